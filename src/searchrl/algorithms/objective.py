"""The policy objective's settings, shared by every policy-gradient algorithm (GRPO, SLATE, Tree-GRPO, ARPO, PPO,
StePPO), and how a policy loss declares itself.

`PolicyObjective` holds the keys of the clipped-ratio objective and what surrounds it (the KL term, the
aggregation, the policy loss and its arguments, the sampler-trainer correction), each with its help and range as
field metadata (`searchrl.core.config.setting`): the loader checks the ranges, the configuration reference prints
both. An algorithm's config subclasses it and adds its own keys; a different default is a redeclared field (PPO's
KL goes in the reward with k1, as Search-R1's recipe).

A policy loss is one function and its declaration, written together (`algorithms/policy_losses.py`):

    @policy_loss("sapo", loss_agg="seq-mean-token-mean", settings={"tau_pos": LossSetting(1.0, "...", POSITIVE)})
    def sapo(logp, old_logp, advantages, mask, cfg): ...   # reads arguments(cfg, "sapo")["tau_pos"]

The declaration says what the loss requires (an aggregation, whether it is one number per sequence, whether
``dual_clip`` applies) and the settings it takes under ``algorithm.policy_loss_args``, with defaults, ranges and
help. This module and the declarations load without torch, so `searchrl validate` reads them as they are.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from searchrl.algorithms.correction import RolloutCorrection
from searchrl.core.config import AT_LEAST_0, POSITIVE, AlgorithmSettings, Range, check_ranges, setting
from searchrl.core.errors import RegistryError

LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "token-sum-norm"]
CLIP_LOW: Range = (lambda v: 0 <= v < 1, "in [0, 1) (ε of the clipped ratio, 0.2 in the papers)")
ABOVE_1: Range = (lambda v: v > 1, "greater than 1 (verl uses 3)")


@dataclass(frozen=True)
class LossSetting:
    """One argument of a policy loss (``algorithm.policy_loss_args``): its default, what it is, its range."""

    default: float
    help: str
    range: Range | None = None


@dataclass(frozen=True)
class LossDeclaration:
    """What a policy loss requires and takes. ``loss_agg``: the aggregation its objective needs (None: any);
    ``sequence_level``: one loss per sequence; ``geometric_weight``: a sampler-trainer weight is the geometric
    mean of the sequence's token weights (GMPO, as verl's geo_mean), not each token's own; ``dual_clip``: whether
    ``dual_clip`` bounds it; ``settings``: its arguments."""

    name: str
    loss_agg: str | None = None
    sequence_level: bool = False
    geometric_weight: bool = False
    dual_clip: bool = False
    settings: dict[str, LossSetting] = field(default_factory=dict)


def policy_loss(
    name: str,
    *,
    loss_agg: str | None = None,
    sequence_level: bool = False,
    geometric_weight: bool = False,
    dual_clip: bool = False,
    settings: dict[str, LossSetting] | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Declare a policy loss; a built-in one (`algorithms/policy_losses.py`) is registered under ``name``
    (`searchrl.algorithms.POLICY_LOSSES`). A user's loss, named in a config by its dotted path
    (``my_pkg.losses:scaled``), may carry the same decorator (its declaration is read from the function, which
    reads its arguments with ``arguments(cfg, scaled)``) or none (no arguments, any aggregation)."""
    from searchrl.algorithms import POLICY_LOSSES

    decl = LossDeclaration(name, loss_agg, sequence_level, geometric_weight, dual_clip, dict(settings or {}))
    return _declaring(POLICY_LOSSES, decl)


def _declaring(registry: Any, decl: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The decorator that attaches ``decl`` to a function and registers it where it is defined."""

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        fn.declaration = decl  # type: ignore[attr-defined]
        registry.add_defined(decl.name, fn)
        return fn

    return deco


def declaration_of(name: str) -> LossDeclaration:
    """The declaration of policy loss ``name`` (a registered name, or a user's dotted path)."""
    from searchrl.algorithms import POLICY_LOSSES

    fn = POLICY_LOSSES.get(name)
    decl = getattr(fn, "declaration", None)
    return decl if isinstance(decl, LossDeclaration) else LossDeclaration(name)


@dataclass(frozen=True)
class EstimatorDeclaration:
    """What an advantage estimator gives and needs. ``level``: one advantage per episode broadcast to its tokens
    (``sequence``: folded episodes and an agent's several rows can share it), per token (``token``), or per step
    of an episode from the batch's steps (``turn``: GRPO's rows only, not SLATE's single steps); ``group``: its
    baseline is the group's, so it needs at least 2 samples per question."""

    name: str
    level: Literal["sequence", "token", "turn"] = "token"
    group: bool = True


def advantage_estimator(
    name: str, *, level: Literal["sequence", "token", "turn"], group: bool = True
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Declare an advantage estimator; a built-in one is registered under ``name``
    (`searchrl.algorithms.ADVANTAGES`). A user's, named by its dotted path, may carry the same decorator or none
    (then: per token, with a group baseline)."""
    from searchrl.algorithms import ADVANTAGES

    return _declaring(ADVANTAGES, EstimatorDeclaration(name, level, group))


def estimator_of(name: str) -> EstimatorDeclaration:
    """The declaration of advantage estimator ``name`` (a registered name, or a user's dotted path)."""
    from searchrl.algorithms import ADVANTAGES

    decl = getattr(ADVANTAGES.get(name), "declaration", None)
    return decl if isinstance(decl, EstimatorDeclaration) else EstimatorDeclaration(name)


def declared(name: str) -> EstimatorDeclaration | None:
    """``estimator_of(name)``, or None for a name the registry does not know (its own check refuses it, naming
    the key and the valid estimators)."""
    try:
        return estimator_of(name)
    except RegistryError:
        return None


def estimators(level: str) -> list[str]:
    """The registered estimators of ``level`` (for messages: the valid choices)."""
    from searchrl.algorithms import ADVANTAGES

    return [n for n in ADVANTAGES.names() if estimator_of(n).level == level]


def arguments(cfg: Any, loss: str | Callable[..., Any]) -> dict[str, float]:
    """A policy loss's arguments under ``cfg`` (``loss``: its registered name, or the declared function itself, as
    a user's loss passes itself): ``policy_loss_args`` over the declared defaults."""
    decl = (
        declaration_of(loss) if isinstance(loss, str) else getattr(loss, "declaration", LossDeclaration("?"))
    )
    given = getattr(cfg, "policy_loss_args", None) or {}
    return {k: float(given.get(k, s.default)) for k, s in decl.settings.items()}


def check_loss(name: str, loss_agg: str, dual_clip: float | None, args: dict[str, Any]) -> None:
    """Check a config's policy loss and its arguments against the loss's declaration; a ValueError says which key
    is wrong and what it may be. An unknown name is left to the registry's check (`searchrl.app.experiment`),
    which names the key and the valid losses."""
    try:
        decl = declaration_of(name)
    except RegistryError:
        return
    if decl.loss_agg is not None and loss_agg != decl.loss_agg:
        what = "a per-sequence objective" if decl.sequence_level else "averaged per sequence"
        raise ValueError(
            f"policy_loss '{name}' is {what} (the mean over sequences of each one's token mean, as its "
            f"paper, verl and TRL write it); set loss_agg: {decl.loss_agg} (got '{loss_agg}', which would "
            "weight each sequence by its length)"
        )
    if dual_clip is not None and not decl.dual_clip:
        raise ValueError(
            f"dual_clip bounds the clipped ratio's loss (policy_loss: clip, entropy_balanced) and has no effect on "
            f"'{name}'; remove dual_clip (verl's clip_ratio_c is likewise for its vanilla loss only)"
        )
    unknown = sorted(set(args) - set(decl.settings))
    if unknown:
        valid = ", ".join(decl.settings) or "none"
        raise ValueError(
            f"policy_loss_args.{unknown[0]}: policy_loss '{name}' takes no such argument (its arguments: {valid})"
        )
    for key, s in decl.settings.items():
        value = args.get(key, s.default)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ValueError(
                f"policy_loss_args.{key} of policy_loss '{name}' must be a finite number, got {value!r}"
            )
        if s.range is not None and not s.range[0](value):
            raise ValueError(
                f"policy_loss_args.{key} of policy_loss '{name}' must be {s.range[1]}, got {value}"
            )


@dataclass(frozen=True)
class PolicyObjective(AlgorithmSettings):
    """The clipped-ratio objective's keys (ReSearch eq. 1; Search-R1's PPO), common to every policy-gradient
    algorithm. Defaults are ReSearch's Table 4; PPO redeclares its KL's."""

    clip_low: float = setting(
        0.2, "ε_low of the clipped ratio [1 − ε_low, 1 + ε_high] (ReSearch eq. 1, Table 4: 0.2)", CLIP_LOW
    )
    clip_high: float = setting(
        0.2, "ε_high; above clip_low it is DAPO's clip-higher (0.28 there)", AT_LEAST_0
    )
    dual_clip: float | None = setting(
        None,
        "c: negative-advantage losses capped at −c·A (verl's clip_ratio_c, 3 there); null: eq. 1 as written; "
        "policy_loss clip and entropy_balanced only",
        ABOVE_1,
    )
    kl_coef: float = setting(
        0.001,
        "β of the KL to the reference policy (ReSearch Table 4); 0 skips the reference model",
        AT_LEAST_0,
    )
    kl_estimator: Literal["k1", "k2", "k3"] = setting(
        "k3", "the per-token KL estimator (Schulman's k1, k2, k3)"
    )
    kl_clamp: float | None = setting(
        None, "bound each token's KL estimate to ±kl_clamp (verl: 10); null: unbounded", POSITIVE
    )
    kl_in: Literal["loss", "reward"] = setting(
        "loss", "where β·KL enters: the loss (GRPO), or the reward before the advantages (PPO, Search-R1)"
    )
    loss_agg: LossAgg = setting(
        "token-mean",
        "how token losses become the batch's loss: over all action tokens, per sequence then over sequences, "
        "per-sequence sums, or sums over a fixed token count (Dr. GRPO)",
    )
    rollout_correction: RolloutCorrection = setting(
        RolloutCorrection,
        "sampler-trainer importance weights or masks (`algorithms.correction`); mode none: the papers' eq. 1",
    )
    policy_loss: str = setting(
        "clip",
        "the policy loss (`algorithms.policy_losses`): clip (eq. 1), entropy_balanced (AEPO's), gspo, gspo_token, "
        "cispo, gmpo, sapo, or a dotted path to your own",
        registry="policy_losses",
    )
    policy_loss_args: dict[str, float] = setting(
        dict, "the policy loss's own arguments (sapo: tau_pos, tau_neg); its declared defaults fill the rest"
    )

    def __post_init__(self) -> None:
        # the arguments stay as given (a replaced policy_loss keeps none of the old one's defaults); the loss
        # reads them with its declared defaults filled in (`arguments`)
        check_ranges(self)
        check_loss(self.policy_loss, self.loss_agg, self.dual_clip, dict(self.policy_loss_args or {}))
