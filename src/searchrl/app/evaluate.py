"""`evaluate`: an experiment's agent on its evaluation split, written into the run directory (what
`searchrl eval` runs once per dataset; also ``from searchrl import evaluate``)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from searchrl.core.errors import SearchRLError

if TYPE_CHECKING:
    from searchrl.app.resources import Resources
    from searchrl.core.config import Experiment


def evaluate(
    exp: Experiment, model: str | Path | None = None, label: str | None = None
) -> dict[str, dict[str, Any]]:
    """``exp.eval.agent`` on the first ``eval.limit`` questions of ``eval.split``: NAME.json, NAME.md,
    NAME.predictions.jsonl and NAME.config.yaml in ``exp.out``, NAME = ``eval-AGENT[-DESIGN]-LABEL`` (LABEL:
    ``label``, else the split). ``model``: the policy's model directory (default: the run's final model,
    else ``model.path``). Returns {NAME: metrics}; PRM best-of-N (``eval.agent: prm``) gives one row per N."""
    from searchrl.app.eval_episodes import EVAL_AGENTS, add_judge_metrics, episode_metrics, write_results
    from searchrl.app.resources import Resources
    from searchrl.core.config import save_resolved
    from searchrl.core.serving import check_failure_rates, failure_summary, service_metrics

    resources = Resources(exp)
    examples = resources.examples(exp.eval.split)[: exp.eval.limit]
    label = label or exp.eval.split
    t = time.perf_counter()
    if model:
        check_model_dir(model)
    if exp.eval.agent == "prm":  # the start policy guided by the trained PRM, one row per N
        return evaluate_prm(exp, resources, label, model)
    states = EVAL_AGENTS[exp.eval.agent](resources, examples, None if model is None else str(model), label)
    for line in failure_summary():
        print(line)
    check_failure_rates(service_metrics())  # a failing summarizer endpoint makes the numbers meaningless
    metrics = episode_metrics(states)
    add_judge_metrics(metrics, states, exp.eval.judge)
    metrics["seconds"] = time.perf_counter() - t
    design = "" if exp.env.agent == "react" else f"-{exp.env.agent}"
    name = f"eval-{exp.eval.agent}{design}-{label}"
    js, _ = write_results(exp.out, name, metrics, states)
    save_resolved(exp, exp.out, f"{name}.config.yaml")  # the run's own config.yaml is never rewritten
    print(json.dumps({k: metrics[k] for k in ("em_by_hops", "finish_reasons")}))
    print(f"results written to {js}")
    return {name: metrics}


def evaluate_prm(
    exp: Experiment, resources: Resources, label: str, model: str | Path | None = None
) -> dict[str, dict[str, Any]]:
    """RAG-Gym Algorithm 1: the start policy (``model``, the warm-start checkpoint, else the run's SFT
    model) guided by the PRM (``eval.prm``, else the run's final model), best-of-N for each N."""
    from searchrl.app.train import evaluate_best_of_n
    from searchrl.core.config import save_resolved

    ws = exp.warm_start
    policy = model or (ws.checkpoint if ws and ws.checkpoint else None) or exp.out / "sft" / "final"
    prm = exp.eval.prm or exp.out / "final"
    rows = {}
    for n in exp.eval.best_of:
        print(f"policy {policy} guided by the PRM in {prm}, best of {n}, on {label}")
        rows[f"prm-best-of-{n}-{label}"] = evaluate_best_of_n(resources, Path(policy), Path(prm), n)
        save_resolved(exp, exp.out / "eval", f"prm-best-of-{n}-{exp.eval.split}.config.yaml")
    return rows


def check_model_dir(path: str | Path) -> None:
    """``--model``: a local model directory, or a hub id (``org/name``, passed on to transformers)."""
    p = Path(path)
    hub_id = (
        not p.exists() and not p.is_absolute() and str(path).count("/") == 1 and not str(path).startswith(".")
    )
    if hub_id:
        return
    if not p.is_dir() or not ((p / "config.json").exists() or (p / "adapter_config.json").exists()):
        why = "does not exist" if not p.exists() else "is not a model directory (no config.json)"
        raise SearchRLError(f"--model {p}: {why}; pass a Hugging Face model directory or hub id (org/name)")
