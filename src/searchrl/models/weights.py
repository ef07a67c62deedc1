"""Weights by parameter name: what an optimizer step can change, and copying named tensors into a module
(a rollout worker's copy of the policy, `searchrl.engine.worker_weights`)."""

from __future__ import annotations

from collections.abc import Mapping

import torch


def trainable_names(module: torch.nn.Module) -> list[str]:
    """The names of the parameters an optimizer step can change (LoRA: the adapter's)."""
    return [n for n, p in module.named_parameters() if p.requires_grad]


def load_into(model: torch.nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
    """Copy ``weights`` into ``model``'s parameters of the same names (cast to their dtype and device)."""
    params = dict(model.named_parameters())
    unknown = [n for n in weights if n not in params]
    if unknown:
        raise KeyError(f"the worker's copy has no parameter(s) {unknown[:3]}")
    with torch.no_grad():
        for n, w in weights.items():
            if params[n].shape != w.shape:
                raise ValueError(
                    f"parameter {n}: the worker's is {tuple(params[n].shape)}, shipped {tuple(w.shape)}"
                )
            params[n].copy_(w)
