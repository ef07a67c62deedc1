"""Load any causal LM and tokenizer the same way: a local directory, a hub id, or a built-in size."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def load_model_and_tokenizer(path: str | Path, dtype: str = "float32", **kwargs: Any):
    """``path``: a local directory (e.g. built by `searchrl build-model`) or a hub id (GPU users).

    Local directories never touch the network.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # per-shard bars drown the training progress bar

    local = Path(path).is_dir()
    if not local and Path(path).exists():
        raise ValueError(f"model path {path} is a file; pass the directory that holds config.json")
    try:
        torch_dtype = getattr(torch, dtype)
    except AttributeError as exc:
        raise ValueError(f"unknown dtype {dtype!r}; valid: float32, bfloat16, float16") from exc
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=local)
    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch_dtype, local_files_only=local, **kwargs
    )
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer
