"""How a model family writes its tool calls, read back linearly and never raising (the tool protocol).

- ``hermes``: ``<tool_call>{"name": …, "arguments": {…}}</tool_call>``, one block per call (Qwen2.5, Qwen3,
  Hermes; `searchrl.envs.tools.parse_tool_calls`).
- ``qwen3_coder``: ``<tool_call><function=NAME><parameter=P>value</parameter>…</function></tool_call>``, the
  XML style of Qwen3-Coder and Qwen3.5. A parameter's value is text; where the tool's schema says it is a
  number, a boolean, an array or an object, it is read as JSON (as vLLM's ``qwen3_coder`` parser does), else
  kept as text.
- ``llama3_json``: the whole turn is one JSON object ``{"name": …, "parameters": {…}}`` (or several separated
  by ``;``), optionally after ``<|python_tag|>``: Llama 3.1-3.3's JSON tool calls. A turn that does not start
  with ``{`` is the final answer.
- ``mistral``: ``[TOOL_CALLS]`` then a JSON list of ``{"name": …, "arguments": {…}, "id": …}`` (Mistral's
  instruct models, Ministral, Mistral-Nemo: their tokenizer's control tokens, as `mistral-common` renders them).
  The id is the model's (nine letters or digits); the tool results name it (``call_id``), and a call written
  without a usable one gets one (`call_ids`).
- ``deepseek_v3`` and ``deepseek_v31``: DeepSeek's control tokens, ``<｜tool▁calls▁begin｜>`` then per call
  ``<｜tool▁call▁begin｜>…<｜tool▁call▁end｜>``, then ``<｜tool▁calls▁end｜>``. V3 and R1 (their template) write a call as
  ``function<｜tool▁sep｜>NAME`` and the arguments in a fenced JSON block (```` ```json ````), calls separated by a
  newline; V3.1 writes ``NAME<｜tool▁sep｜>ARGUMENTS``, calls chained. Either reads both. Neither template renders the
  tool schemas: the prompt describes them as DeepSeek-V3.1's model card does (`describe`).
- ``gemma4``: ``<|tool_call>call:NAME{key:value,…}<tool_call|>`` with bare keys and ``<|"|>``-delimited strings
  (Gemma 4). The model ends its calls with ``<|tool_response>``; the results follow in the same model turn.
- ``gemma3``: prompted, as Google's Gemma 3 function-calling guide describes (the model has no tool tokens and
  its template no tool turns): a call is a Python call with keyword arguments in a ```` ```tool_code ```` block,
  ``search(query="…")``, several calls one per line; the turn then ends (``<end_of_turn>``) and the results come
  back in the next user turn, each in a ```` ```tool_output ```` block (`searchrl.envs.chat_format.ChatFormat`
  writes the OpenAI tool messages so, and describes the tools in the system prompt). Arguments are read as Python
  literals (`ast.literal_eval`), never evaluated.
- ``gpt_oss``: OpenAI's harmony format (gpt-oss). The generation prompt opens ``<|start|>assistant``; the model
  may first write its reasoning (``<|channel|>analysis<|message|>…<|end|>``, then ``<|start|>assistant`` again),
  then either one call, `` to=functions.NAME<|channel|>commentary json<|message|>{…}`` ended by ``<|call|>`` (the
  recipient may also follow the channel: ``<|channel|>commentary to=functions.NAME <|constrain|>json``), or its
  answer, ``<|channel|>final<|message|>…`` ended by ``<|return|>``. Reasoning is not searched for calls, and the
  answer is the final channel's text (`harmony_answer`).
- ``deepseek_dsml``: DeepSeek V3.2's DSML, after the turn's content ``\n\n<｜DSML｜function_calls>`` then per call
  ``<｜DSML｜invoke name="NAME">`` with one ``<｜DSML｜parameter name="K" string="true|false">V</｜DSML｜parameter>`` per
  argument (a string as is, anything else as JSON), ``</｜DSML｜invoke>``, and ``</｜DSML｜function_calls>``; the
  turn ends with ``<｜end▁of▁sentence｜>``. DeepSeek ships no chat template for V3.2: `searchrl.models.deepseek`
  stores one, a Jinja port of its reference encoder (V4's ``tool_calls`` wrapper is read too).
- ``glm45``: ``<tool_call>NAME`` then ``<arg_key>K</arg_key>`` / ``<arg_value>V</arg_value>`` pairs, then
  ``</tool_call>`` (GLM-4.5, GLM-4.6; values typed by the tool's schema, as ``qwen3_coder``'s). Its template closes
  no turn: the model ends a calling turn with ``<|observation|>``, an answer with ``<|user|>``
  (`searchrl.envs.chat_format.ChatFormat.call_end`).

`detect` picks the family from the chat template's text. Every format reads a turn in time linear in its
length, and whatever a policy writes becomes calls that run or calls that say why they cannot
(`searchrl.envs.tools.ToolCall`). `write` renders a call as the family writes it (the scripted teacher's
turns, round-trip tests).

The templates of the two families without a copy in `searchrl.models.qwen` are in `LLAMA3_JSON_TEMPLATE` and
`QWEN3_CODER_TEMPLATE`: written here for the formats as their model cards describe them (system prompt with
the tool schemas, the calls, the tool results' turns), not copies of the vendors' files.
"""

