"""Tags as text in Qwen2.5's real vocabulary: stops, action parsing, segments, masks and log-probs.

In Qwen2.5's vocabulary ``<search>`` is three tokens and ``</search>`` glues to its neighbours (``?</``,
``>\\n\\n``). A tiny model with that vocabulary is given an output head that favours a small alphabet of
tag fragments, so sampling from it writes tags split and glued in every way, unclosed, repeated, inside
answers. Over those real rollouts: the stop fires at the token completing the first closing tag, the
environment reads the action up to that tag only, the segments decode to the environment's transcript,
the loss mask covers exactly the sampled ids, and the sampler's log-probs equal the trainer's.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from searchrl.core.functional import token_logprobs
from searchrl.core.masking import build_batch
from searchrl.envs.search import SearchEnv
from searchrl.rollout.generator import SamplingParams
from searchrl.rollout.hf import HFGenerator, TextStop
from searchrl.rollout.loop import rollout

STOPS = ("</search>", "</answer>")
WORDS = ["Paris", "the capital", "Zelka", "who directed it", "Ann Lee", "France", "born where"]
FRAGMENTS = [
    "<",
    "/",
    "search",
    ">",
    "</",
    "?</",
    ">\n\n",
    ">.",
    "answer",
    "think",
    " Paris",
    " the",
    "?",
    "\n",
    " capital",
    "<search>",
    "</answer>",
    "</search>",
    " is",
    ".",
]


def action_text(rng: random.Random) -> str:
    """A search agent's action as a model might write it: tags glued to punctuation, unclosed, repeated,
    inside an answer."""
    w, q, a = rng.choice(WORDS), rng.choice(WORDS), rng.choice(WORDS)
    punct, tail = rng.choice(["", "?", ".", " "]), rng.choice(["", "\n\n", ".", "\n", " "])
    k = rng.random()
    if k < 0.4:
        return f"<think> {w} </think>\n<search> {q}{punct}</search>{tail}"
    if k < 0.7:
        return f"<think> {w}</think> <answer> {a}{punct}</answer>{tail}"
    if k < 0.8:
        return f"<search>{q}{punct}<search> {a}</search>{tail}"
    if k < 0.9:
        return f"<answer> {a} <search> {q}</answer>{tail}"
    return f"<think> {w}</think><search> {q}"


def split_ids(tok, text: str, rng: random.Random) -> list[int]:
    """``text`` tokenized canonically, or in pieces cut at random characters (a split a model can sample)."""
    if rng.random() < 0.5:
        return tok(text, add_special_tokens=False)["input_ids"]
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 6))))
    pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
    return [i for p in pieces for i in tok(p, add_special_tokens=False)["input_ids"]]


class VocabMap(torch.nn.Module):
    """A Qwen2 model over a small vocabulary behind Qwen2.5's: ids in are mapped to the small vocabulary
    (ids it does not know, such as retrieved text, to one shared row), logits out are scattered back to all
    151,936 rows (-1e4 elsewhere). What the rollout loop sees is a causal LM with Qwen2.5's vocabulary."""

    def __init__(self, inner, known: list[int]) -> None:
        super().__init__()
        self.inner, self.known = inner, torch.tensor(known)
        self.register_buffer(
            "to_small", torch.full((151936,), len(known), dtype=torch.long), persistent=False
        )
        self.to_small[self.known] = torch.arange(len(known))
        self.generation_config = inner.generation_config

    def get_base_model(self):  # as peft's wrappers: the model whose forward's parameters count
        return self.inner

    def forward(self, input_ids, **kw):
        out = inner_out = self.inner(input_ids=self.to_small[input_ids], **kw)
        full = inner_out.logits.new_full((*inner_out.logits.shape[:-1], 151936), -1e4)
        full[..., self.known] = inner_out.logits[..., : len(self.known)]
        out.logits = full
        return out


