"""Synthetic multi-hop world: invented entities, one document each, compositional 1-4 hop questions.

No model can know these facts, so an agent must search and copy what it reads. The world is split into
disjoint sub-worlds (train / dev / test) that share only the countries: a test question's chain uses
entities whose facts never appear in any train question. The corpus holds every sub-world, so other
splits' documents are realistic distractors. Output is byte-identical for a seed.
"""

from __future__ import annotations

import json
import random
import re
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from searchrl.core.config import WorldConfig
from searchrl.core.errors import DataError
from searchrl.core.records import Doc, Example, Hop
from searchrl.data.example import read_jsonl, write_jsonl
from searchrl.envs.synthetic.names import make_names
from searchrl.envs.synthetic.schema import (
    ATTRIBUTES,
    DISTRACTORS,
    INTROS,
    KINDS,
    QUESTION_WRAPPERS,
    RELATIONS_BY_SUBJECT,
    Relation,
)

SPLITS = ("train", "dev", "test")


@dataclass
class Entity:
    id: str
    kind: str
    name: str  # a single invented word; the renaming unit
    split: str  # sub-world ("shared" for countries)
    attrs: dict[str, Any] = field(default_factory=dict)
    facts: dict[str, str] = field(default_factory=dict)  # relation name -> object entity id

    @property
    def display(self) -> str:
        return f"{self.name} University" if self.kind == "university" else self.name

    @property
    def aliases(self) -> tuple[str, ...]:
        if self.kind == "university":
            return (self.display, f"University of {self.name}", self.name)
        if self.kind == "country":
            return (self.name, f"Republic of {self.name}")
        return (self.name,)


