"""A tokenizer's chat template as the tool protocol uses it: the prompt (system and user turns, the tool
schemas, the assistant turn opened), and the text that follows an assistant turn that called tools (the
tool messages, then the next assistant turn opened).

The conversation is never re-rendered (docs/design.md §4.11): the tool messages' text is cut out of a rendering of a
stand-in conversation, after the stand-in assistant turn's end-of-turn marker, so it is exactly what the
template writes there, and it is appended after what the model sampled. Templates that rewrite earlier
assistant turns (Qwen3 drops or re-spaces reasoning, re-serialises tool-call JSON) cannot change the past.

Templates differ in what they keep of a tool-calling turn: Meta's Llama 3.1 / 3.2 templates drop its content
(the stand-in is then found by the prompt it follows) and take one call per turn (the tool messages of a turn
with several calls are then rendered after a one-call stand-in: they do not depend on the calls). Templates whose
generation prompt opens the reasoning (``<think>\n``: Qwen3.5 thinking, Qwen3.6, Qwen3.8, Nemotron 3) are
marked `opens_think`: the sampled turn starts inside its reasoning. What a tool returned is text: a special
token's text in it (``<|im_end|>``) is broken up with a zero-width space so that it tokenizes as text, not as
the token that ends a turn.

Two families need more than cutting text. Gemma 3 (and 2) has no tool turns: its calls are prompted, and `prompted`
writes OpenAI tool calls and results as Google's guide does (a ``tool_code`` block, a user turn of ``tool_output``
blocks) before the template renders them. gpt-oss's harmony template reads reasoning as ``thinking`` and ends a
calling turn with ``<|call|>``.
"""

from __future__ import annotations

import json
import re
from typing import Any

from searchrl.core.errors import DataError
from searchrl.envs.call_formats import PROMPTED

_MARK = "\u2063searchrl-stand-in\u2063"  # content no real turn contains (invisible separators around it)
_ZWSP = "\u200b"  # zero-width space: splits a special token's text in a tool result
# a role marker that opens a turn: <|user|>, <|observation|>, [INST]
_MARKER = re.compile(r"\s*(<\|[^|<>\s]{1,40}\|>|<[^<>\s]{1,40}>|\[[A-Z_]{1,40}\])")


