"""The experiment schema: frozen dataclasses for every section, and the conversion of a mapping into them
with errors a user can act on (the file or command line, the dotted key, the bad value, the valid choices).

It sits at the bottom of the package and imports none of the registries: fields that name a registered
object are recorded in the conversion's context and checked by `searchrl.app.experiment.load_experiment`,
which also reads the files (`searchrl.core.loader`: ``base:`` includes, ``a.b=c`` overrides).
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from searchrl.core.errors import ConfigError, DataError

# ---------------------------------------------------------------------------------------------- sections

# Value ranges, on the fields themselves (`setting`): checked wherever a section is read (files, overrides,
# `searchrl validate`, every command) and listed by the configuration reference (docs/reference/config.md).
Range = tuple[Callable[[Any], bool], str]
AT_LEAST_1: Range = (lambda v: v >= 1, "at least 1")
AT_LEAST_0: Range = (lambda v: v >= 0, "at least 0")
POSITIVE: Range = (lambda v: v > 0, "greater than 0")
AT_LEAST_ONE_NAME: Range = (lambda v: v >= 1, "at least 1 (names invented per entity)")
SHARE: Range = (lambda v: 0 < v <= 1, "greater than 0 and at most 1")
PROBABILITY_BELOW_1: Range = (lambda v: 0 <= v < 1, "in [0, 1)")
UNIT_INTERVAL: Range = (lambda v: 0 < v <= 1, "in (0, 1]")
ZERO_TO_ONE: Range = (lambda v: 0 <= v <= 1, "in [0, 1]")


def check_ranges(obj: Any) -> None:
    """A section built in code (not read from a file, whose loader checks each key): every field's range, as a
    ValueError naming the key (`setting`)."""
    for f in dataclasses.fields(obj):
        check, value = f.metadata.get("range"), getattr(obj, f.name)
        if check is None or value is None or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if not math.isfinite(value) or not check[0](value):
            raise ValueError(f"{f.name} must be {check[1]}, got {value}")


def setting(default: Any, help: str, check: Range | None = None, **meta: Any) -> Any:
    """A field with its help text (printed by the configuration reference) and, optionally, its range and other
    metadata (``registry``, ``choices``). A type or a callable as ``default`` is the field's factory (a section,
    a mapping); ``MISSING`` makes the key required."""
    md = {"help": help, **({"range": check} if check is not None else {}), **meta}
    if default is MISSING:  # a required key
        return field(metadata=md)
    if callable(default):
        return field(default_factory=default, metadata=md)
    return field(default=default, metadata=md)


@dataclass(frozen=True)
class WorldConfig:
    """Size and difficulty of a synthetic world. Defaults generate in about a second."""

    seed: int = setting(0, "the world's seed: entities, names, facts and questions")
    persons: int = setting(360, "people in the world", AT_LEAST_0)
    cities: int = setting(120, "cities", AT_LEAST_0)
    countries: int = setting(12, "countries", AT_LEAST_0)
    films: int = setting(160, "films", AT_LEAST_0)
    companies: int = setting(100, "companies", AT_LEAST_0)
    universities: int = setting(40, "universities", AT_LEAST_0)
    bands: int = setting(80, "bands", AT_LEAST_0)
    split_fractions: tuple[float, float, float] = setting((0.7, 0.1, 0.2), "train, dev, test entities")
    questions: tuple[int, int, int] = setting((4000, 200, 500), "train, dev, test")
    hop_weights: tuple[float, ...] = setting((0.25, 0.35, 0.25, 0.15), "P(1 hop), ..., P(4 hops)")
    distractors_per_doc: int = setting(2, "sentences that name other entities in unrelated roles", AT_LEAST_0)
    inverse_mentions: int = setting(
        3, 'object documents list up to this many subjects ("People born in X include ...")', AT_LEAST_0
    )
    name_pool_factor: float = setting(
        3.0, "names invented per entity: the extra ones are used for renaming", AT_LEAST_ONE_NAME
    )
    phrasings: int | None = setting(
        None,
        (
            "fact sentences per relation that documents use (the first n of schema.RELATIONS' "
            "phrasings, which name the subject first); null: all of them. 1 makes reading an answer off "
            "a document a fixed pattern"
        ),
        AT_LEAST_1,
    )
    coverage: float = setting(
        1.0,
        (
            "the share of entity documents the retrieval corpus keeps (the rest, drawn with the seed, "
            "are left out, and the questions whose hops need them cannot be answered from retrieval): "
            "the corpus-coverage ablation"
        ),
        SHARE,
    )

    def count(self, kind: str) -> int:
        return {
            "person": self.persons,
            "city": self.cities,
            "country": self.countries,
            "film": self.films,
            "company": self.companies,
            "university": self.universities,
            "band": self.bands,
        }[kind]

    def __post_init__(self) -> None:
        if len(self.hop_weights) == 0 or len(self.hop_weights) > 4 or min(self.hop_weights) < 0:
            raise DataError(f"hop_weights must give 1-4 non-negative weights, got {self.hop_weights}")
        if abs(sum(self.split_fractions) - 1.0) > 1e-6 or len(self.split_fractions) != 3:
            raise DataError(f"split_fractions must be 3 numbers summing to 1, got {self.split_fractions}")


@dataclass(frozen=True)
class TeacherConfig:
    noisy: bool = setting(
        False,
        ("imperfect teacher trajectories (repeated, premature and vague searches at the p_* rates below)"),
    )
    p_repeat: float = setting(0.15, "after a successful search, repeat the same query once")
    p_early: float = setting(0.10, "after a hop (not the last), answer with the current sub-answer")
    p_vague: float = setting(0.15, "before a hop's proper query, issue one without its entity")
    rename_prob: float = setting(0.0, "share of trajectories whose entity names are renamed")
    quote: bool = setting(
        False,
        (
            'quote the sentence a sub-answer was read from ("Found: Tubrous was formed in Staloton."), '
            "before the next step or the answer: the answer is then copied from a quoted sentence, not "
            "looked up by relation"
        ),
    )
    plan: bool = setting(
        False,
        (
            'state the searches still needed in every thought ("Found: ... Steps left: 1. Next: ..."), '
            "counted from the question's decomposition: the decision to search on or answer then "
            "follows the agent's own last thought instead of the question a whole tool turn back (the "
            "tool quickstart; docs/tools.md)"
        ),
    )
    refine: bool = setting(
        False,
        (
            "AutoRefine (arXiv 2505.11277): every action after a search's documents opens with <refine> "
            "… </refine>, what the documents establish (the sentence naming the sub-answer, or that "
            "nothing new came back)"
        ),
    )
    seed: int = setting(0, "the teacher's seed (its noise and renamings)")

    def __post_init__(self) -> None:
        for name in ("p_repeat", "p_early", "p_vague", "rename_prob"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise DataError(f"teacher.{name} must be in [0, 1], got {v}")


@dataclass(frozen=True)
class DataConfig:
    source: Literal["synthetic", "auto", "flashrag", "hotpotqa", "musique", "2wiki"] = setting(
        "synthetic",
        (
            "synthetic (the generated world), flashrag (FlashRAG JSONL files), hotpotqa, musique, "
            "2wiki, or auto (read from the files)"
        ),
    )
    world: WorldConfig = setting(WorldConfig, "used when source is synthetic")
    world_dir: str | None = setting(None, "an existing world; default: generated into <output_dir>/world")
    train: str | None = setting(None, "question files for the other sources")
    dev: str | None = setting(None, "the dev split's question file (the other sources)")
    test: str | None = setting(None, "the test split's question file (the other sources)")
    corpus: str | None = setting(None, "retrieval corpus for the other sources")
    limit: int | None = setting(None, "keep the first N questions of each split", AT_LEAST_1)


@dataclass(frozen=True)
class RetrieverConfig:
    name: str = setting(
        "bm25",
        (
            "the retriever: bm25, tantivy, dense (faiss), hybrid, http (a retrieval server), simulated "
            "(ZeroSearch), or a dotted path"
        ),
        registry="retrievers",
    )
    corpus: str | None = setting(None, "default: the data section's corpus (the world's for synthetic)")
    index: str | None = setting(
        None, "a saved index directory (`searchrl index`); built and saved there if missing"
    )
    cache: int = setting(100_000, "LRU entries; 0 turns the cache off", AT_LEAST_0)
    args: dict[str, Any] = setting(dict, "passed to the retriever's constructor")


@dataclass(frozen=True)
class SummarizerConfig:
    name: str = setting(
        "extract",
        "extract (no model: the sentences that answer the query) or llm (an untuned chat model)",
        registry="summarizers",
    )
    args: dict[str, Any] = setting(dict, "passed to the summarizer's constructor")


@dataclass(frozen=True)
class ContextConfig:
    """Long horizons under a fixed context (``env.context``; ReSum, AgentFold; docs/algorithms/long_horizons.md):
    before an action, an episode whose context holds ``max_tokens`` or more is folded: its searches so far are
    summarised and it goes on from the question and that summary. Each context becomes its own training row
    (append-only in its own ids), all given the episode's outcome; group baselines count episodes."""

    max_tokens: int = setting(
        MISSING,
        ("fold before an action once the context holds this many tokens (below rollout.max_total_tokens)"),
        AT_LEAST_1,
    )
    max_segments: int = setting(
        4,
        (
            "training rows one episode may make (its contexts); at the last one the episode runs on to "
            'rollout.max_total_tokens and ends there ("length"). Each row is padded for on every '
            "process, every step"
        ),
        AT_LEAST_1,
    )
    summary_max_tokens: int | None = setting(
        None,
        (
            "the summary's budget in tokens (its oldest searches are dropped to fit); null: half of "
            "what is left of max_tokens after the prompt"
        ),
        AT_LEAST_1,
    )
    header: str = setting("Summary of the searches so far:", "the summary's first line")
    summarizer: SummarizerConfig = setting(
        SummarizerConfig,
        (
            "how each search (query, documents) becomes a line of the summary (`envs/summarize.py`): "
            "extract (no model) or llm (an untuned chat model, RAG-Gym's Figure 7 prompt)"
        ),
    )


@dataclass(frozen=True)
class AgentProgramConfig:
    """A user's agent program (``env.protocol: agent``; docs/agents.md): run once per episode against an
    OpenAI-compatible endpoint in front of the policy, which records the ids it renders and samples; the
    episode's rows are built from those ids (`rollout.agent_program`). One of ``function`` and ``command``."""

    function: str | None = setting(
        None,
        (
            'a Python function, "package.module:function" (imported from PYTHONPATH), called with the '
            "question and the keywords it declares among base_url, model, session and search; it "
            "returns the answer"
        ),
    )
    command: tuple[str, ...] | None = setting(
        None,
        (
            "or a command (argv): SEARCHRL_BASE_URL, SEARCHRL_MODEL, SEARCHRL_SESSION and "
            "SEARCHRL_QUESTION in its environment, its answer the last non-empty line it prints"
        ),
    )
    timeout: float = setting(
        300.0, "seconds one episode may run; then it ends, scored as it stands", POSITIVE
    )
    workers: int = setting(64, "episodes that run at once (their calls are batched together)", AT_LEAST_1)
    max_calls: int = setting(
        8,
        (
            "completions one episode may ask for (a request's n counts each; later requests are "
            "refused): also the most training rows an episode makes, which GRPO sizes its step by"
        ),
        AT_LEAST_1,
    )


@dataclass(frozen=True)
class ToolSpec:
    """A tool of the tool protocol: ``search`` (the retriever, ``search(query, k)``), ``open`` (a document its
    searches returned, in full, ``open(doc_id)``), ``mcp`` (an MCP server's tools: ``args: {server: URL or
    [command, arg, ...], include: [names]}``), or ``pkg.module:function`` (a Python function; its schema from
    its type hints and docstring)."""

    name: str = setting(MISSING, "search, open, mcp, or pkg.module:function")
    args: dict[str, Any] = setting(dict, "the tool's own settings (mcp: server, include)")


# how a model family writes tool calls (`searchrl.envs.call_formats` reads each; ``auto``: from the chat template)
CallFormat = Literal[
    "auto",
    "hermes",
    "qwen3_coder",
    "llama3_json",
    "glm45",
    "mistral",
    "deepseek_v3",
    "deepseek_v31",
    "gemma4",
    "gemma3",
    "gpt_oss",
    "deepseek_dsml",
]


@dataclass(frozen=True)
class EnvConfig:
    retriever: RetrieverConfig = setting(RetrieverConfig, "the retriever section (RetrieverConfig)")
    tags: str = setting(
        "search_r1",
        ("the tag set of the tags protocol: search_r1 (<search>, <information>, <answer>) or research"),
        choices="tagsets",
    )
    template: str = setting(
        "short",
        (
            "the prompt: short, search_r1, research (plain text, for base models), or "
            "search_r1_instruct, research_instruct, short_chat (through the tokenizer's chat template, "
            "for instruct models)"
        ),
        choices="templates",
    )
    topk: int = setting(3, "documents returned per search", AT_LEAST_1)
    max_turns: int = setting(4, "non-answer actions per episode before the answer is forced", AT_LEAST_1)
    max_query_chars: int = setting(
        256, "a longer query is cut to this many characters before retrieval", AT_LEAST_1
    )
    query_separator: str | None = setting(
        None,
        (
            "tags: a search may hold several queries split by this string (ParallelSearch, arXiv "
            '2508.09303), e.g. "##"; each is retrieved (one batch) and its documents shown under it. '
            "null: one query per search"
        ),
    )
    max_parallel_queries: int = setting(4, "with query_separator: more queries in one search make it invalid")
    on_budget: Literal["force_answer", "end"] = setting(
        "force_answer",
        (
            "at max_turns: force_answer (the environment asks for the answer) or end (the episode ends "
            "unanswered)"
        ),
    )
    doc_max_words: int | None = setting(
        None, "each document cut to this many words in observations; null: whole", AT_LEAST_1
    )
    doc_format: Literal["search_r1", "stepsearch"] = setting(
        "search_r1",
        (
            'how documents are written into observations: search_r1 "Doc 1(Title: t) text" (Search-R1, '
            'ReSearch, FlashRAG) or stepsearch "Doc 1<## Title: t ##> text" (StepSearch\'s public code '
            "parses this one)"
        ),
    )
    agent: Literal["react", "direct", "rag", "research"] = setting(
        "react",
        (
            "the agent design (RAG-Gym Appendix C, §3): react (think/search/answer turns), direct "
            "(answer at once), rag (the question is the one query, then answer), research (RAG-Gym's "
            "ReSearch: the state is the question and the (query, summary) pairs so far, re-rendered "
            "each step; SFT, DPO, PRM and evaluation only)"
        ),
    )
    summarizer: SummarizerConfig | None = setting(
        None,
        (
            "turns each search's documents into a short answer to its query (envs/summarize.py). "
            "Default: `extract` for research, none (the documents themselves) for the others; set it on "
            "react for Search-o1's design."
        ),
    )
    protocol: str = setting(
        "tags",
        (
            "how the agent acts: tags (<search>/<answer> in the text, as the papers do) or tools (the "
            "model's own chat format: the template renders the tool schemas, the model writes "
            "<tool_call> JSON and answers in a final message; envs/tool_env.py). tools needs a chat "
            "prompt (env.template: tools, short_chat, ...) or agent: a user's agent program drives the "
            "model through an OpenAI-compatible endpoint (env.agent_program, rollout/agent_program.py); "
            "it renders through the chat template like tools. Each names an entry of the environment "
            'registry (app/environments.py); "pkg.module:build" names your own.'
        ),
        registry="environments",
    )
    agent_program: AgentProgramConfig | None = setting(
        None, "protocol agent: the program (AgentProgramConfig)"
    )
    tools: tuple[ToolSpec, ...] = setting((ToolSpec("search"),), "protocol tools: what the agent may call")
    max_tool_calls: int = setting(4, "protocol tools: calls one assistant turn may make")
    tool_response_max_chars: int | None = setting(
        8192,
        (
            "protocol tools: each tool response cut to this many characters (verl's "
            "max_tool_response_length; null: no cap), on this side: right keeps the start, left the "
            "end, middle both ends"
        ),
        AT_LEAST_1,
    )
    tool_response_truncate: Literal["right", "left", "middle"] = setting(
        "right",
        ("the side tool_response_max_chars cuts: right keeps the start, left the end, middle both ends"),
    )
    call_format: CallFormat = setting(
        "auto",
        (
            "protocol tools: how the model writes its calls (envs/call_formats.py): auto (read from the "
            "chat template), hermes (<tool_call> JSON: Qwen2.5, Qwen3), qwen3_coder "
            "(<function=…><parameter=…>), llama3_json, glm45 "
            "(<tool_call>NAME<arg_key>…</arg_key><arg_value>…</arg_value>: GLM-4.5, 4.6), mistral "
            "([TOOL_CALLS] and a JSON list with call ids), deepseek_v3 (DeepSeek-V3 and R1's control tokens, "
            "arguments in a fenced JSON block), deepseek_v31 (DeepSeek-V3.1's: NAME<｜tool▁sep｜>JSON), gemma4 "
            "(Gemma 4's <|tool_call>call:NAME{key:value}<tool_call|>), gemma3 (prompted: a ```tool_code block "
            "holding NAME(key=value), the results in a user turn's ```tool_output blocks), gpt_oss "
            "(harmony: to=functions.NAME<|channel|>commentary json<|message|>ARGS<|call|>)"
        ),
    )
    chat_kwargs: dict[str, Any] = setting(
        dict, "protocol tools: passed to the chat template, e.g. {enable_thinking: false} for Qwen3"
    )
    context: ContextConfig | None = setting(
        None,
        (
            "long horizons: fold an episode's history into a summary when its context passes a budget "
            "(ContextConfig); null: an episode that fills rollout.max_total_tokens ends there "
            '("length")'
        ),
    )


