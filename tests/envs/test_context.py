"""Long horizons under a fixed context (``env.context``, `searchrl.envs.context`): folding, rows, baselines."""

import time

import pytest
import torch

from searchrl.algorithms.advantage_estimators import AdvantageInput, grpo, per_episode, reinforce_batch
from searchrl.core.masking import build_batch
from searchrl.core.records import Doc, Example
from searchrl.core.types import Segment, Trajectory
from searchrl.envs.chat_format import ChatFormat
from searchrl.envs.context import FOLDS, LATER, ContextFolder, last_rows, unfold
from searchrl.envs.search import SearchEnv
from searchrl.envs.tool_env import ToolEnv
from searchrl.rollout.generator import SamplingParams
from searchrl.rollout.loop import run, start_trajectories

from ..helpers import ScriptedCandidates


class Facts:
    """A retriever whose document for query "fact N" says where fact N+1 is: a chain of any length."""

    def search(self, queries, k):
        out = []
        for q in queries:
            n = int(q.split()[-1]) if q.split()[-1].isdigit() else 0
            out.append([Doc(f"d{n}", f"Fact {n}", f"Fact {n} points to fact {n + 1}. Filler text here.")] * k)
        return out


EX = Example(
    id="chain", question="Follow the facts to the end: where does fact 60 point?", answers=("fact 61",)
)


def long_episode(tok, searches, context=None, max_total=400):
    """One scripted episode of ``searches`` searches, then an answer, under ``max_total`` tokens."""
    env = SearchEnv(Facts(), template="short", topk=1, max_turns=searches + 1)
    env.context = context
    texts = [[f"<search> fact {i} </search>"] for i in range(1, searches + 1)] + [
        ["<answer> fact 61 </answer>"]
    ]
    gen = ScriptedCandidates(tok, texts)
    trajs = start_trajectories(env, tok, [EX])
    stats = run(trajs, env, gen, tok, SamplingParams(max_new_tokens=16), max_total_tokens=max_total)
    return trajs[0], gen, stats


def test_a_long_chain_needs_folding_and_every_context_is_append_only(qwen_tok):
    truncated, _, _ = long_episode(qwen_tok, 60)
    assert truncated.finish_reason == "length" and truncated.episode.n_searches <= 12

    folder = ContextFolder(max_tokens=300, max_segments=40)
    t, gen, stats = long_episode(qwen_tok, 60, folder)
    assert t.finish_reason == "answer" and t.episode.n_searches == 60 and t.answer == "fact 61"
    folds = len(t.info[FOLDS])
    assert 10 <= folds < 40 and stats.metrics()["rollout/context_folds"] == folds
    rows = unfold([t])
    assert len(rows) == folds + 1 and rows[-1] is t
    # each context: the prompt first, then actions and observations; the generator sampled each action from
    # exactly the row's tokens before it (ids as sampled, docs/design.md §4.1)
    calls = iter(gen.prompts)
    for k, row in enumerate(rows):
        assert row.segments[0].kind == "prompt" and len(row) < 400 and row.episode_id == rows[0].episode_id
        assert row.info[LATER] == len(rows) - 1 - k and row.example is EX and row.state is t.state
        for si, seg in enumerate(row.segments):
            if seg.kind == "action":
                assert next(calls)[0] == [x for s in row.segments[:si] for x in s.token_ids]
    assert next(calls, None) is None
    # a folded context starts from the question and the summary of every search so far (the oldest dropped
    # to fit): its last line is the search just before the fold
    first_action = sum(s.kind == "action" for s in rows[0].segments)
    text = qwen_tok.decode(rows[1].segments[0].token_ids)
    assert text.startswith(t.episode.prompt) and "Summary of the searches so far:" in text
    assert f"fact {first_action}: Fact {first_action} points to fact {first_action + 1}." in text
    assert last_rows(rows) == [False] * folds + [True]


def test_no_room_for_a_summary_means_no_fold(qwen_tok):
    """A budget the prompt alone fills leaves no room: the episode runs on and ends at the length cap."""
    t, _, _ = long_episode(qwen_tok, 20, ContextFolder(max_tokens=10, max_segments=5))
    assert t.finish_reason == "length" and not t.info.get(FOLDS)


