"""RAG-Gym: DPO against TRL's loss, the PRM loss, process-data collection, PRM-guided best-of-N, and
DPO / PRM training end to end on the tiny model."""

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from searchrl.algorithms import algorithm_config
from searchrl.algorithms.dpo import dpo_loss
from searchrl.algorithms.prm import prm_loss
from searchrl.app.process_data import collect, step_pairs
from searchrl.core.config import RolloutConfig
from searchrl.envs.search import SearchEnv
from searchrl.models import load_model_and_tokenizer
from searchrl.rollout.loop import encode
from tests.helpers import ScriptedCandidates


def trl_sigmoid_dpo(
    chosen, rejected, ref_chosen, ref_rejected, beta, loss_types=("sigmoid",), loss_weights=(1.0,)
):
    """TRL's own DPOTrainer loss code, run on given per-token log-probabilities (a stub trainer and model)."""
    from trl import DPOTrainer

    B, T = chosen.shape
    per_token = torch.cat([chosen, rejected])  # the batch is [chosen, rejected]
    outputs = SimpleNamespace(
        log_probs=per_token,
        entropy=torch.zeros(2 * B, T),
        mean_logits=torch.zeros(2 * B, T),
        is_top1=torch.zeros(2 * B, T, dtype=torch.bool),
    )
    model = SimpleNamespace(training=True)
    stub = SimpleNamespace(
        model=model,
        accelerator=SimpleNamespace(device="cpu", gather_for_metrics=lambda x: x, gather=lambda x: x),
        aux_loss_enabled=False,
        ld_alpha=None,
        precompute_ref_logps=True,
        f_divergence_type="reverse_kl",
        loss_types=list(loss_types),
        loss_weights=list(loss_weights),
        beta=beta,
        label_smoothing=0.0,
        use_weighting=False,
        _metrics=defaultdict(lambda: defaultdict(list)),
        _total_train_tokens=0,
        _tp_size=1,
    )
    inputs = {
        "input_ids": torch.zeros(2 * B, T + 1, dtype=torch.long),
        "attention_mask": torch.ones(2 * B, T + 1),
        "completion_mask": torch.ones(2 * B, T + 1),
        "ref_chosen_logps": ref_chosen,
        "ref_rejected_logps": ref_rejected,
    }
    return DPOTrainer._compute_loss(stub, lambda **kw: outputs, inputs, False)


@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_dpo_loss_equals_trl(beta):
    g = torch.Generator().manual_seed(0)
    chosen, rejected = -torch.rand(6, 5, generator=g) * 3, -torch.rand(6, 5, generator=g) * 3
    ref_c, ref_r = -torch.rand(6, generator=g) * 10, -torch.rand(6, generator=g) * 10
    ours, margin = dpo_loss(chosen.sum(1), rejected.sum(1), ref_c, ref_r, beta)
    theirs = trl_sigmoid_dpo(chosen, rejected, ref_c, ref_r, beta)
    assert float(ours.mean()) == pytest.approx(float(theirs), rel=1e-6)
    assert torch.allclose(margin, beta * ((chosen.sum(1) - ref_c) - (rejected.sum(1) - ref_r)))


@pytest.mark.parametrize("alpha", [0.5, 2.0])
def test_rpo_term_equals_trl_dpo_plus_its_sft_loss(alpha):
    g = torch.Generator().manual_seed(1)
    chosen, rejected = -torch.rand(4, 7, generator=g) * 3, -torch.rand(4, 7, generator=g) * 3
    ref_c, ref_r = -torch.rand(4, generator=g) * 10, -torch.rand(4, generator=g) * 10
    ours, _ = dpo_loss(
        chosen.sum(1), rejected.sum(1), ref_c, ref_r, 0.1, rpo_alpha=alpha, chosen_nll=-chosen.mean(1)
    )
    theirs = trl_sigmoid_dpo(chosen, rejected, ref_c, ref_r, 0.1, ("sigmoid", "sft"), (1.0, alpha))
    assert float(ours.mean()) == pytest.approx(float(theirs), rel=1e-6)
    plain, _ = dpo_loss(chosen.sum(1), rejected.sum(1), ref_c, ref_r, 0.1)
    assert float((ours - plain).mean()) == pytest.approx(alpha * float(-chosen.mean()), rel=1e-6)


