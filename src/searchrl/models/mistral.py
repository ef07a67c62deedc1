"""Mistral's tokenizers (Mistral-Nemo, Ministral, Pixtral's text side: the ``tekken`` vocabularies), offline, from
`mistral-common` (Apache-2.0), Mistral's own reference renderer, which ships the vocabulary files and writes the
chat template for each tokenizer version (`mistral_common.integrations.chat_templates`, from 1.10 on): the
template for tekken version 3 is stored in ``templates/mistral_tekken_v3.jinja`` as mistral-common 1.13.1 wrote it
(kept, not regenerated: mistral-common 1.10+ caps numpy below 2.4 on Python 3.12 and older, our tested set has
2.4, so the tests run on 1.9.1's vocabulary and encoder). Converted to a `PreTrainedTokenizerFast` by transformers'
``MistralConverter``; its ids for a rendered conversation equal mistral-common's ``encode_chat_completion``
(tests/envs/test_mistral.py).

The format (tokenizer version 3 with tools): ``<s>[AVAILABLE_TOOLS][…schemas…][/AVAILABLE_TOOLS][INST]system\\n\\n
question[/INST]``, a calling turn ``[TOOL_CALLS][{"name", "arguments", "id"}]</s>``, each result
``[TOOL_RESULTS]{"content", "call_id"}[/TOOL_RESULTS]`` with the next turn generated right after it, an answer
``…</s>``. The tool schemas and the system prompt are rendered before the *last* user message, so a new user turn
re-renders the earlier ones: a conversation that adds a user turn is not an append-only extension (the agent
endpoint starts a new row of the episode there, `rollout.agent_program`); a tool loop never adds one.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from searchrl.core.errors import SearchRLError

VOCABULARIES = {"mistral-tekken": "tekken_240911.json"}  # what `searchrl tokenizer` can build
# the chat template mistral-common writes for that vocabulary (its version and licence in the file's first lines)
TEMPLATE = Path(__file__).parent / "templates" / "mistral_tekken_v3.jinja"


def vocabulary_file(name: str = "mistral-tekken") -> Path:
    """The vocabulary file mistral-common ships for ``name``."""
    try:
        import mistral_common
    except ImportError as e:
        raise SearchRLError(
            "Mistral's tokenizer comes from mistral-common: pip install 'searchrl[mistral]' (or mistral-common)"
        ) from e
    if name not in VOCABULARIES:
        raise SearchRLError(f"unknown Mistral vocabulary {name!r}; valid: {', '.join(VOCABULARIES)}")
    return Path(mistral_common.__file__).parent / "data" / VOCABULARIES[name]


def _default_specials() -> list[dict[str, Any]]:
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer

    return [
        {
            "rank": t["rank"],
            "token_str": str(getattr(t["token_str"], "value", t["token_str"])),
            "is_control": True,
        }
        for t in Tekkenizer.DEPRECATED_SPECIAL_TOKENS
    ]


def mistral_tokenizer(out: str | Path | None = None, name: str = "mistral-tekken") -> Any:
    """Mistral's tekken tokenizer with its chat template as a `PreTrainedTokenizerFast` (saved to ``out`` when
    given). Offline."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.mistral.tokenizer import MistralConverter

    vocab = vocabulary_file(name)
    with tempfile.TemporaryDirectory() as tmp:  # the converter reads a file named tekken.json
        raw = json.loads(vocab.read_text())
        # an early tekken file names no control tokens: mistral-common's defaults are written into the copy
        # (transformers reads them from mistral-common only at 1.11.5 or later)
        if "special_tokens" not in raw:
            raw["special_tokens"] = _default_specials()
        (Path(tmp) / "tekken.json").write_text(json.dumps(raw))
        converted = MistralConverter(str(Path(tmp) / "tekken.json")).converted()
    hf = PreTrainedTokenizerFast(
        tokenizer_object=converted,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=131072,
        clean_up_tokenization_spaces=False,
    )
    hf.chat_template = TEMPLATE.read_text()
    if out is not None:
        hf.save_pretrained(str(out))
    return hf
