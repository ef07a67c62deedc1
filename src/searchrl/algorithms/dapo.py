"""DAPO's sampling and shaping (Yu et al. 2025, §3.2 and §3.4) for the group algorithms.

- **Dynamic sampling** (§3.2, eq. 11's constraint 0 < |{o_i : correct}| < G): a group whose rewards are all
  equal has advantage 0 everywhere and only dilutes the batch. Such groups are dropped and fresh questions
  sampled until the step has as many informative groups as it asked for, at most ``max_attempts`` rounds
  of generation (the first included; verl's ``max_num_gen_batches``). If the cap is reached the step trains
  on the informative groups it found (the rest of the batch is empty rows) and says so. A group of one (GRPO
  with ``advantage: reinforce_pp``, ``group_size: 1``) is always kept, as verl keeps it: its advantage comes
  from the batch, not the group. ``criterion``: ``reward`` (the default, verl's: the groups' total rewards
  differ) or ``correct`` (the paper's eq. 11: some but not all answers are correct by exact match), which
  tells apart groups that shaped rewards (format, length, retrieval) make differ while their answers are all
  right or all wrong.
- **Overlong filtering** (§3.4): ``mask_truncated`` takes episodes that ran out of room (finish reason
  "length") out of the loss, so a model is not taught that a cut-off answer is wrong.
- **Overlong shaping** (§3.4, eq. 13) is a reward: ``{name: overlong, args: {max_tokens, buffer}}``
  (`rewards.outcome.overlong_reward`).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from searchrl.core.aggregate import Mean, Sum, merge
from searchrl.core.answers import exact_match
from searchrl.core.config import AT_LEAST_1, check_ranges, setting
from searchrl.core.types import Trajectory

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DynamicSampling:
    enabled: bool = setting(
        False, "resample questions whose groups carry no signal (DAPO's dynamic sampling)"
    )
    max_attempts: int = setting(4, "rounds of generation per step, the first included", AT_LEAST_1)
    criterion: Literal["reward", "correct"] = setting(
        "reward",
        "which groups are informative: reward (their total rewards differ; verl's) or correct (some but not all "
        "answers are exact matches; DAPO's eq. 11)",
    )

    def __post_init__(self) -> None:
        check_ranges(self)
        if self.criterion not in ("reward", "correct"):
            raise ValueError(f"criterion must be 'reward' or 'correct', got {self.criterion!r}")


def groups(trajs: Sequence[Trajectory]) -> list[list[Trajectory]]:
    """Trajectories by group id, in order of first appearance."""
    by: dict[int, list[Trajectory]] = {}
    for t in trajs:
        by.setdefault(t.group_id, []).append(t)
    return list(by.values())


def informative(group: Sequence[Trajectory], criterion: str = "reward") -> bool:
    """Whether a group is kept: one of one episode always (verl's), else its rewards differ (a group-relative
    advantage is nonzero somewhere), or with ``correct`` some but not all of its answers are exact matches."""
    if len(group) == 1:
        return True
    if criterion == "correct":
        correct = sum(exact_match(t.answer or "", t.example.answers) > 0 for t in group)
        return 0 < correct < len(group)
    return len({t.reward for t in group}) > 1


def dynamic_collect(
    collect: Callable[[list[int]], tuple[list[Trajectory], dict[str, float]]],
    indices: list[int],
    n_items: int,
    cfg: DynamicSampling,
    rng: random.Random,
    where: str = "",
) -> tuple[list[Trajectory], dict[str, float]]:
    """``len(indices)`` groups whose rewards are not all equal, from ``collect`` (question indices -> scored
    groups, one per question, group ids the question index), drawing replacement questions from the
    ``n_items`` training items with ``rng``. Group ids of the result are ``indices`` (unique across
    processes as the schedule's are), in order."""
    want, kept, reports, dropped, tried = len(indices), [], [], 0, set(indices)
    first_equal = first_groups = 0
    batch, attempt, generated = list(indices), 0, 0
    while True:
        attempt += 1
        trajs, metrics = collect(batch)
        reports.append(metrics)
        generated += len(trajs)
        found = groups(trajs)
        useful = [g for g in found if informative(g, cfg.criterion)]
        if attempt == 1:
            first_groups, first_equal = len(found), len(found) - len(useful)
        dropped += len(found) - len(useful)
        kept.extend(useful)
        if len(kept) >= want or attempt >= cfg.max_attempts:
            break
        fresh = [i for i in range(n_items) if i not in tried]
        if not fresh:  # every question tried this step: draw again from all of them
            fresh = list(range(n_items))
        batch = rng.sample(fresh, min(want - len(kept), len(fresh)))
        tried.update(batch)
    kept = kept[:want]
    if len(kept) < want:
        log.warning(
            "dynamic sampling%s: after %d rounds of generation (algorithm.dynamic_sampling.max_attempts) only "
            "%d of %d groups had rewards that differ (%d groups were all equal); this step trains on those %d "
            "and leaves the other rows empty. Raise max_attempts, or check that the reward can tell episodes "
            "apart on this data",
            where,
            attempt,
            len(kept),
            want,
            dropped,
            len(kept),
        )
    out: list[Trajectory] = []
    for gid, group in zip(indices, kept):
        for t in group:
            t.group_id = gid
        out.extend(group)
    report = merge(reports)
    report.update(
        {
            "dapo/attempts": Mean(attempt, 1),
            "dapo/groups_dropped": Sum(dropped),
            "dapo/groups_short": Sum(want - len(kept)),
            "dapo/first_all_equal_frac": Mean(first_equal, first_groups),
            "dapo/episodes_generated": Sum(generated),
        }
    )
    return out, report


def mask_truncated(trajs: Sequence[Trajectory]) -> int:
    """DAPO's overlong filtering: episodes that ended for lack of room carry no loss. Returns how many."""
    n = 0
    for t in trajs:
        if t.finish_reason == "length":
            t.trained = False
            n += 1
    return n
