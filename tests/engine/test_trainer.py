"""Single-process training end to end on the tiny model: SFT, GRPO (full and LoRA), resume, NaN handling."""

import json
import math
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from searchrl.algorithms import algorithm_config
from searchrl.app.resources import Resources
from searchrl.core.config import TeacherConfig, TrainerConfig
from searchrl.engine.engine import NonFiniteError
from searchrl.engine.metrics import progress_fields, read_metrics
from searchrl.engine.trainer import Schedule, Trainer, make_optimizer
from searchrl.envs.synthetic.teacher import teacher_records
from searchrl.rewards import register_reward

# compares two computation paths of the same numbers: .ci/run runs these again under a second floating-point
# path (other kernels, one thread), so a tolerance that holds on one CPU's kernels only fails in CI
pytestmark = pytest.mark.numerics


@register_reward("test_trainer_length")
def length_reward(traj, **_):
    """Varies between samples of one group even for an untrained model, so GRPO has signal."""
    ids = [i for seg in traj.segments if seg.kind == "action" for i in seg.token_ids]
    return (sum(ids) % 7) / 6


GROUPED = {"grpo", "ppo", "steppo"}  # algorithms that take group_size: 4 rollouts per question here


def trainer_for(exp, algorithm, cfg, records=None, resume=False, out=None, args=None):
    resources = Resources(exp)
    return Trainer(
        algorithm=algorithm,
        config=algorithm_config(
            algorithm, {"group_size": 4, **(args or {})} if algorithm in GROUPED else args or {}
        ),
        model_path=exp.model.path,
        cfg=cfg,
        out_dir=out or exp.out,
        resources=resources,
        records=records,
        resume=resume,
        seed=exp.seed,
    )


def state(model):
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def gradients_at_update(tr):
    """The policy's gradients as the optimizer receives them (filled at each update; the last one kept)."""
    grads: dict[str, torch.Tensor] = {}
    opt = tr.training_step.model.optimizer
    real = opt.step

    def step(*a, **kw):
        grads.clear()
        grads.update(
            {n: p.grad.detach().clone() for n, p in tr.policy.named_parameters() if p.grad is not None}
        )
        return real(*a, **kw)

    opt.step = step
    return grads


def assert_same_gradients(g0, g1, rel=1e-4):
    """Equal to ``rel`` of each tensor's largest entry (the same sums over ~10^3 tokens in another order)."""
    assert g0 and g0.keys() == g1.keys()
    worst = max(float((g0[k] - g1[k]).abs().max() / g0[k].abs().max().clamp(min=1e-8)) for k in g0)
    assert worst < rel, worst


def test_schedule_is_a_pure_function_of_step():
    s = Schedule(10, 4, seed=3)
    seen = [i for step in range(5) for i in s.indices(step)]
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:20]) == list(range(10))  # epochs
    assert Schedule(10, 4, seed=3).indices(3) == s.indices(3)


def test_wsd_schedule_warms_up_holds_then_decays_to_zero():
    def lrs(cfg):
        opt, sched = make_optimizer(cfg, [{"params": [torch.nn.Parameter(torch.zeros(1))]}])
        out = []
        for _ in range(cfg.steps):
            out.append(sched.get_last_lr()[0])
            opt.step()
            sched.step()
        return out

    got = lrs(TrainerConfig(steps=10, lr=1.0, warmup_steps=2, schedule="wsd", decay_fraction=0.4))
    assert got[:7] == pytest.approx([0.0, 0.5, 1, 1, 1, 1, 1])  # linear warm-up, then constant
    assert got[7:] == pytest.approx([0.5 * (1 + math.cos(math.pi * i / 4)) for i in range(1, 4)])  # cosine
    # a shortened run keeps the shape: the decay is a share of the steps, the warm-up gives way to it
    short = lrs(TrainerConfig(steps=4, lr=1.0, warmup_steps=20, schedule="wsd", decay_fraction=0.25))
    assert short == pytest.approx([0.0, 1 / 3, 2 / 3, 1.0])  # warm-up cut to 3 steps, then the decay starts
    with pytest.raises(ValueError, match="decay_fraction"):
        TrainerConfig(steps=10, schedule="wsd")


