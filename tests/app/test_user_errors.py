"""Every user error, in every command, is one clear message (naming the file, key or argument) with exit
code 2 and no traceback; ``--debug`` shows the traceback."""

import socket
import sys
from pathlib import Path

import pytest

from searchrl.app.cli import main
from searchrl.core.errors import ConfigError, SearchRLError

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = str(REPO / "experiments" / "quickstart.yaml")


def fails(capsys, argv, *expected):
    """``argv`` exits with code 2, printing one message (no traceback) that contains ``expected``."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert "Traceback" not in err and err.startswith("error: "), err
    for part in expected:
        assert part in err, err
    return err


def test_unreadable_configs(tmp_path, capsys):
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes("name: caf\xe9\n".encode("latin-1"))
    fails(capsys, ["train", str(bad)], str(bad), "UTF-8")
    fails(capsys, ["train", str(tmp_path)], str(tmp_path), "directory")
    base = tmp_path / "base.yaml"
    base.write_text("base: 123\n")
    fails(capsys, ["train", str(base)], str(base), "'base'")
    fails(capsys, ["train", QUICKSTART, "output_dir=runs/{nme}"], "output_dir", "{nme}", "{name}")


def test_reward_modules_are_checked_at_validate_time(tmp_path, capsys, monkeypatch):
    (tmp_path / "broken_rewards.py").write_text("def score(traj:\n    return 1\n")
    (tmp_path / "odd_rewards.py").write_text("def score(a, b, c):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for module, why in (("broken_rewards", "SyntaxError"), ("odd_rewards", "calling convention")):
        with pytest.raises(SystemExit) as e:
            main(["validate", QUICKSTART, "--set", f"rewards=[{{name: '{module}:score'}}]"])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "rewards[0]" in err and f"{module}:score" in err and why in err, err
        fails(
            capsys,
            ["train", QUICKSTART, f"rewards=[{{name: '{module}:score'}}]", f"output_dir={tmp_path}/r"],
            "rewards[0]",
            why,
        )
    sys.modules.pop("broken_rewards", None)
    sys.modules.pop("odd_rewards", None)


def test_unknown_retriever_arguments(tmp_path, capsys, fixtures):
    fails(
        capsys,
        ["train", QUICKSTART, "env.retriever.args={k1: 2, bogus: 1}", f"output_dir={tmp_path}"],
        "env.retriever.args.bogus",
    )
    fails(
        capsys,
        [
            "index",
            "--corpus",
            str(fixtures / "corpus.jsonl"),
            "--out",
            str(tmp_path / "i"),
            "--arg",
            "bogus=1",
        ],
        "--arg bogus",
        "k1",
    )


def test_bad_data_files(tmp_path, capsys, fixtures):
    empty, nojson, noid, latin = (
        tmp_path / n for n in ("empty.jsonl", "nojson.jsonl", "noid.json", "l.jsonl")
    )
    empty.write_text("")
    nojson.write_text('{"contents": "a"}\nnot json\n')
    noid.write_text('[{"title": "a"}]')
    latin.write_bytes('{"contents": "caf\xe9"}\n'.encode("latin-1"))
    for corpus, why in ((empty, "no documents"), (nojson, "line 2"), (noid, "text"), (latin, "UTF-8")):
        fails(capsys, ["index", "--corpus", str(corpus), "--out", str(tmp_path / "i")], str(corpus), why)
    questions = tmp_path / "q.jsonl"
    questions.write_text('{"id": "1", "answer": "x"}\n')
    hotpot = tmp_path / "h.json"
    hotpot.write_text('[{"question": "q", "answer": "a", "supporting_facts": [], "context": []}]')

    def eval_on(path, *options):
        corpus = fixtures / "corpus.jsonl"
        return [
            "eval",
            QUICKSTART,
            "--agent",
            "teacher",
            "--data",
            f"q={path},{corpus}",
            *options,
            f"output_dir={tmp_path}/e",
        ]

    fails(capsys, eval_on(questions), str(questions), "cannot tell the format", "flashrag")
    fails(capsys, eval_on(questions, "--data-format", "flashrag"), str(questions), "row 0 needs 'question'")
    fails(capsys, eval_on(hotpot), str(hotpot), "not a hotpotqa question file", "'_id'")
    fails(capsys, eval_on(empty), str(empty), "no questions")


def test_bad_arguments(tmp_path, capsys, fixtures):
    fails(
        capsys,
        ["eval", QUICKSTART, "--split", "validation", f"output_dir={tmp_path}", "eval.limit=2"],
        "eval.split",
        "validation",
        "valid: dev, test, train",
    )
    fails(
        capsys,
        ["eval", QUICKSTART, "--model", str(tmp_path / "nope"), f"output_dir={tmp_path}", "eval.limit=2"],
        "--model",
        str(tmp_path / "nope"),
    )
    fails(
        capsys,
        ["serve-retriever", "--corpus", str(fixtures / "corpus.jsonl"), "--port", "99999"],
        "--port",
        "99999",
    )
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        fails(
            capsys,
            ["serve-retriever", "--corpus", str(fixtures / "corpus.jsonl"), "--port", port],
            port,
            "in use",
        )


def test_debug_shows_the_traceback(tmp_path):
    with pytest.raises(Exception) as e:
        main(["--debug", "train", str(tmp_path)])
    assert not isinstance(e.value, SystemExit)


def test_a_reward_that_returns_none_or_raises_is_named(monkeypatch):
    import types

    from searchrl.core.config import RewardSpec
    from searchrl.core.errors import SearchRLError
    from searchrl.core.records import Example
    from searchrl.core.types import Segment, Trajectory
    from searchrl.rewards.pipeline import RewardPipeline

    def boom(traj):
        raise KeyError("gold")

    mod = types.ModuleType("flaky_rewards")
    mod.none, mod.boom = (lambda traj: None), boom  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flaky_rewards", mod)
    traj = Trajectory(Example("q1", "who?", ("x",)), [Segment("prompt", [1])])
    for name, why in (("flaky_rewards:none", "returned None"), ("flaky_rewards:boom", "KeyError")):
        with pytest.raises(SearchRLError, match=f"reward '{name}'.*{why}"):
            RewardPipeline([RewardSpec(name=name)])([traj])


def test_one_key_value_parser_for_overrides_args_and_world_settings(tmp_path, capsys, fixtures):
    fails(capsys, ["train", QUICKSTART, "env.topk"], "override must look like 'section.key=value'")
    fails(
        capsys,
        ["world", "--out", str(tmp_path / "w"), "persons"],
        "world setting must look like 'persons=200'",
    )
    fails(
        capsys,
        ["index", "--corpus", str(fixtures / "corpus.jsonl"), "--out", str(tmp_path / "i"), "--arg", "k1"],
        "--arg must look like 'key=value'",
    )
    fails(
        capsys,
        ["world", "--out", str(tmp_path / "w"), "persons=[1"],
        "key 'persons': value is not valid YAML",
    )


def test_a_hub_id_is_passed_on_as_a_model(monkeypatch, tmp_path):
    """``--model org/name`` goes to transformers (GPU users with the hub); only local paths are checked."""
    from searchrl.app.evaluate import check_model_dir as _check_model_dir

    _check_model_dir("Qwen/Qwen2.5-0.5B-Instruct")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SearchRLError, match="does not exist"):
        _check_model_dir("./runs/nope")
    with pytest.raises(SearchRLError, match="does not exist"):
        _check_model_dir(str(tmp_path / "nope"))


def test_stepsearch_public_code_needs_its_document_layout(tmp_path, capsys):
    """StepSearch's public parser on search_r1-formatted documents would score every gain and penalty 0."""
    steppo = str(REPO / "experiments" / "synthetic" / "steppo.yaml")
    compat = "rewards=[{name: stepsearch, args: {public_code_compat: true}}]"
    with pytest.raises(SystemExit) as e:
        main(["validate", steppo, "--set", compat])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "env.doc_format" in err and "rewards[0].args.public_code_compat" in err, err
    main(["validate", steppo, "--set", compat, "--set", "env.doc_format=stepsearch"])  # the pair is fine
    fails(
        capsys, ["train", steppo, compat, f"output_dir={tmp_path}/r"], "env.doc_format", "public_code_compat"
    )


