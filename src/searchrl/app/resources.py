"""Turn an `Experiment` into the objects a run needs: the world, question splits, corpus, retriever, env.

Shared by every command (eval, train, collect) so that they all see the same data the same way.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Any

from searchrl.app.environments import renders_chat
from searchrl.core.config import Experiment
from searchrl.core.errors import ConfigError, DataError
from searchrl.core.records import Doc, Example
from searchrl.data.corpus import load_corpus
from searchrl.data.loaders import load_examples
from searchrl.envs.retrievers import build_retriever
from searchrl.envs.retrievers.protocol import Retriever
from searchrl.envs.search import SearchEnv
from searchrl.envs.synthetic.world import World
from searchrl.envs.tags import ALL_TAG_STRINGS, TEMPLATES, TOOL_TAG_STRINGS
from searchrl.envs.tool_env import ToolEnv


class Resources:
    def __init__(self, exp: Experiment) -> None:
        self.exp = exp

    def fresh(self) -> Resources:
        """The same experiment's resources with nothing built yet: small to pickle, for a rollout worker
        process that builds its own (`searchrl.rollout.worker_process`)."""
        return type(self)(self.exp)

    @cached_property
    def world(self) -> World | None:
        """The synthetic world (loaded from `data.world_dir`, or generated once into the run directory)."""
        if self.exp.data.source != "synthetic":
            return None
        world_dir = self.world_dir
        if (world_dir / "world.json").exists():
            world = World.load(world_dir)
            if self.exp.data.world_dir is None and world.config != self.exp.data.world:
                world = World.generate(self.exp.data.world)  # config changed since: regenerate
                world.save(world_dir)
            return world
        if self.exp.data.world_dir is not None:
            raise ConfigError(
                "no world found there; create it with `searchrl world --out DIR`",
                key="data.world_dir",
                value=str(world_dir),
            )
        world = World.generate(self.exp.data.world)
        world.save(world_dir)
        return world

    @property
    def world_dir(self) -> Path:
        return Path(self.exp.data.world_dir) if self.exp.data.world_dir else self.exp.out / "world"

    @cached_property
    def corpus(self) -> list[Doc]:
        path = self.exp.env.retriever.corpus or self.exp.data.corpus
        if path is not None:
            return load_corpus(path)
        if self.world is not None:
            return self.world.documents()
        raise ConfigError("no retrieval corpus: set env.retriever.corpus or data.corpus", key="data.corpus")

    def examples(self, split: str) -> list[Example]:
        data = self.exp.data
        if self.world is not None:
            out = self.world.examples(split)
        else:
            path = getattr(data, split, None) if split in ("train", "dev", "test") else None
            if path is None:
                raise ConfigError(f"no question file for split '{split}'", key=f"data.{split}")
            corpus = self.corpus if (self.exp.env.retriever.corpus or data.corpus) else None
            out = load_examples(path, "auto" if data.source == "auto" else data.source, corpus=corpus)
        return out[: data.limit] if data.limit is not None else out

    @cached_property
    def retriever(self) -> Retriever:
        r = self.exp.env.retriever
        if r.name == "http":
            return build_retriever("http", cache=r.cache, **r.args)
        if r.name == "simulated" and r.args.get("source", "corpus") == "llm":
            from searchrl.rollout.chat import client_from_args

            client = client_from_args(
                dict(r.args.get("llm") or {}), "env.retriever.args.llm", "simulated_search"
            )
            return build_retriever("simulated", client=client, **r.args)
        saved = r.index is not None and (Path(r.index) / "index.json").exists()
        corpus = None if saved else self.corpus  # a saved index brings its own (memory-mapped) documents
        return build_retriever(r.name, corpus=corpus, index=r.index, cache=r.cache, **r.args)

    @cached_property
    def summarizer(self) -> Any:
        """The configured summarizer (built once: an LLM one may load a model), or None."""
        from searchrl.rollout.summarizers import SUMMARIZERS

        spec = self.exp.env.summarizer
        return SUMMARIZERS.get(spec.name)(**spec.args) if spec is not None else None

    def env(self, chat_format: Any = None) -> SearchEnv:
        """The configured environment: the entry ``env.protocol`` names in the environment registry
        (`searchrl.app.environments`). ``chat_format``: a `ChatFormat` to render with instead of the model's."""
        from searchrl.app.environments import ENVIRONMENTS

        return ENVIRONMENTS.get(self.exp.env.protocol)(self, chat_format)  # type: ignore[no-any-return]

    @cached_property
    def context_folder(self) -> Any:
        """Long horizons (``env.context``, `envs.context`): the folder of full contexts, or None."""
        from searchrl.envs.context import ContextFolder
        from searchrl.rollout.summarizers import SUMMARIZERS

        c = self.exp.env.context
        if c is None:
            return None
        summarizer = SUMMARIZERS.get(c.summarizer.name)(**c.summarizer.args)
        return ContextFolder(c.max_tokens, c.max_segments, c.summary_max_tokens, c.header, summarizer)

    @cached_property
    def mcp_connections(self) -> dict[str, Any]:
        """MCP servers connected so far, by address (one connection per server for the whole run)."""
        return {}

    @cached_property
    def tool_chat_format(self) -> Any:
        """The tool protocol's `ChatFormat`: the model's tokenizer and its chat template."""
        from searchrl.envs.chat_format import ChatFormat

        path, tok = self.model_tokenizer
        if not tok.chat_template:
            raise ConfigError(
                f"the tool protocol renders prompts and tool messages through the model's chat template, but "
                f"the tokenizer in {path} has none",
                key="env.protocol",
                value="tools",
                choices=["tags"],
                hint="use an instruct model's tokenizer (Qwen2.5/Qwen3 instruct), or model.tokenizer: local / qwen2.5 / qwen3",
            )
        from searchrl.envs.call_formats import resolve

        try:
            resolve(self.exp.env.call_format, tok.chat_template)
        except DataError as exc:
            raise ConfigError(str(exc), key="env.call_format", value=self.exp.env.call_format) from None
        return ChatFormat(tok, self.exp.env.chat_kwargs)

    @cached_property
    def model_tokenizer(self) -> tuple[Path, Any]:
        """The model's directory (the local model built there first) and its tokenizer."""
        from transformers import AutoTokenizer

        path = local_model_dir(self)
        return path, AutoTokenizer.from_pretrained(str(path), local_files_only=Path(path).is_dir())

    @cached_property
    def chat_format(self) -> Any:
        """The model's chat template as a function of the messages, with the assistant turn opened."""
        m = self.exp.model
        if m.path is None and m.tokenizer == "local":  # trained on the world, without a chat template
            raise ConfigError(
                f"template '{self.exp.env.template}' renders the prompt through the model's chat "
                "template; the local tokenizer has none",
                key="env.template",
                value=self.exp.env.template,
                choices=list(TEMPLATES),
                hint="set model.tokenizer: qwen2.5, or use a plain template",
            )
        path, tok = self.model_tokenizer
        if not tok.chat_template:
            raise ConfigError(
                f"template '{self.exp.env.template}' renders the prompt through the model's chat "
                f"template, but the tokenizer in {path} has none",
                key="env.template",
                value=self.exp.env.template,
                choices=list(TEMPLATES),
                hint="use a plain template, or model.tokenizer: qwen2.5 / an instruct model",
            )

        def render(messages: list[dict[str, Any]]) -> str:
            return str(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))

        return render


