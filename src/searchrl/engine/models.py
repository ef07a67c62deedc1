"""Policy and reference models: LoRA (peft) or full parameters.

Under LoRA the reference is the policy with its adapter disabled (no second copy in memory); under full
fine-tuning it is a frozen copy (initialised for DeepSpeed inference under ZeRO-3, as TRL does).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from searchrl.config import LoraConfig
from searchrl.models.load import load_model_and_tokenizer


def load_policy(path: str, dtype: str = "float32", lora: LoraConfig | None = None) -> tuple[Any, Any]:
    model, tokenizer = load_model_and_tokenizer(path, dtype=dtype)
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
    return model, tokenizer


def is_peft(model: Any) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


class Reference:
    """Log-probabilities under the reference policy.

    The full-fine-tuning reference is loaded from the model path again rather than copied: under ZeRO-3,
    transformers loads weights already partitioned (zero.Init), and a copy of placeholders is empty.
    """

    def __init__(self, policy: Any, engine: Any, model_path: str, dtype: str = "float32") -> None:
        self.engine, self.policy = engine, policy
        self.shared = is_peft(engine.unwrap(policy))
        self.frozen: Any = None
        if not self.shared:
            frozen, _ = load_model_and_tokenizer(model_path, dtype=dtype)
            frozen.eval().requires_grad_(False)
            self.frozen = engine.prepare_frozen(frozen)

    @contextmanager
    def model(self) -> Iterator[Any]:
        if self.shared:
            with self.engine.unwrap(self.policy).disable_adapter():
                yield self.policy
        else:
            yield self.frozen


def forward_logits(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Logits (B, T, V) of a right-padded batch."""
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
    ).logits
