"""Log-probabilities of chosen tokens without a (batch, tokens, vocabulary) logits tensor.

At Qwen2.5's 151,936 rows, float32 logits of one 4,096-token sequence take 2.5 GB. `add_lean_head` patches
a Hugging Face causal LM so that ``model(..., lean_mask=mask)`` runs the backbone, then applies the output
layer only at the positions the mask selects (the action tokens: position t is predicted from the hidden
state at t - 1), in tiles, with TRL's chunked log-prob autograd function (`trl.kernels`): forward folds each
tile into an online log-sum-exp, backward recomputes it, so no tile outlives its use. Where the selected
positions' logits fit in one tile (``DIRECT_LIMIT``: a small vocabulary, the local models'), the layer runs
whole and torch's fused cross-entropy gives the log-probs (`direct_logprobs`), faster on a CPU. Under ZeRO-3 the
output layer's weight is gathered for both (TRL's `maybe_gather_lm_head_ctx`); the projection runs inside
the model's own forward, so DDP and DeepSpeed see it as part of their forward. Without ``lean_mask`` the
model behaves as before (generation is unchanged). ``lean_prefix=P``: the first P tokens, the same in every
row, run once and their keys and values reused by the rows (`models.prefix_cache.prefix_hidden`; not while
activation checkpointing recomputes the layers, which drops a cache: then the rows run whole).

The patched forward returns `LeanOutput`: per-token log-probs and entropy (B, T), 0 off the mask, aligned like
`functional.token_logprobs`, and the final hidden states (for a value head).

``lean_negatives=K`` (supervised warm starts only) replaces the exact softmax by a sampled one (Jean et al.,
2015): the normaliser is summed over the batch's own tokens exactly and estimated from K rows drawn
uniformly from the rest of the vocabulary, each weighted by (rows not in the batch) / K. Training a model
from scratch with a 151,936-row vocabulary costs ~5 ms per token on a 2-core CPU with the exact softmax;
this makes the cost that of a ~K-row vocabulary. The model keeps every row, and everything that samples from
it or scores it (generation, RL, evaluation) uses the exact softmax.
"""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers.utils import ModelOutput

from searchrl.models.prefix_cache import checkpointing_now, prefix_hidden

VOCAB_TILE = 8192  # output-layer rows per tile: 4,096 positions x 8,192 rows of float32 = 128 MB at most
# positions x vocabulary rows up to which the output layer runs whole (`direct_logprobs`): 32M float32 logits,
# 128 MB, the size of one tile. A small vocabulary (the local models' 3,072-4,096 rows) then costs one GEMM and
# torch's fused cross-entropy: the layer alone 2.6-3.5x faster than the tiled kernel's torch fallback on a 2-core
# CPU (2,048-6,600 positions x 4,096 rows x 128 wide, forward and backward), a whole warm-start step 8-11%
# (benchmarks/results/tools_protocol.json, profile_2026_11_29)
DIRECT_LIMIT = 1 << 25


@dataclass
class LeanOutput(ModelOutput):
    logprobs: torch.Tensor | None = None  # (B, T) log p(input_ids[t] | input_ids[<t]) where lean_mask is 1
    entropy: torch.Tensor | None = None  # (B, T) entropy of that next-token distribution (no gradient)
    hidden_states: tuple[torch.Tensor, ...] | None = None  # (final hidden states (B, T, H),)