def test_sft_learns_and_exports(make_exp, small_world, caplog):
    exp = make_exp()
    resources = Resources(exp)
    recs = teacher_records(
        resources.env(), small_world, small_world.examples("train")[:64], TeacherConfig(rename_prob=0.5)
    )
    cfg = TrainerConfig(steps=8, batch_size=16, micro_batch_size=8, lr=3e-3, save_every=4)
    tr = trainer_for(exp, "sft", cfg, records=recs)
    before = state(tr.policy)
    final = tr.run()
    rows = read_metrics(exp.out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 9))
    # supervised learning from a fresh model, not a chaotic dynamic: 7.7 -> 5.3 nats over the 8 steps on one
    # CPU, where float noise and batch-to-batch differences move a step's loss by tenths
    assert rows[-1]["train/loss"] < rows[0]["train/loss"]
    # SFT has no reward: its progress bar shows loss, learning rate and tokens per second
    assert "reward/mean" not in rows[0] and rows[0]["time/tokens_per_s"] > 0
    assert set(progress_fields(rows[-1])) == {"loss", "lr", "tok/s"}
    assert all(torch.isfinite(torch.tensor(r["train/grad_norm"])) for r in rows)
    # the process's peak resident memory, for plotting and the benches: never falls, above the model's weights
    peaks = [r["mem/peak_rss_gb"] for r in rows]
    assert peaks == sorted(peaks) and peaks[0] > sum(p.numel() * 4 for p in tr.policy.parameters()) / 1e9
    after = state(tr.policy)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert (final / "model.safetensors").exists() and (final / "tokenizer.json").exists()
    ckpts = sorted(p.name for p in (exp.out / "checkpoints").iterdir())
    assert ckpts == ["latest", "step-000004", "step-000008"]
    from searchrl.models import load_model_and_tokenizer

    model, _ = load_model_and_tokenizer(final)
    loaded = dict(model.named_parameters())
    assert torch.allclose(loaded["model.embed_tokens.weight"], after["model.embed_tokens.weight"])
    # the tied head is saved once, without accelerate's "Removed shared tensor" warning, and a resume
    # restores it tied: the same weights, so the same outputs
    assert not [r for r in caplog.records if "shared tensor" in r.getMessage()]
    resumed = trainer_for(exp, "sft", cfg, records=recs, resume=True)
    lm = resumed.engine.unwrap(resumed.policy)
    assert lm.lm_head.weight is lm.model.embed_tokens.weight
    assert all(torch.equal(v, after[k]) for k, v in state(resumed.policy).items())


def test_grpo_lora_trains_the_adapter_only(make_exp):
    exp = make_exp(
        "model.lora={r: 4, alpha: 8}", "rollout.temperature=1.0", "rewards=[{name: test_trainer_length}]"
    )
    cfg = TrainerConfig(steps=2, batch_size=2, micro_batch_size=4, lr=5e-3, save_every=2)
    tr = trainer_for(exp, "grpo", cfg, args={"kl_coef": 0.05})
    assert tr.reference is not None and tr.reference.shared  # adapter-disabled policy, no copy
    before = state(tr.policy)
    tr.run()
    after = state(tr.policy)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all("lora_" in k for k in changed)
    model_dir = exp.out / "checkpoints" / "step-000002" / "model"
    assert (model_dir / "adapter_model.safetensors").exists() and not (
        model_dir / "model.safetensors"
    ).exists()
    assert all("lora_" in k for k in load_file(str(model_dir / "adapter_model.safetensors")))
    row = read_metrics(exp.out / "metrics.jsonl")[-1]
    for key in (
        "train/loss",
        "train/kl",
        "train/clip_frac",
        "train/entropy",
        "reward/mean",
        "train/em",
        "rollout/tokens_generated",
        "rollout/logprob_abs_diff",
    ):
        assert key in row and row[key] == row[key], key  # present and not NaN
    assert row["rollout/logprob_abs_diff"] < 1e-3  # sampler and trainer agree on the log-probs


