"""Rollouts in the tool protocol on Qwen's real vocabularies: episodes grow by appending (the ids are the sampled
ones, never a re-rendering through the chat template), the loss mask covers exactly the sampled assistant
tokens, and the sampler's log-probs equal the trainer's.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from searchrl.core.masking import build_batch
from searchrl.core.records import Example
from searchrl.envs.chat_format import ChatFormat
from searchrl.envs.tool_env import ToolEnv
from searchrl.envs.tools import Tool
from searchrl.rollout.generator import SamplingParams
from searchrl.rollout.hf import HFGenerator
from searchrl.rollout.loop import encode, rollout

from ..envs.test_tools import CountingRetriever, call
from ..helpers import ScriptedCandidates
from .test_text_tags import fit_vocab_map, logprob_gap, split_ids

EX = Example(id="q1", question="Who directed Zelka?", answers=("Ann Lee",))
TURN_1 = '<think>\nI should look it up.</think>\n<tool_call>\n{"name":"search","arguments":{"query":"Zelka"}}\n</tool_call>'
TURN_2 = "<think>The document says Ann Lee.</think>\nAnn Lee"


def test_ids_are_the_sampled_ones_where_re_rendering_the_conversation_would_change_them(qwen3_tok):
    """Qwen3's template re-spaces reasoning and re-serialises tool-call JSON in earlier turns (and drops the
    reasoning of turns before the last user message). Our episode keeps the sampled ids; re-rendering the same
    conversation through the template gives other ids from the first assistant turn on."""
    env = ToolEnv(CountingRetriever(), ChatFormat(qwen3_tok), template="tools", topk=1)
    gen = ScriptedCandidates(qwen3_tok, [[TURN_1 + "<|im_end|>"], [TURN_2 + "<|im_end|>"]])
    [traj], _ = rollout([EX], env, gen, qwen3_tok, SamplingParams(1.0, 1.0, 64), 1, 2000)
    ep = traj.episode
    assert ep.finish_reason == "answer" and ep.answer == "Ann Lee"
    kinds = [s.kind for s in traj.segments]
    assert kinds == ["prompt", "action", "observation", "action"]
    sampled = [encode(qwen3_tok, TURN_1 + "<|im_end|>"), encode(qwen3_tok, TURN_2 + "<|im_end|>")]
    assert [
        s.token_ids for s in traj.segments if s.kind == "action"
    ] == sampled  # as sampled, not re-rendered
    messages = env.template.messages(EX.question)
    prompt = qwen3_tok.apply_chat_template(
        messages, tools=env.schemas, add_generation_prompt=True, tokenize=False
    )
    assert traj.segments[0].token_ids == encode(qwen3_tok, prompt)
    # the observation is the template's own tool message, tokenized once
    assert qwen3_tok.decode(traj.segments[2].token_ids) == ep.observations[0]
    assert ep.observations[0].startswith("\n<|im_start|>user\n<tool_response>\nDoc 1 [d3](Title: Zelka)")

    # the same conversation re-rendered by the template, as trainers that rebuild the prompt each turn do
    full = [
        *messages,
        {
            "role": "assistant",
            "content": "<think>\nI should look it up.</think>",
            "tool_calls": [
                {"type": "function", "function": {"name": "search", "arguments": {"query": "Zelka"}}}
            ],
        },
        {"role": "tool", "content": env.format_docs(ep.retrieved[0])},
        {"role": "assistant", "content": TURN_2},
    ]
    rerendered = encode(qwen3_tok, qwen3_tok.apply_chat_template(full, tools=env.schemas, tokenize=False))
    ours = traj.token_ids
    first_diff = next(i for i, (a, b) in enumerate(zip(ours, rerendered)) if a != b)
    start = len(traj.segments[0].token_ids)
    assert start <= first_diff < start + len(sampled[0])  # inside the first sampled turn
    text = qwen3_tok.decode(rerendered)
    assert "<think>\nI should look it up.\n</think>\n\n" in text  # re-spaced
    assert '{"name": "search", "arguments": {"query": "Zelka"}}' in text  # re-serialised
    # with a second question, the template drops the first question's reasoning altogether
    follow = qwen3_tok.apply_chat_template(
        [*full, {"role": "user", "content": "And who wrote it?"}], tokenize=False
    )
    assert "I should look it up" not in follow and "The document says" not in follow


ACTIONS_WORDS = ["Zelka", "Paris", "Ann Lee", "France", "capital"]


def tool_turn(rng: random.Random) -> str:
    """An assistant turn as a model might write it: one or two calls, malformed JSON, an unknown tool, wrong
    argument types, or an answer."""
    w, q = rng.choice(ACTIONS_WORDS), rng.choice(ACTIONS_WORDS)
    k = rng.random()
    if k < 0.3:
        return f"<think> {w} </think>\n{call('search', query=q)}"
    if k < 0.55:
        return f"{call('search', query=q)}\n{call('search', query=w, k=1)}"
    if k < 0.6:
        return '<tool_call>\n{"name": "search", "arguments": {"query": "' + q + '"}\n</tool_call>'
    if k < 0.65:
        return call("browse", url=q)
    if k < 0.7:
        return call("search", query=3)
    return f"<think> {w} </think>\n{q}"


def compact_env(tok, **kw) -> ToolEnv:
    """A tool environment whose search tool has a short schema: a short prompt keeps the test fast."""
    env = ToolEnv(CountingRetriever(), ChatFormat(tok), template="tools", topk=1, **kw)
    params = {
        "type": "object",
        "properties": {"query": {"type": "string"}, "k": {"type": "integer"}},
        "required": ["query"],
    }
    env.set_tools([Tool("search", "Search.", params, env.tools["search"].run)])
    return env


@pytest.fixture(scope="module")
def tool_model(qwen_tok):
    """A tiny model over Qwen2.5's vocabulary, trained for a moment on tool-format episodes so that sampling
    writes tool calls, valid and not, split into tokens in many ways."""
    rng = random.Random(0)
    env = compact_env(qwen_tok)
    prompt = encode(qwen_tok, env.reset(EX).prompt)
    obs = encode(
        qwen_tok,
        env.format.after_tool_calls([("search", {"query": "q"})], ["Doc 1 [d1](Title: Paris) Paris."]),
    )
    samples = []
    for _ in range(256):
        row = list(prompt)
        for _ in range(2):
            row += [*split_ids(qwen_tok, tool_turn(rng), rng), 151645, *obs]
        samples.append(row)
    return fit_vocab_map(samples, steps=100)


@pytest.fixture(scope="module")
def tool_trajectories(tool_model, qwen_tok):
    env = compact_env(qwen_tok, max_turns=3)
    gen = HFGenerator(tool_model, qwen_tok, env.stop_strings, batch_size=16)
    torch.manual_seed(1)
    examples = [Example(id=f"q{i}", question=EX.question, answers=EX.answers) for i in range(8)]
    trajs, stats = rollout(examples, env, gen, qwen_tok, SamplingParams(1.0, 1.0, 48), 4, 1200)
    return env, trajs, stats


def test_sampled_turns_call_tools_in_many_ways(tool_trajectories):
    """The checks below only mean something if the sampled turns hold valid and broken calls and answers
    (several calls in one turn: tests/envs/test_tools.py)."""
    _, trajs, stats = tool_trajectories
    infos = [i for t in trajs for i in t.episode.infos]
    assert {"search", "invalid", "answer"} <= {i.kind for i in infos}
    assert {"malformed_json", "unclosed_tool_call"} <= {i.error for i in infos}
    metrics = stats.metrics()
    assert float(metrics["rollout/tool_calls/search"]) == float(metrics["rollout/tool_calls_per_episode"]) > 0
    assert float(metrics["rollout/tool_calls_per_episode"]) == pytest.approx(
        sum(len(i.calls) for i in infos) / len(trajs)
    )


def test_turns_end_at_the_end_of_turn_token_and_the_mask_covers_exactly_the_sampled_ids(
    tool_trajectories, qwen_tok
):
    _, trajs, _ = tool_trajectories
    batch = build_batch(trajs, qwen_tok.pad_token_id)
    for b, t in enumerate(trajs):
        actions = [s for s in t.segments if s.kind == "action"]
        for s in actions[:-1]:  # every turn that the environment answered ended with <|im_end|>
            assert s.token_ids[-1] == 151645 and 151645 not in s.token_ids[:-1]
        assert "".join(qwen_tok.decode(s.token_ids) for s in t.segments) == t.episode.text()
        on = batch.loss_mask[b].bool()
        assert batch.input_ids[b][on].tolist() == [i for s in actions for i in s.token_ids]
        obs = [i for s in t.segments if s.kind == "observation" for i in s.token_ids]
        assert batch.input_ids[b][batch.obs_mask[b]].tolist() == obs


def test_tool_protocol_sampler_and_trainer_log_probs_agree(tool_trajectories, tool_model, qwen_tok):
    _, trajs, _ = tool_trajectories
    for i in range(0, len(trajs), 4):  # a few rows at a time: each forward's logits have 151,936 columns
        assert logprob_gap(tool_model, trajs[i : i + 4], qwen_tok.pad_token_id, 1.0) <= 1e-4


def test_written_turns_parse_back(qwen_tok):
    """The teacher's turns (SFT data in tool format) are valid calls and answers of the environment."""
    env = ToolEnv(CountingRetriever(), ChatFormat(qwen_tok))
    info = env.parse(env.write_search("I need the director.", 'Zelka "film"'))
    assert info.valid and info.kind == "search" and info.query == 'Zelka "film"'
    assert (
        json.loads(env.write_search("t", "q").split("<tool_call>\n")[1].split("\n</tool_call>")[0])["name"]
        == "search"
    )
    info = env.parse(env.write_answer("Ann Lee", "Found: Ann Lee. "))
    assert info.valid and info.answer == "Ann Lee"
    assert env.parse(env.write_forced_answer("Ann Lee"), forced=True).answer == "Ann Lee"


