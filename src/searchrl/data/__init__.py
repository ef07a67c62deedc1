"""Questions and corpora in one `Example` / `Doc` type, whatever the source format."""

from searchrl.core.records import Doc, Example, Hop
from searchrl.data.corpus import load_corpus
from searchrl.data.example import read_jsonl, write_jsonl
from searchrl.data.loaders import LOADERS, keys_from_subquestion, load_examples

__all__ = [
    "LOADERS",
    "Doc",
    "Example",
    "Hop",
    "keys_from_subquestion",
    "load_corpus",
    "load_examples",
    "read_jsonl",
    "write_jsonl",
]
