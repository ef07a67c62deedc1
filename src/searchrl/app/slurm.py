"""Runs submitted to SLURM through submitit: `searchrl sweep … --executor slurm`, `searchrl train … --executor slurm`.

Each run is one job (its resources: `SlurmResources`, from the sweep file's ``slurm:`` mapping, a variant's own, or
``--slurm KEY=VALUE``), written beside the run: ``<run>/slurm/`` holds submitit's sbatch script, its logs, the
run's own log (``run.log``) and one line per attempt (``attempts.jsonl``). On each of the job's nodes the job runs
`SlurmRun`: the run's ``searchrl train … --resume`` (one process), or ``searchrl launch`` across the allocation
(``--num_machines`` = nodes, ``--machine_rank`` = the node's index, the first node as main process), in a
process group of its own.

**Time limits and preemption.** The job asks for a signal ``signal_delay_s`` before its time limit (submitit's
``--signal=USR2@…``); submitit then calls `SlurmRun.checkpoint`, which passes SIGUSR1 to the run (it finishes
its step, saves, exits 75) and has submitit requeue the job (``scontrol requeue``); the next attempt resumes from
the checkpoint. A job preempted or requeued by the scheduler gets SIGTERM, which is passed on the same way, and
SLURM requeues it. Each attempt after ``max_requeues`` requeues is refused (recorded as failed with its log).

**State.** `job_states` reads the scheduler (``squeue``, then ``scontrol show job`` for jobs that just ended);
a run is done when its ``results.json`` exists. Neither needs SLURM's accounting database.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from searchrl.core.errors import ConfigError, SearchRLError
from searchrl.engine.preemption import EXIT_PREEMPTED


@dataclass(frozen=True)
class SlurmResources:
    """A run's job: what it asks the scheduler for, and how it starts on the nodes it gets."""

    nodes: int = 1  # machines; more than one launches across them (docs/distributed.md, "Several machines")
    gpus_per_node: int = 0
    processes_per_node: int | None = None  # training processes per node (default: gpus_per_node, or 1)
    cpus_per_task: int | None = None  # CPUs per node (one task per node)
    mem_gb: float | None = None  # memory per node
    time_min: int = 60  # the time limit
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    signal_delay_s: int = 120  # the save signal comes this long before the time limit
    max_requeues: int = 3  # attempts after the first (time limits and preemptions together)
    launch_config: str | None = None  # an accelerate config file (experiments/accelerate/*.yaml)
    port: int = 29500  # the main process's port, several processes
    setup: list[str] = field(default_factory=list)  # shell lines before the run (module load, activate)
    sbatch: dict[str, Any] = field(default_factory=dict)  # more sbatch options, e.g. {constraint: a100}

    def __post_init__(self) -> None:
        for name in ("nodes", "time_min"):
            if getattr(self, name) < 1:
                raise ValueError(f"slurm.{name} must be at least 1, got {getattr(self, name)}")
        for name in ("gpus_per_node", "max_requeues", "signal_delay_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"slurm.{name} must be at least 0, got {getattr(self, name)}")
        if self.processes_per_node is not None and self.processes_per_node < 1:
            raise ValueError(f"slurm.processes_per_node must be at least 1, got {self.processes_per_node}")
        if self.signal_delay_s >= self.time_min * 60:
            raise ValueError(
                f"slurm.signal_delay_s ({self.signal_delay_s}) must be shorter than the time limit "
                f"({self.time_min} min): the save signal would come before the job starts"
            )

    @property
    def per_node(self) -> int:
        return self.processes_per_node or max(1, self.gpus_per_node)

    def sbatch_parameters(self, name: str) -> dict[str, Any]:
        """submitit's `SlurmExecutor.update_parameters` for this job (sbatch's options, one task per node)."""
        extra = {k.replace("_", "-"): v for k, v in self.sbatch.items()}
        extra.setdefault("requeue", True)  # a preempted job goes back to the queue (it resumes)
        params: dict[str, Any] = {
            "job_name": name,
            "nodes": self.nodes,
            "ntasks_per_node": 1,
            "time": self.time_min,
            "signal_delay_s": self.signal_delay_s,
            "additional_parameters": extra,
            "setup": list(self.setup),
            "stderr_to_stdout": True,
        }
        if self.gpus_per_node:
            params["gpus_per_node"] = self.gpus_per_node
        if self.cpus_per_task:
            params["cpus_per_task"] = self.cpus_per_task
        if self.mem_gb:
            params["mem"] = f"{int(self.mem_gb * 1024)}MB"
        for key in ("partition", "account", "qos"):
            if getattr(self, key):
                params[key] = getattr(self, key)
        return params


def resources(spec: Any, source: str, key: str = "slurm") -> SlurmResources:
    """`SlurmResources` from a mapping, with errors naming the file and key."""
    from searchrl.core.config import from_dict

    if spec is None:
        return SlurmResources()
    if not isinstance(spec, dict):
        raise ConfigError("must be a mapping of job resources", file=source, key=key, value=spec)
    try:
        res: SlurmResources = from_dict(SlurmResources, spec, source=source, key=key)
    except ValueError as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(str(e), file=source, key=key) from e
    return res


def _submitit() -> Any:
    try:
        import submitit
    except ImportError as e:
        raise SearchRLError(
            "--executor slurm submits through submitit: pip install 'searchrl[slurm]' (or pip install submitit)"
        ) from e
    return submitit


class SlurmRun:
    """What a run's job executes on each node: the run's command in a process group of its own, with the
    scheduler's signals passed on to it; `checkpoint` is submitit's requeue hook."""

    def __init__(self, train_args: list[str], out: Path, res: SlurmResources) -> None:
        self.train_args = list(train_args)  # `train FILE --resume name=… output_dir=… OVERRIDES`
        self.out = Path(out)
        self.res = res
        self.proc: subprocess.Popen[bytes] | None = None
        self.attempt: dict[str, Any] = {}  # this attempt's record (attempts.jsonl)

    # ------------------------------------------------------------------ in the job
    def command(self) -> list[str]:
        """``searchrl train …``, or ``searchrl launch …`` over the allocation's nodes and processes."""
        nodes = int(os.environ.get("SLURM_JOB_NUM_NODES", self.res.nodes))
        if nodes == 1 and self.res.per_node == 1 and not self.res.launch_config:
            return [sys.executable, "-m", "searchrl", *self.train_args]
        head = _hostnames()[0]
        launch = [sys.executable, "-m", "searchrl", "launch"]
        if self.res.launch_config:
            launch += ["--config_file", self.res.launch_config]
        launch += [
            "--num_machines",
            str(nodes),
            "--num_processes",
            str(nodes * self.res.per_node),
            "--machine_rank",
            os.environ.get("SLURM_NODEID", "0"),
            "--main_process_ip",
            head,
            "--main_process_port",
            str(self.res.port),
        ]
        if nodes > 1 and self.res.launch_config and "zero" in Path(self.res.launch_config).name:
            launch += ["--deepspeed_multinode_launcher", "standard"]  # one launcher per node, not pdsh
        return [*launch, *self.train_args]

    def __call__(self) -> int:
        logs = self.out / "slurm"
        logs.mkdir(parents=True, exist_ok=True)
        restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
        attempt = {
            "job_id": os.environ.get("SLURM_JOB_ID"),
            "restart": restarts,
            "node": socket.gethostname(),
            "node_rank": int(os.environ.get("SLURM_NODEID", "0")),
            "started": time.time(),
        }
        if restarts > self.res.max_requeues:
            _append(logs / "attempts.jsonl", {**attempt, "refused": "requeued too many times"})
            raise SearchRLError(
                f"run {self.out} was requeued {restarts} times (slurm.max_requeues {self.res.max_requeues}); "
                f"its log: {logs / 'run.log'}"
            )
        cmd = self.command()
        self.attempt = attempt
        _append(logs / "attempts.jsonl", {**attempt, "command": shlex.join(cmd)})
        signal.signal(signal.SIGTERM, self._pass_on)  # the scheduler's preemption (submitit ignores it)
        with (logs / "run.log").open("ab") as log:
            self.proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_ignore_user_signals,
            )
            rc = self._wait()
        _append(logs / "attempts.jsonl", {**attempt, "exit": rc, "ended": time.time()})
        if rc not in (0, EXIT_PREEMPTED):
            raise SearchRLError(f"run {self.out} failed (exit code {rc}); its log: {logs / 'run.log'}")
        return rc

    def _wait(self) -> int:
        """The run's exit code; polled (a signal handler may poll it too: a blocking wait would hold its lock)."""
        assert self.proc is not None
        while (rc := self.proc.poll()) is None:
            time.sleep(0.5)
        return rc

    def _pass_on(self, signum: int, frame: Any = None) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signum)

    def checkpoint(self) -> Any:
        """submitit's hook on its signal (the time limit ahead, or a preemption notice): the run saves at its
        step boundary and stops (SIGUSR1, exit 75); the job is then requeued and resumes."""
        submitit = _submitit()
        while self.proc is not None and self.proc.poll() is None:
            self._pass_on(signal.SIGUSR1)  # again every few seconds: one sent before the run listened is lost
            for _ in range(10):
                if self.proc.poll() is not None:
                    break
                time.sleep(0.5)
        if self.proc is not None:
            end = {
                "exit": self.proc.returncode,
                "ended": time.time(),
                "signal": "time limit or preemption notice",
            }
            _append(self.out / "slurm" / "attempts.jsonl", {**self.attempt, **end})
        return submitit.helpers.DelayedSubmission(SlurmRun(self.train_args, self.out, self.res))


def _ignore_user_signals() -> None:
    """In the run's process before it starts: SIGUSR1 ignored until the run installs its own handler (the default
    action would end a run that has not started listening; `SlurmRun.checkpoint` sends it again), and SIGUSR2,
    submitit's signal, ignored for good (SLURM delivers ``--signal`` to every process of the job step; its
    default action would end the run before it saved)."""
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)


def _append(path: Path, row: dict[str, Any]) -> None:
    with path.open("a") as fh:
        fh.write(json.dumps(row) + "\n")


def _hostnames() -> list[str]:
    nodelist = os.environ.get("SLURM_JOB_NODELIST", socket.gethostname())
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout.split()
    except (OSError, subprocess.SubprocessError):
        out = []
    return out or [nodelist]


# ------------------------------------------------------------------ submitting and reading the scheduler


def submit(train_args: list[str], out: Path, res: SlurmResources, name: str) -> str:
    """Submit one run as a job; its sbatch script and logs go to ``out/slurm``. Returns the job id."""
    submitit = _submitit()
    folder = Path(out) / "slurm"
    folder.mkdir(parents=True, exist_ok=True)
    executor = submitit.SlurmExecutor(folder=folder, max_num_timeout=res.max_requeues)
    executor.update_parameters(**res.sbatch_parameters(name))
    job = executor.submit(SlurmRun(train_args, out, res))
    script = folder / f"{job.job_id}_submission.sh"
    if script.exists():  # the sbatch script beside the run, under a stable name too
        (folder / "sbatch.sh").write_text(script.read_text())
    return str(job.job_id)


