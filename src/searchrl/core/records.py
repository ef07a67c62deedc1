"""The records every layer passes around: a question (`Example`, its decomposition `Hop`s) and a retrieved
document (`Doc`). They live at the bottom so that the types above them (`core.types`) need nothing from the
data loaders (`searchrl.data`, which reads them from files)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from searchrl.core.errors import DataError


@dataclass(frozen=True)
class Hop:
    """One step of a question's decomposition (the per-hop fields StepSearch and RAG-Gym use)."""

    question: str  # sub-question, with earlier answers substituted in
    answer: str  # sub-answer
    gold_doc_id: str | None = None  # id of the supporting document in the corpus, if known
    gold_title: str | None = None
    keys: tuple[str, ...] = ()  # 2-3 gold search keyword strings (StepSearch eq. 4)


@dataclass(frozen=True)
class Example:
    id: str
    question: str
    answers: tuple[str, ...]  # gold answer first, then aliases
    hops: tuple[Hop, ...] = ()
    gold_doc_ids: tuple[str, ...] = ()  # supporting documents, when the data names them
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def n_hops(self) -> int:
        return len(self.hops)

    def to_json(self) -> dict[str, Any]:
        """FlashRAG/Search-R1 JSONL row: id, question, golden_answers, metadata (hops inside)."""
        meta = dict(self.metadata)
        if self.hops:
            meta["hops"] = [asdict(h) | {"keys": list(h.keys)} for h in self.hops]
        if self.gold_doc_ids:
            meta["gold_doc_ids"] = list(self.gold_doc_ids)
        return {
            "id": self.id,
            "question": self.question,
            "golden_answers": list(self.answers),
            "metadata": meta,
        }

    @classmethod
    def from_json(cls, row: dict[str, Any]) -> Example:
        meta = dict(row.get("metadata") or {})
        hops = tuple(
            Hop(
                question=h["question"],
                answer=h["answer"],
                gold_doc_id=h.get("gold_doc_id"),
                gold_title=h.get("gold_title"),
                keys=tuple(h.get("keys") or ()),
            )
            for h in meta.pop("hops", [])
        )
        field_name = "golden_answers" if "golden_answers" in row else "answers"
        return cls(
            id=str(row["id"]),
            question=row["question"],
            answers=gold_answers(row.get(field_name), f"row {row.get('id')!r}, field '{field_name}'"),
            hops=hops,
            gold_doc_ids=tuple(meta.pop("gold_doc_ids", [])),
            metadata=meta,
        )


def gold_answers(value: Any, where: str) -> tuple[str, ...]:
    """A row's gold answers: a list of non-empty strings (numbers become text; a lone string is a list of
    one). Null, an empty list, a null or empty answer, or any other type is refused, naming ``where``:
    the metrics would otherwise compare predictions with "None" or with nothing."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list | tuple):
        raise DataError(f"{where}: gold answers must be a list of strings, got {value!r}")
    if not value:
        raise DataError(f"{where}: the list of gold answers is empty")
    out = []
    for j, a in enumerate(value):
        if isinstance(a, bool) or not isinstance(a, str | int | float) or not str(a).strip():
            raise DataError(f"{where}: answer {j} must be a non-empty string, got {a!r}")
        out.append(str(a))
    return tuple(out)


@dataclass(frozen=True)
class Doc:
    id: str
    title: str
    text: str
    score: float = 0.0

    @property
    def contents(self) -> str:
        return f'"{self.title}"\n{self.text}'

    def to_json(self) -> dict[str, str]:
        return {"id": self.id, "contents": self.contents}

    @staticmethod
    def from_contents(doc_id: str, contents: str, score: float = 0.0) -> Doc:
        title, _, text = contents.partition("\n")
        return Doc(id=doc_id, title=title.strip().strip('"'), text=text.strip(), score=score)
