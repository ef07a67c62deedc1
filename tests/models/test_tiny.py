import pytest
import torch

from searchrl.envs.tags import ALL_TAG_STRINGS
from searchrl.models import count_parameters, load_model_and_tokenizer


def test_tiny_model_loads_offline_and_tags_are_single_tokens(tiny_model_dir):
    model, tok = load_model_and_tokenizer(tiny_model_dir)
    assert model.config.model_type == "qwen2"
    assert 300_000 <= count_parameters(model) <= 700_000  # ~0.5M
    for tag in ALL_TAG_STRINGS:
        ids = tok(tag, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1, tag
    text = "<think> Found: Kozuk. </think>\n<search> Kozuk university </search>"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text  # byte-level BPE is lossless
    assert tok.eos_token == "<|endoftext|>" and tok.pad_token_id != tok.eos_token_id


def test_forward_and_generate(tiny_model_dir):
    model, tok = load_model_and_tokenizer(tiny_model_dir)
    enc = tok(["Question: Who directed Keve?\n"], return_tensors="pt")
    with torch.no_grad():
        out = model(**enc)
    assert out.logits.shape[-1] == len(tok) and torch.isfinite(out.logits).all()
    gen = model.generate(**enc, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
    assert gen.shape[1] <= enc["input_ids"].shape[1] + 5


def test_small_size_parameter_count(tmp_path, small_world, world_bm25):
    from searchrl.app.resources import tokenizer_texts
    from searchrl.envs.search import SearchEnv
    from searchrl.models.tiny import build_local_model

    texts = tokenizer_texts(small_world, SearchEnv(world_bm25, template="short"), teacher_examples=20)
    path = build_local_model("small", texts, tmp_path, seed=0, tags=ALL_TAG_STRINGS)
    model, _ = load_model_and_tokenizer(path)
    assert 500_000 <= count_parameters(model) <= 1_200_000  # ~0.8M with the 3072-token vocabulary
    deeper = build_local_model("small", texts, tmp_path / "l4", seed=0, tags=ALL_TAG_STRINGS, layers=4)
    model4, _ = load_model_and_tokenizer(deeper)
    assert model4.config.num_hidden_layers == 4 and model.config.num_hidden_layers == 2
    per_layer = sum(p.numel() for p in model.model.layers[0].parameters())
    assert count_parameters(model4) == count_parameters(model) + 2 * per_layer
    with pytest.raises(ValueError, match="model.layers must be at least 1"):
        build_local_model("small", texts, tmp_path / "l0", layers=0)


def test_bad_paths_and_sizes(tmp_path):
    from searchrl.models.tiny import build_local_model

    with pytest.raises(ValueError, match="unknown model size 'huge'; valid: tiny, small, base"):
        build_local_model("huge", ["x"], tmp_path)
    f = tmp_path / "file.bin"
    f.write_text("x")
    with pytest.raises(ValueError, match="is a file; pass the directory"):
        load_model_and_tokenizer(f)


@pytest.mark.parametrize(
    "size, params, rows, tied",
    [
        # Qwen2.5's model cards: 0.49B, 1.54B and 7.61B parameters (7B: untied output layer, 152,064 rows)
        ("qwen2.5-0.5b", 494_032_768, 151_936, True),
        ("qwen2.5-1.5b", 1_543_714_304, 151_936, True),
        ("qwen2.5-7b", 7_615_616_512, 152_064, False),
    ],
)
def test_qwen_shapes_match_the_published_models(qwen_tok, size, params, rows, tied):
    """Built on the meta device (no memory): parameter count, embedding rows and tying as Qwen2.5's."""
    from searchrl.models.qwen import end_of_turn_ids
    from searchrl.models.tiny import SIZES, build_model

    with torch.device("meta"):
        model = build_model(
            SIZES[size], qwen_tok, vocab_rows=SIZES[size].vocab_size, eos_ids=end_of_turn_ids(qwen_tok)
        )
    assert count_parameters(model) == params
    assert model.get_input_embeddings().weight.shape[0] == rows
    assert (model.lm_head.weight is model.get_input_embeddings().weight) == tied


def test_a_model_is_saved_in_the_dtype_asked(tmp_path):
    from safetensors import safe_open

    from searchrl.models.tiny import build_local_model

    out = build_local_model("tiny", [], tmp_path / "m", tokenizer="qwen2.5", layers=1, dtype="bfloat16")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}  # noqa: SIM118 (safe_open is not iterable)
    with pytest.raises(Exception, match="unknown dtype"):
        build_local_model("tiny", [], tmp_path / "x", tokenizer="qwen2.5", dtype="int8")


def test_build_model_command_with_qwens_vocabulary(tmp_path, capsys):
    """`searchrl build-model` at a Qwen shape needs no world: Qwen2.5's tokenizer by default for the qwen sizes,
    any size with --tokenizer, weights saved in --dtype; a device to build on that is not a real one is refused."""
    import json

    from searchrl.app.cli import main

    args = ["build-model", "--size", "tiny", "--tokenizer", "qwen2.5"]
    main([*args, "--dtype", "bfloat16", "--out", str(tmp_path / "m")])
    card = json.loads((tmp_path / "m" / "searchrl_model.json").read_text())
    assert card["tokenizer"] == "qwen2.5" and card["size"] == "tiny"
    model, tok = load_model_and_tokenizer(tmp_path / "m")
    assert model.get_input_embeddings().weight.shape[0] == 151_936 and len(tok) > 150_000
    with pytest.raises(SystemExit):
        main([*args, "--device", "meta", "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert "unknown device 'meta'" in err and "valid: cpu, cuda" in err
