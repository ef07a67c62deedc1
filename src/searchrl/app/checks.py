"""Everything `train` would refuse when any stage starts, checked from the file, in one place: `validate`,
`train` (before anything loads), `train --dry-run` and `sweep` all call `check_experiment` (docs/design.md,
invariant 14)."""

from __future__ import annotations

from searchrl.app.experiment import check_arguments, check_model_template, check_paths
from searchrl.app.plan import check_stages
from searchrl.core.config import Experiment
from searchrl.core.errors import MissingInput


def check_experiment(
    exp: Experiment, source: str = "<config>", missing: list[MissingInput] | None = None
) -> Experiment:
    """The named objects and their arguments (`check_arguments`), each training stage's plan, batch shape and
    data (`searchrl.app.plan.check_stages`), the paths (`check_paths`; with ``missing``, inputs not there yet
    are listed in it instead of refused) and a local model's chat template against the protocol. Returns the
    experiment resolved (its algorithm sections typed: `searchrl.app.experiment.resolve`)."""
    exp = check_arguments(exp, source)
    if exp.algorithm is not None:
        check_stages(exp, source)
    check_paths(exp, source, missing)
    if not missing:
        check_model_template(exp, source)
    return exp
