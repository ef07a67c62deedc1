"""Everything `train` would refuse when any stage starts, checked from the file, in one place: `validate`,
`train` (before anything loads), `train --dry-run` and `sweep` all call `check_experiment` (docs/design.md,
invariant 14)."""

from __future__ import annotations

from searchrl.app.experiment import check_arguments, check_model_template, check_paths
from searchrl.app.plan import check_stages, plan
from searchrl.core.config import Experiment
from searchrl.core.errors import MissingInput


def check_experiment(
    exp: Experiment, source: str = "<config>", missing: list[MissingInput] | None = None
) -> Experiment:
    """The named objects and their arguments (`check_arguments`), each training stage's plan, batch shape and
    data (`searchrl.app.plan.check_stages`), the paths and the collected process data (`check_paths`,
    `check_process_data`; with ``missing``, inputs not there yet are listed in it instead of refused) and a local model's chat template against the protocol. Returns the
    experiment resolved (its algorithm sections typed: `searchrl.app.experiment.resolve`)."""
    exp = check_arguments(exp, source)
    if exp.algorithm is not None:
        check_stages(exp, source)
    check_paths(exp, source, missing)
    if exp.algorithm is not None:
        check_process_data(exp, source, missing)
    if not missing:
        check_model_template(exp, source)
    return exp


def check_process_data(exp: Experiment, source: str, missing: list[MissingInput] | None = None) -> None:
    """The collected process data a stage reads (DPO's and the PRM's pairs, SFT's kept episodes): there (else a
    `MissingInput`, listed in ``missing`` where given), and not empty (`searchrl.app.process_data.check_collected`,
    which the stage asks too)."""
    if exp.process_data.out is None:
        return
    from searchrl.app.process_data import check_collected

    for stage in plan(exp).stages:
        if stage.data.startswith("process-"):
            part = "pairs" if stage.data == "process-pairs" else "sft"
            problem = check_collected(exp.process_data.out, part, source)
            if isinstance(problem, MissingInput) and missing is not None:
                missing.append(problem)
            elif problem is not None:
                raise problem
