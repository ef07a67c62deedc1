"""Every measured figure in the README is read from a committed results file (`benchmarks/results/`): each entry
below names the file, the values in it, and the README text they make; the README must hold that text (its line
breaks read as spaces). A figure re-measured without the README, or the README edited without its file, fails
here."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"


def at(data: Any, path: str) -> Any:
    for key in path.split("."):
        data = data[key]
    return data


def mean_sd(values: list[float]) -> str:
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}"


def learning(name: str) -> list[str]:
    """`benchmarks/learning.py`'s file: the quickstart over seeds, its mean ± sd per stage and the paired gain."""
    d = json.loads((RESULTS / f"{name}.json").read_text())
    s = d["summary"]
    p = s["paired"]
    seeds = d["args"]["seeds"]
    sft, grpo = (f"{s[k]['mean']:.3f} ± {s[k]['std']:.3f}" for k in ("sft", "grpo"))
    return [
        f"{len(seeds)} seeds ({', '.join(map(str, seeds))})",
        f"SFT {sft}, GRPO {grpo}",
        f"GRPO − SFT {p['difference']:+.3f} paired, [{p['low']:.3f}, {p['high']:.3f}]",
    ]


def learning_seeds(names: list[str]) -> list[str]:
    """Several `benchmarks/learning.py` files of one machine read as one set of seeds (each file a run of some of
    them): the mean ± sd per stage over all, each seed's GRPO EM, the smallest gain, each file's paired interval,
    and the row the tool quickstart's table gives the set."""
    files = [json.loads((RESULTS / f"{n}.json").read_text()) for n in names]
    per = {int(s): r for d in files for s, r in d["per_seed"].items()}
    seeds = sorted(per)
    ems = {k: [per[s][k]["em"] for s in seeds] for k in ("sft", "grpo")}
    sft, grpo = mean_sd(ems["sft"]), mean_sd(ems["grpo"])
    gains = [g - f for f, g in zip(ems["sft"], ems["grpo"])]
    out = [
        f"{len(seeds)} seeds ({', '.join(map(str, seeds))})",
        f"SFT {sft}, GRPO {grpo}",
        f"(per seed {', '.join(f'{e:.3f}' for e in ems['grpo'])})",
        f"every seed {min(gains):+.3f} or more",
        f"| tag quickstart, {len(seeds)} seeds (2 CPU cores) | {sft} | {grpo} | |",
    ]
    for d in files:
        p, run = d["summary"]["paired"], d["args"]["seeds"]
        out.append(f"{p['difference']:+.3f} [{p['low']:.3f}, {p['high']:.3f}] over seeds {run[0]}-{run[-1]}")
    return out


def learning_seed(name: str, seed: int) -> list[str]:
    """One seed's rows of the quickstart's table, from that seed's results in the same file."""
    r = json.loads((RESULTS / f"{name}.json").read_text())["per_seed"][str(seed)]
    rows = []
    for stage, label in (("sft", "SFT warm start (400 steps)"), ("grpo", "GRPO (60 steps)")):
        m = r[stage]
        rows.append(
            f"| {label} | {m['em']:.3f} | {m['f1']:.3f} | {m['searches_per_question']:.2f} | "
            f"{m['gold_doc_recall']:.3f} |"
        )
    return rows


def minutes(name: str) -> list[str]:
    """The quickstart's wall time as the README gives it: seed 0's, and the range over the file's seeds."""
    m = json.loads((RESULTS / f"{name}.json").read_text())["minutes"]
    return [
        f"It took {m['0']:.1f} minutes",
        f"seeds {min(m.values()):.1f}-{max(m.values()):.1f} minutes each",
    ]


def sweep(name: str, labels: dict[str, str]) -> list[str]:
    """A recipe sweep's (`benchmarks/algorithms.py`) test EM, mean ± sd over seeds, as the README quotes it."""
    s = json.loads((RESULTS / f"{name}.json").read_text())["summary"]
    return [
        f"{label} {s[key]['em']['mean']:.3f} ± {s[key]['em']['std']:.3f}" for key, label in labels.items()
    ]


def tools_table() -> list[str]:
    """The tool quickstart's three seeds as the file now trains (`tools_fast`), and the minutes of the seed that
    ran alone on the cores."""
    d = json.loads((RESULTS / "tools_protocol.json").read_text())["tools_fast"]
    rows = []
    for seed in "012":
        sft, grpo = d[seed]["sft"]["em"], d[seed]["grpo"]["em"]
        rows.append(f"| seed {seed} | {sft:.3f} | {grpo:.3f} | {grpo - sft:+.3f} |")
    sft = [d[s]["sft"]["em"] for s in "012"]
    grpo = [d[s]["grpo"]["em"] for s in "012"]
    rows.append(f"| 3 seeds, mean ± sd | {mean_sd(sft)} | {mean_sd(grpo)} | |")
    [alone] = [s for s in "012" if d[s]["alone"]]
    rows.append(f"seed {alone} took {d[alone]['minutes']['total']:.1f} minutes alone")
    return rows


def cpu_isa() -> list[str]:
    """The seed-0 SFT under the machine's default vector kernels and under AVX2 (`quickstart_cpu_isa-*.json`)."""
    runs = json.loads((RESULTS / "quickstart_cpu_isa-2026-11-29.json").read_text())["runs"]
    a, b = runs["AVX512"]["sft"], runs["AVX2"]["sft"]
    return [
        f"evaluates at EM {a['em']:.3f} (F1 {a['f1']:.3f})",
        f"`ATEN_CPU_CAPABILITY=avx2` on the same machine at EM {b['em']:.3f} (F1 {b['f1']:.3f})",
    ]


FIGURES = {
    "search_agents_2026": lambda: sweep(
        "search_agents_2026", {"grpo": "GRPO", "searchr1pp": "Search-R1++", "zerosearch": "ZeroSearch"}
    ),
    "long_horizons": lambda: [
        "{} against {} truncating".format(
            *(
                f.split(" ", 1)[1]
                for f in sweep("long_horizons", {"long_horizon": "-", "long_horizon_truncated": "-"})
            )
        )
    ],
    "tools_protocol": tools_table,
    "learning-2026-11-29-packed": lambda: [
        *learning_seeds(["learning-2026-11-29-packed"]),
        *learning_seed("learning-2026-11-29-packed", 0),
        *minutes("learning-2026-11-29-packed"),
    ],
    "learning": lambda: learning("learning"),
    "quickstart_cpu_isa-2026-11-29": cpu_isa,
    "learning-2026-11-28-plan": lambda: [
        *learning("learning-2026-11-28-plan")[:2],
        "(per seed {})".format(
            ", ".join(
                f"{e:.3f}"
                for e in json.loads((RESULTS / "learning-2026-11-28-plan.json").read_text())["summary"][
                    "grpo"
                ]["per_seed"]
            )
        ),
        "against {mean:.3f} ± {std:.3f} without it".format(
            **json.loads((RESULTS / "learning-2026-11-28.json").read_text())["summary"]["grpo"]
        ),
    ],
}


def readme() -> str:
    return re.sub(r"\s+", " ", (REPO / "README.md").read_text())


@pytest.mark.parametrize("name", sorted(FIGURES))
def test_each_readme_figure_is_its_results_file(name):
    text = readme()
    for figure in FIGURES[name]():
        figure = re.sub(r"\s+", " ", figure)
        assert figure in text, f"README.md does not say {figure!r} (from benchmarks/results/{name}.json)"
