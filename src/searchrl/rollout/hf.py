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
from typing import TYPE_CHECKING, Any

import torch

from searchrl.rollout.decoding import (  # noqa: F401  (_draw, _top_p: imported from here too)
    TextStop,
    _draw,
    _top_p,
    cache_kwargs,
    last_logits_only,
    model_eos_ids,
    output_cache,
    sample,
)
from searchrl.rollout.generator import Generation, SamplingParams, split_stops

if TYPE_CHECKING:
    from searchrl.rollout.continuous import HFStream


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
    ) -> None:
        """``model_context``: entered around generation, yields the module to call (ZeRO-3 gathers there).
        ``reuse_cache``: keep each episode's KV cache between turns (memory: one cache per live episode).
        ``continuous``: the rollout loop advances each episode on its own through `stream` (continuous
        batching); False: one batched `generate` call per turn."""
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size
        self.reuse_cache, self.continuous = reuse_cache, continuous
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

    @contextmanager
    def stream(self, params: SamplingParams, versions: bool = False) -> Iterator[HFStream]:
        """A continuous batch (`HFStream`) on the model, for the per-episode agent loop. The model context
        (ZeRO-3's gather) is entered once for the whole stream. Its tokens always carry the stream's
        ``version`` (``versions`` is for the protocol: recording them costs nothing here)."""
        from searchrl.rollout.continuous import HFStream

        with self.model_context() as model:
            self.eos_ids |= model_eos_ids(model)
            was_training = model.training
            model.eval()
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
        for _ in range(params.max_new_tokens):
            tok, tok_logp = sample(logits_last, params)
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
        return [Generation(t, lp, f or "length") for t, lp, f in zip(tokens, logps, finish)]  # type: ignore[arg-type]
