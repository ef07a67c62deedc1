"""Local tiny models (Qwen2 architecture, trained tokenizer) and loading of any model path."""

from searchrl.models.load import load_model_and_tokenizer
from searchrl.models.tiny import (
    SIZES,
    SPECIAL_TOKENS,
    build_local_model,
    build_model,
    count_parameters,
    train_tokenizer,
)

__all__ = [
    "SIZES",
    "SPECIAL_TOKENS",
    "build_local_model",
    "build_model",
    "count_parameters",
    "load_model_and_tokenizer",
    "train_tokenizer",
]