from __future__ import annotations

import ast
import json
import re
import typing
from dataclasses import replace
from typing import Any

from searchrl.core.config import CallFormat
from searchrl.core.errors import DataError
from searchrl.envs.tools import CLOSE, OPEN, Tool, ToolCall, _loads, _one_call, parse_tool_calls

FORMATS: tuple[str, ...] = tuple(f for f in typing.get_args(CallFormat) if f != "auto")
MISTRAL_CALLS = "[TOOL_CALLS]"
# DeepSeek's control tokens (its vocabulary's added tokens; full-width bars, "▁" for a space)
DS_CALLS, DS_CALLS_END = "<\uff5ctool\u2581calls\u2581begin\uff5c>", "<\uff5ctool\u2581calls\u2581end\uff5c>"
DS_CALL, DS_CALL_END = "<\uff5ctool\u2581call\u2581begin\uff5c>", "<\uff5ctool\u2581call\u2581end\uff5c>"
DS_SEP = "<\uff5ctool\u2581sep\uff5c>"
# DeepSeek V3.2's DSML (markup around the full-width-barred "｜DSML｜", text, not control tokens): an invoke per call
DSML = "\uff5cDSML\uff5c"
DSML_CALLS, DSML_CALLS_END = f"<{DSML}function_calls>", f"</{DSML}function_calls>"
DSML_INVOKE, DSML_INVOKE_END = f"<{DSML}invoke", f"</{DSML}invoke>"
_DSML_NAME = re.compile(r'\s+name="([^"<>\n]{1,200})">')
DSML_PARAMETER, DSML_PARAMETER_END = f"<{DSML}parameter", f"</{DSML}parameter>"
_DSML_PARAMETER = re.compile(re.escape(DSML_PARAMETER) + r' name="([^"<>\n]{1,200})" string="(true|false)">')
# Gemma 4's: a call's block, and the delimiter of a string in its arguments (keys are bare)
GEMMA_CALL, GEMMA_CALL_END, GEMMA_QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
_GEMMA_STRING = re.compile(re.escape(GEMMA_QUOTE) + r"(.*?)" + re.escape(GEMMA_QUOTE), re.S)
_GEMMA_KEY = re.compile(r'"(?:\\.|[^"\\])*"|(?<=[{,])(\s*)([A-Za-z_][\w.-]*)(\s*):')
# OpenAI's harmony (gpt-oss): a call's recipient, the reasoning channel's messages, the markers of a message
HARMONY_TO, HARMONY_MESSAGE, HARMONY_FINAL = "to=functions.", "<|message|>", "<|channel|>final<|message|>"
_HARMONY_RECIPIENT = re.compile(r"to=functions\.([^\s<]{1,200})")
HARMONY_ANALYSIS = re.compile(r"<\|channel\|>analysis<\|message\|>.*?(<\|end\|>|$)", re.S)
_HARMONY_MARKERS = re.compile(r"<\|(start|end|return|call|channel|message|constrain)\|>(assistant)?")
# Gemma 3's prompted calls and results (Google's guide: ```tool_code / ```tool_output fences)
CODE_OPEN, OUTPUT_OPEN, FENCE = "```tool_code\n", "```tool_output\n", "```"
_MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")
_FUNCTION = re.compile(r"<function=([^>\n]{1,200})>(.*?)(?:</function>|\Z)", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]{1,200})>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.S)


# chat-template families whose tool calls the tool protocol does not read yet: refused, not read as Hermes
# (name: (family, a marker its template holds)); none at present
UNSUPPORTED: dict[str, tuple[str, str]] = {}
# chat-template families with no tool turns of their own: their calls are prompted (`describe`), and the tool
# messages are written as the guide of the family's vendor says (`searchrl.envs.chat_format.prompted`)
PROMPTED = ("gemma3",)


def detect(template: str | None) -> str:
    """The call format a chat template teaches (``hermes`` when it says nothing we know); one of
    `UNSUPPORTED`'s names for a family we know but do not read (`resolve` refuses it)."""
    text = template or ""
    if "<function=" in text and "<parameter=" in text:
        return "qwen3_coder"
    if "<arg_key>" in text and "<arg_value>" in text:
        return "glm45"
    if MISTRAL_CALLS in text:
        return "mistral"
    if DS_CALLS in text:
        return "deepseek_v3" if "```json" in text else "deepseek_v31"
    if GEMMA_CALL in text and "call:" in text:
        return "gemma4"
    if "<|channel|>" in text and "<|call|>" in text:
        return "gpt_oss"
    if "<start_of_turn>" in text:  # Gemma 2 and 3: no tool turns, calls prompted as Google's guide does
        return "gemma3"
    if DSML in text:
        return "deepseek_dsml"
    for name, (_, marker) in UNSUPPORTED.items():
        if marker in text:
            return name
    if (
        "<|start_header_id|>" in text
        and ('"parameters"' in text or "parameters" in text)
        and "<tool_call>" not in text
    ):
        return "llama3_json"
    return "hermes"


def resolve(call_format: str, template: str | None) -> str:
    """The call format to read: ``call_format`` itself, or for ``auto`` the chat template's (`detect`). A
    template of a family we do not read is refused, naming it, rather than read as Hermes."""
    if call_format != "auto":
        if call_format not in FORMATS:
            raise DataError(f"call_format must be auto or one of {', '.join(FORMATS)}, got {call_format!r}")
        return call_format
    found = detect(template)
    if found in UNSUPPORTED:
        raise DataError(
            f"the chat template writes tool calls in {UNSUPPORTED[found][0]}'s format, which the tool protocol "
            f"does not read yet (it reads {', '.join(FORMATS)}); set env.call_format to one of those if the "
            "model was trained to write it, or use a model of a supported family (Qwen2.5/Qwen3/Qwen3.5, Llama 3.1+, GLM-4.5, Mistral, DeepSeek V3 / R1 / V3.1 / V3.2, Gemma 3 / 4, gpt-oss)"
        )
    return found


def parse(fmt: str, text: str, tools: dict[str, Tool], limit: int | None = None) -> list[ToolCall]:
    """The turn's calls in format ``fmt`` (one of `FORMATS`)."""
    if fmt == "qwen3_coder":
        return _parse_xml(text, tools, limit)
    if fmt == "llama3_json":
        return _parse_llama(text, tools, limit)
    if fmt == "glm45":
        return parse_tool_calls(text, tools, limit, _glm_call)
    if fmt == "mistral":
        return _parse_mistral(text, tools, limit)
    if fmt in ("deepseek_v3", "deepseek_v31"):
        return parse_tool_calls(text, tools, limit, _deepseek_call, (DS_CALL, DS_CALL_END))
    if fmt == "gemma4":
        return parse_tool_calls(text, tools, limit, _gemma_call, (GEMMA_CALL, GEMMA_CALL_END))
    if fmt == "gemma3":
        return _parse_tool_code(text, tools, limit)
    if fmt == "gpt_oss":
        return _parse_harmony(HARMONY_ANALYSIS.sub("", text), tools, limit)
    if fmt == "deepseek_dsml":
        return parse_tool_calls(text, tools, limit, _dsml_call, (DSML_INVOKE, DSML_INVOKE_END))
    return parse_tool_calls(text, tools, limit)


def write(fmt: str, name: str, arguments: dict[str, Any]) -> str:
    """One call as the family writes it in an assistant turn."""
    if fmt == "qwen3_coder":
        params = "".join(
            f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
            for k, v in arguments.items()
        )
        return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"
    if fmt == "llama3_json":
        return json.dumps({"name": name, "parameters": arguments})
    if fmt == "mistral":  # as mistral-common renders a call; the id made from the call (nine characters)
        call = {"name": name, "arguments": arguments, "id": _made_id(f"{name}{json.dumps(arguments)}")}
        return f"{MISTRAL_CALLS}[{json.dumps(call, ensure_ascii=False)}]"
    if fmt == "glm45":  # as GLM-4.5's template writes a call (a string raw, anything else as JSON)
        pairs = "".join(
            f"<arg_key>{k}</arg_key>\n<arg_value>{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}</arg_value>\n"
            for k, v in arguments.items()
        )
        return f"{OPEN}{name}\n{pairs}{CLOSE}"
    if fmt == "deepseek_v3":  # as DeepSeek-V3's template writes a call
        body = f"function{DS_SEP}{name}\n```json\n{json.dumps(arguments, ensure_ascii=False)}\n```"
        return f"{DS_CALLS}{DS_CALL}{body}{DS_CALL_END}{DS_CALLS_END}"
    if fmt == "deepseek_v31":
        body = f"{name}{DS_SEP}{json.dumps(arguments, ensure_ascii=False)}"
        return f"{DS_CALLS}{DS_CALL}{body}{DS_CALL_END}{DS_CALLS_END}"
    if fmt == "gemma4":  # as Gemma 4's template writes a call: keys sorted and bare, strings in <|"|>
        return f"{GEMMA_CALL}call:{name}{_gemma_value(dict(arguments))}{GEMMA_CALL_END}"
    if fmt == "gemma3":
        return tool_code([(name, arguments)])
    if fmt == "deepseek_dsml":  # as DeepSeek's V3.2 encoder writes a calling turn's calls, after its content
        return f"\n\n{DSML_CALLS}\n{dsml_invoke(name, arguments)}\n{DSML_CALLS_END}"
    if (
        fmt == "gpt_oss"
    ):  # the template's layout, after the opened ``<|start|>assistant``; ``<|call|>`` ends it
        return f" {HARMONY_TO}{name}<|channel|>commentary json{HARMONY_MESSAGE}{json.dumps(arguments, ensure_ascii=False)}"
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments})}\n{CLOSE}"


