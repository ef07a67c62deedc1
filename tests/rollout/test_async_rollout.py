"""Asynchronous rollouts: the staleness cap, token versions across a weight update (partial rollouts), no
starvation of long episodes, refusal where the worker cannot run, and a training run end to end."""

import copy
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from searchrl.app.resources import Resources
from searchrl.core.config import ConfigError, TrainerConfig
from searchrl.core.errors import SearchRLError
from searchrl.core.functional import token_logprobs
from searchrl.engine.metrics import read_metrics
from searchrl.rollout.async_rollout import AsyncRollout, admissible
from searchrl.rollout.generator import GENERATORS, SamplingParams
from searchrl.rollout.loop import rollout
from searchrl.rollout.worker_process import RolloutWorkerDied
from tests.engine.test_trainer import trainer_for


@pytest.fixture
def exp(make_exp, agent_model_dir):
    # the SFT'd tiny model: it searches, so episodes take 1-3 turns of different lengths
    return make_exp(f"model.path={agent_model_dir}", "rollout.temperature=1.0", "env.max_turns=3")


def pipeline(exp, steps, max_staleness, batch=2, group=2, **kw):
    resources = Resources(exp)
    env = resources.env()
    from searchrl.models.policy import load_policy

    policy, tok = load_policy(str(exp.model.path), exp.model.dtype, None, False, False)
    examples = resources.examples("train")
    worker = copy.deepcopy(policy)
    p = AsyncRollout(
        worker,
        GENERATORS.get("hf")(worker, tok, env.tags.stop_strings, batch_size=8, continuous=True),
        env,
        tok,
        SamplingParams(1.0, 1.0, exp.rollout.max_new_tokens),
        examples,
        lambda s: [(s * batch + k) % len(examples) for k in range(batch)],
        group,
        exp.rollout.max_total_tokens,
        max_staleness,
        start_step=0,
        end_step=steps,
        **kw,
    )
    return p, policy


def test_the_cap_holds_and_every_episode_is_trained_on_in_order(exp):
    """A trainer that takes its time: the worker runs ahead by at most max_staleness steps, every token
    of step i's batch was sampled by a version ≥ i − max_staleness, and each step gets all its episodes."""
    steps, cap = 5, 2
    p, policy = pipeline(exp, steps, cap)
    p.start()
    try:
        for i in range(steps):
            trajs, m = p.take(i)
            assert len(trajs) == 4 and all(t.state.done for t in trajs)  # 2 questions x 2, all finished
            versions = [v for t in trajs for s in t.segments if s.versions for v in s.versions]
            assert versions and min(versions) >= i - cap and max(versions) <= i
            assert m["async/staleness_max"] <= cap and m["async/admitted_lag"] <= cap
            assert p.next_step <= i + cap + 1  # admitted no further than the cap allows
            time.sleep(0.2)  # "training"
            with torch.no_grad():
                for q in policy.parameters():
                    q.add_(1e-4)
            p.sync(dict(policy.named_parameters()), i + 1)
    finally:
        p.close()


@settings(max_examples=25, deadline=None)
@given(
    cap=st.integers(1, 4),
    steps=st.integers(1, 12),
    lags=st.lists(st.integers(0, 3), min_size=12, max_size=12),
)
def test_admission_rule_never_exceeds_the_cap(cap, steps, lags):
    """The worker's admission rule under any timing (``lags``: admission rounds between two weight
    updates); the trainer reaches step i with version i: step i was admitted by a version ≥ i − cap, before
    the trainer needs it, and every step exactly once, in order."""
    admitted: dict[int, int] = {}
    nxt, version = 0, 0
    for i in range(steps):
        for _ in range(lags[i] + 1):
            while nxt < steps and admissible(nxt, version, cap):
                admitted[nxt] = version
                nxt += 1
        assert i in admitted and i - admitted[i] <= cap  # step i can train at version i
        version = i + 1
    assert sorted(admitted) == list(range(steps))


