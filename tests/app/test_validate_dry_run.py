"""`validate` accepts exactly what `train --dry-run` builds (DESIGN invariant 14: what `validate` accepts,
`train` starts): over every shipped experiment (the synthetic world's, the templates and the papers' recipes
pointed at real-format files), each with a generated set of overrides (batch shapes, group sizes, token
budgets, warm starts, the tool protocol), the two agree, and both refuse with the same one message. The papers'
recipes take local inputs in place of their hub models, data and retrieval server."""

from __future__ import annotations

import random
from pathlib import Path

from searchrl.app.cli import main

REPO = Path(__file__).resolve().parents[2]
SYNTHETIC = sorted(
    [REPO / "experiments" / "quickstart.yaml", *(REPO / "experiments" / "synthetic").glob("*.yaml")]
)
TEMPLATES = sorted((REPO / "experiments" / "templates").glob("*.yaml"))
# the papers' GPU recipes, their inputs swapped for local ones (no hub, no retrieval server here)
PAPER = sorted(f for f in (REPO / "experiments" / "paper").glob("*.yaml") if not f.name.startswith("_"))

CHOICES = {
    "algorithm.group_size": [1, 2, 3, 4, 5],
    "trainer.batch_size": [1, 2, 3, 4, 6],
    "trainer.micro_batch_size": [1, 2, 4, 8, 32],
    "trainer.mini_batches": [1, 2, 3],
    "warm_start.trainer.batch_size": [2, 3, 32],
    "warm_start.trainer.micro_batch_size": [4, 16],
    "rollout.max_total_tokens": [24, 64, 4096],
}


def generated(seed: int, keys: list[str]) -> list[str]:
    rng = random.Random(seed)
    return [f"{k}={rng.choice(CHOICES[k])}" for k in keys if rng.random() < 0.5]


def outcome(argv: list[str], capsys) -> str:
    """ "ok", or the refusal's first line without its verb (`invalid …` from validate, `error: …` from train)."""
    capsys.readouterr()
    try:
        main(argv)
    except SystemExit as e:
        err = capsys.readouterr().err
        assert e.code == 2 and "Traceback" not in err, err
        first = err.strip().splitlines()[0]
        return first.removeprefix("invalid ").removeprefix("error: ")
    return "ok"


def cases(base: list[str], files: list[Path], per_file: int) -> list[tuple[Path, list[str]]]:
    out = []
    for i, f in enumerate(files):
        keys = [k for k in CHOICES if not k.startswith("warm_start") or "template" not in str(f)]
        out += [(f, base + generated(1000 * i + j, keys)) for j in range(per_file)]
    return out


def test_validate_accepts_exactly_what_a_dry_run_builds(
    tmp_path, monkeypatch, capsys, world_dir, tiny_model_dir, qwen_model_dir, fixtures
):
    monkeypatch.chdir(tmp_path)
    synthetic = [f"data.world_dir={world_dir}", f"model.path={tiny_model_dir}", "eval.limit=4"]
    questions = fixtures / "flashrag.jsonl"
    real = [
        f"data.train={questions}",
        f"data.test={questions}",
        f"data.corpus={fixtures / 'corpus.jsonl'}",
        f"model.path={qwen_model_dir}",
    ]
    local = [*real, "data.source=flashrag", f"data.dev={questions}", "env.retriever={name: bm25}"]
    checked, refused = 0, 0
    for f, over in cases(synthetic, SYNTHETIC, 1) + cases(real, TEMPLATES, 4) + cases(local, PAPER, 1):
        said = outcome(["validate", str(f), *over], capsys)
        built = outcome(["train", str(f), "--dry-run", *over], capsys)
        assert (said == "ok") == (built == "ok"), (f.name, over, said, built)
        if said != "ok":
            assert said == built, (f.name, over)  # the same refusal, named once
            refused += 1
        checked += 1
    assert checked > 50 and 5 < refused < checked - 5  # both kinds of outcome were met


def test_validate_refuses_a_model_whose_tool_calls_we_do_not_read(
    tmp_path, capsys, qwen_model_dir, fixtures, monkeypatch
):
    """A local model whose chat template writes a family's tool calls we do not read (every family we know is read
    now, so a made-up one stands in: Qwen2.5's template carrying its marker): refused by name at validate (and by
    the dry run), not read as Hermes; the user's `env.call_format` overrides it. DeepSeek V3.2's DSML, the last one
    refused, validates."""
    import shutil
    from importlib.resources import files

    from searchrl.envs import call_formats

    monkeypatch.setitem(call_formats.UNSUPPORTED, "future", ("Future Family", "FUTURE_CALLS"))
    model = tmp_path / "future-like"
    shutil.copytree(qwen_model_dir, model)
    for name in ("chat_template.jinja", "chat_template.json"):
        (model / name).unlink(missing_ok=True)
    qwen = (files("trl") / "chat_templates" / "qwen2_5.jinja").read_text()
    (model / "chat_template.jinja").write_text(qwen + "{%- if false %}FUTURE_CALLS{% endif %}")
    questions = fixtures / "flashrag.jsonl"
    over = [
        f"data.train={questions}",
        f"data.test={questions}",
        f"data.corpus={fixtures / 'corpus.jsonl'}",
        f"model.path={model}",
    ]
    template = REPO / "experiments" / "templates" / "qa_tools.yaml"
    for verb in (["validate"], ["train", "--dry-run"]):
        said = outcome([verb[0], str(template), *verb[1:], *over], capsys)
        assert "env.call_format" in said and "Future Family" in said, said
    assert outcome(["validate", str(template), *over, "env.call_format=hermes"], capsys) == "ok"
    (model / "chat_template.jinja").write_text(
        qwen + "{%- if false %}<\uff5cDSML\uff5cfunction_calls>{% endif %}"
    )
    assert outcome(["validate", str(template), *over], capsys) == "ok"