def dsml_invoke(name: str, arguments: dict[str, Any]) -> str:
    """One DSML invoke as DeepSeek's V3.2 encoder writes it: a string parameter as is (``string="true"``),
    anything else as JSON."""
    params = "\n".join(
        f'<{DSML}parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
        f"{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}</{DSML}parameter>"
        for k, v in arguments.items()
    )
    return f'{DSML_INVOKE} name="{name}">\n{params}\n{DSML_INVOKE_END}'


def _dsml_call(body: str, tools: dict[str, Tool]) -> ToolCall:
    """One DSML invoke's body, `` name="NAME">`` then ``<｜DSML｜parameter name="K" string="true|false">V</…>``
    parameters: a string one's text as is, any other read as JSON (as DeepSeek's encoder decodes them). One
    forward scan (linear in the body's length); text between parameters is ignored, as the encoder's parser
    ignores it."""
    m = _DSML_NAME.match(body)
    if m is None:
        why = f'a call is {DSML_INVOKE} name="NAME"> with {DSML}parameter values, then {DSML_INVOKE_END}'
        return ToolCall(None, error="missing_name", detail=why)
    args: dict[str, Any] = {}
    pos = m.end()
    while (start := body.find(DSML_PARAMETER, pos)) >= 0:
        p = _DSML_PARAMETER.match(body, start)
        end = body.find(DSML_PARAMETER_END, p.end()) if p is not None else -1
        if p is None or end < 0:
            why = f'a parameter is {DSML_PARAMETER} name="K" string="true|false">V{DSML_PARAMETER_END}'
            return ToolCall(m.group(1)[:80], error="bad_arguments", detail=why)
        key, is_string, raw = p.group(1), p.group(2), body[p.end() : end]
        pos = end + len(DSML_PARAMETER_END)
        if key in args:
            return ToolCall(None, error="duplicate_key", detail=f"the parameter {key[:80]!r} is given twice")
        if is_string == "true":
            args[key] = raw
            continue
        value, bad = _loads(raw)
        if bad is not None:
            return bad
        args[key] = value
    return _one_call(json.dumps({"name": m.group(1), "arguments": args}, ensure_ascii=False), tools)


def call_ids(calls: list[ToolCall]) -> list[str]:
    """The id each call's result names: the model's own where it wrote a usable one (Mistral's nine letters or
    digits), else one made from the call's place in the turn, distinct from the others."""
    ids = [c.id if c.id is not None and _MISTRAL_ID.fullmatch(c.id) else None for c in calls]
    taken = {i for i in ids if i is not None}
    out = []
    for k, i in enumerate(ids):
        if i is None:
            i = _made_id(f"call{k}")
            while i in taken:
                i = _made_id(i)
        taken.add(i)
        out.append(i)
    return out


def _made_id(seed: str) -> str:
    import hashlib

    return hashlib.sha256(seed.encode("utf-8", "replace")).hexdigest()[:9]


def _parse_mistral(text: str, tools: dict[str, Tool], limit: int | None) -> list[ToolCall]:
    """The JSON list after ``[TOOL_CALLS]`` (one object is read as a list of one); a turn without the marker is
    an answer. Each call's ``id`` is kept."""
    at = text.find(MISTRAL_CALLS)
    if at < 0:
        return []
    body = text[at + len(MISTRAL_CALLS) :].strip()
    try:
        _, end = json.JSONDecoder().raw_decode(body)
    except (ValueError, RecursionError) as exc:
        why = f"the tool calls are not valid JSON ({str(exc)[:120]})"
        return [ToolCall(None, error="malformed_json", detail=why)]
    obj, bad = _loads(body[:end])  # the duplicate-key and text checks of every format
    if bad is not None:
        return [bad]
    items = obj if isinstance(obj, list) else [obj]
    if not items:
        return [
            ToolCall(
                None,
                error="missing_name",
                detail='[TOOL_CALLS] holds no call: [{"name": ..., "arguments": {...}}]',
            )
        ]
    calls: list[ToolCall] = []
    for item in items[: limit if limit is not None else len(items)]:
        call = _llama_call(json.dumps(item, ensure_ascii=False), item, tools)  # JSON calls' checks
        got = item.get("id") if isinstance(item, dict) else None
        calls.append(replace(call, id=got) if isinstance(got, str) and _MISTRAL_ID.fullmatch(got) else call)
    return _capped(calls, len(items) - len(calls), limit)


