"""Loaders from the standard multi-hop QA formats into `Example`.

Formats (schemas in each dataset's README):
- ``flashrag``: JSONL rows ``{id, question, golden_answers, metadata?}`` (Search-R1, FlashRAG, our synthetic world);
- ``hotpotqa``: the official JSON list with ``supporting_facts`` and ``context``;
- ``musique``: MuSiQue-Ans JSON/JSONL with ``question_decomposition`` (mapped to per-hop fields);
- ``2wiki``: 2WikiMultiHopQA JSON with ``evidences`` triples (mapped to per-hop fields).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from searchrl.core.errors import DataError
from searchrl.core.records import Doc, Example, Hop
from searchrl.data.example import read_json, read_jsonl

_STOP = set(
    [
        "a",
        "an",
        "the",
        "of",
        "in",
        "on",
        "at",
        "to",
        "for",
        "by",
        "with",
        "from",
        "is",
        "was",
        "were",
        "are",
        "be",
        "been",
        "who",
        "what",
        "which",
        "where",
        "when",
        "whose",
        "whom",
        "how",
        "did",
        "does",
        "do",
        "that",
        "this",
        "as",
        "its",
        "it",
        "his",
        "her",
        "their",
        "and",
        "or",
        "#1",
        "#2",
        "#3",
        "#4",
    ]
)


def keys_from_subquestion(question: str, answer_entity: str | None = None) -> tuple[str, ...]:
    """2-3 search-key strings for a sub-question: the relation form, content words, and the subject.

    MuSiQue writes some sub-questions as ``"Subject >> relation"``; others are natural questions.
    """
    keys: list[str] = []
    if ">>" in question:
        subj, _, rel = (s.strip() for s in question.partition(">>"))
        keys += [f"{subj} {rel}", subj]
    else:
        words = [w for w in re.findall(r"[\w'.-]+", question) if w.lower() not in _STOP]
        if words:
            keys.append(" ".join(words))
        caps = re.findall(r"(?:[A-Z][\w'.-]*\s?)+", question)
        if caps:
            keys.append(max(caps, key=len).strip())
    keys.append(question.strip().rstrip("?").strip())
    out: list[str] = []
    for k in keys:
        if k and k not in out:
            out.append(k)
    return tuple(out[:3])


def _load_json_or_jsonl(path: Path) -> list[dict[str, Any]]:
    if path.suffix == ".jsonl":
        return list(read_jsonl(path))
    data = read_json(path)
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON list of questions, got {type(data).__name__}")
    return data


def _title_index(corpus: list[Doc] | None) -> dict[str, str]:
    return {d.title: d.id for d in corpus} if corpus else {}


def _text_index(corpus: list[Doc] | None) -> dict[tuple[str, str], str]:
    return {(d.title, d.text.strip()): d.id for d in corpus} if corpus else {}


def load_flashrag(path: Path, corpus: list[Doc] | None = None) -> list[Example]:
    out = []
    for i, row in enumerate(read_jsonl(path)):
        if "question" not in row or ("golden_answers" not in row and "answers" not in row):
            raise DataError(f"{path}: row {i} needs 'question' and 'golden_answers', has {sorted(row)}")
        row.setdefault("id", str(i))
        try:
            out.append(Example.from_json(row))
        except DataError as exc:
            raise DataError(f"{path}: row {i}: {exc}") from None
    return out


def load_hotpotqa(path: Path, corpus: list[Doc] | None = None) -> list[Example]:
    titles = _title_index(corpus)
    out = []
    for row in _load_json_or_jsonl(path):
        gold_titles = list(dict.fromkeys(t for t, _ in row.get("supporting_facts", [])))
        out.append(
            Example(
                id=str(row["_id"]),
                question=row["question"],
                answers=(row["answer"],),
                gold_doc_ids=tuple(titles[t] for t in gold_titles if t in titles),
                metadata={
                    "format": "hotpotqa",  # evaluation also writes the official prediction file
                    "type": row.get("type"),
                    "level": row.get("level"),
                    "gold_titles": gold_titles,
                },
            )
        )
    return out


def load_musique(path: Path, corpus: list[Doc] | None = None) -> list[Example]:
    by_text = _text_index(corpus)
    out = []
    for row in _load_json_or_jsonl(path):
        paragraphs = {p["idx"]: p for p in row.get("paragraphs", [])}
        answers: list[str] = []
        hops = []
        for step in row["question_decomposition"]:
            q = step["question"]
            for j, prev in enumerate(answers, 1):  # "#1" -> first sub-answer
                q = q.replace(f"#{j}", prev)
            para = paragraphs.get(step.get("paragraph_support_idx"))
            title = para["title"] if para else None
            doc_id = by_text.get((para["title"], para["paragraph_text"].strip())) if para else None
            hops.append(
                Hop(
                    question=q,
                    answer=step["answer"],
                    gold_doc_id=doc_id,
                    gold_title=title,
                    keys=keys_from_subquestion(q),
                )
            )
            answers.append(step["answer"])
        out.append(
            Example(
                id=str(row["id"]),
                question=row["question"],
                answers=(row["answer"], *row.get("answer_aliases", [])),
                hops=tuple(hops),
                gold_doc_ids=tuple(h.gold_doc_id for h in hops if h.gold_doc_id is not None),
                metadata={"answerable": row.get("answerable", True)},
            )
        )
    return out


def load_2wiki(path: Path, corpus: list[Doc] | None = None) -> list[Example]:
    """2WikiMultiHopQA: each evidence triple (subject, relation, object) becomes a hop."""
    titles = _title_index(corpus)
    out = []
    for row in _load_json_or_jsonl(path):
        gold_titles = list(dict.fromkeys(t for t, _ in row.get("supporting_facts", [])))
        hops = []
        for subj, rel, obj in row.get("evidences", []):
            q = f"{subj} >> {rel.replace('_', ' ')}"
            title = subj if subj in gold_titles else None
            hops.append(
                Hop(
                    question=q,
                    answer=obj,
                    gold_doc_id=titles.get(subj),
                    gold_title=title,
                    keys=keys_from_subquestion(q),
                )
            )
        out.append(
            Example(
                id=str(row["_id"]),
                question=row["question"],
                answers=(row["answer"],),
                hops=tuple(hops),
                gold_doc_ids=tuple(titles[t] for t in gold_titles if t in titles),
                metadata={"type": row.get("type"), "gold_titles": gold_titles},
            )
        )
    return out


LOADERS: dict[str, Callable[[Path, list[Doc] | None], list[Example]]] = {
    "flashrag": load_flashrag,
    "hotpotqa": load_hotpotqa,
    "musique": load_musique,
    "2wiki": load_2wiki,
}


def sniff_format(path: Path) -> str:
    """Guess a question file's format from its first record."""
    if path.suffix == ".jsonl":
        first = next(iter(read_jsonl(path)), {})
    else:
        data = read_json(path)
        first = data[0] if isinstance(data, list) and data else {}
    if not first:
        raise DataError(f"{path}: no questions (empty, or not a list of question records)")
    if "question_decomposition" in first:
        return "musique"
    if "evidences" in first:
        return "2wiki"
    if "supporting_facts" in first and "context" in first:
        return "hotpotqa"
    if "golden_answers" in first:
        return "flashrag"
    raise DataError(
        f"{path}: cannot tell the format from its first record (keys {sorted(first)}); "
        f"pass one of: {', '.join(LOADERS)}"
    )


