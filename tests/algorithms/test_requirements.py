"""The algorithm-trainer contract: each algorithm declares its `Requirements` from its config, the
trainer sizes batches from them, ``group_size`` lives in the algorithms that use it, and preference rows
are told apart by pair id and chosen flag."""

from dataclasses import replace

import pytest

from searchrl.algorithms import requirements
from searchrl.algorithms.base import Requirements
from searchrl.algorithms.preference import pair_split
from searchrl.app.experiment import check_arguments, load_experiment
from searchrl.core.config import EnvConfig, TrainerConfig
from searchrl.core.errors import ConfigError
from searchrl.core.masking import build_batch
from searchrl.core.types import Segment, Trajectory
from searchrl.engine.trainer import batch_shape

ENV = EnvConfig(max_turns=3)
PAIRS = Requirements(samples_per_item=2, online=False, data="pairs", rows="pairs", old_logprobs=False)


@pytest.mark.parametrize(
    ("name", "args", "expected"),
    [
        ("grpo", {"group_size": 6}, Requirements(samples_per_item=6, reference=True)),
        ("grpo", {"kl_coef": 0.0}, Requirements(samples_per_item=5)),  # ReSearch's 5 rollouts, no π_ref
        ("grpo", {"kl_in": "reward"}, Requirements(samples_per_item=5, reference=True, old_in_prepare=True)),
        ("ppo", {}, Requirements(samples_per_item=1, reference=True, value_head=True, old_in_prepare=True)),
        (
            "steppo",
            {"group_size": 2, "detach_value_trunk": True},
            Requirements(
                samples_per_item=2,
                reference=True,
                value_head=True,
                detach_value_trunk=True,
                process_reward=True,
                old_in_prepare=True,  # PPO's KL penalty is in the reward by default
            ),
        ),
        ("slate", {"k": 3}, Requirements(samples_per_item=3 * 4, reference=True)),  # k · (max_turns + 1)
        ("slate", {"k": 2, "budget": 2}, Requirements(samples_per_item=4, reference=True)),
        ("sft", {}, Requirements(online=False, data="trajectories", old_logprobs=False)),
        ("dpo", {}, replace(PAIRS, reference=True)),
        ("prm", {}, replace(PAIRS, value_head=True, acts=False)),
    ],
)
def test_each_algorithm_declares_what_it_needs(name, args, expected):
    assert requirements(name, args, ENV) == expected


def test_requirements_reject_impossible_combinations():
    with pytest.raises(ValueError, match="at least 1"):
        Requirements(samples_per_item=0)
    with pytest.raises(ValueError, match="two per item"):
        Requirements(samples_per_item=3, rows="pairs", online=False, data="pairs")
    with pytest.raises(ValueError, match="names the data"):
        Requirements(online=False)


def test_batch_shape_comes_from_the_requirements():
    cfg = TrainerConfig(batch_size=8, micro_batch_size=16, mini_batches=2)
    rows, micro, accum = batch_shape(cfg, Requirements(samples_per_item=6), "grpo", world=2)
    assert (rows, micro, accum) == (4 * 6, 12, 1)  # 4 questions per process, 6 rows each, 2 mini-batches
    rows, micro, accum = batch_shape(
        replace(cfg, micro_batch_size=4), Requirements(samples_per_item=6), "grpo", 2
    )
    assert (rows, micro, accum) == (24, 4, 3)
    pairs = requirements("dpo", {}, ENV)
    with pytest.raises(ConfigError, match="pairs"):
        batch_shape(replace(cfg, micro_batch_size=3), pairs, "dpo", 1)


def test_group_size_lives_in_the_algorithms_that_use_it():
    def check(*overrides: str) -> None:
        check_arguments(load_experiment(None, list(overrides)), training=False)

    check("algorithm={name: grpo, group_size: 3}")
    with pytest.raises(ConfigError, match="key 'rollout.group_size': unknown key") as err:
        check("rollout.group_size=4")
    assert "hint: samples per question belong to the algorithm that uses them: algorithm.group_size" in str(
        err.value
    )
    for name in ("sft", "slate", "dpo", "prm"):  # they would ignore it: refused, naming the valid keys
        with pytest.raises(ConfigError, match="key 'algorithm.group_size': unknown key"):
            check(f"algorithm={{name: {name}, group_size: 4}}")
    with pytest.raises(ConfigError, match="group_size must be at least 1"):
        check("algorithm={name: grpo, group_size: 0}")


def test_pairs_are_told_apart_by_pair_id_and_chosen_flag():
    def row(pair: int, chosen: bool, reward: float = 0.0) -> Trajectory:
        t = Trajectory(None, [Segment("prompt", [1]), Segment("action", [2, 3])], pair_id=pair, chosen=chosen)  # type: ignore[arg-type]
        t.reward = reward  # rewards play no part in telling chosen from rejected
        return t

    pad = Trajectory(None, [Segment("prompt", [0, 0])], group_id=-7)  # type: ignore[arg-type]
    batch = build_batch([row(5, False, 1.0), pad, row(2, True), row(5, True), row(2, False, 1.0)], pad_id=0)
    assert batch.pair_ids.tolist() == [5, -1, 2, 5, 2] and batch.chosen.tolist() == [0, 0, 1, 1, 0]
    c, r = pair_split(batch)
    assert c.tolist() == [2, 3] and r.tolist() == [4, 0]  # sorted by pair id; the padding row left out
    with pytest.raises(RuntimeError, match="incomplete preference pair"):
        pair_split(batch.select([0, 2, 3]))
