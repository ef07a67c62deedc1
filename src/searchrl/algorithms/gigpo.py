"""GiGPO: group-in-group advantages (Feng et al. 2025, arXiv 2505.10978; released code: verl-agent).

An advantage estimator for GRPO (``algorithm: {name: grpo, advantage: gigpo}``). Two groups, one inside the other:

- **episode level** (eq. 3): the G episodes of a question, A^E_i = (R_i − mean_G R) / F_norm, F_norm = std_G R
  (``normalize: mean_std``) or 1 (``normalize: mean``, verl-agent's ``mean_norm``, its ALFWorld default);
- **step level** (eqs. 5-7): the steps of that question's episodes that start from the same *anchor state* form a
  step group; each step's discounted return R_k = Σ_{j≥k} γ^{j−k} r_j (r_j: the step's process reward, the
  outcome added at the episode's last step) is normalised inside its step group the same way, A^S;
- the token advantage of step k's action tokens (eq. 8): A = A^E_i + ω · A^S_{i,k}.

**The anchor state of a search episode** (verl-agent hashes the environment's current observation; a search
environment's state is what it has shown the agent): the question's group and the token ids of everything the
environment wrote before the step — the prompt and each earlier observation, as separate runs — and not the
agent's own text. Two episodes whose first searches returned the same documents meet the same state at their
second step, whatever their reasoning said; every episode of a group meets the prompt at its first step, so the
first step's group is the whole group. A step group of one has A^S = 0 (GiGPO then reduces to GRPO there).

Step groups are formed within one process's batch: the trainer keeps a question's episodes on one process.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from searchrl.algorithms.advantage_math import (
    broadcast_to_tokens,
    discounted_by_slot,
    grpo_outcome,
    steps_to_tokens,
)
from searchrl.algorithms.objective import advantage_estimator
from searchrl.core.aggregate import Max, Mean, Sum
from searchrl.core.config import AT_LEAST_0, ZERO_TO_ONE, check_ranges, setting

if TYPE_CHECKING:
    from searchrl.algorithms.advantage_estimators import AdvantageInput
    from searchrl.core.types import RolloutBatch


@dataclass(frozen=True)
class GiGPOSettings:
    """``algorithm.gigpo``: GiGPO's own settings (defaults: verl-agent's released scripts)."""

    step_weight: float = setting(
        1.0, "ω of eq. 8 (verl-agent's algorithm.gigpo.step_advantage_w)", AT_LEAST_0
    )
    gamma: float = setting(
        0.95, "γ of the discounted step return, eq. 5 (verl-agent's algorithm.gamma)", ZERO_TO_ONE
    )
    normalize: Literal["mean", "mean_std"] = setting(
        "mean", "F_norm of eqs. 3 and 7: mean (1, verl-agent's mean_norm) or mean_std (the group's std)"
    )

    def __post_init__(self) -> None:
        check_ranges(self)
        if self.normalize not in ("mean", "mean_std"):
            raise ValueError(f"gigpo.normalize must be 'mean' or 'mean_std', got {self.normalize!r}")


Anchor = tuple[int, tuple[tuple[int, ...], ...]]  # (group id, the environment's token runs so far)


def anchor_states(batch: RolloutBatch) -> list[dict[int, Anchor]]:
    """For each row, its steps' anchor states by step slot: (group id, the runs of tokens the environment wrote
    before the step's first action token: the prompt, then each observation). Rows of the trainer's padding
    (negative group ids) and steps whose tokens the batch cut have none."""
    out: list[dict[int, Anchor]] = []
    for b in range(len(batch)):
        gid = int(batch.group_ids[b])
        row: dict[int, Anchor] = {}
        out.append(row)
        if gid < 0:
            continue
        n = int(batch.attention_mask[b].sum())
        ids = batch.input_ids[b, :n].tolist()
        obs = batch.obs_mask[b, :n].tolist()
        sid = batch.step_ids[b, :n].tolist()
        real = set(batch.step_mask[b].nonzero().flatten().tolist())
        first = next((p for p, s in enumerate(sid) if s >= 0), n)
        runs: list[tuple[int, ...]] = [tuple(ids[:first])]  # the prompt
        p = first
        while p < n:
            if obs[p]:  # an observation: one run
                q = p
                while q < n and obs[q]:
                    q += 1
                runs.append(tuple(ids[p:q]))
                p = q
                continue
            if sid[p] >= 0 and sid[p] in real and sid[p] not in row:
                row[sid[p]] = (gid, tuple(runs))
            p += 1
    return out


def step_returns(batch: RolloutBatch, outcome: torch.Tensor, gamma: float) -> list[dict[int, float]]:
    """Eq. 5: R_k = Σ_{j≥k} γ^{j−k} r_j over each row's steps, r_j its process reward (``step_rewards``) and the
    outcome ``outcome`` (B,) added at its last step."""
    out: list[dict[int, float]] = []
    for b in range(len(batch)):
        slots = batch.step_mask[b].nonzero().flatten().tolist()
        r = {k: float(batch.step_rewards[b, k]) for k in slots}
        if slots:
            r[slots[-1]] += float(outcome[b])
        out.append(discounted_by_slot(r, gamma))
    return out


@advantage_estimator("gigpo", level="turn")
def gigpo(x: AdvantageInput) -> torch.Tensor:
    """GiGPO (arXiv 2505.10978, eq. 8): A^E_i + ω · A^S_{i,k} on step k's action tokens (module docstring)."""
    batch = x.steps("gigpo")
    s = x.cfg.gigpo
    std = s.normalize == "mean_std"
    outcome = x.penalised()
    adv = broadcast_to_tokens(grpo_outcome(outcome, x.group_ids, std, x.cfg.eps), x.loss_mask)  # eq. 3
    anchors = anchor_states(batch)
    returns = step_returns(batch, outcome, s.gamma)
    members: dict[Anchor, list[tuple[int, int]]] = defaultdict(list)  # eq. 6: the step groups
    for b, row in enumerate(anchors):
        for k, key in row.items():
            members[key].append((b, k))
    step_adv: list[dict[int, float]] = [{} for _ in range(len(batch))]
    for group in members.values():
        if len(group) < 2:
            continue  # a step group of one: A^S = 0
        r = torch.tensor([returns[b][k] for b, k in group], dtype=torch.float64)
        centred = r - r.mean()
        a = centred / (r.std() + x.cfg.eps) if std else centred  # eq. 7
        for (b, k), v in zip(group, a.tolist()):
            step_adv[b][k] = float(v)
    sizes = [len(g) for g in members.values()]
    steps = sum(sizes)
    x.metrics.update(
        {
            "gigpo/step_groups": Sum(len(sizes)),
            "gigpo/step_group_size": Mean(steps, len(sizes)),
            "gigpo/max_step_group": Max(max(sizes, default=0)),
            "gigpo/grouped_step_rate": Mean(sum(n for n in sizes if n > 1), steps),
        }
    )
    return (adv + s.step_weight * steps_to_tokens(step_adv, batch.step_ids, x.loss_mask)) * x.loss_mask
