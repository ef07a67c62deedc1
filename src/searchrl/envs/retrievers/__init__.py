"""Retrievers behind one batched protocol: ``search(queries, k) -> list[list[Doc]]``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from searchrl.core.errors import DataError
from searchrl.core.records import Doc
from searchrl.data.corpus import load_corpus
from searchrl.envs.retrievers.cache import CachedRetriever
from searchrl.envs.retrievers.protocol import RETRIEVERS, IndexedRetriever, Retriever


def build_retriever(
    name: str,
    corpus: str | Path | Sequence[Doc] | None = None,
    index: str | Path | None = None,
    cache: int = 0,
    **args: Any,
) -> Retriever:
    """Build a registered retriever from a corpus, or load it from a saved ``index`` directory.

    ``hybrid`` takes ``retrievers: [{name: bm25}, {name: dense}]`` (each built on the same corpus).
    """
    cls: Any = RETRIEVERS.get(name)
    if name == "hybrid":
        subs = [
            build_retriever(corpus=corpus, **dict(sub)) for sub in args.pop("retrievers", [{"name": "bm25"}])
        ]
        retriever: Retriever = cls(subs, **args)
    elif name == "simulated":  # ZeroSearch: never cached (a query's documents depend on the step's draw)
        docs = load_corpus(corpus) if isinstance(corpus, str | Path) else corpus
        return cls(docs, **args)  # type: ignore[no-any-return]
    elif name == "http" or not hasattr(cls, "load"):
        retriever = cls(**args)
    elif index is not None and Path(index, "index.json").exists():
        retriever = cls.load(index, **args)
    else:
        if corpus is None:
            if index is not None:
                raise DataError(
                    f"{index}: not an index directory (no index.json); build one with `searchrl index --retriever "
                    f"{name} --corpus FILE --out {index}`, or pass the corpus"
                )
            raise DataError(
                f"retriever '{name}' needs a corpus (or an index directory built by `searchrl index`)"
            )
        docs = load_corpus(corpus) if isinstance(corpus, str | Path) else corpus
        built = cls(docs, **args)
        if index is not None:
            built.save(index)
        retriever = built
    return CachedRetriever(retriever, maxsize=cache) if cache > 0 else retriever


def retriever_arguments(name: str) -> list[str] | None:
    """The keyword arguments retriever ``name`` takes (``args`` in the config, ``--arg`` on the command line);
    None when it takes any."""
    import inspect

    cls: Any = RETRIEVERS.get(name)
    params = list(inspect.signature(cls).parameters.values())
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return [
        p.name for p in params if p.name not in ("docs", "embeddings", "faiss_index", "tantivy_index")
    ]  # built, not configured


__all__ = ["RETRIEVERS", "CachedRetriever", "Doc", "IndexedRetriever", "Retriever", "build_retriever"]
