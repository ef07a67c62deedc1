"""Load any causal LM and tokenizer the same way: a local directory, a hub id, or a built-in size."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from searchrl.core.errors import DataError


@contextmanager
def unpartitioned() -> Iterator[None]:
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
    if not local and _looks_local(str(path)):
        raise DataError(
            f"model path {path} not found (a local directory; a hub id is 'org/name'). Check the config's "
            "model.path, warm_start.checkpoint or --model"
        )
    if local:
        refuse_pickled_weights(Path(path))
    try:
        torch_dtype = getattr(torch, dtype)
    except AttributeError as exc:
        raise DataError(f"unknown dtype {dtype!r}; valid: float32, bfloat16, float16") from exc
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=local)
    except (OSError, ValueError) as exc:
        if local:
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(
            f"model path {path}: no such local directory, and no hub model of that id could be loaded "
            f"({first[:200]})"
        ) from None
    with unpartitioned() if whole else nullcontext():
        model = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=torch_dtype, local_files_only=local, **kwargs
        )
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def _looks_local(path: str) -> bool:
    """A path, not a hub id ('org/name'): absolute, relative with ./ ../ ~, or more than one '/'."""
    return path.startswith(("/", ".", "~")) or path.count("/") > 1 or "\\" in path


def refuse_pickled_weights(model_dir: Path) -> None:
    """A model directory whose only weights are pickles (``pytorch_model.bin``): refused, naming the file.
    A pickle can run code when it is loaded; safetensors cannot."""
    if any(model_dir.glob("*.safetensors")) or (model_dir / "model.safetensors.index.json").exists():
        return
    pickled = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(p.name for p in model_dir.glob("*.pt"))
    if pickled:
        raise DataError(
            f"{model_dir / pickled[0]}: the model's weights are a pickle ({', '.join(pickled)}), which can run "
            "code when loaded; searchrl reads safetensors only. Convert them where you trust the file: "
            "AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(DIR, safe_serialization=True)"
        )