def test_qwen3_with_thinking_off_renders_as_trained_given_reasoning_content(qwen3_tok):
    """enable_thinking: false opens every assistant turn with an empty reasoning block, and our episode keeps
    it in every turn (append-only). Qwen3's own template, re-rendering the conversation as a server does, drops
    it from the earlier turns, so the context served would differ from the one trained on from turn 2; given a
    reasoning_content of "\\n" on those turns, the same template renders exactly the trained text."""
    env = ToolEnv(
        CountingRetriever(), ChatFormat(qwen3_tok, {"enable_thinking": False}), template="tools", topk=1
    )
    turn_1 = '<tool_call>\n{"name": "search", "arguments": {"query": "Zelka"}}\n</tool_call>'
    gen = ScriptedCandidates(qwen3_tok, [[turn_1 + "<|im_end|>"], ["Ann Lee<|im_end|>"]])
    [traj], _ = rollout([EX], env, gen, qwen3_tok, SamplingParams(1.0, 1.0, 64), 1, 2000)
    trained = qwen3_tok.decode(traj.token_ids)
    assert trained.count("<think>\n\n</think>\n\n") == 2  # both turns opened with the empty block
    ep = traj.episode
    call_1 = {"type": "function", "function": {"name": "search", "arguments": {"query": "Zelka"}}}
    turns = [
        *env.template.messages(EX.question),
        {"role": "assistant", "content": "", "tool_calls": [call_1]},
        {"role": "tool", "content": env.format_docs(ep.retrieved[0])},
        {"role": "assistant", "content": "Ann Lee"},
    ]
    kw = {"tools": env.schemas, "tokenize": False, "enable_thinking": False}
    served = qwen3_tok.apply_chat_template(turns, **kw)
    assert served.count("<think>\n\n</think>\n\n") == 1 and served != trained + "\n"
    for t in turns:
        if t["role"] == "assistant":
            t["reasoning_content"] = "\n"
    as_trained = qwen3_tok.apply_chat_template(turns, **kw)
    assert as_trained.rstrip("\n") == trained.rstrip("\n")
