"""The one masker: trajectories -> a right-padded `RolloutBatch`.

``loss_mask`` is built from segment kinds, never from pad ids (docs/design.md §4.2), and is 0 on a row that is not
``trained`` (DAPO's overlong filtering). Sequences longer than
``max_len`` are truncated on the right; an action cut by the truncation keeps loss on its surviving tokens,
and a step whose last token was cut is dropped from the step slots (its reward cannot be placed).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from searchrl.core.types import BatchExtras, RolloutBatch, Trajectory


def build_batch(trajs: Sequence[Trajectory], pad_id: int, max_len: int | None = None) -> RolloutBatch:
    if not trajs:
        raise ValueError("cannot build a batch from no trajectories")
    lengths = [min(len(t), max_len) if max_len else len(t) for t in trajs]
    B, T = len(trajs), max(lengths)
    S = max(1, max(len(t.steps) for t in trajs))
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, T), dtype=torch.long)
    loss_mask = torch.zeros((B, T), dtype=torch.float32)
    obs_mask = torch.zeros((B, T), dtype=torch.bool)
    step_ids = torch.full((B, T), -1, dtype=torch.long)
    sampled = torch.zeros((B, T), dtype=torch.float32)
    step_ends = torch.zeros((B, S), dtype=torch.long)
    step_mask = torch.zeros((B, S), dtype=torch.bool)
    step_rewards = torch.zeros((B, S), dtype=torch.float32)
    # the policy version that sampled each action token (asynchronous rollouts), -1 elsewhere
    versioned = any(seg.versions is not None for t in trajs for seg in t.segments)
    versions = torch.full((B, T), -1, dtype=torch.long) if versioned else None
    for b, (traj, n) in enumerate(zip(trajs, lengths)):
        ids = traj.token_ids[:n]
        input_ids[b, :n] = torch.tensor(ids, dtype=torch.long)
        attention_mask[b, :n] = 1
        seg_to_step = {st.segment: i for i, st in enumerate(traj.steps)}
        pos = 0
        for si, seg in enumerate(traj.segments):
            end = min(pos + len(seg.token_ids), n)
            if end > pos:
                if seg.kind == "action":
                    loss_mask[b, pos:end] = float(traj.trained)
                    if si in seg_to_step:
                        step_ids[b, pos:end] = seg_to_step[si]
                    if seg.logprobs is not None:
                        sampled[b, pos:end] = torch.tensor(seg.logprobs[: end - pos])
                    if versions is not None and seg.versions is not None:
                        versions[b, pos:end] = torch.tensor(seg.versions[: end - pos])
                elif seg.kind == "observation":
                    obs_mask[b, pos:end] = True
            pos += len(seg.token_ids)
        for i, st in enumerate(traj.steps):
            if st.last_token < n:
                step_ends[b, i] = st.last_token
                step_mask[b, i] = True
                if i < len(traj.step_rewards):
                    step_rewards[b, i] = traj.step_rewards[i]
    return RolloutBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        loss_mask=loss_mask,
        obs_mask=obs_mask,
        step_ids=step_ids,
        step_ends=step_ends,
        step_mask=step_mask,
        sampled_logprobs=sampled,
        rewards=torch.tensor([t.reward for t in trajs], dtype=torch.float32),
        step_rewards=step_rewards,
        group_ids=torch.tensor([t.group_id for t in trajs], dtype=torch.long),
        pair_ids=torch.tensor([t.pair_id for t in trajs], dtype=torch.long),
        chosen=torch.tensor([t.chosen for t in trajs], dtype=torch.bool),
        extras=_extras(trajs, versions),
    )


def _extras(trajs: Sequence[Trajectory], versions: torch.Tensor | None) -> BatchExtras:
    """Per-row tensors only some batches have: the sampling versions (asynchronous rollouts) and the episode
    ids of folded episodes (`envs.context`: rows of one episode share one)."""
    folded = any(t.episode_id >= 0 for t in trajs)
    ids = torch.tensor([t.episode_id for t in trajs], dtype=torch.long) if folded else None
    return BatchExtras(versions=versions, episode_ids=ids)
