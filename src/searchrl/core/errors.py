"""User-facing errors. Every message names where the problem is and what would be valid."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from pathlib import Path


def close_match(value: object, choices: Iterable[str]) -> str | None:
    """Best close match for a typo, or None."""
    if not isinstance(value, str):
        return None
    hits = difflib.get_close_matches(value, list(choices), n=1, cutoff=0.5)
    return hits[0] if hits else None


class SearchRLError(Exception):
    """Base class for errors meant to be read by a user (printed without a traceback by the CLI)."""


class ConfigError(SearchRLError, ValueError):
    """A bad experiment config: names the file, the key, the bad value and the valid choices."""

    def __init__(
        self,
        problem: str,
        *,
        file: str | None = None,
        key: str | None = None,
        value: object = None,
        choices: Iterable[str] | None = None,
        hint: str | None = None,
    ) -> None:
        self.problem, self.file, self.key, self.value, self.hint = problem, file, key, value, hint
        self.choices = sorted(choices) if choices is not None else None
        parts = [f"{file or '<config>'}: " + (f"key '{key}': " if key else "") + problem]
        if value is not None:
            parts.append(f"  got: {value!r}")
        if self.choices is not None:
            shown = ", ".join(self.choices) if self.choices else "(none registered)"
            parts.append(f"  valid: {shown}")
            guess = close_match(value, self.choices)
            if guess is not None:
                parts.append(f"  did you mean '{guess}'?")
        if hint:
            parts.append(f"  hint: {hint}")
        super().__init__("\n".join(parts))

    def at(self, file: str, key: str | None = None) -> ConfigError:
        """The same error attributed to ``file`` (a check that ran without knowing it), its key optionally
        renamed; the class is kept (a `MissingInput` stays one)."""
        return type(self)(
            self.problem,
            file=file,
            key=key or self.key,
            value=self.value,
            choices=self.choices,
            hint=self.hint,
        )


class MissingInput(ConfigError):
    """A file or directory the experiment reads is not there (yet): a question file not downloaded, a model
    directory an earlier run writes. The file itself may be right (`searchrl validate --allow-missing`)."""


class DataError(SearchRLError, ValueError):
    """Bad input data or a bad argument: names the file (and row) or the argument and what would be valid."""


def read_text(path: str | Path, what: str = "file") -> str:
    """A UTF-8 text file (a byte-order mark, as Windows editors write, is dropped), or a `DataError` naming it
    (missing, a directory, not UTF-8)."""
    p = Path(path)
    if p.is_dir():
        raise DataError(f"{p}: is a directory, not a {what}")
    if not p.exists():
        raise DataError(f"{p}: {what} not found")
    raw = p.read_bytes()
    try:
        text = raw.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")  # as read_text's newlines
        return text[1:] if text.startswith("\ufeff") else text
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise DataError(
            f"{p}: not UTF-8 text (line {line}, byte {exc.start}: {exc.reason}); save the {what} as UTF-8"
        ) from None


class RegistryError(SearchRLError, KeyError):
    """Unknown or duplicate registry name."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])
