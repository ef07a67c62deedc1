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
from pathlib import Path
from typing import Any

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
        if named is not None and is_valid_checkpoint(named):
            return named
        done = self._done()[::-1]
        for path in done:
            if is_valid_checkpoint(path):
                what = f"{named.name} is incomplete" if named is not None else "no 'latest' pointer"
                self.engine.print(f"checkpoint {what}; resuming from the newest valid one, {path}")
                return path
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
        self.export_model(tmp)
        eng.wait()
        if eng.is_main:
            shutil.rmtree(out, ignore_errors=True)
            os.replace(tmp, out)
        eng.wait()
        return out

    def load(self, path: Path) -> dict[str, Any]:
        eng = self.engine
        kwargs = {"load_module_strict": False} if eng.is_deepspeed else {"strict": not self.lora}
        eng.accelerator.load_state(str(path / "state"), **kwargs)
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
    """Everything a resume reads: a readable ``trainer.json``, the training state and the exported model."""
    try:
        json.loads((path / "trainer.json").read_text())
    except (OSError, ValueError):
        return False
    return (path / "state").is_dir() and has_weights(path / "model")


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