def test_force_in_a_directory_that_is_not_a_run_deletes_nothing(tmp_path, capsys):
    out = tmp_path / "mine"
    files = {"eval/notes.md": b"notes\n", "world/my_world.json": b"{}\n", "metrics.jsonl": b'{"step": 1}\n'}
    for rel, data in files.items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_bytes(data)
    fails(
        capsys,
        ["train", QUICKSTART, f"output_dir={out}", "--force"],
        str(out / "metrics.jsonl"),
        "config.yaml",
    )
    assert {rel: (out / rel).read_bytes() for rel in files} == files


def test_hostile_and_careless_configs(tmp_path, capsys):
    twice = tmp_path / "twice.yaml"
    twice.write_text("name: t\ntrainer:\n  lr: 0.5\nseed: 1\ntrainer:\n  lr: 0.1\n")
    fails(capsys, ["train", str(twice)], str(twice), "'trainer' is given twice", "line 2", "line 5")
    tagged = tmp_path / "sweep.yaml"
    marker = tmp_path / "ran"
    tagged.write_text(f"name: !!python/object/apply:os.system ['touch {marker}']\nbase: x.yaml\n")
    fails(capsys, ["sweep", str(tagged)], str(tagged), "tags that build Python objects are refused")
    fails(capsys, ["train", str(tagged)], str(tagged), "tags that build Python objects are refused")
    assert not marker.exists()
    latin = tmp_path / "latin.yaml"
    latin.write_bytes("name: a\nseed: 1\nx: caf\xe9\n".encode("latin-1"))
    fails(capsys, ["train", str(latin)], str(latin), "line 3")
    for override, key in (
        ("algorithm.group_size=1", "group_size must be at least 2"),
        ("algorithm.clip_low=-0.5", "clip_low must be in [0, 1)"),
        ("algorithm={name: slate, k: 1}", "k must be at least 2"),
        (
            "algorithm={name: slate, judge: llm, judge_args: {model: m, time_out: 5}}",
            "did you mean 'timeout'",
        ),
    ):
        fails(capsys, ["train", QUICKSTART, override, f"output_dir={tmp_path}/r"], key)
    assert not (tmp_path / "r").exists()


