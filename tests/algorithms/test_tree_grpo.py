"""Tree-GRPO (arXiv 2509.21240): its advantages against hand-computed values, its nodes and node prefixes
(token ids as sampled, the environment state rebuilt), and a training step on the quickstart world."""

from __future__ import annotations

import math

import pytest
import torch

from searchrl.algorithms.tree_grpo import TreeGRPOConfig, node_prefix, nodes, tree_advantages
from searchrl.core.config import TrainerConfig
from searchrl.core.errors import ConfigError
from searchrl.core.types import EnvState
from tests.algorithms.test_turn_credit import EX, episode
from tests.engine.test_trainer import trainer_for


def test_intra_plus_inter_tree_advantage_hand_computed():
    """Two trees of one question: leaves [1, 0, 1] and [0, 0, 1]. Intra: within each tree (mean 2/3 and 1/3,
    std √(1/3)); inter: over the six leaves (mean 1/2, std √0.3); eq. 9 adds them."""
    r = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    trees = torch.tensor([6, 6, 6, 7, 7, 7])  # question 3, trees 0 and 1 (M = 2)
    adv = tree_advantages(r, trees, trees=2, std_normalize=True, eps=0.0)
    s3, s6 = math.sqrt(1 / 3), math.sqrt(0.3)
    intra = [1 / 3 / s3, -2 / 3 / s3, 1 / 3 / s3, -1 / 3 / s3, -1 / 3 / s3, 2 / 3 / s3]
    inter = [0.5 / s6 if x else -0.5 / s6 for x in r.tolist()]
    assert adv.tolist() == pytest.approx([a + b for a, b in zip(intra, inter)], abs=1e-6)
    mean_only = tree_advantages(r, trees, 2, std_normalize=False, eps=0.0)
    assert mean_only.tolist() == pytest.approx(
        [1 / 3 + 0.5, -2 / 3 - 0.5, 1 / 3 + 0.5, -1 / 3 - 0.5, -1 / 3 - 0.5, 2 / 3 + 0.5]
    )
    pad = tree_advantages(torch.tensor([1.0, 0.0, 0.0]), torch.tensor([4, 4, -1]), 2, True, 1e-6)
    assert pad[2] == 0  # a padding row (negative group id) is no leaf


class Replayer:
    """An environment that rebuilds a state from recorded actions and observations (`SearchEnv.replay`'s contract)."""

    def replay(self, example, actions, observations):
        return EnvState(example, "p", list(actions), list(observations), [None] * len(actions))


def leaf(first_obs, second):
    t = episode([1, 2], [([10, 11], first_obs), (second, [60]), ([13], None)], 1.0, 0)
    t.state = EnvState(EX, "p", ["a0", "a1", "a2"], ["o0", "o1"], [], retrieved=[["d0"], ["d1"]])
    return t


def test_nodes_and_node_prefixes():
    """A tree's nodes: the prompt and every step an observation followed, a node shared by two leaves once; a
    node prefix keeps the leaf's token ids and log-probs up to the node's observation, its state rebuilt and
    live, the documents its steps retrieved kept."""
    a, b = leaf([50, 51], [12]), leaf([50, 51], [22])  # same first step and documents, different second step
    tree = [a, b]
    assert nodes(tree) == [(0, -1), (0, 0), (0, 1), (1, 1)]  # (1, 0) is (0, 0): the same tokens
    kid = node_prefix(a, 0, Replayer())
    assert kid.token_ids == [1, 2, 10, 11, 50, 51] and kid.segments[1] is a.segments[1]  # as sampled
    assert [s.kind for s in kid.segments] == ["prompt", "action", "observation"] and len(kid.steps) == 1
    assert kid.state.actions == ["a0"] and not kid.state.done and kid.state.retrieved == [["d0"]]
    assert kid.state.generated_tokens == 2 and kid.info == {"tree_node": 1} and kid.reward == 0.0
    root = node_prefix(a, -1, Replayer())
    assert root.token_ids == [1, 2] and root.steps == [] and root.state.actions == []
    assert a.token_ids == [1, 2, 10, 11, 50, 51, 12, 60, 13]  # the leaf itself is untouched


def test_config_is_checked(make_exp):
    from searchrl.app.experiment import check_arguments

    assert TreeGRPOConfig(trees=2, rounds=2, expansions=3).leaves == 7
    with pytest.raises(ValueError, match="own intra- and inter-tree"):
        TreeGRPOConfig(advantage="rloo")
    with pytest.raises(ValueError, match="expansions"):
        TreeGRPOConfig(expansions=0)
    check_arguments(make_exp("algorithm={name: tree_grpo, trees: 2, rounds: 1, expansions: 2}"))
    with pytest.raises(ConfigError, match="env.tools"):
        check_arguments(
            make_exp(
                "algorithm={name: tree_grpo}",
                "env.protocol=tools",
                "env.template=tools",
                'env.tools=[{name: search}, {name: mcp, args: {server: "http://127.0.0.1:9/mcp"}}]',
            )
        )


def test_tree_grpo_trains_a_step_and_leaves_extend_their_nodes(make_exp, tmp_path):
    """Two questions × M 2 trees × (1 + L 1 · N 2) leaves; every expanded leaf begins with the tokens of a node of
    another leaf of its tree (its prefix is not generated again), and its own steps follow."""
    exp = make_exp("rollout.temperature=1.0", "rewards=[{name: test_trainer_length}]")
    cfg = TrainerConfig(steps=1, batch_size=2, micro_batch_size=12, lr=5e-3, save_every=10**6)
    args = {"kl_coef": 0.0, "trees": 2, "rounds": 1, "expansions": 2}
    tr = trainer_for(exp, "tree_grpo", cfg, args=args, out=tmp_path / "run")
    leaves, metrics = tr.algo.collect([0, 1])
    assert len(leaves) == 12 and metrics["tree/leaves"] == 12
    by_tree: dict[int, list] = {}
    for t in leaves:
        by_tree.setdefault(t.group_id, []).append(t)
    assert sorted(by_tree) == [0, 1, 2, 3] and all(len(v) == 3 for v in by_tree.values())
    for tree in by_tree.values():
        first = tree[0]
        for kid in tree[1:]:
            n = kid.info["tree_node"]
            end = kid.steps[n - 1].segment + 2 if n else 1
            prefix = [tok for s in kid.segments[:end] for tok in s.token_ids]
            assert any(o is not kid and o.token_ids[: len(prefix)] == prefix for o in tree), (n, prefix)
            assert kid.token_ids[: len(first.segments[0].token_ids)] == first.segments[0].token_ids
    before = {k: v.detach().clone() for k, v in tr.policy.named_parameters()}
    m = tr.step(0)
    assert torch.isfinite(torch.tensor(m["train/loss"])) and m["tree/leaves"] == 12
    assert any(not torch.equal(before[k], v) for k, v in tr.policy.named_parameters())