def tokenizer_texts(world: World, env: SearchEnv, teacher_examples: int = 300) -> list[str]:
    """Text a local tokenizer is trained on: the corpus, every question, the whole name pool, and
    teacher trajectories in both tag styles (so the think/search phrasing gets its own merges)."""
    from dataclasses import replace

    from searchrl.core.config import TeacherConfig
    from searchrl.envs.synthetic.teacher import teacher_records
    from searchrl.envs.tags import TAGSETS

    texts = [f"{d.title} {d.text}" for d in world.documents()]
    for split in ("train", "dev", "test"):
        texts += [ex.question for ex in world.examples(split)]
    for names in world.name_pool.values():
        texts += [" ".join(names)] * 3
    if isinstance(env, ToolEnv):  # the tool format: its prompts (tool schemas), calls and tool messages,
        # and each name as the agent writes it there: bare, in a JSON string or opening its final message
        for names in world.name_pool.values():
            texts += [" ".join(f'"{n}"' for n in names)] * 3
        cfg = replace(TeacherConfig(), noisy=True, rename_prob=0.5)
        for rec in teacher_records(env, world, world.examples("train")[:teacher_examples], cfg):
            texts += [rec["prompt"], *rec["actions"], *rec["observations"]]
        return texts
    for tags in TAGSETS.values():
        styled = SearchEnv(
            env.retriever,
            tags=tags,
            template=env.template,
            topk=env.topk,
            max_turns=env.max_turns,
            chat=env.chat,
        )
        cfg = replace(TeacherConfig(), noisy=True, rename_prob=0.5)
        for rec in teacher_records(styled, world, world.examples("train")[:teacher_examples], cfg):
            texts += rec["actions"]
    return texts


# The tool protocol's local tokenizer learns each name twice (" Name" as documents write it, bare as a JSON
# string or an answer holds it) and the tool prompt's text: this many rows more than the size's vocabulary
TOOLS_EXTRA_VOCAB = 1024


def local_model_path(resources: Resources) -> Path:
    """Where the local model of `model.size` for this experiment's world is built (`local_model_dir`)."""
    m = resources.exp.model
    tools = renders_chat(resources.exp.env.protocol) and m.tokenizer == "local"
    name = f"model-{m.size}" + (f"-{m.layers}layers" if m.layers is not None else "")
    name = name if m.tokenizer == "local" else f"{name}-{m.tokenizer}"
    return resources.world_dir / (f"{name}-tools" if tools else name)


def local_model_dir(resources: Resources) -> Path:
    """Build (once) the local model of `model.size` for this experiment's world, and return its path."""
    from searchrl.engine.checkpoint import has_weights
    from searchrl.models.tiny import build_local_model

    m = resources.exp.model
    if m.path is not None:
        return Path(m.path)
    if resources.world is None:
        raise ConfigError("model.path is required unless data.source is synthetic", key="model.path")
    tools = renders_chat(resources.exp.env.protocol) and m.tokenizer == "local"
    out = local_model_path(resources)
    if not has_weights(out):
        texts: list[str] = []
        template = None
        if tools:  # Qwen2.5's chat template, its tool markers one token each
            from searchrl.envs.chat_format import ChatFormat
            from searchrl.models.qwen import CHAT_TEMPLATE

            template = CHAT_TEMPLATE
            texts = tokenizer_texts(
                resources.world,
                resources.env(ChatFormat.from_template(template, resources.exp.env.chat_kwargs)),
            )
        elif m.tokenizer == "local":
            texts = tokenizer_texts(resources.world, resources.env())
        tags = (*ALL_TAG_STRINGS, *TOOL_TAG_STRINGS) if tools else ALL_TAG_STRINGS
        build_local_model(
            m.size,
            texts,
            out,
            seed=resources.exp.seed,
            tokenizer=m.tokenizer,
            tags=tags,
            layers=m.layers,
            chat_template=template,
            extra_vocab=TOOLS_EXTRA_VOCAB if tools else 0,
        )
    return out