def _deepseek_call(body: str, tools: dict[str, Tool]) -> ToolCall:
    """One ``<｜tool▁call▁begin｜>`` block's body: V3's ``function<｜tool▁sep｜>NAME`` + a fenced JSON block, or
    V3.1's ``NAME<｜tool▁sep｜>JSON``."""
    head, sep, rest = body.partition(DS_SEP)
    if not sep:
        why = f"a call is NAME{DS_SEP}{{...arguments...}} inside {DS_CALL}...{DS_CALL_END}"
        return ToolCall(None, error="missing_name", detail=why)
    name, args = head.strip(), rest.strip()
    if name == "function" and not args.startswith("{"):  # V3: the type, then the name on its own line
        name, _, args = args.partition("\n")
        name, args = name.strip(), args.strip()
        if args.startswith("```"):
            args = args[3:].removeprefix("json").strip()
            args = args.removesuffix("```").rstrip()
    obj, bad = _loads(args or "{}")  # the duplicate-key and text checks of every format
    if bad is not None:
        return bad
    return _one_call(json.dumps({"name": name, "arguments": obj}, ensure_ascii=False), tools)


def _gemma_call(body: str, tools: dict[str, Tool]) -> ToolCall:
    """One ``<|tool_call>`` block's body, ``call:NAME{key:value,…}``: Gemma 4's arguments, whose keys are bare and
    whose strings sit between ``<|"|>`` delimiters, read as JSON (as transformers' response parser reads them:
    the strings taken out first, then the bare keys quoted)."""
    body = body.strip()
    if not body.startswith("call:") or "{" not in body:
        return ToolCall(
            None, error="missing_name", detail=f"a call is {GEMMA_CALL}call:NAME{{key:value}}{GEMMA_CALL_END}"
        )
    name, brace, args = body[len("call:") :].partition("{")
    obj, bad = gemma_arguments(brace + args)
    if bad is not None:
        return bad
    return _one_call(json.dumps({"name": name.strip(), "arguments": obj}, ensure_ascii=False), tools)


def gemma_arguments(text: str) -> tuple[Any, ToolCall | None]:
    """Gemma 4's ``{key:value,…}`` as JSON: the ``<|"|>`` strings taken out (NUL bytes dropped: they mark the
    places), the bare keys quoted, the strings put back; or the call that says why it cannot be read."""
    strings: list[str] = []

    def keep(m: re.Match[str]) -> str:
        strings.append(m.group(1))
        return f"\x00{len(strings) - 1}\x00"

    text = _GEMMA_STRING.sub(keep, text.replace("\x00", ""))
    text = _GEMMA_KEY.sub(
        lambda m: m.group(0) if m.group(2) is None else f'{m.group(1)}"{m.group(2)}"{m.group(3)}:', text
    )
    text = re.sub("\x00(\\d+)\x00", lambda m: json.dumps(strings[int(m.group(1))], ensure_ascii=False), text)
    return _loads(text)


def _gemma_value(value: Any) -> str:
    """A value as Gemma 4's template writes an argument (its ``format_argument`` with bare keys)."""
    if isinstance(value, str):
        return f"{GEMMA_QUOTE}{value}{GEMMA_QUOTE}"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_gemma_value(v)}" for k, v in sorted(value.items())) + "}"
    if isinstance(value, list | tuple):
        return "[" + ",".join(_gemma_value(v) for v in value) + "]"
    return str(value)


def describe(fmt: str, schemas: list[dict[str, Any]]) -> str:
    """The tool schemas and the call format in words, for a chat template that renders no schemas (DeepSeek's):
    the layout of DeepSeek-V3.1's model card (a ``## Tools`` section, each tool's name, description and JSON
    parameters, then the exact format of a call), which `ChatFormat` appends to the system prompt."""
    lines = ["## Tools", "You have access to the following tools:", ""]
    for schema in schemas:
        fn = schema.get("function", schema)
        lines += [f"### {fn.get('name', '')}", f"Description: {fn.get('description', '')}", ""]
        lines += [f"Parameters: {json.dumps(fn.get('parameters', {}), ensure_ascii=False)}", ""]
    if fmt in ("deepseek_v3", "deepseek_v31"):
        body = (
            f"function{DS_SEP}tool_call_name\n```json\ntool_call_arguments\n```"
            if fmt == "deepseek_v3"
            else f"tool_call_name{DS_SEP}tool_call_arguments"
        )
        chain = (
            "separate them with a newline"
            if fmt == "deepseek_v3"
            else "chain them directly without separators or spaces"
        )
        lines += [
            "IMPORTANT: ALWAYS adhere to this exact format for tool use:",
            f"{DS_CALLS}{DS_CALL}{body}{DS_CALL_END}{{{{additional_tool_calls}}}}{DS_CALLS_END}",
            "",
            "Where:",
            "- `tool_call_name` must be an exact match to one of the available tools",
            "- `tool_call_arguments` must be valid JSON that strictly follows the tool's Parameters specification",
            f"- For multiple tool calls, {chain}",
        ]
    elif fmt == "gemma3":  # Google's function-calling guide for Gemma 3, in our words
        lines += [
            "To use a tool, write a Python call of it with keyword arguments in a tool_code block, and nothing "
            "after the block:",
            write(fmt, "tool_call_name", {"parameter_name": "value"}),
            "",
            "Write one call per line for several calls. Each result comes back in a tool_output block. "
            "`tool_call_name` must be an exact match to one of the available tools and the arguments must follow "
            "that tool's Parameters specification.",
        ]
    else:
        lines += [
            "IMPORTANT: ALWAYS adhere to this exact format for tool use:",
            write(fmt, "tool_call_name", {"parameter_name": "value"}),
            "",
            "Where `tool_call_name` must be an exact match to one of the available tools and the arguments must "
            "follow that tool's Parameters specification.",
        ]
    return "\n".join(lines)


