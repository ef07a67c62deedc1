"""Load and check an experiment: the file(s) and overrides (`searchrl.core.loader`), converted by the schema
(`searchrl.core.config`), then the names it gives checked against the registries (retrievers, rewards,
algorithms, generators, judges, annotators, summarizers, tag sets, templates); and, on demand, the deeper
checks that import the named objects (`check_arguments`: their arguments and calling conventions), run by
`searchrl validate` and before every command that trains or collects.

Every error names the file (or the command line), the dotted key, the bad value and the valid choices,
with a close-match suggestion for typos.
"""

from __future__ import annotations

import inspect
import os
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from searchrl.app.environments import renders_chat
from searchrl.core.config import Experiment, KeySources, from_dict
from searchrl.core.errors import ConfigError, MissingInput, RegistryError
from searchrl.core.loader import read_experiment
from searchrl.core.registry import Registry


def load_experiment(path: str | Path | None = None, overrides: list[str] | None = None) -> Experiment:
    """``path`` (a YAML experiment file, or None for the defaults) with ``overrides`` (``a.b=c``), converted
    and its names checked, before anything heavy is imported."""
    exp, ctx = read_experiment(path, overrides)
    check_names(ctx)
    return exp


def from_dict_checked(cls: type, data: dict[str, Any], source: str = "<config>", key: str = "") -> Any:
    """`searchrl.core.config.from_dict`, with the names it gives checked too."""
    ctx = KeySources()
    obj = from_dict(cls, data, source, key, ctx)
    check_names(ctx)
    return obj


def _registries() -> dict[str, Registry[Any]]:
    from searchrl.algorithms import ADVANTAGES, ALGORITHMS, POLICY_LOSSES
    from searchrl.app.environments import ENVIRONMENTS
    from searchrl.envs.retrievers.protocol import RETRIEVERS
    from searchrl.rewards import REWARDS
    from searchrl.rewards.judges import ANNOTATORS, JUDGES
    from searchrl.rollout.generator import GENERATORS
    from searchrl.rollout.summarizers import SUMMARIZERS

    return {
        "retrievers": RETRIEVERS,
        "rewards": REWARDS,
        "algorithms": ALGORITHMS,
        "advantages": ADVANTAGES,
        "policy_losses": POLICY_LOSSES,
        "generators": GENERATORS,
        "judges": JUDGES,
        "annotators": ANNOTATORS,
        "summarizers": SUMMARIZERS,
        "environments": ENVIRONMENTS,
    }


def _choices(name: str) -> list[str]:
    from searchrl.envs.tags import CHAT_TEMPLATES, TAGSETS, TEMPLATES

    return {"tagsets": list(TAGSETS), "templates": [*TEMPLATES, *CHAT_TEMPLATES]}[name]


def check_names(ctx: KeySources) -> None:
    """The registry names and named choices the schema recorded in ``ctx`` (``ctx.names``)."""
    registries = _registries()
    for key, kind, value in ctx.names:
        if kind in registries:
            reg = registries[kind]
            try:
                reg.check(value)
            except RegistryError as exc:
                if isinstance(value, str) and ":" in value:
                    raise ctx.error(key, str(exc), value=value) from exc
                raise ctx.error(key, f"unknown {reg.kind} name", value=value, choices=reg.names()) from exc
        elif value not in (choices := _choices(kind)):
            raise ctx.error(key, "invalid value", value=value, choices=choices)


def resolve(exp: Experiment, source: str = "<config>") -> Experiment:
    """``exp`` with ``algorithm.args`` and ``warm_start.args`` converted, once, to their typed configs
    (``algorithm.settings``: the algorithm's ``Config``; ``warm_start.settings``: SFT's), their names checked.
    An experiment already resolved is returned as it is."""
    from searchrl.algorithms import algorithm_config

    algo, warm = exp.algorithm, exp.warm_start
    if algo is not None and algo.settings is None:
        ctx = KeySources()
        typed = algorithm_config(algo.name, algo.args, source, "algorithm", ctx)
        check_names(ctx)
        algo = replace(algo, settings=typed)
    if warm is not None and warm.settings is None:  # the SFT warm start's arguments, under their own key
        from searchrl.algorithms.sft import SFTConfig

        warm = replace(warm, settings=from_dict_checked(SFTConfig, warm.args, source, "warm_start.args"))
    if algo is exp.algorithm and warm is exp.warm_start:
        return exp
    return replace(exp, algorithm=algo, warm_start=warm)


