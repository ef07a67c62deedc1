"""Bootstrap intervals and paired tests (`searchrl.core.stats`), and the report that prints them, on synthetic
per-question scores whose difference is known."""

import json
import math
import random

import pytest

from searchrl.app.cli import main
from searchrl.core.stats import align, bootstrap_ci, paired_bootstrap


def coin(n: int, p: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [float(rng.random() < p) for _ in range(n)]


def test_interval_over_questions_matches_the_normal_approximation():
    scores = [[1.0] * 200 + [0.0] * 200]  # one seed: mean 0.5, standard error sqrt(0.25 / 400) = 0.025
    ci = bootstrap_ci(scores)
    assert ci.mean == 0.5 and (ci.seeds, ci.questions) == (1, 400)
    half = 1.96 * math.sqrt(0.25 / 400)
    assert abs(ci.low - (0.5 - half)) < 0.006 and abs(ci.high - (0.5 + half)) < 0.006


def test_seed_spread_widens_the_interval():
    same = [coin(300, 0.5, 1)] * 3
    spread = [[min(1.0, s + shift) for s in coin(300, 0.5, 1)] for shift in (0.0, 0.3, 0.6)]
    narrow, wide = bootstrap_ci(same), bootstrap_ci(spread)
    assert (wide.high - wide.low) > 2 * (narrow.high - narrow.low)
    assert str(narrow).count("[") == 1  # "mean [low, high]"


def test_paired_test_finds_a_known_difference_and_no_difference():
    base = [coin(200, 0.4, s) for s in range(3)]
    better = [[1.0 if i % 5 == 0 else x for i, x in enumerate(row)] for row in base]  # +1 on some questions
    t = paired_bootstrap(better, base)
    true = sum(b - a for ra, rb in zip(base, better) for a, b in zip(ra, rb)) / 600
    assert t.difference.mean == pytest.approx(true) and true > 0.05
    assert t.difference.low < true < t.difference.high and t.difference.low > 0
    assert t.p_value < 0.001 and t.significant()
    assert paired_bootstrap(base, base).p_value == 1.0  # identical: no evidence
    noise = [coin(200, 0.4, s + 10) for s in range(3)]  # another draw of the same coin: no real difference
    t0 = paired_bootstrap(noise, base)
    assert t0.p_value > 0.05 and t0.difference.low < 0 < t0.difference.high and not t0.significant()
    reverse = paired_bootstrap(base, better)
    assert reverse.difference.mean == pytest.approx(-true) and reverse.p_value < 0.001
    with pytest.raises(ValueError, match="align"):
        paired_bootstrap(base, [row[:10] for row in base])


def test_align_keeps_shared_seeds_and_questions():
    a = {0: {"q1": 1.0, "q2": 0.0, "q3": 1.0}, 1: {"q1": 0.0, "q2": 1.0, "q3": 0.0}, 2: {"q1": 1.0}}
    b = {0: {"q1": 0.0, "q2": 0.0}, 1: {"q1": 1.0, "q2": 1.0, "q3": 1.0}}
    ma, mb = align(a, b)
    assert ma == [[1.0, 0.0], [0.0, 1.0]] and mb == [[0.0, 0.0], [1.0, 1.0]]  # seeds 0, 1; questions q1, q2


def fake_run(root, name: str, stages: dict[str, list[float]], eval_em: list[float]) -> None:
    """A finished run: metrics.jsonl with held-out EM, results.json and per-question predictions."""
    run = root / name
    (run / "eval").mkdir(parents=True)
    rows = [
        {"step": i + 1, "reward/mean": 0.1 * i, "rollout/tokens_generated": 1000.0, "eval/em": em}
        for i, em in enumerate(eval_em)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    results = {}
    for stage, ems in stages.items():
        rel = f"eval/{stage}-test.predictions.jsonl"
        (run / rel).write_text(
            "".join(json.dumps({"id": f"q{i}", "em": em}) + "\n" for i, em in enumerate(ems))
        )
        results[stage] = {"n": len(ems), "em": sum(ems) / len(ems), "predictions": rel}
    (run / "results.json").write_text(json.dumps(results))


def test_report_prints_intervals_and_marks_significant_differences(tmp_path, capsys):
    runs = tmp_path / "runs"
    for seed in (0, 1, 2):
        sft = coin(150, 0.3, seed)
        grpo = [1.0 if i % 4 == 0 else x for i, x in enumerate(sft)]  # GRPO: +1 on a quarter of the misses
        ppo = [x for x in coin(150, 0.3, seed)]  # PPO: its own SFT start's scores exactly
        fake_run(runs, f"grpo-seed{seed}", {"sft": sft, "grpo": grpo}, [0.2, 0.3 + 0.01 * seed])
        fake_run(runs, f"ppo-seed{seed}", {"sft": sft, "ppo": ppo}, [0.2, 0.2])
    main(["report", str(runs), "--out", str(tmp_path / "report")])
    printed = capsys.readouterr().out
    lines = {
        ln.split("|")[1].strip() + " vs " + ln.split("|")[2].strip(): ln
        for ln in printed.splitlines()
        if ln.count("|") == 8
    }
    assert "**yes**" in lines["grpo / grpo vs grpo / sft"]  # the known improvement
    assert lines["ppo / ppo vs ppo / sft"].rstrip().endswith("| 1.0000 | no |")  # identical scores
    assert "| no |" in lines["grpo / sft vs ppo / sft"]  # the same start in both variants
    assert "| 3 | 150 |" in lines["grpo / grpo vs grpo / sft"]  # three seeds, 150 shared questions
    table = [ln for ln in printed.splitlines() if ln.startswith("| grpo | grpo | 3 |")]
    assert table and table[0].rstrip(" |").endswith("]")  # the interval column: "mean [low, high]"
    assert (tmp_path / "report" / "eval_em.png").exists()  # held-out EM over steps and tokens
