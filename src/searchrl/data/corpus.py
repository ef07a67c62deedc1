"""Corpora: Search-R1 JSONL (`id`, `contents` = '"title"\\ntext'), or JSON lists / dicts of title and text."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from searchrl.data.example import read_json, read_jsonl
from searchrl.errors import DataError


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


def _from_record(i: int, rec: Any, path: Path) -> Doc:
    if isinstance(rec, dict):
        doc_id = str(rec.get("id", rec.get("_id", i)))
        if "contents" in rec:
            return Doc.from_contents(doc_id, str(rec["contents"]))
        if "text" in rec or "paragraph_text" in rec:
            text = rec.get("text", rec.get("paragraph_text"))
            if isinstance(text, list):
                text = "".join(text)
            return Doc(id=doc_id, title=str(rec.get("title", "")), text=str(text).strip())
    raise DataError(
        f"{path}: record {i} is not a corpus entry; expected {{'id', 'contents'}} or {{'title', 'text'}}, got {rec!r:.120}"
    )


def load_corpus(path: str | Path) -> list[Doc]:
    """Load any supported corpus file. Document ids default to the record's position."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: corpus file not found" if not path.exists() else f"{path}: is not a file")
    docs = _load(path)
    if not docs:
        raise DataError(f"{path}: no documents (the corpus is empty)")
    return docs


def _load(path: Path) -> list[Doc]:
    if path.suffix == ".jsonl":
        return [_from_record(i, rec, path) for i, rec in enumerate(read_jsonl(path))]
    data = read_json(path)
    if isinstance(data, dict):  # HotpotQA style: {title: [sentence, ...]} or {title: text}
        return [
            Doc(id=str(i), title=title, text=("".join(v) if isinstance(v, list) else str(v)).strip())
            for i, (title, v) in enumerate(data.items())
        ]
    if isinstance(data, list):
        return [_from_record(i, rec, path) for i, rec in enumerate(data)]
    raise DataError(f"{path}: expected a JSON list or dict of documents, got {type(data).__name__}")
