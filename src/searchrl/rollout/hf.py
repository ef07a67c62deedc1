"""Batched sampling with a Hugging Face causal LM: KV cache, per-sequence stop at tags / EOS.

Stop tags that are single tokens (our local tokenizers) are matched on ids; multi-token stop strings
(e.g. ``</search>`` in Qwen2.5's tokenizer) are matched on the decoded tail of each sequence. Either way
the returned ids are the sampled ids, never re-tokenized.

Multi-turn reuse: with ``cache_keys``, a row that stops at a tag keeps its keys/values (compacted, padding
removed) under its key. When the next prompt under that key starts with exactly the cached tokens, only
the new tail (the stop token, which was sampled but never fed, and the observation) is prefilled; the
rows' caches are left-padded into one batch and the holes are masked. Without this, every turn re-reads
the whole context, which dominated rollout time (benchmarks/rollout_overhead.py).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from searchrl.rollout.decoding import (  # noqa: F401  (_draw, _top_p: imported from here too)
    TextStop,
    _draw,
    _top_p,
    cache_kwargs,
    entropy,
    last_logits_only,
    model_eos_ids,
    output_cache,
    sample,
)
from searchrl.rollout.generator import Generation, SamplingParams, split_stops

SHARED_PREFIX_MIN = 32  # tokens a prefix of distinct prompts must have to be computed once (prefix sharing)


def _common_prefix(rows: list[list[int]]) -> int:
    """The length of the longest prefix every row shares, one token short of the shortest row (each row keeps
    a token of its own to compute: its last logits)."""
    n = min(len(r) for r in rows) - 1
    first = rows[0]
    for r in rows[1:]:
        i = 0
        while i < n and r[i] == first[i]:
            i += 1
        n = i
    return max(n, 0)


@dataclass
class _Saved:
    tokens: list[int]  # the ids whose keys/values are stored, in order
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values of shape (heads, len(tokens), dim)


class HFGenerator:
    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        stop_strings: Sequence[str] = (),
        batch_size: int = 64,
        model_context: Callable[[], AbstractContextManager[Any]] | None = None,
        reuse_cache: bool = True,
        continuous: bool = True,
        compile: bool = False,
        prefix_sharing: bool = False,
        compile_runner: str | None = None,
        max_total_tokens: int | None = None,
    ) -> None:
        """``model_context``: entered around generation, yields the module to call (ZeRO-3 gathers there).
        ``reuse_cache``: keep each episode's KV cache between turns (memory: one cache per live episode).
        ``continuous``: the rollout loop advances each episode on its own through `stream` (continuous
        batching); False: one batched `generate` call per turn.
        ``compile``: decode through a captured step (`searchrl.rollout.graph_decode`: CUDA graphs on a GPU,
        ``torch.compile`` on a CPU; ``compile_runner`` picks one: graph, compile, eager), in both loops.
        ``prefix_sharing``: prompts that are equal are prefilled once, and a prefix that the new prompts of one
        prefill share (a system prompt, tool schemas) once (`_prefill`). ``max_total_tokens``: an episode's
        length bound (``rollout.max_total_tokens``), with ``compile`` the static cache's columns from the start."""
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size
        self.reuse_cache, self.continuous = reuse_cache, continuous
        self.compile, self.prefix_sharing = compile, prefix_sharing
        self.shared_tokens = 0  # prompt tokens not prefilled thanks to prefix sharing (a counter)
        self._graphs: Any = None
        if compile:
            from searchrl.rollout.graph_decode import DecodeGraphs

            self._graphs = DecodeGraphs(compile_runner, max_total_tokens)
        self._saved: dict[Hashable, _Saved] = {}
        self.reused_tokens = 0  # prompt tokens served from a kept cache instead of prefilled (a counter)
        self.model_context = model_context or (lambda: nullcontext(self.model))
        self.eos_ids = {i for i in [tokenizer.eos_token_id] if i is not None}  # and the model's, see _eos
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.stop_ids, self.stop_texts = split_stops(tokenizer, stop_strings)
        self.text_stop = TextStop(tokenizer, self.stop_texts)

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        cache_keys: Sequence[Hashable] | None = None,
    ) -> list[Generation]:
        if cache_keys is not None and len(cache_keys) != len(prompts):
            raise ValueError(f"{len(cache_keys)} cache keys for {len(prompts)} prompts")
        if self.compile:  # the captured step serves the turn loop too: every prompt through one stream
            return self._generate_streamed(prompts, params, cache_keys)
        out: list[Generation] = []
        with self.model_context() as model:
            self.eos_ids |= model_eos_ids(model)
            was_training = model.training
            model.eval()
            try:
                for i in range(0, len(prompts), self.batch_size):
                    keys = None if cache_keys is None else list(cache_keys[i : i + self.batch_size])
                    out += self._generate_batch(model, prompts[i : i + self.batch_size], params, keys)
            finally:
                model.train(was_training)
        return out

    def _generate_streamed(
        self, prompts: list[list[int]], params: SamplingParams, cache_keys: Sequence[Hashable] | None
    ) -> list[Generation]:
        """`generate` through a stream: each prompt a request under its cache key (or its index)."""
        keys: list[Hashable] = list(cache_keys) if cache_keys is not None else list(range(len(prompts)))
        if len(set(keys)) != len(keys):
            raise ValueError("cache keys must be distinct")
        results: dict[Hashable, Generation] = {}
        with self.stream(params) as s:
            for k, p in zip(keys, prompts):
                s.add(k, p)
            while len(s):
                results.update(s.step())
        if cache_keys is None:
            self.release(keys)
        return [results[k] for k in keys]

    @contextmanager
    def stream(self, params: SamplingParams, versions: bool = False) -> Iterator[Any]:
        """A continuous batch (`HFStream`, or with ``compile`` a `GraphStream`) on the model, for the
        per-episode agent loop. The model context (ZeRO-3's gather) is entered once for the whole stream. Its
        tokens always carry the stream's ``version`` (``versions`` is for the protocol: recording them costs
        nothing here)."""
        from searchrl.rollout.continuous import HFStream

        with self.model_context() as model:
            self.eos_ids |= model_eos_ids(model)
            was_training = model.training
            model.eval()
            if self._graphs is not None:
                from searchrl.rollout.graph_decode import GraphStream

                s: Any = GraphStream(self, model, params, self._graphs)
            else:
                s = HFStream(self, model, params)
            try:
                with torch.no_grad():
                    yield s
            finally:
                s.close()
                model.train(was_training)

    def release(self, cache_keys: Sequence[Hashable] | None = None) -> None:
        if cache_keys is None:
            self._saved.clear()
        for k in cache_keys or ():
            self._saved.pop(k, None)

    def _take_saved(self, keys: list[Hashable] | None, prompts: list[list[int]]) -> list[_Saved | None]:
        """Each row's cached prefix, if its prompt extends it (anything else is dropped: stale)."""
        if keys is None or not self.reuse_cache:
            return [None] * len(prompts)
        out: list[_Saved | None] = []
        for k, p in zip(keys, prompts):
            s = self._saved.pop(k, None)
            ok = s is not None and len(s.tokens) < len(p) and p[: len(s.tokens)] == s.tokens
            out.append(s if ok else None)
            self.reused_tokens += len(s.tokens) if ok and s is not None else 0
        return out

    def _prefill(self, model: Any, prompts: list[list[int]], saved: list[_Saved | None]) -> tuple[Any, ...]:
        """Forward over what is not cached yet. Returns (output, attention mask, last positions); the output's
        ``logits`` (rows, 1 or length, vocabulary) and cache are per prompt. With ``prefix_sharing``, equal
        new prompts (the episodes of one GRPO group) are computed once and their rows copied, and the prefix
        that at least two distinct new prompts share, if it has ``SHARED_PREFIX_MIN`` tokens or more (a system
        prompt, tool schemas), is computed once and then read by each of them as a cached prefix."""
        if not self.prefix_sharing:
            return self._prefill_rows(model, prompts, saved)
        first: dict[tuple[int, ...], int] = {}
        keep: list[int] = []  # the rows computed
        inv: list[int] = []  # each prompt's row among them
        for b, (p, s) in enumerate(zip(prompts, saved)):
            key = tuple(p) if s is None else None
            if key is not None and key in first:
                inv.append(first[key])
                continue
            if key is not None:
                first[key] = len(keep)
            inv.append(len(keep))
            keep.append(b)
        rows = [prompts[b] for b in keep]
        row_saved = [saved[b] for b in keep]
        if len(rows) > 1 and all(s is None for s in row_saved):
            n = _common_prefix(rows)
            if n >= SHARED_PREFIX_MIN:
                prefix = self._prefix_cache(model, rows[0][:n])
                row_saved = [prefix] * len(rows)
                self.shared_tokens += n * (len(rows) - 1)
        self.shared_tokens += sum(len(prompts[b]) for b in range(len(prompts))) - sum(len(r) for r in rows)
        out, mask, pos = self._prefill_rows(model, rows, row_saved)
        if len(keep) == len(prompts):
            return out, mask, pos
        idx = torch.tensor(inv, device=mask.device)
        cache = output_cache(out)
        cache.batch_select_indices(idx)
        return SimpleNamespace(logits=out.logits[idx], cache=cache), mask[idx], pos[idx]

    def _prefix_cache(self, model: Any, prefix: list[int]) -> _Saved:
        """A prefix's keys and values, computed in one row, as a kept cache (`_Saved`) for rows to extend."""
        device = next(model.parameters()).device
        ids = torch.tensor([prefix], dtype=torch.long, device=device)
        out = model(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            position_ids=torch.arange(len(prefix), device=device)[None],
            use_cache=True,
            **last_logits_only(model),
        )
        return _Saved(list(prefix), [(x.keys[0], x.values[0]) for x in output_cache(out).layers])

    def _prefill_rows(
        self, model: Any, prompts: list[list[int]], saved: list[_Saved | None]
    ) -> tuple[Any, ...]:
        """One forward over what is not cached yet. Returns (output, attention mask, last positions)."""
        device = next(model.parameters()).device
        n = [len(s.tokens) if s is not None else 0 for s in saved]
        tails = [p[k:] for p, k in zip(prompts, n)]
        B, Lc, S = len(prompts), max(n), max(len(t) for t in tails)
        ids = torch.full((B, S), self.pad_id, dtype=torch.long, device=device)
        mask = torch.zeros((B, Lc + S), dtype=torch.long, device=device)
        pos = torch.zeros((B, S), dtype=torch.long, device=device)
        for b, (t, k) in enumerate(zip(tails, n)):  # left padding, of the cached part and of the tail
            ids[b, S - len(t) :] = torch.tensor(t, dtype=torch.long)
            mask[b, Lc - k : Lc] = 1
            mask[b, Lc + S - len(t) :] = 1
            pos[b, S - len(t) :] = torch.arange(k, k + len(t))
        last = last_logits_only(model)
        if Lc == 0:
            return (
                model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **last),
                mask,
                pos[:, -1],
            )
        from transformers import DynamicCache

        layers = []
        for layer in range(len(next(s for s in saved if s is not None).kv)):
            like = next(s for s in saved if s is not None).kv[layer][0]
            K = like.new_zeros((B, like.shape[0], Lc, like.shape[2]))
            V = torch.zeros_like(K)
            for b, s in enumerate(saved):
                if s is not None:
                    K[b, :, Lc - n[b] :] = s.kv[layer][0]
                    V[b, :, Lc - n[b] :] = s.kv[layer][1]
            layers.append((K, V))
        out = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            use_cache=True,
            **cache_kwargs(model, DynamicCache(ddp_cache_data=layers)),
            **last,
        )
        return out, mask, pos[:, -1]

    def _save(self, key: Hashable, tokens: list[int], cache: Any, row: int, mask: torch.Tensor) -> None:
        """Keep one row's keys/values (its unmasked positions) for the episode's next turn."""
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        from searchrl.rollout.kv_cache import SlotLayer

        layers: list[Any] = list(cache.layers) if isinstance(cache, DynamicCache) else []
        if not layers or not all(type(x) in (DynamicLayer, SlotLayer) for x in layers):
            return  # sliding windows, quantized or custom caches: no reuse, the next turn prefills
        keep = mask[row].bool()
        if int(keep.sum()) != len(tokens):
            return
        self._saved[key] = _Saved(tokens, [(x.keys[row][:, keep], x.values[row][:, keep]) for x in layers])

    def _save_layers(
        self, key: Hashable, tokens: list[int], layers: list[tuple[torch.Tensor, torch.Tensor]], n: int
    ) -> None:
        """Keep a slot's keys and values (per layer: (heads, columns, dim), its tokens at columns [0, n))."""
        if n == len(tokens):
            self._saved[key] = _Saved(tokens, [(k[:, :n].clone(), v[:, :n].clone()) for k, v in layers])

    def _generate_batch(
        self, model: Any, prompts: list[list[int]], params: SamplingParams, keys: list[Hashable] | None
    ) -> list[Generation]:
        device = next(model.parameters()).device
        B = len(prompts)
        tokens: list[list[int]] = [[] for _ in range(B)]
        logps: list[list[float]] = [[] for _ in range(B)]
        finish: list[str | None] = [None] * B
        rows = list(range(B))  # cache row -> prompt index; finished rows are dropped from the KV cache
        out, mask, last_pos = self._prefill(model, prompts, self._take_saved(keys, prompts))
        cache, logits_last = output_cache(out), out.logits[:, -1, :]
        ents: list[list[float]] | None = [[] for _ in range(B)] if params.entropy_tokens > 0 else None
        for n in range(params.max_new_tokens):
            tok, tok_logp = sample(logits_last, params)
            if ents is not None and n < params.entropy_tokens:
                for b, h in zip(rows, entropy(logits_last, params).tolist()):
                    ents[b].append(h)
            keep = []
            for j, (b, t, lp) in enumerate(zip(rows, tok.tolist(), tok_logp.tolist())):
                tokens[b].append(t)
                logps[b].append(lp)
                if t in self.eos_ids:
                    finish[b] = "eos"
                elif t in self.stop_ids or self.text_stop(tokens[b]):
                    finish[b] = "stop"
                    if keys is not None and self.reuse_cache:  # all but the stop token have been fed
                        self._save(keys[b], prompts[b] + tokens[b][:-1], cache, j, mask)
                else:
                    keep.append(j)
            if not keep:
                break
            if len(keep) < len(rows):  # stragglers should not pay for finished rows
                sel = torch.tensor(keep, device=device)
                cache.batch_select_indices(sel)
                mask, last_pos, tok = mask[sel], last_pos[sel], tok[sel]
                rows = [rows[j] for j in keep]
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            last_pos = last_pos + 1
            out = model(
                input_ids=tok[:, None],
                attention_mask=mask,
                position_ids=last_pos[:, None],
                use_cache=True,
                **cache_kwargs(model, cache),
            )
            cache, logits_last = output_cache(out), out.logits[:, -1, :]
        return [
            Generation(t, lp, f or "length", entropy=None if ents is None else ents[b])  # type: ignore[arg-type]
            for b, (t, lp, f) in enumerate(zip(tokens, logps, finish))
        ]
