"""Continuous batching for the HF backend: one decode batch that admits requests and retires finished ones
at every step, so that an episode resumes as soon as its observation is appended, while others decode.

Each request has its own KV cache row inside the batch (left-padded to the longest row, holes masked,
positions explicit), held in a slot of buffers with room (`searchrl.rollout.kv_cache`): a decode step writes
its token in place, a request that finishes frees its slot and the next one admitted takes it. A request
whose prompt extends what its key has cached (`HFGenerator`'s multi-turn reuse) prefills only its new tail;
requests admitted together are prefilled in one forward, then written into their slots. Columns that no
request uses any more (left padding left behind by finished long rows) are trimmed. Sampling, stop rules and
log-probs are `HFGenerator`'s: for greedy decoding a stream gives the same tokens as `HFGenerator.generate`
(tests/rollout/test_agent_loop.py).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from searchrl.rollout.generator import Generation, SamplingParams
from searchrl.rollout.kv_cache import slot_cache


@dataclass
class _Request:
    key: Hashable
    prompt: list[int]
    max_new_tokens: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # the policy version of each token
    entropy: list[float] = field(default_factory=list)  # H(π_T) at the first `SamplingParams.entropy_tokens`
    logits_version: int = 0  # the version whose forward produced the row's current logits


class Requests:
    """What every continuous batch shares: a queue of requests, the slots they run in, counters."""

    def __init__(self, gen: Any, model: Any, params: SamplingParams, slots: int = 0) -> None:
        self.gen, self.model, self.params = gen, model, params  # gen: an `HFGenerator`
        self.queue: deque[_Request] = deque()
        self.slots: list[_Request | None] = [None] * slots  # batch row -> request (None: a free slot)
        self.running = 0  # requests in slots
        self.forwards = 0  # model calls (prefills and decode steps), for benchmarks
        # the policy version of the weights (asynchronous rollouts change the weights between steps: a
        # token carries the version of the forward whose logits sampled it)
        self.version = 0

    @property
    def rows(self) -> list[_Request]:
        """The running requests, in slot order."""
        return [r for r in self.slots if r is not None]

    def add(self, key: Hashable, prompt: list[int], max_new_tokens: int | None = None) -> None:
        n = self.params.max_new_tokens if max_new_tokens is None else max_new_tokens
        self.queue.append(_Request(key, list(prompt), max(1, n)))

    def __len__(self) -> int:
        return len(self.queue) + self.running


class HFStream(Requests):
    """Requests in, finished generations out: ``add`` queues a request, ``step`` decodes one token for every
    running request (admitting queued requests first, up to the generator's ``batch_size``) and returns the
    requests that finished at that token.

    Each running request holds a slot of the batch's KV cache (`searchrl.rollout.kv_cache`); a finished one
    frees its slot, which the next admitted request takes. A free slot still runs through the forward (it
    attends to its own newest column only, so its values stay finite) until it is taken, or until at most half
    the slots run and nothing waits, when the running ones are packed to the front."""

    def __init__(self, gen: Any, model: Any, params: SamplingParams) -> None:
        super().__init__(gen, model, params)
        self.cache: Any = None  # DynamicCache of SlotLayers over the slots
        # (slots, L) attention mask, (slots,) last positions, (slots, V) last logits
        self.mask = self.pos = self.logits = None

    def step(self) -> list[tuple[Hashable, Generation]]:
        self._admit()
        if not self.running:
            return []
        from searchrl.rollout.decoding import cache_kwargs, entropy, output_cache, sample

        assert self.logits is not None and self.mask is not None and self.pos is not None
        live = [j for j, r in enumerate(self.slots) if r is not None]
        idx = torch.tensor(live, device=self.logits.device)
        tok_live, tok_logp = sample(self.logits[idx], self.params)
        n_ent = self.params.entropy_tokens  # only the rows still within their first n_ent tokens
        need = [j for j in live if len(self.slots[j].tokens) < n_ent]  # type: ignore[union-attr]
        if need:
            ents = entropy(self.logits[torch.tensor(need, device=idx.device)], self.params).tolist()
            for j, h in zip(need, ents):
                self.slots[j].entropy.append(h)  # type: ignore[union-attr]
        gen, done = self.gen, []
        for j, t, lp in zip(live, tok_live.tolist(), tok_logp.tolist()):
            r = self.slots[j]
            assert r is not None
            r.tokens.append(t)
            r.logprobs.append(lp)
            r.versions.append(r.logits_version)
            if t in gen.eos_ids:
                done.append(
                    (r.key, Generation(r.tokens, r.logprobs, "eos", r.versions, r.entropy if n_ent else None))
                )
            elif t in gen.stop_ids or gen.text_stop(r.tokens):
                if gen.reuse_cache:  # all but the stop token have been fed
                    gen._save(r.key, r.prompt + r.tokens[:-1], self.cache, j, self.mask)
                done.append(
                    (
                        r.key,
                        Generation(r.tokens, r.logprobs, "stop", r.versions, r.entropy if n_ent else None),
                    )
                )
            elif len(r.tokens) >= r.max_new_tokens:
                done.append(
                    (
                        r.key,
                        Generation(r.tokens, r.logprobs, "length", r.versions, r.entropy if n_ent else None),
                    )
                )
            else:
                continue
            self._free(j)
        if not self.running:
            self._drop()
            return done
        tok = torch.full((len(self.slots),), self.gen.pad_id, dtype=torch.long, device=self.logits.device)
        tok[idx] = tok_live
        tok = self._pack(tok)
        # the new column: a free slot attends to it alone
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)
        self.pos = self.pos + 1
        out = self.model(
            input_ids=tok[:, None],
            attention_mask=self.mask,
            position_ids=self.pos[:, None],
            use_cache=True,
            **cache_kwargs(self.model, self.cache),
        )
        self.forwards += 1
        self.cache, self.logits = output_cache(out), out.logits[:, -1, :]
        for r in self.rows:
            r.logits_version = self.version
        return done

    def close(self) -> None:
        """Drop the batch (requests still running or queued are abandoned)."""
        self.queue.clear()
        self._drop()

    # ------------------------------------------------------------------------------------- internals
    def _drop(self) -> None:
        self.slots, self.running = [], 0
        self.cache = self.mask = self.pos = self.logits = None

    def _free(self, j: int) -> None:
        assert self.mask is not None
        self.slots[j] = None
        self.running -= 1
        self.mask[j] = 0

    def _admit(self) -> None:
        """Queued requests into free slots (then new ones), up to ``batch_size`` running: their new tokens
        prefilled in one forward, their cache rows written into the slots, right-aligned with the others."""
        from searchrl.rollout.decoding import output_cache

        room = self.gen.batch_size - self.running
        if not self.queue or room <= 0:
            return
        new = [self.queue.popleft() for _ in range(min(room, len(self.queue)))]
        prompts = [r.prompt for r in new]
        out, mask, pos = self.gen._prefill(
            self.model, prompts, self.gen._take_saved([r.key for r in new], prompts)
        )
        self.forwards += 1
        logits = out.logits[:, -1, :]
        for r in new:
            r.logits_version = self.version
        if self.cache is None:  # nothing running: the new rows are the batch
            self.slots, self.running = list(new), len(new)
            self.cache, self.mask, self.pos, self.logits = (
                slot_cache(output_cache(out), self.gen.batch_size),
                mask,
                pos,
                logits,
            )
            return
        assert self.mask is not None and self.pos is not None and self.logits is not None
        free = [j for j, r in enumerate(self.slots) if r is None][: len(new)]
        slots = free + list(range(len(self.slots), len(self.slots) + len(new) - len(free)))
        opened = len(new) - len(free)
        self.slots += [None] * opened
        for j, r in zip(slots, new):
            self.slots[j] = r
        self.running += len(new)
        width = max(self.mask.shape[1], mask.shape[1])
        sel = torch.tensor(slots, device=self.mask.device)
        for layer, x in zip(self.cache.layers, output_cache(out).layers):
            layer.widen(width)
            layer.place(sel, x.keys, x.values)
        self.mask = _left_pad(self.mask, width, 1)
        if opened:
            self.mask = torch.cat([self.mask, self.mask.new_zeros((opened, width))])
            self.pos = torch.cat([self.pos, self.pos.new_zeros(opened)])
            self.logits = torch.cat([self.logits, self.logits.new_zeros((opened, self.logits.shape[1]))])
        self.mask[sel] = _left_pad(mask, width, 1)
        self.pos[sel] = pos
        self.logits[sel] = logits

    def _pack(self, tok: torch.Tensor) -> torch.Tensor:
        """With nothing queued and at most half the slots running, the running ones packed to the front; then
        the columns left of every running request's first trimmed. Returns ``tok`` for the slots kept."""
        assert self.mask is not None and self.pos is not None and self.logits is not None
        if not self.queue and 2 * self.running <= len(self.slots):
            keep = [j for j, r in enumerate(self.slots) if r is not None]
            sel = torch.tensor(keep, device=self.mask.device)
            self.cache.batch_select_indices(sel)
            self.slots = [self.slots[j] for j in keep]
            self.mask, self.pos, self.logits, tok = self.mask[sel], self.pos[sel], self.logits[sel], tok[sel]
        live = torch.tensor([r is not None for r in self.slots], device=self.mask.device)
        first = int(self.mask[live].any(0).long().argmax())
        if first > 0:
            self.mask = self.mask[:, first:]
            for layer in self.cache.layers:
                layer.trim(first)
        return tok


def _left_pad(x: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    """``x`` padded with zeros on the left of ``dim`` to ``length``."""
    n = length - x.shape[dim]
    if n <= 0:
        return x
    shape = list(x.shape)
    shape[dim] = n
    return torch.cat([x.new_zeros(shape), x], dim=dim)