def check_arguments(exp: Experiment, source: str = "<config>", training: bool = True) -> Experiment:
    """Deeper checks that import the named objects: algorithm arguments against the algorithm's
    ``Config`` dataclass, reward ``args`` against the reward's keyword parameters, and (``training``: the
    file will train its algorithm) that the algorithm can train the agent design. Returns ``exp`` resolved
    (`resolve`: its algorithm sections typed), for `searchrl.app.plan.plan` and `searchrl.app.train.train`."""
    exp = resolve(exp, source)
    _check_algorithm(exp, source, training)
    _check_named_args(exp.process_data, source, "process_data")
    _check_env_arguments(exp, source)
    _check_reward_arguments(exp, source)
    return exp


def _local_path(path: str) -> bool:
    """Whether a model reference is a local path rather than a hub id (``org/name``, or a bare name)."""
    return os.path.isabs(path) or path.startswith((".", "~")) or path.count("/") > 1 or Path(path).exists()


def check_paths(exp: Experiment, source: str = "<config>", missing: list[MissingInput] | None = None) -> None:
    """The model and checkpoint directories the file names exist (hub ids such as ``Qwen/Qwen2.5-7B`` are
    not checked: no hub is reached here), and a source other than the synthetic world names its question
    files and a model. `validate` and `train` run it before anything loads.

    An input that is named but not there is a `MissingInput`: raised, or, given ``missing``, added to it and
    the checks go on (`validate --allow-missing`: the file is right, its inputs are still to be fetched)."""

    def absent(err: MissingInput) -> None:
        if missing is None:
            raise err
        missing.append(err)

    _check_data_source(exp, source, absent)
    named = [("model.path", exp.model.path)]
    if exp.warm_start is not None:
        named.append(("warm_start.checkpoint", exp.warm_start.checkpoint))
    for key, path in named:
        if path is None or not _local_path(str(path)):
            continue
        p = Path(str(path)).expanduser()
        if p.exists() and not p.is_dir():
            raise ConfigError("is not a directory", file=source, key=key, value=path)
        if not p.exists():
            absent(
                MissingInput(
                    "no such directory",
                    file=source,
                    key=key,
                    value=path,
                    hint="a model directory (config.json and weights), as training writes under "
                    "<run>/<stage>/final"
                    + (
                        ": run the quickstart first (searchrl train experiments/quickstart.yaml)"
                        if "runs/" in str(path)
                        else ""
                    ),
                )
            )


def check_model_template(exp: Experiment, source: str = "<config>") -> None:
    """A local model directory's tokenizer against the protocol and template: the tool protocol and the chat
    templates render through the model's chat template, so a tokenizer without one is refused here (as the
    environment refuses it when a stage starts; hub ids are checked then)."""
    from searchrl.app.resources import Resources
    from searchrl.envs.tags import CHAT_TEMPLATES

    e, m = exp.env, exp.model
    if not renders_chat(e.protocol) and e.template not in CHAT_TEMPLATES:
        return
    if (
        m.path is None
        or not _local_path(str(m.path))
        or not (Path(m.path) / "tokenizer_config.json").exists()
    ):
        return
    resources = Resources(exp)
    try:
        resources.tool_chat_format if renders_chat(e.protocol) else resources.chat_format
    except ConfigError as exc:
        raise exc.at(source) from None


class _NoSearch:
    """The retriever of a prompt-only environment: rendering a prompt never searches."""

    def search(self, queries: list[str], k: int) -> list[list[Any]]:
        raise RuntimeError("a prompt was rendered with a search")


