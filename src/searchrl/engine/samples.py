"""What a training step trained on, saved for `searchrl view` (``trainer.samples``).

For a few groups of each saved step's batch (``groups`` groups of the main process's rows, those whose
rewards differ first, since an all-equal group has no advantage to see), the
recorder keeps what the loss saw in the first optimizer update that contained each row: the token ids and
the loss mask of the micro-batch as it went into ``algo.loss``, the sampler's (behaviour) log-probs, π_old,
the trainer's log-probs of that forward, the advantages and importance weights the algorithm put in the
batch, the step boundaries and step rewards, and each token's segment kind and sampling policy version.
A step's record is ``samples/step-NNNNNN.json`` in the stage's directory, written again when the step is
run again (after a rollback or a resume), so the files always describe the run's kept steps.

The rows are found in the micro-batches by an extra per-row tensor, ``batch.extras.sample_row`` (the
row's index in the step's batch), which follows the rows through every reordering and selection.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from searchrl.core.types import RolloutBatch, Trajectory

KINDS = {"prompt": 0, "action": 1, "observation": 2}  # token kinds as saved (`kinds`)
# per-token tensors of the micro-batch saved when present: the name in the file <- the batch's field
TOKEN_EXTRAS = {
    "logp_old": "old_logp",
    "logp_ref": "ref_logp",
    "advantages": "advantages",
    "is_weight": "is_weight",
}


def step_file(out_dir: Path, step: int) -> Path:
    """Where step ``step``'s (counted from 1) sample is saved."""
    return out_dir / "samples" / f"step-{step:06d}.json"


def group_of(traj: Trajectory, row: int) -> int:
    """The group a row is shown in: its preference pair, else its episode group (a question's episodes, a
    prefix's candidates); a dataset row without either (SFT records) is a group of its own."""
    if traj.pair_id >= 0:
        return traj.pair_id
    return traj.group_id if traj.state is not None else row


def _floats(t: torch.Tensor) -> list[float]:
    return [round(float(x), 5) for x in t.detach().float().cpu().tolist()]


class SampleRecorder:
    """Saves a sample of every ``every``-th step's rows (``groups`` groups) on the main process."""

    def __init__(self, out_dir: Path, groups: int, every: int, tokenizer: Any, enabled: bool) -> None:
        self.out, self.groups, self.every, self.tokenizer = out_dir, groups, every, tokenizer
        self.enabled = enabled and groups > 0 and every > 0
        self.step = -1
        self.rows: dict[int, dict[str, Any]] = {}  # row index in the step's batch -> its record
        self.seen: set[int] = set()

    def start(self, step: int, trajs: list[Trajectory], batch: RolloutBatch) -> None:
        """Choose this step's rows (``step`` counted from 0) and tag the batch's rows to find them later."""
        self.rows, self.seen, self.step = {}, set(), step
        if not self.enabled or (step + 1) % self.every:
            return
        members: dict[int, list[int]] = {}  # group as shown -> its rows, in batch order
        for i, t in enumerate(trajs):
            if t.group_id >= 0:  # not one of the trainer's padding rows (`Trainer._pad`)
                members.setdefault(group_of(t, i), []).append(i)
        # groups whose rewards differ first: they carry the learning signal (an all-equal GRPO group has
        # zero advantage everywhere); then the others, in batch order
        order = sorted(members, key=lambda g: len({trajs[i].reward for i in members[g]}) < 2)
        chosen = {i: g for g in order[: self.groups] for i in members[g]}
        self.rows = {i: {**self._static(trajs[i], batch, i), "group": g} for i, g in sorted(chosen.items())}
        if self.rows:
            batch.extras.sample_row = torch.arange(len(batch), device=batch.input_ids.device)

    def _static(self, traj: Trajectory, batch: RolloutBatch, i: int) -> dict[str, Any]:
        """What the trajectory says of row ``i``: question, reward, segment kinds, versions, steps."""
        kinds: list[int] = []
        versions: list[int] = []
        for seg in traj.segments:
            kinds += [KINDS[seg.kind]] * len(seg.token_ids)
            versions += seg.versions if seg.versions is not None else [-1] * len(seg.token_ids)
        ex = traj.example
        steps = [
            {
                "end": int(batch.step_ends[i, s]),
                "reward": round(float(batch.step_rewards[i, s]), 5),
                # dataset rows (SFT, DPO records) may carry steps without the environment's step info
                "kind": st.info.kind if st.info is not None else "action",
                "valid": st.info.valid if st.info is not None else True,
                "query": st.info.query if st.info is not None else None,
                "doc_ids": list(st.info.doc_ids) if st.info is not None else [],
            }
            for s, st in enumerate(traj.steps)
            if s < batch.step_mask.shape[1] and bool(batch.step_mask[i, s])
        ]
        return {
            "row": i,
            "id": ex.id if ex is not None else None,
            "question": ex.question if ex is not None else None,
            "answers": list(ex.answers) if ex is not None else [],
            "prediction": traj.answer,
            "reward": round(float(traj.reward), 5),
            "finish_reason": traj.finish_reason,
            "trained": traj.trained,
            "kinds": kinds,
            "versions": versions if any(v >= 0 for v in versions) else None,
            "steps": steps,
        }

    def record(self, mb: RolloutBatch, logp: torch.Tensor) -> None:
        """A micro-batch as the loss saw it, with the trainer's log-probs ``logp`` (B, T) of its forward."""
        if not self.rows or mb.extras.sample_row is None:
            return
        for b, r in enumerate(mb.extras.sample_row.tolist()):
            if r not in self.rows or r in self.seen:
                continue
            self.seen.add(r)
            n = int(mb.attention_mask[b].sum())
            ids = mb.input_ids[b, :n].tolist()
            rec = self.rows[r]
            rec.update(
                ids=ids,
                tokens=self.tokenizer.batch_decode([[t] for t in ids]),  # each token's own text
                loss_mask=[int(x) for x in mb.loss_mask[b, :n].tolist()],
                logp_sampled=_floats(mb.sampled_logprobs[b, :n]),
                logp=_floats(logp[b, :n]),
            )
            for name, key in TOKEN_EXTRAS.items():
                x = getattr(mb.extras, key)
                if x is not None and x.dim() == 2:
                    rec[name] = _floats(x[b, :n])
            rec["kinds"] = rec["kinds"][:n]
            if rec["versions"] is not None:
                rec["versions"] = rec["versions"][:n]

    def finish(self, metrics: dict[str, float] | None = None) -> Path | None:
        """Write the step's record (rows in batch order; the step's reduced metrics beside them)."""
        if not self.rows:
            return None
        rows = [self.rows[r] for r in sorted(self.rows) if r in self.seen]
        path = step_file(self.out, self.step + 1)
        path.parent.mkdir(parents=True, exist_ok=True)
        record = {"step": self.step + 1, "metrics": metrics or {}, "rows": rows}
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(record, ensure_ascii=False, separators=(",", ":")), encoding="utf-8")
        os.replace(tmp, path)
        self.rows = {}
        return path


def read_samples(directory: Path) -> list[dict[str, Any]]:
    """Every step record under ``directory/samples``, in step order."""
    return [
        json.loads(p.read_text(encoding="utf-8")) for p in sorted((directory / "samples").glob("step-*.json"))
    ]