def test_a_partial_rollout_carries_both_versions_across_a_weight_update(exp):
    """Weights shipped while actions are being decoded: the in-flight episodes go on (none dropped) and
    their tokens carry version 0 before the update and 1 after it, in that order."""
    p, policy = pipeline(exp, 1, 1, batch=4, group=2)
    gate = threading.Event()
    step = type(p)._loop

    def slow_loop(self, stream):  # decode a few tokens, then let the test update the weights
        original = stream.step
        count = [0]

        def stepped():
            count[0] += 1
            if count[0] == 3:
                gate.set()
                time.sleep(0.5)
            return original()

        stream.step = stepped
        return step(self, stream)

    p._loop = slow_loop.__get__(p)
    p.start()
    assert gate.wait(30)
    p.sync(dict(policy.named_parameters()), 1)  # the lock waits for the decode step in progress
    trajs, m = p.take(0)
    p.close()
    seqs = [s.versions for t in trajs for s in t.segments if s.kind == "action"]
    assert all(v == sorted(v) for v in seqs)  # versions never go back within an action
    mixed = [v for v in seqs if 0 in v and 1 in v]
    assert mixed, seqs  # an action that began under version 0 finished under version 1
    assert m["async/staleness_max"] == 0  # step 0 trains at version 0: the worker's 1 is ahead, never behind
    assert len(trajs) == 8 and all(t.state.done for t in trajs)


def test_long_episodes_are_not_starved(exp):
    """Episodes of very different lengths (1-3 turns): consumed in step order, each step gets exactly its
    questions' episodes, so long ones are trained on at the same rate as short ones."""
    steps = 4
    p, policy = pipeline(exp, steps, 3, batch=3, group=2)
    p.start()
    lengths, got, buckets = [], [], set()
    try:
        for i in range(steps):
            trajs, m = p.take(i)
            got.append(sorted(t.group_id for t in trajs))
            lengths += [len(t) for t in trajs]
            # by number of actions: every episode finished and is trained on, none older than the cap
            done = {k: float(v) for k, v in m.items() if k.startswith("async/completed_frac/")}
            assert done and all(v == 1.0 for v in done.values()), done
            stale = {k: float(v) for k, v in m.items() if k.startswith("async/episode_staleness/")}
            assert stale.keys() == {k.replace("completed_frac", "episode_staleness") for k in done}
            assert all(0 <= v <= 3 for v in stale.values()), stale
            buckets |= {k.rsplit("/", 1)[1] for k in done}
            # the worker's own throughput so far: it generated these tokens while busy
            assert float(m["async/worker_tokens_per_s"]) > 0 and float(m["async/worker_busy_s"]) >= 0
            p.sync(dict(policy.named_parameters()), i + 1)
    finally:
        p.close()
    assert len(buckets) >= 2  # episodes of several lengths were measured
    assert got == [
        sorted([(i * 3 + k) % len(p.examples) for k in range(3) for _ in range(2)]) for i in range(4)
    ]
    assert max(lengths) > 1.5 * min(lengths)  # the mix was real


def test_refused_where_the_worker_cannot_run(exp, tmp_path):
    from searchrl.core.config import AsyncRolloutConfig

    cfg = TrainerConfig(steps=2, batch_size=2, async_rollout=AsyncRolloutConfig(max_staleness=1))
    with pytest.raises(ConfigError, match="collects step by step"):
        trainer_for(exp, "slate", cfg, out=tmp_path / "s")
    with pytest.raises(ConfigError, match="trains on given records"):
        trainer_for(exp, "sft", cfg, records=[], out=tmp_path / "f")


def test_the_trainer_and_validate_refuse_the_same_async_setups(make_exp, tmp_path):
    """One decision (`async_rollout.refusal`), asked by `validate` and by the trainer itself: a library user who
    builds a `Trainer` directly is refused what the file would be (the simulated retriever's curriculum)."""
    from searchrl.app.experiment import check_arguments
    from searchrl.core.config import AsyncRolloutConfig

    exp = make_exp(
        "algorithm={name: grpo}", "env.retriever.name=simulated", "trainer.async_rollout.max_staleness=1"
    )
    with pytest.raises(ConfigError, match="noise curriculum") as e:
        check_arguments(exp)
    assert "trainer.async_rollout.max_staleness" in str(e.value)
    cfg = TrainerConfig(steps=2, batch_size=2, async_rollout=AsyncRolloutConfig(max_staleness=1))
    with pytest.raises(ConfigError, match="noise curriculum"):
        trainer_for(make_exp("env.retriever.name=simulated"), "grpo", cfg, out=tmp_path / "g")


