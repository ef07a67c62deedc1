"""GiGPO and IGPO: per-step credit on GRPO's groups, against hand-computed values and against references
written from reading the authors' released code (verl-agent's ``core_gigpo.py``; IGPO's ``core_algos.py``)."""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
import pytest
import torch

from searchrl.algorithms.advantage_estimators import AdvantageInput
from searchrl.algorithms.base import PROBE_KEY
from searchrl.algorithms.gigpo import GiGPOSettings, anchor_states, gigpo
from searchrl.algorithms.grpo import GRPOConfig
from searchrl.algorithms.igpo import IGPOSettings, answer_probes, igpo, split_gold
from searchrl.core.config import TrainerConfig
from searchrl.core.errors import ConfigError
from searchrl.core.masking import build_batch
from searchrl.core.records import Example
from searchrl.core.types import Segment, Step, StepInfo, Trajectory
from tests.engine.test_trainer import trainer_for

EX = Example(id="q", question="q?", answers=("Ann Lee",))


def episode(prompt, turns, reward, group):
    """A trajectory from (action ids, observation ids or None) turns; each action is a step."""
    segs, steps, pos = [Segment("prompt", list(prompt))], [], len(prompt)
    for action, obs in turns:
        segs.append(Segment("action", list(action), [0.0] * len(action)))
        pos += len(action)
        steps.append(Step(len(segs) - 1, pos - 1, StepInfo("search" if obs else "answer", True)))
        if obs:
            segs.append(Segment("observation", list(obs)))
            pos += len(obs)
    return Trajectory(EX, segs, steps, reward=reward, group_id=group)


def scripted():
    """Three episodes of one question (A and B meet the same documents at their second step, C does not) and a
    lone episode of another question."""
    a = episode([1, 2], [([10, 11], [50, 51]), ([12], [60]), ([13, 14], None)], 1.0, 0)
    b = episode([1, 2], [([20], [50, 51]), ([21, 22], None)], 0.0, 0)
    c = episode([1, 2], [([30], [70]), ([31], [60]), ([32], None)], 1.0, 0)
    d = episode([3], [([40], None)], 0.5, 1)
    return [a, b, c, d], build_batch([a, b, c, d], pad_id=0)


def per_step(adv, batch, b):
    """The advantage on each step's action tokens (one value per step; asserted constant on the step)."""
    out = []
    for k in range(int(batch.step_mask[b].sum())):
        vals = adv[b][batch.step_ids[b] == k]
        assert torch.allclose(vals, vals[0].expand_as(vals))
        out.append(float(vals[0]))
    return out


def adv_input(batch, cfg):
    return AdvantageInput(batch.rewards, batch.group_ids, batch.loss_mask, None, cfg, float, batch)


# ------------------------------------------------------------------------------------------------- GiGPO


def test_gigpo_anchor_states_ignore_the_agents_text():
    _, batch = scripted()
    anchors = anchor_states(batch)
    assert anchors[0][0] == anchors[1][0] == anchors[2][0] == (0, ((1, 2),))  # the prompt: the whole group
    assert anchors[0][1] == anchors[1][1] == (0, ((1, 2), (50, 51)))  # same documents, different thoughts
    assert anchors[2][1] != anchors[0][1]
    assert anchors[0][2] == (0, ((1, 2), (50, 51), (60,))) != anchors[2][2]  # histories differ before (60,)
    assert anchors[3][0] == (1, ((3,),))


def test_gigpo_hand_computed():
    """ω = 1, γ = 0.95, F_norm = 1 (verl-agent's defaults). A^E: group rewards [1, 0, 1], mean 2/3. Step groups
    {A0, B0, C0} with returns [0.95², 0, 0.95²] and {A1, B1} with [0.95, 0]; the rest are singletons (0)."""
    _, batch = scripted()
    x = adv_input(batch, GRPOConfig())
    adv = gigpo(x)
    m0 = 2 * 0.9025 / 3
    assert per_step(adv, batch, 0) == pytest.approx([1 / 3 + 0.9025 - m0, 1 / 3 + 0.475, 1 / 3])
    assert per_step(adv, batch, 1) == pytest.approx([-2 / 3 - m0, -2 / 3 - 0.475])
    assert per_step(adv, batch, 2) == pytest.approx([1 / 3 + 0.9025 - m0, 1 / 3, 1 / 3])
    assert per_step(adv, batch, 3) == [0.0]
    assert float((adv * (1 - batch.loss_mask)).abs().sum()) == 0  # nothing off the action tokens
    m = x.metrics
    assert m["gigpo/step_groups"] == 6 and m["gigpo/max_step_group"] == 3
    assert m["gigpo/step_group_size"] == pytest.approx(9 / 6)
    assert m["gigpo/grouped_step_rate"] == pytest.approx(5 / 9)


