"""The KV cache as a model's forward takes and returns it, and a micro-batch's common prefix run once through it.

`prefix_hidden` is the trainer's second way of sharing a prefix (docs/objectives.md, "A long common prefix
through the KV cache"; the first is the prefix tree of `models.prefix`): the
leading tokens every row of a micro-batch begins with (an instruct model's system prompt and tool schemas, the
one prompt of a GRPO group) run once as a batch of one; their keys and values are expanded (a view, no copy)
to every row, and the rows run only their own tokens against them, attending to the prefix's keys through the
cache. The rows' final hidden states are the prefix's (expanded) followed by their own, so whatever reads them
(the output layer, a value head) sees the same (rows, tokens, hidden) tensor as from one pass over the whole
rows, equal within float rounding; the gradients of the prefix's positions sum over the rows in the expand's
backward and flow back through the prefix's one pass. Against the prefix tree (`models.prefix`), where every
packed row carries its first row whole and attention is a dense (width × width) mask, the prefix's attention
is causal once and the rows' queries see (own + prefix) keys only.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch


def output_cache(out: Any) -> Any:
    """The KV cache a forward returned (``out.cache`` from transformers 5.24 on, else the old name)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


@functools.cache
def forward_params(cls: type) -> frozenset[str]:
    """The parameter names of ``cls.forward`` (what may be passed to a model of that class)."""
    return frozenset(inspect.signature(cls.forward).parameters)  # type: ignore[attr-defined]


def cache_arg(cls: type) -> str:
    """The name under which ``cls``'s forward takes a KV cache: ``cache`` from transformers 5.24 on (which
    warns that the old name goes in 5.40), ``past_key_values`` before it and in custom models."""
    return "cache" if "cache" in forward_params(cls) else "past_key_values"


def common_prefix(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> int:
    """How many leading tokens every right-padded row of ``input_ids`` (B, T) shares with the others, real in
    all (``attention_mask``), at most the shortest row's length − 1 so that each row keeps a token of its
    own: what `prefix_hidden` may run once (0 for fewer than two rows)."""
    if input_ids.shape[0] < 2 or input_ids.shape[1] < 2:
        return 0
    same = (input_ids == input_ids[:1]).all(0) & attention_mask.bool().all(0)
    same[max(int(attention_mask.sum(-1).min()) - 1, 0) :] = False
    return int(same.long().cumprod(0).sum())


def cached_cost(rows: int, width: int, prefix: int) -> float:
    """The relative cost of ``rows`` rows of ``width`` columns whose first ``prefix`` run once through the cache:
    each row's own tokens plus their attention (own queries × all keys), at `models.prefix`'s scale (a token,
    or 1,024 query-key pairs). The trainer lays a micro-batch out padded or as a prefix tree after the cached
    prefix, whichever costs less: one group's episodes, each seeing the prompt and itself, are cheaper padded
    than as one packed row whose dense mask spans every episode."""
    own = width - prefix
    return rows * (own + own * width / 1024)


def prefix_hidden(base: Any, prefix: int, **kwargs: Any) -> torch.Tensor:
    """The final hidden states (R, C, H) of ``base`` (a transformers backbone: `model.base_model` of a causal
    LM) over ``input_ids`` (R, C), with their first ``prefix`` columns (identical in every row, positions 0 …
    prefix − 1, causal among themselves: `common_prefix` of the rows; packed rows, `models.packing` and
    `models.prefix`, begin with a whole row each, so their first columns are the same) run once.
    ``attention_mask``: the rows' 2-D mask (C columns), or a 4-D one (R, 1, C, C) for packed rows with shared
    prefixes (`models.prefix`), of which the rows' own queries' part is used; ``position_ids`` (R, C) as for
    one pass."""
    ids, positions = kwargs.pop("input_ids"), kwargs.pop("position_ids", None)
    attention = kwargs.pop("attention_mask", None)
    if positions is None:  # right-padded rows with their 2-D mask
        positions = (attention.long().cumsum(-1) - 1).clamp(min=0)
    for k in ("use_cache", "cache", "past_key_values"):
        kwargs.pop(k, None)
    R, name = ids.shape[0], cache_arg(type(base))
    pre = base(input_ids=ids[:1, :prefix], position_ids=positions[:1, :prefix], use_cache=True, **kwargs)
    cache = output_cache(pre)
    for layer in cache.layers:  # a view: every row reads the one copy; the backward sums over the rows
        layer.keys = layer.keys.expand(R, -1, -1, -1)
        layer.values = layer.values.expand(R, -1, -1, -1)
    if attention is not None and attention.dim() == 4:
        attention = attention[:, :, prefix:, :]  # the rows' own queries against (prefix + own) keys
    own = base(
        input_ids=ids[:, prefix:],
        position_ids=positions[:, prefix:],
        attention_mask=attention,
        use_cache=True,
        **{name: cache},
        **kwargs,
    )
    return torch.cat([pre.last_hidden_state.expand(R, -1, -1), own.last_hidden_state], 1)


def checkpointing_now(model: Any) -> bool:
    """Whether a forward of ``model`` now recomputes its layers in the backward (activation checkpointing in
    training mode with gradients on), which drops a KV cache: `prefix_hidden` cannot run then."""
    if not (model.training and torch.is_grad_enabled()):
        return False
    return any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
