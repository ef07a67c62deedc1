"""Small Qwen2-architecture models and byte-level BPE tokenizers, built locally (no hub access).

The caller's tag strings (`envs.tags.ALL_TAG_STRINGS`) become single special tokens, so stop-at-tag generation
and loss masks work on token ids. Everything is saved in Hugging Face format and loads with
``from_pretrained``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from searchrl.core.errors import DataError

EOS, PAD = "<|endoftext|>", "<|pad|>"
CHAT_TOKENS = ("<|im_start|>", "<|im_end|>")
SPECIAL_TOKENS: tuple[str, ...] = (EOS, PAD, *CHAT_TOKENS)  # then the caller's tags


@dataclass(frozen=True)
class ModelSize:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int  # tokenizer vocabulary (merges included)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True


SIZES: dict[str, ModelSize] = {
    # ~0.5M parameters: unit and integration tests.
    "tiny": ModelSize(96, 2, 4, 2, 256, vocab_size=2048),
    # ~0.8M parameters: the embedded default; learns the synthetic world on 2 CPU cores in minutes
    # (about 18k training tokens/s there, against 4k for `base`). Every name of the quickstart world is one token.
    "small": ModelSize(128, 2, 4, 2, 352, vocab_size=3072),
    # ~4M parameters: more capacity for longer CPU runs.
    "base": ModelSize(256, 4, 4, 2, 688, vocab_size=4096),
    # Qwen2.5-0.5B's shape (random weights): realistic memory and time on a CPU. Qwen2.5 tokenizer only.
    "qwen2.5-0.5b": ModelSize(896, 24, 14, 2, 4864, vocab_size=151936, max_position_embeddings=32768),
    # Qwen2.5-1.5B's and -7B's shapes (1.54B and 7.62B parameters): GPU step time and memory at real sizes.
    "qwen2.5-1.5b": ModelSize(1536, 28, 12, 2, 8960, vocab_size=151936, max_position_embeddings=32768),
    "qwen2.5-7b": ModelSize(
        3584, 28, 28, 4, 18944, vocab_size=152064, max_position_embeddings=32768, tie_word_embeddings=False
    ),
}
TOKENIZERS = (
    "local",
    "qwen2.5",
    "qwen3",
)  # a tokenizer trained on the world (tags are tokens), or a Qwen one


def train_tokenizer(
    texts: Iterable[str], vocab_size: int, out_dir: str | Path | None = None, tags: Sequence[str] = ()
):
    """Byte-level BPE (lossless on any text) with every string of ``tags`` as one special token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(dict.fromkeys([*SPECIAL_TOKENS, *tags])),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD, padding_side="left")
    if out_dir is not None:
        hf.save_pretrained(str(out_dir))
    return hf


def build_model(
    size: str | ModelSize,
    tokenizer,
    seed: int = 0,
    vocab_rows: int | None = None,
    eos_ids: Iterable[int] | None = None,
):
    """A randomly initialised Qwen2ForCausalLM matching ``tokenizer`` (``vocab_rows`` embedding rows, at
    least one per token; Qwen2.5 models have 151,936), ending generation at ``eos_ids`` (default: the
    tokenizer's EOS)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    spec = SIZES[size] if isinstance(size, str) else size
    eos = sorted(eos_ids) if eos_ids is not None else [tokenizer.eos_token_id]
    cfg = Qwen2Config(
        vocab_size=max(len(tokenizer), vocab_rows or 0),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        # Qwen2.5's RoPE base (1e6) for the Qwen shape; the small local models keep the default 1e4
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1e6 if spec.max_position_embeddings > 2048 else 1e4,
        },
        eos_token_id=eos[0] if len(eos) == 1 else eos,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(cfg)


def build_local_model(
    size: str,
    texts: Iterable[str],
    out_dir: str | Path,
    seed: int = 0,
    tokenizer: str = "local",
    tags: Sequence[str] = (),
    layers: int | None = None,
    chat_template: str | None = None,
    extra_vocab: int = 0,
    dtype: str = "float32",
    device: str = "cpu",
) -> Path:
    """Build a model of ``size`` with a tokenizer and save both to ``out_dir``. ``tokenizer``: ``local``
    trains one on ``texts``, every string of ``tags`` one special token (pass `envs.tags.ALL_TAG_STRINGS`);
    ``qwen2.5`` is Qwen2.5's real vocabulary (tags are text; ``texts`` and ``tags`` are not read).
    ``layers``: that many transformer layers instead of the size's. ``chat_template``: the local tokenizer's
    (the tool protocol renders prompts through it); Qwen's tokenizers bring their own. ``extra_vocab``: that
    many more tokens than the size's vocabulary (local tokenizer only). ``dtype``: the saved weights' (bfloat16
    halves a 7B shape's 30 GB); ``device``: where the random weights are drawn (``cuda`` initialises a 7B
    shape in seconds where a CPU takes minutes)."""
    import torch

    if size not in SIZES:
        raise DataError(f"unknown model size {size!r}; valid: {', '.join(SIZES)}")
    if layers is not None and layers < 1:
        raise DataError(f"model.layers must be at least 1, got {layers}")
    spec = SIZES[size] if layers is None else replace(SIZES[size], num_hidden_layers=layers)
    if extra_vocab and tokenizer == "local":
        spec = replace(spec, vocab_size=spec.vocab_size + extra_vocab)
    if tokenizer not in TOKENIZERS:
        raise DataError(f"unknown tokenizer {tokenizer!r}; valid: {', '.join(TOKENIZERS)}")
    if size.startswith("qwen") and tokenizer == "local":
        raise DataError(f"model size {size!r} has Qwen2.5's vocabulary: set model.tokenizer: qwen2.5")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise DataError(f"unknown dtype {dtype!r}; valid: float32, bfloat16, float16")
    try:
        kind = torch.device(device).type
    except RuntimeError:
        kind = device
    if kind not in ("cpu", "cuda"):
        raise DataError(f"unknown device {device!r} to build the model on; valid: cpu, cuda, cuda:N")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with torch.device(device):
        if tokenizer == "local":
            tok = train_tokenizer(texts, spec.vocab_size, tags=tags)
            if chat_template is not None:
                tok.chat_template = chat_template
            model = build_model(spec, tok, seed=seed)
        else:
            from searchrl.models.qwen import VOCAB_ROWS, end_of_turn_ids, qwen_tokenizer

            tok = qwen_tokenizer(name=tokenizer)
            rows = spec.vocab_size if size.startswith("qwen") else VOCAB_ROWS  # 7B: 152,064 rows
            model = build_model(spec, tok, seed=seed, vocab_rows=rows, eos_ids=end_of_turn_ids(tok))
    model = model.to(getattr(torch, dtype))
    tok.save_pretrained(str(out))
    model.save_pretrained(str(out))
    card = {"size": size, "seed": seed, "tokenizer": tokenizer, **asdict(spec)}
    (out / "searchrl_model.json").write_text(json.dumps(card, indent=1), encoding="utf-8")
    return out


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())