class World:
    def __init__(self, config: WorldConfig, entities: list[Entity], name_pool: dict[str, list[str]]) -> None:
        self.config = config
        self.entities = entities
        self.by_id = {e.id: e for e in entities}
        self.name_pool = name_pool  # kind -> every invented name (entity names first)
        self.kind_of_name = {n: k for k, names in name_pool.items() for n in names}
        self._examples: dict[str, list[Example]] = {}

    # ------------------------------------------------------------------ generation
    @classmethod
    def generate(cls, config: WorldConfig | None = None) -> World:
        config = config or WorldConfig()
        rng = random.Random(config.seed)
        taken: set[str] = set()
        pool = {
            kind: make_names(rng, kind, max(1, round(config.count(kind) * config.name_pool_factor)), taken)
            for kind in KINDS
        }
        entities: list[Entity] = []
        for kind in KINDS:
            n = config.count(kind)
            splits = ["shared"] * n if kind == "country" else _split_labels(n, config.split_fractions)
            for i in range(n):
                entities.append(Entity(id=f"{kind}_{i:04d}", kind=kind, name=pool[kind][i], split=splits[i]))
        members: dict[tuple[str, str], list[Entity]] = defaultdict(list)
        for e in entities:
            members[(e.kind, e.split)].append(e)
        for e in entities:
            e.attrs = _attributes(rng, e.kind)
            for rel in RELATIONS_BY_SUBJECT[e.kind]:
                split = "shared" if rel.object == "country" else e.split
                e.facts[rel.name] = rng.choice(members[(rel.object, split)]).id
        return cls(config, entities, pool)

    # ------------------------------------------------------------------ corpus
    def documents(self) -> list[Doc]:
        rng = random.Random(self.config.seed + 1)
        subjects_of: dict[tuple[str, str], list[Entity]] = defaultdict(list)
        for e in self.entities:
            for rel_name, obj in e.facts.items():
                subjects_of[(obj, f"{e.kind}.{rel_name}")].append(e)
        by_kind: dict[str, list[Entity]] = defaultdict(list)
        for e in self.entities:
            by_kind[e.kind].append(e)
        docs = []
        for e in self.entities:
            s = e.display
            intro = rng.choice(INTROS[e.kind]).format(s=s, **e.attrs)
            body = []
            for rel in RELATIONS_BY_SUBJECT[e.kind]:
                facts = rel.facts[: self.config.phrasings]
                body.append(rng.choice(facts).format(s=s, o=self.by_id[e.facts[rel.name]].display))
            for rel in _relations_with_object(e.kind):
                subs = subjects_of.get((e.id, f"{rel.subject}.{rel.name}"), [])
                if subs and self.config.inverse_mentions > 0:
                    picked = rng.sample(subs, min(len(subs), self.config.inverse_mentions))
                    body.append(rel.inverse.format(o=s, subjects=_join([x.display for x in picked])))
            options = DISTRACTORS[e.kind]
            for template, kind in rng.sample(options, min(len(options), self.config.distractors_per_doc)):
                other = rng.choice([x for x in by_kind[kind] if x.id != e.id])
                body.append(template.format(s=s, x=other.display))
            rng.shuffle(body)
            docs.append(Doc(id=e.id, title=s, text=" ".join([intro, *body])))
        if self.config.coverage < 1.0:  # the coverage ablation: its own draw, so a full corpus is unchanged
            keep = random.Random(self.config.seed + 2).sample(
                range(len(docs)), round(len(docs) * self.config.coverage)
            )
            docs = [docs[i] for i in sorted(keep)]
        return docs

    # ------------------------------------------------------------------ questions
    def chains(self, split: str) -> list[tuple[Entity, tuple[Relation, ...]]]:
        """Every (start entity, relation path) of 1-4 hops inside a split's sub-world."""
        max_hops = len(self.config.hop_weights)
        out = []

        def walk(start: Entity, cur: Entity, path: tuple[Relation, ...]) -> None:
            if path:
                out.append((start, path))
            if len(path) == max_hops:
                return
            for rel in RELATIONS_BY_SUBJECT[cur.kind]:
                walk(start, self.by_id[cur.facts[rel.name]], (*path, rel))

        for e in self.entities:
            if e.split == split:
                walk(e, e, ())
        return out

    def make_question(
        self, rng: random.Random, qid: str, start: Entity, path: tuple[Relation, ...]
    ) -> Example:
        entities = [start]
        for rel in path:
            entities.append(self.by_id[entities[-1].facts[rel.name]])
        desc = start.display
        for rel in path[:-1]:
            desc = rel.noun.format(d=desc)
        q = path[-1].question.format(d=desc)
        wrapper = rng.choice(QUESTION_WRAPPERS)
        q = wrapper.format(q=q, q_lower=q[0].lower() + q[1:])
        hops = []
        for rel, subj, obj in zip(path, entities, entities[1:]):
            hops.append(
                Hop(
                    question=rel.question.format(d=subj.display),
                    answer=obj.display,
                    gold_doc_id=subj.id,
                    gold_title=subj.display,
                    keys=tuple(k.format(s=subj.display) for k in rel.keys),
                )
            )
        answer = entities[-1]
        return Example(
            id=qid,
            question=q,
            answers=answer.aliases,
            hops=tuple(hops),
            gold_doc_ids=tuple(h.gold_doc_id for h in hops if h.gold_doc_id),
            metadata={
                "source": "synthetic",
                "world_seed": self.config.seed,
                "n_hops": len(path),
                "chain": [e.id for e in entities],
                "relations": [f"{r.subject}.{r.name}" for r in path],
                "answer_kind": answer.kind,
            },
        )

    def examples(self, split: str) -> list[Example]:
        if split not in SPLITS:
            raise DataError(f"unknown split {split!r}; valid: {', '.join(SPLITS)}")
        if split not in self._examples:
            idx = SPLITS.index(split)
            rng = random.Random(self.config.seed * 1000 + 17 + idx)
            by_hops: dict[int, list] = defaultdict(list)
            for start, path in self.chains(split):
                by_hops[len(path)].append((start, path))
            for chains in by_hops.values():
                rng.shuffle(chains)
            wanted = self.config.questions[idx]
            weights = list(self.config.hop_weights)
            out: list[Example] = []
            used: dict[int, int] = defaultdict(int)
            while len(out) < wanted and any(used[h + 1] < len(by_hops[h + 1]) for h in range(len(weights))):
                hops = rng.choices(range(1, len(weights) + 1), weights=weights)[0]
                if used[hops] >= len(by_hops[hops]):
                    continue  # this hop count is exhausted; the others still have chains
                start, path = by_hops[hops][used[hops]]
                used[hops] += 1
                out.append(self.make_question(rng, f"{split}-{len(out):05d}", start, path))
            self._examples[split] = out
        return self._examples[split]

    # ------------------------------------------------------------------ renaming
    _WORD = re.compile(r"\b[A-Z][a-z]+\b")

    def names_in(self, text: str) -> list[str]:
        return [w for w in dict.fromkeys(self._WORD.findall(text)) if w in self.kind_of_name]

    def rename_map(self, rng: random.Random, texts: list[str]) -> dict[str, str]:
        """A consistent map from every world name in ``texts`` to a fresh pool name of the same kind."""
        present = {n for t in texts for n in self.names_in(t)}
        mapping: dict[str, str] = {}
        used = set(present)
        for name in sorted(present):
            kind = self.kind_of_name[name]
            choices = [n for n in self.name_pool[kind] if n not in used]
            if not choices:
                continue  # pool exhausted for this kind: keep the name
            new = rng.choice(choices)
            used.add(new)
            mapping[name] = new
        return mapping

    def apply_renaming(self, text: str, mapping: dict[str, str]) -> str:
        if not mapping:
            return text
        return self._WORD.sub(lambda m: mapping.get(m.group(0), m.group(0)), text)

    # ------------------------------------------------------------------ files
    def save(self, out: str | Path) -> Path:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        write_jsonl(out / "corpus.jsonl", (d.to_json() for d in self.documents()))
        for split in SPLITS:
            write_jsonl(out / f"{split}.jsonl", (ex.to_json() for ex in self.examples(split)))
        meta = {
            "config": asdict(self.config),
            "entities": [asdict(e) for e in self.entities],
            "name_pool": self.name_pool,
        }
        (out / "world.json").write_text(json.dumps(meta, sort_keys=True, indent=1) + "\n", encoding="utf-8")
        return out

    @classmethod
    def load(cls, path: str | Path) -> World:
        path = Path(path)
        file = path / "world.json"
        if not file.exists():
            raise FileNotFoundError(
                f"{file} not found; create a world with `searchrl world --seed 0 --out {path}`"
            )
        meta = json.loads(file.read_text(encoding="utf-8"))
        cfg = meta["config"]
        config = WorldConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in cfg.items()})  # type: ignore[arg-type]
        world = cls(config, [Entity(**e) for e in meta["entities"]], meta["name_pool"])
        for split in SPLITS:
            f = path / f"{split}.jsonl"
            if f.exists():
                world._examples[split] = [Example.from_json(r) for r in read_jsonl(f)]
        return world


def _split_labels(n: int, fractions: tuple[float, float, float]) -> list[str]:
    counts = [round(n * f) for f in fractions]
    counts[0] = n - counts[1] - counts[2]
    if min(counts) < 1:
        raise DataError(f"a world with {n} entities of one kind cannot be split {fractions}; make it larger")
    return [s for s, c in zip(SPLITS, counts) for _ in range(c)]


def _attributes(rng: random.Random, kind: str) -> dict[str, Any]:
    attrs: dict[str, Any] = {k: rng.choice(v) for k, v in ATTRIBUTES.items()}
    attrs["a_occupation"] = ("an " if attrs["occupation"][0] in "aeiou" else "a ") + attrs["occupation"]
    attrs["year"] = rng.randint(1890, 2020)
    attrs["population"] = f"{rng.randint(2, 900) * 1000:,}"
    return attrs


def _relations_with_object(kind: str) -> Iterator[Relation]:
    for rels in RELATIONS_BY_SUBJECT.values():
        for rel in rels:
            if rel.object == kind:
                yield rel


def _join(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]
