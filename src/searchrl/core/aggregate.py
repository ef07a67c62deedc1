"""How a metric combines over processes, so that a run on N processes logs what one process would log
from the union of their data.

A process reports each metric as a number of one of these kinds (``float`` subclasses, so code that reads
a metric as a number is unaffected):

- ``Mean(total, count)``: the global value is Σ total / Σ count — a mean over episodes, tokens or rows,
  or a rate with its numerator and denominator. A plain number ``v`` counts as ``Mean(v, 1)``: the mean
  over the processes that report it (for values every process computes identically, such as a global
  loss term or the learning rate).
- ``Sum(value)``: Σ value (counts: tokens generated, sequences trained on).
- ``Max(value)``: the largest value (the slowest process's time, the largest log-prob gap).

A key that a process does not report adds nothing to that key, so a ``Mean`` is over the items of the
processes that report it. A rate whose absence means zero (a finish reason no episode of this process
had) must therefore always be reported, with a zero numerator.

`combine` is the rule on plain lists of reports; `Engine.reduce_metrics` applies the same rule across
processes with a fixed sequence of collectives whatever each process's keys are.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

Kind = Literal["mean", "sum", "max"]


class Mean(float):
    """Σ total / Σ count over processes. Its own float value is this process's mean (0 over nothing)."""

    total: float
    count: float

    def __new__(cls, total: float, count: float = 1.0) -> Mean:
        obj = super().__new__(cls, float(total) / float(count) if count else 0.0)
        obj.total, obj.count = float(total), float(count)
        return obj

    def __reduce__(self) -> tuple[type, tuple[float, float]]:
        return (Mean, (self.total, self.count))


class Sum(float):
    """Summed over processes."""


class Max(float):
    """The largest value over processes."""


Metric = float | int
Report = Mapping[str, Metric]


def kind_of(value: Metric) -> Kind:
    if isinstance(value, Sum):
        return "sum"
    if isinstance(value, Max):
        return "max"
    try:
        float(value)
    except (TypeError, ValueError):
        raise TypeError(f"a metric must be a number, Mean, Sum or Max, got {type(value).__name__}") from None
    return "mean"


def pair(value: Metric) -> tuple[float, float]:
    """The two summed numbers of a mean or sum metric: (total, count) or (value, 0)."""
    if isinstance(value, Mean):
        return float(value.total), float(value.count)
    if isinstance(value, Sum):
        return float(value), 0.0
    if isinstance(value, Max):
        raise TypeError("a Max metric is not summed")
    return float(value), 1.0


def peak(value: Metric) -> float:
    if not isinstance(value, Max):
        raise TypeError("only a Max metric has a peak")
    return float(value)


def layout(reports_keys: Iterable[Iterable[tuple[str, Kind]]]) -> list[tuple[str, Kind]]:
    """The sorted union of (key, kind) over processes; a key reported with two kinds is an error."""
    kinds: dict[str, Kind] = {}
    for keys in reports_keys:
        for key, kind in keys:
            if kinds.setdefault(key, kind) != kind:
                raise ValueError(
                    f"metric '{key}' is reported as {kinds[key]} by one process and {kind} by another"
                )
    return sorted(kinds.items())


def flatten(report: Report, keys: Sequence[tuple[str, Kind]]) -> tuple[list[float], list[float]]:
    """One process's report as two flat vectors over the agreed ``keys``: the summed pairs (two entries per
    mean or sum key) and the maxima (one per max key; -inf where this process has no value)."""
    sums: list[float] = []
    maxes: list[float] = []
    for key, kind in keys:
        if kind == "max":
            maxes.append(peak(report[key]) if key in report else -math.inf)
        else:
            sums.extend(pair(report[key]) if key in report else (0.0, 0.0))
    return sums, maxes


def finish(
    keys: Sequence[tuple[str, Kind]], sums: Sequence[float], maxes: Sequence[float]
) -> dict[str, float]:
    """Global values from the summed and maxed vectors of `flatten`. A mean over nothing is left out."""
    out: dict[str, float] = {}
    s = m = 0
    for key, kind in keys:
        if kind == "max":
            if maxes[m] > -math.inf:
                out[key] = float(maxes[m])
            m += 1
        else:
            total, count = sums[s], sums[s + 1]
            s += 2
            if kind == "sum":
                out[key] = float(total)
            elif count > 0:
                out[key] = float(total) / float(count)
    return out


def combine(reports: Sequence[Report]) -> dict[str, float]:
    """The global value of every metric from each process's report (one report: one process)."""
    keys = layout([(k, kind_of(v)) for k, v in r.items()] for r in reports)
    flat = [flatten(r, keys) for r in reports]
    sums = [sum(col) for col in zip(*(f[0] for f in flat))] if keys else []
    maxes = [max(col) for col in zip(*(f[1] for f in flat))] if keys else []
    return finish(keys, sums, maxes)


def values(report: Report) -> dict[str, float]:
    """One process's report as plain numbers (what it logs when it runs alone)."""
    return combine([report])


def merge(reports: Sequence[Report]) -> dict[str, Metric]:
    """One process's reports of several parts of its work (e.g. rounds of sampling) as one report of the
    same kinds: means pool their totals and counts, sums add, maxima take the largest."""
    out: dict[str, Metric] = {}
    for report in reports:
        for key, value in report.items():
            if key not in out:
                out[key] = value
                continue
            prev, kind = out[key], kind_of(value)
            if kind_of(prev) != kind:
                raise ValueError(f"metric '{key}' is reported as {kind_of(prev)} and as {kind}")
            if kind == "max":
                out[key] = Max(max(float(prev), float(value)))
            elif kind == "sum":
                out[key] = Sum(float(prev) + float(value))
            else:
                (t0, c0), (t1, c1) = pair(prev), pair(value)
                out[key] = Mean(t0 + t1, c0 + c1)
    return out
