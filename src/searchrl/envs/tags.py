"""Tag protocols and prompt templates.

``search_r1``: <think>/<search>/<information>/<answer> (Search-R1, StepSearch).
``research``: <think>/<search>/<result>/<answer> with the answer inside \\boxed{} (ReSearch, Table 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TagSet:
    name: str
    info_open: str
    info_close: str
    boxed: bool = False  # the final answer must be written \boxed{...} inside <answer>
    think_open: str = "<think>"
    think_close: str = "</think>"
    search_open: str = "<search>"
    search_close: str = "</search>"
    answer_open: str = "<answer>"
    answer_close: str = "</answer>"

    @property
    def stop_strings(self) -> tuple[str, str]:
        """Generation stops right after either of these (docs/design.md §4.4)."""
        return (self.search_close, self.answer_close)

    @property
    def all_tags(self) -> tuple[str, ...]:
        return (
            self.think_open,
            self.think_close,
            self.search_open,
            self.search_close,
            self.info_open,
            self.info_close,
            self.answer_open,
            self.answer_close,
        )

    def format_answer(self, answer: str) -> str:
        body = f"The final answer is \\boxed{{{answer}}}" if self.boxed else answer
        return f"{self.answer_open} {body} {self.answer_close}"


TAGSETS: dict[str, TagSet] = {
    "search_r1": TagSet("search_r1", "<information>", "</information>"),
    "research": TagSet("research", "<result>", "</result>", boxed=True),
}
ALL_TAG_STRINGS: tuple[str, ...] = tuple(dict.fromkeys(t for ts in TAGSETS.values() for t in ts.all_tags))
# the tool protocol's markers in Qwen's chat format: one special token each in a local tokenizer built for it
TOOL_TAG_STRINGS: tuple[str, ...] = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
# AutoRefine's block after each search (arXiv 2505.11277): text the agent writes, never a stop
REFINE_OPEN, REFINE_CLOSE = "<refine>", "</refine>"

# Prompt templates. `short` suits the tiny local models; the others are the papers' own.
TEMPLATES: dict[str, str] = {
    "short": "Question: {question}\n",
    "search_r1": (
        "Answer the given question. You must conduct reasoning inside <think> and </think> first every time "
        "you get new information. After reasoning, if you find you lack some knowledge, you can call a search "
        "engine by <search> query </search> and it will return the top searched results between <information> "
        "and </information>. You can search as many times as your want. If you find no further external "
        "knowledge needed, you can directly provide the answer inside <answer> and </answer>, without detailed "
        "illustrations. For example, <answer> Beijing </answer>. Question: {question}\n"
    ),
    # AutoRefine's template (its released code, template_type autorefine), with our tag set's <information>
    # where AutoRefine writes <documents>
    "autorefine": (
        "You are a helpful assistant excel at answering questions with multi-turn search engine calling. To "
        "answer questions, you must first reason through the available information using <think> and </think>. "
        "If you identify missing knowledge, you may issue a search request using <search> query </search> at "
        "any time. The retrieval system will provide you with the three most relevant documents enclosed in "
        "<information> and </information>. After each search, you need to summarize and refine the existing "
        "documents in <refine> and </refine>. You may send multiple search requests if needed. Once you have "
        "sufficient information, provide a concise final answer using <answer> and </answer>. For example, "
        "<answer> Donald Trump </answer>. Question: {question}\n"
    ),
    # ReSearch Table 1, template for base models.
    "research": (
        "A conversation between User and Assistant. The user asks a question, and the assistant solves it. "
        "The assistant first thinks about the reasoning process in the mind and then provides the user with "
        "the answer. During thinking, the assistant can invoke the wikipedia search tool to search for fact "
        "information about specific topics if needed. The reasoning process and answer are enclosed within "
        "<think> </think> and <answer> </answer> tags respectively, and the search query and result are "
        "enclosed within <search> </search> and <result> </result> tags respectively. For example, <think> "
        "This is the reasoning process. </think> <search> search query here </search> <result> search result "
        "here </result> <think> This is the reasoning process. </think> <answer> The final answer is "
        "\\boxed{{answer here}} </answer>. In the last part of the answer, the final exact answer is enclosed "
        "within \\boxed{{}} with latex format. User: {question}. Assistant:"
    ),
    # RAG-Gym Figure 8 (the ReSearch agent's action prompt) in our tag protocol instead of its JSON output;
    # for env.agent: research, which appends the information-seeking history (query, summary pairs) after it.
    "raggym_research": (
        "You are a helpful assistant. Your task is to answer a given question following user instructions. "
        "Inside <think> and </think>: 1. Step-by-step Reasoning: think step-by-step and then answer the "
        "question. 2. Unverified Claim Identification: identify if there are claims in the reasoning chain "
        "that are not grounded in the information-seeking history and need to be verified. Then, if there is "
        "an unverified claim, search for the first piece of missing information as an atomic query by "
        "<search> query </search>; if there is none, give your predicted answer (a word, digit or short "
        "phrase) by <answer> answer </answer>.\n### Original Question\n{question}\n"
        "### Information-seeking History\n"
    ),
}


@dataclass(frozen=True)
class ChatTemplate:
    """A prompt for an instruction-tuned model, rendered through the tokenizer's chat template as a system
    turn (``None``: the template's default, e.g. Qwen2.5's) and a user turn, with the assistant's turn
    opened. The whole episode then stays in that one assistant turn: actions are generated and
    observations appended as text, as Search-R1 and ReSearch do."""

    system: str | None
    user: str  # "{question}" is filled in

    def messages(self, question: str) -> list[dict[str, Any]]:
        turns = [] if self.system is None else [{"role": "system", "content": self.system}]
        return [*turns, {"role": "user", "content": self.user.format(question=question)}]


# ReSearch Table 1: "System Prompt Template For Instruction-Tuned Model"
RESEARCH_SYSTEM = (
    "You are a helpful assistant that can solve the given question step by step with the help of the wikipedia "
    "search tool. Given a question, you need to first think about the reasoning process in the mind and then "
    "provide the answer. During thinking, you can invoke the wikipedia search tool to search for fact information "
    "about specific topics if needed. The reasoning process and answer are enclosed within <think> </think> and "
    "<answer> </answer> tags respectively, and the search query and result are enclosed within <search> "
    "</search> and <result> </result> tags respectively. For example, <think> This is the reasoning process. "
    "</think> <search> search query here </search> <result> search result here </result> <think> This is the "
    "reasoning process. </think> <answer> The final answer is \\boxed{answer here} </answer>. In the last part "
    "of the answer, the final exact answer is enclosed within \\boxed{} with latex format."
)

# Instruct variants. Search-R1's code puts its prompt in the user turn and lets the model's chat template add
# its default system prompt; ReSearch's instruct prompt is the system turn and the question the user turn.
CHAT_TEMPLATES: dict[str, ChatTemplate] = {
    "search_r1_instruct": ChatTemplate(None, TEMPLATES["search_r1"].rstrip("\n")),
    "research_instruct": ChatTemplate(RESEARCH_SYSTEM, "{question}"),
    "autorefine_instruct": ChatTemplate(None, TEMPLATES["autorefine"].rstrip("\n")),
    "short_chat": ChatTemplate(
        None, "Question: {question}"
    ),  # the short prompt as a user turn (small models)
    # the tool protocol (env.protocol: tools): the template adds the tool schemas after this system prompt
    "tools": ChatTemplate(
        "Answer the question. Search for each fact you need; when you know the answer, reply with the answer "
        "alone.",
        "Question: {question}",
    ),
}
