"""Runs on SLURM (`searchrl.app.slurm`): job resources and the commands a job runs (always), and, against a real
single-node SLURM on this machine (marker ``slurm``; `.ci/slurm-up` starts one, `.ci/run` runs these): a sweep
submitted, run and collected; a run requeued mid-training that resumes to the uninterrupted run's weights; a job
that reaches its time limit saves, requeues and stops at its requeue cap."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch

from searchrl.app.cli import main
from searchrl.app.slurm import SlurmResources, SlurmRun, job_states, resources, run_status
from searchrl.app.sweep import load_sweep
from searchrl.core.errors import ConfigError
from tests.app.held_reward import HOLD_ENV
from tests.engine.test_distributed import TINY_PIPELINE

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "experiments" / "quickstart.yaml"


def test_resources_are_checked_with_the_file_and_key():
    assert resources({"nodes": 2, "gpus_per_node": 8, "time_min": 30}, "s.yaml").per_node == 8
    with pytest.raises(ConfigError) as e:
        resources({"nodes": 0}, "s.yaml")
    assert "s.yaml" in str(e.value) and "slurm" in str(e.value) and "at least 1" in str(e.value)
    with pytest.raises(ConfigError, match="shorter than the time limit"):
        resources({"time_min": 1, "signal_delay_s": 90}, "s.yaml")
    with pytest.raises(ConfigError, match="gpu_per_node"):
        resources({"gpu_per_node": 1}, "s.yaml")


def test_a_sweeps_job_resources_and_sbatch_script(tmp_path):
    """The sweep file's ``slurm:`` and a variant's own over it; the sbatch script submitit writes from them asks
    for the save signal before the limit, requeues, and runs one task per node."""
    from submitit.slurm.slurm import _make_sbatch_string

    f = tmp_path / "s.yaml"
    f.write_text(
        f"name: s\nbase: {QUICKSTART}\nslurm: {{time_min: 30, partition: gpu, signal_delay_s: 100}}\n"
        "variants:\n  - {name: a}\n  - {name: b, slurm: {nodes: 2, gpus_per_node: 4, sbatch: {constraint: a100}}}\n"
    )
    a, b = load_sweep(f, tmp_path).runs
    assert a.slurm == SlurmResources(time_min=30, partition="gpu", signal_delay_s=100)
    assert (b.slurm.nodes, b.slurm.per_node, b.slurm.partition) == (2, 4, "gpu")
    script = _make_sbatch_string("python -m submitit", tmp_path, **b.slurm.sbatch_parameters("s-b"))
    for line in (
        "#SBATCH --signal=USR2@100",
        "#SBATCH --requeue",
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --time=30",
        "#SBATCH --partition=gpu",
        "#SBATCH --constraint=a100",
    ):
        assert line in script, line
    f.write_text(f"name: s\nbase: {QUICKSTART}\nvariants: [{{name: a, slurm: {{nodes: -1}}}}]\n")
    with pytest.raises(ConfigError, match=r"variants\[0\].slurm"):
        load_sweep(f, tmp_path)


def test_a_jobs_command_on_each_node(monkeypatch, tmp_path):
    """One process: `searchrl train`; several nodes: `searchrl launch` with the allocation's machine count, this
    node's rank and the first node as main process (DeepSpeed launched one launcher per node)."""
    import searchrl.app.slurm as slurm

    args = ["train", "x.yaml", "--resume"]
    assert SlurmRun(args, tmp_path, SlurmResources()).command()[1:] == ["-m", "searchrl", *args]
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "2")
    monkeypatch.setenv("SLURM_NODEID", "1")
    monkeypatch.setattr(slurm, "_hostnames", lambda: ["node7", "node8"])
    res = SlurmResources(
        nodes=2, gpus_per_node=8, launch_config="experiments/accelerate/zero3.yaml", port=29511
    )
    cmd = SlurmRun(args, tmp_path, res).command()
    assert cmd[1:4] == ["-m", "searchrl", "launch"] and cmd[-3:] == args
    flags = dict(zip(cmd[4:-3:2], cmd[5:-3:2]))
    assert flags == {
        "--config_file": "experiments/accelerate/zero3.yaml",
        "--num_machines": "2",
        "--num_processes": "16",
        "--machine_rank": "1",
        "--main_process_ip": "node7",
        "--main_process_port": "29511",
        "--deepspeed_multinode_launcher": "standard",
    }