def _parse_harmony(text: str, tools: dict[str, Tool], limit: int | None) -> list[ToolCall]:
    """Every ``to=functions.NAME … <|message|>ARGS`` of a turn (its reasoning taken out), ARGS up to the message's
    end (``<|call|>``, ``<|end|>``, the next ``<|start|>``, or the turn's end: the stop string is cut off). Linear:
    each call's pieces are found by forward searches from where the last one ended."""
    calls: list[ToolCall] = []
    extra = pos = 0
    while (m := _HARMONY_RECIPIENT.search(text, pos)) is not None:
        name = m.group(1)
        at = text.find(HARMONY_MESSAGE, m.end())
        if at < 0:
            detail = f"a call is {HARMONY_TO}NAME<|channel|>commentary json{HARMONY_MESSAGE}{{...}}<|call|>"
            calls.append(ToolCall(None, error="unclosed_tool_call", detail=detail))
            break
        body_start = at + len(HARMONY_MESSAGE)
        ends = [e for t in ("<|call|>", "<|end|>", "<|start|>") if (e := text.find(t, body_start)) >= 0]
        end = min(ends) if ends else len(text)
        if limit is None or len(calls) < limit:
            obj, bad = _loads(text[body_start:end].strip() or "{}")
            calls.append(
                bad
                if bad is not None
                else _one_call(json.dumps({"name": name, "arguments": obj}, ensure_ascii=False), tools)
            )
        else:
            extra += 1
        pos = end
    return _capped(calls, extra, limit)


def harmony_answer(text: str) -> str:
    """A harmony turn's answer: its final channel's text (what follows the last ``<|channel|>final<|message|>``),
    else the turn without its reasoning; the format's markers taken out."""
    at = text.rfind(HARMONY_FINAL)
    text = text[at + len(HARMONY_FINAL) :] if at >= 0 else HARMONY_ANALYSIS.sub("", text)
    return _HARMONY_MARKERS.sub(" ", text)


def harmony_reasoning(text: str) -> str | None:
    """The text of a harmony turn's reasoning (its analysis messages, joined), or None."""
    found = [m.group(0)[len("<|channel|>analysis<|message|>") :] for m in HARMONY_ANALYSIS.finditer(text)]
    return "\n".join(f.removesuffix("<|end|>") for f in found) if found else None


def python_call(name: str, arguments: dict[str, Any]) -> str:
    """A call as Python writes it, ``name(key=value, …)``, each value a Python literal (Gemma 3's prompted calls)."""
    return f"{name}({', '.join(f'{k}={_py_literal(v)}' for k, v in arguments.items())})"


