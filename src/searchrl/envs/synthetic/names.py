"""Invented, pronounceable single-word names, unique across a world and its renaming pool."""

from __future__ import annotations

import random

_ONSETS = [
    "b",
    "d",
    "f",
    "g",
    "k",
    "l",
    "m",
    "n",
    "p",
    "r",
    "s",
    "t",
    "v",
    "z",
    "br",
    "dr",
    "gr",
    "kr",
    "tr",
    "st",
    "th",
    "sh",
    "vr",
    "pl",
]
_VOWELS = ["a", "e", "i", "o", "u", "a", "e", "o", "ai", "ei", "ou"]
_CODAS = ["", "", "", "n", "r", "l", "s", "m", "k", "th"]

# Type-specific endings make a name's kind guessable, as real names often are, without leaking facts.
_ENDINGS: dict[str, list[str]] = {
    "person": ["", "", "o", "a", "in"],
    "city": ["ton", "ford", "mere", "burg", "vale", ""],
    "country": ["ia", "land", "ar", "istan", "ova"],
    "film": ["", "", "", ""],
    "company": ["corp", "tek", "ex", "co", "ium"],
    "university": ["", ""],
    "band": ["", "s", ""],
}


def _syllable(rng: random.Random) -> str:
    return rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)


def make_names(rng: random.Random, kind: str, count: int, taken: set[str]) -> list[str]:
    """``count`` new names for entities of ``kind``, none in ``taken`` (which is updated)."""
    out: list[str] = []
    attempts = 0
    while len(out) < count:
        attempts += 1
        if attempts > 200 * count + 1000:
            raise RuntimeError(f"could not invent {count} unique {kind} names; lower the world size")
        n_syl = 2 if rng.random() < 0.9 else 3
        name = ("".join(_syllable(rng) for _ in range(n_syl)) + rng.choice(_ENDINGS[kind])).capitalize()
        if 4 <= len(name) <= 10 and name not in taken:
            taken.add(name)
            out.append(name)
    return out
