"""Real data end to end, as a user's first run on their own files: HotpotQA questions with their paragraphs
(the official format, from the sample in ``../shared/data``, `SEARCHRL_SHARED_DATA`), BM25 over those
paragraphs, a model directory as a download looks (a small random model at Qwen2.5's real vocabulary, with its
tokenizer and chat template), LoRA; the templates users start from (`experiments/templates/`: GRPO, PPO, and
GRPO in the model's own tool-calling format through its chat template) a few steps each through `searchrl validate`, `train --dry-run` and `train`, then the papers' evaluation (EM and
F1, standard normalisation) on several datasets in one command, one table row each. Deselected where the
sample data is absent (the project does not require it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from searchrl.app.cli import main

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "template, algorithm", [("qa_grpo", "grpo"), ("qa_ppo", "ppo"), ("qa_tools", "grpo")]
)
def test_hotpotqa_trains_with_lora_and_evaluates(
    template, algorithm, shared_data, qwen_model_dir, tmp_path, monkeypatch, capsys
):
    hotpot = shared_data / "hotpotqa"
    questions = hotpot / "hipporag_hotpotqa_train_100.json"
    corpus = hotpot / "hipporag_hotpotqa_train_100_corpus.json"
    monkeypatch.chdir(tmp_path)
    file = str(REPO / "experiments" / "templates" / f"{template}.yaml")
    overrides = [
        "data.source=hotpotqa",
        f"data.train={questions}",
        f"data.test={questions}",
        f"data.corpus={corpus}",
        f"model.path={qwen_model_dir}",
        "model.dtype=float32",
        "name=hotpot",
        "trainer.steps=2",
        "trainer.batch_size=2",
        "trainer.micro_batch_size=10",
        "rollout.max_new_tokens=16",
        "eval.limit=4",
    ]
    main(["validate", file, *overrides])
    main(["train", file, "--dry-run", *overrides])
    out = capsys.readouterr().out
    assert "data: 100 train questions" in out and f"stage {algorithm}: 2 steps" in out
    main(["train", file, *overrides])
    run = tmp_path / "runs" / "hotpot"
    results = json.loads((run / "results.json").read_text())
    assert set(results) == {"untrained", algorithm} and results[algorithm]["n"] == 4
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["train/sequences"] > 0 for r in rows)
    assert (run / "final" / "adapter_config.json").exists()  # LoRA
    if template != "qa_grpo":
        return
    # the seven-dataset evaluation of the papers, over local files: one command, one row per dataset
    capsys.readouterr()
    data = [f"hotpotqa={questions},{corpus}"] + [
        f"{name}={shared_data / name / questions_file},{corpus}"
        for name, questions_file in (("nq", "test_subsample.jsonl"), ("bamboogle", "test.jsonl"))
    ]
    datasets = [x for d in data for x in ("--data", d)]
    main(
        [
            "eval",
            file,
            "--model",
            str(run / "final"),
            *datasets,
            *overrides,
            "eval.limit=3",
            "--data-format",
            "auto",
        ]
    )
    table = capsys.readouterr().out
    assert "| run | n | em | f1 |" in table, table
    for name in ("hotpotqa", "nq", "bamboogle"):
        assert f"| eval-policy-{name} | 3 |" in table, table
        assert json.loads((run / f"eval-policy-{name}.json").read_text())["n"] == 3
