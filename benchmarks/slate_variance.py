"""SLATE Theorem 1 on the synthetic world: per-sample advantage variance of truncated step-level sampling
against full-trajectory GRPO sampling (k = G), under the same dense reward, for a fixed policy.

    python benchmarks/slate_variance.py --model runs/quickstart/sft/final [--k 8] [--limit 400]

Both estimators are mean-centred, as in the theorem: GRPO A_i = R(τ_i) − mean_G R with R = Σ_t r_t (every
step of every full episode scored by the rule judge, eq. 5-6), truncated A_t^(j) = r_t^(j) − mean_k r_t
with k candidates branched from prefixes τ<t of the policy's own episodes. Reported per hop count, with
the mean number of steps T of the policy's episodes, against the bound ratio ≤ 1/T.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
from collections import defaultdict
from pathlib import Path

import torch

from searchrl.algorithms.slate import step_reward
from searchrl.app.experiment import load_experiment
from searchrl.app.resources import Resources
from searchrl.core.types import EnvState
from searchrl.models.load import load_model_and_tokenizer
from searchrl.rewards.judges import JudgeItem, RuleJudge
from searchrl.rollout.generator import SamplingParams
from searchrl.rollout.hf import HFGenerator
from searchrl.rollout.loop import branch, rollout, run, start_trajectories

REPO = Path(__file__).resolve().parents[1]


def prefix_state(state: EnvState, t: int) -> EnvState:
    """The episode before its step t (0-based)."""
    s = copy.copy(state)
    s.actions, s.observations = state.actions[:t], state.observations[:t]
    s.infos, s.retrieved = state.infos[:t], state.retrieved[:t]
    s.done = False
    return s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(REPO / "experiments" / "quickstart.yaml"))
    p.add_argument("--model", required=True)
    p.add_argument("--k", type=int, default=8, help="k = G")
    p.add_argument("--split", default="train")
    p.add_argument("--limit", type=int, default=400)
    p.add_argument("--bonus", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = p.parse_args()
    exp = load_experiment(args.config)
    resources = Resources(exp)
    env = resources.env()
    model, tok = load_model_and_tokenizer(args.model)
    gen = HFGenerator(model.eval(), tok, env.tags.stop_strings, batch_size=256)
    params = SamplingParams(exp.rollout.temperature, exp.rollout.top_p, exp.rollout.max_new_tokens)
    judge = RuleJudge()
    B = env.max_turns + 1
    examples = resources.examples(args.split)[: args.limit]
    torch.manual_seed(args.seed)

    def score(items_and_steps):
        items = [it for it, _ in items_and_steps]
        return [
            step_reward(s, it.info.kind, t, B, args.bonus)
            for s, (it, t) in zip(judge(items), items_and_steps)
        ]

    # (A) GRPO: G full episodes per question, R = sum of the judged step rewards
    trajs, _ = rollout(examples, env, gen, tok, params, args.k, exp.rollout.max_total_tokens)
    grpo_sq: dict[int, list[float]] = defaultdict(list)
    steps_of: dict[int, list[int]] = defaultdict(list)
    for q, ex in enumerate(examples):
        group = trajs[q * args.k : (q + 1) * args.k]
        R = []
        for tr in group:
            st = tr.state
            items = [
                (JudgeItem(prefix_state(st, t), st.actions[t], st.infos[t], tuple(st.retrieved[t])), t + 1)
                for t in range(len(st.actions))
            ]
            R.append(sum(score(items)))
            steps_of[ex.n_hops].append(len(st.actions))
        mean = sum(R) / len(R)
        grpo_sq[ex.n_hops] += [(x - mean) ** 2 for x in R]
    # (B) truncated: k candidates from each prefix τ<t of the first policy episode of each question
    trunc_sq: dict[int, list[float]] = defaultdict(list)
    firsts = [trajs[q * args.k] for q in range(len(examples))]
    jobs = [(q, t) for q, tr in enumerate(firsts) for t in range(len(tr.state.actions))]
    for i in range(0, len(jobs), 64):
        chunk = jobs[i : i + 64]
        prefixes = []
        for q, t in chunk:
            [pre] = start_trajectories(env, tok, [examples[q]])
            pre.state = prefix_state(firsts[q].state, t)
            # rebuild the prefix's tokens: prompt, then (action, observation) for the first t steps
            segs, steps_seen = [firsts[q].segments[0]], 0
            for s in firsts[q].segments[1:]:
                if s.kind == "action":
                    if steps_seen == t:
                        break
                    steps_seen += 1
                segs.append(s)
            pre.segments = list(segs)
            pre.steps = firsts[q].steps[:t]
            prefixes.append(pre)
        kids = branch(prefixes, args.k)
        run(kids, env, gen, tok, params, exp.rollout.max_total_tokens, max_steps=1)
        for g, (q, t) in enumerate(chunk):
            group = [k for k in kids[g * args.k : (g + 1) * args.k] if len(k.state.actions) > t]
            if len(group) < 2:
                continue
            r = score(
                [
                    (
                        JudgeItem(
                            prefix_state(k.state, t),
                            k.state.actions[t],
                            k.state.infos[t],
                            tuple(k.state.retrieved[t]),
                        ),
                        t + 1,
                    )
                    for k in group
                ]
            )
            mean = sum(r) / len(r)
            trunc_sq[examples[q].n_hops] += [(x - mean) ** 2 for x in r]
    rows = {}
    print(f"k = G = {args.k}, {len(examples)} {args.split} questions, policy {args.model}\n")
    print(
        "| hops | mean steps T | GRPO Var[A] | truncated Var[A] | ratio | bound 1/T |\n|---|---|---|---|---|---|"
    )
    for h in sorted(grpo_sq):
        T = statistics.mean(steps_of[h])
        vg, vt = statistics.mean(grpo_sq[h]), statistics.mean(trunc_sq[h]) if trunc_sq[h] else float("nan")
        ratio = vt / vg if vg > 0 else float("nan")
        rows[h] = {
            "steps": T,
            "grpo_var": vg,
            "truncated_var": vt,
            "ratio": ratio,
            "bound": 1 / T,
            "questions": len(grpo_sq[h]) // args.k,
        }
        print(f"| {h} | {T:.2f} | {vg:.3f} | {vt:.3f} | {ratio:.3f} | {1 / T:.3f} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "slate_variance.json").write_text(
        json.dumps({"k": args.k, "model": args.model, "rows": rows}, indent=1)
    )


if __name__ == "__main__":
    main()
