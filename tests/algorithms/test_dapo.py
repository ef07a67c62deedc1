"""DAPO's dynamic sampling, overlong filtering and overlong shaping; the objective variants in training and in
the config (validated, bad names refused with the valid choices)."""

import logging
import math
import random

import pytest
import torch

from searchrl.algorithms.dapo import DynamicSampling, dynamic_collect, informative, mask_truncated
from searchrl.algorithms.grpo import GRPOConfig
from searchrl.core.aggregate import Mean, Sum
from searchrl.core.config import TrainerConfig
from searchrl.core.errors import ConfigError
from searchrl.core.masking import build_batch
from searchrl.core.types import Segment, Trajectory
from searchrl.rewards.outcome import overlong_penalty
from searchrl.rollout.async_rollout import refusal
from tests.engine.test_trainer import trainer_for

N_ITEMS = 40


def fake_collect(equal, calls):
    """Groups of 3 episodes per question; question i's rewards are all equal when ``equal(i)``."""

    def collect(indices):
        calls.append(list(indices))
        trajs = []
        for i in indices:
            for j in range(3):
                t = Trajectory(
                    None, [Segment("prompt", [1]), Segment("action", [2, 3], [0.0, 0.0])], group_id=i
                )  # type: ignore[arg-type]
                t.reward = 0.5 if equal(i) else float(j == 0)
                trajs.append(t)
        return trajs, {
            "rollout/tokens_generated": Sum(6 * len(indices)),
            "reward/x": Mean(len(indices), len(indices)),
        }

    return collect


def test_dynamic_sampling_returns_only_informative_groups_with_the_schedules_ids():
    calls = []
    indices = [0, 3, 6, 9, 1, 2]  # 0, 3, 6, 9 are all-equal (multiples of 3)
    trajs, m = dynamic_collect(
        fake_collect(lambda i: i % 3 == 0, calls),
        indices,
        N_ITEMS,
        DynamicSampling(True, 8),
        random.Random(0),
    )
    groups = {}
    for t in trajs:
        groups.setdefault(t.group_id, []).append(t)
    assert sorted(groups) == sorted(indices)  # ids as the schedule gave them: unique across processes
    assert all(informative(g) and len(g) == 3 for g in groups.values())
    assert m["dapo/first_all_equal_frac"] == pytest.approx(4 / 6)
    assert m["dapo/groups_dropped"] >= 4 and m["dapo/groups_short"] == 0
    assert m["dapo/attempts"] == len(calls) >= 2
    assert m["dapo/episodes_generated"] == 3 * sum(len(c) for c in calls)
    assert m["rollout/tokens_generated"] == 6 * sum(len(c) for c in calls)  # every round's cost counted
    assert not set(calls[1]) & set(calls[0])  # fresh questions, not the ones already tried


def test_dynamic_sampling_stops_at_its_cap_with_a_message(caplog):
    calls = []
    with caplog.at_level(logging.WARNING):
        trajs, m = dynamic_collect(
            fake_collect(lambda i: True, calls),
            [1, 2, 4],
            N_ITEMS,
            DynamicSampling(True, 3),
            random.Random(0),
            " (step 5)",
        )
    assert trajs == [] and len(calls) == 3
    assert m["dapo/groups_short"] == 3 and m["dapo/attempts"] == 3
    assert "max_attempts" in caplog.text and "step 5" in caplog.text and "0 of 3 groups" in caplog.text
    with pytest.raises(ValueError, match="max_attempts"):
        DynamicSampling(True, 0)


def test_dynamic_sampling_is_deterministic_and_never_keeps_an_equal_group():
    for seed in range(5):
        rng_equal = random.Random(seed)
        eq = {i: rng_equal.random() < 0.5 for i in range(N_ITEMS)}
        runs = [
            dynamic_collect(
                fake_collect(eq.__getitem__, []),
                [0, 1, 2, 3],
                N_ITEMS,
                DynamicSampling(True, 6),
                random.Random(seed),
            )
            for _ in range(2)
        ]
        for trajs, _ in runs:
            by = {}
            for t in trajs:
                by.setdefault(t.group_id, []).append(t.reward)
            assert all(len(set(r)) > 1 for r in by.values())
        assert [t.reward for t in runs[0][0]] == [t.reward for t in runs[1][0]]


def test_truncated_episodes_are_out_of_the_loss_but_keep_their_reward():
    a = Trajectory(
        None, [Segment("prompt", [1]), Segment("action", [2, 3])], reward=1.0, finish_reason="length"
    )  # type: ignore[arg-type]
    b = Trajectory(
        None, [Segment("prompt", [1]), Segment("action", [2, 3])], reward=0.0, finish_reason="answer"
    )  # type: ignore[arg-type]
    assert mask_truncated([a, b]) == 1
    batch = build_batch([a, b], pad_id=0)
    assert batch.loss_mask.tolist() == [[0.0, 0.0, 0.0], [0.0, 1.0, 1.0]]
    assert batch.rewards.tolist() == [1.0, 0.0]


def test_overlong_penalty_is_dapo_eq_13():
    # L_max = 100, L_cache = 20: 0 up to 80, linear to −1 at 100, −1 beyond
    assert [overlong_penalty(n, 100, 20) for n in (50, 80, 90, 100, 101)] == [0.0, 0.0, -0.5, -1.0, -1.0]
    assert overlong_penalty(90, 100, 20, penalty=2.0) == -1.0
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(5, 100, 0)


def test_async_rollouts_refuse_dynamic_sampling():
    why = refusal("grpo", True, False, "episode", resamples=True)
    assert why is not None and "dynamic_sampling" in why
    assert refusal("grpo", True, False, "episode") is None


# ------------------------------------------------------------------------------------------- config


