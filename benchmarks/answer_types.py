"""Does a policy answer with the kind of entity the question asks for? By hops and asked kind, from the
predictions files of `searchrl train` / `searchrl eval` (``eval/*.predictions.jsonl``) and the synthetic world
they were evaluated on (``world/`` of the run directory).

    python benchmarks/answer_types.py runs/quickstart/eval/grpo-test.predictions.jsonl \
        runs/synthetic-grpo-tools/eval/grpo-test.predictions.jsonl --out benchmarks/results/answer_types.json

A policy that learned what to search but not when to stop answers with the right kind less often: the tool
quickstart's GRPO policy answered a country to 23% of the one-hop "in which city" questions (docs/tools.md).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any


def world_kinds(world_dir: Path) -> dict[str, str]:
    """Name -> kind (person, city, country, film, …) of a saved synthetic world, renamed names included."""
    from searchrl.envs.synthetic.world import World

    return World.load(world_dir).kind_of_name


def kind_of(text: str, kinds: dict[str, str]) -> str | None:
    """The kind of the entity ``text`` names, its aliases included ("Podei University", "University of
    Podei", "Republic of Zasulia")."""
    text = text.strip()
    for prefix in ("University of ", "Republic of "):
        text = text.removeprefix(prefix)
    return kinds.get(text.removesuffix(" University"))


def answer_types(predictions: Path, kinds: dict[str, str]) -> dict[str, Any]:
    """Per (hops, asked kind): questions, the share answered with the asked kind, with a country, and EM."""
    n: Counter[tuple[int, str]] = Counter()
    right: Counter[tuple[int, str]] = Counter()
    country: Counter[tuple[int, str]] = Counter()
    em: defaultdict[tuple[int, str], float] = defaultdict(float)
    for line in predictions.read_text().splitlines():
        d = json.loads(line)
        asked = next((k for a in d["answers"] if (k := kind_of(a, kinds))), "other")
        got = kind_of(d.get("prediction") or "", kinds)
        key = (int(d["hops"]), asked)
        n[key] += 1
        right[key] += got == asked
        country[key] += got == "country"
        em[key] += float(d["em"])
    return {
        f"{k[0]}-hop {k[1]}": {
            "n": n[k],
            "right_kind": right[k] / n[k],
            "answered_country": country[k] / n[k],
            "em": em[k] / n[k],
        }
        for k in sorted(n)
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("predictions", nargs="+", type=Path, help="eval/*.predictions.jsonl files")
    ap.add_argument(
        "--world", type=Path, help="a saved world's directory (default: the run directory's world/)"
    )
    ap.add_argument("--out", type=Path, help="write the tables here as JSON")
    args = ap.parse_args()
    out = {}
    for p in args.predictions:
        world = args.world or p.parent.parent / "world"
        table = answer_types(p, world_kinds(world))
        out[str(p)] = table
        print(p)
        for key, row in table.items():
            print(
                f"  {key:22s} n={row['n']:3d}  right kind {row['right_kind']:.2f}  "
                f"a country {row['answered_country']:.2f}  EM {row['em']:.2f}"
            )
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