# ------------------------------------------------------------------------------------ on a real SLURM

TINY = [o for o in TINY_PIPELINE if not o.startswith(("trainer.steps=", "trainer.eval_every="))]


@pytest.fixture(scope="session")
def slurm_cluster():
    """A SLURM that answers: this machine's, or one `.ci/slurm-up` starts (it needs root and Debian's packages)."""
    if shutil.which("sinfo") and subprocess.run(["sinfo", "-h"], capture_output=True).returncode == 0:
        return
    if os.geteuid() != 0:
        pytest.skip("no SLURM answers here, and starting one (.ci/slurm-up) needs root")
    proc = subprocess.run([str(REPO / ".ci" / "slurm-up")], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"a single-node SLURM could not be started here: {proc.stderr[-500:]}")


@pytest.fixture
def job_env(monkeypatch):
    """What a submitted job inherits (sbatch exports the environment): one thread, so that runs compare exactly."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def wait_for(predicate, timeout: float, what: str, poll: float = 3.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def job_field(jid: str, name: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", "-o", jid], capture_output=True, text=True).stdout
    for part in out.split():
        if part.startswith(f"{name}="):
            return part.split("=", 1)[1]
    return ""


def release_requeued(jid: str) -> None:
    """A requeued job waits about two minutes before it may start again; let it start now (once it is pending
    again: an update before that is overwritten by the requeue's own start time)."""

    def started() -> bool:
        state = job_field(jid, "JobState")
        if state == "PENDING":
            subprocess.run(["scontrol", "update", f"JobId={jid}", "StartTime=now"], capture_output=True)
        return state not in ("PENDING", "COMPLETING", "REQUEUED", "")

    wait_for(started, 120, f"job {jid} to start again", poll=2.0)


def submit_train(out: Path, overrides: list[str], *slurm: str) -> None:
    """`searchrl train quickstart.yaml OVERRIDES output_dir=OUT --executor slurm --slurm …`."""
    flags = [x for kv in slurm for x in ("--slurm", kv)]
    main(["train", str(QUICKSTART), *overrides, f"output_dir={out}", "--executor", "slurm", *flags])


def submitted_job(capsys) -> str:
    out = capsys.readouterr().out
    return out.split("job ")[1].split(";")[0].split()[0]


def metric_rows(run: Path) -> list[str]:
    f = run / "metrics.jsonl"
    return f.read_text().splitlines() if f.exists() else []


def attempts(run: Path) -> list[dict]:
    f = run / "slurm" / "attempts.jsonl"
    return [json.loads(x) for x in f.read_text().splitlines()] if f.exists() else []


@pytest.mark.slurm
def test_a_sweep_is_submitted_run_and_collected(
    slurm_cluster, job_env, tmp_path, world_dir, agent_model_dir, capsys
):
    f = tmp_path / "sweep.yaml"
    common = [f"data.world_dir={world_dir}", f"model.path={agent_model_dir}", *TINY, "trainer.steps=1"]
    f.write_text(
        f"name: tiny\nbase: {QUICKSTART}\ngrid: {{seed: [0, 1]}}\nslurm: {{time_min: 20, cpus_per_task: 1}}\n"
        f"overrides: {json.dumps(common)}\n"
    )
    root = tmp_path / "sweeps"
    main(["sweep", str(f), "--executor", "slurm", "--root", str(root)])
    assert capsys.readouterr().out.count("submitted seed") == 2
    sweep = load_sweep(f, root)
    for r in sweep.runs:
        assert (r.out / "slurm" / "sbatch.sh").exists()  # the sbatch script beside the run
    main(["sweep", str(f), "--executor", "slurm", "--root", str(root)])  # queued runs are not submitted twice
    assert "0 submitted" in capsys.readouterr().out

    def finished():
        main(["sweep", "status", str(f), "--root", str(root)])
        lines = capsys.readouterr().out.splitlines()
        return lines if all(x.startswith(("done", "failed")) for x in lines) else None

    lines = wait_for(finished, 900, "both runs to finish")
    assert all(x.startswith("done") for x in lines), "\n".join(lines)
    main(["sweep", "collect", str(f), "--root", str(root)])
    assert "2 run(s) done, 0 not" in capsys.readouterr().out
    results = json.loads((root / "tiny" / "results.json").read_text())
    assert set(results["runs"]) == {"seed0", "seed1"} and all("grpo" in r for r in results["runs"].values())


@pytest.mark.slurm
def test_a_requeued_run_resumes_to_the_uninterrupted_weights(
    slurm_cluster, job_env, tmp_path, world_dir, agent_model_dir, capsys, monkeypatch
):
    """`scontrol requeue` mid-training: SIGTERM reaches the run, which saves at its step and exits 75; SLURM
    requeues the job and the next attempt resumes; the final weights equal an uninterrupted job's, bit for bit."""
    from safetensors.torch import load_file

    held = [o for o in TINY if not o.startswith("rewards=")] + [
        "rewards=[{name: 'tests.app.held_reward:held_f1'}]"
    ]
    common = [f"data.world_dir={world_dir}", f"model.path={agent_model_dir}", *held, "trainer.steps=6"]
    monkeypatch.setenv("PYTHONPATH", str(REPO))  # the reward's module, in the job
    runs = {}
    for name in ("whole", "requeued"):
        out = tmp_path / name
        if name == "requeued":  # held in its third step until the requeue's signal has reached it
            out.mkdir()
            (out / "hold").touch()
            monkeypatch.setenv(HOLD_ENV, str(out))
        submit_train(out, common, "cpus_per_task=1")
        runs[name] = (out, submitted_job(capsys))
    out, jid = runs["requeued"]
    wait_for(lambda: len(metric_rows(out)) >= 2, 600, "two GRPO steps")
    subprocess.run(["scontrol", "requeue", jid], check=True)
    wait_for(lambda: (out / "signalled").exists(), 120, "the requeue's SIGTERM to reach the run")
    (out / "hold").unlink()
    wait_for(lambda: job_field(jid, "Restarts") == "1", 120, "the requeue")
    release_requeued(jid)
    for name, (_, j) in runs.items():
        wait_for(lambda j=j: job_field(j, "JobState") in ENDED, 900, f"{name} to finish")
    tries = attempts(out)
    assert [a.get("exit") for a in tries if "exit" in a] == [75, 0], tries
    assert "resumed from" in (out / "slurm" / "run.log").read_text()
    assert len(metric_rows(out)) == 6 and not (out / "hold").exists()
    w1, w2 = (load_file(o / "final" / "model.safetensors") for o, _ in runs.values())
    assert w1.keys() == w2.keys() and all(torch.equal(w1[k], w2[k]) for k in w1)


@pytest.mark.slurm
def test_a_job_at_its_time_limit_saves_requeues_and_stops_at_the_cap(
    slurm_cluster, job_env, tmp_path, world_dir, agent_model_dir, capsys
):
    """A 1-minute job asks for the save signal 30 s before its limit: the run saves and exits 75, submitit requeues
    the job, the second attempt resumes from that checkpoint; with ``max_requeues: 1`` the second signal ends it,
    recorded as failed with its log."""
    out = tmp_path / "long"
    common = [f"data.world_dir={world_dir}", f"model.path={agent_model_dir}", *TINY, "trainer.steps=400"]
    limits = ["time_min=1", "signal_delay_s=30", "max_requeues=1", "cpus_per_task=1"]
    submit_train(out, common, *limits)
    jid = submitted_job(capsys)
    first = wait_for(lambda: [a for a in attempts(out) if "exit" in a], 240, "the first attempt to end")
    assert first[0]["exit"] == 75 and any(out.rglob("checkpoints/latest")), first  # saved where it was
    wait_for(lambda: job_field(jid, "Restarts") == "1", 120, "the requeue")
    release_requeued(jid)
    wait_for(lambda: job_field(jid, "JobState") in ENDED, 300, "the second attempt to end")
    starts = [a for a in attempts(out) if "command" in a]
    assert [a["restart"] for a in starts] == [0, 1]
    assert "resumed from" in (out / "slurm" / "run.log").read_text()
    assert not (out / "results.json").exists()
    assert job_field(jid, "Restarts") == "1"  # the cap: not requeued a second time
    assert run_status(out, job_states([jid])[jid]) == "failed"  # what `searchrl sweep status` reports
