import itertools

import pytest
import torch

from searchrl.models import load_model_and_tokenizer
from searchrl.rollout.generator import SamplingParams
from searchrl.rollout.hf import HFGenerator, _draw, _top_p, last_logits_only


@pytest.fixture(scope="module")
def model_tok(tiny_model_dir):
    model, tok = load_model_and_tokenizer(tiny_model_dir)
    return model.eval(), tok


def test_greedy_matches_hf_generate_with_left_padding(model_tok):
    """KV cache, left padding and position ids are right: greedy output equals HF generate per prompt."""
    model, tok = model_tok
    prompts = [
        tok("Question: Who directed Keve?\n")["input_ids"],
        tok("Question: x\n<think>")["input_ids"],
        tok("Hi")["input_ids"],
    ]
    gen = HFGenerator(model, tok, stop_strings=())
    outs = gen.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=12))
    for p, o in zip(prompts, outs):
        ref = model.generate(
            torch.tensor([p]),
            max_new_tokens=12,
            do_sample=False,
            pad_token_id=tok.pad_token_id,
            eos_token_id=None,
        )[0, len(p) :].tolist()
        assert o.token_ids == ref[: len(o.token_ids)] and o.finish in ("length", "eos")


def test_logprobs_equal_a_recompute(model_tok):
    from searchrl.core.functional import token_logprobs

    model, tok = model_tok
    torch.manual_seed(0)
    prompts = [tok("Question: a b c\n")["input_ids"], tok("Q\n")["input_ids"]]
    outs = HFGenerator(model, tok).generate(prompts, SamplingParams(temperature=0.7, max_new_tokens=10))
    for p, o in zip(prompts, outs):
        ids = torch.tensor([p + o.token_ids])
        with torch.no_grad():
            lp = token_logprobs(model(input_ids=ids).logits, ids, temperature=0.7)[0, len(p) :]
        assert torch.allclose(lp, torch.tensor(o.logprobs), atol=1e-4)


class Scripted(torch.nn.Module):
    """Next token = a fixed function of the row's last input token (stateless, so finished rows can be
    dropped from the batch), for exact stop tests."""

    def __init__(self, next_of, vocab):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.next_of, self.vocab = next_of, vocab

    def forward(
        self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=True
    ):
        logits = torch.full((input_ids.shape[0], input_ids.shape[1], self.vocab), -1e9)
        for b in range(input_ids.shape[0]):
            logits[b, -1, self.next_of[int(input_ids[b, -1])]] = 0.0
        cache = past_key_values if past_key_values is not None else _NoCache()
        return type("Out", (), {"logits": logits, "past_key_values": cache})()


class _NoCache:
    def batch_select_indices(self, indices):
        pass


def chain(*seq):
    return dict(itertools.pairwise(seq))


def test_stops_exactly_at_tag_eos_or_length(model_tok):
    _, tok = model_tok
    stop = tok.convert_tokens_to_ids("</search>")
    ans = tok.convert_tokens_to_ids("</answer>")
    eos = tok.eos_token_id
    nxt = {
        **chain(1, 20, 21, stop, 22),
        **chain(2, 30, ans, 31),
        **chain(3, 40, eos, 41),
        **chain(4, 50, 51, 52, 53, 54),
    }
    gen = HFGenerator(Scripted(nxt, len(tok)), tok, stop_strings=("</search>", "</answer>"))
    outs = gen.generate([[1], [9, 2], [3], [4]], SamplingParams(temperature=0.0, max_new_tokens=4))
    assert [o.token_ids for o in outs] == [[20, 21, stop], [30, ans], [40, eos], [50, 51, 52, 53]]
    assert [o.finish for o in outs] == ["stop", "stop", "eos", "length"]


def test_multi_token_stop_strings_are_matched_on_text(model_tok):
    _, tok = model_tok
    ids = tok("zq</stop>", add_special_tokens=False)["input_ids"]
    assert len(ids) > 1 and len(set(ids)) == len(ids)
    nxt = {**chain(1, *ids), ids[-1]: 7, 7: 7}
    gen = HFGenerator(Scripted(nxt, len(tok)), tok, stop_strings=("</stop>",))
    [out] = gen.generate([[1]], SamplingParams(temperature=0.0, max_new_tokens=20))
    assert out.finish == "stop" and out.token_ids == ids