def check_prompt_budget(exp: Experiment, source: str = "<config>") -> str | None:
    """The longest training prompt against ``rollout.max_total_tokens`` (`train` refuses a budget the prompt
    fills), where that is known without building anything: a training run of the tag protocol, a local model
    directory's tokenizer, question files (or the run's world, generated by an earlier run). Returns why it
    was not checked, or None when it was; raises `ConfigError` naming the file when the budget is too small."""
    from searchrl.app.resources import Resources, local_model_path
    from searchrl.envs.search import RERENDERED_AGENTS

    e = exp.env
    if exp.algorithm is None:
        return "no training stage"
    if e.protocol != "tags" or e.agent == "rag" or e.agent in RERENDERED_AGENTS:
        return f"the prompt of {e.protocol} / {e.agent} is counted when training starts"
    if exp.data.source == "synthetic":
        world = Path(exp.data.world_dir) if exp.data.world_dir else exp.out / "world"
        if not (world / "world.json").exists():
            return "the synthetic world is generated by the first run (checked when training starts)"
        from searchrl.envs.synthetic.world import World

        if (
            exp.data.world_dir is None and World.load(world).config != exp.data.world
        ):  # the run would regenerate it
            return "the world on disk was generated with other settings (checked when training starts)"
    resources = Resources(exp)
    path = (
        Path(str(exp.model.path)).expanduser() if exp.model.path is not None else local_model_path(resources)
    )
    if not _local_path(str(path)) or not (path / "tokenizer_config.json").exists():
        return "no local model directory with a tokenizer to count with yet (checked when training starts)"
    from searchrl.rollout.loop import check_prompt_room

    resources.__dict__["retriever"] = _NoSearch()  # the prompts need no index: none is built
    try:
        check_prompt_room(
            resources.env(),
            resources.model_tokenizer[1],
            resources.examples("train"),
            exp.rollout.max_total_tokens,
        )
    except ConfigError as exc:
        raise exc.at(source) from None
    return None


def _check_data_source(exp: Experiment, source: str, absent: Callable[[MissingInput], None]) -> None:
    d = exp.data
    if d.source == "synthetic":
        return
    if exp.model.path is None:
        raise ConfigError(
            "the local model is built on the synthetic world's text; with questions of another source give a "
            "model directory or hub id",
            file=source,
            key="model.path",
            hint=f"data.source is {d.source!r}; e.g. model.path=Qwen/Qwen2.5-3B",
        )
    needed = {exp.eval.split} | ({"train"} if exp.algorithm is not None else set())
    for split in sorted(needed):
        if getattr(d, split) is None:
            raise ConfigError(
                f"data.source {d.source!r} reads its {split} questions from a file, and none is given",
                file=source,
                key=f"data.{split}",
                hint=f"data.{split}=PATH (a {d.source} file)",
            )
        if not Path(getattr(d, split)).exists():
            absent(
                MissingInput(
                    "no such file",
                    file=source,
                    key=f"data.{split}",
                    value=getattr(d, split),
                    hint=f"the {d.source} question file (docs/retrieval.md#data: where each data set comes from)",
                )
            )


def _check_algorithm(exp: Experiment, source: str, training: bool) -> None:
    """The algorithm's arguments (``exp`` resolved), that it can train the agent design, the asynchronous-rollout
    refusal, and a process reward where the algorithm places per-step rewards."""
    from searchrl.algorithms import ALGORITHMS, requirements
    from searchrl.envs.search import AGENTS, RERENDERED_AGENTS
    from searchrl.rewards import REWARDS
    from searchrl.rewards.contract import reward_kind

    if exp.algorithm is not None:
        algo: Any = ALGORITHMS.get(exp.algorithm.name)
        conf = exp.algorithm.settings
        _check_named_args(conf, source, "algorithm")
        req = requirements(exp.algorithm.name, conf, exp.env, source)
        if training and req.online and exp.env.agent in RERENDERED_AGENTS:
            raise ConfigError(
                f"agent '{exp.env.agent}' re-renders its state at every step, so an episode is not one token "
                f"sequence; the online algorithm '{exp.algorithm.name}' trains on such sequences",
                file=source,
                key="env.agent",
                value=exp.env.agent,
                choices=[a for a in AGENTS if a not in RERENDERED_AGENTS],
                hint="train the research agent with sft, dpo or prm on process data (RAG-Gym)",
            )
        if training and req.online:
            _check_context_algorithm(exp, conf, source)
        if training and exp.algorithm.name in BRANCHING:
            _check_tree_tools(exp, source)
        if training and exp.algorithm.name in ENTROPY_BRANCHING and exp.rollout.compile:
            raise ConfigError(
                f"{exp.algorithm.name} branches where the sampler's entropy rises after a tool response; rollout.compile's "
                "captured decoding step does not record entropies",
                file=source,
                key="rollout.compile",
                value=exp.rollout.compile,
                choices=["false"],
            )
        if training and exp.trainer.async_rollout.max_staleness:  # refused before any stage runs
            resamples = getattr(getattr(conf, "dynamic_sampling", None), "enabled", False)
            _check_async(exp, req.online, not algo.episodic, resamples, source)
        if req.process_reward and not any(reward_kind(s.name) == "process" for s in exp.rewards):
            raise ConfigError(
                f"algorithm '{exp.algorithm.name}' places per-step rewards, but no configured reward is a "
                "process reward",
                file=source,
                key="rewards",
                value=[s.name for s in exp.rewards],
                choices=[n for n in REWARDS.names() if REWARDS.meta(n).get("kind") == "process"],
                hint="add e.g. {name: stepsearch}, or use algorithm ppo for outcome rewards only",
            )


