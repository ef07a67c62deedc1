"""RAG-Gym process-data collection (§2.2.1): `searchrl collect-process-data EXP.yaml --model DIR`.

For each question the current policy is rolled out; at every step N candidate actions are sampled from
the same state and run through the environment, an annotator ranks them (`rewards.judges.ANNOTATORS`:
``rule`` from the decomposition with RAG-Gym's sufficiency / utility / redundancy criteria, or ``judge``
with an LLM judge), the best one is executed and the episode continues. Only episodes whose final answer
is correct are kept. From each of their steps, every candidate scoring at least ``chosen_min`` is paired
with every candidate scoring at most ``rejected_max``.

Written to ``process_data.out`` (a `datasets` dataset on disk each):

- ``pairs/``: one row per (state, chosen, rejected) step pair — the state as text pieces (``prompt``,
  earlier ``actions`` and ``observations``), ``chosen``/``rejected`` action texts and their scores;
- ``sft/``: the kept episodes as SFT records (prompt, actions, observations), the chosen actions — one
  record per step, the rendered state as its prompt, for a re-rendered agent design (``research``);
- ``README.md``: a card saying how the data was made, with counts.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from searchrl.core.answers import exact_match
from searchrl.core.errors import ConfigError, MissingInput
from searchrl.envs.search import RERENDERED_AGENTS
from searchrl.envs.synthetic.teacher import step_records, trajectory_record
from searchrl.rewards.judges import ANNOTATORS, JudgeItem
from searchrl.rollout.generator import SamplingParams
from searchrl.rollout.loop import RolloutStats, start_trajectories
from searchrl.rollout.step_search import best, step_search


def step_pairs(
    env: Any, state: Any, candidates: list[tuple[str, float]], chosen_min: float, rejected_max: float
) -> list[dict[str, Any]]:
    """Every (chosen, rejected) pair of one step's ranked candidates, with the state as text pieces
    (`SearchEnv.pieces`: the rendered state alone for a re-rendered agent design)."""
    good = [(a, s) for a, s in candidates if s >= chosen_min]
    bad = [(a, s) for a, s in candidates if s <= rejected_max]
    prompt, actions, observations = env.pieces(state)
    return [
        {
            "id": state.example.id,
            "question": state.example.question,
            "prompt": prompt,
            "actions": actions,
            "observations": observations,
            "step": len(state.actions),
            "chosen": a,
            "rejected": b,
            "chosen_score": sa,
            "rejected_score": sb,
        }
        for a, sa in good
        for b, sb in bad
    ]


def collect(
    resources: Any, generator: Any, tokenizer: Any, *, batch: int = 64, progress: bool = True
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    """(pairs, sft records, summary) for ``process_data.split`` of the experiment ``resources.exp``."""
    from tqdm.auto import tqdm

    exp, cfg = resources.exp, resources.exp.process_data
    env = resources.env()
    annotate = ANNOTATORS.get(cfg.annotator)(**cfg.annotator_args)
    params = SamplingParams(cfg.temperature, exp.rollout.top_p, exp.rollout.max_new_tokens)
    examples = resources.examples(cfg.split)[: cfg.limit]
    pairs: list[dict[str, Any]] = []
    records: list[dict[str, Any]] = []
    stats = RolloutStats()
    kept = steps = 0
    start = time.perf_counter()
    bar = tqdm(total=len(examples), desc="collect", disable=not progress)
    for i in range(0, len(examples), batch):
        chunk = examples[i : i + batch]
        ranked: list[list[tuple[Any, list[tuple[str, float]]]]] = [[] for _ in chunk]

        def rank(
            q: int, t: int, prefix: Any, group: list[Any], scores: list[Any], ranked: Any = ranked
        ) -> int:
            s = [float(x) for x in scores]
            ranked[q].append((prefix.episode, [(c.episode.actions[-1], x) for c, x in zip(group, s)]))
            return best(q, t, prefix, group, s)  # execute the best action

        prefixes = step_search(
            start_trajectories(env, tokenizer, chunk),
            cfg.n,
            lambda pairs: annotate([JudgeItem.of(p, c) for p, c in pairs]),
            rank,
            env,
            generator,
            tokenizer,
            params,
            exp.rollout.max_total_tokens,
            stats,
        )
        steps += sum(len(r) for r in ranked)
        for q, p in enumerate(prefixes):
            if p.answer is not None and exact_match(p.answer, p.example.answers):  # keep correct episodes
                kept += 1
                rec = trajectory_record(p.episode)
                records += [rec] if env.append_only else step_records(env, rec)
                for state, cands in ranked[q]:
                    pairs += step_pairs(env, state, cands, cfg.chosen_min, cfg.rejected_max)
        bar.update(len(chunk))
    bar.close()
    summary = {
        "questions": len(examples),
        "kept_episodes": kept,
        "steps": steps,
        "pairs": len(pairs),
        "candidates_per_step": cfg.n,
        # the collection's wall time: its cost beside an online method's
        "seconds": time.perf_counter() - start,
        **stats.metrics(),
    }
    return pairs, records, summary


def save(
    out: Path,
    pairs: list[dict[str, Any]],
    records: list[dict[str, Any]],
    summary: dict[str, Any],
    exp: Any,
    model: str,
) -> None:
    from datasets import Dataset

    out.mkdir(parents=True, exist_ok=True)
    Dataset.from_list(pairs).save_to_disk(str(out / "pairs"))
    Dataset.from_list(records).save_to_disk(str(out / "sft"))
    cfg = exp.process_data
    rerendered = (
        " (state re-rendered each step: one SFT record per step)"
        if exp.env.agent in RERENDERED_AGENTS
        else ""
    )
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "README.md").write_text(f"""# RAG-Gym process data: {exp.name}

