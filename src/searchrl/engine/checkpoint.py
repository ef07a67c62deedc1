"""Checkpoints: atomic, safetensors, adapter-only under LoRA, resumable.

Layout of ``<run>/checkpoints/step-000050/``::

    model/          the policy in Hugging Face format (LoRA: the adapter only) + tokenizer -> `model.path`
    state/          optimizer, scheduler, RNG states and trainable weights (accelerate save_state;
                    DeepSpeed's partitioned checkpoint under ZeRO)
    trainer.json    step, metrics history length, and what the run was

Each checkpoint is written to ``step-N.tmp`` and renamed when complete; ``latest`` names the newest one.
A crash mid-write leaves the previous checkpoint untouched.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from searchrl.core.errors import SearchRLError
from searchrl.engine.engine import Engine
from searchrl.models.policy import is_peft, lm_of


def _trainable_only(model: Any) -> Any:
    """accelerate save-state hook: under LoRA keep only trainable tensors (adapter, value head)."""
    names = {n for n, p in model.named_parameters() if p.requires_grad}

    def hook(models: list[Any], weights: list[dict[str, Any]], output_dir: str) -> None:
        for i, sd in enumerate(weights):
            weights[i] = {k: v for k, v in sd.items() if k in names or k.removeprefix("module.") in names}

    return hook


def _without_tied_aliases(model: Any) -> Any:
    """accelerate save-state hook: drop the second name of a tied parameter (``lm_head.weight`` when the
    head shares the embedding), as ``save_pretrained`` does. safetensors cannot store shared tensors, so
    accelerate would drop it anyway, with a warning; loading re-ties it (tested)."""
    seen: dict[int, str] = {}
    aliases = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            aliases.add(name)
        seen.setdefault(id(param), name)

    def hook(models: list[Any], weights: list[dict[str, Any]], output_dir: str) -> None:
        for i, sd in enumerate(weights):
            weights[i] = {k: v for k, v in sd.items() if k.removeprefix("module.") not in aliases}

    return hook


class Checkpointer:
    def __init__(self, engine: Engine, run_dir: Path, model: Any, tokenizer: Any, keep: int = 2) -> None:
        self.engine, self.dir, self.model, self.tokenizer, self.keep = (
            engine,
            run_dir / "checkpoints",
            model,
            tokenizer,
            keep,
        )
        self.lora = is_peft(lm_of(engine.unwrap(model)))
        if not engine.is_deepspeed:
            saved = _trainable_only if self.lora else _without_tied_aliases
            engine.accelerator.register_save_state_pre_hook(saved(engine.unwrap(model)))

    def latest(self) -> Path | None:
        """The newest valid checkpoint: the one ``latest`` names, else (said aloud) the newest complete one."""
        pointer = self.dir / "latest"
        named = self.dir / pointer.read_text().strip() if pointer.exists() else None
        skipped = []
        if named is not None:
            problem = checkpoint_problem(named) if named.exists() else "missing"
            if problem is None:
                return named
            skipped.append(f"{named.name} ({problem})")
        for path in self._done()[::-1]:
            if named is not None and path.name == named.name:
                continue
            problem = checkpoint_problem(path)
            if problem is None:
                what = ", ".join(skipped) if skipped else "no 'latest' pointer"
                self.engine.print(f"checkpoint skipped: {what}; resuming from the newest valid one, {path}")
                return path
            skipped.append(f"{path.name} ({problem})")
        if skipped:
            self.engine.print(f"no valid checkpoint to resume from: {'; '.join(skipped)}")
        return None

    def _done(self) -> list[Path]:
        return sorted(p for p in self.dir.glob("step-*") if not p.name.endswith(".tmp"))

    def latest_before(self, step: int) -> Path | None:
        """The newest valid checkpoint at or before ``step``."""
        good = [p for p in self._done() if int(p.name.split("-")[1]) <= step and is_valid_checkpoint(p)]
        return good[-1] if good else None

    def discard_after(self, path: Path) -> None:
        """Delete the checkpoints newer than ``path`` and point ``latest`` at it (a rollback: a resume must
        not start from the discarded steps)."""
        if self.engine.is_main:
            for p in self._done():
                if p.name > path.name:
                    shutil.rmtree(p, ignore_errors=True)
            _atomic_write(self.dir / "latest", path.name)
        self.engine.wait()

    def save(self, step: int, trainer_state: dict[str, Any]) -> Path:
        eng = self.engine
        final = self.dir / f"step-{step:06d}"
        tmp = self.dir / f"step-{step:06d}.tmp"
        if eng.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        with disk_errors(tmp):
            if eng.is_main:
                tmp.mkdir(parents=True)
            eng.wait()
            self.export_model(tmp / "model")
            kwargs = {"exclude_frozen_parameters": True} if (self.lora and eng.is_deepspeed) else {}
            eng.accelerator.save_state(str(tmp / "state"), safe_serialization=True, **kwargs)
        eng.wait()
        if eng.is_main:
            (tmp / "trainer.json").write_text(json.dumps({"step": step, **trainer_state}, indent=1))
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            _atomic_write(self.dir / "latest", final.name)
            self._prune()
        eng.wait()
        return final

    def export_model(self, out: Path) -> None:
        """The policy as a loadable HF directory (adapter only under LoRA), gathered under ZeRO-3."""
        eng = self.engine
        state_dict = eng.accelerator.get_state_dict(self.model)  # collective under ZeRO-3
        if eng.is_main:
            unwrapped = eng.unwrap(self.model)
            unwrapped.save_pretrained(str(out), state_dict=state_dict, safe_serialization=True)
            self.tokenizer.save_pretrained(str(out))

    def export_final(self, out: Path) -> Path:
        """The trained model as ``out``, atomically: exported into ``out.tmp`` and renamed when complete,
        so ``out`` exists only with its weights (a kill mid-export leaves no ``out``)."""
        eng = self.engine
        tmp = out.with_name(out.name + ".tmp")
        if eng.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        eng.wait()
        with disk_errors(tmp):
            self.export_model(tmp)
        eng.wait()
        if eng.is_main:
            shutil.rmtree(out, ignore_errors=True)
            os.replace(tmp, out)
        eng.wait()
        return out

    def load(self, path: Path) -> dict[str, Any]:
        """Restore the training state of the checkpoint at ``path``. accelerate reads the optimizer and RNG
        states with ``torch.load(weights_only=True)``: a pickle that would build other objects (run code) is
        refused, here with one message naming the checkpoint."""
        import pickle

        eng = self.engine
        kwargs = {"load_module_strict": False} if eng.is_deepspeed else {"strict": not self.lora}
        try:
            eng.accelerator.load_state(str(path / "state"), **kwargs)
        except (pickle.UnpicklingError, EOFError) as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise CheckpointError(
                f"{path / 'state'}: a pickled state file (optimizer, scheduler or RNG) could not be loaded as "
                f"plain tensors, so it was refused and nothing in it ran ({first[:200]}). Resume from another "
                "checkpoint (delete this one) or start over with --force"
            ) from None
        return json.loads((path / "trainer.json").read_text())

    def _prune(self) -> None:
        done = self._done()
        for old in done[: max(0, len(done) - self.keep)]:
            shutil.rmtree(old, ignore_errors=True)


WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "adapter_model.safetensors",
    "pytorch_model.bin",
    "adapter_model.bin",
)


def has_weights(model_dir: Path) -> bool:
    """A model directory holds a config and its weights (a finished export)."""
    config = (model_dir / "config.json").exists() or (model_dir / "adapter_config.json").exists()
    return config and any((model_dir / f).exists() for f in WEIGHT_FILES)


def is_valid_checkpoint(path: Path) -> bool:
    """Everything a resume reads: a readable ``trainer.json``, the training state and the exported model,
    every safetensors file whole (`checkpoint_problem`)."""
    return checkpoint_problem(path) is None


def checkpoint_problem(path: Path) -> str | None:
    """Why a resume cannot use the checkpoint at ``path`` (None: it can): ``trainer.json`` unreadable, no
    state or model, or a safetensors file whose header is unreadable or whose size is not what its header
    says (a write cut short by a kill or a full disk)."""
    try:
        json.loads((path / "trainer.json").read_text())
    except (OSError, ValueError) as exc:
        return f"trainer.json unreadable ({type(exc).__name__})"
    if not (path / "state").is_dir():
        return "no state/ directory"
    if not has_weights(path / "model"):
        return "no model weights"
    for f in sorted(path.glob("*/**/*.safetensors")):
        problem = safetensors_problem(f)
        if problem is not None:
            return f"{f.relative_to(path)}: {problem}"
    return None


def safetensors_problem(path: Path) -> str | None:
    """A safetensors file checked without loading it: 8 bytes of header length, a JSON header, and data
    exactly as long as the header's offsets say."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if size < 8 or n <= 0 or 8 + n > size:
                return f"header length {n} does not fit a file of {size} bytes"
            header = json.loads(f.read(n))
    except (OSError, ValueError) as exc:
        return f"unreadable header ({type(exc).__name__})"
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)]
    expected = 8 + n + max(ends, default=0)
    return None if size == expected else f"{size} bytes where its header says {expected} (truncated?)"


class CheckpointError(SearchRLError):
    """A checkpoint that cannot be written (disk full, no permission) or read (refused pickled state)."""


@contextmanager
def disk_errors(tmp: Path) -> Iterator[None]:
    """A write that fails for lack of space or permission ends in one message naming the path and the free
    space; the partial ``tmp`` is removed and the earlier checkpoints stay as they were."""
    try:
        yield
    except Exception as exc:
        text = f"{type(exc).__name__}: {exc}"
        markers = ("No space", "StorageFull", "unexpected pos", "failed writing", "Disk quota", "Read-only")
        writer = isinstance(exc, OSError | RuntimeError) or "Safetensor" in type(exc).__name__
        if not writer or not (isinstance(exc, OSError) or any(m in text for m in markers)):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            free = f"{shutil.disk_usage(tmp.parent).free / 2**20:,.0f} MiB free"
        except OSError:
            free = "free space unknown"
        raise CheckpointError(
            f"could not write {tmp.with_suffix('') if tmp.suffix == '.tmp' else tmp} ({free} on that disk): "
            f"{text.splitlines()[0][:200]}. The earlier checkpoints are intact; free some space (or set "
            "trainer.keep_checkpoints lower) and run again with --resume"
        ) from None


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