def test_server_flags_in_range(capsys, fixtures):
    corpus = str(fixtures / "corpus.jsonl")
    for flag, value in (("--max-queries", "0"), ("--max-topk", "-1"), ("--timeout", "0")):
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            main(["serve-retriever", "--corpus", corpus, flag, value])
        err = capsys.readouterr().err
        assert e.value.code == 2 and flag in err and "must be above 0" in err, err
    with pytest.raises(SystemExit) as e:
        main(["serve-model", "--model", "x", "--max-tokens", "0"])
    assert e.value.code == 2 and "--max-tokens" in capsys.readouterr().err


def test_bad_answers_and_duplicate_documents(tmp_path, capsys, fixtures):
    corpus = fixtures / "corpus.jsonl"
    for answers, why in (
        ("[null]", "answer 0 must be a non-empty string"),
        ("[]", "is empty"),
        ("42", "must be a list"),
    ):
        q = tmp_path / "q.jsonl"
        q.write_text(
            '{"id": "a", "question": "q?", "golden_answers": ["x"]}\n'
            f'{{"id": "b", "question": "q?", "golden_answers": {answers}}}\n'
        )
        fails(
            capsys,
            [
                "eval",
                QUICKSTART,
                "--agent",
                "teacher",
                "--data",
                f"q={q},{corpus}",
                "--data-format",
                "flashrag",
                f"output_dir={tmp_path}/e",
            ],
            str(q),
            "row 1",
            "golden_answers",
            why,
        )
    dup = tmp_path / "dup.jsonl"
    dup.write_text(
        '{"id": "d1", "contents": "A\\na"}\n{"id": "d2", "contents": "B\\nb"}\n{"id": "d1", "contents": "C\\nc"}\n'
    )
    fails(capsys, ["index", "--corpus", str(dup), "--out", str(tmp_path / "i")], str(dup), "'d1'", "unique")
    assert not (tmp_path / "i" / "docs.arrow").exists()
    from searchrl.core.errors import DataError
    from searchrl.data.corpus import load_corpus

    with pytest.raises(DataError, match="'d1'"):
        load_corpus(dup)