Collected {time.strftime("%Y-%m-%d %H:%M")} by `searchrl collect-process-data` (RAG-Gym §2.2.1).

- policy: `{model}`, sampling temperature {cfg.temperature}, {cfg.n} candidate actions per step
- questions: {summary["questions"]} from split `{cfg.split}` of `{exp.data.source}`
- annotator: `{cfg.annotator}` {json.dumps(cfg.annotator_args) if cfg.annotator_args else ""}
- at every step the best-ranked candidate was executed; only episodes with a correct final answer were
  kept ({summary["kept_episodes"]} of {summary["questions"]})
- agent design: `{exp.env.agent}`{rerendered}
- pairs: every candidate scoring >= {cfg.chosen_min} (chosen) x every candidate scoring <= {cfg.rejected_max}
  (rejected) of the same step: {summary["pairs"]} pairs over {summary["steps"]} annotated steps

`pairs/`: id, question, prompt, actions, observations (the state), step, chosen, rejected, chosen_score,
rejected_score. `sft/`: the kept episodes (prompt, actions, observations, answers, finish_reason).
Load with `datasets.load_from_disk`.
""")


def load_pairs(path: str | Path) -> list[dict[str, Any]]:
    return _load(Path(path) / "pairs")


def load_sft(path: str | Path) -> list[dict[str, Any]]:
    return _load(Path(path) / "sft")


def _load(path: Path) -> list[dict[str, Any]]:
    from datasets import load_from_disk

    problem = check_collected(path.parent, path.name)
    if problem is not None:
        raise problem
    return [dict(r) for r in load_from_disk(str(path))]


def check_collected(out: str | Path, part: str, source: str = "<config>") -> ConfigError | None:
    """Why the process data at ``out`` cannot train a stage that reads its ``part`` (``pairs`` or ``sft``), or
    None: not collected there (a `MissingInput`: an earlier command's output), or collected with no rows (a
    collection that kept no episode or found no pair, which `datasets` cannot even load). `validate` and the stage
    itself ask the same."""
    path = Path(out) / part
    if not (path / "state.json").is_file():
        return MissingInput(
            "no process data there",
            file=source,
            key="process_data.out",
            value=str(out),
            hint="collect it with `searchrl collect-process-data EXP.yaml --model DIR`",
        )
    if json.loads((path / "state.json").read_text(encoding="utf-8")).get("_data_files"):
        return None
    summary_file = Path(out) / "summary.json"
    s = json.loads(summary_file.read_text(encoding="utf-8")) if summary_file.is_file() else {}
    what = "preference pairs" if part == "pairs" else "kept episodes"
    found = f" (its collection: {s.get('pairs', 0)} pairs, {s.get('kept_episodes', 0)} of {s.get('questions', '?')} episodes kept)"
    return ConfigError(
        f"the process data holds no {what}{found if s else ''}",
        file=source,
        key="process_data.out",
        value=str(out),
        hint="collect again from a stronger start policy (--model), with more candidates per step "
        "(process_data.n) or wider score thresholds (process_data.chosen_min, process_data.rejected_max)",
    )


def run(exp: Any, model: str, progress: bool = True) -> dict[str, Any]:
    from searchrl.app.resources import Resources
    from searchrl.models.load import load_model_and_tokenizer
    from searchrl.rollout.hf import HFGenerator

    if exp.process_data.out is None:
        raise ConfigError("set where to write the data", key="process_data.out")
    torch.manual_seed(exp.seed)
    resources = Resources(exp)
    policy, tok = load_model_and_tokenizer(model)
    gen = HFGenerator(
        policy.eval(),
        tok,
        resources.env().stop_strings,
        batch_size=exp.rollout.batch_size,
        continuous=exp.rollout.loop == "episode",
    )
    pairs, records, summary = collect(resources, gen, tok, progress=progress)
    save(Path(exp.process_data.out), pairs, records, summary, exp, model)
    for part in ("pairs", "sft"):  # said now, not when a stage that reads it starts
        if (problem := check_collected(exp.process_data.out, part)) is not None:
            print(f"warning: {problem.problem}; {problem.hint}")
    return summary