def _py_literal(value: Any) -> str:
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # a JSON string is a Python string literal
    if value is None or isinstance(value, bool | int | float):
        return repr(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_py_literal(str(k))}: {_py_literal(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_py_literal(v) for v in value) + "]"
    return _py_literal(str(value))


def tool_code(calls: list[tuple[str, dict[str, Any]]]) -> str:
    """Calls as Gemma 3 is prompted to write them: one ``tool_code`` block, a call per line."""
    return CODE_OPEN + "\n".join(python_call(n, a) for n, a in calls) + "\n" + FENCE


def tool_outputs(results: list[str]) -> str:
    """Tool results as Gemma 3's prompted format gives them back in the user turn: one fenced block each."""
    return "\n".join(f"{OUTPUT_OPEN}{r}\n{FENCE}" for r in results)


def _parse_tool_code(text: str, tools: dict[str, Tool], limit: int | None) -> list[ToolCall]:
    """Every call in the turn's ```` ```tool_code ```` blocks, in order: each line a Python call with keyword
    arguments, read with `ast` (literals only, nothing evaluated). A block left open is one more, invalid, call.
    Linear in the text: each block is found with one forward search for its closing fence."""
    calls: list[ToolCall] = []
    extra = pos = 0
    while (start := text.find(CODE_OPEN, pos)) >= 0:
        end = text.find(FENCE, start + len(CODE_OPEN))
        if end < 0:
            calls.append(
                ToolCall(
                    None,
                    error="unclosed_tool_call",
                    detail=f"a {CODE_OPEN.strip()} block is closed by {FENCE}",
                )
            )
            break
        for call in _code_calls(text[start + len(CODE_OPEN) : end], tools):
            if limit is None or len(calls) < limit:
                calls.append(call)
            else:
                extra += 1
        pos = end + len(FENCE)
    return _capped(calls, extra, limit)


def _code_calls(body: str, tools: dict[str, Tool]) -> list[ToolCall]:
    """One ``tool_code`` block's calls: ``name(key=literal, …)`` statements."""
    usage = "a call is NAME(key=value, ...), values Python literals, one call per line"
    try:
        tree = ast.parse(body.strip(), mode="exec")
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError) as exc:
        return [ToolCall(None, error="malformed_json", detail=f"not Python ({type(exc).__name__}); {usage}")]
    out: list[ToolCall] = []
    for stmt in tree.body:
        call = stmt.value if isinstance(stmt, ast.Expr) else None
        if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name):
            out.append(ToolCall(None, error="missing_name", detail=usage))
            continue
        name = call.func.id
        if call.args or any(k.arg is None for k in call.keywords):
            out.append(ToolCall(name if name in tools else None, error="bad_arguments", detail=usage))
            continue
        keys = [str(k.arg) for k in call.keywords]
        if len(set(keys)) < len(keys):  # the parser takes a repeated keyword (the compiler would refuse it)
            again = next(k for i, k in enumerate(keys) if k in keys[:i])
            out.append(ToolCall(None, error="duplicate_key", detail=f"argument {again!r} given twice"))
            continue
        try:
            args = {str(k.arg): ast.literal_eval(k.value) for k in call.keywords}
            obj = json.dumps({"name": name, "arguments": args}, ensure_ascii=False, allow_nan=False)
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError, OverflowError) as exc:
            out.append(ToolCall(None, error="bad_arguments", detail=f"{usage} ({type(exc).__name__})"))
            continue
        out.append(_one_call(obj, tools))
    return out or [ToolCall(None, error="missing_name", detail=usage)]


def _capped(calls: list[ToolCall], extra: int, limit: int | None) -> list[ToolCall]:
    if extra:
        detail = f"{extra} more tool call{'s' if extra > 1 else ''} not run: at most {limit} per turn"
        calls.append(ToolCall(None, error="too_many_calls", detail=detail))
    return calls


def _parse_xml(text: str, tools: dict[str, Tool], limit: int | None) -> list[ToolCall]:
    """``<tool_call>`` blocks holding ``<function=…>`` with ``<parameter=…>`` values (Qwen3-Coder)."""
    return parse_tool_calls(text, tools, limit, _xml_call)


def _xml_call(body: str, tools: dict[str, Tool]) -> ToolCall:
    m = _FUNCTION.search(body)
    if m is None:
        return ToolCall(
            None, error="missing_name", detail="a tool call is <function=NAME> with <parameter=…> values"
        )
    name = m.group(1).strip()
    if name not in tools:
        shown = name if len(name) <= 80 else name[:80] + "…"
        return ToolCall(shown, error="unknown_tool", detail=f"no tool {shown!r}; tools: {', '.join(tools)}")
    props = tools[name].parameters.get("properties", {})
    args: dict[str, Any] = {}
    for p in _PARAMETER.finditer(m.group(2)):
        key, raw = p.group(1).strip(), p.group(2)
        raw = raw[1:] if raw.startswith("\n") else raw
        raw = raw[:-1] if raw.endswith("\n") else raw
        if key in args:
            return ToolCall(None, error="duplicate_key", detail=f"the parameter {key[:80]!r} is given twice")
        args[key] = _typed(raw, props.get(key, {}))
    text = json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
    return _one_call(text, tools)  # the same checks (text, schema) as a JSON call


def _glm_call(body: str, tools: dict[str, Tool]) -> ToolCall:
    """A GLM-4.5 call's body: ``NAME`` then ``<arg_key>K</arg_key>`` / ``<arg_value>V</arg_value>`` pairs, each
    value read by its schema's type (`_typed`); one forward scan (linear in the body's length)."""
    first = body.find("<arg_key>")
    name = (body if first < 0 else body[:first]).strip()
    if not name or "\n" in name:
        return ToolCall(
            None,
            error="missing_name",
            detail="a tool call is <tool_call>NAME then <arg_key>/<arg_value> pairs",
        )
    if name not in tools:
        shown = name if len(name) <= 80 else name[:80] + "…"
        return ToolCall(shown, error="unknown_tool", detail=f"no tool {shown!r}; tools: {', '.join(tools)}")
    props = tools[name].parameters.get("properties", {})
    args: dict[str, Any] = {}
    pos = first
    while pos >= 0:
        k_end = body.find("</arg_key>", pos)
        v_start = body.find("<arg_value>", k_end) if k_end >= 0 else -1
        v_end = body.find("</arg_value>", v_start) if v_start >= 0 else -1
        if v_end < 0 or body[k_end + len("</arg_key>") : v_start].strip():
            return ToolCall(
                name,
                error="bad_arguments",
                detail="each <arg_key>K</arg_key> is followed by <arg_value>V</arg_value>",
            )
        key = body[pos + len("<arg_key>") : k_end].strip()
        if key in args:
            return ToolCall(None, error="duplicate_key", detail=f"the argument {key[:80]!r} is given twice")
        args[key] = _typed(body[v_start + len("<arg_value>") : v_end], props.get(key, {}))
        pos = body.find("<arg_key>", v_end)
    text = json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
    return _one_call(text, tools)  # the same checks (text, schema) as a JSON call


