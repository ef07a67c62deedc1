"""A run directory's config.yaml is written once; another config is refused; --force clears only run files."""

from pathlib import Path

import pytest

from searchrl.app.experiment import load_experiment
from searchrl.app.rundir import check_run_dir, claim_run_dir
from searchrl.core.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


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


def _user_files(root):
    files = {"eval/notes.md": b"my notes\n", "world/my_world.json": b'{"mine": 1}\n'}
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return files


def test_force_refuses_a_directory_without_a_run_config_and_deletes_nothing(tmp_path):
    files = _user_files(tmp_path)
    (tmp_path / "metrics.jsonl").write_bytes(b'{"step": 1, "mine": true}\n')
    files["metrics.jsonl"] = b'{"step": 1, "mine": true}\n'
    with pytest.raises(ConfigError) as e:
        check_run_dir(_exp(tmp_path), force=True)
    msg = str(e.value)
    assert "config.yaml" in msg and str(tmp_path / "metrics.jsonl") in msg and "nothing was deleted" in msg
    assert "notes.md" not in msg  # not a run's file: never a candidate
    assert {rel: (tmp_path / rel).read_bytes() for rel in files} == files
    # a directory with nothing of a run's in it: --force has nothing to delete, and the run may start
    other = tmp_path / "fresh"
    _user_files(other)
    check_run_dir(_exp(other), force=True)


def test_force_in_a_run_leaves_the_users_files_beside_the_runs(tmp_path):
    claim_run_dir(_exp(tmp_path))
    files = _user_files(tmp_path)
    for rel in (
        "eval/grpo-test.json",
        "eval/grpo-test.predictions.jsonl",
        "world/world.json",
        "sft/teacher-4.jsonl",
    ):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("{}\n")
    (tmp_path / "world" / "model-small").mkdir()
    check_run_dir(_exp(tmp_path), force=True)
    claim_run_dir(_exp(tmp_path), force=True)
    assert {rel: (tmp_path / rel).read_bytes() for rel in files} == files
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert left == ["config.yaml", "eval", "eval/notes.md", "world", "world/my_world.json"]


def test_a_killed_run_is_not_restarted_without_resume(tmp_path):
    claim_run_dir(_exp(tmp_path))
    (tmp_path / "sft" / "checkpoints" / "step-000100").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"did not finish.*\n(.*\n)*.*pass --resume"):
        check_run_dir(_exp(tmp_path))
    check_run_dir(_exp(tmp_path), resume=True)
    check_run_dir(_exp(tmp_path), force=True)


def test_a_moved_run_directory_resumes(tmp_path):
    claim_run_dir(_exp(tmp_path / "a"))
    (tmp_path / "a").rename(tmp_path / "b")
    check_run_dir(_exp(tmp_path / "b"), resume=True)  # only output_dir differs
    with pytest.raises(ConfigError, match="trainer.lr"):
        check_run_dir(_exp(tmp_path / "b", "trainer.lr=5e-4"), resume=True)
