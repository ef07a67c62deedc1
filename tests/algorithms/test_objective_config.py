"""The policy objective's one config (`algorithms.objective.PolicyObjective`) and the policy losses' declarations:
every algorithm field carries its help and (where it has one) its range as metadata, the declarations load
without torch, and a loss with a setting of its own is one function and its declaration."""

from __future__ import annotations

import dataclasses
import importlib
import subprocess
import sys
import textwrap

import pytest

from searchrl.algorithms import ALGORITHMS, POLICY_LOSSES, algorithm_config
from searchrl.algorithms.grpo import GRPOConfig
from searchrl.algorithms.objective import PolicyObjective, declaration_of
from searchrl.algorithms.ppo import PPOConfig
from searchrl.core.errors import ConfigError


def _fields(cls, prefix=""):
    """(key, field) of ``cls`` and of its nested sections."""
    for f in dataclasses.fields(cls):
        yield f"{prefix}{f.name}", f
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default) and not isinstance(default, type):
            yield from _fields(type(default), f"{prefix}{f.name}.")


@pytest.mark.parametrize("name", sorted(ALGORITHMS.names()))
def test_every_algorithm_key_has_its_help_as_metadata(name):
    cls = ALGORITHMS.get(name).Config
    missing = [key for key, f in _fields(cls) if not f.metadata.get("help")]
    assert not missing, f"{name}: keys without metadata help: {missing}"


def test_group_algorithms_and_ppo_share_one_objective():
    shared = {f.name for f in dataclasses.fields(PolicyObjective)}
    for name in ("grpo", "slate", "tree_grpo", "arpo", "aepo", "ppo", "steppo"):
        assert issubclass(ALGORITHMS.get(name).Config, PolicyObjective), name
        assert shared <= {f.name for f in dataclasses.fields(ALGORITHMS.get(name).Config)}
    # one default differs where the papers differ: Search-R1's PPO puts a k1 KL in the reward
    assert (GRPOConfig().kl_in, GRPOConfig().kl_estimator) == ("loss", "k3")
    assert (PPOConfig().kl_in, PPOConfig().kl_estimator) == ("reward", "k1")


def test_ranges_are_checked_in_files_and_in_code():
    """The loader names the key and the range; a config built in code is checked the same way."""
    for key, value, says in (
        ("branch_probability", 1.5, "branch_probability must be in [0, 1]"),
        ("entropy_tokens", 0, "entropy_tokens must be at least 1"),
        ("kl_coef", -0.1, "kl_coef must be at least 0"),
    ):
        with pytest.raises(ConfigError, match=rf"key 'algorithm.{key}': {key} must be") as e:
            algorithm_config("arpo", {key: value}, source="exp.yaml")
        assert "exp.yaml" in str(e.value) and says in str(e.value)
        with pytest.raises(ValueError, match=says.replace("[", r"\[").replace("]", r"\]")):
            ALGORITHMS.get("arpo").Config(**{key: value})
    with pytest.raises(ConfigError, match="gamma must be in"):
        algorithm_config("ppo", {"gamma": 1.5})
    with pytest.raises(ValueError, match="trees must be at least 1"):
        ALGORITHMS.get("tree_grpo").Config(trees=0)
    with pytest.raises(ValueError, match="beta must be greater than 0"):
        ALGORITHMS.get("dpo").Config(beta=0.0)


