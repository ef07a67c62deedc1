"""`plan(experiment)`: the stages and evaluations of `searchrl train`, worked out without a model."""

from pathlib import Path

import pytest

from searchrl.app.experiment import load_experiment
from searchrl.app.plan import BASE, WARM, Evaluation, plan
from searchrl.core.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
EXP = REPO / "experiments"


def test_quickstart_warm_starts_then_trains_then_evaluates_all_three():
    p = plan(load_experiment(EXP / "quickstart.yaml", ["output_dir=runs/x"]))
    (sft, grpo) = p.stages
    assert (sft.name, sft.algorithm, sft.start, sft.data, sft.out) == (
        WARM,
        "sft",
        BASE,
        "teacher",
        Path("runs/x/sft"),
    )
    assert (grpo.name, grpo.algorithm, grpo.start, grpo.data, grpo.out) == (
        "grpo",
        "grpo",
        WARM,
        "online",
        Path("runs/x"),
    )
    assert [(e.name, e.model) for e in p.evaluations] == [
        ("untrained", BASE),
        ("sft", WARM),
        ("grpo", "grpo"),
    ]
    assert p.teacher_passes == 4 and p.process_data is None


def test_a_given_warm_start_checkpoint_is_not_trained_again():
    p = plan(load_experiment(EXP / "quickstart.yaml", ["warm_start.checkpoint=runs/q/sft/final"]))
    assert [s.name for s in p.stages] == ["grpo"] and p.stages[0].start == "runs/q/sft/final"
    assert Evaluation("sft", "runs/q/sft/final") in p.evaluations and p.teacher_passes == 0


def test_teacher_sft_alone_and_sft_on_process_data():
    alone = plan(load_experiment(EXP / "quickstart.yaml", ["algorithm={name: sft}"]))
    assert [(s.name, s.start, s.data) for s in alone.stages] == [("sft", BASE, "teacher")]
    assert [e.name for e in alone.evaluations] == ["untrained", "sft"] and alone.teacher_passes == 4
    rag = plan(load_experiment(EXP / "synthetic" / "raggym_sft.yaml"))
    # its warm start is the quickstart's SFT model, so the SFT stage on process data is named apart
    assert [(s.name, s.start, s.data) for s in rag.stages] == [
        ("sft (process data)", "runs/quickstart/sft/final", "process-trajectories")
    ]
    assert rag.process_data == "runs/raggym-data"


def test_a_prm_is_evaluated_guiding_its_start_policy():
    p = plan(load_experiment(EXP / "synthetic" / "raggym_prm.yaml"))
    assert p.stages[-1].algorithm == "prm" and p.stages[-1].data == "process-pairs"
    assert [(e.name, e.model, e.guide, e.n) for e in p.evaluations[2:]] == [
        ("prm best-of-4", "runs/quickstart/sft/final", "prm", 4),
        ("prm best-of-8", "runs/quickstart/sft/final", "prm", 8),
    ]
    assert "prm" not in [e.name for e in p.evaluations]


def test_pairs_need_process_data_and_an_algorithm_is_required():
    with pytest.raises(ConfigError, match="process_data.out"):
        plan(load_experiment(EXP / "quickstart.yaml", ["algorithm={name: dpo}"]))
    with pytest.raises(ConfigError, match="needs an algorithm section"):
        plan(load_experiment(None, ["algorithm=null"]))


def test_warm_start_arguments_are_checked_under_their_own_key():
    from searchrl.app.experiment import check_arguments

    exp = load_experiment(EXP / "quickstart.yaml", ["warm_start.args={loss_on: all, sampled_sofmax: 8}"])
    with pytest.raises(ConfigError, match=r"key 'warm_start.args.sampled_sofmax': unknown key") as e:
        check_arguments(exp, "q.yaml")
    assert "did you mean 'sampled_softmax'?" in str(e.value)
