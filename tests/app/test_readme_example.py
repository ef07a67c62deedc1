"""The README's "Your own experiment", run as printed: its YAML and Python blocks are extracted from README.md
literally and written to files; its data files are made from small real data (FlashRAG format); the one thing
changed is the model, a local model directory at Qwen2.5's vocabulary in place of the hub id (no hub here).
Then `validate` and `train --dry-run` as the README prints them, and a one-step `train`."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from searchrl.app.cli import main

REPO = Path(__file__).resolve().parents[2]


def readme_blocks() -> dict[str, str]:
    """The fenced blocks of the README's "Your own experiment" section, keyed by their first line's file name
    (``# my_experiment.yaml``) or by language (``bash``)."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Your own experiment") :]
    section = section[: section.index("\n## ", 5)]
    out = {}
    for lang, body in re.findall(r"```(\w+)\n(.*?)```", section, re.S):
        first = body.splitlines()[0]
        name = re.match(r"# (\S+\.(?:yaml|py))", first)
        out[name.group(1) if name else lang] = body
    return out


@pytest.fixture
def user_dir(tmp_path, monkeypatch, fixtures):
    """A user's working directory: the README's files, the repository's experiments, FlashRAG data files."""
    blocks = readme_blocks()
    assert {"my_experiment.yaml", "my_rewards.py", "bash"} <= set(blocks)
    (tmp_path / "my_experiment.yaml").write_text(blocks["my_experiment.yaml"])
    (tmp_path / "my_rewards.py").write_text(blocks["my_rewards.py"])
    (tmp_path / "experiments").symlink_to(REPO / "experiments")
    questions = [json.loads(x) for x in (fixtures / "flashrag.jsonl").read_text().splitlines()]
    for name in ("nq_train.jsonl", "nq_test.jsonl"):
        (tmp_path / name).write_text("".join(json.dumps(q) + "\n" for q in questions))
    (tmp_path / "wiki.jsonl").write_text((fixtures / "corpus.jsonl").read_text())
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # my_rewards.py "on PYTHONPATH"
    yield tmp_path, blocks
    sys.modules.pop("my_rewards", None)


def commands(bash: str) -> list[list[str]]:
    return [line.split() for line in bash.strip().splitlines() if line.strip() and not line.startswith("#")]


def test_the_readme_example_validates_dry_runs_and_trains(user_dir, qwen_model_dir, capsys):
    tmp, blocks = user_dir
    model = f"model.path={qwen_model_dir}"  # the hub id's stand-in: a model directory as a download holds
    validate, dry, launch = commands(blocks["bash"])
    assert validate[:3] == ["searchrl", "validate", "my_experiment.yaml"] and dry[-1] == "--dry-run"
    assert launch[:2] == ["searchrl", "launch"] and launch[-2:] == ["train", "my_experiment.yaml"]

    main([*validate[1:], model])
    assert "ok      my_experiment.yaml" in capsys.readouterr().out
    main([*dry[1:], model])
    out = capsys.readouterr().out
    assert "dry run ok: my_experiment.yaml" in out and "data: 2 train questions" in out
    assert "stage grpo: 200 steps of 80 rows per process, micro-batches of 8, 10 accumulated" in out
    assert not (tmp / "runs" / "my_experiment" / "config.yaml").exists()  # a dry run writes no run

    # one step, as printed but for the model and the step's size (a laptop's minute, not a GPU's hours)
    main(
        [
            "train",
            "my_experiment.yaml",
            model,
            "model.dtype=float32",
            "trainer.steps=1",
            "trainer.batch_size=2",
            "trainer.micro_batch_size=10",
            "rollout.max_new_tokens=12",
            "eval.limit=2",
        ]
    )
    run = tmp / "runs" / "my_experiment"  # named after the file, not after the template it bases on
    results = json.loads((run / "results.json").read_text())
    assert set(results) == {"untrained", "grpo"} and results["grpo"]["n"] == 2
    row = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert {"reward/f1", "reward/my_rewards:gold_hits"} <= set(row)  # the user's reward module ran
    assert (run / "final" / "adapter_config.json").exists()  # LoRA, as the file says