def add_lean_head(model: Any) -> Any:
    """Patch ``model`` (a Hugging Face causal LM, before any peft wrapping) in place; returns it."""
    if getattr(model, "_searchrl_lean_head", False):
        return model
    original = model.forward
    # called on ``self``, not on ``model``: a copy of the model (copy.deepcopy, the asynchronous worker's copy)
    # keeps this function, and must run its own weights, not those of the model it was copied from
    unbound = getattr(original, "__func__", None) if getattr(original, "__self__", None) is model else None
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    softcap = getattr(config, "final_logit_softcapping", None)
    scale = getattr(config, "logit_scale", None) or 1.0

    @functools.wraps(type(model).forward)
    def forward(
        self: Any,
        *args: Any,
        lean_mask: torch.Tensor | None = None,
        lean_temperature: float = 1.0,
        lean_entropy: bool = False,
        lean_negatives: int = 0,
        lean_prefix: int = 0,
        **kwargs: Any,
    ) -> Any:
        if lean_mask is None:
            return unbound(self, *args, **kwargs) if unbound is not None else original(*args, **kwargs)
        from trl.kernels import ChunkedLogProbFunction
        from trl.trainer.utils import maybe_gather_lm_head_ctx

        input_ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        hidden = final_hidden(self, args, kwargs, lean_prefix)  # (B, T, H)
        head = self.get_output_embeddings()
        bias = getattr(head, "bias", None)
        pos = lean_mask[:, 1:].bool()
        if lean_negatives:
            logprobs = sampled_logprobs(
                hidden[:, :-1][pos], head, input_ids, input_ids[:, 1:][pos], lean_negatives
            )
            zeros = torch.zeros(input_ids.shape, dtype=torch.float32, device=hidden.device)
            return LeanOutput(
                logprobs=zeros.masked_scatter(F.pad(pos, (1, 0)), logprobs), hidden_states=(hidden,)
            )
        if (
            int(pos.sum()) * head.weight.shape[0] <= DIRECT_LIMIT
            and getattr(head.weight, "ds_id", None) is None
        ):
            logprobs, entropy = direct_logprobs(
                hidden[:, :-1][pos],
                head,
                input_ids[:, 1:][pos],
                lean_temperature,
                softcap,
                scale,
                lean_entropy,
            )
        else:
            with maybe_gather_lm_head_ctx(*([head.weight] if bias is None else [head.weight, bias])):
                logprobs, entropy, *_ = ChunkedLogProbFunction.apply(
                    hidden[:, :-1][pos],
                    head.weight,
                    bias,
                    input_ids[:, 1:][pos],
                    float(lean_temperature),
                    VOCAB_TILE,
                    softcap,
                    float(scale),
                    ("entropy",) if lean_entropy else (),
                )
        where = F.pad(pos, (1, 0))
        zeros = torch.zeros(input_ids.shape, dtype=torch.float32, device=hidden.device)
        return LeanOutput(
            logprobs=zeros.masked_scatter(where, logprobs.float()),
            entropy=None if entropy is None else zeros.masked_scatter(where, entropy.detach().float()),
            hidden_states=(hidden,),
        )

    model.forward = types.MethodType(forward, model)
    model._searchrl_lean_head = True
    return model


def final_hidden(model: Any, args: tuple, kwargs: dict[str, Any], prefix: int) -> torch.Tensor:
    """The backbone's final hidden states (B, T, H) for the patched forward's arguments, without a cache; with
    ``prefix``, the first ``prefix`` tokens (the same in every row) run once (`models.prefix_cache.prefix_hidden`),
    unless activation checkpointing would recompute the layers now (that drops a cache)."""
    for k in ("output_hidden_states", "logits_to_keep", "labels"):
        kwargs.pop(k, None)
    kwargs["use_cache"] = False
    if prefix > 0 and not args and not checkpointing_now(model):
        return prefix_hidden(model.base_model, prefix, **kwargs)
    return model.base_model(*args, **kwargs).last_hidden_state


def direct_logprobs(
    hidden: torch.Tensor,
    head: Any,
    targets: torch.Tensor,
    temperature: float,
    softcap: float | None,
    scale: float,
    entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (N,) of ``targets`` and their distributions' entropies (no gradient) from hidden states
    (N, H) through the output layer whole: the logits z = (softcap·tanh(scale·h·Wᵀ / softcap) or scale·h·Wᵀ) / T,
    as `trl.kernels.ChunkedLogProbFunction` computes them tile by tile."""
    y = head(hidden).float() * scale
    z = (softcap * torch.tanh(y / softcap) if softcap else y) / temperature
    logprobs = -F.cross_entropy(z, targets, reduction="none")
    ent = None
    if entropy:
        with torch.no_grad():
            logp = torch.log_softmax(z, -1)
            ent = -(logp.exp() * logp).sum(-1)
    return logprobs, ent


def sampled_logprobs(
    hidden: torch.Tensor, head: Any, batch_ids: torch.Tensor, targets: torch.Tensor, negatives: int
) -> torch.Tensor:
    """log p(target) under a sampled softmax: the candidates are every token of ``batch_ids`` (so every target)
    plus ``negatives`` rows drawn uniformly from the others, whose exp-logits are weighted by
    (others / negatives) so that the sum estimates the exact normaliser. ``hidden`` (N, H), ``targets`` (N,)."""
    weight = head.weight
    if getattr(weight, "ds_tensor", None) is not None:
        raise ValueError(
            "a sampled softmax (sft sampled_softmax) is not supported under DeepSpeed ZeRO-3; use one "
            "process or DDP for the warm start"
        )
    vocab = weight.shape[0]
    own = torch.unique(batch_ids)
    others = torch.ones(vocab, dtype=torch.bool, device=weight.device)
    others[own] = False
    rest = others.nonzero().squeeze(-1)
    k = min(negatives, len(rest))
    drawn = rest[torch.randperm(len(rest), device=weight.device)[:k]]
    cand = torch.cat([own, drawn])
    logits = (hidden @ weight[cand].t()).float()
    if getattr(head, "bias", None) is not None:
        logits = logits + head.bias[cand].float()
    correction = torch.zeros(len(cand), device=logits.device)
    correction[len(own) :] = torch.log(torch.tensor(len(rest) / max(k, 1), device=logits.device))
    index = torch.searchsorted(own, targets)  # own is sorted (torch.unique) and holds every target
    return logits.gather(-1, index[:, None]).squeeze(-1) - torch.logsumexp(logits + correction, -1)
