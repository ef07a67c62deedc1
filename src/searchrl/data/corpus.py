"""Corpora: Search-R1 JSONL (`id`, `contents` = '"title"\\ntext'), or JSON lists / dicts of title and text."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from searchrl.core.errors import DataError
from searchrl.core.records import Doc
from searchrl.data.example import read_json, read_jsonl


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
    """Load any supported corpus file. Document ids default to the record's position and must be unique
    (gold recall, redundancy penalties and the retrieval cache count documents by id)."""
    docs = list(iter_corpus(path))
    seen: set[str] = set()
    dup = list(dict.fromkeys(d.id for d in docs if d.id in seen or seen.add(d.id)))  # type: ignore[func-returns-value]
    if dup:
        raise DataError(
            f"{path}: document ids must be unique; these are shared by several documents: "
            f"{', '.join(repr(d) for d in dup[:10])}{' …' if len(dup) > 10 else ''}"
        )
    return docs


def iter_corpus(path: str | Path) -> Iterator[Doc]:
    """The documents of any supported corpus file, one at a time: JSONL is streamed (for corpora too big for
    memory, with `docstore.write_docstore`); JSON files are read whole."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: corpus file not found" if not path.exists() else f"{path}: is not a file")
    empty = True
    for doc in _iter(path):
        empty = False
        yield doc
    if empty:
        raise DataError(f"{path}: no documents (the corpus is empty)")


def _iter(path: Path) -> Iterator[Doc]:
    if path.suffix == ".jsonl":
        for i, rec in enumerate(read_jsonl(path)):
            yield _from_record(i, rec, path)
        return
    data = read_json(path)
    if isinstance(data, dict):  # HotpotQA style: {title: [sentence, ...]} or {title: text}
        for i, (title, v) in enumerate(data.items()):
            yield Doc(id=str(i), title=title, text=("".join(v) if isinstance(v, list) else str(v)).strip())
    elif isinstance(data, list):
        for i, rec in enumerate(data):
            yield _from_record(i, rec, path)
    else:
        raise DataError(f"{path}: expected a JSON list or dict of documents, got {type(data).__name__}")


DOC_FORMATS = {  # how retrieved documents are written into an observation
    "search_r1": "Doc {i}(Title: {title}) {text}",  # Search-R1, ReSearch, FlashRAG
    "stepsearch": "Doc {i}<## Title: {title} ##> {text}",  # StepSearch's public code (its reward parses it)
}


def format_docs(docs: Sequence[Doc], max_words: int | None = None, style: str = "search_r1") -> str:
    """Documents as the agent (or a summarizer) reads them, one per line (`DOC_FORMATS`)."""
    lines = []
    for i, d in enumerate(docs, 1):
        text = d.text if max_words is None else " ".join(d.text.split()[:max_words])
        lines.append(DOC_FORMATS[style].format(i=i, title=d.title, text=text))
    return "\n".join(lines)