def job_states(job_ids: list[str]) -> dict[str, dict[str, Any]]:
    """The scheduler's view of ``job_ids``: {id: {state, restarts, reason}}; a job the scheduler no longer
    knows (ended long ago) has state ``GONE``."""
    out: dict[str, dict[str, Any]] = {}
    for jid in job_ids:
        info = _scontrol(jid)
        out[jid] = (
            {
                "state": info.get("JobState", "UNKNOWN"),
                "restarts": int(info.get("Restarts", "0") or 0),
                "reason": info.get("Reason", ""),
            }
            if info
            else {"state": "GONE", "restarts": None, "reason": ""}
        )
    return out


def _scontrol(jid: str) -> dict[str, str]:
    try:
        proc = subprocess.run(
            ["scontrol", "show", "job", "-o", jid], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.SubprocessError):
        return {}
    if proc.returncode != 0:
        return {}
    fields: dict[str, str] = {}
    for part in proc.stdout.split():
        if "=" in part:
            k, _, v = part.partition("=")
            fields.setdefault(k, v)
    return fields


ACTIVE = (
    "PENDING",
    "RUNNING",
    "REQUEUED",
    "CONFIGURING",
    "COMPLETING",
    "SUSPENDED",
    "REQUEUE_HOLD",
    "RESIZING",
)


def run_status(out: Path, scheduler: dict[str, Any] | None) -> str:
    """done (its results.json exists), queued / running (the scheduler holds the job), or failed."""
    if (Path(out) / "results.json").exists():
        return "done"
    state = (scheduler or {}).get("state", "GONE")
    if state == "PENDING":
        return "queued"
    if state in ACTIVE:
        return "running"
    return "failed"