def test_a_token_budget_shorter_than_the_prompt_is_refused(tmp_path, capsys, world_dir, agent_model_dir):
    fails(
        capsys,
        [
            "train",
            QUICKSTART,
            f"output_dir={tmp_path}/r",
            f"data.world_dir={world_dir}",
            f"warm_start.checkpoint={agent_model_dir}",
            "rollout.max_total_tokens=8",
        ],
        "rollout.max_total_tokens",
        "longest prompt",
    )


def test_a_bad_byte_is_reported_on_its_own_line(tmp_path):
    from searchrl.core.errors import DataError
    from searchrl.data.example import read_jsonl

    bad = tmp_path / "q.jsonl"
    bad.write_bytes(b'{"a": 1}\n' * 2000 + b'{"a": "caf\xe9"}\n')  # past the first 8 kB a text reader decodes
    with pytest.raises(DataError, match=r"line 2001,"):
        list(read_jsonl(bad))


def test_a_missing_index_directory_is_named(tmp_path, capsys):
    fails(
        capsys,
        ["serve-retriever", "--index", str(tmp_path / "nope")],
        "--index",
        str(tmp_path / "nope"),
        "not found",
    )


def test_validate_catches_what_train_would_refuse(tmp_path, capsys):
    """`validate FILE key=value` takes overrides as `train` does; a missing model or checkpoint directory, a
    guard whose min is above its max, and `train --resume --force` are refused before anything loads."""

    def invalid(argv, *expected):  # validate reports each file and exits 2, as train does
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith("invalid ") and "Traceback" not in err, err
        assert all(part in err for part in expected), err

    capsys.readouterr()
    main(["validate", QUICKSTART, "env.topk=2"])
    assert "ok" in capsys.readouterr().out
    invalid(["validate", QUICKSTART, "env.topk=0"], "env.topk")
    invalid(["validate", QUICKSTART, f"model.path={tmp_path}/nope/model"], "model.path", "no such directory")
    invalid(
        ["validate", QUICKSTART, "warm_start.checkpoint=runs/never/sft/final"],
        "warm_start.checkpoint",
        "run the quickstart first",
    )
    invalid(
        ["validate", QUICKSTART, "trainer.guards={monitors: [{metric: kl, min: 2.0, max: 1.0}]}"],
        "min 2.0 is above max 1.0",
    )
    fails(capsys, ["train", QUICKSTART, "--resume", "--force"], "--resume", "--force")
    main(["validate", QUICKSTART, "model.path=Qwen/Qwen2.5-7B"])  # a hub id: not checked here
    invalid(["validate", QUICKSTART, "data.source=hotpotqa"], "model.path", "synthetic world")
    invalid(
        ["validate", QUICKSTART, "data.source=hotpotqa", "model.path=Qwen/Qwen2.5-7B", "warm_start=null"],
        "data.test",
        "none is given",
    )
    # what a stage refuses when it starts, found at load: the batch shape of the GRPO stage (5 samples of 16
    # questions do not split into micro-batches of 32) and of the warm start; the teacher off the synthetic world
    invalid(
        ["validate", QUICKSTART, "algorithm.group_size=5"], "key 'trainer'", "micro_batch_size (32)", "grpo"
    )
    invalid(["validate", QUICKSTART, "warm_start.trainer.mini_batches=3"], "warm_start.trainer", "sft stage")
    flashrag = tmp_path / "q.jsonl"
    flashrag.write_text('{"id": "1", "question": "Who?", "golden_answers": ["A"]}\n')
    real = [
        "data.source=flashrag",
        f"data.train={flashrag}",
        f"data.test={flashrag}",
        "model.path=Qwen/Qwen2.5-7B",
    ]
    invalid(["validate", QUICKSTART, *real], "key 'warm_start'", "synthetic world's scripted teacher")
    main(["validate", QUICKSTART, *real, "warm_start=null"])
    # a misspelt section on the command line is the command line's, not the file's
    invalid(["validate", QUICKSTART, "trainr.steps=8"], "command line override 'trainr.steps=8'", "'trainer'")


