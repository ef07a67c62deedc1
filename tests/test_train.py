"""`searchrl train` end to end on the tiny model: warm start, GRPO, evaluation, table and curve; resume."""

import json
from pathlib import Path

from searchrl.cli import main

REPO = Path(__file__).resolve().parents[1]


def test_train_pipeline_and_resume(tmp_path, world_dir, tiny_model_dir, capsys):
    out = tmp_path / "run"
    args = ["train", str(REPO / "experiments" / "quickstart.yaml"), f"output_dir={out}",
            f"data.world_dir={world_dir}", f"model.path={tiny_model_dir}", "warm_start.teacher_passes=1",
            "warm_start.trainer={steps: 2, batch_size: 4, micro_batch_size: 4, lr: 1.0e-3, save_every: 1}",
            "trainer={steps: 2, batch_size: 2, micro_batch_size: 8, lr: 1.0e-4, save_every: 1}",
            "rollout.group_size=4", "rollout.max_new_tokens=12", "rollout.max_total_tokens=200", "eval.limit=6"]  # fmt: skip
    main(args)
    printed = capsys.readouterr().out
    assert (
        "| untrained (test) | 6 |" in printed
        and "| sft (test) | 6 |" in printed
        and "| grpo (test) | 6 |" in printed
    )
    results = json.loads((out / "results.json").read_text())
    assert set(results) == {"untrained", "sft", "grpo"}
    assert (out / "learning_curve.png").stat().st_size > 1000
    assert (out / "sft" / "final" / "config.json").exists() and (out / "final" / "config.json").exists()
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
    assert (out / "config.yaml").exists() and (out / "sft" / "teacher-1.jsonl").exists()
    # a second run with --resume finds both stages finished and only evaluates again
    main([*args, "--resume"])
    assert json.loads((out / "results.json").read_text()) == results
