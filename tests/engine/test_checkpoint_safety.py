"""Checkpoints a resume can trust: truncated files are skipped (naming the file), a full disk ends in one
message naming the path and the free space, pickled state that would run code is refused, and model
directories holding only pickled weights are refused."""

import errno
import os
import pickle
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from searchrl.core.config import TrainerConfig
from searchrl.core.errors import DataError
from searchrl.engine.checkpoint import (
    Checkpointer,
    CheckpointError,
    checkpoint_problem,
    disk_errors,
    safetensors_problem,
)


def fake_checkpoint(root, step, truncate=False):
    ck = root / f"step-{step:06d}"
    (ck / "model").mkdir(parents=True)
    (ck / "state").mkdir()
    (ck / "trainer.json").write_text(f'{{"step": {step}}}')
    (ck / "model" / "config.json").write_text("{}")
    save_file({"w": torch.arange(64, dtype=torch.float32)}, str(ck / "model" / "model.safetensors"))
    save_file({"m": torch.zeros(8)}, str(ck / "state" / "model.safetensors"))
    if truncate:
        f = ck / "state" / "model.safetensors"
        f.write_bytes(f.read_bytes()[:-10])
    return ck


def test_a_truncated_safetensors_file_is_found_without_loading_it(tmp_path):
    good = fake_checkpoint(tmp_path, 1)
    bad = fake_checkpoint(tmp_path, 2, truncate=True)
    assert checkpoint_problem(good) is None
    assert "state/model.safetensors" in checkpoint_problem(bad) and "truncated" in checkpoint_problem(bad)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x00" * 4)
    assert "header length" in safetensors_problem(junk)


def test_resume_falls_back_to_the_newest_checkpoint_that_verifies(tmp_path):
    fake_checkpoint(tmp_path, 1)
    fake_checkpoint(tmp_path, 2)
    fake_checkpoint(tmp_path, 3, truncate=True)
    (tmp_path / "latest").write_text("step-000003")
    printed = []
    ck = Checkpointer.__new__(Checkpointer)
    ck.dir, ck.engine = tmp_path, SimpleNamespace(print=printed.append)
    assert ck.latest() == tmp_path / "step-000002"
    assert "step-000003 (state/model.safetensors:" in printed[0] and "step-000002" in printed[0]


@pytest.mark.parametrize(
    "exc",
    [
        OSError(errno.ENOSPC, "No space left on device"),
        RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 4480 vs 4368"),
    ],
)
def test_a_full_disk_names_the_path_and_the_free_space(tmp_path, exc):
    tmp = tmp_path / "checkpoints" / "step-000004.tmp"
    tmp.mkdir(parents=True)
    (tmp / "half").write_bytes(b"x")
    with (
        pytest.raises(
            CheckpointError, match=r"could not write .*step-000004 \([\d,]+ MiB free on that disk\)"
        ),
        disk_errors(tmp),
    ):
        raise exc
    assert not tmp.exists()


def test_other_errors_while_saving_are_not_disguised(tmp_path):
    with pytest.raises(RuntimeError, match="a bug"), disk_errors(tmp_path / "x.tmp"):
        raise RuntimeError("a bug")


class Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickled_state_that_would_run_code_is_refused(make_exp, agent_model_dir, tmp_path):
    from tests.engine.test_trainer import trainer_for

    exp = make_exp(f"model.path={agent_model_dir}", "rewards=[{name: test_trainer_length}]")
    cfg = TrainerConfig(steps=1, batch_size=2, micro_batch_size=8, lr=1e-4, save_every=1)
    trainer_for(exp, "grpo", cfg, args={"kl_coef": 0.0}).run()
    state = exp.out / "checkpoints" / "step-000001" / "state"
    pickled = sorted(p.name for p in state.iterdir() if p.suffix in (".pkl", ".bin", ".pt"))
    assert pickled, sorted(p.name for p in state.iterdir())  # what accelerate pickles (README says so)
    marker = tmp_path / "pwned"
    for name in pickled:
        (state / name).write_bytes(pickle.dumps(Exploit(marker)))
    with pytest.raises(CheckpointError, match=r"state: a pickled state file .* nothing in it ran"):
        trainer_for(exp, "grpo", cfg, args={"kl_coef": 0.0}, resume=True)
    assert not marker.exists()


def test_model_directories_with_only_pickled_weights_are_refused(tmp_path):
    from searchrl.models.load import load_model_and_tokenizer

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(pickle.dumps({"w": 1}))
    with pytest.raises(DataError, match=r"pytorch_model.bin: the model's weights are a pickle"):
        load_model_and_tokenizer(tmp_path)
    with pytest.raises(DataError, match=r"runs/nope/final not found"):
        load_model_and_tokenizer("runs/nope/final")