def test_draws_follow_each_rows_distribution():
    """Inverse-CDF sampling: frequencies match each row's probabilities (4 standard errors), tokens of zero
    mass (nucleus-filtered, -inf) are never drawn, and a one-hot row always gives its token."""
    logp = torch.log_softmax(torch.tensor([[0.0, 1.0, 2.0, -1.0, 0.5], [3.0, 0.0, 0.0, 0.0, 0.0]]), -1)
    logp[0, 3] = float("-inf")
    logp = torch.log_softmax(logp, -1)
    one_hot = torch.full((1, 5), float("-inf"))
    one_hot[0, 4] = 0.0
    n = 40_000
    rows = torch.cat([logp.repeat_interleave(n, 0), one_hot.repeat(100, 1)])
    torch.manual_seed(0)
    tok = _draw(rows)
    for r in range(2):
        freq = torch.bincount(tok[r * n : (r + 1) * n], minlength=5).double() / n
        p = logp[r].exp().double()
        assert ((freq - p).abs() <= 4 * (p * (1 - p) / n).sqrt() + 1e-12).all(), (freq, p)
    assert (tok[:n] != 3).all() and (tok[2 * n :] == 4).all()


def test_prefill_keeps_only_the_last_logits_where_the_model_allows(model_tok):
    """A prefill builds (rows, 1, vocabulary) logits for transformers' models, under peft too; a model whose
    forward does not take ``logits_to_keep`` gets none (and returns every position)."""
    from peft import LoraConfig, get_peft_model

    model, tok = model_tok
    assert last_logits_only(model) == {"logits_to_keep": 1}
    peft = get_peft_model(
        load_model_and_tokenizer(model.name_or_path)[0], LoraConfig(r=2, target_modules=["q_proj"])
    )
    assert last_logits_only(peft) == {"logits_to_keep": 1}
    assert last_logits_only(Scripted({}, 8)) == {}
    gen = HFGenerator(model, tok)
    out, _, _ = gen._prefill(model, [tok("Question: a b c\n")["input_ids"]] * 2, [None, None])
    assert out.logits.shape[:2] == (2, 1)


def test_top_p_keeps_the_nucleus():
    logp = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = _top_p(logp, 0.75).exp()
    assert kept[0, :2].tolist() == pytest.approx([0.5, 0.3]) and kept[0, 2:].tolist() == [0.0, 0.0]
    assert torch.equal(_top_p(logp, 1.0), logp)


def test_kv_reuse_across_turns_matches_a_fresh_prefill(model_tok):
    """Turn 2 under a cache key prefills only the new tail, and gives what a full prefill gives."""
    model, tok = model_tok
    stop = tok.convert_tokens_to_ids("</search>")
    prompts = [tok("Question: Who directed Keve?\n")["input_ids"], tok("Q: x\n<think> a b c")["input_ids"]]
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    gen = HFGenerator(model, tok, stop_strings=("</search>",))
    gen.stop_ids = set(range(len(tok))) - {tok.eos_token_id}  # every token stops: rows end after 1 token
    keys = ["a", "b"]
    first = gen.generate(prompts, params, keys)
    assert all(o.finish == "stop" for o in first) and set(gen._saved) == {"a", "b"}
    obs = [tok(" <information> doc one </information>\n")["input_ids"], [stop, stop, 5]]
    turn2 = [p + o.token_ids + x for p, o, x in zip(prompts, first, obs)]
    gen.stop_ids = {stop}
    reused = gen.generate(turn2, params, keys)
    assert gen.reused_tokens == sum(len(p) for p in prompts)  # prompt + the fed part of turn 1 (nothing)
    fresh = HFGenerator(model, tok, stop_strings=("</search>",)).generate(turn2, params)
    for r, f in zip(reused, fresh):
        assert r.token_ids == f.token_ids
        assert torch.allclose(torch.tensor(r.logprobs), torch.tensor(f.logprobs), atol=1e-4)
    assert "a" not in gen._saved or gen._saved["a"].tokens[: len(turn2[0])] == turn2[0]
    gen.release()
    assert gen._saved == {}


def test_a_stale_cache_key_falls_back_to_a_full_prefill(model_tok):
    model, tok = model_tok
    gen = HFGenerator(model, tok)
    gen.stop_ids = set(range(len(tok))) - {tok.eos_token_id}
    params = SamplingParams(temperature=0.0, max_new_tokens=4)
    gen.generate([tok("Question: a\n")["input_ids"]], params, ["k"])
    other = tok("Something else entirely\n")["input_ids"]  # does not extend the cached tokens
    gen.stop_ids = set()
    [r] = gen.generate([other], params, ["k"])
    assert gen.reused_tokens == 0
    [f] = HFGenerator(model, tok).generate([other], params)
    assert r.token_ids == f.token_ids