def test_one_update_per_batch_takes_pi_old_from_the_update_itself(make_exp, tmp_path):
    """With one optimizer update per rollout batch, π_old is the policy being updated: the step skips the
    no-grad π_old pass and gives the update (weights, loss, KL, sampler agreement) of a step that makes it."""
    exp = make_exp("rollout.temperature=1.0", "rewards=[{name: test_trainer_length}]")
    cfg = TrainerConfig(steps=1, batch_size=4, micro_batch_size=8, lr=5e-3, save_every=10**6)
    out = {}
    for pass_ in (False, True):
        tr = trainer_for(exp, "grpo", cfg, args={"kl_coef": 0.05}, out=tmp_path / str(pass_))
        assert not tr.training_step.shape.old_pass
        tr.training_step.shape.old_pass = pass_
        calls: list[int] = []

        def counted(*a, calls=calls, no_grad=tr.training_step._no_grad_pass, **k):
            calls.append(1)
            return no_grad(*a, **k)

        tr.training_step._no_grad_pass = counted
        grads = gradients_at_update(tr)
        torch.manual_seed(0)
        out[pass_] = tr.step(0), grads, len(calls)
    (m0, g0, n0), (m1, g1, n1) = out[False], out[True]
    assert (n0, n1) == (1, 2)  # the reference pass only, against reference and π_old
    assert m0["rollout/tokens_generated"] == m1["rollout/tokens_generated"]  # the same episodes
    for k in ("train/loss", "train/kl", "train/clip_frac", "rollout/logprob_abs_diff"):
        assert m0[k] == pytest.approx(m1[k], abs=1e-5), k
    assert m0["rollout/logprob_abs_diff"] < 1e-4
    # the gradients the update received, not the weights after Adam (which moves a ~0-gradient entry by up to
    # lr in the direction rounding picks: weights after one Adam step are not comparable at a fraction of lr)
    assert_same_gradients(g0, g1)
    ppo = trainer_for(exp, "ppo", cfg, out=tmp_path / "ppo")  # GAE reads the old values first
    assert (
        ppo.training_step.shape.old_pass
        and trainer_for(exp, "grpo", replace(cfg, epochs=2), out=tmp_path / "e2").training_step.shape.old_pass
    )


def test_resume_repeats_an_uninterrupted_run(make_exp, tmp_path, monkeypatch):
    exp = make_exp("rewards=[{name: test_trainer_length}]")
    cfg = TrainerConfig(steps=4, batch_size=2, micro_batch_size=4, lr=1e-3, save_every=2)
    full = trainer_for(exp, "grpo", cfg, out=tmp_path / "a")
    full.run()
    broken = trainer_for(exp, "grpo", cfg, out=tmp_path / "b")
    original = Trainer.step

    def crash_at_3(self, step):
        if step == 2:
            raise KeyboardInterrupt("killed")
        return original(self, step)

    monkeypatch.setattr(Trainer, "step", crash_at_3)
    with pytest.raises(KeyboardInterrupt):
        broken.run()
    monkeypatch.setattr(Trainer, "step", original)
    resumed = trainer_for(exp, "grpo", cfg, out=tmp_path / "b", resume=True)
    assert resumed.start_step == 2
    resumed.run()
    a, b = read_metrics(tmp_path / "a" / "metrics.jsonl"), read_metrics(tmp_path / "b" / "metrics.jsonl")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b):
        for k in ra:
            if not k.startswith(("time/", "mem/", "rollout/tokens_per_second")):
                assert ra[k] == pytest.approx(rb[k], rel=1e-6, abs=1e-9), (ra["step"], k)


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(make_exp, monkeypatch):
    exp = make_exp()
    cfg = TrainerConfig(steps=4, batch_size=2, micro_batch_size=8, lr=1e-3, save_every=1)
    tr = trainer_for(exp, "grpo", cfg)
    real = tr.algo.loss
    calls = {"n": 0}

    def poisoned(logp, ent, mb, values=None):
        calls["n"] += 1
        loss, m = real(logp, ent, mb, values)
        return (loss * float("nan") if calls["n"] > 1 else loss), m

    monkeypatch.setattr(tr.algo, "loss", poisoned)
    with pytest.raises(
        NonFiniteError,
        match=r"training stopped at step 2: loss is nan(.|\n)*last good checkpoint is .*step-000001",
    ):
        tr.run()
    latest = (exp.out / "checkpoints" / "latest").read_text()
    assert latest == "step-000001"
    assert json.loads((exp.out / "checkpoints" / latest / "trainer.json").read_text())["step"] == 1


