"""Policy and reference models: LoRA (peft) or full parameters.

Under LoRA the reference is the policy with its adapter disabled (no second copy in memory); under full
fine-tuning it is a frozen copy (initialised for DeepSpeed inference under ZeRO-3, as TRL does).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from searchrl.core.config import LoraConfig
from searchrl.models.lean_head import add_lean_head
from searchrl.models.load import load_model_and_tokenizer

VALUE_HEAD_FILE = "value_head.safetensors"


class PolicyWithValue(torch.nn.Module):
    """The policy LM plus a scalar value head on its last hidden state: one module, so one engine is
    prepared under ZeRO-3 and one optimizer holds both (the head in its own parameter group).

    Called like the LM (generation, reference passes) it returns the LM's output; with ``values=True``
    it returns ``(output, values)``, ``values`` (B, T) aligned like `functional.token_logprobs`: position
    t holds V of the state *before* token t (read from the hidden state at t-1), 0 at t = 0. Under LoRA
    the adapter and the head are trained; ``detach_trunk`` stops the value loss from reaching the LM.
    """

    def __init__(self, lm: Any, detach_trunk: bool = False) -> None:
        super().__init__()
        self.lm, self.detach_trunk = lm, detach_trunk
        hidden = (lm.get_base_model() if is_peft(lm) else lm).config.hidden_size
        self.value_head = torch.nn.Linear(hidden, 1)
        torch.nn.init.zeros_(self.value_head.weight)  # V = 0 at the start: GAE begins as reward-to-go
        torch.nn.init.zeros_(self.value_head.bias)
        self.value_head.to(next(lm.parameters()).dtype)

    @property
    def config(self) -> Any:
        return self.lm.config

    # what generation helpers (trl's unwrap_model_for_generation) ask of a model
    @property
    def is_gradient_checkpointing(self) -> bool:
        for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):  # transformers 5 renamed it
            if hasattr(type(self.lm), name) or name in vars(self.lm):
                return bool(getattr(self.lm, name))
        return False

    def gradient_checkpointing_enable(
        self,
        gradient_checkpointing_kwargs: dict | None = None,
        activation_checkpointing_kwargs: dict | None = None,
    ) -> None:
        enable_checkpointing(self.lm, gradient_checkpointing_kwargs or activation_checkpointing_kwargs)

    def gradient_checkpointing_disable(self) -> None:
        # transformers 5.2x: activation_checkpointing_*, the gradient_ names warn and go in v6
        getattr(self.lm, "activation_checkpointing_disable", self.lm.gradient_checkpointing_disable)()

    activation_checkpointing_enable = gradient_checkpointing_enable
    activation_checkpointing_disable = gradient_checkpointing_disable

    def forward(self, *args: Any, values: bool = False, **kwargs: Any) -> Any:
        if not values:
            return self.lm(*args, **kwargs)
        kwargs["output_hidden_states"] = True
        out = self.lm(*args, **kwargs)
        h = out.hidden_states[-1]
        v = self.value_head(h.detach() if self.detach_trunk else h).squeeze(-1).float()
        return out, torch.nn.functional.pad(v[:, :-1], (1, 0))

    def save_pretrained(self, out: str, state_dict: dict[str, Any] | None = None, **kwargs: Any) -> None:
        """The LM as usual (adapter only under LoRA) and the head beside it in ``value_head.safetensors``."""
        from safetensors.torch import save_file

        sd = state_dict if state_dict is not None else self.state_dict()
        lm_sd = {k.removeprefix("lm."): v for k, v in sd.items() if k.startswith("lm.")}
        self.lm.save_pretrained(out, state_dict=lm_sd, **kwargs)
        head = {
            k.removeprefix("value_head."): v.contiguous()
            for k, v in sd.items()
            if k.startswith("value_head.")
        }
        save_file(head, f"{out}/{VALUE_HEAD_FILE}")


def lm_of(model: Any) -> Any:
    """The language model inside a `PolicyWithValue` (or the model itself)."""
    return model.lm if isinstance(model, PolicyWithValue) else model


def load_policy(
    path: str,
    dtype: str = "float32",
    lora: LoraConfig | None = None,
    value_head: bool = False,
    detach_trunk: bool = False,
    gradient_checkpointing: bool = False,
) -> tuple[Any, Any]:
    """The trainable policy (LoRA-wrapped if configured), with a value head for actor-critic methods.
    ``gradient_checkpointing``: activations recomputed in the backward pass (non-reentrant, so a LoRA model's
    frozen embeddings need no gradient); only where gradients are taken in train mode: generation (eval
    mode, KV cache) and the no-grad log-prob passes run as without it."""
    model, tokenizer = load_model_and_tokenizer(path, dtype=dtype)
    add_lean_head(model)  # before peft wraps it
    model.config.use_cache = False  # training forward passes; generation turns the cache on explicitly
    if lora is not None:
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model

        present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
        targets = [m for m in lora.target_modules if m in present]
        if not targets:
            raise ValueError(
                f"model.lora.target_modules {list(lora.target_modules)} match no module of {path}"
            )
        model = get_peft_model(
            model,
            PeftLoraConfig(
                r=lora.r,
                lora_alpha=lora.alpha,
                lora_dropout=lora.dropout,
                target_modules=targets,
                task_type="CAUSAL_LM",
            ),
        )
    if value_head:
        model = PolicyWithValue(model, detach_trunk)
    if gradient_checkpointing:
        enable_checkpointing(model)
    return model, tokenizer


def enable_checkpointing(model: Any, kwargs: dict | None = None) -> None:
    """Activation checkpointing on every layer of ``model``'s LM (through a value head or peft), non-reentrant
    unless ``kwargs`` (torch.utils.checkpoint's) say otherwise, named as the installed transformers names it
    (``activation_checkpointing_enable`` since 5.2x, before it ``gradient_checkpointing_enable``, each with
    its own keyword)."""
    lm = model.lm if isinstance(model, PolicyWithValue) else model
    kwargs = kwargs or {"use_reentrant": False}
    if hasattr(lm, "activation_checkpointing_enable"):
        lm.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def is_peft(model: Any) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


class Reference:
    """Log-probabilities under the reference policy.

    The full-fine-tuning reference is loaded from the model path again rather than copied: under ZeRO-3,
    transformers loads weights already partitioned (zero.Init), and a copy of placeholders is empty.
    """

    def __init__(self, policy: Any, engine: Any, model_path: str, dtype: str = "float32") -> None:
        self.engine, self.policy = engine, policy
        self.shared = is_peft(lm_of(engine.unwrap(policy)))
        self.frozen: Any = None
        if not self.shared:
            frozen, _ = load_model_and_tokenizer(model_path, dtype=dtype)
            add_lean_head(frozen).eval().requires_grad_(False)
            self.frozen = engine.prepare_frozen(frozen)

    @contextmanager
    def model(self) -> Iterator[Any]:
        if self.shared:
            with lm_of(self.engine.unwrap(self.policy)).disable_adapter():
                yield self.policy
        else:
            yield self.frozen


def _positions(attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None) -> torch.Tensor:
    if (
        position_ids is not None
    ):  # packed rows (`models.packing`): no 2-D mask, positions restart per sequence
        return position_ids
    assert attention_mask is not None
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def forward(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    values: bool = False,
    position_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logits (B, T, V) of a right-padded batch, or of packed rows (``position_ids``, ``attention_mask``
    None), and, from a `PolicyWithValue`, values (B, T)."""
    position_ids = _positions(attention_mask, position_ids)
    kw = {"values": True} if values else {}
    out = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False, **kw
    )
    return (out[0].logits, out[1]) if values else (out.logits, None)


def forward_lean(
    model: Any,
    batch_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    mask: torch.Tensor,
    temperature: float,
    entropy: bool = False,
    values: bool = False,
    negatives: int = 0,
    position_ids: torch.Tensor | None = None,
    prefix: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Log-probs and entropy (B, T) of the ``mask`` positions, and values (B, T) from a `PolicyWithValue`,
    without a (B, T, V) logits tensor (`models.lean_head`; the LM must have been patched by
    `add_lean_head`, as `load_policy` and `Reference` do). ``negatives``: a sampled softmax (training only);
    ``position_ids`` with no ``attention_mask``: packed rows, as in `forward`. ``prefix``: the first tokens of
    every row, the same in all, run once (`models.prefix_cache.prefix_hidden`)."""
    position_ids = _positions(attention_mask, position_ids)
    kw: dict[str, Any] = {"values": True} if values else {}
    if prefix > 0:
        kw["lean_prefix"] = prefix
    out = model(
        input_ids=batch_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
        lean_mask=mask,
        lean_temperature=temperature,
        lean_entropy=entropy,
        lean_negatives=negatives,
        **kw,
    )
    lean, v = (out[0], out[1]) if values else (out, None)
    return lean.logprobs, lean.entropy, v
