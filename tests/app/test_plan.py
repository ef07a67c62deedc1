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


def test_the_checked_experiment_carries_its_algorithm_sections_typed():
    """`check_arguments` returns the experiment with ``algorithm.settings`` and ``warm_start.settings`` the
    algorithms' own ``Config`` objects, converted once; a file cannot set them, and the saved config keeps the
    keys as written."""
    from searchrl.algorithms.grpo import GRPOConfig
    from searchrl.algorithms.sft import SFTConfig
    from searchrl.app.experiment import check_arguments, resolve
    from searchrl.core.config import to_dict

    exp = load_experiment(EXP / "quickstart.yaml", ["algorithm.kl_coef=0.25"])
    assert exp.algorithm is not None and exp.algorithm.settings is None  # the schema alone cannot type them
    typed = check_arguments(exp, "q.yaml")
    assert typed.algorithm is not None and typed.warm_start is not None
    assert isinstance(typed.algorithm.settings, GRPOConfig) and typed.algorithm.settings.kl_coef == 0.25
    assert isinstance(typed.warm_start.settings, SFTConfig)
    assert resolve(typed) is typed  # converted once
    assert to_dict(typed) == to_dict(exp) and "settings" not in to_dict(typed)["algorithm"]
    p = plan(typed)
    assert p.stages[0].config is typed.warm_start.settings and p.stages[1].config is typed.algorithm.settings
    for override in ("algorithm.settings={clip: 0.1}", "warm_start.settings={}"):
        with pytest.raises(ConfigError, match="unknown key"):
            check_arguments(load_experiment(EXP / "quickstart.yaml", [override]), "q.yaml")


USER_ALGORITHM = """
from dataclasses import dataclass


@dataclass(frozen=True)
class PlainConfig:
    lr_scale: float = 1.0


class Mine:
    Config = PlainConfig
"""


def test_an_algorithm_whose_config_is_not_typed_settings_is_refused_by_name(tmp_path, monkeypatch):
    (tmp_path / "my_algo_plain.py").write_text(USER_ALGORITHM)
    monkeypatch.syspath_prepend(str(tmp_path))
    exp = load_experiment(None, ["algorithm={name: 'my_algo_plain:Mine'}"])
    with pytest.raises(ConfigError, match="extends searchrl.core.config.AlgorithmSettings") as e:
        plan(exp)
    assert "my_algo_plain.Mine" in str(e.value)


def test_validate_refuses_process_data_with_no_pairs_as_the_stage_would(tmp_path):
    """A collection that kept nothing writes datasets `datasets` cannot load (IndexError in the DPO stage before):
    `check_experiment` (validate, train before anything loads) and the stage refuse it with what the collection
    found; data not collected yet is a missing input (`validate --allow-missing` lists it)."""
    from searchrl.app.checks import check_experiment
    from searchrl.app.process_data import load_pairs, load_sft, save
    from searchrl.core.errors import MissingInput

    summary = {"questions": 24, "kept_episodes": 0, "steps": 36, "pairs": 0}
    exp = load_experiment(
        EXP / "synthetic" / "raggym_dpo.yaml",
        ["warm_start.checkpoint=null", f"process_data.out={tmp_path / 'pd'}"],
    )
    missing: list[MissingInput] = []
    check_experiment(exp, "dpo.yaml", missing)
    assert [m.key for m in missing] == ["process_data.out"] and "collect-process-data" in str(missing[0])
    save(tmp_path / "pd", [], [], summary, exp, "m")
    for check in (lambda: check_experiment(exp, "dpo.yaml"), lambda: load_pairs(tmp_path / "pd")):
        with pytest.raises(
            ConfigError, match=r"holds no preference pairs \(its collection: 0 pairs, 0 of 24"
        ):
            check()
    with pytest.raises(ConfigError, match="holds no kept episodes"):
        load_sft(tmp_path / "pd")
    pair = {"id": "q", "question": "q", "prompt": "p", "actions": [], "observations": [], "step": 0,
            "chosen": "a", "rejected": "b", "chosen_score": 1.0, "rejected_score": -1.0}  # fmt: skip
    save(tmp_path / "pd", [pair], [], {**summary, "pairs": 1}, exp, "m")
    check_experiment(exp, "dpo.yaml")
    assert load_pairs(tmp_path / "pd") == [pair]