def test_prm_loss_on_a_hand_made_pair():
    assert float(prm_loss(torch.tensor([2.0]), torch.tensor([0.5]))) == pytest.approx(
        math.log(1 + math.exp(-1.5))
    )
    assert float(prm_loss(torch.tensor([0.0]), torch.tensor([0.0]))) == pytest.approx(math.log(2))


def test_step_pairs_are_every_chosen_times_rejected():
    st = SimpleNamespace(
        example=SimpleNamespace(id="q", question="Q?"), prompt="P", actions=["a1"], observations=["o1"]
    )
    cands = [("good", 2.0), ("ok", 1.0), ("meh", 0.0), ("bad", -1.0), ("worse", -3.0)]
    pairs = step_pairs(SearchEnv(None), st, cands, chosen_min=1.0, rejected_max=-1.0)
    assert {(p["chosen"], p["rejected"]) for p in pairs} == {
        ("good", "bad"),
        ("good", "worse"),
        ("ok", "bad"),
        ("ok", "worse"),
    }
    assert all(p["prompt"] == "P" and p["actions"] == ["a1"] and p["step"] == 1 for p in pairs)


@pytest.fixture
def one_hop(tiny_model_dir, world_bm25, small_world, make_exp):
    _, tok = load_model_and_tokenizer(tiny_model_dir)
    ex = next(e for e in small_world.examples("train") if e.n_hops == 1)
    [[doc]] = world_bm25.search([ex.hops[0].keys[0]], 1)
    assert doc.id == ex.hops[0].gold_doc_id
    return tok, ex


def test_collection_keeps_correct_episodes_and_pairs_every_step(one_hop, make_exp, world_bm25):
    tok, ex = one_hop
    hop = ex.hops[0]
    gold, junk = (
        f"<think> a </think>\n<search> {hop.keys[0]} </search>",
        "<think> a </think>\n<search> zzq qqz </search>",
    )
    right, wrong = (
        f"<think> a </think>\n<answer> {ex.answers[0]} </answer>",
        "<think> a </think>\n<answer> nobody </answer>",
    )
    exp = make_exp("env.topk=1", "process_data={n: 4, chosen_min: 1.0, rejected_max: -1.0}")
    # step 1: gold search (1), junk search (-1), wrong answer (-2), malformed (-3) -> the gold search runs
    # step 2: right answer (2), wrong answer (-2), gold search again (every hop resolved: -1), junk (-1)
    gen = ScriptedCandidates(tok, [[gold, junk, wrong, "<think> x </think>"], [right, wrong, gold, junk]])
    resources = SimpleNamespace(
        exp=exp,
        env=lambda: SearchEnv(world_bm25, template="short", topk=1, max_turns=3),
        examples=lambda split: [ex],
    )
    pairs, records, summary = collect(resources, gen, tok, progress=False)
    assert summary["kept_episodes"] == 1 and summary["steps"] == 2 and len(records) == 1
    by_step = defaultdict(set)
    for p in pairs:
        by_step[p["step"]].add((p["chosen"], p["rejected"]))
    assert by_step[0] == {(gold, junk), (gold, wrong), (gold, "<think> x </think>")}
    assert by_step[1] == {(right, wrong), (right, gold), (right, junk)}
    assert records[0]["actions"] == [gold, right]


def test_a_wrong_final_answer_drops_the_episode(one_hop, make_exp, world_bm25):
    tok, ex = one_hop
    wrong = "<think> a </think>\n<answer> nobody </answer>"
    exp = make_exp("process_data={n: 2}")
    resources = SimpleNamespace(
        exp=exp,
        env=lambda: SearchEnv(world_bm25, template="short", topk=1, max_turns=3),
        examples=lambda split: [ex],
    )
    pairs, records, summary = collect(resources, ScriptedCandidates(tok, [[wrong]]), tok, progress=False)
    assert summary["kept_episodes"] == 0 and pairs == [] and records == []


class FixedScorer:
    """Scores an action by a table of its text."""

    def __init__(self, tok, table):
        self.tok, self.table = tok, table

    def score(self, states, actions):
        return [self.table.get(self.tok.decode(a), 0.0) for a in actions]


