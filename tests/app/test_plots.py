"""The learning curve's series: equal metrics drawn once, the final held-out evaluation on the curve, the SFT
stage's held-out EM as the RL panel's baseline."""

import json

from searchrl.app.plots import curve_panels, learning_curve


def write(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_curve_panels(tmp_path):
    write(
        tmp_path / "sft" / "metrics.jsonl",
        [{"step": 1, "train/loss": 3.0}, {"step": 2, "train/loss": 2.0, "eval/em": 0.25}],
    )
    rl = [{"step": s, "reward/mean": 0.1 * s, "train/em": 0.1 * s, "train/loss": 0.5} for s in (1, 2, 3)]
    rl[1]["eval/em"], rl[2]["eval/em"] = 0.3, 0.35  # every 2 steps and at the last (3)
    write(tmp_path / "metrics.jsonl", rl)
    (sft_title, sft), (title, main) = curve_panels(tmp_path)
    assert (sft_title, [s.label for s in sft]) == ("SFT warm start", ["train/loss", "eval/em"])
    assert title == "main algorithm"
    by_label = {s.label: s for s in main}
    # an EM reward: reward/mean and train/em are the same numbers, one line
    assert list(by_label) == ["reward/mean = train/em", "eval/em", "train/loss", "SFT held-out EM"]
    assert by_label["eval/em"].steps == (2, 3) and by_label["eval/em"].values == (0.3, 0.35)
    base = by_label["SFT held-out EM"]
    assert base.baseline and base.values == (0.25, 0.25) and base.steps == (1, 3)
    assert by_label["train/loss"].right_axis and not by_label["eval/em"].right_axis
    assert learning_curve(tmp_path, tmp_path / "curve.png").stat().st_size > 1000


def test_different_metrics_stay_apart_and_a_lone_loss_keeps_the_left_axis(tmp_path):
    write(tmp_path / "metrics.jsonl", [{"step": 1, "reward/mean": 0.5, "train/em": 0.2, "train/loss": 1.0}])
    [(_, main)] = curve_panels(tmp_path)
    assert [s.label for s in main] == ["reward/mean", "train/em", "train/loss"]
    write(tmp_path / "sft" / "metrics.jsonl", [{"step": 1, "train/loss": 3.0}])
    (_, sft), (_, main) = curve_panels(tmp_path)
    assert [(s.label, s.right_axis) for s in sft] == [("train/loss", False)]
    assert "SFT held-out EM" not in [s.label for s in main]  # no held-out EM in the SFT stage: no baseline
    assert curve_panels(tmp_path / "nothing") == []
