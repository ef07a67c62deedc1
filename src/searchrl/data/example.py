"""JSON and JSON-lines files as the loaders and the run directory read and write them (the question type every
loader produces is `searchrl.core.records.Example`)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from searchrl.core.errors import DataError, read_text

__all__ = ["read_json", "read_jsonl", "write_jsonl"]


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
