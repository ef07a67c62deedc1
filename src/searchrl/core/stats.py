"""Uncertainty of evaluation scores: bootstrap confidence intervals over questions and seeds, and a paired
bootstrap test between two variants evaluated on the same questions with the same seeds.

Scores come as a matrix, one row per seed (training run) and one column per question. Both sources of
variance are resampled (a two-level bootstrap): each replicate draws seeds with replacement and, jointly
for all drawn seeds, questions with replacement, and takes the mean. With one seed it is the usual
bootstrap over questions. The paired test resamples the per-(seed, question) differences the same way, so
question difficulty and seed luck, shared by both variants, cancel (Koehn, 2004; Dror et al., 2018).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

REPLICATES = 10_000


@dataclass(frozen=True)
class Interval:
    mean: float
    low: float
    high: float
    seeds: int
    questions: int

    def __str__(self) -> str:
        return f"{self.mean:.3f} [{self.low:.3f}, {self.high:.3f}]"


@dataclass(frozen=True)
class PairedTest:
    difference: Interval  # mean of a − b with its interval
    p_value: float  # two-sided: how often the resampled difference falls on the other side of 0, doubled

    def significant(self, alpha: float = 0.05) -> bool:
        return self.p_value < alpha


def _matrix(scores: Sequence[Sequence[float]]) -> np.ndarray:
    m = np.asarray(scores, dtype=np.float64)
    if m.ndim != 2 or m.shape[0] == 0 or m.shape[1] == 0:
        raise ValueError(f"scores must be a non-empty seeds x questions matrix, got shape {m.shape}")
    if not np.isfinite(m).all():
        raise ValueError("scores must be finite")
    return m


def _replicates(m: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """Means of ``n`` two-level bootstrap replicates of ``m`` (seeds x questions)."""
    s, q = m.shape
    # a replicate's mean is Σ_ij c_i d_j m_ij / (s q), where c and d count how often each seed and each
    # question was drawn: multinomial counts, so no index arrays of size n x s x q are built
    seeds = rng.multinomial(s, np.full(s, 1 / s), size=n)
    questions = rng.multinomial(q, np.full(q, 1 / q), size=n)
    return np.einsum("ns,sq,nq->n", seeds, m, questions, optimize=True) / (s * q)  # type: ignore[no-any-return]


def bootstrap_ci(
    scores: Sequence[Sequence[float]], confidence: float = 0.95, n: int = REPLICATES, seed: int = 0
) -> Interval:
    """Mean of ``scores`` (seeds x questions) with a percentile bootstrap interval over seeds and questions."""
    m = _matrix(scores)
    reps = _replicates(m, n, np.random.default_rng(seed))
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(reps, [tail, 100 - tail])
    return Interval(float(m.mean()), float(low), float(high), m.shape[0], m.shape[1])


def paired_bootstrap(
    a: Sequence[Sequence[float]],
    b: Sequence[Sequence[float]],
    confidence: float = 0.95,
    n: int = REPLICATES,
    seed: int = 0,
) -> PairedTest:
    """Is variant ``a`` different from ``b``? Both seeds x questions, aligned (same seed, same question)."""
    ma, mb = _matrix(a), _matrix(b)
    if ma.shape != mb.shape:
        raise ValueError(f"paired scores must align: {ma.shape} vs {mb.shape}")
    d = ma - mb
    reps = _replicates(d, n, np.random.default_rng(seed))
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(reps, [tail, 100 - tail])
    # the share of replicates on the far side of zero, both tails; exact ties count half
    below, above = (reps < 0).mean() + (reps == 0).mean() / 2, (reps > 0).mean() + (reps == 0).mean() / 2
    p = min(1.0, 2 * min(below, above))
    if not d.any():
        p = 1.0  # identical scores: no evidence of any difference
    return PairedTest(Interval(float(d.mean()), float(low), float(high), d.shape[0], d.shape[1]), float(p))


def align(
    runs_a: dict[int, dict[str, float]], runs_b: dict[int, dict[str, float]]
) -> tuple[list[list[float]], list[list[float]]]:
    """Two variants' per-question scores ({seed: {question id: score}}) as aligned matrices over the seeds
    both have and the questions every one of those runs answered."""
    seeds = sorted(set(runs_a) & set(runs_b))
    if not seeds:
        return [], []
    common = set.intersection(*(set(runs_a[s]) & set(runs_b[s]) for s in seeds))
    ids = sorted(common)
    return [[runs_a[s][q] for q in ids] for s in seeds], [[runs_b[s][q] for q in ids] for s in seeds]