@pytest.mark.parametrize("lora", [False, True])
def test_ppo_trains_policy_and_value_head(make_exp, lora):
    over = ["rollout.temperature=1.0", "rewards=[{name: test_trainer_length}]"]
    exp = make_exp(*over, *(["model.lora={r: 4, alpha: 8}"] if lora else []))
    cfg = TrainerConfig(steps=2, batch_size=2, micro_batch_size=4, lr=5e-3, save_every=1)
    tr = trainer_for(exp, "ppo", cfg, args={"kl_coef": 0.05, "adaptive_kl": True, "critic_lr": 1e-2})
    assert [g["lr"] for g in tr.optimizer.param_groups] == [5e-3, 1e-2]
    before = state(tr.policy)
    final = tr.run()
    after = state(tr.policy)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert {"value_head.weight", "value_head.bias"} <= changed
    assert any(k.startswith("lm.") for k in changed)
    if lora:
        assert all("lora_" in k or k.startswith("value_head.") for k in changed)
    row = read_metrics(exp.out / "metrics.jsonl")[-1]
    for key in (
        "train/value_loss",
        "train/pg_loss",
        "train/value_clip_frac",
        "critic/value_mean",
        "critic/return_mean",
        "kl/coef",
        "kl/sequence",
    ):
        assert key in row and row[key] == row[key], key
    assert row["kl/coef"] != 0.05  # adapted
    saved = json.loads((exp.out / "checkpoints" / "step-000002" / "trainer.json").read_text())
    assert saved["algorithm"]["kl_coef"] == pytest.approx(tr.algo.kl_coef)
    head = load_file(str(final / "value_head.safetensors"))
    assert torch.allclose(head["weight"], after["value_head.weight"])
    resumed = trainer_for(
        exp,
        "ppo",
        TrainerConfig(steps=3, batch_size=2, micro_batch_size=4, lr=5e-3),
        args={"kl_coef": 0.05, "adaptive_kl": True},
        resume=True,
    )
    assert resumed.start_step == 2 and resumed.algo.kl_coef == pytest.approx(tr.algo.kl_coef)
    assert torch.allclose(state(resumed.policy)["value_head.weight"], after["value_head.weight"])


def test_steppo_runs_with_stepsearch_rewards(make_exp):
    exp = make_exp("rollout.temperature=1.0", "rewards=[{name: stepsearch, args: {gamma_key: 0.5}}]")
    cfg = TrainerConfig(steps=1, batch_size=2, micro_batch_size=4, lr=1e-3, save_every=1)
    tr = trainer_for(exp, "steppo", cfg, args={"kl_coef": 0.0})
    tr.run()
    row = read_metrics(exp.out / "metrics.jsonl")[-1]
    for key in ("reward/stepsearch", "reward/stepsearch/key", "reward/stepsearch/gain", "train/value_loss"):
        assert key in row and row[key] == row[key], key


class LengthJudge:
    """Scores vary between candidates even for an untrained model, so the step groups have signal."""

    def __call__(self, items):
        from searchrl.rewards.judges import JudgeScores

        return [JudgeScores(think=float(len(it.action) % 3 - 1), answer=0.0) for it in items]


