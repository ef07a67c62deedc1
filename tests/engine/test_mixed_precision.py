"""A stage's `trainer.mixed_precision` after the process's first accelerator (`engine.Engine`)."""

import pytest

from searchrl.engine.engine import Engine, distributed_state


@pytest.fixture
def restore_precision(monkeypatch):
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    yield
    Engine(mixed_precision="no")  # the next test finds the process as the others leave it


def test_each_stage_gets_the_mixed_precision_it_asks_for(restore_precision, monkeypatch):
    # accelerate fixes the process's mixed precision at its first Accelerator and refused a later one asking
    # for another: a warm start in float32 then RL in bf16 raised "AcceleratorState has already been
    # initialized" before any training
    distributed_state()
    assert Engine(mixed_precision="no").accelerator.mixed_precision == "no"
    assert Engine(mixed_precision="bf16").accelerator.mixed_precision == "bf16"
    assert Engine(mixed_precision="no").accelerator.mixed_precision == "no"
    # null: the launcher's (accelerate launch --mixed_precision / its config), else no
    assert Engine(mixed_precision=None).accelerator.mixed_precision == "no"
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    assert Engine(mixed_precision=None).accelerator.mixed_precision == "bf16"
    assert Engine(mixed_precision="no").accelerator.mixed_precision == "no"
