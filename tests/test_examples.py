"""The shipped custom-reward example validates, imports by dotted path, and trains a few steps."""

from pathlib import Path

import yaml

from searchrl.app.experiment import check_arguments, load_experiment
from searchrl.engine.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "custom_reward"


def test_custom_reward_example_trains(make_exp, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))
    shipped = load_experiment(EXAMPLE / "experiment.yaml")
    check_arguments(shipped, str(EXAMPLE / "experiment.yaml"))
    rewards = yaml.safe_load((EXAMPLE / "experiment.yaml").read_text())["rewards"]
    algo = yaml.safe_load((EXAMPLE / "experiment.yaml").read_text())["algorithm"]
    exp = make_exp(
        f"rewards={rewards}",
        f"algorithm={algo}",
        "rollout.temperature=1.0",
        "trainer={steps: 2, batch_size: 2, micro_batch_size: 4, lr: 1.0e-3, save_every: 2}",
    )
    from searchrl.algorithms import algorithm_config
    from searchrl.app.resources import Resources
    from searchrl.engine.trainer import Trainer

    tr = Trainer(
        algorithm="steppo",
        config=algorithm_config("steppo", exp.algorithm.args),
        model_path=exp.model.path,
        cfg=exp.trainer,
        out_dir=exp.out,
        resources=Resources(exp),
        seed=0,
    )
    tr.run()
    row = read_metrics(exp.out / "metrics.jsonl")[-1]
    assert "reward/my_rewards:gold_hits" in row and "reward/my_rewards:gold_hits/gold_found" in row
    assert row["train/value_loss"] == row["train/value_loss"]


def test_gold_hits_scores_each_search(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))
    from my_rewards import gold_hits

    from searchrl.core.records import Doc, Example, Hop
    from searchrl.core.types import Segment, Step, Trajectory
    from searchrl.envs.search import SearchEnv

    class Fixed:
        def search(self, queries, k):
            return [[Doc(id="g1" if "one" in q else "x", title="t", text="t")] for q in queries]

    ex = Example("q", "Q?", ("a",), (Hop("h1", "a", gold_doc_id="g1"), Hop("h2", "b", gold_doc_id="g2")))
    env = SearchEnv(Fixed(), template="short", max_turns=5)
    state = env.reset(ex)
    traj = Trajectory(ex, [Segment("prompt", [0])], state=state)
    for a in [
        "<search> one </search>",
        "<search> one </search>",
        "<search> two </search>",
        "<answer> a </answer>",
    ]:
        env.step(state, a)
        traj.steps.append(Step(0, 0, state.infos[-1]))
    out = gold_hits(traj, hops=ex.hops, hit=1.0, repeat_penalty=0.5)
    assert out.step_scores == (1.0, -0.5, 0.0, 0.0) and out.score == 0.5