@dataclass(frozen=True)
class LoraConfig:
    r: int = setting(16, "the adapters' rank", AT_LEAST_1)
    alpha: int = setting(32, "LoRA's alpha (the update scaled by alpha / r)", POSITIVE)
    dropout: float = setting(0.0, "dropout on the adapters' input", PROBABILITY_BELOW_1)
    target_modules: tuple[str, ...] = setting(
        (
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ),
        "the modules that get adapters (Qwen2's attention and MLP projections)",
    )


@dataclass(frozen=True)
class ModelConfig:
    path: str | None = setting(None, "local directory or hub id; None builds the local `size` model")
    size: Literal["tiny", "small", "base", "qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b"] = setting(
        "small",
        (
            "the local model built when model.path is unset: tiny, small (the default), base, or a "
            "Qwen2.5 shape with random weights"
        ),
    )
    layers: int | None = setting(
        None, "the local model's transformer layers; None: the size's own", AT_LEAST_1
    )
    tokenizer: Literal["local", "qwen2.5", "qwen3"] = setting(
        "local",
        (
            'the local model\'s tokenizer: "local" is trained on the synthetic world (every tag one '
            'special token); "qwen2.5" is Qwen2.5\'s real vocabulary (tags are text), from the qwen '
            "extra"
        ),
    )
    dtype: Literal["float32", "bfloat16", "float16"] = setting(
        "float32", "the weights' dtype (bfloat16 on a GPU)"
    )
    lora: LoraConfig | None = setting(None, "null: full fine-tuning")
    gradient_checkpointing: bool = setting(
        False,
        (
            "Recompute each layer's activations in the backward pass (transformers' gradient "
            "checkpointing, non-reentrant) instead of keeping them: about a third more compute for the "
            "training passes, activation memory of one layer instead of all. A 7B shape's GRPO step "
            "with LoRA (8 episodes of ~1.1k tokens per micro-batch) ran out of an H100's 80 GB without "
            "it (measured). Generation is unaffected."
        ),
    )


@dataclass(frozen=True)
class RewardSpec:
    name: str = setting(
        MISSING,
        (
            "a registered reward (em, f1, cover_em, search_r1_format, stepsearch, judge, ...) or "
            "pkg.module:function"
        ),
        registry="rewards",
    )
    weight: float = setting(1.0, "its weight in the summed reward")
    args: dict[str, Any] = setting(dict, "the reward's keyword arguments")


@dataclass(frozen=True)
class AlgorithmSettings:
    """An algorithm's own keys, typed: the base of every algorithm's ``Config`` (`searchrl.algorithms`, above this
    schema, so the schema cannot name them). A file's algorithm keys are read as written (`AlgorithmConfig.args`)
    and converted once into the algorithm's ``Config`` by `searchrl.app.experiment.resolve`, which sets
    `AlgorithmConfig.settings` (and `WarmStartConfig.settings`); from there on the experiment carries them typed."""


@dataclass(frozen=True)
class AlgorithmConfig:
    """``algorithm: {name: grpo, clip: 0.2, ...}``: every key but ``name`` is the algorithm's own."""

    name: str = setting(
        "grpo",
        "the algorithm: sft, grpo, ppo, steppo, slate, tree_grpo, arpo, aepo, dpo, prm",
        registry="algorithms",
    )
    args: dict[str, Any] = setting(
        dict, "every other key of the section: the algorithm's own (listed per algorithm below)"
    )
    # filled in by the loader (``derived``: never read from a file nor written to one)
    settings: AlgorithmSettings | None = setting(
        None, "args as the algorithm's typed Config (`searchrl.app.experiment.resolve`)", derived=True
    )


@dataclass(frozen=True)
class RolloutConfig:
    backend: str = setting(
        "hf", "the generator: hf (transformers, in-process) or vllm", registry="generators"
    )
    temperature: float = setting(
        1.0, "ReSearch Table 4; also divides the logits of the training log-probs", AT_LEAST_0
    )
    top_p: float = setting(1.0, "nucleus sampling's p (1: off)", UNIT_INTERVAL)
    max_new_tokens: int = setting(128, "per action (generation stops earlier at a stop tag)", AT_LEAST_1)
    max_total_tokens: int = setting(2048, "whole trajectory: prompt + actions + observations", AT_LEAST_1)
    batch_size: int = setting(64, "sequences per generation call (rows of the continuous batch)", AT_LEAST_1)
    loop: Literal["episode", "turn"] = setting(
        "episode",
        (
            "episode: each episode advances on its own through a continuous batch (an action that ends "
            "goes to the environment, its next action joins the batch while others decode); turn: one "
            "batched generation per turn"
        ),
    )
    compile: bool = setting(
        False,
        (
            "HF backend: decode through a captured step (one CUDA graph per batch and length bucket on "
            "a GPU, torch.compile on a CPU; rollout/graph_decode.py). Off by default: its GPU figures "
            "are in docs/decoding.md. vLLM captures its own graphs."
        ),
    )
    prefix_sharing: bool = setting(
        False,
        (
            "HF backend: equal prompts (a GRPO group's) prefilled once, and the prefix that distinct "
            "prompts admitted together share (system prompt, tool schemas) computed once. vLLM caches "
            "prefixes itself."
        ),
    )
    backend_args: dict[str, Any] = setting(
        dict,
        (
            "keyword arguments of the backend, e.g. vllm: {gpu_memory_utilization: 0.4, "
            "tensor_parallel_size: 2, enable_sleep_mode: true, max_model_len: 8192}"
        ),
    )


@dataclass(frozen=True)
class GuardConfig:
    """One collapse monitor: the mean of ``metric`` over the last ``window`` steps must stay in [min, max], and
    (``max_drop``) must not fall more than that below the highest such mean since the run (or its last
    rollback) started: a reward that crashes from wherever it had climbed to."""

    metric: str = setting(
        MISSING,
        (
            "a monitor (entropy, kl, length, reward, grad_norm, loss, tool_calls, tool_errors) or any "
            "metrics.jsonl key, e.g. train/clip_frac"
        ),
    )
    min: float | None = setting(None, "the window's mean must stay at least this; null: no lower bound")
    max: float | None = setting(None, "the window's mean must stay at most this; null: no upper bound")
    max_drop: float | None = setting(
        None,
        (
            "the window's mean must not fall more than this below its highest since the start (or the "
            "last rollback)"
        ),
        POSITIVE,
    )
    window: int = setting(3, "steps averaged", AT_LEAST_1)
    after: int = setting(0, "steps before the monitor is armed (a warm-up)", AT_LEAST_0)
    unless_reward_above: float | None = setting(
        None,
        (
            "not checked while the training reward's mean over the same window is at least this: a "
            "policy that is sure of itself because it succeeds (entropy near 0 at reward 0.95) has "
            "converged, not collapsed"
        ),
    )

    def __post_init__(self) -> None:
        if self.min is None and self.max is None and self.max_drop is None:
            raise ValueError(f"guard on '{self.metric}' needs a bound: min, max, max_drop or several")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(
                f"guard on '{self.metric}': min {self.min} is above max {self.max}, so every step would trip it"
            )


@dataclass(frozen=True)
class GuardsConfig:
    """Collapse guards (`engine.guards`). Non-finite losses and gradients always stop or roll back."""

    monitors: tuple[GuardConfig, ...] = setting((), "the collapse monitors (GuardConfig each)")
    on_trip: Literal["stop", "rollback"] = setting(
        "stop",
        (
            "when a monitor trips: stop (with a message naming the last good checkpoint) or rollback "
            "(restore it and go on at a lower learning rate)"
        ),
    )
    lr_scale: float = setting(
        0.5, "rollback: the learning rate is multiplied by this at every trip", UNIT_INTERVAL
    )
    max_rollbacks: int = setting(2, "rollback: trips beyond this many stop the run", AT_LEAST_0)


@dataclass(frozen=True)
class AsyncRolloutConfig:
    """Asynchronous rollouts (``trainer.async_rollout``): a worker samples the next steps' episodes while the
    trainer trains; step i trains on tokens sampled by policy versions ≥ i − max_staleness."""

    max_staleness: int = setting(
        0, "0: synchronous (on-policy, today's trainer); 1: one step off; k: up to k behind", AT_LEAST_0
    )
    worker: Literal["thread", "process"] = setting(
        "thread",
        (
            'where the rollout worker runs (`rollout.worker_process`): "thread", beside the trainer in '
            'its process (HF: on a copy of the policy; vLLM: on the process\'s engine); "process", a '
            "process of its own (its own copy, environment and torch threads, no interpreter lock "
            "shared with the trainer; vLLM: its own engine, loaded from that copy), the weights shipped "
            "through shared memory."
        ),
    )
    worker_threads: int | None = setting(
        None, "torch threads of a worker process; None: torch's default for it", AT_LEAST_1
    )
    worker_cpus: tuple[int, ...] = setting(
        (), "cores a worker process is pinned to (Linux); empty: the trainer's"
    )
    max_restarts: int = setting(
        3,
        (
            "a worker process that dies (killed, out of memory, a native crash) is started again this "
            "many times, re-sampling the steps it had in flight, before the run stops (logged: "
            "async/worker_restarts)"
        ),
    )


@dataclass(frozen=True)
class SamplesConfig:
    """What each step trained on, saved for `searchrl view` (``trainer.samples``, `engine.samples`): token ids,
    loss mask, behaviour / π_old / trainer log-probs, advantages and step rewards of a few groups' rows."""

    groups: int = setting(
        2,
        "groups (a question's episodes, a prefix's candidates) per saved step; 0: nothing saved",
        AT_LEAST_0,
    )
    every: int = setting(1, "save every N-th step", AT_LEAST_1)


@dataclass(frozen=True)
class TrainerConfig:
    steps: int = setting(100, "optimizer steps per epoch × mini_batch == rollout batches", AT_LEAST_1)
    preempt_grace_s: float = setting(
        60.0,
        (
            "on SIGTERM / SIGUSR1 (preemption) the step in progress finishes, a checkpoint is written "
            'if it fits in this many seconds from the signal, and the run exits 75 ("resume me"; '
            "engine/preemption.py)"
        ),
        POSITIVE,
    )
    batch_size: int = setting(
        16, "questions (online) or records (SFT) per step, across all processes", AT_LEAST_1
    )
    micro_batch_size: int = setting(8, "sequences per forward/backward on one process", AT_LEAST_1)
    lr: float = setting(1.0e-6, "ReSearch Table 4", POSITIVE)
    optimizer: Literal["adamw", "sgd"] = setting("adamw", "adamw or sgd")
    weight_decay: float = setting(0.0, "the optimizer's weight decay", AT_LEAST_0)
    warmup_steps: int = setting(0, "steps of linear learning-rate warm-up", AT_LEAST_0)
    schedule: Literal["constant", "cosine", "linear", "wsd"] = setting(
        "constant",
        (
            "wsd: warm-up, constant, then a cosine decay to 0 over the last `decay_fraction` of the "
            "steps (warmup-stable-decay; a fraction, so that a shortened run keeps the shape)"
        ),
    )
    decay_fraction: float = setting(0.0, "wsd only, in (0, 1]")
    max_grad_norm: float = setting(1.0, "gradients clipped to this global norm", POSITIVE)
    epochs: int = setting(1, "passes over each rollout batch (PPO epochs)", AT_LEAST_1)
    mini_batches: int = setting(1, "optimizer updates per pass over a rollout batch", AT_LEAST_1)
    save_every: int = setting(50, "steps between checkpoints (and at the end)", AT_LEAST_1)
    keep_checkpoints: int = setting(2, "checkpoints kept on disk (the newest)", AT_LEAST_1)
    eval_every: int = setting(
        0,
        (
            "steps between evaluations on `eval_split` during training, and at the last step, so that "
            "the held-out curve ends at the final policy (0: none; the run's own evaluation after "
            "training is `eval`)"
        ),
        AT_LEAST_0,
    )
    eval_split: Literal["train", "dev", "test"] = setting(
        "dev", "the split evaluated during training (every eval_every steps)"
    )
    eval_limit: int | None = setting(200, "questions of it evaluated; null: all", AT_LEAST_1)
    log_entropy: bool = setting(True, "log the policy's token entropy (one more reduction per step)")
    lean_logprobs: bool = setting(
        True,
        (
            "log-probs from the final hidden states, the output layer applied only at action tokens and "
            "in chunks: no (batch, tokens, vocabulary) logits tensor (2.5 GB per 4,096 tokens at "
            "Qwen2.5's vocabulary)"
        ),
    )
    packing: bool = setting(
        False,
        (
            "every pass's micro-batch as one row of its real tokens, no padding (`models.packing`): the "
            "same log-probs, losses and gradients (to float rounding) for less compute when lengths "
            "differ"
        ),
    )
    share_prefix: bool = setting(
        True,
        (
            "every prefix that rows of a micro-batch share runs once, forward and "
            "backward, the rows laid out as a prefix tree (a system prompt and tool schemas, a "
            "question's prompt, the turns branches of one episode share, SLATE's and RAG-Gym's "
            "candidates of one step; `models.prefix`); micro-batches are cut in token order so that "
            "such rows meet (with packing; where the attention kernel takes a custom mask, SDPA or eager, "
            "and it costs less than separate rows); and a long prefix common to all rows of a micro-batch "
            "runs once through the KV cache (prefix_cache_tokens), packed or not"
        ),
    )
    prefix_cache_tokens: int | None = setting(
        512,
        (
            "with share_prefix: a micro-batch whose rows all begin with at least this many common tokens (an "
            "instruct model's system prompt and tool schemas, a GRPO group's long prompt) runs them once as a "
            "batch of one, and the rows (padded, or packed as a prefix tree) attend to their keys and values "
            "(`models.prefix_cache`): the prompt's attention causal once instead of in every row's dense "
            "mask. Equal to one pass within float rounding. With the SDPA or eager attention kernel, the lean "
            "log-prob path (lean_logprobs), and not while activation checkpointing recomputes the layers. "
            "null: never"
        ),
        AT_LEAST_1,
    )
    balance_ranks: bool = setting(
        False,
        (
            "several processes: after the collection, whole groups move between processes so that each "
            "trains on a similar number of tokens (`engine.balance`); the update is the same, the "
            "slowest process less slow"
        ),
    )
    tensorboard: bool = setting(False, "write TensorBoard event files beside metrics.jsonl")
    wandb_project: str | None = setting(None, "log to this Weights & Biases project; null: not at all")
    mixed_precision: Literal["no", "bf16", "fp16"] | None = setting(
        None,
        (
            "accelerate's mixed precision: no, bf16 or fp16; null: what `accelerate launch` was given (its "
            "config's mixed_precision), else no. Each stage may set its own (a warm start in float32, RL in bf16)"
        ),
    )
    master_weights: bool = setting(
        True,
        (
            "float32 master copies (and optimizer moments) of trainable bfloat16 / float16 parameters "
            "outside DeepSpeed, which keeps its own (`engine.precision`): stepped in place in bfloat16, "
            "an update below half a weight's rounding step is lost (at lr 1e-6, 98% of a 0.5B layer's "
            "weights unchanged after 3 steps). With several micro-batches per update their gradients "
            "are summed in float32 too (2 bytes per parameter more while the update runs). false: the "
            "parameters stepped, and gradients summed, in their own dtype (8 bytes per parameter less "
            "with AdamW)"
        ),
    )
    guards: GuardsConfig = setting(GuardsConfig, "collapse monitors and what a trip does (GuardsConfig)")
    async_rollout: AsyncRolloutConfig = setting(
        AsyncRolloutConfig,
        "asynchronous partial rollouts under a staleness cap (`searchrl.rollout.async_rollout`)",
    )
    samples: SamplesConfig = setting(
        SamplesConfig,
        ("a sample of each step's batch as the loss saw it, in samples/ (`searchrl view`'s training view)"),
    )

    def __post_init__(self) -> None:
        if self.schedule == "wsd" and not 0 < self.decay_fraction <= 1:
            raise ValueError(f"schedule wsd needs decay_fraction in (0, 1], got {self.decay_fraction}")


@dataclass(frozen=True)
class WarmStartConfig:
    """SFT on the synthetic world's teacher before the main algorithm (the quickstart's first stage)."""

    checkpoint: str | None = setting(
        None, "an existing SFT model directory to start from instead of training"
    )
    teacher_passes: int = setting(
        4, "teacher trajectories per train question (each pass: new noise and names)", AT_LEAST_1
    )
    args: dict[str, Any] = setting(dict, "SFT algorithm arguments, e.g. {loss_on: all}")
    settings: AlgorithmSettings | None = setting(
        None, "args as SFT's typed Config (`searchrl.app.experiment.resolve`)", derived=True
    )
    trainer: TrainerConfig = setting(
        lambda: TrainerConfig(
            steps=600,
            batch_size=32,
            micro_batch_size=32,
            lr=1.0e-3,
            warmup_steps=30,
            schedule="cosine",
            eval_split="dev",
        ),
        "the warm start's own trainer section (its steps, learning rate and schedule)",
    )


@dataclass(frozen=True)
class EvalConfig:
    split: Literal["train", "dev", "test"] = setting("test", "the split the final evaluation reads")
    limit: int | None = setting(None, "questions evaluated; null: all", AT_LEAST_1)
    agent: Literal["policy", "teacher", "prm"] = setting(
        "policy", "greedy policy, scripted oracle, PRM best-of-N"
    )
    temperature: float = setting(0.0, "0: greedy", AT_LEAST_0)
    best_of: tuple[int, ...] = setting((4, 8), "N of the PRM-guided agent (RAG-Gym Algorithm 1)")
    best_of_temperature: float = setting(
        1.0, "sampling temperature of its candidates (RAG-Gym: 1.0)", AT_LEAST_0
    )
    prm: str | None = setting(
        None, 'the PRM model directory for agent "prm" (default: the run\'s final model)'
    )
    judge: dict[str, Any] | None = setting(
        None,
        (
            "an LLM answer judge (rewards/answer_judge.py: backend, model, url, ...): evaluation then "
            "also reports judge_acc, gen_acc (cover EM or the judge), judge_failures and "
            "judge_em_agreement; null: not asked"
        ),
    )


@dataclass(frozen=True)
class ProcessDataConfig:
    """RAG-Gym process-data collection (`searchrl collect-process-data`) and where DPO/PRM/SFT read it."""

    out: str | None = setting(
        None, "the collected dataset's directory (written by collection, read by training)"
    )
    n: int = setting(4, "candidate actions per step", AT_LEAST_1)
    annotator: str = setting(
        "rule",
        ("who scores the candidate actions: rule (the world's facts), judge (an LLM), or a dotted path"),
        registry="annotators",
    )
    annotator_args: dict[str, Any] = setting(dict, "the annotator's keyword arguments")
    chosen_min: float = setting(1.0, 'candidates scoring at least this are "chosen" …')
    rejected_max: float = setting(
        -1.0, '… at most this "rejected"; every chosen x rejected pair of a step is kept'
    )
    split: Literal["train", "dev", "test"] = setting("train", "the split whose questions are collected")
    limit: int | None = setting(None, "questions collected; null: all", AT_LEAST_1)
    temperature: float = setting(1.0, "sampling temperature of the candidate actions", AT_LEAST_0)


@dataclass(frozen=True)
class DistributedConfig:
    """Multi-process runs (`accelerate launch`)."""

    timeout: float | None = setting(
        None,
        (
            "seconds a collective operation may wait for the other processes before the run fails with "
            "an error naming the step and phase (instead of hanging); null: 300 on CPU, 1800 on GPU"
        ),
        POSITIVE,
    )


# config keys that were renamed or moved, with where they live now (the error message says so)
RENAMED_KEYS = {
    "RolloutConfig.group_size": "samples per question belong to the algorithm that uses them: "
    "algorithm.group_size (grpo, ppo, steppo; slate samples k candidates per step)",
    "PolicyObjective.sapo_tau_pos": "a policy loss's own settings sit under policy_loss_args: "
    "policy_loss_args: {tau_pos: ..., tau_neg: ...}",
    "PolicyObjective.sapo_tau_neg": "a policy loss's own settings sit under policy_loss_args: "
    "policy_loss_args: {tau_pos: ..., tau_neg: ...}",
}


@dataclass(frozen=True)
class Experiment:
    name: str = setting("experiment", "the experiment's name (fills output_dir's {name})")
    output_dir: str = setting("runs/{name}", "{name} is filled in")
    seed: int = setting(0, "the run's seed (model initialisation, sampling, data order)")
    data: DataConfig = setting(DataConfig, "where the questions and the corpus come from (DataConfig)")
    env: EnvConfig = setting(EnvConfig, "the search environment (EnvConfig)")
    model: ModelConfig = setting(ModelConfig, "the policy model (ModelConfig)")
    teacher: TeacherConfig = setting(TeacherConfig, "the synthetic world's scripted teacher (TeacherConfig)")
    algorithm: AlgorithmConfig | None = setting(
        None, "the training algorithm and its keys; null: evaluation only"
    )
    rewards: tuple[RewardSpec, ...] = setting(
        (), "the rewards summed into each episode's reward (RewardSpec each)"
    )
    rollout: RolloutConfig = setting(RolloutConfig, "how episodes are sampled (RolloutConfig)")
    trainer: TrainerConfig = setting(TrainerConfig, "the training loop (TrainerConfig)")
    warm_start: WarmStartConfig | None = setting(
        None, "SFT on the teacher before the algorithm (WarmStartConfig); null: none"
    )
    eval: EvalConfig = setting(EvalConfig, "the final evaluation (EvalConfig)")
    process_data: ProcessDataConfig = setting(
        ProcessDataConfig, "RAG-Gym process-data collection (ProcessDataConfig)"
    )
    distributed: DistributedConfig = setting(DistributedConfig, "multi-process runs (DistributedConfig)")

    @property
    def out(self) -> Path:
        return Path(self.output_dir.format(name=self.name))


# ---------------------------------------------------------------------------------------------- loading


class KeySources:
    """Tracks which file (or override) set each dotted key, so errors point at the right place."""

    def __init__(self) -> None:
        self.source: dict[str, str] = {}
        # (dotted key, registry or choice-list name, value): names the schema cannot check, because the
        # registries sit above it; `searchrl.app.experiment` checks them
        self.names: list[tuple[str, str, Any]] = []

    def record(self, data: Any, origin: str, prefix: str = "") -> None:
        if isinstance(data, dict):
            for k, v in data.items():
                key = f"{prefix}.{k}" if prefix else str(k)
                self.source[key] = origin
                self.record(v, origin, key)

    def where(self, key: str) -> str:
        key = re.sub(r"\[\d+\]", "", key)
        while key:
            if key in self.source:
                return self.source[key]
            key = key.rpartition(".")[0]
        return self.source.get("", "<config>")

    def error(self, key: str, problem: str, **kw: Any) -> ConfigError:
        return ConfigError(problem, file=self.where(key), key=key or None, **kw)


def from_dict(
    cls: type, data: dict[str, Any], source: str = "<config>", key: str = "", ctx: KeySources | None = None
) -> Any:
    """Convert a mapping into dataclass ``cls`` with the schema's checks (types, ranges, choices); registry
    names are left in ``ctx.names`` (`searchrl.app.experiment.from_dict_checked` checks them too)."""
    ctx = ctx if ctx is not None else KeySources()
    ctx.source.setdefault("", source)
    return convert(cls, data, ctx, key)


# ---------------------------------------------------------------------------------------------- conversion


_SCALARS: dict[type, tuple[Any, str]] = {
    bool: (lambda v: isinstance(v, bool), "true or false"),
    int: (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    float: (lambda v: isinstance(v, int | float) and not isinstance(v, bool), "a number"),
    str: (lambda v: isinstance(v, str), "a string"),
}


_EXPONENT_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def convert(tp: Any, value: Any, ctx: KeySources, key: str) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        errors = []
        for a in inner:
            try:
                return convert(a, value, ctx, key)
            except ConfigError as exc:
                errors.append(exc)
        raise errors[0] if len(errors) == 1 else ctx.error(key, f"expected one of {inner}", value=value)
    if origin is Literal:
        choices = typing.get_args(tp)
        if isinstance(value, bool) and not any(isinstance(c, bool) for c in choices):
            # YAML 1.1 reads an unquoted `no` / `off` (`yes` / `on`) as a boolean: `mixed_precision: no`
            spellings = ("yes", "on", "true") if value else ("no", "off", "false")
            value = next((c for c in spellings if c in choices), value)
        if value not in choices:
            raise ctx.error(key, "invalid value", value=value, choices=[str(c) for c in choices])
        return value
    if dataclasses.is_dataclass(tp):
        return _convert_dataclass(tp, value, ctx, key)
    if origin in (tuple, list):
        if not isinstance(value, list | tuple):
            raise ctx.error(key, "expected a list", value=value)
        args = typing.get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise ctx.error(key, f"expected a list of {len(args)} items", value=value)
            items = [convert(a, v, ctx, f"{key}[{i}]") for i, (a, v) in enumerate(zip(args, value))]
        else:
            elem = args[0] if args else Any
            items = [convert(elem, v, ctx, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ctx.error(key, "expected a mapping", value=value)
        return dict(value)
    if tp is float and isinstance(value, str) and _EXPONENT_FLOAT.fullmatch(value.strip()):
        value = float(value)  # YAML 1.1 reads `1e-5` (no dot) as a string; it is a number to a user
    if tp in _SCALARS:
        accepts, expected = _SCALARS[tp]
        if not accepts(value):
            raise ctx.error(key, f"expected {expected}", value=value)
        return float(value) if tp is float else value
    raise TypeError(f"config type {tp!r} at '{key}' is not supported")  # a bug in a section definition


def field_default(f: dataclasses.Field) -> Any:
    """A field's default value (its factory's product for a ``default_factory``); MISSING when required."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _convert_dataclass(cls: Any, value: Any, ctx: KeySources, key: str, base: Any = None) -> Any:
    """``value`` (a mapping) as section ``cls``. Keys it leaves out keep ``base``'s values (the section's
    effective default), and a nested section it gives in part merges field by field onto that section's
    default: ``warm_start: {trainer: {steps: 50}}`` keeps the warm start's own learning rate and schedule
    (its ``default_factory``), not the plain `TrainerConfig`'s."""
    if isinstance(value, cls):
        return value
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise ctx.error(key, f"expected a mapping for section '{cls.__name__}'", value=value)
    value = dict(value)
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("derived")}
    if cls is AlgorithmConfig:  # flat YAML: every key but name is an algorithm argument
        value = {"name": value.pop("name", AlgorithmConfig.name), "args": value}
        base = None
    kwargs: dict[str, Any] = {}
    for k, v in value.items():
        sub = f"{key}.{k}" if key else str(k)
        if k not in fields:
            hint = next(
                (RENAMED_KEYS[n] for c in cls.__mro__ if (n := f"{c.__name__}.{k}") in RENAMED_KEYS), None
            )
            raise ctx.error(
                sub, "unknown key", value=k, choices=list(fields), **({"hint": hint} if hint else {})
            )
        default = getattr(base, k) if base is not None else field_default(fields[k])
        if (
            isinstance(v, dict)
            and dataclasses.is_dataclass(default)
            and not isinstance(default, type)
            and type(default) is not AlgorithmConfig
        ):
            kwargs[k] = _convert_dataclass(type(default), v, ctx, sub, base=default)
        else:
            kwargs[k] = convert(hints[k], v, ctx, sub)
        _check_names(fields[k], kwargs[k], ctx, sub)
        _check_range(fields[k], kwargs[k], ctx, sub)
    missing = [
        n
        for n, f in fields.items()
        if n not in kwargs and base is None and field_default(f) is dataclasses.MISSING
    ]
    if missing:
        raise ctx.error(f"{key}.{missing[0]}" if key else missing[0], "required key is missing")
    try:
        obj = dataclasses.replace(base, **kwargs) if base is not None else cls(**kwargs)
    except (ValueError, TypeError) as exc:
        raise ctx.error(key, str(exc)) from exc
    return obj


def _check_range(f: dataclasses.Field, value: Any, ctx: KeySources, key: str) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ctx.error(key, "expected a finite number", value=value)
    check = f.metadata.get("range")
    if check is not None and value is not None and not check[0](value):
        raise ctx.error(key, f"{f.name} must be {check[1]}", value=value)


def _check_names(f: dataclasses.Field, value: Any, ctx: KeySources, key: str) -> None:
    if value is None:
        return
    for kind in ("registry", "choices"):
        if kind in f.metadata:
            ctx.names.append((key, f.metadata[kind], value))


# ---------------------------------------------------------------------------------------------- output


def to_dict(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = {
            f.name: to_dict(getattr(obj, f.name))
            for f in dataclasses.fields(obj)
            if not f.metadata.get("derived")
        }
        if isinstance(obj, AlgorithmConfig):
            out = {"name": obj.name, **obj.args}
        return out
    if isinstance(obj, tuple | list):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def save_resolved(exp: Experiment, out_dir: str | Path, filename: str = "config.yaml") -> Path:
    """Write the fully resolved config beside a run's (or an evaluation's) outputs."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / filename
    path.write_text(yaml.safe_dump(to_dict(exp), sort_keys=False), encoding="utf-8")
    return path