def fit_vocab_map(samples: list[list[int]], steps: int) -> VocabMap:
    """A `VocabMap` over the ids in ``samples`` (rows of Qwen2.5 ids), trained on them for ``steps`` steps."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    known = sorted({i for row in samples for i in row})
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=len(known) + 1,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        eos_token_id=151645,
    )
    model = VocabMap(Qwen2ForCausalLM(cfg), known)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    T = max(map(len, samples))
    ids = torch.tensor([r + [151643] * (T - len(r)) for r in samples])
    mask = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in samples])
    small = model.to_small[ids]  # train the inner model on its own vocabulary: fast
    for _ in range(steps):
        b = torch.randint(0, len(samples), (32,))
        logits = model.inner(input_ids=small[b], attention_mask=mask[b]).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), small[b][:, 1:].reshape(-1), reduction="none"
        )
        loss = (loss * mask[b][:, 1:].reshape(-1)).sum() / mask[b][:, 1:].sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model.eval()


@pytest.fixture(scope="module")
def fragment_model(qwen_tok):
    """Trained for a moment on synthetic action transcripts, so that sampling from it writes tags split and
    glued in many ways."""
    rng = random.Random(0)
    obs = "\n\n<information>doc</information>\n\n"
    samples = [[*split_ids(qwen_tok, "Question: q\n", rng)] for _ in range(400)]
    for row in samples:
        for _ in range(2):
            row += (
                split_ids(qwen_tok, action_text(rng), rng)
                + qwen_tok(obs, add_special_tokens=False)["input_ids"]
            )
        row.append(151645)
    return fit_vocab_map(samples, steps=150)


def test_tags_are_text_in_this_vocabulary(qwen_tok):
    from searchrl.rollout.generator import split_stops

    ids, texts = split_stops(qwen_tok, STOPS)
    assert ids == set() and texts == list(STOPS)


@pytest.fixture(scope="module")
def trajectories(fragment_model, qwen_tok, small_world, world_bm25):
    env = SearchEnv(world_bm25, template="short", topk=1, max_turns=4)
    gen = HFGenerator(fragment_model, qwen_tok, env.tags.stop_strings, batch_size=16)
    torch.manual_seed(1)
    trajs, _ = rollout(
        small_world.examples("train")[:12], env, gen, qwen_tok, SamplingParams(1.0, 1.0, 32), 4, 500
    )
    return env, trajs


def test_rollouts_write_tags_in_many_splits(trajectories, qwen_tok):
    """The property tests below only mean something if the sampled actions contain tags, split variously."""
    _, trajs = trajectories
    actions = [s for t in trajs for s in t.segments if s.kind == "action"]
    texts = [qwen_tok.decode(a.token_ids) for a in actions]
    stopped = [t for t in texts if any(s in t for s in STOPS)]
    kinds = {i.kind for t in trajs for i in t.episode.infos}
    assert len(stopped) >= 20 and {"search", "answer", "invalid"} <= kinds
    assert any(t.endswith(("</search>\n\n", "</search>.", "</answer>.", "</answer>\n\n")) for t in stopped)


def test_stop_fires_at_the_token_that_completes_the_first_closing_tag(trajectories, qwen_tok):
    _, trajs = trajectories
    for t in trajs:
        for seg in (s for s in t.segments if s.kind == "action"):
            text = qwen_tok.decode(seg.token_ids)
            if any(s in text for s in STOPS):
                assert not any(s in qwen_tok.decode(seg.token_ids[:-1]) for s in STOPS), text


def test_environment_reads_each_action_up_to_its_first_closing_tag(trajectories):
    """Each step's parse equals parsing the action cut at the end of its first closing tag: what the last
    token adds after the tag never makes an answer invalid or starts another action."""
    env, trajs = trajectories
    glued = 0
    for t in trajs:
        ep = t.episode
        for i, (action, info) in enumerate(zip(ep.actions, ep.infos)):
            forced = i > 0 and ep.observations[i - 1].endswith(env.tags.answer_open)
            text = (env.tags.answer_open + action) if forced else action
            if not any(s in text for s in STOPS):
                continue
            end = env.first_stop_end(text)
            glued += end < len(text)
            head = env.parse(text[:end])  # the text already holds the forced tag
            assert (head.kind, head.valid, head.error, head.answer) == (
                info.kind,
                info.valid,
                info.error,
                info.answer,
            )
            if info.kind == "search" and info.valid:
                assert head.query == info.query
    assert glued >= 5  # actions whose last token carried characters after the tag


def test_segments_decode_to_the_transcript_and_the_mask_covers_exactly_the_sampled_ids(
    trajectories, qwen_tok
):
    _, trajs = trajectories
    batch = build_batch(trajs, qwen_tok.pad_token_id)
    for b, t in enumerate(trajs):
        assert "".join(qwen_tok.decode(s.token_ids) for s in t.segments) == t.episode.text()
        sampled = [i for s in t.segments if s.kind == "action" for i in s.token_ids]
        on = batch.loss_mask[b].bool()
        assert batch.input_ids[b][on].tolist() == sampled
        obs = [i for s in t.segments if s.kind == "observation" for i in s.token_ids]
        assert batch.input_ids[b][batch.obs_mask[b]].tolist() == obs


def logprob_gap(model, trajs, pad_id: int, temperature: float) -> float:
    """Largest difference between the sampler's log-probs and a full forward pass's, over action tokens."""
    batch = build_batch(trajs, pad_id)
    pos = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=pos
        ).logits
    ours = token_logprobs(logits, batch.input_ids, temperature, mask=batch.loss_mask)
    return float(((ours - batch.sampled_logprobs).abs() * batch.loss_mask).max())


def test_sampler_and_trainer_log_probs_agree(trajectories, fragment_model, qwen_tok):
    _, trajs = trajectories
    assert logprob_gap(fragment_model, trajs, qwen_tok.pad_token_id, 1.0) <= 1e-4


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(FRAGMENTS), min_size=1, max_size=14), st.booleans())
def test_adversarial_splits(qwen_tok, pieces, canonical):
    """Any text, tokenized canonically or fragment by fragment (a split the model may sample): the stop
    check fires at the first token whose text completes a closing tag, and parsing the text as generated
    up to there equals parsing the text cut at the end of that tag."""
    text = "".join(pieces)
    ids = (
        qwen_tok(text, add_special_tokens=False)["input_ids"]
        if canonical
        else [i for p in pieces for i in qwen_tok(p, add_special_tokens=False)["input_ids"]]
    )
    stop = TextStop(qwen_tok, STOPS)
    first = next((n for n in range(1, len(ids) + 1) if stop(ids[:n])), None)
    expected = next(
        (n for n in range(1, len(ids) + 1) if any(s in qwen_tok.decode(ids[:n]) for s in STOPS)), None
    )
    assert first == expected
    if first is None:
        return
    generated = qwen_tok.decode(ids[:first])
    env = SearchEnv(retriever=None, template="short")  # type: ignore[arg-type]  # parsing only
    cut = generated[: env.first_stop_end(generated)]
    assert any(cut.endswith(s) for s in STOPS)
    assert env.parse(generated, stopped=True) == env.parse(cut)


def test_sampler_and_trainer_log_probs_agree_over_the_full_vocabulary(qwen_tok, small_world, world_bm25):
    """A random Qwen2 model with all 151,936 output rows: the KV-cached sampler's log-probs (softmax over the
    whole vocabulary) equal a full forward pass's, through the multi-turn loop."""
    from ..helpers import qwen_model

    model = qwen_model()
    env = SearchEnv(world_bm25, template="short", topk=1, max_turns=2)
    gen = HFGenerator(model, qwen_tok, env.tags.stop_strings, batch_size=8)
    trajs, _ = rollout(
        small_world.examples("train")[:4], env, gen, qwen_tok, SamplingParams(0.7, 1.0, 12), 2, 200
    )
    assert logprob_gap(model, trajs, qwen_tok.pad_token_id, 0.7) <= 1e-4


