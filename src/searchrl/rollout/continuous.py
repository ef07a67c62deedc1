"""Continuous batching for the HF backend: one decode batch that admits requests and retires finished ones
at every step, so that an episode resumes as soon as its observation is appended, while others decode.

Each row has its own KV cache inside the batch (left-padded to the longest row, holes masked, positions
explicit). A request whose prompt extends what its key has cached (`HFGenerator`'s multi-turn reuse)
prefills only its new tail; requests admitted together are prefilled in one forward, then concatenated
into the running batch. Columns that no row uses any more (left padding left behind by retired long rows)
are trimmed. Sampling, stop rules and log-probs are `HFGenerator`'s: for greedy decoding a stream gives the
same tokens as `HFGenerator.generate` (tests/rollout/test_agent_loop.py).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from searchrl.rollout.generator import Generation, SamplingParams


@dataclass
class _Request:
    key: Hashable
    prompt: list[int]
    max_new_tokens: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # the policy version of each token
    logits_version: int = 0  # the version whose forward produced the row's current logits


class HFStream:
    """Requests in, finished generations out: ``add`` queues a request, ``step`` decodes one token for every
    running row (admitting queued requests first, up to the generator's ``batch_size`` rows) and returns the
    requests that finished at that token."""

    def __init__(self, gen: Any, model: Any, params: SamplingParams) -> None:  # gen: an `HFGenerator`
        self.gen, self.model, self.params = gen, model, params
        self.queue: deque[_Request] = deque()
        self.rows: list[_Request] = []  # batch row -> request
        self.cache: Any = None  # DynamicCache over the rows
        self.mask = self.pos = self.logits = None  # (B, L) attention mask, (B,) last position, (B, V)
        self.forwards = 0  # model calls (prefills and decode steps), for benchmarks
        # the policy version of the weights (asynchronous rollouts change the weights between steps: a
        # token carries the version of the forward whose logits sampled it)
        self.version = 0

    def add(self, key: Hashable, prompt: list[int], max_new_tokens: int | None = None) -> None:
        n = self.params.max_new_tokens if max_new_tokens is None else max_new_tokens
        self.queue.append(_Request(key, list(prompt), max(1, n)))

    def __len__(self) -> int:
        return len(self.queue) + len(self.rows)

    def step(self) -> list[tuple[Hashable, Generation]]:
        self._admit()
        if not self.rows:
            return []
        from searchrl.rollout.decoding import cache_kwargs, output_cache, sample

        assert self.logits is not None and self.mask is not None and self.pos is not None
        tok, tok_logp = sample(self.logits, self.params)
        gen, done, keep = self.gen, [], []
        for j, (r, t, lp) in enumerate(zip(self.rows, tok.tolist(), tok_logp.tolist())):
            r.tokens.append(t)
            r.logprobs.append(lp)
            r.versions.append(r.logits_version)
            if t in gen.eos_ids:
                done.append((r.key, Generation(r.tokens, r.logprobs, "eos", r.versions)))
            elif t in gen.stop_ids or gen.text_stop(r.tokens):
                if gen.reuse_cache:  # all but the stop token have been fed
                    gen._save(r.key, r.prompt + r.tokens[:-1], self.cache, j, self.mask)
                done.append((r.key, Generation(r.tokens, r.logprobs, "stop", r.versions)))
            elif len(r.tokens) >= r.max_new_tokens:
                done.append((r.key, Generation(r.tokens, r.logprobs, "length", r.versions)))
            else:
                keep.append(j)
        if len(keep) < len(self.rows):
            self._select(keep)
            tok = tok[keep]
        if self.rows:
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
        self.rows, self.cache, self.mask, self.pos, self.logits = [], None, None, None, None

    # ------------------------------------------------------------------------------------- internals
    def _admit(self) -> None:
        from searchrl.rollout.decoding import output_cache

        room = self.gen.batch_size - len(self.rows)
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
        if not self.rows:
            self.rows, self.cache, self.mask, self.pos, self.logits = (
                new,
                output_cache(out),
                mask,
                pos,
                logits,
            )
            return
        assert self.mask is not None and self.pos is not None and self.logits is not None
        from transformers import DynamicCache

        L = max(self.mask.shape[1], mask.shape[1])
        layers = [
            tuple(
                torch.cat([_left_pad(a, L, 2), _left_pad(b, L, 2)])
                for a, b in ((x.keys, y.keys), (x.values, y.values))
            )
            for x, y in zip(self.cache.layers, output_cache(out).layers)
        ]
        self.cache = DynamicCache(ddp_cache_data=layers)
        self.mask = torch.cat([_left_pad(self.mask, L, 1), _left_pad(mask, L, 1)])
        self.pos = torch.cat([self.pos, pos])
        self.logits = torch.cat([self.logits, logits])
        self.rows = self.rows + new

    def _select(self, keep: list[int]) -> None:
        """Keep these rows; trim the columns left of every remaining row's first unmasked position."""
        assert self.mask is not None and self.pos is not None and self.logits is not None
        self.rows = [self.rows[j] for j in keep]
        if not keep:
            self.cache = self.mask = self.pos = self.logits = None
            return
        sel = torch.tensor(keep, device=self.mask.device)
        self.cache.batch_select_indices(sel)
        self.mask, self.pos, self.logits = self.mask[sel], self.pos[sel], self.logits[sel]
        first = int(self.mask.any(0).long().argmax())
        if first > 0:
            self.mask = self.mask[:, first:]
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]


def _left_pad(x: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    """``x`` padded with zeros on the left of ``dim`` to ``length``."""
    n = length - x.shape[dim]
    if n <= 0:
        return x
    shape = list(x.shape)
    shape[dim] = n
    return torch.cat([x.new_zeros(shape), x], dim=dim)
