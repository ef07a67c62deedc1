"""Tools that keep state across an episode's calls (`searchrl.envs.python_tools.class_tools`): one `Library`
per episode, made when the episode starts. The agent searches, keeps the documents it wants in a shortlist, reads
its shortlist back, and is paid a small bonus when its answer appears in a document it kept: a reward the
environment owns (the ``tool_env`` reward), beside the answer's exact match."""

from __future__ import annotations

import asyncio
from typing import Any


class Library:
    """A reading list for one episode, over the experiment's retriever (a constructor parameter named
    ``retriever`` receives it)."""

    def __init__(self, retriever: Any, bonus: float = 0.2) -> None:
        self.retriever, self.bonus = retriever, bonus
        self.seen: dict[str, str] = {}
        self.kept: list[str] = []
        self.question = ""

    def reset(self, example: Any) -> None:
        """The episode starts: its question is known, nothing is kept."""
        self.question = example.question

    def search(self, query: str) -> str:
        """Search the library.

        Args:
            query: what to search for
        """
        [docs] = self.retriever.search([query], 3)
        for d in docs:
            self.seen[d.id] = f"{d.title}: {d.text}"
        return "\n".join(f"[{d.id}] {d.title}: {d.text}" for d in docs)

    def keep(self, doc_id: str) -> str:
        """Put a document from an earlier search on the shortlist.

        Args:
            doc_id: the id shown in square brackets in the search results
        """
        if doc_id not in self.seen:
            return f"No document {doc_id!r} among this episode's search results."
        if doc_id not in self.kept:
            self.kept.append(doc_id)
        return f"Kept {doc_id}; the shortlist has {len(self.kept)} document(s)."

    async def shortlist(self) -> str:
        """Read the shortlist back."""
        await asyncio.sleep(0)  # an async tool: awaited by the environment
        return "\n".join(self.seen[i] for i in self.kept) or "The shortlist is empty."

    def reward(self, answer: str | None) -> float:
        """A bonus when the answer is in a kept document."""
        hit = answer and any(answer.lower() in self.seen[i].lower() for i in self.kept)
        return self.bonus if hit else 0.0

    def release(self) -> None:
        """The episode is over."""
        self.seen.clear()
        self.kept.clear()
