"""The one search environment every algorithm shares.

An action is the text the policy generated up to a stop tag. ``step`` parses it, runs the retriever for
searches (batched over episodes), and returns the observation text to append, a done flag and a
`StepInfo`. Malformed actions are recorded as invalid with a flag and never raise. Episodes can be
rebuilt from a recorded list of actions (and, optionally, their observations) for SLATE and RAG-Gym,
which restart from a prefix.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from searchrl.core.config import EnvConfig
from searchrl.core.errors import DataError
from searchrl.core.records import Doc, Example
from searchrl.core.types import EnvState, StepInfo
from searchrl.data.corpus import DOC_FORMATS, format_docs
from searchrl.envs.retrievers.protocol import Retriever
from searchrl.envs.tags import CHAT_TEMPLATES, TAGSETS, TEMPLATES, ChatTemplate, TagSet

INVALID_FEEDBACK = (
    "\nMy previous action is invalid. If I want to search, I should put the query between {so} and {sc}. "
    "If I want to give the final answer, I should put the answer between {ao} and {ac}. Let me try again.\n"
)
# Agent designs (RAG-Gym Appendix C and §3) over this environment; see `SearchEnv.reset`.
AGENTS = ("react", "direct", "rag", "research")
# Designs whose state is re-rendered at every step rather than grown by appending (`SearchEnv.render`).
RERENDERED_AGENTS = ("research",)
# Error codes recorded in StepInfo.error
ERRORS = (
    "no_action",
    "unclosed_tag",
    "empty_query",
    "query_too_long",
    "multiple_answers",
    "text_after_answer",
    "missing_boxed",
    "empty_answer",
    "too_many_queries",
)


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` in ``text``, braces matched (``\\boxed{a} or \\boxed{b}``
    gives ``b``; ``\\boxed{f(x{1})}`` gives ``f(x{1})``); None when there is none or it is unclosed. ReSearch's
    public code and the MATH evaluation scripts read the last boxed expression the same way."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    for i in range(start + len("\\boxed"), len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + len("\\boxed{") : i]
    return None


# The environments' keyword defaults are the ``env`` section's (one place); the registry entries in
# `searchrl.app.environments` build them from the experiment's section.
ENV = EnvConfig()

# the thought before the answer IGPO teacher-forces (its code: "Now there's enough information to answer")
PROBE_THOUGHT = "Now there is enough information to answer."


class SearchEnv:
    def __init__(
        self,
        retriever: Retriever,
        tags: str | TagSet = ENV.tags,
        template: str | ChatTemplate = "search_r1",  # the papers' prompt (the section's default is `short`)
        topk: int = ENV.topk,
        max_turns: int = ENV.max_turns,
        max_query_chars: int = ENV.max_query_chars,
        on_budget: str = ENV.on_budget,
        doc_max_words: int | None = ENV.doc_max_words,
        agent: str = ENV.agent,
        summarizer: Callable[[Sequence[tuple[str, str, Sequence[Doc]]]], list[str]] | None = None,
        chat: Callable[[list[dict[str, Any]]], str] | None = None,
        doc_format: str = ENV.doc_format,
        query_separator: str | None = ENV.query_separator,
        max_parallel_queries: int = ENV.max_parallel_queries,
    ) -> None:
        """``template``: a name in `TEMPLATES` (plain prompts, for base models), in `CHAT_TEMPLATES` (rendered
        through ``chat``, the tokenizer's chat template with the assistant turn opened, for instruct models),
        or a format string with ``{question}``. ``query_separator``: a search may hold several queries split
        by it (ParallelSearch), at most ``max_parallel_queries``, retrieved in one batch and shown per query."""
        if query_separator is not None and not query_separator.strip():
            raise DataError(f"query_separator must hold a visible character, got {query_separator!r}")
        if max_parallel_queries < 1:
            raise DataError(f"max_parallel_queries must be at least 1, got {max_parallel_queries}")
        self.query_separator, self.max_parallel_queries = query_separator, max_parallel_queries
        if doc_format not in DOC_FORMATS:
            raise DataError(f"doc_format must be one of {', '.join(DOC_FORMATS)}, got {doc_format!r}")
        self.doc_format = doc_format
        if on_budget not in ("force_answer", "end"):
            raise DataError(f"on_budget must be 'force_answer' or 'end', got {on_budget!r}")
        if agent not in AGENTS:
            raise DataError(f"agent must be one of {', '.join(AGENTS)}, got {agent!r}")
        self.agent = agent
        if summarizer is None and agent == "research":
            from searchrl.envs.summarize import ExtractiveSummarizer

            summarizer = ExtractiveSummarizer()
        self.summarizer = summarizer
        self.retriever = retriever
        self.tags = TAGSETS[tags] if isinstance(tags, str) else tags
        if isinstance(template, str):
            template = CHAT_TEMPLATES.get(template) or TEMPLATES.get(template, template)
        self.template: str | ChatTemplate = template
        if isinstance(self.template, ChatTemplate) and chat is None:
            raise DataError(
                f"template {template!r} is rendered through a tokenizer's chat template: pass chat="
            )
        self.chat = chat
        self.topk, self.max_turns, self.max_query_chars = topk, max_turns, max_query_chars
        self.on_budget, self.doc_max_words = on_budget, doc_max_words
        # long horizons (`envs.context`, ``env.context``): folds a full context into a summary; None: no folding
        self.context: Any = None

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """Generation stops right after any of these (docs/design.md §4.4): the closing search and answer tags."""
        return self.tags.stop_strings

    # ------------------------------------------------------------------ episodes
    def reset(self, example: Example) -> EnvState:
        """A new episode. The agent design shapes it (RAG-Gym Appendix C, §3): ``react`` reasons and
        searches in turns; ``direct`` answers at once (the prompt ends with the opened answer tag);
        ``rag`` retrieves with the question itself, shows those documents, then answers at once;
        ``research`` searches in turns like ``react``, but its state is the question and the (query,
        summary) pairs of its searches so far, re-rendered at every step (see `render`)."""
        if isinstance(self.template, ChatTemplate):
            prompt = self.chat(self.template.messages(example.question))  # type: ignore[misc]
        else:
            prompt = self.template.format(question=example.question)
        if self.agent in ("react", "research"):
            return EnvState(example=example, prompt=prompt)
        prefetched = None
        if self.agent == "rag":
            [docs] = self.retriever.search([example.question], self.topk)
            prompt += f"\n\n{self.tags.info_open}{self.format_docs(docs)}{self.tags.info_close}\n\n"
            prefetched = (example.question, tuple(docs))
        return EnvState(
            example=example, prompt=prompt + self.tags.answer_open, force_answer=True, prefetched=prefetched
        )

    def discard(self, state: EnvState) -> None:
        """An episode that will not be played (its prompt measured): nothing to release here (the tool
        protocol releases its tool objects)."""

    def fold_prompt(self, state: EnvState, summary: str) -> str:
        """The context a folded episode goes on from (`envs.context`): a chat prompt re-rendered with the summary
        after the question in the user's message; a plain prompt followed by the summary as an information
        block. An episode that must answer next (its turn budget spent) is told so again."""
        t = self.tags
        if isinstance(self.template, ChatTemplate):
            messages = self.template.messages(state.example.question)
            messages[-1]["content"] += f"\n\n{summary}"
            text = self.chat(messages)  # type: ignore[misc]
        else:
            text = f"{state.prompt}\n\n{t.info_open}{summary}{t.info_close}\n\n"
        return text + (t.answer_open if state.force_answer else "")

    def step(
        self, state: EnvState, action: str, eos: bool = False, stopped: bool = False
    ) -> tuple[str, bool, StepInfo]:
        return self.step_batch([state], [action], [eos], [stopped])[0]

    def step_batch(
        self,
        states: list[EnvState],
        actions: list[str],
        eos: list[bool] | None = None,
        stopped: list[bool] | None = None,
    ) -> list[tuple[str, bool, StepInfo]]:
        """Advance each episode by one action; all searches go to the retriever in one batch. ``stopped``:
        generation stopped at a closing tag (see `parse`)."""
        eos = eos or [False] * len(states)
        stopped = stopped or [False] * len(states)
        parsed = [
            self.parse(a, forced=s.force_answer, stopped=st) for s, a, st in zip(states, actions, stopped)
        ]
        asked = [
            (s, q) for s, p in zip(states, parsed) if p.kind == "search" and p.valid for q in p.subqueries
        ]
        queries = [q for _, q in asked]
        results = self._retrieve(queries, [s.example for s, _ in asked])
        summaries = iter(self._summaries(states, parsed, results))
        found = iter(results)
        out = []
        for state, action, info, ended in zip(states, actions, parsed, eos):
            if state.done:
                raise ValueError(f"episode {state.example.id} is already done; reset it before stepping")
            docs: list[Doc] = []
            body = ""
            if info.kind == "search" and info.valid:
                per_query = [next(found) for _ in info.subqueries]
                bodies = [
                    next(summaries) if self.summarizer is not None else self.format_docs(d) for d in per_query
                ]
                docs = [d for found_docs in per_query for d in found_docs]
                body = bodies[0] if not info.queries else self._per_query(info.queries, bodies)
                info = StepInfo(
                    kind="search",
                    valid=True,
                    query=info.query,
                    doc_ids=tuple(d.id for d in docs),
                    queries=info.queries,
                )
            obs, done, reason = self._observe(state, info, body, ended)
            self.record(state, action, obs, info, docs, done, reason)
            state.force_answer = obs.endswith(self.tags.answer_open)
            out.append((obs, done, info))
        return out

    def _retrieve(self, queries: list[str], examples: list[Example]) -> list[list[Doc]]:
        """The retriever's documents for ``queries``; a retriever that reads the question each query was asked
        for (the simulated search engine) gets it."""
        if not queries:
            return []
        with_context = getattr(self.retriever, "search_with_context", None)
        if with_context is not None:
            return list(with_context(queries, self.topk, examples))
        return list(self.retriever.search(queries, self.topk))

    @staticmethod
    def _per_query(queries: Sequence[str], bodies: Sequence[str]) -> str:
        """The observation of a search with several queries: each query's documents under its name."""
        return "\n".join(f"Query {i + 1}: {q}\n{b}" for i, (q, b) in enumerate(zip(queries, bodies)))

    @staticmethod
    def record(
        state: EnvState,
        action: str,
        obs: str,
        info: StepInfo,
        docs: list[Doc],
        done: bool,
        reason: str | None,
    ) -> None:
        """Append one step to the episode's state."""
        state.actions.append(action)
        state.observations.append(obs)
        state.infos.append(info)
        state.retrieved.append(docs)
        state.done, state.finish_reason = done, reason

    def _summaries(
        self, states: list[EnvState], parsed: list[StepInfo], results: list[list[Doc]]
    ) -> list[str]:
        """One summary per valid search, in order (the ReSearch agent's m_t, eq. 8)."""
        if self.summarizer is None or not results:
            return []
        searched = [
            (s.example.question, q)
            for s, p in zip(states, parsed)
            if p.kind == "search" and p.valid
            for q in p.subqueries
        ]
        out = self.summarizer([(q, query, docs) for (q, query), docs in zip(searched, results)])
        if len(out) != len(results):
            raise RuntimeError(f"the summarizer returned {len(out)} summaries for {len(results)} searches")
        return out

    def _observe(
        self, state: EnvState, info: StepInfo, body: str, ended: bool
    ) -> tuple[str, bool, str | None]:
        t = self.tags
        if info.kind == "answer":
            return "", True, "answer"
        if ended:  # EOS (or the length cap) without an answer: nothing more will be generated
            return "", True, "eos"
        if info.kind == "search" and info.valid:
            obs = f"\n\n{t.info_open}{body}{t.info_close}\n\n"
        else:
            obs = INVALID_FEEDBACK.format(
                so=t.search_open, sc=t.search_close, ao=t.answer_open, ac=t.answer_close
            )
        if state.n_turns + 1 >= self.max_turns:  # this step used the last turn of the budget
            if self.on_budget == "end":
                return obs, True, "budget"
            return obs + t.answer_open, False, None
        return obs, False, None

    # ------------------------------------------------------------------ state as text
    @property
    def append_only(self) -> bool:
        """Whether the state text only grows (prompt, action, observation, ...): one token sequence per
        episode, as the online algorithms need. False for re-rendered designs (``research``)."""
        return self.agent not in RERENDERED_AGENTS

    def render(self, state: EnvState) -> str:
        """The text the policy conditions on for its next action. Append-only designs: the prompt then
        every action and observation. ``research`` (RAG-Gym §3): the prompt, then each valid search as
        its query and summary, H'_t of eq. 8 — the agent's earlier reasoning and any invalid actions are
        not part of the state — and the opened answer tag once the turn budget forces an answer."""
        if self.append_only:
            return state.text()
        t = self.tags
        parts = [state.prompt]
        for info, obs in zip(state.infos, state.observations):
            if info.kind == "search" and info.valid:
                parts.append(
                    f"{t.search_open} {info.query} {t.search_close}{obs.removesuffix(t.answer_open)}"
                )
        if state.force_answer:
            parts.append(t.answer_open)
        return "".join(parts)

    def pieces(self, state: EnvState) -> tuple[str, list[str], list[str]]:
        """The state as (prompt, actions, observations) text pieces, the form datasets store: the episode's
        own pieces for append-only designs, the rendered state as one prompt otherwise."""
        if self.append_only:
            return state.prompt, list(state.actions), list(state.observations)
        return self.render(state), [], []

    def format_docs(self, docs: Sequence[Doc]) -> str:
        return format_docs(docs, self.doc_max_words, self.doc_format)

    # ------------------------------------------------------------------ parsing
    def parse(self, action: str, forced: bool = False, stopped: bool = False) -> StepInfo:
        """Classify one action. ``forced``: the answer tag was already emitted by the environment.
        ``stopped``: generation stopped at a closing tag. In a real vocabulary a tag is text and its last
        token may carry more characters (Qwen2.5's ``>\n\n``, ``>.``): the action is read up to the end
        of its first closing tag, and what that token adds after it belongs to the action but is never
        read as more of it (not as text after the answer, not as a second action)."""
        t = self.tags
        text = (t.answer_open + action) if forced else action
        if stopped:
            text = text[: self.first_stop_end(text)]
        a_open, a_close = text.find(t.answer_open), text.find(t.answer_close)
        s_open = text.find(t.search_open)
        is_answer = a_open >= 0 and (s_open < 0 or a_open < s_open)
        if is_answer:
            return self._parse_answer(text, forced)
        if s_open >= 0:
            s_close = text.find(t.search_close, s_open)
            if s_close < 0:
                return StepInfo("invalid", False, "unclosed_tag")
            query = " ".join(text[s_open + len(t.search_open) : s_close].split())
            if not query:
                return StepInfo("invalid", False, "empty_query")
            if self.query_separator is not None and self.query_separator in query:
                return self._parse_parallel(query)
            if len(query) > self.max_query_chars:
                return StepInfo("invalid", False, "query_too_long", query=query[: self.max_query_chars])
            return StepInfo("search", True, query=query)
        if a_close >= 0:
            return StepInfo("invalid", False, "unclosed_tag")
        return StepInfo("invalid", False, "no_action")

    def _parse_parallel(self, query: str) -> StepInfo:
        """A search holding several queries split by ``query_separator``: each is a query of its own (empty
        pieces dropped); more than ``max_parallel_queries`` or one too long makes the action invalid."""
        assert self.query_separator is not None
        parts = tuple(p.strip() for p in query.split(self.query_separator) if p.strip())  # linear in the text
        short = query[: self.max_query_chars]
        if len(parts) > self.max_parallel_queries:
            return StepInfo("invalid", False, "too_many_queries", query=short)
        if not parts:
            return StepInfo("invalid", False, "empty_query")
        if any(len(p) > self.max_query_chars for p in parts):
            return StepInfo("invalid", False, "query_too_long", query=short)
        if len(parts) == 1:
            return StepInfo("search", True, query=parts[0])
        return StepInfo("search", True, query=query, queries=parts)

    def first_stop_end(self, text: str) -> int:
        """The end of the first closing tag (``</search>``, ``</answer>``) in ``text``; its length if none."""
        ends = [i + len(tag) for tag in self.tags.stop_strings if (i := text.find(tag)) >= 0]
        return min(ends, default=len(text))

    def _parse_answer(self, text: str, forced: bool) -> StepInfo:
        t = self.tags
        blocks = re.findall(re.escape(t.answer_open) + r"(.*?)" + re.escape(t.answer_close), text, re.S)
        if not blocks:
            return StepInfo("answer", False, "unclosed_tag", forced=forced)
        raw = blocks[-1]
        answer: str | None = " ".join(raw.split())
        error = None
        if t.boxed:
            boxed = last_boxed(raw)
            answer = " ".join(boxed.split()) if boxed is not None else None
            if boxed is None:
                error = "missing_boxed"
        if len(blocks) > 1:
            error = "multiple_answers"
        elif text[text.rfind(t.answer_close) + len(t.answer_close) :].strip():
            error = "text_after_answer"
        elif not answer:
            error = error or "empty_answer"
        return StepInfo("answer", error is None, error, answer=answer or None, forced=forced)

    # ------------------------------------------------------------------ written actions (the teacher)
    def write_search(self, think: str, query: str) -> str:
        """A search action in this protocol: a thought, then the query."""
        t = self.tags
        return f"{t.think_open} {think} {t.think_close}\n{t.search_open} {query} {t.search_close}"

    def write_answer(self, answer: str, note: str = "") -> str:
        """A final answer in this protocol, after a thought that starts with ``note``."""
        return f"{self.tags.think_open} {note}So the answer is {answer}. {self.tags.think_close}\n{self.tags.format_answer(answer)}"

    def answer_probe(self, answer: str) -> str:
        """``answer`` as this protocol's final answer after a thought that says it is time to answer: the text
        IGPO teacher-forces after each turn to read the policy's belief in the gold answer (`algorithms.igpo`)."""
        t = self.tags
        return f"{t.think_open} {PROBE_THOUGHT} {t.think_close}\n{t.format_answer(answer)}"

    def write_forced_answer(self, answer: str) -> str:
        """The answer after the environment opened the answer tag (the turn budget ran out)."""
        return self.tags.format_answer(answer)[len(self.tags.answer_open) :]

    # ------------------------------------------------------------------ replay
    def replay(self, example: Example, actions: list[str], observations: list[str] | None = None) -> EnvState:
        """Rebuild an episode from recorded actions. With ``observations`` nothing is retrieved again."""
        state = self.reset(example)
        for i, action in enumerate(actions):
            if observations is None:
                self.step(state, action)
                continue
            info = self.parse(action, forced=state.force_answer)
            state.actions.append(action)
            state.observations.append(observations[i])
            state.infos.append(info)
            state.retrieved.append([])
            state.done = info.kind == "answer"
            state.finish_reason = "answer" if state.done else None
            state.force_answer = observations[i].endswith(self.tags.answer_open)
        return state
