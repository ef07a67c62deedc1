"""Does a policy decide when to stop from the question? Its probability of searching on after the first
sub-answer, by the question's hop count, read off the warm start's own teacher trajectories.

The synthetic teacher writes ``<think> Found: <the sentence it read>.`` and then either `` Next: <the next
sub-question>`` (it searches on) or `` So the answer is …`` (it answers); with ``teacher.plan`` its thought
states the searches left in between (``Found: <sentence>. Steps left: 1.``), and the decision is scored after
that. On a one-hop question it always answers there; on a longer one it answers too early ``p_early`` of the
time (the mistake RL should remove). For each trajectory this scores the model's next token at that point,
teacher-forced on the teacher's context:

    P(continue) = P(" Next") / (P(" Next") + P(" So"))

A warm start that reads the question keeps P(continue) near 0 on one-hop questions and near the teacher's rate
on longer ones; GRPO should then raise it on longer questions only. "greedy_continues" is the share above 0.5
(the greedy policy searches on).

    python benchmarks/stop_decision.py runs/synthetic-grpo-tools/sft/final runs/synthetic-grpo-tools/final \
        --teacher runs/synthetic-grpo-tools/sft/teacher-4.jsonl --world runs/synthetic-grpo-tools/world

Trajectories of either protocol (tags or tools) work; the checkpoint's tokenizer must be the one they were
written for.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

# with teacher.plan the thought also states the searches left ("Found: ... Steps left: 1. Next: ...")
FOUND = re.compile(r"(<think> Found: .*?\.(?: Steps left: \d+\.)?)( So| Next| Let)")


def decision_points(teacher: Path, hops: dict[str, int], limit: int) -> list[tuple[str, int, str]]:
    """(context up to the first decision after a found sub-answer, hops, the teacher's choice) per record."""
    out = []
    with teacher.open() as f:
        for line in f:
            if len(out) >= limit:
                break
            rec = json.loads(line)
            if rec["id"] not in hops:
                continue
            text = rec["prompt"]
            for action, obs in zip(rec["actions"], rec["observations"], strict=True):
                m = FOUND.match(action)
                if m:
                    out.append((text + m.group(1), hops[rec["id"]], m.group(2).strip()))
                    break
                text += action + obs
    return out


def stop_decision(model_dir: Path, points: list[tuple[str, int, str]]) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = {w: tok.encode(f" {w}", add_special_tokens=False)[0] for w in ("Next", "So")}
    by_hops: defaultdict[str, list[tuple[float, str]]] = defaultdict(list)
    with torch.no_grad():
        for text, h, choice in points:
            x = torch.tensor([tok.encode(text, add_special_tokens=False)])
            p = model(x).logits[0, -1].float().softmax(-1)
            cont = (p[ids["Next"]] / (p[ids["Next"]] + p[ids["So"]])).item()
            by_hops["3+" if h >= 3 else str(h)].append((cont, choice))
    return {
        f"{h} hops": {
            "n": len(v),
            "p_continue": round(statistics.mean(c for c, _ in v), 3),
            "greedy_continues": round(sum(c > 0.5 for c, _ in v) / len(v), 3),
            "teacher_continues": round(sum(ch == "Next" for _, ch in v) / len(v), 3),
        }
        for h, v in sorted(by_hops.items())
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+", type=Path, help="model directories (the SFT's and GRPO's final/)")
    ap.add_argument("--teacher", type=Path, required=True, help="the warm start's sft/teacher-N.jsonl")
    ap.add_argument("--world", type=Path, required=True, help="the run directory's world/")
    ap.add_argument("--limit", type=int, default=500, help="decision points scored (default 500)")
    ap.add_argument("--out", type=Path, help="write the tables here as JSON")
    args = ap.parse_args()
    from searchrl.envs.synthetic.world import World

    hops = {e.id: len(e.hops) for e in World.load(args.world).examples("train")}
    points = decision_points(args.teacher, hops, args.limit)
    out = {}
    for m in args.models:
        out[str(m)] = table = stop_decision(m, points)
        print(m)
        for key, row in table.items():
            print(
                f"  {key:7s} n={row['n']:3d}  P(continue) {row['p_continue']:.3f}  "
                f"greedy continues {row['greedy_continues']:.2f}  teacher {row['teacher_continues']:.2f}"
            )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
