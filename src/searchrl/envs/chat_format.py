"""A tokenizer's chat template as the tool protocol uses it: the prompt (system and user turns, the tool
schemas, the assistant turn opened), and the text that follows an assistant turn that called tools (the
tool messages, then the next assistant turn opened).

The conversation is never re-rendered (docs/design.md §4.11): the tool messages' text is cut out of a rendering of a
stand-in conversation, after the stand-in assistant turn's end-of-turn marker, so it is exactly what the
template writes there, and it is appended after what the model sampled. Templates that rewrite earlier
assistant turns (Qwen3 drops or re-spaces reasoning, re-serialises tool-call JSON) cannot change the past.
"""

from __future__ import annotations

from typing import Any

from searchrl.core.errors import DataError

_MARK = "\u2063searchrl-stand-in\u2063"  # content no real turn contains (invisible separators around it)


class ChatFormat:
    def __init__(self, tokenizer: Any, template_kwargs: dict[str, Any] | None = None) -> None:
        """``template_kwargs``: passed to the template (Qwen3: ``enable_thinking``)."""
        if not getattr(tokenizer, "chat_template", None):
            raise DataError(
                f"the tool protocol renders prompts through the tokenizer's chat template; "
                f"{getattr(tokenizer, 'name_or_path', 'this tokenizer')!r} has none"
            )
        self.tokenizer, self.kwargs = tokenizer, dict(template_kwargs or {})
        self.end_of_turn = self._end_of_turn()

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
        out = self.tokenizer.apply_chat_template(
            messages, tools=tools or None, tokenize=False, add_generation_prompt=opened, **self.kwargs
        )
        return str(out)

    def prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> str:
        """The episode's prompt: ``messages`` with the tool schemas, the assistant turn opened."""
        return self.render(messages, tools)

    def _end_of_turn(self) -> str:
        """The text the template closes an assistant turn with (Qwen: ``<|im_end|>``), without the
        whitespace after it: what the model samples to end its turn."""
        text = self.render(
            [{"role": "user", "content": "q"}, {"role": "assistant", "content": _MARK}], opened=False
        )
        end = text[text.rfind(_MARK) + len(_MARK) :].strip()
        if not end:
            raise DataError("the chat template writes nothing after an assistant turn: no end-of-turn marker")
        return end

    def after_tool_calls(self, calls: list[tuple[str, dict[str, Any]]], results: list[str]) -> str:
        """What the template writes after an assistant turn that made ``calls`` (name, arguments), up to
        the next assistant turn opened: the end of that turn (Qwen: a newline), the tool messages holding
        ``results``, and the generation prompt. The model's own end-of-turn token is not in it."""
        stand_in = {
            "role": "assistant",
            "content": _MARK,
            "tool_calls": [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls],
        }
        tool_msgs = [{"role": "tool", "name": n, "content": r} for (n, _), r in zip(calls, results)]
        text = self.render([{"role": "user", "content": "q"}, stand_in, *tool_msgs])
        at = text.find(self.end_of_turn, text.rfind(_MARK))
        if at < 0:
            raise DataError(f"the chat template did not close the assistant turn with {self.end_of_turn!r}")
        return text[at + len(self.end_of_turn) :]