class ChatFormat:
    def __init__(self, tokenizer: Any, template_kwargs: dict[str, Any] | None = None) -> None:
        """``template_kwargs``: passed to the template (Qwen3: ``enable_thinking``)."""
        if not getattr(tokenizer, "chat_template", None):
            raise DataError(
                f"the tool protocol renders prompts through the tokenizer's chat template; "
                f"{getattr(tokenizer, 'name_or_path', 'this tokenizer')!r} has none (DeepSeek-V3.2 ships none: copy "
                "searchrl/models/templates/deepseek_v32.jinja, its format as a template, into the model directory "
                "as chat_template.jinja)"
            )
        self.tokenizer, self.kwargs = tokenizer, dict(template_kwargs or {})
        from searchrl.envs.call_formats import FORMATS, detect

        found = detect(tokenizer.chat_template)
        # the call format the tool description teaches where the template renders no schemas (`render`); the
        # tool protocol and the agent endpoint set it to the format they read
        self.call_format = found if found in FORMATS else "hermes"
        self.takes_system = self._takes_system()
        self.renders_tools = self._renders_tools()
        # the stand-in form each kind of turn renders with (`_with_calls`), found once: every tool turn renders one
        self._forms: dict[tuple[bool, bool], int] = {}
        self._content_after_calls = False  # Gemma 4 writes a turn's content after its calls' results
        self.end_of_turn = self._end_of_turn()
        self.call_end = self._call_end()
        self.opens_think = self._opens_think()
        # Gemma 4 writes a tool's result between <|"|> delimiters: one in the result would close it
        quote = '<|"|>' if '<|"|>' in str(tokenizer.chat_template) else None
        self._specials = _special_pattern(tokenizer, quote)

    @classmethod
    def from_template(cls, template: str, template_kwargs: dict[str, Any] | None = None) -> ChatFormat:
        """A chat format from a template alone (no vocabulary): to render text before a tokenizer exists,
        e.g. the texts a local tokenizer is trained on."""
        from tokenizers import Tokenizer, models
        from transformers import PreTrainedTokenizerFast

        tok = PreTrainedTokenizerFast(
            tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
        )
        tok.chat_template = template
        return cls(tok, template_kwargs)

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        opened: bool = True,
    ) -> str:
        """``messages`` rendered with the tool schemas. A template that renders no schemas (DeepSeek's, whose
        model card has the user describe the tools in the system prompt) gets them described at the end of the
        system message in the words of `call_formats.describe`, in `call_format`."""
        if self.call_format in PROMPTED:  # no tool turns in the template (Gemma 3): written as its guide says
            messages = prompted(messages, self.call_format)
        if self.call_format == "gpt_oss":
            messages = _reasoning_as_thinking(messages)
        if tools and not self.renders_tools:
            messages = _with_tools_described(messages, tools, self.call_format)
        if not self.takes_system and messages and messages[0].get("role") == "system" and len(messages) > 1:
            # Gemma 2's template refuses a system message: it opens the first user turn, as Gemma 3's writes it
            system, first, *rest = messages
            messages = [
                {**first, "content": f"{_text(system.get('content'))}\n\n{_text(first.get('content'))}"},
                *rest,
            ]
        out = self.tokenizer.apply_chat_template(
            messages, tools=tools or None, tokenize=False, add_generation_prompt=opened, **self.kwargs
        )
        return str(out)

    def _takes_system(self) -> bool:
        """Whether the template renders a system message (Gemma 2's raises on one)."""
        try:
            self.tokenizer.apply_chat_template(
                [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}],
                tokenize=False,
                add_generation_prompt=True,
                **self.kwargs,
            )
        except Exception:
            return False
        return True

    def _renders_tools(self) -> bool:
        """Whether the template writes the tool schemas it is given (one that fails with them counts as
        writing them: the error comes where the prompt is rendered)."""
        user = [{"role": "user", "content": "q"}]
        probe = {
            "type": "function",
            "function": {"name": "probe_tool_x", "description": "", "parameters": {}},
        }
        try:
            with_tools = self.tokenizer.apply_chat_template(
                user, tools=[probe], tokenize=False, add_generation_prompt=True, **self.kwargs
            )
        except Exception:
            return True
        return "probe_tool_x" in str(with_tools)

    def prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> str:
        """The episode's prompt: ``messages`` with the tool schemas, the assistant turn opened."""
        return self.render(messages, tools)

    def _end_of_turn(self) -> str:
        """The text the template closes an assistant turn with (Qwen: ``<|im_end|>``), without the
        whitespace after it: what the model samples to end its turn. A template that writes nothing after the
        turn (GLM-4.5) ends it with the next turn's role marker, which the model samples as its end
        (``<|user|>`` after an answer; ``call_end`` after calls)."""
        user = {"role": "user", "content": "q"}
        text = self.render([user, {"role": "assistant", "content": _MARK}], opened=False)
        end = text[text.rfind(_MARK) + len(_MARK) :].strip()
        if end:
            return end
        nxt = self.render([user, {"role": "assistant", "content": _MARK}, {"role": "user", "content": "q2"}])
        marker = _MARKER.match(nxt[nxt.rfind(_MARK) + len(_MARK) :])
        if marker is None:
            raise DataError("the chat template writes nothing after an assistant turn: no end-of-turn marker")
        return marker.group(1)

    def _call_end(self) -> str:
        """What the model samples to end a turn that called tools: `end_of_turn` where the template closes
        such a turn with it (Qwen, Llama), else the marker that opens the tool messages after it (GLM-4.5's
        ``<|observation|>``)."""
        # harmony (gpt-oss): the call's message ends with <|call|>, which ends the turn
        if self.call_format == "gpt_oss":
            return "<|call|>"
        user = {"role": "user", "content": "q"}
        calls: list[tuple[str, dict[str, Any]]] = [("search", {})]
        try:
            closed = self._with_calls([user], calls, [STAND_IN_ID], [], opened=False)
        except Exception:  # a template that cannot render a call: refused when the tool protocol renders one
            return self.end_of_turn
        after = closed[closed.find(_MARK) + len(_MARK) :] if _MARK in closed else closed
        if self.end_of_turn in after:
            return self.end_of_turn
        tool = {"role": "tool", "name": "search", "content": "r", "tool_call_id": STAND_IN_ID}
        with_tool = self._with_calls([user], calls, [STAND_IN_ID], [tool])
        marker = _MARKER.match(with_tool[len(closed) :]) if with_tool.startswith(closed) else None
        if marker is None:  # Gemma 4 writes a turn's content after its calls: the marker closes the calls
            marker = _MARKER.fullmatch(after.rstrip())
        return marker.group(1) if marker else self.end_of_turn

    @property
    def ends(self) -> tuple[str, ...]:
        """Every text that ends a sampled turn: the stop strings of the tool protocol."""
        return (self.end_of_turn,) if self.call_end == self.end_of_turn else (self.end_of_turn, self.call_end)

    def turn_end(self, text: str) -> int:
        """Where the first end-of-turn marker of ``text`` starts (len(text) when none)."""
        found = [at for e in self.ends if (at := text.find(e)) >= 0]
        return min(found) if found else len(text)

    def _opens_think(self) -> bool:
        """Whether the generation prompt leaves a ``<think>`` open: the model's turn starts in its reasoning."""
        user = [{"role": "user", "content": "q"}]
        opened, closed = self.render(user), self.render(user, opened=False)
        tail = opened[len(closed) :] if opened.startswith(closed) else opened[opened.rfind("q") + 1 :]
        at = tail.rfind("<think>")
        return at >= 0 and "</think>" not in tail[at:]

    def escape(self, text: str) -> str:
        """``text`` (what a tool returned) with every special token's text broken up by a zero-width space,
        so that it tokenizes as text: a ``<|im_end|>`` in a document must not end the turn in the ids."""
        text = text.replace(_MARK, "")  # the stand-in's marker is ours alone
        if self._specials is None:
            return text
        return self._specials.sub(lambda m: m.group(0)[0] + _ZWSP + m.group(0)[1:], text)

    def after_tool_calls(
        self, calls: list[tuple[str, dict[str, Any]]], results: list[str], ids: list[str] | None = None
    ) -> str:
        """What the template writes after an assistant turn that made ``calls`` (name, arguments), up to
        the next assistant turn opened: the end of that turn (Qwen: a newline), the tool messages holding
        ``results`` (escaped: `escape`) and naming the calls' ``ids`` (Mistral's results do), and the
        generation prompt. The model's own end-of-turn token is not in it.

        The stand-in turn carries the calls' names with empty arguments: what the model wrote is already in
        the ids, and an argument holding the end-of-turn text must not end the stand-in early."""
        ids = ids or [f"{STAND_IN_ID[:-1]}{k % 10}" for k in range(len(calls))]
        tool_msgs = [
            {"role": "tool", "name": n, "content": self.escape(r), "tool_call_id": i}
            for (n, _), r, i in zip(calls, results, ids)
        ]
        user = [{"role": "user", "content": "q"}]
        start = -1
        if not self._content_after_calls:
            text = self._with_calls(user, calls, ids, tool_msgs)
            start = text.find(_MARK)
            # the content is written after the calls and their results (Gemma 4): the stand-in goes without
            self._content_after_calls = start >= 0 and text.find(self.call_end, start) < 0
        if self._content_after_calls:
            text, start = self._with_calls(user, calls, ids, tool_msgs, marked=False), -1
        if start < 0:  # the template drops a tool-calling turn's content: the turn starts after the prompt
            prompt = self.render([{"role": "user", "content": "q"}])
            start = len(prompt) if text.startswith(prompt) else -1
        at = text.find(self.call_end, start) if start >= 0 else -1
        if at < 0:
            raise DataError(f"the chat template did not close the assistant turn with {self.call_end!r}")
        return text[at + len(self.call_end) :]

    def _with_calls(
        self,
        before: list[dict[str, Any]],
        calls: list[tuple[str, dict[str, Any]]],
        ids: list[str],
        tool_msgs: list[dict[str, Any]],
        opened: bool = True,
        marked: bool = True,
    ) -> str:
        """``before``, a stand-in assistant turn making ``calls``, then ``tool_msgs``, rendered. The stand-in
        holds `_MARK` as its content where the template allows it (and ``marked``); a template that refuses
        content beside calls (Mistral's) gets none, one that takes one call per turn (Meta's Llama 3.1 / 3.2)
        gets the first, and one that joins the arguments as text (DeepSeek-V3's) gets them as JSON text. The form
        that rendered is tried first the next time."""
        contents = (_MARK, "") if marked else ("",)
        tries = [
            (made, content, text)
            for text in (False, True)
            for made in (calls, calls[:1])
            for content in contents
        ]
        key = (len(calls) > 1, marked)
        first = self._forms.get(key, 0)
        order = [first, *(i for i in range(len(tries)) if i != first)]

        def attempt(i: int) -> str:
            made, content, text = tries[i]
            out = self.render([*before, _stand_in(made, ids, content, text), *tool_msgs], opened=opened)
            self._forms[key] = i
            return out

        for i in order[:-1]:
            try:
                return attempt(i)
            except Exception:
                continue
        return attempt(order[-1])  # its error is the template's


