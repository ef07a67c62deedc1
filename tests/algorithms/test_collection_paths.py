"""One collection path: every batch of episodes goes through its algorithm's own post-processing, whether the
algorithm collected it (`Algorithm.collect`) or the asynchronous worker did (`Algorithm.accept`, what the trainer
calls on the worker's episodes): the same rows, masks, rewards and metrics from the same episodes; an algorithm,
or an option of one, that builds its rows within the step is refused asynchronous rollouts when the
configuration is read."""

from __future__ import annotations

import pytest

from searchrl.app.experiment import check_arguments
from searchrl.core.config import AsyncRolloutConfig, TrainerConfig
from searchrl.core.errors import ConfigError
from searchrl.rollout.loop import rollout

from ..engine.test_trainer import trainer_for

# (algorithm, its arguments, other overrides); every online algorithm and the options that change its rows
CASES = [
    ("grpo", {}, []),
    ("grpo", {"mask_truncated": True}, []),
    ("grpo", {"advantage": "rloo", "loss_agg": "seq-mean-token-mean"}, []),
    ("grpo", {"advantage": "gigpo"}, []),
    ("grpo", {"advantage": "igpo"}, []),
    ("grpo", {}, ["env.context={max_tokens: 120, max_segments: 3}"]),
    ("grpo", {"dynamic_sampling": {"enabled": True, "max_attempts": 2}}, []),
    ("ppo", {}, []),
    ("steppo", {}, ["rewards=[{name: em}, {name: stepsearch}]"]),
    ("slate", {}, []),
    ("tree_grpo", {}, []),
    ("arpo", {}, []),
    ("aepo", {}, []),
]
# what refuses asynchronous collection, and why: these build their rows within the step
REFUSED = {"slate", "tree_grpo", "arpo", "aepo", "dynamic_sampling", "env.context"}


def rows_of(trajs):
    return [
        (
            t.token_ids,
            [s.kind for s in t.segments],
            t.trained,
            t.reward,
            list(t.step_rewards),
            t.episode_id,
            t.group_id,
            t.finish_reason,
        )
        for t in trajs
    ]


def comparable(metrics: dict) -> dict:
    return {
        k: float(v)
        for k, v in metrics.items()
        if "per_second" not in k and not k.startswith(("time/", "mem/"))
    }


@pytest.mark.parametrize("name,args,extra", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_collected_and_worker_batches_get_the_same_post_processing(
    make_exp, agent_model_dir, tmp_path, name, args, extra
):
    algo = {"name": name, **args}
    exp = make_exp(
        f"model.path={agent_model_dir}",
        f"algorithm={algo}",
        "rollout.temperature=0.0",
        "rollout.max_total_tokens=260",
        "rollout.loop=episode",
        "trainer.async_rollout.max_staleness=1",
        *extra,
    )
    reason = next((r for r in REFUSED if r == name or r in args or any(x.startswith(r) for x in extra)), None)
    if reason is not None:  # refused when the configuration is read, as `train` and `validate` read it
        with pytest.raises(ConfigError) as e:
            check_arguments(exp, "<test>", training=True)
        assert e.value.key in ("trainer.async_rollout.max_staleness", "env.context")
        return
    check_arguments(exp, "<test>", training=True)
    cfg = TrainerConfig(steps=1, batch_size=2, micro_batch_size=8, save_every=10**6,
                        async_rollout=AsyncRolloutConfig(max_staleness=0))  # fmt: skip
    tr = trainer_for(exp, name, cfg, args={k: v for k, v in args.items()}, out=tmp_path / "run")
    a, c = tr.algo, tr.algo.ctx
    indices = [0, 1]
    collected, m1 = a.collect(indices)
    # the worker's batch: the same episodes, unscored, as the worker hands them over
    raw, stats = rollout(
        [c.train_examples[i] for i in indices], c.env, c.generator, c.tokenizer, c.sampling,
        a.cfg.group_size, c.max_total_tokens,
    )  # fmt: skip
    for t in raw:
        t.group_id = indices[t.group_id]
    taken, m2 = a.accept(raw, stats.metrics())
    assert rows_of(collected) == rows_of(taken)
    assert comparable(m1) == comparable(m2)
    if args.get("mask_truncated"):  # the budget cuts episodes off: the masking is exercised on both paths
        assert float(m2["dapo/truncated_masked"]) > 0 and sum(not t.trained for t in taken) == float(
            m2["dapo/truncated_masked"]
        )
    assert len(collected) >= 8
