"""The same agent as a command (``env.agent_program.command: [python, examples/agents/command_agent.py]``): the
run passes the episode through the environment (``SEARCHRL_BASE_URL``, ``SEARCHRL_MODEL``, ``SEARCHRL_QUESTION``)
and reads the answer from the last line printed. This one brings no search tool of its own: it asks the model
once and prints its reply."""

from __future__ import annotations

import os

from openai import OpenAI

if __name__ == "__main__":
    client = OpenAI(base_url=os.environ["SEARCHRL_BASE_URL"], api_key="unused", max_retries=0)
    question = os.environ["SEARCHRL_QUESTION"]
    reply = client.chat.completions.create(
        model=os.environ.get("SEARCHRL_MODEL", "policy"),
        messages=[{"role": "user", "content": f"Question: {question}"}],
    )
    print(reply.choices[0].message.content or "")