def test_declarations_load_without_torch():
    """What `searchrl validate` reads of the losses: their names and declarations, torch not imported."""
    code = textwrap.dedent(
        """
        import sys
        from searchrl.algorithms import POLICY_LOSSES
        from searchrl.algorithms.objective import declaration_of
        names = POLICY_LOSSES.names()
        assert {"clip", "gspo", "gspo_token", "cispo", "gmpo", "sapo"} <= set(names), names
        assert declaration_of("sapo").settings["tau_neg"].default == 1.05
        assert declaration_of("gmpo").geometric_weight and declaration_of("clip").dual_clip
        assert "torch" not in sys.modules, "torch was imported"
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_the_declarations_say_what_each_loss_requires():
    seq = {n for n in POLICY_LOSSES.names() if declaration_of(n).loss_agg == "seq-mean-token-mean"}
    assert seq == {"gspo", "gspo_token", "gmpo", "sapo"}
    assert {n for n in POLICY_LOSSES.names() if declaration_of(n).sequence_level} == {"gspo", "gmpo"}
    assert {n for n in POLICY_LOSSES.names() if declaration_of(n).dual_clip} == {"clip", "entropy_balanced"}
    assert set(declaration_of("sapo").settings) == {"tau_pos", "tau_neg"}


USER_LOSS = """
from searchrl.algorithms.objective import LossSetting, arguments, policy_loss
from searchrl.core.config import POSITIVE


@policy_loss("scaled", settings={"scale": LossSetting(2.0, "the loss's factor", POSITIVE)})
def scaled(logp, old_logp, adv, mask, cfg):
    import torch

    return -arguments(cfg, scaled)["scale"] * adv * logp, {"ratio": torch.exp(logp - old_logp)}


def plain(logp, old_logp, adv, mask, cfg):
    return -adv * logp, {}
"""


def test_a_loss_with_a_setting_is_one_function_and_its_declaration(tmp_path, monkeypatch, make_exp):
    """A user's loss with its own argument: declared beside its code, named by its dotted path, its argument
    set under policy_loss_args (default filled in, range and name checked by validate), and used by a step's
    loss as declared."""
    import torch

    from searchrl.app.experiment import check_arguments

    (tmp_path / "my_losses.py").write_text(USER_LOSS)
    monkeypatch.syspath_prepend(str(tmp_path))
    import my_losses

    from searchrl.algorithms.objective import arguments

    conf = GRPOConfig(policy_loss="my_losses:scaled")
    assert arguments(conf, my_losses.scaled) == {"scale": 2.0}  # the declared default
    conf = algorithm_config("grpo", {"policy_loss": "my_losses:scaled", "policy_loss_args": {"scale": 3}})
    assert arguments(conf, my_losses.scaled) == {"scale": 3.0}
    logp, adv = torch.tensor([[-1.0, -2.0]]), torch.tensor([[1.0, 1.0]])
    loss, _ = POLICY_LOSSES.get(conf.policy_loss)(logp, logp, adv, torch.ones(1, 2), conf)
    assert torch.equal(loss, torch.tensor([[3.0, 6.0]]))
    check_arguments(
        make_exp("algorithm.policy_loss=my_losses:scaled", "algorithm.policy_loss_args={scale: 0.5}")
    )
    for args, says in (("{scale: 0}", "must be greater than 0"), ("{scal: 1}", "its arguments: scale")):
        with pytest.raises(ConfigError, match=says):  # what `searchrl validate` and `train` check
            check_arguments(
                make_exp("algorithm.policy_loss=my_losses:scaled", f"algorithm.policy_loss_args={args}")
            )
    # without a declaration: no arguments, any aggregation
    assert arguments(GRPOConfig(policy_loss="my_losses:plain"), my_losses.plain) == {}
    with pytest.raises(ValueError, match="its arguments: none"):
        GRPOConfig(policy_loss="my_losses:plain", policy_loss_args={"scale": 1.0})


def test_a_users_declaration_registers_no_name(tmp_path, monkeypatch):
    """A user's declared loss or estimator is named by its dotted path: importing it adds no registry name (the
    registry's names do not depend on what was imported), even one that equals a built-in's."""
    (tmp_path / "clash_losses.py").write_text(
        "from searchrl.algorithms.objective import advantage_estimator, policy_loss\n\n\n"
        "@policy_loss('sapo')\ndef sapo(logp, old_logp, adv, mask, cfg):\n    return -adv * logp, {}\n\n\n"
        "@advantage_estimator('mine', level='token')\ndef mine(x):\n    return x.loss_mask * 0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    from searchrl.algorithms import ADVANTAGES

    before = (POLICY_LOSSES.names(), ADVANTAGES.names())
    mod = importlib.import_module("clash_losses")
    assert (POLICY_LOSSES.names(), ADVANTAGES.names()) == before
    assert POLICY_LOSSES.get("sapo") is not mod.sapo
    GRPOConfig(policy_loss="clash_losses:sapo")  # its own declaration: no arguments, any aggregation


def test_estimators_declare_their_level_and_group():
    """What the trainer and validate read from an estimator's declaration: sequence-level estimators are the
    ones folded episodes can share, turn-level ones credit steps (GRPO's rows, not SLATE's), and the estimators
    without a group baseline train with groups of one."""
    from searchrl.algorithms import ADVANTAGES
    from searchrl.algorithms.objective import estimator_of, estimators

    assert set(estimators("sequence")) == {
        "grpo",
        "rloo",
        "reinforce",
        "reinforce_batch",
        "reinforce_baseline",
    }
    assert set(estimators("turn")) == {"gigpo", "igpo"}
    assert set(estimators("token")) == {"reinforce_pp", "reinforce_pp_baseline"}
    assert {n for n in ADVANTAGES.names() if not estimator_of(n).group} == {
        "reinforce",
        "reinforce_batch",
        "reinforce_pp",
    }
    GRPOConfig(group_size=1, advantage="reinforce_pp")
    with pytest.raises(ValueError, match="advantages reinforce, reinforce_batch, reinforce_pp need no group"):
        GRPOConfig(group_size=1, advantage="rloo")
    with pytest.raises(ValueError, match="credits the steps of whole episodes"):
        ALGORITHMS.get("slate").Config(advantage="gigpo")


def test_a_declared_estimator_by_dotted_path(tmp_path, monkeypatch):
    (tmp_path / "my_estimators.py").write_text(
        "from searchrl.algorithms.objective import advantage_estimator\n\n\n"
        "@advantage_estimator('lone_test', level='sequence', group=False)\n"
        "def lone(x):\n    return x.loss_mask * 0\n\n\n"
        "def plain(x):\n    return x.loss_mask * 0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    GRPOConfig(group_size=1, advantage="my_estimators:lone")  # declared: no group needed
    with pytest.raises(ValueError, match="group baseline"):  # undeclared: assumed to need its group
        GRPOConfig(group_size=1, advantage="my_estimators:plain")
