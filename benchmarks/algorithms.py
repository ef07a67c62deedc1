"""GRPO vs PPO vs StePPO (StepSearch Table 2 / §4.2) vs SLATE on the synthetic world, from one SFT checkpoint,
over several RL seeds, at an equal generation budget.

    python benchmarks/algorithms.py --sft runs/quickstart/sft/final --seeds 0 1 2 \
        --steps grpo=60 ppo=60 steppo=60 slate=150 [KEY=VALUE ...]

Each (algorithm, seed) is a `searchrl train experiments/synthetic/<algo>.yaml` run in
runs/algos[-NAME]-<algo>-seed<S>/ with `warm_start.checkpoint` pointing at the shared SFT model; ``--steps``
sets each algorithm's `trainer.steps` (SLATE samples k candidates of one step where GRPO samples whole
episodes, so it needs more steps for the same generated tokens: the table's tokens per question shows the
budgets). Reports test EM, F1, searches per question, the redundant-search rate (searches whose documents were
all seen before), generated tokens per training question and time per step, mean ± std over seeds; then, from
the per-question predictions (`searchrl report`'s statistics), a 95% bootstrap interval of EM over questions
and seeds per algorithm and paired bootstrap tests (same questions, same seeds) of every algorithm against the
SFT start and of every two algorithms, with p-values. Writes benchmarks/results/NAME.json and NAME.md.

An experiment that trains offline on RAG-Gym process data (``process_data`` set: raggym_dpo, raggym_dpo_nll, ...)
first collects it with the same SFT model and seed (`searchrl collect-process-data`, ``--process-questions``
training questions, into runs/algos-NAME-process-<key>-seed<S>-q<Q>-data/, shared by arms whose collections
would be the same); its generated tokens and seconds are the collection's plus its training's, and its tokens per
question are per collected question.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
METRICS = (
    "em",
    "f1",
    "searches_per_question",
    "redundant_search_rate",
    "invalid_action_rate",
    "no_answer_rate",
)


def _eval_metrics(stage: dict[str, object]) -> dict[str, float]:
    """The table's metrics of one evaluated stage; ``no_answer_rate``: the share of questions the agent never
    answered (answer avoidance: Search-R1++), from the finish reasons."""
    reasons = stage.get("finish_reasons") or {}
    assert isinstance(reasons, dict)
    n = float(stage.get("n") or sum(reasons.values()) or 1)
    out = {m: float(stage.get(m, 0.0)) for m in METRICS if m != "no_answer_rate"}  # type: ignore[arg-type]
    out["no_answer_rate"] = 1.0 - reasons.get("answer", 0) / n
    return out


TRAIN = ("rollout/tokens_generated", "time/step_s")  # summed over the run's steps
PEAK = "mem/peak_rss_gb"  # the largest over the run's steps (runs before it was logged have none)


def _questions_per_step(run: str) -> int:
    import yaml

    cfg = yaml.safe_load((Path("runs") / run / "config.yaml").read_text())
    return int(cfg["trainer"]["batch_size"])


def _collect_process_data(config: Path, name: str, seed: int, sft: str, questions: int) -> dict[str, Any]:
    """For an experiment that trains on process data: collect it and return its summary with ``out`` (the
    directory), its generated tokens and its seconds under the training metrics' names; for any other
    experiment, ``{}``. Arms of one seed whose collections would be the same (agent design and process_data
    settings) share one (each is charged its whole cost); an existing collection is reused."""
    import dataclasses
    import hashlib

    from searchrl.core.loader import read_experiment

    exp = read_experiment(config)[0]
    if exp.process_data.out is None:
        return {}
    settings = {k: v for k, v in dataclasses.asdict(exp.process_data).items() if k not in ("out", "limit")}
    key = hashlib.sha1(
        json.dumps([exp.env.agent, settings], sort_keys=True, default=str).encode()
    ).hexdigest()
    out = Path("runs") / f"{name.rsplit('-', 2)[0]}-process-{key[:8]}-seed{seed}-q{questions}-data"
    if not (out / "summary.json").exists():
        cmd = [
            sys.executable,
            "-m",
            "searchrl",
            "collect-process-data",
            str(config),
            "--model",
            str(Path(sft).resolve()),
            f"seed={seed}",
            f"process_data.out={out}",
            f"process_data.limit={questions}",
        ]
        print("$", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
    summary = json.loads((out / "summary.json").read_text())
    return {**summary, "out": str(out), "time/step_s": summary["seconds"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sft", required=True, help="the SFT model every algorithm starts from")
    p.add_argument("--algorithms", nargs="+", default=["grpo", "ppo", "steppo", "slate"])
    p.add_argument("--steps", nargs="*", default=[], help="ALGO=N: that algorithm's trainer.steps")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--name", default="algorithms", help="results file name; also tags the run directories")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    p.add_argument(
        "--process-questions",
        type=int,
        default=300,
        help="training questions an offline (process-data) arm collects its data on",
    )
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    steps = dict(x.split("=", 1) for x in args.steps)
    results: dict[str, dict[int, dict[str, float]]] = {}
    run_dirs: list[Path] = []
    sft: dict[str, float] = {}
    for algo in args.algorithms:
        config = REPO / "experiments" / "synthetic" / f"{algo}.yaml"
        results[algo] = {}
        for s in args.seeds:
            tag = "" if args.name == "algorithms" else f"-{args.name}"
            name = f"algos{tag}-{algo}-seed{s}"
            res_file = Path("runs") / name / "results.json"
            collected = _collect_process_data(config, name, s, args.sft, args.process_questions)
            if not res_file.exists():
                cmd = [
                    sys.executable,
                    "-m",
                    "searchrl",
                    "train",
                    str(config),
                    f"name={name}",
                    f"seed={s}",
                    f"warm_start.checkpoint={Path(args.sft).resolve()}",
                    *([f"process_data.out={collected['out']}"] if collected else []),
                    "trainer.samples.groups=0",  # benchmarks write no training samples
                    *([f"trainer.steps={steps[algo]}"] if algo in steps else []),
                    *args.overrides,
                ]
                print("$", " ".join(cmd), flush=True)
                subprocess.run(cmd, check=True)
            run_dirs.append(Path("runs") / name)
            res = json.loads(res_file.read_text())
            stage = next(k for k in res if k not in ("untrained", "sft"))
            results[algo][s] = _eval_metrics(res[stage])
            rows = [
                json.loads(line) for line in (Path("runs") / name / "metrics.jsonl").read_text().splitlines()
            ]
            for m in TRAIN:
                results[algo][s][m] = sum(r.get(m, 0.0) for r in rows) + float(collected.get(m, 0.0))
            peaks = [r[PEAK] for r in rows if PEAK in r]
            if peaks:
                results[algo][s][PEAK] = max(peaks)
            # every step draws batch_size training questions; an offline arm generated on its collected ones
            questions = collected.get("questions") or len(rows) * _questions_per_step(name)
            results[algo][s]["generated_tokens_per_question"] = (
                results[algo][s]["rollout/tokens_generated"] / questions
            )
            sft = _eval_metrics(res["sft"])
    cols: tuple[str, ...] = (
        *METRICS,
        "rollout/tokens_generated",
        "generated_tokens_per_question",
        "time/step_s",
    )
    if all(PEAK in r for per_seed in results.values() for r in per_seed.values()):
        cols += (PEAK,)
    labels = {
        "rollout/tokens_generated": "generated tokens (run)",
        "time/step_s": "training s (run)",
        PEAK: "peak RSS GB",
    }
    head = " | ".join(labels.get(c, c) for c in cols)
    table = [
        f"From one SFT checkpoint ({args.sft}); mean ± std over seeds {args.seeds}; "
        f"trainer.steps {steps or 'as configured'}",
        "",
        f"| run | {head} |",
        "|---" + "|---" * len(cols) + "|",
        "| SFT start | "
        + " | ".join(f"{sft[m]:.3f}" for m in METRICS)
        + " |" * (len(cols) - len(METRICS) + 1),
    ]
    summary = {}
    for algo, per_seed in results.items():
        cells, summary[algo] = [], {}
        for m in cols:
            vals = [per_seed[s][m] for s in args.seeds]
            sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
            summary[algo][m] = {"mean": statistics.mean(vals), "std": sd, "per_seed": vals}
            fmt = ".0f" if m in TRAIN else ".1f" if m == "generated_tokens_per_question" else ".3f"
            cells.append(f"{statistics.mean(vals):{fmt}} ± {sd:{fmt}}")
        table.append(f"| {algo} | " + " | ".join(cells) + " |")
    print("\n" + "\n".join(table))
    stats_md, paired = statistics_of(run_dirs)
    print("\n" + stats_md)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.md").write_text("\n".join(table) + "\n\n" + stats_md + "\n")
    (out / f"{args.name}.json").write_text(
        json.dumps(
            {
                "sft": sft,
                "summary": summary,
                "paired": paired,
                "seeds": args.seeds,
                "steps": steps,
                "overrides": args.overrides,
            },
            indent=1,
        )
    )


def statistics_of(run_dirs: list[Path]) -> tuple[str, list[dict[str, object]]]:
    """EM intervals per algorithm and stage (the SFT start is every run's ``sft`` stage: the same model, so
    its rows pool the seeds' evaluations) and paired tests, as markdown and as records."""
    from searchrl.app.report import ALPHA, arms, interval
    from searchrl.core.stats import align, paired_bootstrap

    groups = {}
    for d in run_dirs:
        groups.setdefault(d.name.rsplit("-seed", 1)[0].rsplit("-", 1)[-1], []).append(d)
    data = arms(groups)
    start = next(v for (algo, stage), v in data.items() if stage == "sft")
    rl = {algo: v for (algo, stage), v in data.items() if stage != "sft"}
    arms_ = {"SFT start": start, **rl}
    lines = ["| arm | EM [95% CI over questions x seeds] |", "|---|---|"]
    lines += [f"| {a} | {interval(v)} |" for a, v in arms_.items()]
    lines += [
        "",
        f"Paired bootstrap (same questions, same seeds; two-sided, significant at p < {ALPHA}):",
        "",
        "| a | b | EM a − b [95% CI] | p | significant |",
        "|---|---|---|---|---|",
    ]
    names = list(arms_)
    records = []
    for i, first in enumerate(names):
        for second in names[i + 1 :]:
            # every algorithm against the start, then every two algorithms
            a, b = (second, first) if first == "SFT start" else (first, second)
            t = paired_bootstrap(*align(arms_[a], arms_[b]))
            sig = t.significant(ALPHA)
            lines.append(f"| {a} | {b} | {t.difference} | {t.p_value:.4f} | {'**yes**' if sig else 'no'} |")
            records.append(
                {
                    "a": a,
                    "b": b,
                    "difference": t.difference.mean,
                    "low": t.difference.low,
                    "high": t.difference.high,
                    "p": t.p_value,
                    "significant": sig,
                }
            )
    return "\n".join(lines), records


if __name__ == "__main__":
    main()
