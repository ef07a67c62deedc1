"""A search agent written with Hugging Face's smolagents (``ToolCallingAgent``), trained by searchrl through its
endpoint (docs/agents.md). ``pip install 'searchrl[agents]' smolagents``.

Nothing here knows about training: smolagents talks to ``base_url`` through its ``OpenAIServerModel`` as it would to
any OpenAI-compatible server, runs the ``search`` tool itself and ends with its ``final_answer`` tool. searchrl runs
it once per episode (``env.protocol: agent``) and trains on the tokens the policy sampled.

smolagents sends each step's history in its own form (its system prompt, the earlier calls and their results as
text messages), not the assistant message the endpoint returned, so no call extends the one before: each call is a
row of its own, all with the episode's reward (``agent/rows_per_episode`` counts them). A policy trained this way
learns smolagents' prompt, not the tool quickstart's; warm-start it on smolagents' transcripts.
"""

from __future__ import annotations

from collections.abc import Callable


def run(
    question: str, base_url: str, search: Callable[..., str], model: str = "policy", max_turns: int = 4
) -> str | None:
    """Answer ``question`` with a smolagents tool-calling agent whose one tool is the run's ``search``."""
    from smolagents import OpenAIServerModel, Tool, ToolCallingAgent

    class Search(Tool):
        name = "search"
        description = (
            "Search the knowledge base. Returns the top documents for the query, each with its id and title."
        )
        inputs = {"query": {"type": "string", "description": "what to search for"}}  # noqa: RUF012
        output_type = "string"

        def forward(self, query: str) -> str:
            return search(query)

    server = OpenAIServerModel(
        model_id=model, api_base=base_url, api_key="unused", client_kwargs={"max_retries": 0}
    )
    agent = ToolCallingAgent(tools=[Search()], model=server, max_steps=max_turns, verbosity_level=0)
    answer = agent.run(question)
    return None if answer is None else str(answer)