STAND_IN_ID = "searchrl0"  # a call id of the length Mistral's templates require (nine letters or digits)


def _stand_in(
    calls: list[tuple[str, dict[str, Any]]], ids: list[str], content: str, text: bool = False
) -> dict[str, Any]:
    args: Any = "{}" if text else {}
    return {
        "role": "assistant",
        "content": content,
        "tool_calls": [
            {"id": i, "type": "function", "function": {"name": n, "arguments": args}}
            for (n, _), i in zip(calls, ids)
        ],
    }


def prompted(messages: list[dict[str, Any]], call_format: str) -> list[dict[str, Any]]:
    """``messages`` for a template with no tool turns (Gemma 3), as the family's function-calling guide writes
    them: an assistant turn's calls appended to its content as the model is prompted to write them (one
    ``tool_code`` block, `call_formats.tool_code`), and each run of tool messages one user turn of ``tool_output``
    blocks (merged with a user message after it, so the turns still alternate)."""
    from searchrl.envs.call_formats import OUTPUT_OPEN, tool_code, tool_outputs

    out: list[dict[str, Any]] = []
    results: list[str] = []
    for m in [*messages, None]:
        if m is not None and m.get("role") == "tool":
            results.append(_text(m.get("content")))
            continue
        if results:
            out.append({"role": "user", "content": tool_outputs(results)})
            results = []
        if m is None:
            break
        if m.get("role") == "assistant" and m.get("tool_calls"):
            calls = tool_code(
                [
                    (str(fn.get("name", "")), _arguments(fn.get("arguments")))
                    for c in m["tool_calls"]
                    if isinstance(fn := c.get("function", c), dict)
                ]
            )
            content = _text(m.get("content"))
            m = {k: v for k, v in m.items() if k != "tool_calls"}
            m["content"] = f"{content}\n{calls}" if content.strip() else calls
        if out and m.get("role") == out[-1]["role"] == "user" and out[-1]["content"].startswith(OUTPUT_OPEN):
            out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n\n{_text(m.get('content'))}"}
            continue
        out.append(m)
    return out