def test_best_of_n_follows_the_highest_prm_score(one_hop, world_bm25, tiny_model_dir):
    from searchrl.app.eval_episodes import run_best_of_n

    tok, ex = one_hop
    model, _ = load_model_and_tokenizer(tiny_model_dir)
    hop = ex.hops[0]
    a, b = (
        f"<think> a </think>\n<search> {hop.keys[0]} </search>",
        "<think> b </think>\n<answer> nobody </answer>",
    )
    c, d = (
        f"<think> c </think>\n<answer> {ex.answers[0]} </answer>",
        "<think> d </think>\n<answer> x </answer>",
    )
    env = SearchEnv(world_bm25, template="short", topk=1, max_turns=3)
    table = {
        tok.decode(encode(tok, a)): 1.0,
        tok.decode(encode(tok, b)): 0.5,
        tok.decode(encode(tok, c)): 3.0,
        tok.decode(encode(tok, d)): -1.0,
    }
    import searchrl.rollout.hf as hf

    gen = ScriptedCandidates(tok, [[b, a, b, a], [d, c, d, d]])
    orig = hf.HFGenerator
    try:
        hf.HFGenerator = lambda *args, **kw: gen  # the scripted candidates stand in for sampling
        [state] = run_best_of_n(model, tok, FixedScorer(tok, table), env, [ex], n=4, budget=RolloutConfig())
    finally:
        hf.HFGenerator = orig
    assert state.actions == [a, c] and state.answer == ex.answers[0]


def pair_records(small_world, n=8):
    out = []
    for ex in small_world.examples("train")[:n]:
        hop = ex.hops[0]
        out.append(
            {
                "id": ex.id,
                "question": ex.question,
                "prompt": f"Question: {ex.question}\n",
                "actions": [],
                "observations": [],
                "step": 0,
                "chosen": f"<think> a </think>\n<search> {hop.keys[0]} </search>",
                "rejected": "<think> a </think>\n<answer> nobody </answer>",
                "chosen_score": 1.0,
                "rejected_score": -2.0,
            }
        )
    return out


@pytest.mark.parametrize("lora", [False, True])
def test_dpo_trains_and_prefers_the_chosen_actions(make_exp, small_world, lora):
    from searchrl.algorithms import algorithm_config
    from searchrl.app.resources import Resources
    from searchrl.core.config import TrainerConfig
    from searchrl.engine.metrics import read_metrics
    from searchrl.engine.trainer import Trainer

    exp = make_exp(*(["model.lora={r: 4, alpha: 8}"] if lora else []))
    mini = 1 if lora else 2  # two mini-batches: pairs are shuffled as pairs
    cfg = TrainerConfig(steps=6, batch_size=4, micro_batch_size=4, lr=5e-3, save_every=6, mini_batches=mini)
    tr = Trainer(
        algorithm="dpo",
        config=algorithm_config("dpo", {"beta": 0.5}),
        model_path=exp.model.path,
        cfg=cfg,
        out_dir=exp.out,
        resources=Resources(exp),
        records=pair_records(small_world),
        seed=0,
    )
    assert tr.reference is not None and tr.reference.shared == lora
    tr.run()
    rows = read_metrics(exp.out / "metrics.jsonl")
    if mini == 1:
        assert rows[0]["train/dpo_margin"] == pytest.approx(0.0, abs=1e-5)  # policy == reference at the start
    assert rows[-1]["train/dpo_margin"] > 0.0 and rows[-1]["train/loss"] < rows[0]["train/loss"]


def test_prm_trains_saves_and_scores(make_exp, small_world):
    from searchrl.app.resources import Resources
    from searchrl.core.config import TrainerConfig
    from searchrl.engine.metrics import read_metrics
    from searchrl.engine.trainer import Trainer
    from searchrl.rewards.prm_scorer import PRMScorer

    exp = make_exp()
    cfg = TrainerConfig(steps=8, batch_size=4, micro_batch_size=8, lr=5e-3, save_every=8)
    recs = pair_records(small_world)
    tr = Trainer(
        algorithm="prm",
        config=algorithm_config("prm", {}),
        model_path=exp.model.path,
        cfg=cfg,
        out_dir=exp.out,
        resources=Resources(exp),
        records=recs,
        seed=0,
    )
    final = tr.run()
    rows = read_metrics(exp.out / "metrics.jsonl")
    assert rows[-1]["train/prm_accuracy"] == 1.0 and rows[-1]["train/loss"] < rows[0]["train/loss"]
    scorer = PRMScorer(final)
    state = encode(scorer.tokenizer, recs[0]["prompt"])
    good, bad = (encode(scorer.tokenizer, recs[0][k]) for k in ("chosen", "rejected"))
    s_good, s_bad = scorer.score([state, state], [good, bad])
    assert s_good > s_bad
    with pytest.raises(FileNotFoundError, match="not a PRM"):
        PRMScorer(exp.model.path)