def verl_agent_gigpo(trajs, gamma, weight, remove_std, eps=1e-6):
    """GiGPO as verl-agent computes it, one row per step (read from ``gigpo/core_gigpo.py``): the step's return
    γ^(T−1−t)·outcome (``compute_step_discounted_returns`` without process rewards), the episode advantage over
    the group's trajectories (``episode_norm_reward`` with ``compute_mean_std_cross_steps=False``), step groups
    by identical anchor observations inside a prompt group (``build_step_group``) and their normalised returns
    (``step_norm_reward``); the joint advantage ``episode + step_advantage_w · step``. Returns {(row, t): A}."""
    rows = []  # (group index, trajectory, step t, anchor, return, outcome)
    for i, tr in enumerate(trajs):
        T = len(tr.steps)
        for t in range(T):
            runs = tuple(tuple(s.token_ids) for s in tr.segments[: tr.steps[t].segment] if s.kind != "action")
            rows.append((tr.group_id, i, t, runs, gamma ** (T - 1 - t) * tr.reward, tr.reward))

    def norm(index, scores):  # step_norm_reward: a group of one has its own mean (advantage 0) and std 1
        by = defaultdict(list)
        for idx, s in zip(index, scores):
            by[idx].append(s)
        out = []
        for idx, s in zip(index, scores):
            v = torch.tensor(by[idx], dtype=torch.float64)
            std = v.std() if len(v) > 1 else torch.tensor(1.0)
            out.append(float(s - v.mean()) if remove_std else float((s - v.mean()) / (std + eps)))
        return out

    ep_scores = {}
    for g, i, *_ in rows:
        ep_scores.setdefault(i, (g, trajs[i].reward))
    ep_adv = {}
    by_group = defaultdict(list)
    for g, r in ep_scores.values():
        by_group[g].append(r)
    for i, (g, r) in ep_scores.items():
        v = torch.tensor(by_group[g])
        mean, std = (v.mean(), v.std()) if len(v) > 1 else (torch.tensor(0.0), torch.tensor(1.0))
        ep_adv[i] = float(r - mean) if remove_std else float((r - mean) / (std + eps))
    step_index = [(g, anchor) for g, _, _, anchor, _, _ in rows]  # build_step_group: per index, identical obs
    step_adv = norm(step_index, [ret for *_, ret, _ in rows])
    return {(i, t): ep_adv[i] + weight * sa for (g, i, t, *_), sa in zip(rows, step_adv)}


@pytest.mark.parametrize("normalize", ["mean", "mean_std"])
@pytest.mark.parametrize("gamma,weight", [(0.95, 1.0), (1.0, 0.5)])
def test_gigpo_equals_verl_agents_computation(normalize, gamma, weight):
    trajs, batch = scripted()
    cfg = GRPOConfig(gigpo=GiGPOSettings(step_weight=weight, gamma=gamma, normalize=normalize))
    adv = gigpo(adv_input(batch, cfg))
    ref = verl_agent_gigpo(trajs[:3], gamma, weight, remove_std=normalize == "mean")
    for b in range(3):
        assert per_step(adv, batch, b) == pytest.approx(
            [ref[(b, t)] for t in range(len(trajs[b].steps))], abs=1e-5
        )


def test_gigpo_without_repeated_states_is_grpo():
    """No step group larger than one beyond the first step, which every episode shares: with ω = 0 GiGPO is
    GRPO with F_norm = 1 exactly."""
    _, batch = scripted()
    adv = gigpo(adv_input(batch, GRPOConfig(gigpo=GiGPOSettings(step_weight=0.0))))
    assert per_step(adv, batch, 1) == pytest.approx([-2 / 3, -2 / 3])


# -------------------------------------------------------------------------------------------------- IGPO

# the answer's mean log-prob before each step (A: 0.1, 0.4, 0.9; B: 0.1, 0.05; C: 0.1, 0.2, 0.6)
BELIEFS = [[0.1, 0.4, 0.9], [0.1, 0.05], [0.1, 0.2, 0.6], []]


def with_beliefs(batch):
    t = torch.full(batch.step_mask.shape, float("nan"))
    for b, ps in enumerate(BELIEFS):
        for k, p in enumerate(ps):
            t[b, k] = math.log(p)
    batch.extras.more[PROBE_KEY] = t
    return batch


