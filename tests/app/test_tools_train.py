"""Training in the tool protocol end to end: the local model built with a chat template and tool tokens, the
SFT warm start on the teacher's trajectories in tool format, then every online algorithm (GRPO, PPO, StePPO,
SLATE) on rollouts in the protocol, evaluation, and the tool-use metrics and guard. (Rollouts that call tools,
valid and not, on Qwen's vocabulary: tests/rollout/test_tool_rollout.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from searchrl.app.cli import main
from searchrl.engine.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
SYNTH = REPO / "experiments" / "synthetic"


def tool_overrides(world_dir: Path, out: Path) -> list[str]:
    return [
        f"data.world_dir={world_dir}",
        f"output_dir={out}",
        "model.size=tiny",
        "model.layers=null",
        "env.protocol=tools",
        "env.template=tools",
        "env.topk=1",
        "env.max_turns=3",
        "rollout.max_new_tokens=64",
        "rollout.max_total_tokens=700",
        "eval.limit=6",
    ]


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory, world_dir):
    out = tmp_path_factory.mktemp("tools") / "grpo"
    main(
        [
            "train",
            str(SYNTH / "grpo_tools.yaml"),
            *tool_overrides(world_dir, out),
            "warm_start.teacher_passes=1",
            "warm_start.trainer={steps: 6, batch_size: 8, micro_batch_size: 8, lr: 4.0e-3, save_every: 6}",
            "trainer={steps: 2, batch_size: 2, micro_batch_size: 8, lr: 1.0e-4, save_every: 2}",
            "algorithm.group_size=4",
        ]
    )
    return out


def test_sft_then_grpo_in_tool_format(grpo_run, world_dir):
    out = grpo_run
    assert set(json.loads((out / "results.json").read_text())) == {"untrained", "sft", "grpo"}
    [rec] = [json.loads(line) for line in (out / "sft" / "teacher-1.jsonl").read_text().splitlines()[:1]]
    assert '"name": "search"' in rec["prompt"] and rec["prompt"].endswith("<|im_start|>assistant\n")
    assert all(a.endswith("<|im_end|>") for a in rec["actions"])
    assert "<tool_call>" in rec["actions"][0] and "<tool_response>" in rec["observations"][0]
    # the local tokenizer built for the protocol: its chat template, and each tool marker one token
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(world_dir / "model-tiny-tools"))
    assert tok.chat_template and all(
        len(tok.encode(t, add_special_tokens=False)) == 1
        for t in ("<tool_call>", "</tool_response>", "<|im_end|>")
    )
    rows = read_metrics(out / "metrics.jsonl")
    assert all("rollout/tool_calls_per_episode" in r and "rollout/tool_calls/search" in r for r in rows)
    # (a 6-step warm start of the tiny model does not yet write whole tool calls: what it learns is measured
    # by experiments/synthetic/grpo_tools.yaml, not asserted here)
    preds = [
        json.loads(line) for line in (out / "eval" / "grpo-test.predictions.jsonl").read_text().splitlines()
    ]
    assert len(preds) == 6 and all(p["transcript"].startswith("<|im_start|>system\n") for p in preds)


@pytest.mark.parametrize(
    "config,extra",
    [
        ("ppo.yaml", ["algorithm.group_size=2"]),
        ("steppo.yaml", ["algorithm.group_size=2"]),
        ("slate.yaml", ["algorithm.k=2"]),
    ],
)
def test_every_online_algorithm_trains_on_tool_calls(grpo_run, world_dir, tmp_path, config, extra):
    out = tmp_path / "run"
    main(
        [
            "train",
            str(SYNTH / config),
            *tool_overrides(world_dir, out),
            f"warm_start.checkpoint={grpo_run / 'sft' / 'final'}",
            "trainer={steps: 1, batch_size: 2, micro_batch_size: 8, lr: 1.0e-4, save_every: 1}",
            "eval.limit=2",
            *extra,
        ]
    )
    [row] = read_metrics(out / "metrics.jsonl")
    assert row["rollout/tool_calls_per_episode"] >= 0 and "train/loss" in row
    assert (out / "final" / "config.json").exists()


def test_guard_trips_when_a_run_stops_calling_tools(grpo_run, world_dir, tmp_path, capsys):
    """``{metric: tool_calls, min: ...}``: a bound no run can meet trips at the first step it is checked."""
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        main(
            [
                "train",
                str(SYNTH / "grpo_tools.yaml"),
                *tool_overrides(world_dir, out),
                f"warm_start.checkpoint={grpo_run / 'sft' / 'final'}",
                "trainer={steps: 2, batch_size: 2, micro_batch_size: 8, lr: 1.0e-4, save_every: 1, "
                "guards: {monitors: [{metric: tool_calls, min: 100, window: 1}], on_trip: stop}}",
                "algorithm.group_size=2",
            ]
        )
    assert e.value.code != 0
    assert "guard 'tool_calls' (rollout/tool_calls_per_episode)" in capsys.readouterr().err


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["env.protocol=tools"], "env.template"),  # the default plain prompt has no chat turns
        (["env.protocol=tools", "env.template=tools", "env.agent=rag"], "env.agent"),
        (["env.protocol=tools", "env.template=tools", "env.tools=[{name: mcp}]"], "env.tools[0].args.server"),
        (
            ["env.protocol=tools", "env.template=tools", "env.tools=[{name: search, args: {k: 3}}]"],
            "env.tools[0].args.k",
        ),
        (["env.protocol=tools", "env.template=tools", "env.tools=[{name: browse}]"], "env.tools[0].name"),
        (["env.protocol=tools", "env.template=tools", "env.max_tool_calls=0"], "env.max_tool_calls"),
    ],
)
def test_tool_protocol_configs_are_checked(overrides, key):
    from searchrl.app.experiment import check_arguments, load_experiment
    from searchrl.core.errors import ConfigError

    exp = load_experiment(None, overrides)
    with pytest.raises(ConfigError) as e:
        check_arguments(exp, "exp.yaml")
    assert e.value.key == key and "exp.yaml" in str(e.value)
