"""A search agent in plain OpenAI-client code, trained by searchrl through its endpoint (docs/agents.md).

Nothing here knows about training: the agent talks to ``base_url`` as it would to any OpenAI-compatible server,
runs its ``search`` tool itself and returns its answer. searchrl runs it once per episode (``env.protocol:
agent``) with a ``base_url`` of the episode's own, records the exact tokens the policy sampled and trains on them.

Its system prompt and tool schema are the quickstart's tool format (`experiments/synthetic/grpo_tools.yaml`), so a
policy warm-started there reads them as it learned to; any other prompt works too, from a policy that knows it.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from openai import OpenAI

SYSTEM = "Answer the question. Search for each fact you need; when you know the answer, reply with the answer alone."
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the knowledge base. Returns the top documents for the query, each with its id and title.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": "what to search for"},
                    "k": {"type": "integer", "description": "how many documents (default 1, at most 10)"},
                },
                "required": ["query"],
            },
        },
    }
]


def run(
    question: str, base_url: str, search: Callable[..., str], model: str = "policy", max_turns: int = 4
) -> str | None:
    """Answer ``question``: ask the model, run the searches it calls, until it answers (or ``max_turns`` pass)."""
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages: list[dict] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Question: {question}"},
    ]
    for _ in range(max_turns + 1):
        reply = client.chat.completions.create(model=model, messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return message.content
        for call in message.tool_calls:
            try:
                args = json.loads(call.function.arguments)
                result = search(str(args["query"]), args.get("k"))
            except (ValueError, KeyError, TypeError) as exc:  # the model's call is input: say what was wrong
                result = f"Error: {exc}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return None
