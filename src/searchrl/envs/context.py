"""Long horizons under a fixed context (``env.context``): folding an episode's history into a summary.

ReSum (Wu et al., 2025) and AgentFold (Ye et al., 2025) let a search agent go on past its context window: when
the context fills, the history is summarised and the agent continues from the question and the summary. Here,
before an action, an episode whose context holds ``max_tokens`` or more is *folded* (`ContextFolder.fold`):

1. every search of the episode so far becomes one line, ``query: m``, m the summariser's answer to the query
   from its documents (`envs.summarize`: ``extract`` picks the document sentences that share the most words
   with the query; ``llm`` asks an untuned chat model, RAG-Gym's Figure 7 prompt). Searches summarised at an
   earlier fold are not summarised again, so an episode's summary carries its whole history;
2. the oldest lines are dropped until the summary fits ``summary_max_tokens`` (default: half of what
   ``max_tokens`` leaves after the prompt);
3. the episode's context so far (its segments and steps) is closed as a finished training row, and the episode
   goes on from ``env.fold_prompt``: the question's prompt with the summary (the tag protocol: as an
   information block after the prompt; a chat prompt: appended to the user's message).

Every context is append-only in its own ids: its actions' ids and log-probs are the ones sampled from exactly
the tokens before them (docs/design.md §4.1). `unfold` turns an episode into its rows once the episode is scored:
each row gets the episode's outcome reward, its group and an episode id, so that group baselines count episodes,
not rows (`algorithms.advantage_estimators.per_episode`). An episode that already made ``max_segments`` rows is not folded
again: it runs on to ``rollout.max_total_tokens`` and ends there ("length"), as without folding.

Assumed (neither paper's exact recipe is reproduced): the summary is model-free by default, not written by the
policy (AgentFold) or a trained summary model (ReSum's ReSumTool-30B); the summary is shown once, at the start
of the new context; every row of an episode gets its outcome reward (ReSum-GRPO broadcasts the trajectory's
advantage to all its segments in the same way).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from searchrl.core.errors import DataError
from searchrl.core.records import Doc
from searchrl.core.types import Segment, Trajectory

Summarizer = Callable[[Sequence[tuple[str, str, Sequence[Doc]]]], list[str]]

FOLDS = "context_folds"  # Trajectory.info: the closed contexts, [(segments, steps), ...]
LINES = "context_lines"  # Trajectory.info: the summary lines so far, one per search
SUMMARISED = "context_summarised"  # Trajectory.info: how many of the episode's steps the lines cover
LATER = "later_segments"  # Trajectory.info on an unfolded row: rows of its episode after it (0: the last)


class ContextFolder:
    """Folds an episode's history into a summary when its context reaches ``max_tokens`` (module docstring)."""

    def __init__(
        self,
        max_tokens: int,
        max_segments: int = 4,
        summary_max_tokens: int | None = None,
        header: str = "Summary of the searches so far:",
        summarizer: Summarizer | None = None,
    ) -> None:
        if max_tokens < 1:
            raise DataError(f"env.context.max_tokens must be at least 1, got {max_tokens}")
        if max_segments < 1:
            raise DataError(f"env.context.max_segments must be at least 1, got {max_segments}")
        if summary_max_tokens is not None and summary_max_tokens < 1:
            raise DataError(f"env.context.summary_max_tokens must be at least 1, got {summary_max_tokens}")
        if summarizer is None:
            from searchrl.envs.summarize import ExtractiveSummarizer

            summarizer = ExtractiveSummarizer()
        self.max_tokens, self.max_segments = max_tokens, max_segments
        self.summary_max_tokens, self.header, self.summarizer = summary_max_tokens, header, summarizer

    def due(self, t: Trajectory) -> bool:
        """Whether ``t`` is to be folded before its next action: its context is full and it may make a row more."""
        return len(t) >= self.max_tokens and len(t.info.get(FOLDS, ())) + 1 < self.max_segments

    def fold(self, t: Trajectory, env: Any, tokenizer: Any) -> bool:
        """Close ``t``'s context as a row and start a new one from the question and the summary of its
        searches; False (nothing changed) when even the summary's header does not leave room below
        ``max_tokens``."""
        state = t.episode
        lines = self._lines(t)
        prompt_len = len(_encode(tokenizer, state.prompt))
        budget = self.summary_max_tokens or max(1, (self.max_tokens - prompt_len) // 2)

        def context(start: int) -> list[int] | None:  # the new context keeping lines[start:], if it fits
            ids = _encode(tokenizer, env.fold_prompt(state, "\n".join([self.header, *lines[start:]])))
            return ids if len(ids) - prompt_len <= budget and len(ids) < self.max_tokens else None

        # the most lines that fit (fewer lines, fewer tokens): a binary search, O(log n) renderings per fold
        lo, hi = 0, len(lines)  # lines[hi:] (none) is the last resort
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if context(mid) is not None else (mid + 1, hi)
        ids = context(lo)
        if ids is None:
            return False
        t.info.setdefault(FOLDS, []).append((t.segments, t.steps))
        t.segments, t.steps = [Segment("prompt", ids)], []
        return True

    def _lines(self, t: Trajectory) -> list[str]:
        """The summary's lines: one per search of the episode, the new ones summarised now (one batch)."""
        state = t.episode
        done = t.info.get(SUMMARISED, 0)
        lines: list[str] = t.info.setdefault(LINES, [])
        items = [
            (state.example.question, q, docs)
            for info, docs in zip(state.infos[done:], state.retrieved[done:])
            if info.kind == "search" and info.valid
            for q in [" / ".join(info.subqueries)]
        ]
        if items:
            found = self.summarizer(items)
            if len(found) != len(items):
                raise RuntimeError(
                    f"the summarizer returned {len(found)} summaries for {len(items)} searches"
                )
            # one line each; text that is not valid Unicode (an unpaired surrogate in a chat model's JSON reply)
            # is replaced, so the tokenizer always takes the summary
            lines += [_text(f"{q}: {' '.join(str(m).split())}") for (_, q, _), m in zip(items, found)]
        t.info[SUMMARISED] = len(state.infos)
        return lines


def _text(s: str) -> str:
    return s.encode("utf-8", "replace").decode("utf-8")


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def unfold(trajs: Sequence[Trajectory]) -> list[Trajectory]:
    """Each episode as its training rows: its closed contexts, then its last one (the trajectory itself). Every
    row shares the episode's reward, group, state and an episode id (rows of one episode: the same id, unique
    in ``trajs`` and, with group ids unique over processes, over the step); a row carries ``info[LATER]``, the rows of its episode after it (0 on the last)."""
    out: list[Trajectory] = []
    for i, t in enumerate(trajs):
        # unique over every process too (group ids are), so that rows moved between processes (the trainer's
        # `engine.balance`, by whole groups) never meet another episode's id
        e = t.group_id * (1 << 20) + i if t.group_id >= 0 else -1 - i
        folds = t.info.pop(FOLDS, [])
        n = len(folds) + 1
        for k, (segments, steps) in enumerate(folds):
            out.append(
                Trajectory(
                    t.example,
                    segments,
                    steps,
                    state=t.state,
                    reward=t.reward,
                    group_id=t.group_id,
                    finish_reason="folded",
                    info={LATER: n - 1 - k, "segment": k},
                    trained=t.trained,
                    episode_id=e,
                )
            )
        t.episode_id = e
        t.info[LATER], t.info["segment"] = 0, n - 1
        out.append(t)
    return out


def last_rows(trajs: Sequence[Trajectory]) -> list[bool]:
    """Per row: whether it ends its episode (a row without folding always does); per-episode metrics count
    those only."""
    return [not t.info.get(LATER, 0) for t in trajs]