def test_data_files_duplicate_ids_and_byte_order_marks(tmp_path, capsys):
    """Two questions under one id are refused, naming both records; a UTF-8 byte-order mark (Windows editors
    write one) is read past, in JSONL and JSON; a negative world size names its key."""
    import json

    from searchrl.core.errors import DataError
    from searchrl.data.loaders import load_examples

    rows = [
        {"id": "a", "question": "Q1?", "golden_answers": ["x"]},
        {"id": "b", "question": "Q2?", "golden_answers": ["y"]},
    ]
    dup = tmp_path / "dup.jsonl"
    dup.write_text("\n".join(json.dumps(r) for r in [*rows, {**rows[0], "question": "Q3?"}]))
    with pytest.raises(DataError, match=r"'a' appears twice \(records 1 and 3\)"):
        load_examples(dup)
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + "\n".join(json.dumps(r) for r in rows).encode())
    assert [e.id for e in load_examples(bom)] == ["a", "b"]
    bom_json = tmp_path / "bom.json"
    bom_json.write_bytes(b"\xef\xbb\xbf" + json.dumps(rows).encode())
    from searchrl.data.example import read_json

    assert read_json(bom_json) == rows
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["validate", QUICKSTART, "data.world.persons=-3"])
    assert "data.world.persons" in capsys.readouterr().err


def test_an_index_directory_that_is_not_an_index_is_named(tmp_path, capsys):
    empty = tmp_path / "not-an-index"
    empty.mkdir()
    fails(
        capsys,
        ["serve-retriever", "--index", str(empty), "--port", "0"],
        str(empty),
        "not an index directory",
    )


def test_validate_counts_the_longest_prompt_against_the_budget(make_exp, capsys):
    """`validate` refuses a rollout.max_total_tokens the longest training prompt fills, as `train` would,
    when a local tokenizer and the questions are at hand; otherwise it says why it could not count (-v)."""
    from searchrl.app.experiment import check_prompt_budget

    grpo = "algorithm={name: grpo, group_size: 2}"
    assert check_prompt_budget(make_exp(grpo), "exp.yaml") is None  # counted, and it fits
    with pytest.raises(ConfigError, match=r"exp.yaml: key 'rollout.max_total_tokens': leaves no room to act"):
        check_prompt_budget(make_exp(grpo, "rollout.max_total_tokens=5"), "exp.yaml")
    assert "no training stage" in check_prompt_budget(make_exp(), "exp.yaml")
    hub = make_exp(grpo, "model.path=Qwen/Qwen2.5-3B")
    assert "no local model directory" in check_prompt_budget(hub, "exp.yaml")


def test_a_rollout_worker_that_died_past_its_restarts_is_one_line(tmp_path, capsys, monkeypatch):
    """A rollout worker killed more often than max_restarts allows stops `train` with one `error:` line naming
    its exit codes and how to continue (exit 2), as every user error."""
    from searchrl.app import commands
    from searchrl.rollout.worker_process import RolloutWorkerDied

    def died(args):
        raise RolloutWorkerDied(
            "the rollout worker process exited with code -9, -9 (killed, out of memory, or a crash in a native "
            "library) after 1 restarts (trainer.async_rollout.max_restarts: 1) before step 3's episodes"
        )

    monkeypatch.setattr(commands, "cmd_train", died)
    err = fails(capsys, ["train", QUICKSTART], "code -9, -9", "max_restarts: 1", "--resume")
    assert err.count("\n") == 1
