import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from searchrl.app.cli import main
from tests.helpers import eval_teacher

REPO = Path(__file__).resolve().parents[2]
SMALL = [
    "data.world.persons=80",
    "data.world.cities=30",
    "data.world.films=30",
    "data.world.companies=20",
    "data.world.universities=10",
    "data.world.bands=15",
    "data.world.countries=5",
    "data.world.questions=[100, 30, 60]",
]


def test_world_command_is_deterministic(tmp_path, capsys):
    main(["world", "--seed", "2", "--out", str(tmp_path / "a"), "persons=50", "questions=[50, 10, 10]"])
    main(["world", "--seed", "2", "--out", str(tmp_path / "b"), "persons=50", "questions=[50, 10, 10]"])
    assert "world seed=2" in capsys.readouterr().out
    for f in (tmp_path / "a").iterdir():
        assert f.read_bytes() == (tmp_path / "b" / f.name).read_bytes()


def test_world_command_rejects_bad_setting(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["world", "--out", str(tmp_path), "persns=5"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "key 'world.persns': unknown key" in err and "did you mean 'persons'?" in err


def test_validate(tmp_path, capsys):
    good = REPO / "experiments" / "quickstart.yaml"
    main(["validate", str(good)])
    assert f"ok      {good}" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text("env: {retriever: {name: bm52}}\n")
    with pytest.raises(SystemExit) as e:
        main(["validate", str(good), str(bad)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"{bad}: key 'env.retriever.name': unknown retriever name" in err and "did you mean 'bm25'?" in err


def test_every_shipped_experiment_validates_with_its_inputs_allowed_missing(tmp_path, capsys, monkeypatch):
    """A recipe checked before its data is downloaded (or before the run it starts from): plain `validate`
    refuses it naming the input and pointing at --allow-missing; with it, each shipped file is ok and the
    inputs still to fetch or build are listed. Run where none of them exists (a fresh directory)."""
    monkeypatch.chdir(tmp_path)
    # the agent recipe's program, importable as its comment says to run it (PYTHONPATH=examples/agents); without
    # this the test passed only after a test that had imported the module
    monkeypatch.syspath_prepend(str(REPO / "examples" / "agents"))
    files = sorted(
        str(f)
        for f in (REPO / "experiments").rglob("*.yaml")
        if "accelerate" not in f.parts and "sweeps" not in f.parts
    )
    main(["validate", *files, "--allow-missing"])
    out = capsys.readouterr().out
    assert out.count("ok      ") == len(files) > 40
    listed = [line for line in out.splitlines() if line.startswith("  missing input: ")]
    assert any("data.train = data/musique/train.jsonl (no such file)" in x for x in listed), listed
    assert any("warm_start.checkpoint = runs/quickstart/sft/final (no such directory)" in x for x in listed)
    recipe = str(REPO / "experiments" / "paper" / "stepsearch_steppo_qwen3b.yaml")
    with pytest.raises(SystemExit) as e:
        main(["validate", recipe])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "key 'data.test': no such file" in err and "--allow-missing" in err
    # a missing input never hides a wrong key: the rest of the file is still checked
    with pytest.raises(SystemExit):
        main(["validate", recipe, "--allow-missing", "trainer.stpes=3"])
    assert "stpes" in capsys.readouterr().err


def test_eval_teacher_writes_results_and_resolved_config(tmp_path, capsys):
    out = tmp_path / "run"
    eval_teacher(out, "teacher.noisy=false", "env.topk=3", *SMALL)
    printed = capsys.readouterr().out
    assert "| eval-teacher-test | 60 | 1.000 |" in printed
    metrics = json.loads((out / "eval-teacher-test.json").read_text())
    assert metrics["em"] >= 0.95 and metrics["finish_reasons"] == {"answer": 60}
    assert (out / "eval-teacher-test.config.yaml").exists() and (out / "world" / "corpus.jsonl").exists()
    assert not (out / "config.yaml").exists()  # only a run that trains here writes the run's config


def test_teacher_command(tmp_path, capsys):
    out = tmp_path / "sft.jsonl"
    main(
        [
            "teacher",
            str(REPO / "experiments" / "quickstart.yaml"),
            "--split",
            "train",
            "--out",
            str(out),
            f"output_dir={tmp_path}",
            *SMALL,
        ]
    )
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 100 and all(r["actions"] for r in rows)
    assert 0.75 <= sum(r["renamed"] for r in rows) / len(rows) <= 1.0  # rename_prob 0.9 in the quickstart


@pytest.mark.parametrize("retriever", ["bm25", "tantivy"])
def test_index_then_serve_over_http(tmp_path, fixtures, retriever):
    idx = tmp_path / "idx"
    main(["index", "--retriever", retriever, "--corpus", str(fixtures / "corpus.jsonl"), "--out", str(idx)])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "searchrl",
            "serve-retriever",
            "--retriever",
            retriever,
            "--index",
            str(idx),
            "--port",
            str(port),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        from searchrl.envs.retrievers.http import HTTPRetriever, RetrieverUnavailable

        client = HTTPRetriever(f"http://127.0.0.1:{port}", timeout=2, retries=0, retry_budget_s=0)
        deadline = time.time() + 60
        while True:
            try:
                rows = client.search(["capital of France"], 1)
                break
            except RetrieverUnavailable:
                if time.time() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.3)
        assert rows[0][0].title == "Paris"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_serve_needs_a_corpus(capsys):
    with pytest.raises(SystemExit):
        main(["serve-retriever"])
    assert "needs --corpus FILE or --index DIR" in capsys.readouterr().err


def test_unknown_override_argument_is_rejected(capsys):
    with pytest.raises(SystemExit):
        main(["world", "--out", "x", "--bogus"])


def test_eval_on_dataset_files_gives_one_row_each(tmp_path, capsys, fixtures, tiny_model_dir):
    out = tmp_path / "run"
    main(
        [
            "eval",
            str(REPO / "experiments" / "quickstart.yaml"),
            "--model",
            str(tiny_model_dir),
            "--data",
            f"musique={fixtures / 'musique.jsonl'},{fixtures / 'musique_corpus.json'}",
            "--data",
            f"hotpotqa={fixtures / 'hotpotqa.json'},{fixtures / 'hotpotqa_corpus.json'}",
            f"output_dir={out}",
            "env.max_turns=2",
            "rollout.max_new_tokens=8",
            "env.agent=rag",
        ]
    )
    printed = capsys.readouterr().out
    assert "| eval-policy-rag-musique |" in printed and "| eval-policy-rag-hotpotqa |" in printed
    m = json.loads((out / "eval-policy-rag-musique.json").read_text())
    assert m["n"] > 0 and m["tokens_per_question"] > 0 and "searches_per_question" in m
    assert (out / "eval-policy-rag-musique.predictions.jsonl").exists()
    hotpot = json.loads((out / "eval-policy-rag-hotpotqa.hotpot.json").read_text())  # the official format
    assert set(hotpot) == {"answer", "sp"} and set(hotpot["answer"]) == {"hp1", "hp2"}
    assert not (out / "eval-policy-rag-musique.hotpot.json").exists()
    with pytest.raises(SystemExit):
        main(["eval", str(REPO / "experiments" / "quickstart.yaml"), "--data", "nopath"])


def test_no_deepspeed_cpu_fallback_notice():
    """DeepSpeed's "Setting accelerator to CPU … unable to detect" is expected on a CPU and not actionable."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", "import searchrl, deepspeed"], capture_output=True, text=True, check=True
    )
    assert "Setting accelerator to CPU" not in out.stdout + out.stderr


def test_dependency_deprecations_users_cannot_act_on_are_quiet():
    """DeepSpeed ZeRO-3 calls renamed torch.distributed collectives on every step; trl reads a renamed property."""
    import subprocess
    import sys

    code = (
        "import warnings, searchrl.engine.engine\n"
        "for m in ('`torch.distributed.all_gather_into_tensor` is deprecated. Please use x',\n"
        "          '`torch.distributed.reduce_scatter_tensor` is deprecated. Please use x',\n"
        "          '`is_gradient_checkpointing` is deprecated and will be removed in v6.'):\n"
        "    warnings.warn(m, FutureWarning)\n"
        "warnings.warn('something else is deprecated', FutureWarning)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "is deprecated" in out.stderr and out.stderr.count("deprecated") == 1  # only the unrelated one


def test_every_command_and_option_says_what_it_is(capsys):
    """`searchrl --help` and each command's help describe every command, argument and option; `--version`."""
    import argparse

    from searchrl.app.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    described = {c.dest: c.help for c in sub._choices_actions}
    bare = [
        f"{name} {a.option_strings or a.dest}"
        for name, command in sub.choices.items()
        for a in command._actions
        if not isinstance(a, argparse._HelpAction) and not a.help
    ]
    assert not bare and all(described.get(name) for name in sub.choices), (bare, described)
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("searchrl ")