def async_trainer(make_exp, agent_model_dir, tmp_path, *overrides, **async_cfg):
    """GRPO for 3 steps at max_staleness 1 on the SFT'd tiny model, with a reward that varies within a group
    (so every step changes the weights the worker must receive)."""
    from searchrl.core.config import AsyncRolloutConfig

    exp = make_exp(
        f"model.path={agent_model_dir}",
        "rollout.temperature=1.0",
        "env.max_turns=3",
        "rewards=[{name: test_trainer_length}]",
        *overrides,
    )
    cfg = TrainerConfig(
        steps=3,
        batch_size=2,
        micro_batch_size=8,
        lr=1e-3,
        save_every=10**6,
        async_rollout=AsyncRolloutConfig(max_staleness=1, **async_cfg),
    )
    args = {"kl_coef": 0.0, "rollout_correction": {"mode": "token_tis"}}
    return trainer_for(exp, "grpo", cfg, args=args, out=tmp_path / "a")


def test_grpo_trains_asynchronously_end_to_end(make_exp, agent_model_dir, tmp_path):
    tr = async_trainer(make_exp, agent_model_dir, tmp_path)
    started, start = [], tr.rollouts.start
    tr.rollouts.start = lambda step: (start(step), started.append(tr.rollouts.worker))
    tr.run()
    # the worker's copy received every step's weights: version 3, equal to the trained policy
    (worker,) = started
    theirs = dict(worker.model.named_parameters())
    assert worker.version == 3
    assert all(torch.equal(q, theirs[n]) for n, q in tr.policy.named_parameters())
    rows = read_metrics(tmp_path / "a" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["async/staleness_max"] <= 1 for r in rows)
    assert rows[0]["async/staleness_max"] == 0  # step 0's episodes were sampled by the initial weights
    assert all(r["rollout_corr/w_mean"] > 0 for r in rows) and tr.rollouts.worker is None  # closed
    check_shipped_weights(rows)


def check_shipped_weights(rows):
    """Step 1's tokens were all sampled by the initial copy, so they match the trainer's recomputed log-probs
    to rounding. (Later, a token sampled by the current version may still attend over keys and values an
    older version computed, in a partial rollout, so only the first step is exact.)"""
    assert rows[0]["async/fresh_token_frac"] == 1.0
    assert rows[0]["async/logprob_max_diff_fresh"] < 1e-4
    assert all(0.0 <= r["async/fresh_token_frac"] <= 1.0 for r in rows)


def test_lora_ships_the_adapter_and_the_copy_equals_the_trainer(exp):
    """With LoRA the trainer ships only the adapter after a step; the worker's copy, built once whole, then
    equals the trainer's policy in every parameter."""
    from types import SimpleNamespace

    from searchrl.core.config import LoraConfig
    from searchrl.engine.worker_weights import gathered, whole_copy
    from searchrl.models.policy import load_policy
    from searchrl.models.weights import trainable_names

    policy, _ = load_policy(str(exp.model.path), "float32", LoraConfig(r=4, alpha=8, dropout=0.0))
    eng = SimpleNamespace(unwrap=lambda m: m, is_deepspeed=False, zero_stage=0)
    worker = whole_copy(eng, policy, lambda: None)
    names = trainable_names(policy)
    assert names and all("lora_" in n for n in names)
    with torch.no_grad():
        for n, q in policy.named_parameters():
            q.add_(0.01 if n in names else 0.0)
    with gathered(eng, policy, names) as w:
        assert set(w) == set(names)
        p = AsyncRollout(worker, None, None, None, None, [], lambda s: [], 1, 8, 1, 0, 1, shipped=names)
        p.sync(w, 1)
    theirs = dict(worker.named_parameters())
    assert all(torch.equal(q, theirs[n]) for n, q in policy.named_parameters())
    assert p.version == 1


