"""Experiment files -> frozen dataclasses, with errors a user can act on.

``load_experiment(path, overrides)`` reads YAML, follows ``base:`` includes (paths relative to the
including file; later files and overrides win; mappings merge, lists replace), applies ``a.b=c``
overrides, converts everything into the typed sections below and checks registry names before anything
heavy is imported. Every error names the file (or the command line), the dotted key, the bad value and
the valid choices, with a close-match suggestion for typos.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from searchrl.envs.synthetic.teacher import TeacherConfig
from searchrl.envs.synthetic.world import WorldConfig
from searchrl.errors import ConfigError, RegistryError
from searchrl.registry import Registry

# ---------------------------------------------------------------------------------------------- sections


@dataclass(frozen=True)
class DataConfig:
    source: Literal["synthetic", "auto", "flashrag", "hotpotqa", "musique", "2wiki"] = "synthetic"
    world: WorldConfig = field(default_factory=WorldConfig)  # used when source is synthetic
    world_dir: str | None = None  # an existing world; default: generated into <output_dir>/world
    train: str | None = None  # question files for the other sources
    dev: str | None = None
    test: str | None = None
    corpus: str | None = None  # retrieval corpus for the other sources
    limit: int | None = None  # keep the first N questions of each split


@dataclass(frozen=True)
class RetrieverConfig:
    name: str = field(default="bm25", metadata={"registry": "retrievers"})
    corpus: str | None = None  # default: the data section's corpus (the world's for synthetic)
    index: str | None = None  # a saved index directory (`searchrl index`); built and saved there if missing
    cache: int = 100_000  # LRU entries; 0 turns the cache off
    args: dict[str, Any] = field(default_factory=dict)  # passed to the retriever's constructor


@dataclass(frozen=True)
class SummarizerConfig:
    name: str = field(default="extract", metadata={"registry": "summarizers"})
    args: dict[str, Any] = field(default_factory=dict)  # passed to the summarizer's constructor


@dataclass(frozen=True)
class EnvConfig:
    retriever: RetrieverConfig = field(default_factory=RetrieverConfig)
    tags: str = field(default="search_r1", metadata={"choices": "tagsets"})
    # the prompt: short, search_r1, research (plain text, for base models), or search_r1_instruct,
    # research_instruct, short_chat (through the tokenizer's chat template, for instruct models)
    template: str = field(default="short", metadata={"choices": "templates"})
    topk: int = 3
    max_turns: int = 4  # non-answer actions per episode before the answer is forced
    max_query_chars: int = 256
    on_budget: Literal["force_answer", "end"] = "force_answer"
    doc_max_words: int | None = None
    # how documents are written into observations: search_r1 "Doc 1(Title: t) text" (Search-R1, ReSearch,
    # FlashRAG) or stepsearch "Doc 1<## Title: t ##> text" (StepSearch's public code parses this one)
    doc_format: Literal["search_r1", "stepsearch"] = "search_r1"
    # the agent design (RAG-Gym Appendix C, §3): react (think/search/answer turns), direct (answer at once),
    # rag (the question is the one query, then answer), research (RAG-Gym's ReSearch: the state is the
    # question and the (query, summary) pairs so far, re-rendered each step; SFT, DPO, PRM and evaluation only)
    agent: Literal["react", "direct", "rag", "research"] = "react"
    # turns each search's documents into a short answer to its query (envs/summarize.py). Default: `extract`
    # for research, none (the documents themselves) for the others; set it on react for Search-o1's design.
    summarizer: SummarizerConfig | None = None


@dataclass(frozen=True)
class LoraConfig:
    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: tuple[str, ...] = (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    )


@dataclass(frozen=True)
class ModelConfig:
    path: str | None = None  # local directory or hub id; None builds the local `size` model
    size: Literal["tiny", "small", "base", "qwen2.5-0.5b"] = "small"
    # the local model's tokenizer: "local" is trained on the synthetic world (every tag one special token);
    # "qwen2.5" is Qwen2.5's real vocabulary (tags are text), from the qwen extra
    tokenizer: Literal["local", "qwen2.5"] = "local"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    lora: LoraConfig | None = None  # null: full fine-tuning


@dataclass(frozen=True)
class RewardSpec:
    name: str = field(metadata={"registry": "rewards"})
    weight: float = 1.0
    args: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class AlgorithmConfig:
    """``algorithm: {name: grpo, clip: 0.2, ...}``: every key but ``name`` is the algorithm's own."""

    name: str = field(default="grpo", metadata={"registry": "algorithms"})
    args: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RolloutConfig:
    backend: str = field(default="hf", metadata={"registry": "generators"})
    group_size: int = 5  # trajectories per question (ReSearch Table 4: 5 rollouts)
    temperature: float = 1.0  # ReSearch Table 4; also divides the logits of the training log-probs
    top_p: float = 1.0
    max_new_tokens: int = 128  # per action (generation stops earlier at a stop tag)
    max_total_tokens: int = 2048  # whole trajectory: prompt + actions + observations
    batch_size: int = 64  # sequences per generation call
    # keyword arguments of the backend, e.g. vllm: {gpu_memory_utilization: 0.4, tensor_parallel_size: 2,
    # enable_sleep_mode: true, max_model_len: 8192}
    backend_args: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TrainerConfig:
    steps: int = 100  # optimizer steps per epoch × mini_batch == rollout batches
    batch_size: int = 16  # questions (online) or records (SFT) per step, across all processes
    micro_batch_size: int = 8  # sequences per forward/backward on one process
    lr: float = 1.0e-6  # ReSearch Table 4
    optimizer: Literal["adamw", "sgd"] = "adamw"
    weight_decay: float = 0.0
    warmup_steps: int = 0
    schedule: Literal["constant", "cosine", "linear"] = "constant"
    max_grad_norm: float = 1.0
    epochs: int = 1  # passes over each rollout batch (PPO epochs)
    mini_batches: int = 1  # optimizer updates per pass over a rollout batch
    save_every: int = 50  # steps between checkpoints (and at the end)
    keep_checkpoints: int = 2
    eval_every: int = 0  # steps between evaluations on `eval_split` (0: only at the end)
    eval_split: str = "dev"
    eval_limit: int | None = 200
    log_entropy: bool = True
    # log-probs from the final hidden states, the output layer applied only at action tokens and in chunks:
    # no (batch, tokens, vocabulary) logits tensor (2.5 GB per 4,096 tokens at Qwen2.5's vocabulary)
    lean_logprobs: bool = True
    tensorboard: bool = False
    wandb_project: str | None = None
    mixed_precision: Literal["no", "bf16", "fp16"] = "no"


@dataclass(frozen=True)
class WarmStartConfig:
    """SFT on the synthetic world's teacher before the main algorithm (the quickstart's first stage)."""

    checkpoint: str | None = None  # an existing SFT model directory to start from instead of training
    teacher_passes: int = 4  # teacher trajectories per train question (each pass: new noise and names)
    args: dict[str, Any] = field(default_factory=dict)  # SFT algorithm arguments, e.g. {loss_on: all}
    trainer: TrainerConfig = field(
        default_factory=lambda: TrainerConfig(
            steps=600,
            batch_size=32,
            micro_batch_size=32,
            lr=1.0e-3,
            warmup_steps=30,
            schedule="cosine",
            eval_split="dev",
        )
    )


@dataclass(frozen=True)
class EvalConfig:
    split: str = "test"
    limit: int | None = None
    agent: Literal["policy", "teacher", "prm"] = "policy"  # greedy policy, scripted oracle, PRM best-of-N
    temperature: float = 0.0  # 0: greedy
    best_of: tuple[int, ...] = (4, 8)  # N of the PRM-guided agent (RAG-Gym Algorithm 1)
    best_of_temperature: float = 1.0  # sampling temperature of its candidates (RAG-Gym: 1.0)
    prm: str | None = None  # the PRM model directory for agent "prm" (default: the run's final model)


@dataclass(frozen=True)
class ProcessDataConfig:
    """RAG-Gym process-data collection (`searchrl collect-process-data`) and where DPO/PRM/SFT read it."""

    out: str | None = None  # the collected dataset's directory (written by collection, read by training)
    n: int = 4  # candidate actions per step
    annotator: str = field(default="rule", metadata={"registry": "annotators"})
    annotator_args: dict[str, Any] = field(default_factory=dict)
    chosen_min: float = 1.0  # candidates scoring at least this are "chosen" …
    rejected_max: float = -1.0  # … at most this "rejected"; every chosen x rejected pair of a step is kept
    split: str = "train"
    limit: int | None = None
    temperature: float = 1.0


@dataclass(frozen=True)
class DistributedConfig:
    """Multi-process runs (`accelerate launch`)."""

    # seconds a collective operation may wait for the other processes before the run fails with an error
    # naming the step and phase (instead of hanging); null: 300 on CPU, 1800 on GPU
    timeout: float | None = None


# Value ranges, checked wherever a section is read (files, overrides, `searchrl validate`, every command).
_AT_LEAST_1, _AT_LEAST_0, _POSITIVE = (
    (lambda v: v >= 1, "at least 1"),
    (lambda v: v >= 0, "at least 0"),
    (
        lambda v: v > 0,
        "greater than 0",
    ),
)
RANGES: dict[str, dict[str, tuple[Callable[[Any], bool], str]]] = {
    "DataConfig": {"limit": _AT_LEAST_1},
    "RetrieverConfig": {"cache": _AT_LEAST_0},
    "EnvConfig": {"topk": _AT_LEAST_1, "max_turns": _AT_LEAST_1, "max_query_chars": _AT_LEAST_1,
                  "doc_max_words": _AT_LEAST_1},
    "LoraConfig": {"r": _AT_LEAST_1, "alpha": _POSITIVE, "dropout": (lambda v: 0 <= v < 1, "in [0, 1)")},
    "RolloutConfig": {"group_size": _AT_LEAST_1, "temperature": _AT_LEAST_0,
                      "top_p": (lambda v: 0 < v <= 1, "in (0, 1]"), "max_new_tokens": _AT_LEAST_1,
                      "max_total_tokens": _AT_LEAST_1, "batch_size": _AT_LEAST_1},
    "TrainerConfig": {"steps": _AT_LEAST_1, "batch_size": _AT_LEAST_1, "micro_batch_size": _AT_LEAST_1,
                      "lr": _POSITIVE, "weight_decay": _AT_LEAST_0, "warmup_steps": _AT_LEAST_0,
                      "max_grad_norm": _POSITIVE, "epochs": _AT_LEAST_1, "mini_batches": _AT_LEAST_1,
                      "save_every": _AT_LEAST_1, "keep_checkpoints": _AT_LEAST_1, "eval_every": _AT_LEAST_0,
                      "eval_limit": _AT_LEAST_1},
    "WarmStartConfig": {"teacher_passes": _AT_LEAST_1},
    "EvalConfig": {"limit": _AT_LEAST_1, "temperature": _AT_LEAST_0, "best_of_temperature": _AT_LEAST_0},
    "ProcessDataConfig": {"n": _AT_LEAST_1, "limit": _AT_LEAST_1, "temperature": _AT_LEAST_0},
    "DistributedConfig": {"timeout": _POSITIVE},
}  # fmt: skip


@dataclass(frozen=True)
class Experiment:
    name: str = "experiment"
    output_dir: str = "runs/{name}"  # {name} is filled in
    seed: int = 0
    data: DataConfig = field(default_factory=DataConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    algorithm: AlgorithmConfig | None = None
    rewards: tuple[RewardSpec, ...] = ()
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    warm_start: WarmStartConfig | None = None
    eval: EvalConfig = field(default_factory=EvalConfig)
    process_data: ProcessDataConfig = field(default_factory=ProcessDataConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)

    @property
    def out(self) -> Path:
        return Path(self.output_dir.format(name=self.name))


# ---------------------------------------------------------------------------------------------- registries


def _registries() -> dict[str, Registry[Any]]:
    from searchrl.algorithms import ALGORITHMS
    from searchrl.envs.retrievers.base import RETRIEVERS
    from searchrl.envs.summarize import SUMMARIZERS
    from searchrl.rewards import REWARDS
    from searchrl.rewards.judges import ANNOTATORS, JUDGES
    from searchrl.rollout.generator import GENERATORS

    return {"retrievers": RETRIEVERS, "rewards": REWARDS, "algorithms": ALGORITHMS, "generators": GENERATORS,
            "judges": JUDGES, "annotators": ANNOTATORS, "summarizers": SUMMARIZERS}  # fmt: skip


def _choices(name: str) -> list[str]:
    from searchrl.envs.tags import CHAT_TEMPLATES, TAGSETS, TEMPLATES

    return {"tagsets": list(TAGSETS), "templates": [*TEMPLATES, *CHAT_TEMPLATES]}[name]


# ---------------------------------------------------------------------------------------------- loading


class _Ctx:
    """Tracks which file (or override) set each dotted key, so errors point at the right place."""

    def __init__(self) -> None:
        self.source: dict[str, str] = {}

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


def _read_yaml(path: Path, ctx: _Ctx, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    if not path.exists():
        raise ConfigError("config file not found", file=str(path))
    if path.resolve() in seen:
        raise ConfigError("circular 'base:' include", file=str(path), value=[str(p) for p in seen])
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"not valid YAML: {exc}", file=str(path)) from exc
    if not isinstance(data, dict):
        raise ConfigError(
            "the top level must be a mapping of sections", file=str(path), value=type(data).__name__
        )
    bases = data.pop("base", None) or []
    merged: dict[str, Any] = {}
    for base in [bases] if isinstance(bases, str) else bases:
        base_path = (path.parent / base).resolve()
        if not base_path.exists():
            raise ConfigError("base config not found", file=str(path), key="base", value=str(base))
        merged = _merge(merged, _read_yaml(base_path, ctx, (*seen, path.resolve())))
    ctx.record(data, str(path))
    return _merge(merged, data)


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """``b`` over ``a``, recursively. A mapping that names a different ``name`` (another algorithm, reward
    or retriever) replaces the old one instead of inheriting arguments that belong to it."""
    out = dict(a)
    for k, v in b.items():
        old = out.get(k)
        same = (
            isinstance(v, dict)
            and isinstance(old, dict)
            and v.get("name", old.get("name")) == old.get("name")
        )
        out[k] = _merge(old, v) if same else v  # type: ignore[arg-type]
    return out


def apply_overrides(data: dict[str, Any], overrides: list[str], ctx: _Ctx) -> dict[str, Any]:
    """``a.b=c`` sets data['a']['b'] to YAML-parsed ``c``; a mapping ``c`` merges into an existing section
    (``trainer={steps: 2}`` keeps the file's other trainer keys; a different ``name`` replaces it)."""
    data = _merge({}, data)
    for item in overrides:
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise ConfigError(
                "an override must look like 'section.key=value'", file="command line", value=item
            )
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError as exc:
            raise ConfigError(
                f"value is not valid YAML: {exc}", file="command line", key=key, value=raw
            ) from exc
        node = data
        parts = key.split(".")
        for p in parts[:-1]:
            if not isinstance(node.get(p), dict):
                node[p] = {}
            node = node[p]
        old = node.get(parts[-1])  # a mapping merges into the section, as a file's `base:` does
        node[parts[-1]] = _merge({"_": old}, {"_": value})["_"] if isinstance(old, dict) else value
        ctx.source[key] = f"command line override '{item}'"
    return data


def load_experiment(path: str | Path | None = None, overrides: list[str] | None = None) -> Experiment:
    ctx = _Ctx()
    data: dict[str, Any] = {}
    if path is not None:
        data = _read_yaml(Path(path), ctx)
        ctx.source[""] = str(path)
    data = apply_overrides(data, list(overrides or []), ctx)
    return convert(Experiment, data, ctx, "")


def check_arguments(exp: Experiment, source: str = "<config>", training: bool = True) -> None:
    """Deeper checks that import the named objects: algorithm arguments against the algorithm's
    ``Config`` dataclass, reward ``args`` against the reward's keyword parameters, and (``training``: the
    file will train its algorithm) that the algorithm can train the agent design."""
    import inspect

    from searchrl.algorithms import ALGORITHMS
    from searchrl.envs.search import AGENTS, RERENDERED_AGENTS
    from searchrl.rewards import REWARDS
    from searchrl.rewards.registry import PROVIDED, reward_kind

    if exp.algorithm is not None:
        algo = ALGORITHMS.get(exp.algorithm.name)
        if training and getattr(algo, "online", False) and exp.env.agent in RERENDERED_AGENTS:
            raise ConfigError(
                f"agent '{exp.env.agent}' re-renders its state at every step, so an episode is not one token "
                f"sequence; the online algorithm '{exp.algorithm.name}' trains on such sequences",
                file=source, key="env.agent", value=exp.env.agent,
                choices=[a for a in AGENTS if a not in RERENDERED_AGENTS],
                hint="train the research agent with sft, dpo or prm on process data (RAG-Gym)")  # fmt: skip
        config_cls = getattr(algo, "Config", None)
        if config_cls is not None:
            from_dict(config_cls, exp.algorithm.args, source, "algorithm")
        elif exp.algorithm.args:
            raise ConfigError(
                "this algorithm takes no arguments", file=source, key="algorithm", value=exp.algorithm.args
            )
        if getattr(algo, "needs_process_reward", False) and not any(
            reward_kind(s.name) == "process" for s in exp.rewards
        ):
            raise ConfigError(
                f"algorithm '{exp.algorithm.name}' places per-step rewards, but no configured reward is a "
                "process reward", file=source, key="rewards", value=[s.name for s in exp.rewards],
                choices=[n for n in REWARDS.names() if REWARDS.meta(n).get("kind") == "process"],
                hint="add e.g. {name: stepsearch}, or use algorithm ppo for outcome rewards only")  # fmt: skip
    if exp.env.summarizer is not None:
        from searchrl.envs.summarize import SUMMARIZERS

        params = inspect.signature(SUMMARIZERS.get(exp.env.summarizer.name)).parameters
        for arg in exp.env.summarizer.args:
            if arg not in params:
                raise ConfigError(f"summarizer '{exp.env.summarizer.name}' has no argument '{arg}'", file=source,
                                  key=f"env.summarizer.args.{arg}", value=arg, choices=list(params))  # fmt: skip
    for i, spec in enumerate(exp.rewards):
        params = inspect.signature(REWARDS.get(spec.name)).parameters
        allowed = [
            n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY and n not in PROVIDED
        ]
        named_only = not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        for arg in spec.args:
            if arg in PROVIDED or (arg not in allowed and named_only):
                raise ConfigError(f"reward '{spec.name}' has no argument '{arg}'", file=source,
                                  key=f"rewards[{i}].args.{arg}", value=arg, choices=allowed)  # fmt: skip


def from_dict(cls: type, data: dict[str, Any], source: str = "<config>", key: str = "") -> Any:
    """Convert a mapping into dataclass ``cls`` with the same checks as experiment files."""
    ctx = _Ctx()
    ctx.source[""] = source
    return convert(cls, data, ctx, key)


# ---------------------------------------------------------------------------------------------- conversion


_SCALARS: dict[type, tuple[Any, str]] = {
    bool: (lambda v: isinstance(v, bool), "true or false"),
    int: (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    float: (lambda v: isinstance(v, int | float) and not isinstance(v, bool), "a number"),
    str: (lambda v: isinstance(v, str), "a string"),
}


_EXPONENT_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def convert(tp: Any, value: Any, ctx: _Ctx, key: str) -> Any:
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


def _convert_dataclass(cls: Any, value: Any, ctx: _Ctx, key: str) -> Any:
    if isinstance(value, cls):
        return value
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise ctx.error(key, f"expected a mapping for section '{cls.__name__}'", value=value)
    value = dict(value)
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if cls is AlgorithmConfig:  # flat YAML: every key but name is an algorithm argument
        value = {"name": value.pop("name", AlgorithmConfig.name), "args": value}
    kwargs: dict[str, Any] = {}
    for k, v in value.items():
        sub = f"{key}.{k}" if key else str(k)
        if k not in fields:
            raise ctx.error(sub, "unknown key", value=k, choices=list(fields))
        kwargs[k] = convert(hints[k], v, ctx, sub)
        _check_names(fields[k], kwargs[k], ctx, sub)
        _check_range(cls.__name__, k, kwargs[k], ctx, sub)
    missing = [n for n, f in fields.items() if n not in kwargs and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]  # fmt: skip
    if missing:
        raise ctx.error(f"{key}.{missing[0]}" if key else missing[0], "required key is missing")
    try:
        obj = cls(**kwargs)
    except (ValueError, TypeError) as exc:
        raise ctx.error(key, str(exc)) from exc
    return obj


def _check_range(section: str, name: str, value: Any, ctx: _Ctx, key: str) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ctx.error(key, "expected a finite number", value=value)
    check = RANGES.get(section, {}).get(name)
    if check is not None and value is not None and not check[0](value):
        raise ctx.error(key, f"must be {check[1]}", value=value)


def _check_names(f: dataclasses.Field, value: Any, ctx: _Ctx, key: str) -> None:
    if value is None:
        return
    if "registry" in f.metadata:
        reg = _registries()[f.metadata["registry"]]
        try:
            reg.check(value)
        except RegistryError as exc:
            if isinstance(value, str) and ":" in value:
                raise ctx.error(key, str(exc), value=value) from exc
            raise ctx.error(key, f"unknown {reg.kind} name", value=value, choices=reg.names()) from exc
    if "choices" in f.metadata:
        choices = _choices(f.metadata["choices"])
        if value not in choices:
            raise ctx.error(key, "invalid value", value=value, choices=choices)


# ---------------------------------------------------------------------------------------------- output


def to_dict(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        if isinstance(obj, AlgorithmConfig):
            out = {"name": obj.name, **obj.args}
        return out
    if isinstance(obj, tuple | list):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def save_resolved(exp: Experiment, out_dir: str | Path) -> Path:
    """Write the fully resolved config beside a run's outputs."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "config.yaml"
    path.write_text(yaml.safe_dump(to_dict(exp), sort_keys=False), encoding="utf-8")
    return path
