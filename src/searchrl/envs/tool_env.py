"""The tool protocol (``env.protocol: tools``): the search environment spoken in the model's own chat format.

The prompt is the tokenizer's chat template with the tool schemas (``tools=``) and the question as the user
turn. An action is one assistant turn, up to its end-of-turn marker (Qwen: ``<|im_end|>``, which is the
model's EOS: generation ends there, not at ``</tool_call>``, so one turn may call several tools). A turn
with ``<tool_call>`` blocks runs them (every search of the step in one retriever batch) and the observation
is the template's own rendering of the tool messages, then the next assistant turn opened, tokenized once
and appended after the sampled ids (`ChatFormat.after_tool_calls`). A turn without tool calls is the final
answer: its text with any ``<think>…</think>`` removed (or what it puts inside ``<answer>…</answer>``).

A call that cannot run (malformed JSON, an unknown tool, arguments that do not fit the schema, more calls
than ``max_tool_calls``) still gets a tool message, saying why, and makes its turn invalid (counted in
``rollout/invalid_action_rate``). When the turn budget (``env.max_turns`` tool turns) is spent, the last
tool message says so and the next turn must answer (``on_budget: force_answer``), or the episode ends
(``end``).

Whatever a policy writes is an observation, never an exception (`searchrl.envs.tools.parse_tool_calls`), in
time linear in the turn's length:

- a ``<tool_call>`` inside ``<think>…</think>`` is reasoning, not a call: it is not run (as vLLM's reasoning
  parsers hand tool parsers the content after the reasoning only), and a turn whose calls are all inside its
  reasoning is its final answer;
- JSON with a key written twice is refused (``duplicate_key``), not resolved: a second ``"name"`` would
  silently switch tools;
- a ``search`` query longer than ``env.max_query_chars`` is refused (``query_too_long``), as in the tag
  protocol;
- the calls past ``max_tool_calls`` get one message between them, not one each;
- with a template whose generation prompt opens ``<think>`` (`ChatFormat.opens_think`: Qwen3.5 thinking,
  Qwen3.6, Qwen3.8, Nemotron 3), the turn starts inside its reasoning: what comes before ``</think>`` is
  reasoning, the answer what follows it;
- the answer inside ``<answer>…</answer>`` is the last such block, found in time linear in the turn;
- each tool response is cut to ``max_response_chars`` (verl's ``max_tool_response_length``) on the side
  ``truncate_side`` names (``right`` keeps the start, ``left`` the end, ``middle`` both ends), saying how much
  was cut, and any text that is not valid Unicode (an unpaired surrogate a tool echoed) is replaced.

A call that ran but failed (the tool raised, timed out, returned what is not text, or was asked for a
document it never showed: `searchrl.envs.tools.TOOL_FAILURES`) is the tool's failure, not the model's: the
turn stays valid, the kind is recorded in ``StepInfo.failures`` and counted per kind in the rollout metrics
(``tool/error_rate``, …), which a guard can watch (``trainer.guards``, monitor ``tool_errors``). A tool
whose ``run`` itself raises or returns the wrong number of results gives each of its calls an error.

Stateful tool classes (`searchrl.envs.python_tools.class_tools`) get their instance when the episode starts
(`reset`), and the text their ``reset`` returns is appended to the user's message, as TRL's
``environment_factory`` does.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from searchrl.core.errors import DataError
from searchrl.core.records import Doc, Example
from searchrl.core.types import EnvState, StepInfo
from searchrl.envs.chat_format import ChatFormat
from searchrl.envs.search import ENV, PROBE_THOUGHT, SearchEnv
from searchrl.envs.tags import CHAT_TEMPLATES, ChatTemplate
from searchrl.envs.tools import CALL_ERRORS, TOOL_FAILURES, Tool, ToolCall, ToolResult, format_tool_docs

TOOL_ERRORS = (*CALL_ERRORS, "query_too_long", "tool_call_after_budget", "empty_answer")
TRUNCATE_SIDES = ("right", "left", "middle")
BUDGET_NOTE = "\nNo tool calls left: give the final answer now."
_THINK = re.compile(r"<think>.*?(</think>|$)", re.S)


def last_answer(text: str) -> str | None:
    """What the last ``<answer>…</answer>`` block of ``text`` holds, or None: linear in the text (a regex
    scan for every ``<answer>`` of ``"<answer>" * n`` is quadratic)."""
    close = text.rfind("</answer>")
    if close < 0:
        return None
    start = text.rfind("<answer>", 0, close)
    return None if start < 0 else text[start + len("<answer>") : close]


class ToolEnv(SearchEnv):
    eos_ends_turn = True  # the model's end of turn (its EOS) ends an action, not the episode

    def __init__(
        self,
        retriever: Any,
        chat: ChatFormat,
        tools: Sequence[Tool] | None = None,
        template: str | ChatTemplate = "tools",
        topk: int = ENV.topk,
        max_turns: int = ENV.max_turns,
        max_tool_calls: int = ENV.max_tool_calls,
        on_budget: str = ENV.on_budget,
        doc_max_words: int | None = ENV.doc_max_words,
        max_query_chars: int = ENV.max_query_chars,
        max_response_chars: int | None = ENV.tool_response_max_chars,
        truncate_side: str = ENV.tool_response_truncate,
        call_format: str = ENV.call_format,
    ) -> None:
        """``tools``: default ``search`` over ``retriever``. ``template``: a chat prompt (`CHAT_TEMPLATES`);
        ``max_turns``: tool turns before the answer is due; ``max_tool_calls``: calls one turn may make;
        ``max_response_chars`` / ``truncate_side``: each tool response's length cap (None: no cap) and which
        side of a longer one is cut; ``call_format``: how the model writes its calls (`envs.call_formats`;
        ``auto``: read from the chat template)."""
        from searchrl.envs import call_formats

        self.call_format = call_formats.resolve(call_format, getattr(chat.tokenizer, "chat_template", None))
        chat.call_format = self.call_format  # what a template that renders no tool schemas describes
        try:  # a template that cannot render tool messages fails here, not at a run's first call
            chat.after_tool_calls([("search", {})], ["probe"])
        except Exception as exc:
            raise DataError(f"the chat template cannot render a tool call's result: {exc}") from None
        if truncate_side not in TRUNCATE_SIDES:
            raise DataError(
                f"truncate_side must be one of {', '.join(TRUNCATE_SIDES)}, got {truncate_side!r}"
            )
        if max_response_chars is not None and max_response_chars < 1:
            raise DataError(
                f"max_response_chars must be at least 1 (or None: no cap), got {max_response_chars}"
            )
        self.max_response_chars, self.truncate_side = max_response_chars, truncate_side
        from searchrl.envs.tools import search_tool

        if isinstance(template, str):
            if template not in CHAT_TEMPLATES:
                raise DataError(
                    f"the tool protocol's template must be a chat prompt ({', '.join(CHAT_TEMPLATES)}), got {template!r}"
                )
            template = CHAT_TEMPLATES[template]
        self.format = chat
        super().__init__(
            retriever,
            template=template,
            topk=topk,
            max_turns=max_turns,
            max_query_chars=max_query_chars,
            on_budget=on_budget,
            doc_max_words=doc_max_words,
            chat=lambda messages: chat.prompt(messages, self.schemas),
        )
        self.max_tool_calls = max_tool_calls
        self.set_tools(list(tools) if tools is not None else [search_tool(retriever, topk, self.format_docs)])

    def set_tools(self, tools: Sequence[Tool]) -> None:
        names = [t.name for t in tools]
        if not tools or len(set(names)) != len(names):
            raise DataError(f"the tool protocol needs at least one tool, each name once; got {names}")
        self.tools = {t.name: t for t in tools}
        self.schemas = [t.schema for t in tools]

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return self.format.ends

    @property
    def tool_names(self) -> tuple[str, ...]:
        return tuple(self.tools)

    def format_docs(self, docs: Sequence[Doc]) -> str:
        """Search results with their ids (what ``open`` takes)."""
        return format_tool_docs(docs, self.doc_max_words)

    # ------------------------------------------------------------------ parsing
    def turn_text(self, action: str) -> str:
        """The turn's text before its end-of-turn marker; with a template that opens the reasoning in its
        generation prompt, from that ``<think>`` on."""
        text = action[: self.format.turn_end(action)]
        return "<think>" + text if self.format.opens_think else text

    def calls(self, action: str) -> list[ToolCall]:
        """The turn's tool calls outside its reasoning, those past ``max_tool_calls`` refused together, and
        searches whose query is longer than ``max_query_chars`` refused."""
        from searchrl.envs.call_formats import parse

        text = _THINK.sub("", self.turn_text(action))  # harmony's reasoning channel: `call_formats.parse`
        return [self._query_length(c) for c in parse(self.call_format, text, self.tools, self.max_tool_calls)]

    def _query_length(self, call: ToolCall) -> ToolCall:
        query = call.arguments.get("query") if call.valid and call.name == "search" else None
        if isinstance(query, str) and len(query) > self.max_query_chars:
            detail = f"the query has {len(query)} characters; at most {self.max_query_chars}"
            return ToolCall(call.name, call.arguments, error="query_too_long", detail=detail)
        return call

    def cap(self, text: str) -> str:
        """A tool response as the model reads it: valid Unicode, at most ``max_response_chars`` characters
        of it kept (the side ``truncate_side`` names is cut), with a note of what was cut."""
        text = text.encode("utf-8", "replace").decode("utf-8")
        n = self.max_response_chars
        if n is None or len(text) <= n:
            return text
        note = f" …[{len(text) - n} characters cut] "
        if self.truncate_side == "right":
            return text[:n] + note
        if self.truncate_side == "left":
            return note + text[-n:]
        return text[: n - n // 2] + note + text[len(text) - n // 2 :]

    def parse(self, action: str, forced: bool = False, stopped: bool = False) -> StepInfo:
        """Classify one assistant turn (without running its calls: see `step_batch`)."""
        return self._classify(action, self.calls(action), forced)

    def _classify(self, action: str, calls: list[ToolCall], forced: bool) -> StepInfo:
        """The turn's `StepInfo` from its parsed ``calls``."""
        if not calls:
            return self._parse_answer(self.turn_text(action), forced)
        if forced:
            return StepInfo("answer", False, "tool_call_after_budget", forced=True)
        bad = next((c for c in calls if not c.valid), None)
        searches = [c for c in calls if c.valid and c.name == "search"]
        kind = "search" if searches else ("tool" if bad is None else "invalid")
        query = " ".join(str(searches[0].arguments.get("query", "")).split()) if searches else None
        names = tuple(c.name for c in calls if c.valid and c.name)
        return StepInfo(kind, bad is None, bad.error if bad else None, query=query, calls=names)

    def _parse_answer(self, text: str, forced: bool) -> StepInfo:  # type: ignore[override]
        text = _THINK.sub("", text)
        if self.call_format == "gpt_oss":
            from searchrl.envs.call_formats import harmony_answer

            text = harmony_answer(text)
        inside = last_answer(text)
        answer = " ".join((text if inside is None else inside).split())
        return StepInfo(
            "answer", bool(answer), None if answer else "empty_answer", answer=answer or None, forced=forced
        )

    # ------------------------------------------------------------------ stepping
    def step_batch(
        self,
        states: list[EnvState],
        actions: list[str],
        eos: list[bool] | None = None,
        stopped: list[bool] | None = None,
    ) -> list[tuple[str, bool, StepInfo]]:
        """Advance each episode by one turn; each tool's calls from every episode run as one batch.
        ``eos``: the turn was cut (length) rather than ended by the model."""
        eos = eos or [False] * len(states)
        parsed = [self.calls(a) for a in actions]  # each turn's calls parsed once
        infos = [self._classify(a, cs, s.force_answer) for s, a, cs in zip(states, actions, parsed)]
        calls = [cs if i.kind != "answer" else [] for cs, i in zip(parsed, infos)]
        results = self._run_calls(states, calls)
        out = []
        for state, action, info, cs, rs, cut in zip(states, actions, infos, calls, results, eos):
            if state.done:
                raise ValueError(f"episode {state.example.id} is already done; reset it before stepping")
            docs = [d for r in rs for d in r.docs]
            if docs:
                info = replace(info, doc_ids=tuple(d.id for d in docs))
            failures = tuple(r.error for c, r in zip(cs, rs) if c.valid and r.error in TOOL_FAILURES)
            if failures:
                info = replace(info, failures=failures)
            obs, done, reason = self._after(state, info, cs, rs, cut)
            self.record(state, action, obs, info, docs, done, reason)
            if done:
                self.finished(state)
            state.force_answer = (
                not done and self.on_budget == "force_answer" and state.n_turns >= self.max_turns
            )
            out.append((obs, done, info))
        return out

    def _run_calls(self, states: list[EnvState], calls: list[list[ToolCall]]) -> list[list[ToolResult]]:
        """Every call's result; the valid calls of one tool run as one batch."""
        results: list[list[ToolResult | None]] = [[None] * len(cs) for cs in calls]
        batches: dict[str, list[tuple[int, int]]] = defaultdict(list)
        for i, cs in enumerate(calls):
            for j, c in enumerate(cs):
                if c.valid and c.name is not None:
                    batches[c.name].append((i, j))
                else:
                    results[i][j] = ToolResult(f"Error: {c.detail}", error=c.error)
        for name, where in batches.items():
            for (i, j), r in zip(
                where, self._run_tool(name, [(calls[i][j].arguments, states[i]) for i, j in where])
            ):
                results[i][j] = r
        return [[r for r in rs if r is not None] for rs in results]

    def _run_tool(self, name: str, batch: list[tuple[dict[str, Any], EnvState]]) -> list[ToolResult]:
        """One tool's batch of calls, one result each whatever its ``run`` does (raises, returns too few or
        too many results, or results that are not `ToolResult`s)."""
        from searchrl.envs.python_tools import as_result, describe

        try:
            got = list(self.tools[name].run(batch))
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt):
                raise
            why = f"Error: the tool {name} failed: {describe(exc)}"
            return [ToolResult(why, error="tool_error")] * len(batch)
        if len(got) != len(batch):
            why = f"Error: the tool {name} returned {len(got)} results for {len(batch)} calls"
            return [ToolResult(why, error="tool_error")] * len(batch)
        return [as_result(r) for r in got]

    def _after(
        self, state: EnvState, info: StepInfo, calls: list[ToolCall], results: list[ToolResult], cut: bool
    ) -> tuple[str, bool, str | None]:
        if info.kind == "answer":
            return "", True, "answer"
        if cut:  # the length cap ended the turn: nothing more will be generated
            return "", True, "eos"
        texts = [self.cap(r.text) for r in results]
        last = state.n_turns + 1 >= self.max_turns  # this turn used the last of the budget
        if last and self.on_budget == "force_answer":
            texts[-1] += BUDGET_NOTE
        from searchrl.envs.call_formats import call_ids

        named = [(c.name or "invalid", c.arguments) for c in calls]
        obs = self.format.after_tool_calls(named, texts, call_ids(calls))
        if last and self.on_budget == "end":
            return obs, True, "budget"
        return obs, False, None

    def reset(self, example: Example) -> EnvState:
        """A new episode: its tool objects made and reset (`envs.python_tools.ToolObjects.start`), the text
        their ``reset`` returned appended to the user's message (as TRL's ``environment_factory``), and the
        chat prompt rendered with the tool schemas."""
        state = EnvState(example=example, prompt="")
        owners = {id(t.owner): t.owner for t in self.tools.values() if t.owner is not None}
        state.intro = "".join(note for o in owners.values() if (note := o.start(state)))
        state.prompt = self._render(state, "")
        return state

    def _render(self, state: EnvState, extra: str) -> str:
        messages = self.template.messages(state.example.question)  # type: ignore[union-attr]
        messages[-1]["content"] += state.intro + extra
        return str(self.chat(messages))  # type: ignore[misc]

    def fold_prompt(self, state: EnvState, summary: str) -> str:
        """The chat prompt re-rendered with the summary after the question (`envs.context`); with the tool
        budget spent, the user's message ends by saying so."""
        return self._render(state, f"\n\n{summary}" + (BUDGET_NOTE if state.force_answer else ""))

    def finished(self, state: EnvState) -> None:
        """An episode ended: its tool objects are settled (`envs.python_tools.settle`)."""
        from searchrl.envs.python_tools import settle

        settle(state)

    def discard(self, state: EnvState) -> None:
        """An episode that will not be played: its tool objects released without a reward."""
        from searchrl.envs.python_tools import discard

        discard(state)

    def replay(self, example: Example, actions: list[str], observations: list[str] | None = None) -> EnvState:
        """Rebuild an episode from recorded turns. With ``observations`` no tool runs again."""
        if observations is None:
            return super().replay(example, actions)
        state = self.reset(example)
        for action, obs in zip(actions, observations):
            info = self.parse(action, forced=state.force_answer)
            state.actions.append(action)
            state.observations.append(obs)
            state.infos.append(info)
            state.retrieved.append([])
            state.done = info.kind == "answer"
            state.finish_reason = "answer" if state.done else None
            state.force_answer = (
                not state.done and self.on_budget == "force_answer" and state.n_turns >= self.max_turns
            )
        return state

    # ------------------------------------------------------------------ written actions (the teacher)
    def _think(self, text: str) -> str:
        """Reasoning as the turn writes it: inside ``<think>…</think>``, or, where the template opened the
        ``<think>`` already, the reasoning and its close."""
        if self.call_format == "gpt_oss":  # harmony: an analysis message, then the next message opened
            return f"<|channel|>analysis<|message|>{text}<|end|><|start|>assistant"
        return f"{text}\n</think>\n\n" if self.format.opens_think else f"<think> {text} </think>\n"

    def _final(self, answer: str) -> str:
        """The answer as the turn writes it (harmony: in the final channel)."""
        return f"<|channel|>final<|message|>{answer}" if self.call_format == "gpt_oss" else answer

    def write_search(self, think: str, query: str) -> str:
        from searchrl.envs.call_formats import write

        call = write(self.call_format, "search", {"query": query})
        # the whole turn is the call (Mistral's templates refuse a turn with both text and calls)
        if self.call_format in ("llama3_json", "mistral", "gemma4"):
            return f"{call}{self.format.call_end}"
        return f"{self._think(think)}{call}{self.format.call_end}"

    def write_answer(self, answer: str, note: str = "") -> str:
        return f"{self._think(f'{note}So the answer is {answer}.')}{self._final(answer)}{self.format.end_of_turn}"

    def answer_probe(self, answer: str) -> str:
        return f"{self._think(PROBE_THOUGHT)}{self._final(answer)}{self.format.end_of_turn}"

    def write_forced_answer(self, answer: str) -> str:
        return (
            f"{self._think('')}{answer}{self.format.end_of_turn}"
            if self.format.opens_think
            else f"{self._final(answer)}{self.format.end_of_turn}"
        )
