"""LRU cache around any retriever: repeated queries (common in GRPO groups) skip the index."""

from __future__ import annotations

from collections import OrderedDict

from searchrl.core.records import Doc
from searchrl.envs.retrievers.protocol import Retriever


class CachedRetriever:
    def __init__(self, inner: Retriever, maxsize: int = 100_000) -> None:
        self.inner, self.maxsize = inner, maxsize
        self._cache: OrderedDict[tuple[str, int], list[Doc]] = OrderedDict()
        self.hits = self.misses = 0

    def search(self, queries: list[str], k: int) -> list[list[Doc]]:
        out: list[list[Doc] | None] = []
        todo: dict[str, list[int]] = {}
        for i, q in enumerate(queries):
            key = (q, k)
            if key in self._cache:
                self._cache.move_to_end(key)
                out.append(self._cache[key])
                self.hits += 1
            else:
                out.append(None)
                todo.setdefault(q, []).append(i)
        if todo:
            uniq = list(todo)
            self.misses += len(uniq)
            self.hits += sum(len(v) - 1 for v in todo.values())  # in-batch duplicates
            for q, docs in zip(uniq, self.inner.search(uniq, k)):
                self._cache[(q, k)] = docs
                for i in todo[q]:
                    out[i] = docs
            while len(self._cache) > self.maxsize:
                self._cache.popitem(last=False)
        return [o if o is not None else [] for o in out]