def test_igpo_group_baseline_hand_computed():
    """Turn rewards (eq. 4-5): A [0.3, 0.5, 1], B [−0.05, 0], C [0.1, 0.4, 1]; pooled over the group (population
    std, IGPO's joint mode), then summed backwards with γ = 1 (eq. 6)."""
    _, batch = scripted()
    batch = with_beliefs(batch)
    x = adv_input(batch, GRPOConfig(advantage="igpo"))
    adv = igpo(x)
    pool = np.array([0.3, 0.5, 1.0, -0.05, 0.0, 0.1, 0.4, 1.0])
    z = lambda r: (r - pool.mean()) / (math.sqrt(pool.var() + 1e-8) + 1e-6)  # noqa: E731
    assert per_step(adv, batch, 0) == pytest.approx([z(0.3) + z(0.5) + z(1), z(0.5) + z(1), z(1)], abs=1e-5)
    assert per_step(adv, batch, 1) == pytest.approx([z(-0.05) + z(0), z(0)], abs=1e-5)
    assert per_step(adv, batch, 2) == pytest.approx([z(0.1) + z(0.4) + z(1), z(0.4) + z(1), z(1)], abs=1e-5)
    assert per_step(adv, batch, 3) == [0.0]  # a lone reward: mean itself, std 1
    assert x.metrics["igpo/turn_reward"] == pytest.approx((0.3 + 0.5 - 0.05 + 0.1 + 0.4) / 5)


def igpo_reference(token_rewards, mask, index, gamma, eps=1e-6):
    """IGPO's ``compute_grpo_outcome_advantage`` in its joint mode, read from its ``core_algos.py``: rewards at
    each turn's last token (the final turn's outcome at the last action token), normalised over the group's
    non-zero turn rewards and final rewards (population std, +1e-8 under the root, 1 for one reward), then the
    turn-level backward accumulation A_i = r̂_i + γ A_{i+1}, broadcast over each turn's masked tokens."""
    B, T = token_rewards.shape
    last = torch.tensor([int(torch.nonzero(mask[b])[-1]) for b in range(B)])
    pos = torch.arange(T).expand(B, T)
    f1 = (pos == last[:, None]) & (mask == 1)
    ig = (mask == 1) & ~f1 & (token_rewards != 0)
    joint = f1 | ig
    out = torch.zeros(B, T, dtype=torch.float64)
    for g in set(index):
        rows = [b for b in range(B) if index[b] == g]
        vals = torch.cat([token_rewards[b][joint[b]] for b in rows]).double()
        mean = vals.mean()
        std = torch.sqrt(((vals - mean) ** 2).mean() + 1e-8) if len(vals) > 1 else torch.tensor(1.0)
        for b in rows:
            norm = torch.where(joint[b], (token_rewards[b] - mean) / (std + eps), torch.zeros(T).double())
            ends = joint[b].nonzero().flatten().tolist()
            nxt, advs = 0.0, []
            for p in reversed(ends):
                nxt = float(norm[p]) + gamma * nxt
                advs.append((p, nxt))
            prev = 0
            for p, a in reversed(advs):
                for t in range(prev, p + 1):
                    if mask[b, t] == 1:
                        out[b, t] = a
                prev = p + 1
    return out.float()


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_igpo_equals_the_released_computation(gamma):
    trajs, batch = scripted()
    batch = with_beliefs(batch)
    adv = igpo(adv_input(batch, GRPOConfig(advantage="igpo", igpo=IGPOSettings(gamma=gamma))))
    tok = torch.zeros_like(batch.loss_mask)  # IGPO's token-level rewards: information gain at each turn's end
    for b, ps in enumerate(BELIEFS[:3]):
        ends = batch.step_ends[b][batch.step_mask[b]].tolist()
        for k, end in enumerate(ends):
            tok[b, end] = ps[k + 1] - ps[k] if k + 1 < len(ps) else trajs[b].reward
    ref = igpo_reference(tok[:3], batch.loss_mask[:3], [0, 0, 0], gamma)
    assert torch.allclose(adv[:3], ref, atol=1e-5)


def test_igpo_per_turn_leave_one_out_baseline():
    """Returns (γ = 1): A [1.8, 1.5, 1], B [−0.05, 0], C [1.5, 1.4, 1]; each less the mean of the other episodes'
    returns at the same turn index, 0 where no other episode reached it."""
    _, batch = scripted()
    batch = with_beliefs(batch)
    adv = igpo(adv_input(batch, GRPOConfig(advantage="igpo", igpo=IGPOSettings(baseline="turn"))))
    assert per_step(adv, batch, 0) == pytest.approx([1.8 - 0.725, 1.5 - 0.7, 0.0])
    assert per_step(adv, batch, 1) == pytest.approx([-0.05 - 1.65, 0.0 - 1.45])
    assert per_step(adv, batch, 2) == pytest.approx([1.5 - 0.875, 1.4 - 0.75, 0.0])
    assert per_step(adv, batch, 3) == [0.0]


def test_igpo_log_prob_gain():
    _, batch = scripted()
    batch = with_beliefs(batch)
    x = adv_input(batch, GRPOConfig(advantage="igpo", igpo=IGPOSettings(gain="logprob", baseline="turn")))
    igpo(x)
    gains = [math.log(0.4 / 0.1), math.log(0.9 / 0.4), math.log(0.05 / 0.1), math.log(0.2 / 0.1), math.log(3)]
    assert x.metrics["igpo/turn_reward"] == pytest.approx(sum(gains) / 5)


