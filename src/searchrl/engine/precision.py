"""Float32 master weights for parameters trained in bfloat16 or float16 (``trainer.master_weights``).

An optimizer stepping a bfloat16 parameter in place rounds every update to the parameter's precision: 8
significant bits, so an update smaller than half the spacing of representable values around a weight is lost
whole. At the learning rates of the papers' recipes (1e-6 for ReSearch and Search-R1) Adam's first updates are
about lr in size, and a weight of 0.02 sits where the spacing is 2^-13 ≈ 1.2e-4: after three AdamW steps at
lr 1e-6, 98% of a (896 × 4,864) bfloat16 matrix drawn with standard deviation 0.02 has not changed at all. The
update is not biased; it is dropped. DeepSpeed keeps float32 master partitions for this (its ``bf16`` mode); a
plain process or DDP did not.

`with_master_weights(cls)` is ``cls`` (AdamW, SGD) stepping a float32 copy of each low-precision parameter:
the copy and the optimizer's state (Adam's moments) are float32 and live in the optimizer's state, so they are
saved with it and restored without rounding; after each step the model's parameter is the copy rounded to its
own dtype. Float32 parameters (LoRA adapters, which peft keeps in float32) are stepped as they are. Cost per
low-precision trainable parameter: 4 bytes for the copy and, with AdamW, 4 more for its moments than bfloat16
moments take (a 7.6B model trained whole: about 61 GB more); during the step, float32 copies of the gradients,
at most ``chunk_numel`` elements (1 GiB) at a time.

`Float32Gradients` is the other half: with master weights and several micro-batches per optimizer update, the
gradients of the low-precision parameters are summed across the micro-batches in float32 (as DeepSpeed's bf16
mode and Megatron's ``main_grad`` do), not in place in bfloat16, where each addition rounds the running sum to 8
significant bits and a micro-batch's contribution loses the bits below the sum's rounding step.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import chain
from typing import Any

import torch

LOW = (torch.bfloat16, torch.float16)


class MasterWeights(torch.optim.Optimizer):
    """Mixin: steps float32 copies of the low-precision parameters (see the module's docstring)."""

    # elements of float32 gradient copies alive at once: the step runs over chunks of the low-precision
    # parameters, so the copies add at most 1 GiB at the step's peak instead of 4 bytes per parameter
    chunk_numel = 2**28

    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        whole = [g["params"] for g in self.param_groups]
        try:
            for part in self._parts(whole):
                for group, params in zip(self.param_groups, part):
                    group["params"] = params
                self._step_copies()
        finally:
            for group, params in zip(self.param_groups, whole):
                group["params"] = params
        return loss

    def _parts(self, whole: list[list[torch.nn.Parameter]]) -> list[list[list[torch.nn.Parameter]]]:
        """Each group's parameters split into steps: the float32 ones in the first, then the low-precision
        ones with a gradient, at most ``chunk_numel`` elements per step (one parameter at least)."""
        parts = [[[p for p in ps if p.dtype not in LOW] for ps in whole]]
        current: list[list[torch.nn.Parameter]] = [[] for _ in whole]
        size = 0
        for i, ps in enumerate(whole):
            for p in ps:
                if p.dtype not in LOW or p.grad is None:
                    continue
                if size and size + p.numel() > self.chunk_numel:
                    parts.append(current)
                    current, size = [[] for _ in whole], 0
                current[i].append(p)
                size += p.numel()
        return [*parts, current] if size else parts

    @torch.no_grad()
    def _step_copies(self) -> None:
        """One step of the optimizer over the current groups, the low-precision parameters swapped for their
        float32 copies (and gradients) while it runs, then rounded back."""
        swapped: list[tuple[torch.nn.Parameter, torch.Tensor, torch.Tensor | None]] = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype not in LOW:
                    continue
                # the copy joins the state after its first step: the optimizer initialises an empty state
                master = self.state[p].get("master")
                low, grad = p.data, p.grad
                p.data = p.detach().float() if master is None else master
                p.grad = grad.float() if grad is not None else None  # the optimizer steps (and keeps
                swapped.append((p, low, grad))  # its moments for) the copy
        try:
            super().step()
        finally:
            for p, low, grad in swapped:
                master = p.data
                p.data = low
                p.data.copy_(master)  # rounded to nearest
                p.grad = grad
                self.state[p]["master"] = master

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch casts every loaded state tensor to its parameter's dtype, which would round the float32 copies
        and moments to bfloat16; those of low-precision parameters are put back as saved, in float32."""
        saved = state_dict["state"]
        ids = list(chain.from_iterable(g["params"] for g in state_dict["param_groups"]))
        super().load_state_dict(state_dict)
        params = list(chain.from_iterable(g["params"] for g in self.param_groups))
        for pid, p in zip(ids, params):
            if p.dtype not in LOW or pid not in saved:
                continue
            for key, value in saved[pid].items():
                if key != "step" and torch.is_tensor(value) and value.is_floating_point():
                    self.state[p][key] = value.to(device=p.device, dtype=torch.float32)


class Float32Gradients:
    """Gradients of the low-precision trainable ``params`` summed across an update's micro-batches in float32.

    While `folding` is on, a hook on each parameter moves its gradient into a float32 sum as soon as autograd
    has accumulated it, one parameter at a time, and frees it; `unfold` hands each sum back as the
    parameter's gradient, rounded once to its dtype. The trainer calls `before_backward` and `after_backward`
    around each micro-batch's backward pass. In one process every pass is folded and the total rounded once
    after the last. Under DDP (``distributed``) the sums go back before the last pass, which adds its own
    gradient and reduces the whole over the processes exactly as gradients accumulated in place would be (no
    communication is added; the total is rounded twice). Memory: 2 more bytes per parameter than bfloat16
    gradients, while the update runs."""

    def __init__(self, params: list[torch.nn.Parameter], distributed: bool = False) -> None:
        self.params = [p for p in params if p.requires_grad and p.dtype in LOW]
        self.distributed = distributed
        self.sums: dict[torch.nn.Parameter, torch.Tensor] = {}
        self.folding = False
        self._handles = [p.register_post_accumulate_grad_hook(self._fold) for p in self.params]

    @classmethod
    def of(cls, groups: list[dict[str, Any]], distributed: bool) -> Float32Gradients:
        """Over the parameters of an optimizer's ``groups``."""
        return cls([p for g in groups for p in g["params"]], distributed)

    def before_backward(self, last: bool) -> None:
        """Before a micro-batch's backward pass; ``last``: the pass that completes the update."""
        if last and self.distributed:
            self.unfold()  # DDP reduces what the parameters hold after this pass
        else:
            self.folding = True

    def after_backward(self, last: bool) -> None:
        if last and not self.distributed:
            self.unfold()

    def _fold(self, p: torch.Tensor) -> None:
        if not self.folding or p.grad is None:
            return
        total = self.sums.get(p)  # type: ignore[call-overload]
        if total is None:
            self.sums[p] = p.grad.float()  # type: ignore[index]
        else:
            total.add_(p.grad)
        p.grad = None

    def unfold(self) -> None:
        """The float32 sums back into the parameters' gradients, rounded once (and freed)."""
        self.folding = False
        for p in self.params:
            total = self.sums.pop(p, None)
            if total is None:
                continue
            if p.grad is not None:  # a gradient accumulated outside the folding: add it, in float32
                total.add_(p.grad)
            p.grad = total.to(p.dtype)

    def clear(self) -> None:
        """Drops the sums (an update that did not finish) and stops folding."""
        self.folding = False
        self.sums.clear()

    def remove(self) -> None:
        """Takes the hooks off the parameters."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


_CLASSES: dict[type, type] = {}


def with_master_weights(cls: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """``cls`` with float32 master copies of its low-precision parameters (one class per ``cls``)."""
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Master{cls.__name__}", (MasterWeights, cls), {})
    return _CLASSES[cls]


def use_master_weights(
    wanted: bool, groups: list[dict[str, Any]], deepspeed: bool, say: Callable[[str], Any]
) -> bool:
    """Whether the optimizer over ``groups`` gets master copies (``trainer.master_weights``): where asked, some
    trainable parameters are bfloat16 / float16, and DeepSpeed (which keeps its own) is not in charge. Says
    which, and warns when low-precision parameters are stepped in place."""
    low = sum(p.numel() for g in groups for p in g["params"] if p.dtype in LOW)
    if not low or deepspeed:
        return False
    if wanted:
        say(f"optimizer: float32 master weights for {low / 1e6:.1f}M bfloat16/float16 trainable parameters")
    else:
        say(
            f"warning: {low / 1e6:.1f}M trainable parameters are stepped in bfloat16/float16 "
            "(trainer.master_weights: false): updates below half their rounding step are lost"
        )
    return wanted
