"""Decoding primitives shared by the HF generator (`searchrl.rollout.hf`) and its continuous batch
(`searchrl.rollout.continuous`): sampling a token with its log-probability, stop tags that are text, and the
KV-cache arguments a model's forward takes."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from searchrl.models.prefix_cache import cache_arg, forward_params
from searchrl.models.prefix_cache import output_cache as output_cache  # the generators read it from here
from searchrl.rollout.generator import SamplingParams


def sample(logits_last: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """The next token of every row from its last logits (greedy when temperature is 0, else from
    softmax(logits / T) with nucleus ``top_p``) and its log-probability under that distribution."""
    logits = logits_last.float()
    if params.temperature > 0:
        logits = logits / params.temperature
    logp = F.log_softmax(logits, -1)
    tok = _draw(_top_p(logp, params.top_p)) if params.temperature > 0 else logp.argmax(-1)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


def entropy(logits_last: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """H(π_T) = −Σ_v π_T(v) log π_T(v) (nats) of every row's next-token distribution, π_T = softmax(logits / T)
    as `sample` draws from it (T = 1 when greedy; before the nucleus cut). (B,)"""
    logits = logits_last.float()
    if params.temperature > 0:
        logits = logits / params.temperature
    logp = F.log_softmax(logits, -1)
    return -(logp.exp() * logp.clamp_min(torch.finfo(logp.dtype).min)).sum(-1)  # 0·log 0 = 0


def _draw(logp: torch.Tensor) -> torch.Tensor:
    """One token per row from these log-probabilities, by inverting each row's cumulative distribution at
    one uniform draw: the first token whose cumulative mass exceeds it (tokens of zero mass never qualify).
    The same distribution as ``torch.multinomial``, which on the CPU took 10 ms for 64 rows of 3,072 tokens
    against 0.6 ms for this (benchmarks/rollout_overhead.py profile)."""
    cum = logp.exp().cumsum(-1)  # (B, V)
    u = torch.rand(cum.shape[0], 1, dtype=cum.dtype, device=cum.device) * cum[:, -1:]
    return torch.searchsorted(cum, u, right=True).squeeze(-1).clamp_max(cum.shape[-1] - 1)


class TextStop:
    """Whether a row's generated ids now contain a stop tag that is text in this vocabulary (Qwen2.5:
    ``</search>`` is ``</`` ``search`` ``>``, or ``?</`` … ``>\n\n`` glued to its neighbours, or any
    other split the model happens to sample). Checked after every token, so it fires at the token that
    completes the first tag, even when that token carries more characters. A tag of n characters spans at
    most n tokens (each token adds at least one of its characters), so the last n+1 tokens are decoded.

    The token that completes a tag carries the tag's last character. Where every tag ends in an ASCII
    character other than whitespace (one byte, so no token can carry part of it, and decoding neither adds
    nor drops it), only rows whose newest token's text holds such a character are decoded: in Qwen2.5's
    vocabulary 675 of 151,665 tokens hold ``>``. That skips the decode for almost every row and step
    (`benchmarks/stop_check.py`). Which tokens qualify is read once per tokenizer, from each token's text
    (`_ending_tokens`); ids beyond the tokenizer's (padded output rows) are always decoded."""

    def __init__(self, tokenizer: Any, stop_texts: Sequence[str]) -> None:
        self.tokenizer, self.stop_texts = tokenizer, list(stop_texts)
        self.window = max((len(s) for s in self.stop_texts), default=0) + 1
        ends = {s[-1] for s in self.stop_texts if s}
        self.ends = "".join(sorted(ends)) if all(c.isascii() and not c.isspace() for c in ends) else ""
        self._enders: tuple[int, frozenset[int]] | None = None  # (ids read, ids whose text can end a tag)

    def __call__(self, row: Sequence[int]) -> bool:
        if not self.stop_texts:
            return False
        if self.ends and row:
            if self._enders is None:
                self._enders = _ending_tokens(self.tokenizer, self.ends)
            read, enders = self._enders
            if row[-1] < read and row[-1] not in enders:
                return False
        tail = self.tokenizer.decode(list(row[-self.window :]))
        return any(s in tail for s in self.stop_texts)


_ENDERS: weakref.WeakKeyDictionary[Any, dict[str, tuple[int, frozenset[int]]]] = weakref.WeakKeyDictionary()


def _ending_tokens(tokenizer: Any, chars: str) -> tuple[int, frozenset[int]]:
    """(the number of ids read, the ids whose text holds one of ``chars``), once per tokenizer: each id's
    text as ``tokenizer.decode`` gives it, in one batch (Rust's, 0.2 s for Qwen2.5's vocabulary)."""
    try:
        per_tok = _ENDERS.setdefault(tokenizer, {})
    except TypeError:  # a tokenizer that cannot be weakly referenced: read for this check alone
        per_tok = {}
    if chars not in per_tok:
        ids = [[i] for i in range(len(tokenizer))]
        fast: Any = getattr(tokenizer, "_tokenizer", None)
        texts = (
            fast.decode_batch(ids, skip_special_tokens=False)
            if hasattr(fast, "decode_batch")
            else tokenizer.batch_decode(ids)
        )
        per_tok[chars] = (len(ids), frozenset(i for i, t in enumerate(texts) if any(c in t for c in chars)))
    return per_tok[chars]


def last_logits_only(model: Any) -> dict[str, int]:
    """``logits_to_keep=1`` where the model's forward takes it (transformers' causal LMs, under peft too): a
    prefill samples from its last position only, so the (rows, length, vocabulary) logits are not built."""
    return {"logits_to_keep": 1} if "logits_to_keep" in forward_params(_base_type(model)) else {}


def cache_kwargs(model: Any, cache: Any) -> dict[str, Any]:
    """``cache`` under the name the model's forward takes: ``cache`` from transformers 5.24 on (which warns
    that the old name goes in 5.40), ``past_key_values`` before it and in custom models."""
    return {cache_arg(_base_type(model)): cache}


def _base_type(model: Any) -> type:
    """The class of the model under its wrappers, whose forward's parameters decide what may be passed."""
    return type(base_model(model))


def base_model(model: Any) -> Any:
    """The model under its wrappers: peft, the PPO policy-with-value, DDP / DeepSpeed engines."""
    for _ in range(8):
        if callable(getattr(model, "get_base_model", None)):
            model = model.get_base_model()
        elif isinstance(getattr(model, "lm", None), torch.nn.Module):
            model = model.lm
        elif isinstance(getattr(model, "module", None), torch.nn.Module):
            model = model.module
        else:
            break
    return model


def model_eos_ids(model: Any) -> set[int]:
    """The end-of-sequence ids a model's generation config names (Qwen2.5: ``<|im_end|>`` and
    ``<|endoftext|>``), besides the tokenizer's EOS."""
    cfg = getattr(model, "generation_config", None)
    eos = getattr(cfg, "eos_token_id", None) if cfg is not None else None
    return set(eos) if isinstance(eos, list | tuple) else ({eos} if isinstance(eos, int) else set())


def _top_p(logp: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus filtering on log-probabilities: keep the smallest set whose mass reaches ``top_p``."""
    if top_p >= 1.0:
        return logp
    sorted_lp, idx = logp.sort(-1, descending=True)
    cum = sorted_lp.exp().cumsum(-1)
    drop = cum - sorted_lp.exp() > top_p  # mass before this token already reaches top_p
    sorted_lp = sorted_lp.masked_fill(drop, float("-inf"))
    return torch.full_like(logp, float("-inf")).scatter(-1, idx, sorted_lp)