def test_answer_probes_score_exactly_the_gold_tokens(qwen_tok):
    """On Qwen2.5's vocabulary: each probe is the row's tokens before the step's action, then the environment's
    answer with the gold answer's own tokens scored."""
    from searchrl.envs.search import SearchEnv

    env = SearchEnv.__new__(SearchEnv)  # only the tag set is read to write the probe
    from searchrl.envs.tags import TAGSETS

    env.tags = TAGSETS["search_r1"]
    text = env.answer_probe("Ann Lee")
    assert split_gold(text, "Ann Lee") == (text[: text.rfind(" Ann Lee")], " Ann Lee", " </answer>")
    trajs, batch = scripted()
    probes = answer_probes(trajs, batch, env, qwen_tok)
    assert [(p.row, p.slot) for p in probes] == [
        (0, 0),
        (0, 1),
        (0, 2),
        (1, 0),
        (1, 1),
        (2, 0),
        (2, 1),
        (2, 2),
    ]
    p = probes[1]  # row 0 before its second action: prompt, action, observation
    assert p.ids[: len([1, 2, 10, 11, 50, 51])] == [1, 2, 10, 11, 50, 51]
    assert qwen_tok.decode(p.ids[p.start : p.end]) == " Ann Lee"
    assert "<answer>" in qwen_tok.decode(p.ids[6 : p.start])
    with pytest.raises(ValueError, match="does not contain"):
        split_gold("<answer> x </answer>", "Ann Lee")


# ------------------------------------------------------------------------------------------- in training


def test_turn_credit_is_refused_where_it_cannot_apply(make_exp):
    from searchrl.app.experiment import check_arguments

    check_arguments(make_exp("algorithm.advantage=gigpo", "algorithm.gigpo={gamma: 0.9, step_weight: 0.5}"))
    check_arguments(make_exp("algorithm.advantage=igpo", "algorithm.igpo={baseline: turn, gain: logprob}"))
    with pytest.raises(ConfigError, match="gigpo"):
        check_arguments(make_exp("algorithm.advantage=igpo", "algorithm.gigpo={gamma: 2}"))
    with pytest.raises(ConfigError, match="baseline"):
        check_arguments(make_exp("algorithm.advantage=igpo", "algorithm.igpo={baseline: episode}"))
    with pytest.raises(ConfigError, match="sequence-level"):
        check_arguments(make_exp("algorithm.advantage=gigpo", "env.context={max_tokens: 100}"))
    with pytest.raises(ValueError, match="SLATE row is one step"):
        from searchrl.algorithms.slate import SLATEConfig

        SLATEConfig(advantage="gigpo")


def test_probe_pass_scores_the_probes_with_the_policy(make_exp, tmp_path):
    """The trainer's probe pass (batched, micro-batched, no grad) gives each probe the mean log-prob of its
    gold tokens that a direct forward of the policy gives, filed at its row and step slot."""
    exp = make_exp()
    cfg = TrainerConfig(steps=1, batch_size=2, micro_batch_size=2, save_every=10**6)
    tr = trainer_for(exp, "grpo", cfg, args={"kl_coef": 0.0, "advantage": "igpo"}, out=tmp_path / "run")
    trajs, batch = scripted()
    tr.training_step._probe_pass(trajs, batch, 0)
    beliefs = batch.extras.more[PROBE_KEY]
    probes = tr.algo.probes(trajs, batch)
    assert len(probes) == 8 and int(torch.isfinite(beliefs).sum()) == 8
    for p in (probes[0], probes[-1]):
        with torch.no_grad():
            logits = tr.policy(torch.tensor([p.ids])).logits[0].float()
        logp = torch.log_softmax(logits / exp.rollout.temperature, -1)
        direct = sum(float(logp[t - 1, p.ids[t]]) for t in range(p.start, p.end)) / (p.end - p.start)
        assert float(beliefs[p.row, p.slot]) == pytest.approx(direct, abs=1e-4)


def test_igpo_without_a_probe_gives_no_gain_not_nan():
    """A row whose probes are missing (an example without a gold answer has none) gets no information gain; its
    last turn keeps its outcome and every advantage stays finite."""
    _, batch = scripted()
    batch = with_beliefs(batch)
    batch.extras.more[PROBE_KEY][1] = float("nan")
    x = adv_input(batch, GRPOConfig(advantage="igpo", igpo=IGPOSettings(baseline="turn")))
    adv = igpo(x)
    assert torch.isfinite(adv).all()
    assert per_step(adv, batch, 1) == pytest.approx([0.0 - 1.65, 0.0 - 1.45])  # B's first turn: no gain