def load_examples(
    path: str | Path, fmt: str = "auto", corpus: list[Doc] | None = None, limit: int | None = None
) -> list[Example]:
    """Load questions in any supported format; ``corpus`` lets gold paragraphs be mapped to doc ids."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: question file not found")
    if fmt == "auto":
        fmt = sniff_format(path)
    if fmt not in LOADERS:
        raise DataError(f"unknown data format {fmt!r}; valid: auto, {', '.join(LOADERS)}")
    try:
        examples = LOADERS[fmt](path, corpus)
    except (
        KeyError,
        TypeError,
        AttributeError,
        IndexError,
    ) as exc:  # a record without a field the format has
        raise DataError(
            f"{path}: not a {fmt} question file: a record lacks or mistypes a field "
            f"({type(exc).__name__}: {exc})"
        ) from None
    if not examples:
        raise DataError(f"{path}: no questions")
    seen: dict[str, int] = {}
    for i, ex in enumerate(examples, 1):
        if ex.id in seen:  # predictions are kept by id: two questions under one id could not be told apart
            raise DataError(
                f"{path}: question id {ex.id!r} appears twice (records {seen[ex.id]} and {i}); every id must be "
                "unique"
            )
        seen[ex.id] = i
    return examples[:limit] if limit is not None else examples