# algorithms that continue an episode from one of its steps, its state rebuilt by replay (`tree_grpo.node_prefix`)
BRANCHING = ("tree_grpo", "arpo", "aepo")
ENTROPY_BRANCHING = ("arpo", "aepo")  # ... where the sampler's entropy after a tool response rose


def _check_tree_tools(exp: Experiment, source: str) -> None:
    """Tree and branch rollouts rebuild a node's state from its recorded actions and observations: a user's Python
    or MCP tools may hold state a replay cannot rebuild (the built-in search and open hold none)."""
    if exp.env.protocol != "tools" or exp.algorithm is None:
        return
    own = [t.name for t in exp.env.tools if t.name not in ("search", "open")]
    if own:
        raise ConfigError(
            f"{exp.algorithm.name} continues an episode from one of its steps by replaying the steps before it; "
            "tools other than search and open may keep state that a replay does not rebuild",
            file=source,
            key="env.tools",
            value=own,
            choices=["search", "open"],
            hint="train these tools with algorithm grpo (its group of whole episodes)",
        )


def _check_context(exp: Experiment, source: str) -> None:
    """``env.context`` (long horizons, `envs.context`): a budget below the episode's, the react design, and
    the summarizer's arguments (the fields' own ranges are checked when the file is read)."""
    c = exp.env.context
    if c is None:
        return
    if not 0 < c.max_tokens < exp.rollout.max_total_tokens:
        raise ConfigError(
            "the context is folded when it holds this many tokens: it must be positive and below "
            f"rollout.max_total_tokens ({exp.rollout.max_total_tokens}), which leaves the room for the last action "
            "and observation",
            file=source,
            key="env.context.max_tokens",
            value=c.max_tokens,
            hint=f"e.g. {max(1, exp.rollout.max_total_tokens - 2 * exp.rollout.max_new_tokens)} "
            "(max_total_tokens minus room for an action and its documents)",
        )
    if exp.env.agent != "react":
        raise ConfigError(
            "folding summarises the searches of an agent that searches in turns (react)",
            file=source,
            key="env.agent",
            value=exp.env.agent,
            choices=["react"],
            hint="set env.context: null for this agent design",
        )
    from searchrl.rollout.summarizers import SUMMARIZERS

    fn = SUMMARIZERS.get(c.summarizer.name)
    check_kwargs(
        fn, c.summarizer.args, source, "env.context.summarizer.args", f"summarizer '{c.summarizer.name}'"
    )


def _check_context_algorithm(exp: Experiment, conf: Any, source: str) -> None:
    """Folded episodes train as several rows sharing the episode's outcome: GRPO's sequence-level estimators
    (group baselines over episodes) and synchronous rollouts."""
    from searchrl.algorithms.objective import estimator_of, estimators

    split = "env.context" if exp.env.context is not None else "env.protocol"
    if (exp.env.context is None and exp.env.protocol != "agent") or exp.algorithm is None:
        return
    if exp.algorithm.name != "grpo":
        raise ConfigError(
            f"a folded episode (or an agent program's, which may split into several rows) trains as several rows "
            f"that share its outcome; '{exp.algorithm.name}' places values, step rewards or per-step candidates "
            "on one sequence per episode",
            file=source,
            key=split,
            value=exp.algorithm.name,
            choices=["grpo"],
            hint="train with algorithm grpo (any of its sequence-level advantages)",
        )
    if estimator_of(conf.advantage).level != "sequence":
        raise ConfigError(
            "a folded episode's rows share one advantage per episode: the estimator must be sequence-level",
            file=source,
            key="algorithm.advantage",
            value=conf.advantage,
            choices=estimators("sequence"),
        )
    if exp.trainer.async_rollout.max_staleness:
        raise ConfigError(
            "folding and agent programs run in the synchronous rollout (the asynchronous worker's rows are whole "
            "episodes of our own loop)",
            file=source,
            key="trainer.async_rollout.max_staleness",
            value=exp.trainer.async_rollout.max_staleness,
            choices=["0"],
        )