def test_every_variant_validates_and_a_bad_name_is_refused(make_exp):
    from searchrl.app.experiment import check_arguments

    def checked(*overrides):  # what `searchrl validate` and every training command check
        exp = make_exp(*overrides)
        check_arguments(exp)
        return exp

    for adv in ("grpo", "rloo", "reinforce_baseline", "reinforce_pp", "reinforce_pp_baseline"):
        checked(f"algorithm.advantage={adv}")
    for loss in ("clip", "cispo"):
        checked(f"algorithm.policy_loss={loss}")
    for loss in ("gspo", "gspo_token", "gmpo", "sapo"):
        checked(f"algorithm.policy_loss={loss}", "algorithm.loss_agg=seq-mean-token-mean")
    checked("algorithm.dynamic_sampling={enabled: true, max_attempts: 3}", "algorithm.mask_truncated=true")
    checked("algorithm.name=ppo", "algorithm.policy_loss=cispo")
    with pytest.raises(ConfigError) as e:
        checked("algorithm.policy_loss=gsop")
    assert "algorithm.policy_loss" in str(e.value) and "gspo" in str(e.value) and "cispo" in str(e.value)
    with pytest.raises(ConfigError) as e:
        checked("algorithm.advantage=rlo")
    assert "rloo" in str(e.value) and "reinforce_pp" in str(e.value)
    with pytest.raises(ConfigError, match="seq-mean-token-mean"):
        checked("algorithm.policy_loss=gspo")
    with pytest.raises(ValueError, match="group baseline"):
        GRPOConfig(group_size=1, advantage="rloo")
    assert GRPOConfig(group_size=1, advantage="reinforce_pp").group_size == 1


def test_a_user_loss_by_dotted_path(make_exp):
    from searchrl.app.experiment import check_arguments

    check_arguments(make_exp("algorithm.policy_loss=searchrl.algorithms.policy_losses:cispo"))
    with pytest.raises(ConfigError, match="no attribute"):
        check_arguments(make_exp("algorithm.policy_loss=searchrl.algorithms.policy_losses:nope"))


# ------------------------------------------------------------------------------------------- in training


@pytest.mark.parametrize(
    "args",
    [
        {"advantage": "rloo", "policy_loss": "cispo"},
        {"advantage": "reinforce_pp", "kl_in": "reward", "kl_coef": 0.01},
        {
            "advantage": "reinforce_pp_baseline",
            "policy_loss": "gspo",
            "loss_agg": "seq-mean-token-mean",
            "clip_low": 3e-4,
            "clip_high": 4e-4,
        },
        {"policy_loss": "gmpo", "loss_agg": "seq-mean-token-mean", "dynamic_sampling": {"enabled": True}},
        {"advantage": "gigpo"},
        {"advantage": "igpo"},
        {"advantage": "igpo", "igpo": {"baseline": "turn"}},
    ],
    ids=["rloo-cispo", "reinforce_pp", "rpp_baseline-gspo", "gmpo-dapo", "gigpo", "igpo", "igpo-turn"],
)
def test_variants_train_a_step(make_exp, tmp_path, args):
    exp = make_exp("rollout.temperature=1.0", "rewards=[{name: test_trainer_length}]")
    cfg = TrainerConfig(steps=1, batch_size=2, micro_batch_size=8, lr=5e-3, save_every=10**6)
    tr = trainer_for(exp, "grpo", cfg, args={"kl_coef": 0.0, **args}, out=tmp_path / "run")
    before = {k: v.detach().clone() for k, v in tr.policy.named_parameters()}
    m = tr.step(0)
    assert torch.isfinite(torch.tensor(m["train/loss"]))
    assert any(not torch.equal(before[k], v) for k, v in tr.policy.named_parameters())
    if args.get("dynamic_sampling"):
        assert m["dapo/groups_short"] == 0 and m["dapo/first_all_equal_frac"] >= 0
    if args.get("advantage") == "gigpo":  # every episode meets its prompt: a group of 4 at the first step
        assert m["gigpo/max_step_group"] >= 4 and m["gigpo/step_groups"] >= 2
    if args.get("advantage") == "igpo":
        assert (
            math.isfinite(m["igpo/turn_reward"]) and m["igpo/turns_rewarded"] >= 0 and m["time/probe_s"] >= 0
        )


@pytest.mark.parametrize("staleness", [0, 1])
def test_mask_truncated_in_training_drops_exactly_the_cut_off_episodes(make_exp, tmp_path, staleness):
    """Collected by the trainer or taken from the asynchronous worker, a batch goes through the algorithm's
    own post-processing (`Algorithm.finish`): the cut-off episodes are out of the loss either way (the worker's
    batches skipped it before)."""
    from searchrl.core.config import AsyncRolloutConfig

    exp = make_exp(
        "rollout.temperature=1.0", "rewards=[{name: test_trainer_length}]", "rollout.max_total_tokens=200"
    )
    cfg = TrainerConfig(
        steps=1,
        batch_size=2,
        micro_batch_size=8,
        lr=5e-3,
        save_every=10**6,
        async_rollout=AsyncRolloutConfig(max_staleness=staleness),
    )
    tr = trainer_for(exp, "grpo", cfg, args={"kl_coef": 0.0, "mask_truncated": True}, out=tmp_path / "run")
    try:
        m = tr.step(0)
    finally:
        tr.rollouts.close()
    assert tr.rollouts.asynchronous == bool(staleness)
    assert m["rollout/finish_length"] > 0  # the budget cuts some episodes off, so the masking is exercised
    assert m["dapo/truncated_masked"] == pytest.approx(8 * m["rollout/finish_length"])
    assert m["train/sequences"] == 8 - m["dapo/truncated_masked"]  # the others keep their loss