def test_max_staleness_zero_is_the_synchronous_trainer(exp, tmp_path):
    cfg = TrainerConfig(steps=1, batch_size=2, micro_batch_size=8, lr=1e-3, save_every=10**6)
    tr = trainer_for(exp, "grpo", cfg, out=tmp_path / "z")
    assert cfg.async_rollout.max_staleness == 0 and tr.rollouts.worker is None
    torch.manual_seed(0)
    m = tr.step(0)
    assert tr.rollouts.worker is None and not any(k.startswith("async/") for k in m)


def test_rollout_without_a_stream_keeps_versions_empty(exp):
    resources = Resources(exp)
    env = resources.env()
    from searchrl.models.policy import load_policy

    policy, tok = load_policy(str(exp.model.path), exp.model.dtype, None, False, False)
    gen = GENERATORS.get("hf")(policy, tok, env.tags.stop_strings, continuous=False)
    trajs, _ = rollout(resources.examples("train")[:1], env, gen, tok, SamplingParams(1.0, 1.0, 8), 1, 256)
    assert all(s.versions is None for t in trajs for s in t.segments)


def test_refused_when_the_experiment_is_checked_before_any_stage(make_exp, monkeypatch):
    """Where the worker cannot run (the turn loop, SLATE, dynamic sampling) the refusal comes at load time,
    not after the warm start; DDP and DeepSpeed launches and the vLLM backend are accepted."""
    from searchrl.app.experiment import check_arguments

    exp = make_exp("trainer.async_rollout.max_staleness=1", "algorithm={name: grpo}")
    check_arguments(exp)  # one process, HF: accepted
    monkeypatch.setenv("WORLD_SIZE", "2")
    check_arguments(exp)  # DDP: each process runs its own worker
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    check_arguments(exp)  # ZeRO: the worker's whole copy is filled from gathered parameters
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED")
    with pytest.raises(ConfigError, match="dynamic sampling") as e:
        check_arguments(
            make_exp(
                "trainer.async_rollout.max_staleness=1",
                "algorithm={name: grpo, dynamic_sampling: {enabled: true}}",
            )
        )
    assert e.value.key == "trainer.async_rollout.max_staleness"
    monkeypatch.setenv("WORLD_SIZE", "1")
    # the vLLM engine samples for the worker (its per-episode stream); the turn loop cannot
    check_arguments(
        make_exp("trainer.async_rollout.max_staleness=1", "algorithm={name: grpo}", "rollout.backend=vllm")
    )
    with pytest.raises(ConfigError, match="not loop 'turn'"):
        check_arguments(
            make_exp("trainer.async_rollout.max_staleness=1", "algorithm={name: grpo}", "rollout.loop=turn")
        )
    with pytest.raises(ConfigError, match="collects step by step"):
        check_arguments(make_exp("trainer.async_rollout.max_staleness=2", "algorithm={name: slate}"))
    # a worker process runs either backend (vLLM: its engine started in the worker)
    for backend in ("hf", "vllm"):
        check_arguments(
            make_exp(
                "trainer.async_rollout={max_staleness: 1, worker: process}",
                "algorithm={name: grpo}",
                f"rollout.backend={backend}",
            )
        )


