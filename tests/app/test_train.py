"""`searchrl train` end to end on the tiny model: warm start, GRPO, evaluation, table and curve; resume."""

import json
import shutil
from pathlib import Path

import pytest

from searchrl.app.cli import main
from searchrl.engine.checkpoint import has_weights
from searchrl.engine.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]


def test_train_pipeline_and_resume(tmp_path, world_dir, tiny_model_dir, capsys):
    out = tmp_path / "run"
    args = [
        "train",
        str(REPO / "experiments" / "quickstart.yaml"),
        f"output_dir={out}",
        f"data.world_dir={world_dir}",
        f"model.path={tiny_model_dir}",
        "warm_start.teacher_passes=1",
        "warm_start.trainer={steps: 2, batch_size: 4, micro_batch_size: 4, lr: 1.0e-3, save_every: 1}",
        "trainer={steps: 2, batch_size: 2, micro_batch_size: 8, lr: 1.0e-4, save_every: 1}",
        "algorithm.group_size=4",
        "rollout.max_new_tokens=12",
        "rollout.max_total_tokens=200",
        "eval.limit=6",
    ]
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

    # a kill mid-export (before exports were atomic) leaves final/ without weights: --resume redoes the export
    (out / "final" / "model.safetensors").unlink()
    main([*args, "--resume"])
    assert has_weights(out / "final") and json.loads((out / "results.json").read_text()) == results
    # the latest checkpoint incomplete and metrics.jsonl's last line torn: resume from the newest valid one
    losses = [r["train/loss"] for r in read_metrics(out / "metrics.jsonl")]
    shutil.rmtree(out / "final")
    (out / "checkpoints" / "step-000002" / "trainer.json").unlink()
    with (out / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "train/lo')
    capsys.readouterr()
    main([*args, "--resume"])
    printed = capsys.readouterr().out
    assert (
        "checkpoint skipped: step-000002 (trainer.json unreadable" in printed
        and "resuming from the newest valid one" in printed
        and "step-000001" in printed
    )
    assert [r["train/loss"] for r in read_metrics(out / "metrics.jsonl")] == pytest.approx(losses, abs=1e-6)
    assert has_weights(out / "final")
    # the run's config.yaml is written once: another config in this directory is refused, naming the keys
    saved = (out / "config.yaml").read_text()
    with pytest.raises(SystemExit) as e:
        main([*args, "eval.limit=5", "--resume"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "trained with another config" in err and "eval.limit: 6 -> 5" in err and "--force" in err
    assert (out / "config.yaml").read_text() == saved
    # `searchrl eval` on the run writes its config beside its results, never over the run's
    main(["eval", args[1], *args[2:], "eval.limit=3"])
    assert (out / "config.yaml").read_text() == saved
    assert "limit: 3" in (out / "eval-policy-test.config.yaml").read_text()


def test_same_seed_same_machine_gives_identical_runs(tmp_path, world_dir, tiny_model_dir):
    """What the README's reproducibility claim rests on: the same config and seed, run twice on one machine,
    give the same evaluations, the same per-step metrics (timings aside) and the same weights."""
    import torch
    from safetensors.torch import load_file

    def run(out: Path) -> tuple[dict, list[dict], dict]:
        main(
            [
                "train",
                str(REPO / "experiments" / "quickstart.yaml"),
                f"output_dir={out}",
                f"data.world_dir={world_dir}",
                f"model.path={tiny_model_dir}",
                "seed=3",
                "warm_start.teacher_passes=1",
                "warm_start.trainer={steps: 2, batch_size: 4, micro_batch_size: 4, lr: 1.0e-3, save_every: 2}",
                "trainer={steps: 2, batch_size: 2, micro_batch_size: 8, lr: 1.0e-4, save_every: 2}",
                "algorithm.group_size=4",
                "rollout.max_new_tokens=12",
                "rollout.max_total_tokens=200",
                "eval.limit=6",
            ]
        )
        # service/…: the counters of every live judge or summarizer client of the process, including clients that
        # earlier tests left for the garbage collector (present in run a or not, by the collector's timing)
        metrics = [
            {
                k: v
                for k, v in r.items()
                if not k.startswith(("time/", "mem/", "service/")) and "per_second" not in k
            }
            for r in read_metrics(out / "metrics.jsonl")
        ]
        return (
            json.loads((out / "results.json").read_text()),
            metrics,
            load_file(out / "final" / "model.safetensors"),
        )

    a, b = run(tmp_path / "a"), run(tmp_path / "b")
    assert a[0] == b[0] and a[1] == b[1]
    assert a[2].keys() == b[2].keys() and all(torch.equal(a[2][k], b[2][k]) for k in a[2])


def test_training_processes_grow_cuda_segments_unless_the_user_chose(make_exp):
    """`default_cuda_allocator`: expandable segments for a training process (the H200's slow second step,
    docs/benchmarks.md), never over the user's own PYTORCH_CUDA_ALLOC_CONF (an empty one included), and not
    beside vLLM's sleep mode, whose memory pool refuses them."""
    from searchrl.app.train import ALLOC_CONF, default_cuda_allocator

    exp = make_exp()
    env: dict[str, str] = {}
    assert default_cuda_allocator(exp, env) == "expandable_segments:True" == env[ALLOC_CONF]
    for mine in ("", "max_split_size_mb:128"):
        env = {ALLOC_CONF: mine}
        assert default_cuda_allocator(exp, env) is None and env == {ALLOC_CONF: mine}
    vllm = make_exp("rollout.backend=vllm", "rollout.backend_args={enable_sleep_mode: true}")
    env = {}
    assert default_cuda_allocator(vllm, env) is None and env == {}
