"""`searchrl view` and the training samples it shows: the samples are what the loss saw, the viewer's data
is the run's, the comparison is paired, and bad input gets a message. The page itself is tested in a real
browser by tests/test_view_browser.py."""

import json

import pytest
import torch

from searchrl.algorithms import algorithm_config
from searchrl.app.cli import main
from searchrl.app.resources import Resources
from searchrl.app.viewer.build import find, paired, view
from searchrl.core.config import SamplesConfig, TrainerConfig
from searchrl.core.errors import DataError
from searchrl.core.stats import paired_bootstrap
from searchrl.engine.samples import KINDS, read_samples, step_file
from searchrl.engine.trainer import Trainer
from searchrl.rewards import register_reward
from tests.helpers import eval_teacher


@register_reward("test_view_length")
def length_reward(traj, **_):
    """Differs between the episodes of a group even for the untrained model: the updates move the weights."""
    ids = [i for seg in traj.segments if seg.kind == "action" for i in seg.token_ids]
    return (sum(ids) % 7) / 6


def load_js(path, prefix):
    text = path.read_text(encoding="utf-8")
    assert text.startswith(prefix) and text.rstrip().endswith(";")
    return json.loads(text[len(prefix) : text.rstrip().rindex(";")].rstrip(")").rstrip())


def page_data(index):
    return load_js(index.parent / "data" / "main.js", "window.SEARCHRL = ")


def step_data(index, stage, step):
    text = (index.parent / "data" / f"{stage}-step-{step:06d}.js").read_text(encoding="utf-8")
    head = f'SEARCHRL_STEP("{stage}", {step}, '
    assert text.startswith(head) and text.endswith(");\n")
    return json.loads(text[len(head) : -3])


def train_with_capture(exp, algorithm, cfg, args, monkeypatch):
    """A trainer whose every `algo.loss` call records the rows of the micro-batch it was given."""
    tr = Trainer(
        algorithm=algorithm,
        config=algorithm_config(algorithm, args),
        model_path=exp.model.path,
        cfg=cfg,
        out_dir=exp.out,
        resources=Resources(exp),
        seed=exp.seed,
    )
    seen: dict[tuple[int, int], list[dict]] = {}
    loss = tr.algo.loss

    def spy(logp, ent, mb, values):
        out = loss(logp, ent, mb, values)
        if mb.extras.sample_row is not None:
            for b, r in enumerate(mb.extras.sample_row.tolist()):
                n = int(mb.attention_mask[b].sum())
                seen.setdefault((tr.algo.step, r), []).append(
                    {
                        "ids": mb.input_ids[b, :n].tolist(),
                        "loss_mask": mb.loss_mask[b, :n].tolist(),
                        "advantages": mb.extras.advantages[b, :n].tolist(),
                        "logp_sampled": mb.sampled_logprobs[b, :n].tolist(),
                        "logp_old": mb.extras.old_logp[b, :n].tolist(),
                        "logp": logp[b, :n].detach().tolist(),
                    }
                )
        return out

    monkeypatch.setattr(tr.algo, "loss", spy)
    return tr, seen


@pytest.mark.parametrize(("algorithm", "epochs"), [("grpo", 1), ("ppo", 2)])
def test_saved_samples_are_exactly_what_the_loss_saw(make_exp, monkeypatch, algorithm, epochs):
    exp = make_exp("rollout.temperature=1.0")
    cfg = TrainerConfig(
        steps=2,
        batch_size=4,
        micro_batch_size=3,  # rows of a group land in different micro-batches
        epochs=epochs,
        mini_batches=2 if epochs > 1 else 1,
        lr=1e-3,
        save_every=10**6,
        samples=SamplesConfig(groups=2, every=1),
    )
    tr, seen = train_with_capture(exp, algorithm, cfg, {"group_size": 3}, monkeypatch)
    tr.run()
    records = read_samples(exp.out)
    assert [r["step"] for r in records] == [1, 2]
    for rec in records:
        rows = rec["rows"]
        assert len({r["group"] for r in rows}) == 2 and len(rows) == 6  # two groups of 3 episodes
        assert rec["metrics"]["train/loss"] == pytest.approx(rec["metrics"]["train/loss"])
        for row in rows:
            calls = seen[(rec["step"] - 1, row["row"])]
            assert len(calls) == epochs  # every epoch saw the row; the sample keeps the first
            first = calls[0]
            assert row["ids"] == first["ids"]  # the ids and the mask the loss saw, exactly
            assert row["loss_mask"] == [int(x) for x in first["loss_mask"]]
            for key in ("advantages", "logp_sampled", "logp_old", "logp"):
                assert row[key] == pytest.approx(first[key], abs=1e-5), key
            # kinds: the mask is 1 exactly on action tokens (no row is untrained here)
            assert [int(k == KINDS["action"]) for k in row["kinds"]] == row["loss_mask"]
            assert len(row["tokens"]) == len(row["ids"]) and "".join(row["tokens"])
            for s in row["steps"]:
                assert row["kinds"][s["end"]] == KINDS["action"] and row["loss_mask"][s["end"]] == 1
                # a step's boundary is its action's last token: what follows is not an action token
                assert s["end"] + 1 == len(row["kinds"]) or row["kinds"][s["end"] + 1] != KINDS["action"]
    assert step_file(exp.out, 2).is_file() and not list((exp.out / "samples").glob("*.tmp"))