def test_slate_trains_on_step_candidates(make_exp):
    from searchrl.rewards.judges import JUDGES

    if "test_length" not in JUDGES:
        JUDGES.add("test_length", LengthJudge)
    exp = make_exp("rollout.temperature=1.0")
    cfg = TrainerConfig(steps=2, batch_size=2, micro_batch_size=8, lr=1e-3, save_every=2)
    tr = trainer_for(exp, "slate", cfg, args={"k": 3, "kl_coef": 0.01, "judge": "test_length"})
    assert tr.req.samples_per_item == 3 * (exp.env.max_turns + 1)
    before = state(tr.policy)
    tr.run()
    assert any(not torch.equal(before[k], v) for k, v in state(tr.policy).items())
    row = read_metrics(exp.out / "metrics.jsonl")[-1]
    for key in (
        "slate/step_reward",
        "slate/candidates",
        "slate/judge_failures",
        "slate/em",
        "train/kl",
        "train/loss",
        "train/sequences",
    ):
        assert key in row and row[key] == row[key], key
    # every candidate is one trained sequence; the trainer's padding rows (up to k·B per question) are not
    assert row["slate/candidates"] >= 3 * 2 and row["train/sequences"] == row["slate/candidates"]


def test_a_failing_judge_endpoint_stops_the_run_naming_it(make_exp, monkeypatch):
    """A wrong API key (every request answered 401): the run stops at the first step with the endpoint and
    the HTTP status, never the key, instead of training on failed judgements."""
    import threading
    from http.server import ThreadingHTTPServer

    from searchrl.core.serving import ServiceFailure
    from tests.helpers import JSONHandler

    class Refuses(JSONHandler):
        def do_POST(self):
            self.read_json()
            self.reply(401, {"error": {"message": "invalid api key"}})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Refuses)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    monkeypatch.setenv("FAILING_JUDGE_KEY", "s3cret-key")
    exp = make_exp("rollout.temperature=1.0")
    cfg = TrainerConfig(steps=2, batch_size=2, micro_batch_size=8, lr=1e-3, save_every=2)
    judge_args = {
        "backend": "openai",
        "url": url,
        "model": "m",
        "api_key_env": "FAILING_JUDGE_KEY",
        "retries": 0,
    }
    try:
        tr = trainer_for(exp, "slate", cfg, args={"k": 3, "judge": "llm", "judge_args": judge_args})
        with pytest.raises(ServiceFailure) as e:
            tr.run()
    finally:
        server.shutdown()
        server.server_close()
    msg = str(e.value)
    assert "judge:" in msg and f"{url}/chat/completions" in msg and "HTTP 401" in msg and "100%" in msg
    assert "s3cret-key" not in msg
    assert not read_metrics(exp.out / "metrics.jsonl")  # the step trained on nothing that was logged


def test_service_failure_rates_and_the_progress_bar():
    from searchrl.core.serving import (
        COUNTERS,
        FailureCounter,
        ServiceFailure,
        check_failure_rates,
        service_metrics,
    )

    saved = set(COUNTERS)
    COUNTERS.clear()
    try:
        c = FailureCounter("summarizer", "http://x/v1/chat/completions", max_rate=0.1)
        for i in range(40):
            c.record("http://x rejected the request: HTTP 500" if i % 20 == 0 else None)
        m = service_metrics()
        assert m == {"service/summarizer/requests": 40.0, "service/summarizer/failures": 2.0}
        check_failure_rates(m)  # 5% <= 10%
        assert progress_fields(m)["summarizer_fail"] == "2"
        assert service_metrics()["service/summarizer/requests"] == 0.0  # deltas since the last call
        with pytest.raises(ServiceFailure, match=r"summarizer: 5 of 40 requests to http://x.* HTTP 500"):
            check_failure_rates({"service/summarizer/requests": 40.0, "service/summarizer/failures": 5.0})
        check_failure_rates(
            {"service/summarizer/requests": 10.0, "service/summarizer/failures": 5.0}
        )  # too few
        with pytest.raises(ServiceFailure, match="3 of 3"):  # but every request failing stops at once
            check_failure_rates({"service/summarizer/requests": 3.0, "service/summarizer/failures": 3.0})
    finally:
        COUNTERS.update(saved)
