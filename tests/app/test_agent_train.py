"""An agent program trained end to end (`experiments/synthetic/grpo_agent.yaml`): the plain OpenAI-client agent of
examples/agents plays every episode through the policy endpoint, GRPO trains on the ids it recorded, and the
evaluation runs the same agent; `validate` refuses what `train` would."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from searchrl.app.cli import main
from searchrl.core.errors import ConfigError
from searchrl.engine.metrics import read_metrics

from .test_tools_train import tool_overrides

pytest.importorskip("openai")
REPO = Path(__file__).resolve().parents[2]
AGENT_FILE = REPO / "experiments" / "synthetic" / "grpo_agent.yaml"


@pytest.fixture
def agents_path(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "examples" / "agents"))


def overrides(world_dir: Path, out: Path) -> list[str]:
    return [*tool_overrides(world_dir, out), "env.protocol=agent"]


@pytest.mark.parametrize("program", ["openai_search_agent:run", "smolagents_search_agent:run"])
def test_grpo_trains_an_agent_program_through_the_endpoint(tmp_path, world_dir, agents_path, program):
    """The plain OpenAI-client agent, and the smolagents one (its framework unchanged, whatever the barely trained
    policy writes)."""
    smol = program.startswith("smolagents")
    pytest.importorskip("smolagents" if smol else "openai")
    # smolagents' own system prompt is ~1,100 tokens of English: Qwen2.5's vocabulary, a longer context, and
    # fewer episodes (each of its calls sends the whole prompt again); the warm start's head over the 151,936 rows
    # as a sampled softmax, and its evaluation on 2 questions (it took 3.4 of the test's 7 minutes without them)
    smol_extra = [
        "model.tokenizer=qwen2.5",
        "rollout.max_total_tokens=2048",
        "eval.limit=2",
        "warm_start.args={loss_on: all, sampled_softmax: 256}",
        "warm_start.trainer.eval_limit=2",
    ]
    out = tmp_path / "agent"
    main(
        [
            "train",
            str(AGENT_FILE),
            *overrides(world_dir, out),
            f"env.agent_program.function={program}",
            "warm_start.teacher_passes=1",
            "warm_start.trainer={steps: 4, batch_size: 8, micro_batch_size: 8, lr: 4.0e-3, save_every: 4}",
            f"trainer={{steps: 2, batch_size: {1 if smol else 2}, micro_batch_size: 8, lr: 1.0e-4, save_every: 2}}",
            "algorithm.group_size=4",
            *(smol_extra if smol else []),
        ]
    )
    assert set(json.loads((out / "results.json").read_text())) == {"untrained", "sft", "grpo"}
    rows = read_metrics(out / "metrics.jsonl")
    assert len(rows) == 2 and all(r["rollout/tool_calls_per_episode"] >= 0 for r in rows)
    assert all(
        "agent/rows_per_episode" in r and r["agent/errors"] == 0 and r["agent/timeouts"] == 0 for r in rows
    )
    assert all(r["train/action_tokens"] > 0 for r in rows)
    preds = [json.loads(x) for x in (out / "eval" / "grpo-test.predictions.jsonl").read_text().splitlines()]
    assert len(preds) == (2 if smol else 6) and all(
        p["transcript"].startswith("<|im_start|>system\n") for p in preds
    )


@pytest.mark.parametrize(
    "extra,key",
    [
        (["env.agent_program.function=no_such_agent_module:run"], "env.agent_program.function"),
        (["env.agent_program=null"], "env.agent_program"),
        (
            ["env.agent_program.function=null", "env.agent_program.command=[no-such-agent-program-xyz]"],
            "env.agent_program.command",
        ),
        (["env.protocol=tools"], "env.protocol"),
        (["algorithm.name=ppo"], "env.protocol"),
        (["trainer.async_rollout.max_staleness=1"], "trainer.async_rollout.max_staleness"),
    ],
)
def test_validate_and_train_refuse_the_same(tmp_path, world_dir, agents_path, capsys, extra, key):
    args = [str(AGENT_FILE), *overrides(world_dir, tmp_path / "v"), *extra]
    if "env.protocol=tools" in extra:
        args.remove("env.protocol=agent")
    with pytest.raises(SystemExit) as e:
        main(["validate", *args])
    assert e.value.code == 2 and f"key '{key}'" in capsys.readouterr().err
    with pytest.raises((SystemExit, ConfigError)):
        main(["train", *args])
    assert not (tmp_path / "v" / "sft").exists()  # refused before any stage ran