def _check_tool_protocol(exp: Experiment, source: str) -> None:
    """``env.protocol: tools``: a chat prompt, the react design, and tool specs that name known tools."""
    from searchrl.envs.tags import CHAT_TEMPLATES
    from searchrl.envs.tool_specs import check_tool_specs

    e = exp.env
    _check_agent_program(exp, source)
    if not renders_chat(e.protocol):
        return
    if e.template not in CHAT_TEMPLATES:
        raise ConfigError(
            "the tool protocol renders the prompt through the model's chat template: it needs a chat prompt",
            file=source,
            key="env.template",
            value=e.template,
            choices=list(CHAT_TEMPLATES),
        )
    if e.agent != "react":
        raise ConfigError(
            "the tool protocol's agent searches in turns (react)",
            file=source,
            key="env.agent",
            value=e.agent,
            choices=["react"],
        )
    if e.max_tool_calls < 1:
        raise ConfigError("must be at least 1", file=source, key="env.max_tool_calls", value=e.max_tool_calls)
    check_tool_specs(e.tools, source)


def _check_agent_program(exp: Experiment, source: str) -> None:
    """``env.protocol: agent``: one program (its function imported, its parameters ones we pass), and none of
    what an episode played elsewhere cannot have (folding)."""
    from searchrl.rollout.agent_program import check_program

    e, key = exp.env, "env.agent_program"
    if e.protocol != "agent":
        if e.agent_program is not None:
            raise ConfigError("an agent program plays episodes only under env.protocol: agent", file=source,
                              key="env.protocol", value=e.protocol, choices=["agent"],
                              hint="set env.protocol: agent, or remove env.agent_program")  # fmt: skip
        return
    a = e.agent_program
    if a is None or (a.function is None) == (not a.command):
        raise ConfigError(
            "env.protocol: agent runs a program once per episode: give exactly one of function and command",
            file=source,
            key=key,
            value=None if a is None else {"function": a.function, "command": a.command},
            hint="e.g. env.agent_program: {function: my_agent:run} (PYTHONPATH holds my_agent.py), docs/agents.md",
        )
    if a.function is not None:
        try:
            check_program(a.function)
        except Exception as exc:
            raise ConfigError(str(exc), file=source, key=f"{key}.function", value=a.function) from None
    elif a.command and not (shutil.which(a.command[0]) or Path(a.command[0]).is_file()):
        raise ConfigError(f"no program {a.command[0]!r} on PATH or at that path", file=source,
                          key=f"{key}.command", value=list(a.command))  # fmt: skip
    if e.context is not None:
        raise ConfigError("an agent program keeps its own history; folding does not apply", file=source,
                          key="env.context", value="set", choices=["null"])  # fmt: skip
    if (
        exp.rollout.backend != "hf"
    ):  # the endpoint calls the generator from its server thread: tested with HF only
        raise ConfigError("agent programs are served by the HF backend (vLLM behind the endpoint is not tested yet)",
                          file=source, key="rollout.backend", value=exp.rollout.backend, choices=["hf"])  # fmt: skip


def _check_env_arguments(exp: Experiment, source: str) -> None:
    """The retriever's and the summarizer's arguments against their parameters; the tool protocol."""
    from searchrl.envs.retrievers import retriever_arguments

    _check_tool_protocol(exp, source)
    _check_context(exp, source)
    known = retriever_arguments(exp.env.retriever.name)
    for arg in exp.env.retriever.args:
        if known is not None and arg not in known:
            raise ConfigError(
                f"retriever '{exp.env.retriever.name}' has no argument '{arg}'",
                file=source,
                key=f"env.retriever.args.{arg}",
                value=arg,
                choices=known,
            )
    if exp.env.summarizer is not None:
        from searchrl.rollout.summarizers import SUMMARIZERS

        params = inspect.signature(SUMMARIZERS.get(exp.env.summarizer.name)).parameters
        for arg in exp.env.summarizer.args:
            if arg not in params:
                raise ConfigError(
                    f"summarizer '{exp.env.summarizer.name}' has no argument '{arg}'",
                    file=source,
                    key=f"env.summarizer.args.{arg}",
                    value=arg,
                    choices=list(params),
                )


