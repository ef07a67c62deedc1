"""`searchrl launch`: `accelerate launch` for a scheduler that reads exit codes (SLURM requeue, Kubernetes).

``searchrl launch [ACCELERATE OPTIONS] train FILE [KEY=VALUE ...] [--resume]`` runs accelerate's own launcher
(torchrun's elastic agent for several processes) in this process, with three differences that a preempted
job needs:

- **the exit code and one line**: a run whose processes stopped on a preemption signal exits 75 (as
  ``searchrl train`` on one process does) with one line saying what was saved and the command that resumes
  it; a user error exits 2 with the processes' one ``error:`` line; a crash exits 1 naming the processes' exit
  codes. Plain ``accelerate launch`` exits 1 with a traceback in each of these cases.
- **time to save**: the agent forwards SIGTERM (and SIGUSR1, which SLURM's ``--signal`` sends ahead of time) to
  the processes and waits ``--shutdown-timeout`` seconds for them before SIGKILL (default: the experiment's
  largest ``trainer.preempt_grace_s`` plus 60 s for the step in progress; torchrun's own default is 30 s).
- **one report**: each process writes how it ended into a directory this launcher reads
  (``SEARCHRL_LAUNCH_STATUS``) instead of printing it, so the line is printed once.

With plain ``accelerate launch`` the processes save and exit 75 the same way; set
``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` (seconds) so that the agent waits for them.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from searchrl.core.errors import SearchRLError
from searchrl.engine.preemption import EXIT_PREEMPTED

STATUS_ENV = "SEARCHRL_LAUNCH_STATUS"
LAUNCHED = ("train", "eval", "collect-process-data")  # the commands that run under a launcher
SAVE_MARGIN_S = 60.0  # the step in progress finishes before the save starts


def split_command(argv: list[str]) -> tuple[list[str], list[str]]:
    """(accelerate's options, the searchrl command) of ``launch``'s arguments: the command starts at the first
    of `LAUNCHED`."""
    for i, word in enumerate(argv):
        if word in LAUNCHED:
            return argv[:i], argv[i:]
    raise SearchRLError(
        "launch needs a command to run: searchrl launch [ACCELERATE OPTIONS] train FILE [KEY=VALUE ...] "
        f"(commands: {', '.join(LAUNCHED)})"
    )


def shutdown_timeout(command: list[str]) -> float:
    """Seconds the processes get between the launcher's signal and SIGKILL: the largest
    ``trainer.preempt_grace_s`` of the experiment's stages plus `SAVE_MARGIN_S`."""
    from searchrl.app.experiment import load_experiment
    from searchrl.core.config import TrainerConfig

    grace = TrainerConfig().preempt_grace_s
    if command[0] == "train" and len(command) > 1:
        overrides = [w for w in command[2:] if "=" in w and not w.startswith("-")]
        exp = load_experiment(command[1], overrides)  # a bad file is refused here, before any process starts
        stages = [exp.trainer] + ([exp.warm_start.trainer] if exp.warm_start is not None else [])
        grace = max(t.preempt_grace_s for t in stages if t is not None)
    return grace + SAVE_MARGIN_S


def read_statuses(folder: Path) -> list[dict[str, Any]]:
    """How each process ended (written by `write_status`), by rank."""
    out = []
    for f in sorted(folder.glob("rank*.json"), key=lambda p: int(p.stem[4:] or 0)):
        try:
            out.append(json.loads(f.read_text()))
        except (OSError, ValueError):
            continue
    return out


def write_status(code: int, exc: BaseException) -> bool:
    """Under `searchrl launch`, this process's end (exit ``code``, ``exc``'s message) for the launcher to report;
    False when not launched so (the caller prints it itself)."""
    folder = os.environ.get(STATUS_ENV)
    if not folder:
        return False
    rank = os.environ.get("RANK", "0")
    record = {"rank": int(rank), "code": code, "message": str(exc), "summary": getattr(exc, "summary", None)}
    tmp = Path(folder) / f".rank{rank}.json"
    tmp.write_text(json.dumps(record))
    tmp.replace(Path(folder) / f"rank{rank}.json")
    return True


def outcome(statuses: list[dict[str, Any]], failure: str | None, resume: str) -> tuple[int, str]:
    """The launcher's exit code and its one line, from the processes' statuses (``failure``: how the launch
    ended when it did not succeed, None when it did)."""
    preempted = [s for s in statuses if s["code"] == EXIT_PREEMPTED]
    if preempted:  # a process that got the signal itself names it; the others say "a peer's signal"
        first = sorted(preempted, key=lambda s: "a peer's signal" in (s["summary"] or ""))[0]
        return EXIT_PREEMPTED, (
            f"stopped: {first['summary'] or first['message']}; continue with `{resume}` "
            f"(exit code {EXIT_PREEMPTED})"
        )
    errors = [s for s in statuses if s["code"] == 2]
    if errors:
        return 2, f"error: {errors[0]['message']}"
    if failure is None:
        return 0, ""
    return 1, f"error: the training processes failed ({failure}); their output is above"


def run(argv: list[str]) -> int:
    """Launch ``argv`` (accelerate's options, then the command); the exit code, its line printed."""
    from accelerate.commands.launch import launch_command, launch_command_parser

    accelerate_args, command = split_command(argv)
    timeout = shutdown_timeout(command)
    resume = shlex.join(["searchrl", "launch", *argv] + ([] if "--resume" in command else ["--resume"]))
    with tempfile.TemporaryDirectory(prefix="searchrl-launch-") as folder:
        env = {
            STATUS_ENV: folder,
            # torchrun's agent: which signals it forwards to the processes, how long it waits for them
            "PET_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
            "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(
                int(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", timeout))
            ),
            "LOGLEVEL": os.environ.get("LOGLEVEL", "ERROR"),  # the agent's shutdown notices: our line says it
        }
        previous = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        forward = _forward_signals()  # a single process (accelerate's simple launcher): we forward them
        try:
            args = launch_command_parser().parse_args([*accelerate_args, "-m", "searchrl", *command])
            failure: str | None = None
            try:
                launch_command(args)
            except subprocess.CalledProcessError as exc:
                failure = f"exit code {exc.returncode}"
            except SystemExit as exc:
                failure = None if exc.code in (0, None) else f"exit code {exc.code}"
            except Exception as exc:  # torchrun's ChildFailedError, SignalException
                failure = _describe(exc)
            code, line = outcome(read_statuses(Path(folder)), failure, resume)
        finally:
            forward()
            for k, v in previous.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    if line:
        print(line, file=sys.stderr)
    return code


def _describe(exc: BaseException) -> str:
    """The processes' exit codes from torchrun's ChildFailedError, or the signal the launcher got."""
    failures = getattr(exc, "failures", None)
    if failures:
        return ", ".join(f"process {rank}: exit code {f.exitcode}" for rank, f in sorted(failures.items()))
    sigval = getattr(exc, "sigval", None)
    if sigval is not None:
        return f"the launcher got {signal.Signals(sigval).name}"
    return f"{type(exc).__name__}: {exc}"


def _forward_signals() -> Any:
    """Until the returned function is called, SIGTERM and SIGUSR1 to this process go on to its child processes
    (torchrun's agent replaces these handlers with its own, which forward them too)."""
    import psutil

    def forward(signum: int, frame: Any) -> None:
        for child in psutil.Process().children():
            try:
                child.send_signal(signum)
            except psutil.Error:
                continue

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGUSR1)}

    def restore() -> None:
        for s, handler in previous.items():
            signal.signal(s, handler)

    return restore