def test_after_max_segments_the_episode_runs_to_the_length_cap(qwen_tok):
    t, _, _ = long_episode(qwen_tok, 60, ContextFolder(max_tokens=300, max_segments=3))
    assert len(t.info[FOLDS]) == 2 and t.finish_reason == "length"


def test_a_thousand_searches_fold_in_bounded_time(qwen_tok):
    """The summary keeps the newest lines that fit: a huge history never makes a context too long."""
    folder = ContextFolder(max_tokens=300, max_segments=1000, summary_max_tokens=60)
    t0 = time.perf_counter()
    t, _, _ = long_episode(qwen_tok, 400, folder, max_total=400)
    assert t.finish_reason == "answer" and t.episode.n_searches == 400
    assert time.perf_counter() - t0 < 20  # 0.9 s here; a rendering per dropped line took 83 s
    assert all(len(r) < 400 for r in unfold([t]))


def test_a_summarizer_replying_with_broken_text_still_folds(qwen_tok):
    """A chat model's reply may hold an unpaired surrogate or control characters: the summary stays text."""
    folder = ContextFolder(
        max_tokens=300, max_segments=5, summarizer=lambda items: ["\udfff\x00 odd"] * len(items)
    )
    t, _, _ = long_episode(qwen_tok, 20, folder)
    assert t.finish_reason == "answer" and len(t.info[FOLDS]) >= 1
    assert "fact 1: ?\x00 odd" in qwen_tok.decode(unfold([t])[1].segments[0].token_ids)


def test_a_chat_prompt_folds_into_the_users_message(qwen_tok):
    fmt = ChatFormat(qwen_tok)
    env = ToolEnv(Facts(), fmt, template="tools", topk=1, max_turns=3)
    state = env.reset(EX)
    text = env.fold_prompt(state, "Summary:\nfact 1: Fact 1 points to fact 2.")
    messages = env.template.messages(EX.question)
    messages[-1]["content"] += "\n\nSummary:\nfact 1: Fact 1 points to fact 2."
    want = qwen_tok.apply_chat_template(
        messages, tools=env.schemas, add_generation_prompt=True, tokenize=False
    )
    assert text == want and text.endswith("<|im_start|>assistant\n")
    state.force_answer = True
    assert "No tool calls left" in env.fold_prompt(state, "Summary:")
    tags = SearchEnv(Facts(), template="short", topk=1)
    st = tags.reset(EX)
    st.force_answer = True
    assert tags.fold_prompt(st, "S").endswith("<information>S</information>\n\n<answer>")


# ------------------------------------------------------------------ the rows of an episode count once
def rows_of(episodes):
    """Trajectories from (group, reward, rows, tokens per row) specs, unfolded."""
    trajs = []
    for g, r, n in episodes:
        t = Trajectory(
            EX, [Segment("prompt", [1]), Segment("action", [2, 3], [-0.1, -0.1])], group_id=g, reward=r
        )
        t.info[FOLDS] = [([Segment("prompt", [1]), Segment("action", [4], [-0.2])], []) for _ in range(n - 1)]
        trajs.append(t)
    return unfold(trajs)


class Cfg:
    std_normalize, eps = True, 1e-6


def test_group_baselines_count_episodes_not_rows():
    # group 0: rewards 1 (3 rows), 0 (1 row); group 1: rewards 1, 1, 0 (2, 1, 1 rows)
    rows = rows_of([(0, 1.0, 3), (0, 0.0, 1), (1, 1.0, 2), (1, 1.0, 1), (1, 0.0, 1)])
    batch = build_batch(rows, 0)
    ids = batch.extras.episode_ids
    x = AdvantageInput(batch.rewards, batch.group_ids, batch.loss_mask, None, Cfg)
    adv = per_episode(grpo, x, ids)
    # by hand: group 0 mean 0.5, std (unbiased) 0.7071 -> +-0.7071; group 1 mean 2/3, std 0.5774 -> 0.5774, -1.1547
    per_row = [0.7071, 0.7071, 0.7071, -0.7071, 0.5774, 0.5774, 0.5774, -1.1547]
    got = [float(adv[i][batch.loss_mask[i] > 0][0]) for i in range(len(rows))]
    assert got == pytest.approx(per_row, abs=1e-3)
    # the rows' own GRPO (each row an episode) would count the 3-row episode three times
    assert float(grpo(x)[3][batch.loss_mask[3] > 0][0]) == pytest.approx(
        -1.5, abs=1e-3
    )  # rows 1, 1, 1, 0: mean 0.75, std 0.5