def _check_reward_arguments(exp: Experiment, source: str) -> None:
    """Each reward's arguments against its keyword parameters, and its calling convention; the evaluation
    judge's arguments."""
    from searchrl.rewards import REWARDS
    from searchrl.rewards.contract import PROVIDED
    from searchrl.rewards.pipeline import check_calling_convention

    if exp.eval.judge:
        judge_params = inspect.signature(REWARDS.get("judge")).parameters
        for arg in exp.eval.judge:
            if arg not in judge_params:
                raise ConfigError(
                    f"the answer judge has no argument '{arg}'",
                    file=source,
                    key=f"eval.judge.{arg}",
                    value=arg,
                    choices=list(judge_params),
                )

    for i, spec in enumerate(exp.rewards):
        params = inspect.signature(REWARDS.get(spec.name)).parameters
        allowed = [
            n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY and n not in PROVIDED
        ]
        named_only = not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        for arg in spec.args:
            if arg in PROVIDED or (arg not in allowed and named_only):
                raise ConfigError(
                    f"reward '{spec.name}' has no argument '{arg}'",
                    file=source,
                    key=f"rewards[{i}].args.{arg}",
                    value=arg,
                    choices=allowed,
                )
        _check_stepsearch_compat(exp, REWARDS.get(spec.name), spec.args, source, i)
        try:
            check_calling_convention(REWARDS.get(spec.name), spec.args)
        except TypeError as exc:
            raise ConfigError(
                f"reward '{spec.name}' does not follow the reward calling convention "
                f"fn(traj, *, answers=..., hops=..., <args>) -> float | RewardOutput: {exc}",
                file=source,
                key=f"rewards[{i}].name",
                value=spec.name,
            ) from None


def _check_async(exp: Experiment, online: bool, own_collect: bool, resamples: bool, source: str) -> None:
    """``trainer.async_rollout`` where this version cannot run it."""
    from searchrl.rollout.async_rollout import refusal

    assert exp.algorithm is not None
    why = refusal(
        exp.algorithm.name, online, own_collect, exp.rollout.loop, resamples, exp.env.retriever.name
    )
    if why is not None:
        raise ConfigError(
            why,
            file=source,
            key="trainer.async_rollout.max_staleness",
            value=exp.trainer.async_rollout.max_staleness,
            choices=["0"],
        )


def _check_stepsearch_compat(exp: Experiment, fn: Any, args: dict[str, Any], source: str, i: int) -> None:
    """StepSearch's public code cuts documents out of its own layout (``##> text <##``): under any other
    ``env.doc_format`` every information gain and redundancy penalty would silently be 0."""
    from searchrl.rewards.stepsearch import stepsearch_reward

    if fn is stepsearch_reward and args.get("public_code_compat") and exp.env.doc_format != "stepsearch":
        raise ConfigError(
            f"rewards[{i}].args.public_code_compat: true parses documents in StepSearch's layout, but "
            f"env.doc_format is '{exp.env.doc_format}': every information gain and redundancy penalty "
            "would be 0",
            file=source,
            key="env.doc_format",
            value=exp.env.doc_format,
            choices=["stepsearch"],
            hint=f"set env.doc_format: stepsearch, or rewards[{i}].args.public_code_compat: false",
        )


def check_kwargs(fn: Any, args: dict[str, Any], source: str, key: str, what: str) -> None:
    """``args`` are keyword arguments ``fn`` (a function or class) takes, else a `ConfigError` naming the
    key, with the valid names and a close match (``time_out`` -> ``timeout``). A ``**kwargs`` takes all."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    valid = [n for n, p in params.items() if p.kind is not inspect.Parameter.VAR_POSITIONAL and n != "self"]
    for arg in args:
        if arg not in valid:
            raise ConfigError(
                f"{what} has no argument '{arg}'" + ("" if valid else f" ({what} takes none)"),
                file=source,
                key=f"{key}.{arg}",
                value=arg,
                choices=valid or None,
            )


def _check_named_args(conf: Any, source: str, key: str) -> None:
    """Every ``X_args`` mapping of a config section beside a registered ``X`` (SLATE's ``judge`` and
    ``judge_args``, process data's ``annotator`` and ``annotator_args``) against X's constructor."""
    import dataclasses

    fields = {f.name: f for f in dataclasses.fields(conf)}
    registries = _registries()
    for name in fields:
        base = fields.get(name.removesuffix("_args")) if name.endswith("_args") else None
        if base is None or base.metadata.get("registry") not in registries:
            continue
        reg = registries[base.metadata["registry"]]
        target = getattr(conf, base.name)
        obj = reg.get(target)
        if hasattr(
            obj, "declaration"
        ):  # declared settings (a policy loss's), checked when the section was built
            continue
        check_kwargs(obj, getattr(conf, name), source, f"{key}.{name}", f"{reg.kind} '{target}'")