def _typed(raw: str, schema: dict[str, Any]) -> Any:
    """A parameter's text, read as JSON where its schema's type is not a string (kept as text if it is not
    JSON: the schema check then says what was expected)."""
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind else []
    if not kinds or "string" in kinds:
        return raw
    value, bad = _loads(raw.strip())
    return raw if bad is not None else value


def _parse_llama(text: str, tools: dict[str, Tool], limit: int | None) -> list[ToolCall]:
    """JSON objects at the start of the turn, separated by ``;`` (Llama 3's JSON tool calls)."""
    body = text.strip()
    body = body[len("<|python_tag|>") :].lstrip() if body.startswith("<|python_tag|>") else body
    if not body.startswith("{"):
        return []  # a final answer
    calls: list[ToolCall] = []
    extra = pos = 0
    decoder = json.JSONDecoder()
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except (ValueError, RecursionError) as exc:
            calls.append(
                ToolCall(
                    None, error="malformed_json", detail=f"the tool call is not valid JSON ({str(exc)[:120]})"
                )
            )
            break
        if limit is None or len(calls) < limit:
            calls.append(_llama_call(body[pos:end], obj, tools))
        else:
            extra += 1
        pos = end
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
        if pos < len(body) and body[pos] != "{":
            break  # text after the calls: read as nothing more
    return _capped(calls, extra, limit)


def _llama_call(raw: str, obj: Any, tools: dict[str, Tool]) -> ToolCall:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall(
            None, error="missing_name", detail='a tool call is {"name": ..., "parameters": {...}}'
        )
    again, bad = _loads(raw)  # the duplicate-key and text checks of every format
    if bad is not None:
        return bad
    args = again.get("parameters", again.get("arguments", {}))
    return _one_call(json.dumps({"name": again["name"], "arguments": args}, ensure_ascii=False), tools)


# A Llama 3.1-style template with JSON tool calls: the tool schemas in the first user turn, a call as the whole
# assistant turn ({"name", "parameters"}), results in ipython turns.
LLAMA3_JSON_TEMPLATE = """{{- bos_token if bos_token is defined else '' }}
{%- set system = messages[0]['content'] if messages[0]['role'] == 'system' else 'You are a helpful assistant.' %}
{%- set rest = messages[1:] if messages[0]['role'] == 'system' else messages %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + system + '<|eot_id|>' }}
{%- for message in rest %}
    {%- if message.role == 'user' %}
        {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' }}
        {%- if tools and loop.first %}
            {{- 'Given the following functions, please respond with a JSON for a function call with its proper arguments that best answers the given prompt.\\n\\nRespond in the format {"name": function name, "parameters": dictionary of argument name and its value}. Do not use variables.\\n\\n' }}
            {%- for t in tools %}
                {{- t | tojson(indent=4) + '\\n\\n' }}
            {%- endfor %}
        {%- endif %}
        {{- message.content + '<|eot_id|>' }}
    {%- elif message.role == 'assistant' and message.tool_calls %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
        {%- if message.content %}{{- message.content }}{%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- set call = tool_call.function if tool_call.function is defined else tool_call %}
            {{- '{"name": "' + call.name + '", "parameters": ' + (call.arguments | tojson) + '}' }}
            {%- if not loop.last %}{{- '; ' }}{%- endif %}
        {%- endfor %}
        {{- '<|eot_id|>' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}
    {%- elif message.role == 'tool' %}
        {{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# A Qwen3-Coder-style template: ChatML turns, the tool schemas in the system turn, calls as <function=…> with
# <parameter=…> values inside <tool_call>, results in <tool_response> blocks of a user turn.
QWEN3_CODER_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {{- messages[0]['content'] + '\\n\\n' if messages[0]['role'] == 'system' else '' }}
    {{- '# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>' }}
    {%- for t in tools %}
        {{- '\\n' + (t | tojson) }}
    {%- endfor %}
    {{- '\\n</tools>\\n\\nIf you choose to call a function, reply in the following format:\\n\\n<tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>\\nvalue_1\\n</parameter>\\n</function>\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- set call = tool_call.function if tool_call.function is defined else tool_call %}
            {{- '\\n<tool_call>\\n<function=' + call.name + '>\\n' }}
            {%- for key, value in call.arguments.items() %}
                {{- '<parameter=' + key + '>\\n' }}
                {{- value if value is string else (value | tojson) }}
                {{- '\\n</parameter>\\n' }}
            {%- endfor %}
            {{- '</function>\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
