"""Batched sampling with a Hugging Face causal LM: KV cache, per-sequence stop at tags / EOS.

Stop tags that are single tokens (our local tokenizers) are matched on ids; multi-token stop strings
(e.g. ``</search>`` in Qwen2.5's tokenizer) are matched on the decoded tail of each sequence. Either way
the returned ids are the sampled ids, never re-tokenized.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.nn.functional as F

from searchrl.rollout.generator import Generation, SamplingParams


class HFGenerator:
    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        stop_strings: Sequence[str] = (),
        batch_size: int = 64,
        model_context: Callable[[], AbstractContextManager[Any]] | None = None,
    ) -> None:
        """``model_context``: entered around generation, yields the module to call (ZeRO-3 gathers there)."""
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size
        self.model_context = model_context or (lambda: nullcontext(self.model))
        self.eos_ids = {i for i in [tokenizer.eos_token_id] if i is not None}
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.stop_ids: set[int] = set()
        self.stop_texts: list[str] = []
        for s in stop_strings:
            ids = tokenizer.encode(s, add_special_tokens=False)
            if len(ids) == 1 and tokenizer.decode(ids) == s:
                self.stop_ids.add(ids[0])
            else:
                self.stop_texts.append(s)
        self._tail = (
            max((len(tokenizer.encode(s, add_special_tokens=False)) for s in self.stop_texts), default=0) + 2
        )

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        out: list[Generation] = []
        with self.model_context() as model:
            was_training = model.training
            model.eval()
            try:
                for i in range(0, len(prompts), self.batch_size):
                    out += self._generate_batch(model, prompts[i : i + self.batch_size], params)
            finally:
                model.train(was_training)
        return out

    def _generate_batch(
        self, model: Any, prompts: list[list[int]], params: SamplingParams
    ) -> list[Generation]:
        device = next(model.parameters()).device
        B, L = len(prompts), max(len(p) for p in prompts)
        ids = torch.full((B, L), self.pad_id, dtype=torch.long, device=device)
        mask = torch.zeros((B, L), dtype=torch.long, device=device)
        for b, p in enumerate(prompts):  # left padding
            ids[b, L - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[b, L - len(p) :] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        tokens: list[list[int]] = [[] for _ in range(B)]
        logps: list[list[float]] = [[] for _ in range(B)]
        finish: list[str | None] = [None] * B
        rows = list(range(B))  # cache row -> prompt index; finished rows are dropped from the KV cache
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
        cache, logits_last, last_pos = out.past_key_values, out.logits[:, -1, :], pos[:, -1]
        for _ in range(params.max_new_tokens):
            logits = logits_last.float()
            if params.temperature > 0:
                logits = logits / params.temperature
            logp = F.log_softmax(logits, -1)
            if params.temperature > 0:
                tok = torch.multinomial(_top_p(logp, params.top_p).exp(), 1).squeeze(-1)
            else:
                tok = logp.argmax(-1)
            tok_logp = logp.gather(-1, tok[:, None]).squeeze(-1).tolist()
            keep = []
            for j, (b, t) in enumerate(zip(rows, tok.tolist())):
                tokens[b].append(t)
                logps[b].append(tok_logp[j])
                if t in self.eos_ids:
                    finish[b] = "eos"
                elif t in self.stop_ids or (self.stop_texts and self._text_stop(tokens[b])):
                    finish[b] = "stop"
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
            out = model(input_ids=tok[:, None], attention_mask=mask, position_ids=last_pos[:, None],
                        past_key_values=cache, use_cache=True)  # fmt: skip
            cache, logits_last = out.past_key_values, out.logits[:, -1, :]
        return [Generation(t, lp, f or "length") for t, lp, f in zip(tokens, logps, finish)]  # type: ignore[arg-type]

    def _text_stop(self, row: list[int]) -> bool:
        tail = self.tokenizer.decode(row[-self._tail :])
        return any(s in tail for s in self.stop_texts)


def _top_p(logp: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus filtering on log-probabilities: keep the smallest set whose mass reaches ``top_p``."""
    if top_p >= 1.0:
        return logp
    sorted_lp, idx = logp.sort(-1, descending=True)
    cum = sorted_lp.exp().cumsum(-1)
    drop = cum - sorted_lp.exp() > top_p  # mass before this token already reaches top_p
    sorted_lp = sorted_lp.masked_fill(drop, float("-inf"))
    return torch.full_like(logp, float("-inf")).scatter(-1, idx, sorted_lp)
