"""`searchrl sweep SWEEP.yaml`: many training runs from one base experiment, resumable.

A sweep file::

    name: algorithms                      # runs go to runs/sweeps/<name>/<run>/
    base: ../synthetic/grpo.yaml          # the experiment every variant starts from (relative to this file)
    variants:                             # optional: named alternatives (a config file and/or overrides)
      - {name: grpo}
      - {name: ppo, config: ../synthetic/ppo.yaml}
      - {name: ppo-lowkl, config: ../synthetic/ppo.yaml, overrides: [algorithm.kl_coef=0.0001]}
    grid:                                 # optional: the cartesian product of these keys' values
      seed: [0, 1, 2]
    overrides: [warm_start.checkpoint=runs/quickstart/sft/final]   # applied to every run

Run names are stable and readable: ``<variant>-<key><value>-…`` (``ppo-seed1``). A run whose
``results.json`` exists is skipped and an interrupted one continues from its last checkpoint, so a
crashed sweep resumes where it stopped; a failing run is recorded
in ``sweep.json`` (with its log) and the others go on. ``--jobs N`` runs N at once; ``--launch-config``
starts every run through ``searchrl launch --config_file …`` (accelerate's launcher; multi-GPU sweeps).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from searchrl.app.slurm import ACTIVE, SlurmResources, resources
from searchrl.core.errors import ConfigError


@dataclass(frozen=True)
class Run:
    name: str
    config: Path
    overrides: tuple[str, ...]
    out: Path
    slurm: SlurmResources | None = None  # the job's resources under --executor slurm

    def train_args(self) -> list[str]:
        """``train FILE --resume name=… output_dir=… OVERRIDES``: --resume, so that a run interrupted mid-way (a
        killed sweep, a requeued job) continues from its last checkpoint."""
        return [
            "train",
            str(self.config),
            "--resume",
            f"name={self.name}",
            f"output_dir={self.out}",
            *self.overrides,
        ]

    def command(self, launch_config: str | None = None) -> list[str]:
        if launch_config:  # `searchrl launch`: accelerate's launcher with a preempted run's exit code (75)
            return [
                sys.executable,
                "-m",
                "searchrl",
                "launch",
                "--config_file",
                launch_config,
                *self.train_args(),
            ]
        return [sys.executable, "-m", "searchrl", *self.train_args()]

    @property
    def done(self) -> bool:
        return (self.out / "results.json").exists()


@dataclass
class Sweep:
    name: str
    runs: list[Run] = field(default_factory=list)
    root: Path = Path("runs/sweeps")

    @property
    def dir(self) -> Path:
        return self.root / self.name


def _slug(value: Any) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", str(value)).strip("-")


def load_sweep(path: str | Path, root: str | Path = "runs/sweeps") -> Sweep:
    path = Path(path)
    if not path.exists():
        raise ConfigError("sweep file not found", file=str(path))
    from searchrl.core.loader import load_yaml

    if path.is_dir():
        raise ConfigError("is a directory; pass a sweep YAML file", file=str(path))
    spec = load_yaml(path.read_bytes(), str(path)) or {}
    if not isinstance(spec, dict):
        raise ConfigError("the top level must be a mapping", file=str(path), value=type(spec).__name__)
    allowed = {"name", "base", "variants", "grid", "overrides", "slurm"}
    for key in spec:
        if key not in allowed:
            raise ConfigError("unknown key", file=str(path), key=key, value=key, choices=sorted(allowed))
    if "base" not in spec:
        raise ConfigError("a sweep needs the experiment it starts from", file=str(path), key="base")
    here = path.parent
    base = Path(os.path.normpath(here / spec["base"]))
    name = str(spec.get("name") or path.stem)
    variants = spec.get("variants") or [{"name": ""}]
    grid = spec.get("grid") or {}
    if not isinstance(grid, dict) or not all(isinstance(v, list) and v for v in grid.values()):
        raise ConfigError(
            "grid must map config keys to non-empty lists of values", file=str(path), key="grid"
        )
    common = tuple(str(o) for o in spec.get("overrides") or [])
    sweep = Sweep(name, root=Path(root))
    seen: set[str] = set()
    for i, var in enumerate(variants):
        if not isinstance(var, dict) or set(var) - {"name", "config", "overrides", "slurm"}:
            raise ConfigError(
                "each variant is {name, config?, overrides?, slurm?}",
                file=str(path),
                key=f"variants[{i}]",
                value=var,
            )
        job = spec.get("slurm") or {}
        if not isinstance(job, dict):
            raise ConfigError("must be a mapping of job resources", file=str(path), key="slurm", value=job)
        res = resources(
            {**job, **(var.get("slurm") or {})},
            str(path),
            "slurm" if "slurm" not in var else f"variants[{i}].slurm",
        )
        config = Path(os.path.normpath(here / var["config"])) if var.get("config") else base
        if not config.exists():
            raise ConfigError(
                "experiment file not found", file=str(path), key=f"variants[{i}].config", value=str(config)
            )
        for combo in itertools.product(*grid.values()) if grid else [()]:
            parts = [_slug(var.get("name", ""))] + [
                f"{_slug(k.split('.')[-1])}{_slug(v)}" for k, v in zip(grid, combo)
            ]
            run_name = "-".join(p for p in parts if p) or name
            if run_name in seen:
                raise ConfigError(
                    f"two runs would be named '{run_name}': give the variants distinct names",
                    file=str(path),
                    key="variants",
                )
            seen.add(run_name)
            grid_over = tuple(
                f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in zip(grid, combo)
            )
            sweep.runs.append(
                Run(
                    run_name,
                    config,
                    (*common, *(str(o) for o in var.get("overrides") or []), *grid_over),
                    sweep.dir / run_name,
                    res,
                )
            )
    return sweep


def check(sweep: Sweep) -> None:
    """Every run's experiment loads and validates before anything starts: its arguments and what each of its
    stages would refuse at its start (paths are checked by each run: one may start from an earlier's model)."""
    from searchrl.app.experiment import check_arguments, load_experiment
    from searchrl.app.plan import check_stages

    for r in sweep.runs:
        exp, where = load_experiment(r.config, list(r.overrides)), f"{r.config} (run {r.name})"
        exp = check_arguments(exp, where)
        if exp.algorithm is not None:
            check_stages(exp, where)


def _load_status(sweep: Sweep) -> dict[str, Any]:
    status_file = sweep.dir / "sweep.json"
    status: dict[str, Any] = json.loads(status_file.read_text()) if status_file.exists() else {}
    for r in sweep.runs:
        if r.done:
            status[r.name] = {**status.get(r.name, {}), "status": "done"}
    return status


def _save_status(sweep: Sweep, status: dict[str, Any]) -> None:
    (sweep.dir / "sweep.json").write_text(json.dumps(status, indent=1))


def run_sweep(
    sweep: Sweep,
    jobs: int = 1,
    launch_config: str | None = None,
    dry_run: bool = False,
    executor: str = "local",
) -> dict[str, Any]:
    """Run what is not finished (``executor: local``), or submit it as SLURM jobs (``slurm``: see
    `submit_sweep`); returns and writes the status of every run (``sweep.json``)."""
    todo = [r for r in sweep.runs if not r.done]
    if dry_run:
        for r in sweep.runs:
            print(f"{'done ' if r.done else 'todo '} {r.name}: {' '.join(r.command(launch_config))}")
        return {}
    check(sweep)
    sweep.dir.mkdir(parents=True, exist_ok=True)
    if executor == "slurm":
        return submit_sweep(sweep, launch_config)
    status_file = sweep.dir / "sweep.json"
    status = _load_status(sweep)

    def one(r: Run) -> tuple[str, dict[str, Any]]:
        r.out.mkdir(parents=True, exist_ok=True)
        log = r.out / "sweep.log"
        t = time.perf_counter()
        with log.open("a") as fh:  # an interrupted run's earlier log is kept
            rc = subprocess.run(r.command(launch_config), stdout=fh, stderr=subprocess.STDOUT).returncode
        ok = rc == 0 and r.done
        print(
            f"{'finished' if ok else 'FAILED  '} {r.name} ({time.perf_counter() - t:.0f} s){'' if ok else f', see {log}'}",
            flush=True,
        )
        return r.name, {
            "status": "done" if ok else "failed",
            "returncode": rc,
            "log": str(log),
            "seconds": time.perf_counter() - t,
        }

    print(
        f"sweep {sweep.name}: {len(sweep.runs)} runs, {len(sweep.runs) - len(todo)} already done, {len(todo)} to run"
    )
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        for name, st in pool.map(one, todo):
            status[name] = st
            status_file.write_text(json.dumps(status, indent=1))
    status_file.write_text(json.dumps(status, indent=1))
    return status


# ------------------------------------------------------------------ SLURM (`searchrl.app.slurm`)


def submit_sweep(sweep: Sweep, launch_config: str | None = None) -> dict[str, Any]:
    """Each run not done and not already queued or running, submitted as one SLURM job with its resources
    (``slurm:`` of the sweep file, a variant's own over it); ``--launch-config`` fills a run's
    ``slurm.launch_config`` where it has none. Writes the job ids into ``sweep.json``."""
    from dataclasses import replace

    from searchrl.app.slurm import job_states, submit

    status = _load_status(sweep)
    live = job_states(
        [str(status[r.name]["job_id"]) for r in sweep.runs if status.get(r.name, {}).get("job_id")]
    )
    submitted = 0
    for r in sweep.runs:
        jid = str(status.get(r.name, {}).get("job_id", ""))
        if r.done or (jid and live.get(jid, {}).get("state") in ACTIVE):
            continue
        res = r.slurm or SlurmResources()
        if launch_config and not res.launch_config:
            res = replace(res, launch_config=launch_config)
        out = r.out.absolute()
        args = Run(r.name, r.config.absolute(), r.overrides, out).train_args()
        jid = submit(args, out, res, f"{sweep.name}-{r.name}")
        status[r.name] = {"status": "submitted", "job_id": jid, "log": str(out / "slurm" / "run.log")}
        print(f"submitted {r.name}: job {jid} (logs in {out / 'slurm'})", flush=True)
        submitted += 1
        _save_status(sweep, status)
    print(
        f"sweep {sweep.name}: {len(sweep.runs)} runs, {submitted} submitted; follow with "
        f"`searchrl sweep status …`, tables with `searchrl sweep collect …`"
    )
    _save_status(sweep, status)
    return status


def sweep_status(sweep: Sweep) -> list[dict[str, Any]]:
    """Every run's state: done / queued / running / failed (from its results and the scheduler's state of its
    job), the job id, the scheduler's state and requeue count, and its log; written into ``sweep.json``."""
    from searchrl.app.slurm import job_states, run_status

    status = _load_status(sweep)
    jobs = job_states([str(v["job_id"]) for v in status.values() if v.get("job_id")])
    rows = []
    for r in sweep.runs:
        st = status.get(r.name, {})
        jid = str(st.get("job_id", ""))
        sched = jobs.get(jid) if jid else None
        now = run_status(r.out, sched) if jid else ("done" if r.done else st.get("status", "not run"))
        rows.append(
            {
                "run": r.name,
                "status": now,
                "job_id": jid or None,
                "scheduler": (sched or {}).get("state"),
                "restarts": (sched or {}).get("restarts"),
                "log": st.get("log"),
            }
        )
        if st:
            status[r.name] = {**st, "status": now}
    if sweep.dir.exists():
        _save_status(sweep, status)
    return rows


def collect(sweep: Sweep) -> dict[str, Any]:
    """The finished runs' results side by side (each stage's test metrics), the others with their status and
    log: ``results.json`` and ``results.md`` in the sweep's directory."""
    rows = sweep_status(sweep)
    out: dict[str, Any] = {"runs": {}, "not_done": {}}
    for r, row in zip(sweep.runs, rows):
        if row["status"] == "done":
            out["runs"][r.name] = json.loads((r.out / "results.json").read_text())
        else:
            out["not_done"][r.name] = {k: row[k] for k in ("status", "job_id", "log")}
    sweep.dir.mkdir(parents=True, exist_ok=True)
    (sweep.dir / "results.json").write_text(json.dumps(out, indent=1))
    metrics = ("em", "f1", "searches_per_question")
    lines = [
        f"# sweep {sweep.name}",
        "",
        "| run | stage | " + " | ".join(metrics) + " |",
        "|---|---|" + "---|" * len(metrics),
    ]
    for name, results in out["runs"].items():
        for stage, m in results.items():
            if isinstance(m, dict):
                lines.append(f"| {name} | {stage} | " + " | ".join(_fmt(m.get(k)) for k in metrics) + " |")
    for name, st in out["not_done"].items():
        lines.append(
            f"| {name} | {st['status']} (job {st['job_id']}, log {st['log']}) |" + " |" * len(metrics)
        )
    (sweep.dir / "results.md").write_text("\n".join(lines) + "\n")
    return out


def _fmt(v: Any) -> str:
    return f"{v:.3f}" if isinstance(v, float) else ("" if v is None else str(v))
