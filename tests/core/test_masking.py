"""Property tests of the masker (hypothesis): masks from segment kinds, steps in token space, truncation."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from searchrl.core.masking import build_batch
from searchrl.core.records import Example
from searchrl.core.types import Segment, Step, StepInfo, Trajectory

EX = Example(id="x", question="q", answers=("a",))
PAD = 0


@st.composite
def trajectories(draw):
    """prompt, then alternating action / observation segments (the observation may be missing at the end)."""
    n_steps = draw(st.integers(0, 5))
    segs = [Segment("prompt", draw(st.lists(st.integers(1, 50), min_size=1, max_size=6)))]
    steps = []
    length = len(segs[0].token_ids)
    for _ in range(n_steps):
        ids = draw(st.lists(st.integers(1, 50), min_size=1, max_size=6))
        segs.append(Segment("action", ids, [-0.5] * len(ids)))
        length += len(ids)
        steps.append(Step(segment=len(segs) - 1, last_token=length - 1, info=StepInfo("search", True)))
        if draw(st.booleans()):
            obs = draw(st.lists(st.integers(1, 50), min_size=1, max_size=6))
            segs.append(Segment("observation", obs))
            length += len(obs)
    rewards = draw(st.lists(st.floats(-1, 1), min_size=len(steps), max_size=len(steps)))
    return Trajectory(EX, segs, steps, reward=draw(st.floats(-1, 1)), step_rewards=rewards)


@settings(max_examples=150, deadline=None)
@given(st.lists(trajectories(), min_size=1, max_size=4), st.one_of(st.none(), st.integers(2, 30)))
def test_masker_properties(trajs, max_len):
    b = build_batch(trajs, PAD, max_len)
    assert b.input_ids.shape[0] == len(trajs)
    for i, t in enumerate(trajs):
        n = min(len(t), max_len) if max_len else len(t)
        kinds = [s.kind for s in t.segments for _ in s.token_ids][:n]
        # the count of (surviving) action tokens equals loss_mask.sum()
        assert b.loss_mask[i].sum() == sum(k == "action" for k in kinds)
        assert b.attention_mask[i].sum() == n and (b.loss_mask[i, n:] == 0).all()
        # observation positions never carry loss, and masks follow segment kinds, not pad ids
        for pos, k in enumerate(kinds):
            assert bool(b.loss_mask[i, pos]) == (k == "action")
            assert bool(b.obs_mask[i, pos]) == (k == "observation")
        assert not (b.loss_mask[i].bool() & b.obs_mask[i]).any()
        assert b.input_ids[i, :n].tolist() == t.token_ids[:n]
        # step ends point at the last action token of each (surviving) step
        for s_idx, step in enumerate(t.steps):
            seg_start = sum(len(s.token_ids) for s in t.segments[: step.segment])
            last = seg_start + len(t.segments[step.segment].token_ids) - 1
            assert step.last_token == last
            if last < n:
                assert b.step_mask[i, s_idx] and b.step_ends[i, s_idx] == last
                assert b.loss_mask[i, last] == 1 and b.step_ids[i, last] == s_idx
                assert b.step_rewards[i, s_idx] == torch.tensor(t.step_rewards[s_idx], dtype=torch.float32)
                if last + 1 < n:
                    assert b.step_ids[i, last + 1] != s_idx  # nothing after the step's end belongs to it
            else:  # truncation is consistent: a step whose end was cut is dropped
                assert not b.step_mask[i, s_idx]
        assert (b.step_ids[i][b.loss_mask[i] == 0] == -1).all()
        assert (b.sampled_logprobs[i][b.loss_mask[i] == 1] == -0.5).all()


def test_padding_token_inside_actions_still_carries_loss():
    """A sampled token that equals the pad id is an action token all the same."""
    t = Trajectory(
        EX,
        [Segment("prompt", [5, 6]), Segment("action", [PAD, 7], [-1.0, -1.0])],
        [Step(1, 3, StepInfo("answer", True))],
    )
    b = build_batch([t], PAD)
    assert b.loss_mask[0].tolist() == [0, 0, 1, 1]


def test_select_and_trim_keep_rows_aligned():
    t1 = Trajectory(EX, [Segment("prompt", [1]), Segment("action", [2, 3], [0.0, 0.0])], [Step(1, 2, None)])
    t2 = Trajectory(
        EX, [Segment("prompt", [1, 1, 1]), Segment("action", [4], [0.0])], [Step(1, 3, None)], reward=1.0
    )
    b = build_batch([t1, t2], PAD)
    b.extras.more["adv"] = b.loss_mask * 2
    b.extras.more_tokens.add("adv")  # declared token-aligned: cut with the batch
    # per step slot, as wide as the batch by chance (4 slots, 4 tokens): not token-aligned, kept whole
    b.extras.more["per_slot"] = torch.arange(8.0).view(2, 4)
    s = b.select([1])
    assert s.rewards.tolist() == [1.0] and s.extras.more["adv"].shape == (1, 4)
    tr = b.select([0]).trim(3)
    assert tr.input_ids.tolist() == [[1, 2, 3]] and tr.extras.more["adv"].shape == (1, 3)
    assert tr.extras.more["per_slot"].tolist() == [[0.0, 1.0, 2.0, 3.0]]
    assert tr.step_ends.tolist() == b.step_ends[:1].tolist()


def test_batch_extras_are_a_typed_contract():
    """A misspelt field is an error, not a silent new key; a field the reader needs and the batch lacks names
    itself; select / trim / to carry every field present, token-aligned ones cut with the batch."""
    import pytest

    from searchrl.core.types import BatchExtras

    e = BatchExtras(old_logp=torch.ones(2, 4), episode_ids=torch.tensor([3, 5]))
    with pytest.raises(AttributeError):
        e.old_lopg = torch.zeros(2, 4)  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="no ref_logp"):
        e.need("ref_logp")
    with pytest.raises(AttributeError):
        e.need("advantage")
    cut = e.map(lambda v: v[:, :3] if v.dim() == 2 else v)
    assert cut.old_logp.shape == (2, 3) and cut.episode_ids.tolist() == [3, 5] and cut.ref_logp is None
