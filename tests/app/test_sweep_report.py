"""Sweeps (names, dry run, resume, a failing run recorded) and reports (table, plots, HTML) end to end."""

import json
import shutil

import pytest

from searchrl.app.report import report, variant_of
from searchrl.app.sweep import load_sweep, run_sweep
from searchrl.core.errors import ConfigError


def write_sweep(tmp_path, world_dir, tiny_model_dir, extra=""):
    base = tmp_path / "base.yaml"
    base.write_text(f"""data: {{world_dir: {world_dir}}}
model: {{path: {tiny_model_dir}}}
env: {{template: short, topk: 2, max_turns: 2}}
rollout: {{max_new_tokens: 8, max_total_tokens: 160, temperature: 1.0}}
rewards: [{{name: f1}}]
algorithm: {{name: grpo, group_size: 2}}
trainer: {{steps: 2, batch_size: 2, micro_batch_size: 4, lr: 1.0e-3, save_every: 2}}
eval: {{split: test, limit: 4}}
""")
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(f"""name: t
base: base.yaml
variants:
  - {{name: a}}
  - {{name: b, overrides: [trainer.lr=2.0e-3]}}
{extra}grid:
  seed: [0, 1]
""")
    return sweep


def test_sweep_names_and_errors(tmp_path, world_dir, tiny_model_dir):
    sw = load_sweep(write_sweep(tmp_path, world_dir, tiny_model_dir), tmp_path / "runs")
    assert [r.name for r in sw.runs] == ["a-seed0", "a-seed1", "b-seed0", "b-seed1"]
    assert sw.runs[3].overrides == ("trainer.lr=2.0e-3", "seed=1")
    bad = tmp_path / "bad.yaml"
    bad.write_text("base: base.yaml\nvariants: [{name: a}, {name: a}]\n")
    with pytest.raises(ConfigError, match="two runs would be named 'a'"):
        load_sweep(bad)
    bad.write_text("base: base.yaml\ngrdi: {seed: [1]}\n")
    with pytest.raises(ConfigError, match="key 'grdi': unknown key"):
        load_sweep(bad)


def test_sweep_runs_resumes_records_failures_and_reports(tmp_path, world_dir, tiny_model_dir, capsys):
    extra = "  - {name: broken, overrides: [data.world_dir=/nonexistent/world]}\n"
    sw = load_sweep(write_sweep(tmp_path, world_dir, tiny_model_dir, extra), tmp_path / "runs")
    sw.runs = [r for r in sw.runs if r.name.endswith("seed0") or r.name == "a-seed1"]  # keep the test short
    status = run_sweep(sw, jobs=2)
    assert {n: s["status"] for n, s in status.items()} == {
        "a-seed0": "done",
        "a-seed1": "done",
        "b-seed0": "done",
        "broken-seed0": "failed",
    }
    assert "no world found" in (sw.dir / "broken-seed0" / "sweep.log").read_text()
    assert json.loads((sw.dir / "sweep.json").read_text())["broken-seed0"]["returncode"] != 0
    capsys.readouterr()
    run_sweep(sw, dry_run=True)
    listing = capsys.readouterr().out
    assert "done  a-seed0" in listing and "todo  broken-seed0" in listing  # finished runs are skipped
    # a run interrupted after its last checkpoint (killed before its results) continues from it
    run = sw.dir / "a-seed1"
    (run / "results.json").unlink()
    shutil.rmtree(run / "final")
    status = run_sweep(sw)
    assert status["a-seed1"]["status"] == "done"
    assert (
        "resumed from" in (run / "sweep.log").read_text() and "step-000002" in (run / "sweep.log").read_text()
    )
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2
    page = report([sw.dir], tmp_path / "report")
    md = (tmp_path / "report" / "report.md").read_text()
    assert "| a | grpo | 2 | " in md and "| b | grpo | 1 | " in md and " ± " in md
    assert (tmp_path / "report" / "reward_mean.png").exists() and "<table>" in page.read_text()
    # the failed run is named as missing, not silently left out of the averages
    assert "1 sweep run(s) failed and are not in the table" in md and "- broken-seed0: exit code" in md
    assert "broken-seed0 (exit" in page.read_text()
    assert variant_of("ppo-lowkl-seed12") == "ppo-lowkl"


def test_token_axis_labels_are_compact():
    from searchrl.app.report import compact_count

    assert [compact_count(x) for x in (0, 950, 12_000, 120_000, 1_500_000)] == [
        "0",
        "950",
        "12k",
        "120k",
        "1.5M",
    ]


def test_html_table_marks_header_cells():
    from searchrl.app.report import html_table

    md = "| variant | em |\n|---|---|\n| grpo | 0.3 ± 0.1 |"
    out = html_table(md)
    assert out.startswith('<thead><tr><th scope="col">variant</th><th scope="col">em</th></tr></thead>')
    assert '<tr><th scope="row">grpo</th><td>0.3 ± 0.1</td></tr>' in out and "<td>variant</td>" not in out