@pytest.mark.parametrize("lora", [False, True])
def test_grpo_trains_with_a_worker_process(make_exp, agent_model_dir, tmp_path, lora):
    """The worker in its own process: three steps at max_staleness 1 train as with a thread (the cap, the
    first step's exact log-probs), and afterwards the process's copy of the policy equals the trained policy
    in every parameter (with LoRA only the adapter was shipped after each step)."""
    from searchrl.rollout.worker_process import ProcessRollout

    over = ["model.lora={r: 4, alpha: 8, dropout: 0.0}"] if lora else []
    tr = async_trainer(make_exp, agent_model_dir, tmp_path, *over, worker="process", worker_threads=1)
    seen: dict = {}
    probe = tr.tokenizer("Question: who is Keve?\n")["input_ids"]
    start = tr.rollouts.start

    def started(step):
        start(step)
        p = tr.rollouts.worker
        assert isinstance(p, ProcessRollout)
        close = p.close

        def closing():  # the worker's weights and a sample of its sampler just before the trainer ends it
            seen.update(weights=p.worker_weights(), version=p.version, shipped=list(p.shipped))
            seen["sample"] = p.worker_sample(probe, SamplingParams(temperature=1.0, max_new_tokens=12))
            close()

        p.close = closing

    tr.rollouts.start = started
    tr.run()
    assert seen["version"] == 3
    ours = dict(tr.policy.named_parameters())
    assert seen["weights"].keys() == ours.keys()
    assert all(torch.equal(q.detach(), seen["weights"][n]) for n, q in ours.items())
    assert bool(lora) == all("lora_" in n for n in seen["shipped"])
    g = seen["sample"]  # sampled by the worker's copy: the trained policy's log-probs
    ids = torch.tensor([probe + g.token_ids])
    with torch.no_grad():
        ours = token_logprobs(tr.policy(input_ids=ids).logits, ids, temperature=1.0)[0, len(probe) :]
    assert g.token_ids and torch.allclose(torch.tensor(g.logprobs), ours, atol=1e-4)
    rows = read_metrics(tmp_path / "a" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["async/staleness_max"] <= 1 for r in rows) and rows[0]["async/staleness_max"] == 0
    assert all(r["async/worker_tokens_per_s"] > 0 for r in rows)
    check_shipped_weights(rows)


def test_a_failing_worker_process_stops_the_trainer_with_its_error(make_exp, agent_model_dir, tmp_path):
    """The worker process's failure reaches the trainer as an error carrying the worker's traceback (here: its
    model directory vanished before it loaded), and a worker killed outright as one naming its exit code."""
    import os
    import shutil
    import signal

    tr = async_trainer(
        make_exp, agent_model_dir, tmp_path, worker="process", worker_threads=1, max_restarts=0
    )
    moved = tmp_path / "elsewhere"
    tr.rollouts.model_path = moved  # the worker loads the architecture from here: nothing there
    tr.rollouts.start(0)
    with pytest.raises(RuntimeError, match=r"failed before step 0's episodes:(.|\n)*elsewhere"):
        tr.rollouts.worker.take(0)
    tr.rollouts.worker.close()

    shutil.copytree(agent_model_dir, moved)
    tr.rollouts.start(0)
    tr.rollouts.worker.take(0)  # the worker is up
    os.kill(tr.rollouts.worker._proc.pid, signal.SIGKILL)
    with pytest.raises(RolloutWorkerDied, match="exited with code -9") as died:
        tr.rollouts.worker.take(2)
    tr.rollouts.worker.close()
    # a user's error: one line naming the exit code, the setting and how to continue; the CLI prints it as
    # `error: …` and exits 2, no traceback
    text = str(died.value)
    assert "\n" not in text and "max_restarts: 0" in text and "--resume" in text
    assert isinstance(died.value, SearchRLError)


def test_a_killed_worker_process_is_started_again_and_the_run_finishes(make_exp, agent_model_dir, tmp_path):
    """SIGKILL to the worker process after the first step: a new worker starts from the shared weights, the
    steps it had in flight are sampled again, and the run finishes with every step trained on its own
    questions, the staleness cap held and the restart logged."""
    import os
    import signal

    from searchrl.rollout.worker_process import ProcessRollout

    tr = async_trainer(
        make_exp, agent_model_dir, tmp_path, worker="process", worker_threads=1, max_restarts=2
    )
    seen: dict = {"killed": False, "questions": {}}
    take = ProcessRollout.take

    def taking(self, step):
        trajs, metrics = take(self, step)
        seen["questions"][step] = sorted(t.example.id for t in trajs)
        if step == 0 and not seen["killed"]:
            os.kill(self._proc.pid, signal.SIGKILL)
            seen["killed"] = True
        return trajs, metrics

    ProcessRollout.take = taking
    try:
        tr.run()
    finally:
        ProcessRollout.take = take
    rows = read_metrics(tmp_path / "a" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[-1]["async/worker_restarts"] == 1.0 and rows[0]["async/worker_restarts"] == 0.0
    assert all(r["async/staleness_max"] <= 1 for r in rows)
    for step, ids in seen["questions"].items():
        want = sorted(
            tr.ctx.train_examples[i].id
            for i in tr.schedule.indices(step)
            for _ in range(tr.algo.cfg.group_size)
        )
        assert ids == want, step
