"""Load any causal LM and tokenizer the same way: a local directory, a hub id, or a built-in size."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from searchrl.errors import DataError


@contextmanager
def _unpartitioned() -> Iterator[None]:
    """Inside a DeepSpeed ZeRO-3 run, transformers builds every model partitioned across the processes
    (zero.Init): an empty placeholder per parameter. A model for one process alone (evaluation, scoring)
    must be loaded whole, so the run's DeepSpeed config is hidden from transformers while it loads."""
    from transformers.integrations import deepspeed as hf_deepspeed

    saved = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = saved


def load_model_and_tokenizer(path: str | Path, dtype: str = "float32", whole: bool = False, **kwargs: Any):
    """``path``: a local directory (e.g. built by `searchrl build-model`) or a hub id (GPU users).
    ``whole``: every parameter in this process even inside a ZeRO-3 run (models used by one process
    alone, such as evaluation); otherwise a ZeRO-3 run loads it partitioned for DeepSpeed.

    Local directories never touch the network.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # per-shard bars drown the training progress bar

    local = Path(path).is_dir()
    if not local and Path(path).exists():
        raise DataError(f"model path {path} is a file; pass the directory that holds config.json")
    try:
        torch_dtype = getattr(torch, dtype)
    except AttributeError as exc:
        raise DataError(f"unknown dtype {dtype!r}; valid: float32, bfloat16, float16") from exc
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=local)
    with _unpartitioned() if whole else nullcontext():
        model = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=torch_dtype, local_files_only=local, **kwargs
        )
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer
