"""Training algorithms. Each one lives in its own module and is registered here by name."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from searchrl.core.registry import Registry

if TYPE_CHECKING:
    from searchrl.algorithms.base import Requirements
    from searchrl.core.config import AlgorithmSettings, EnvConfig, KeySources

ALGORITHMS: Registry[type] = Registry("algorithm")
# Lazy so that configs can be validated without importing torch.
ALGORITHMS.add_lazy("sft", "searchrl.algorithms.sft:SFT")
ALGORITHMS.add_lazy("grpo", "searchrl.algorithms.grpo:GRPO")
ALGORITHMS.add_lazy("ppo", "searchrl.algorithms.ppo:PPO")
ALGORITHMS.add_lazy("steppo", "searchrl.algorithms.steppo:StePPO")
ALGORITHMS.add_lazy("slate", "searchrl.algorithms.slate:SLATE")
ALGORITHMS.add_lazy("tree_grpo", "searchrl.algorithms.tree_grpo:TreeGRPO")
ALGORITHMS.add_lazy("arpo", "searchrl.algorithms.arpo:ARPO")
ALGORITHMS.add_lazy("aepo", "searchrl.algorithms.aepo:AEPO")
ALGORITHMS.add_lazy("dpo", "searchrl.algorithms.dpo:DPO")
ALGORITHMS.add_lazy("prm", "searchrl.algorithms.prm:PRM")

# The pieces an algorithm's config selects (``advantage:``, ``policy_loss:``), each registered where it is defined
# with its declaration (`algorithms.objective.advantage_estimator`, `policy_loss`; the losses' module loads without
# torch); a dotted path ``package.module:function`` names a user's own with the same signature.
ADVANTAGES: Registry[Any] = Registry(
    "advantage estimator",
    sources=(
        "searchrl.algorithms.advantage_estimators",
        "searchrl.algorithms.gigpo",
        "searchrl.algorithms.igpo",
    ),
)
POLICY_LOSSES: Registry[Any] = Registry("policy loss", sources=("searchrl.algorithms.policy_losses",))


def algorithm_config(
    name: str,
    args: dict[str, Any],
    source: str = "<config>",
    key: str = "algorithm",
    ctx: KeySources | None = None,
) -> AlgorithmSettings:
    """Algorithm ``name``'s typed ``Config`` from its arguments (``algorithm:`` without ``name``): the one
    conversion of an algorithm section. The registry names it holds (a policy loss, a judge) are left in
    ``ctx`` for the loader to check (`searchrl.app.experiment.resolve`)."""
    from searchrl.core.config import AlgorithmSettings, from_dict
    from searchrl.core.errors import ConfigError

    cls: Any = ALGORITHMS.get(name)
    conf = getattr(cls, "Config", None)
    if not (isinstance(conf, type) and issubclass(conf, AlgorithmSettings)):
        raise ConfigError(
            f"algorithm '{name}' ({cls.__module__}.{cls.__qualname__}) needs a frozen dataclass `Config` that "
            f"extends searchrl.core.config.AlgorithmSettings (a policy-gradient one: PolicyObjective), got {conf!r}",
            file=source,
            key=key,
            hint="docs/design.md, 'An algorithm'",
        )
    return from_dict(conf, args, source=source, key=key, ctx=ctx)  # type: ignore[no-any-return]


def requirements(name: str, config: Any, env: EnvConfig, source: str = "<config>") -> Requirements:
    """What algorithm ``name`` with ``config`` (its typed ``Config``, or its arguments as a dict, converted
    here) needs from the trainer."""
    cls: Any = ALGORITHMS.get(name)
    if isinstance(config, dict):
        config = algorithm_config(name, config, source)
    return cls.requires(config, env)  # type: ignore[no-any-return]


__all__ = ["ADVANTAGES", "ALGORITHMS", "POLICY_LOSSES", "algorithm_config", "requirements"]
