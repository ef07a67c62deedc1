"""A run directory's config.yaml is written once; another config is refused; --force clears only run files."""

from pathlib import Path

import pytest

from searchrl.errors import ConfigError
from searchrl.experiment import load_experiment
from searchrl.rundir import check_run_dir, claim_run_dir

REPO = Path(__file__).resolve().parents[1]


def _exp(tmp_path, *overrides):
    return load_experiment(REPO / "experiments" / "quickstart.yaml", [f"output_dir={tmp_path}", *overrides])


def test_same_config_passes_and_is_not_rewritten(tmp_path):
    exp = _exp(tmp_path)
    path = claim_run_dir(exp)
    before = path.stat().st_mtime_ns
    check_run_dir(_exp(tmp_path))
    claim_run_dir(_exp(tmp_path))
    assert path.stat().st_mtime_ns == before


def test_changed_config_is_refused_with_the_keys(tmp_path):
    claim_run_dir(_exp(tmp_path))
    with pytest.raises(ConfigError) as e:
        check_run_dir(_exp(tmp_path, "trainer.lr=5e-4", "env.topk=2"))
    msg = str(e.value)
    assert str(tmp_path / "config.yaml") in msg and "trainer.lr: 0.0003 -> 0.0005" in msg
    assert "env.topk: 1 -> 2" in msg
    assert "--force" in msg


def test_force_clears_run_files_only(tmp_path):
    claim_run_dir(_exp(tmp_path))
    for d in ("checkpoints/step-000001", "final", "sft/final"):
        (tmp_path / d).mkdir(parents=True)
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "notes.txt").write_text("mine")
    changed = _exp(tmp_path, "trainer.lr=5e-4")
    check_run_dir(changed, force=True)
    claim_run_dir(changed, force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml", "notes.txt"]
    assert "0.0005" in (tmp_path / "config.yaml").read_text()
