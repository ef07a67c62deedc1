"""The one question type every loader produces."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from searchrl.core.errors import DataError, read_text


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


def write_jsonl(path: str | Path, rows: Iterable[dict[str, Any]]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False, sort_keys=True) + "\n")


def read_json(path: str | Path) -> Any:
    """A JSON file, or a `DataError` naming it and the place where it stops being JSON."""
    try:
        return json.loads(read_text(path))
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}: not valid JSON (line {exc.lineno}: {exc.msg})") from None


def read_jsonl(path: str | Path) -> Iterator[dict[str, Any]]:
    """The records of a JSONL file, streamed line by line (a corpus of millions never sits in memory whole)."""
    p = Path(path)
    if p.is_dir() or not p.exists():
        read_text(p)  # the DataError naming it
    with p.open("rb") as f:  # decoded line by line, so that a bad byte is reported on its own line
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
                if lineno == 1 and line.startswith("\ufeff"):  # a byte-order mark (Windows editors write one)
                    line = line[1:]
            except UnicodeDecodeError as exc:
                raise DataError(
                    f"{p}: not UTF-8 text (line {lineno}, byte {exc.start} of the line: {exc.reason}); "
                    "save the file as UTF-8"
                ) from None
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataError(f"{path}: line {lineno} is not valid JSON: {exc.msg}") from None