def test_the_stop_check_decodes_only_rows_whose_newest_token_can_end_a_tag(qwen_tok, monkeypatch):
    """The tags end in ``>``: a row whose newest token holds no ``>`` cannot have just completed one and is
    not decoded; one whose token does, or an id beyond the tokenizer's (a padded output row), is."""
    stop = TextStop(qwen_tok, STOPS)
    assert stop.ends == ">"
    gt = qwen_tok(">", add_special_tokens=False)["input_ids"][0]
    word = qwen_tok(" Paris", add_special_tokens=False)["input_ids"][0]
    head = qwen_tok("<think> a </think><search> b </search", add_special_tokens=False)["input_ids"]
    calls = []
    decode = qwen_tok.decode
    monkeypatch.setattr(qwen_tok, "decode", lambda ids, **kw: calls.append(ids) or decode(ids, **kw))
    assert not stop([*head, word]) and calls == []  # skipped
    assert stop([*head, gt]) and len(calls) == 1  # decoded: completes </search>
    assert not stop([word, len(qwen_tok) + 5]) and len(calls) == 2  # unknown id: decoded
    read, enders = stop._enders
    assert read == len(qwen_tok) and gt in enders and word not in enders
    assert all(">" in decode([i]) for i in list(enders)[:200])


def test_tags_ending_outside_ascii_are_checked_at_every_token(qwen_tok):
    assert TextStop(qwen_tok, ["</search>", "答"]).ends == ""
    assert TextStop(qwen_tok, ["</search>", "\n"]).ends == ""
    assert TextStop(qwen_tok, ["</search>", "</answer>"]).ends == ">"
    stop = TextStop(qwen_tok, ["答"])
    ids = qwen_tok("问答", add_special_tokens=False)["input_ids"]
    assert stop(ids)