def test_batch_mean_and_kl_penalty_are_per_episode_and_padding_is_ignored():
    rows = rows_of([(0, 1.0, 3), (1, 0.0, 1)])
    pad = Trajectory(EX, [Segment("prompt", [0, 0])], group_id=-7)  # the trainer's padding row
    batch = build_batch([*rows, pad], 0)
    kl = batch.loss_mask * 0.1  # β·KL 0.1 per action token
    x = AdvantageInput(batch.rewards, batch.group_ids, batch.loss_mask, kl, Cfg)
    adv = per_episode(reinforce_batch, x, batch.extras.episode_ids)
    # episode rewards less their KL: 1 - 0.1 * (2 + 1 + 1) = 0.6 and 0 - 0.1 * 2 = -0.2: batch mean 0.2
    first = [float(adv[i][batch.loss_mask[i] > 0][0]) for i in range(4)]
    assert first == pytest.approx([0.4, 0.4, 0.4, -0.4]) and float(adv[4].abs().sum()) == 0.0


def test_unfold_ids_are_unique_across_groups_and_rows_share_the_outcome():
    rows = rows_of([(3, 0.5, 2), (5, 0.25, 1)])
    assert [r.episode_id for r in rows] == [3 << 20, 3 << 20, (5 << 20) + 1]
    assert [r.reward for r in rows] == [0.5, 0.5, 0.25] and [r.group_id for r in rows] == [3, 3, 5]
    assert [r.finish_reason for r in rows][:1] == ["folded"]


# ------------------------------------------------------------------ the configuration
@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["env.context={max_tokens: 900}"], "env.context.max_tokens"),
        (["env.context={max_segments: 2}"], "env.context.max_tokens"),  # required
        (["env.context={max_tokens: 100, max_segments: 0}"], "env.context.max_segments"),
        (["env.context={max_tokens: 100}", "algorithm={name: ppo}"], "env.context"),
        (["env.context={max_tokens: 100}", "algorithm.advantage=reinforce_pp"], "algorithm.advantage"),
        (
            ["env.context={max_tokens: 100, summarizer: {name: extract, args: {max_sentence: 2}}}"],
            "env.context",
        ),
    ],
)
def test_bad_context_configs_are_refused(overrides, key):
    from searchrl.app.experiment import check_arguments, load_experiment
    from searchrl.core.errors import ConfigError

    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        check_arguments(load_experiment(None, ["rollout.max_total_tokens=768", *overrides]))


def test_grpo_trains_on_folded_episodes(make_exp, agent_model_dir):
    from searchrl.core.config import TrainerConfig
    from searchrl.engine.metrics import read_metrics
    from tests.engine.test_trainer import trainer_for

    exp = make_exp(
        f"model.path={agent_model_dir}",
        "rollout.temperature=1.0",
        "env.max_turns=4",
        "env.topk=1",
        "rollout.max_total_tokens=240",
        "env.context={max_tokens: 100, max_segments: 3, summary_max_tokens: 60}",
    )
    tr = trainer_for(exp, "grpo", TrainerConfig(steps=2, batch_size=2, micro_batch_size=8, save_every=2))
    assert tr.training_step.shape.rows == 2 * 4 * 3  # questions x group x rows per episode
    tr.run()
    rows = read_metrics(exp.out / "metrics.jsonl")
    assert len(rows) == 2 and all("rollout/context_folds" in r for r in rows)
    assert sum(r["rollout/context_folds"] for r in rows) > 0
    assert all(r["train/sequences"] >= 8 for r in rows)  # every episode's last row at least
    assert all(torch.isfinite(torch.tensor(r["train/loss"])) for r in rows)