def test_samples_off_and_every(make_exp, tmp_path):
    """Off, or every other step; saving changes nothing the step computes (the same weights after 4 steps)."""
    exp = make_exp("rollout.temperature=1.0", "rewards=[{name: test_view_length}]")
    weights = []
    for groups, every, expect in ((0, 1, []), (1, 2, [2, 4])):
        out = tmp_path / f"g{groups}"
        cfg = TrainerConfig(
            steps=4,
            batch_size=2,
            micro_batch_size=4,
            lr=5e-3,
            save_every=10**6,
            samples=SamplesConfig(groups, every),
        )
        tr = Trainer(
            algorithm="grpo",
            config=algorithm_config("grpo", {"group_size": 2}),
            model_path=exp.model.path,
            cfg=cfg,
            out_dir=out,
            resources=Resources(exp),
        )
        before = {k: v.detach().clone() for k, v in tr.policy.named_parameters()}
        for step in range(4):
            tr.step(step)
        got = read_samples(out)
        assert [r["step"] for r in got] == expect
        assert all(len({row["group"] for row in r["rows"]}) == groups for r in got)
        weights.append({k: v.detach().clone() for k, v in tr.policy.named_parameters()})
        assert any(not torch.equal(before[k], weights[-1][k]) for k in before)  # it trained
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_the_viewer_shows_a_trained_and_evaluated_run(make_exp, monkeypatch, capsys):
    exp = make_exp("rollout.temperature=1.0", "eval.limit=6", "eval.split=test")
    cfg = TrainerConfig(steps=2, batch_size=2, micro_batch_size=4, save_every=10**6)
    tr, _ = train_with_capture(exp, "grpo", cfg, {"group_size": 2}, monkeypatch)
    tr.run()
    eval_teacher(exp.out, f"data.world_dir={exp.data.world_dir}", "env.topk=2", "eval.limit=12")
    (exp.out / "learning_curve.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    main(["view", str(exp.out)])
    index = exp.out / "view" / "index.html"
    assert index.is_file() and f"viewer: {index}" in capsys.readouterr().out
    for f in ("viewer.js", "viewer.css", "curves/learning_curve.png"):
        assert (index.parent / f).is_file(), f
    assert "http" not in (index.parent / "index.html").read_text()  # nothing from the network
    page = page_data(index)
    (ev,) = page["evals"]
    preds = [
        json.loads(x) for x in (exp.out / "eval-teacher-test.predictions.jsonl").read_text().splitlines()
    ]
    assert [r["id"] for r in ev["records"]] == [p["id"] for p in preds] and len(preds) == 12
    rec = ev["records"][0]
    kinds = [s["kind"] for s in rec["segments"]]
    assert kinds[0] == "prompt" and "action" in kinds and "transcript" not in rec
    # the segments are the transcript, split
    assert "".join(s["text"] for s in rec["segments"]) == preds[0]["transcript"]
    searched = [s for r in ev["records"] for s in r["segments"] if s.get("docs")]
    assert searched and all({"id", "title", "text", "gold"} <= set(d) for s in searched for d in s["docs"])
    assert any(d["gold"] for s in searched for d in s["docs"])  # the teacher finds gold documents
    assert page["training"] == [{"name": "main", "steps": [1, 2]}]
    saved = read_samples(exp.out)[1]
    assert step_data(index, "main", 2) == saved
    assert page["curves"] == ["curves/learning_curve.png"]


def records(ems):
    return [
        {"id": f"q{i}", "question": f"question {i}?", "em": float(e), "f1": float(e)}
        for i, e in enumerate(ems)
    ]


def test_compare_pairs_the_questions_and_tests_the_difference(tmp_path):
    a = [1, 1, 0, 1, 0, 1, 1, 0, 1, 1]
    b = [0, 1, 0, 0, 0, 1, 0, 1, 1, 0]
    for name, ems in (("a", a), ("b", b)):
        with open(tmp_path / f"{name}.predictions.jsonl", "w") as f:
            for r in records(ems)[::-1] if name == "b" else records(ems):  # another order: paired by id
                f.write(json.dumps(r) + "\n")
    got = paired(records(a), records(b)[::-1])
    ref = paired_bootstrap([a], [b])
    assert got["em"]["difference"] == pytest.approx(0.3) == pytest.approx(ref.difference.mean)
    assert (got["em"]["low"], got["em"]["high"], got["em"]["p"]) == pytest.approx(
        (ref.difference.low, ref.difference.high, ref.p_value)
    )
    assert got["counts"] == {"a_only": 4, "b_only": 1, "both": 3, "neither": 2}
    index = view(tmp_path / "a.predictions.jsonl", tmp_path / "b.predictions.jsonl", tmp_path / "v")
    cmp = page_data(index)["compare"]
    assert cmp["stats"]["counts"] == got["counts"] and cmp["a"]["name"].endswith(": a")


def test_text_that_looks_like_html_or_script_stays_data(tmp_path):
    nasty = '</script><script>alert(1)</script> "quotes" \u2028 <b>bold</b>'
    rec = {"id": "x", "question": nasty, "answers": [nasty], "prediction": nasty, "em": 0.0, "f1": 0.0}
    (tmp_path / "r.predictions.jsonl").write_text(json.dumps(rec) + "\n")
    index = view(tmp_path / "r.predictions.jsonl")
    assert index == tmp_path / "r.view" / "index.html"
    assert page_data(index)["evals"][0]["records"][0]["question"] == nasty
    assert "innerHTML" not in (index.parent / "viewer.js").read_text()  # text is only ever set as text


def test_bad_input_gets_a_message(tmp_path, capsys):
    with pytest.raises(DataError, match="does not exist"):
        find(tmp_path / "nope")
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(DataError, match="not an evaluation's predictions file"):
        find(tmp_path / "notes.txt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="holds nothing to show"):
        find(tmp_path / "empty")
    bad = tmp_path / "bad.predictions.jsonl"
    bad.write_text(json.dumps(records([1])[0]) + "\n{oops\n")
    with pytest.raises(DataError, match="bad.predictions.jsonl, line 2: not JSON"):
        view(bad)
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("a user's file")
    good = tmp_path / "good.predictions.jsonl"
    good.write_text(json.dumps(records([1])[0]) + "\n")
    with pytest.raises(SystemExit) as exc:
        main(["view", str(good), "--out", str(other)])
    assert exc.value.code == 2 and "is not empty and holds no viewer" in capsys.readouterr().err
    assert (other / "keep.txt").read_text() == "a user's file"
    with pytest.raises(DataError, match="share no question ids"):
        paired(records([1]), [{"id": "other", "question": "?", "em": 1.0}])


def test_samples_config_is_validated(make_exp):
    with pytest.raises(Exception, match="trainer.samples.every"):
        make_exp("trainer.samples.every=0")
    assert make_exp("trainer.samples.groups=0").trainer.samples.groups == 0


def test_offline_rows_are_saved_one_group_each(make_exp, small_world):
    from searchrl.core.config import TeacherConfig
    from searchrl.envs.synthetic.teacher import teacher_records

    exp = make_exp()
    resources = Resources(exp)
    recs = teacher_records(resources.env(), small_world, small_world.examples("train")[:8], TeacherConfig())
    cfg = TrainerConfig(steps=1, batch_size=4, micro_batch_size=4, save_every=10**6)
    Trainer(
        algorithm="sft",
        config=algorithm_config("sft", {}),
        model_path=exp.model.path,
        cfg=cfg,
        out_dir=exp.out,
        resources=resources,
        records=recs,
    ).run()
    (rec,) = read_samples(exp.out)
    assert [r["group"] for r in rec["rows"]] == [0, 1]  # two groups: two records, not the whole batch
    for row in rec["rows"]:
        assert sum(row["loss_mask"]) > 0 and row["steps"] and all(s["kind"] == "action" for s in row["steps"])
        assert "advantages" not in row and len(row["logp"]) == len(row["ids"])


def test_the_viewer_shows_an_evaluation_on_a_dataset_file(tmp_path, fixtures, tiny_model_dir, capsys):
    """`searchrl eval --data hotpotqa=QUESTIONS,CORPUS` then `searchrl view` on its directory: the RAG agent's
    own retrieval shows on the prompt, with the documents HotpotQA names as supporting marked gold."""
    from tests.helpers import QUICKSTART

    out = tmp_path / "run"
    data = f"hotpotqa={fixtures / 'hotpotqa.json'},{fixtures / 'hotpotqa_corpus.json'}"
    overrides = [f"output_dir={out}", "env.max_turns=2", "rollout.max_new_tokens=8", "env.agent=rag"]
    main(["eval", str(QUICKSTART), "--model", str(tiny_model_dir), "--data", data, *overrides])
    main(["view", str(out)])
    (ev,) = page_data(out / "view" / "index.html")["evals"]
    assert ev["name"] == "eval-policy-rag-hotpotqa" and [r["id"] for r in ev["records"]] == ["hp1", "hp2"]
    for rec in ev["records"]:
        prompt = rec["segments"][0]
        assert prompt["kind"] == "prompt" and prompt["docs"]
        gold = {d["id"] for d in prompt["docs"] if d["gold"]}
        assert gold == set(rec["gold_doc_ids"]) & {d["id"] for d in prompt["docs"]}
    assert any(d["gold"] for rec in ev["records"] for d in rec["segments"][0]["docs"])


def test_groups_whose_rewards_differ_are_saved_first(tmp_path):
    from types import SimpleNamespace

    from searchrl.core.masking import build_batch
    from searchrl.core.types import Segment, Trajectory
    from searchrl.engine.samples import SampleRecorder

    rewards = {0: [1.0, 1.0], 1: [0.0, 1.0], 2: [0.0, 0.0], 3: [0.5, 0.0]}
    trajs = [
        Trajectory(
            None,  # type: ignore[arg-type]
            [Segment("prompt", [1, 2]), Segment("action", [3, 4], [-0.5, -0.25])],
            state=SimpleNamespace(answer=None),  # type: ignore[arg-type]
            reward=r,
            group_id=g,
        )
        for g, rs in rewards.items()
        for r in rs
    ]
    batch = build_batch(trajs, pad_id=0)
    rec = SampleRecorder(tmp_path, groups=2, every=1, tokenizer=None, enabled=True)
    rec.start(0, trajs, batch)
    assert sorted(rec.rows) == [2, 3, 6, 7] and {r["group"] for r in rec.rows.values()} == {1, 3}
    assert batch.extras.sample_row.tolist() == list(range(8))
    rec = SampleRecorder(tmp_path, groups=3, every=1, tokenizer=None, enabled=True)
    rec.start(0, trajs, batch)  # then the all-equal ones, in batch order
    assert {r["group"] for r in rec.rows.values()} == {1, 3, 0}


def test_serve_answers_on_loopback(tmp_path):
    """`searchrl view FILE --serve 0`: the folder on 127.0.0.1 at a free port, until interrupted."""
    import re
    import signal
    import subprocess
    import sys
    import urllib.request

    f = tmp_path / "r.predictions.jsonl"
    f.write_text(json.dumps(records([1])[0]) + "\n")
    # Ctrl-C as a terminal delivers it: a child inherits an ignored SIGINT (some test before this one in the
    # same pytest process left SIGINT ignored: CI's full run), and Python then never raises KeyboardInterrupt
    proc = subprocess.Popen(
        [sys.executable, "-m", "searchrl", "view", str(f), "--serve", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        url = None
        for _ in range(50):
            line = proc.stdout.readline()
            m = re.search(r"(http://127\.0\.0\.1:\d+/)", line)
            if m:
                url = m.group(1)
                break
        assert url, "no serving line"
        with urllib.request.urlopen(url + "index.html", timeout=10) as r:
            assert r.status == 200 and b"viewer.js" in r.read()
        with urllib.request.urlopen(url + "data/main.js", timeout=10) as r:
            assert r.read().startswith(b"window.SEARCHRL = ")
    finally:
        proc.send_signal(signal.SIGINT)
        try:  # communicate drains the pipe, so a process writing at exit cannot block on a full one
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            raise AssertionError(f"Ctrl-C did not stop the server; its output:\n{out[-3000:]}") from None
        assert proc.returncode == 0, out[-3000:]  # Ctrl-C stops it cleanly