def _reasoning_as_thinking(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Harmony's template (gpt-oss) reads an assistant turn's reasoning from ``thinking``, where OpenAI clients send
    it back as ``reasoning_content``."""
    return [
        {**{k: v for k, v in m.items() if k != "reasoning_content"}, "thinking": m["reasoning_content"]}
        if m.get("reasoning_content") and "thinking" not in m
        else m
        for m in messages
    ]


def _text(content: Any) -> str:
    """A message's content as text (OpenAI content parts joined)."""
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def _arguments(raw: Any) -> dict[str, Any]:
    """A call's arguments as a mapping (OpenAI messages carry them as JSON text)."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError:
            return {}
    return raw if isinstance(raw, dict) else {}


def _with_tools_described(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]], call_format: str
) -> list[dict[str, Any]]:
    """``messages`` with the tools described after the system prompt (a system message made if none), as
    DeepSeek-V3.1's model card lays it out: ``{system prompt}\n\n{tool description}``."""
    from searchrl.envs.call_formats import describe

    text = describe(call_format, tools)
    if messages and messages[0].get("role") == "system" and isinstance(messages[0].get("content"), str):
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def _special_pattern(tokenizer: Any, extra: str | None = None) -> re.Pattern[str] | None:
    """A pattern matching the text of every special token the tokenizer parses out of text (its added
    tokens marked special: ``<|im_end|>``, ``<|eot_id|>``, …), longest first."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    texts = {
        str(t.content) for t in decoder.values() if getattr(t, "special", False) and len(str(t.content)) > 1
    }
    texts |= {str(t) for t in getattr(tokenizer, "all_special_tokens", ()) if len(str(t)) > 1}
    # DeepSeek's control tokens (<｜tool▁output▁end｜>, <｜User｜>) are added tokens its vocabulary does not mark
    # special; they are matched in text all the same
    texts |= {
        c for t in decoder.values() if (c := str(t.content)).startswith("<\uff5c") and c.endswith("\uff5c>")
    }
    texts |= {extra} if extra else set()
    if not texts:
        return None
    return re.compile("|".join(re.escape(t) for t in sorted(texts, key=len, reverse=True)))
