"""The `searchrl` command line. Also runnable as `python -m searchrl` and `accelerate launch -m searchrl`.

Each subcommand has a function that adds its arguments (``_add_NAME``) and one in `searchrl.app.commands` that
runs it."""

from __future__ import annotations

import argparse
import sys
import typing
from pathlib import Path
from typing import Any

from searchrl.app import commands
from searchrl.core.errors import SearchRLError


def _overrides(p: argparse.ArgumentParser) -> None:
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. env.topk=5")


def _experiment(p: argparse.ArgumentParser) -> None:
    """``FILE [KEY=VALUE ...]``: every command that reads one experiment takes it the same way (`main` sorts
    words that come after options, and says what is missing)."""
    p.add_argument("config", nargs="?", metavar="FILE", help="the experiment YAML file")
    _overrides(p)
    p.set_defaults(needs_file=True)


def _is_file_word(word: str) -> bool:
    """A command-line word that names a file (rather than an override or a misspelt one)."""
    return "=" not in word and (word.endswith((".yaml", ".yml")) or Path(word).exists())


def _sort_words(parser: argparse.ArgumentParser, args: argparse.Namespace, extra: list[str]) -> None:
    """One grammar for ``FILE [FILE ...] [KEY=VALUE ...]``, wherever the words stand among the options: a word
    with ``=`` is an override, a file word a file (`validate` takes several), anything else an override too,
    so that the override parser says what it should look like. An unknown ``--option`` is argparse's error."""
    if any(x.startswith("-") for x in extra) or not hasattr(args, "overrides"):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    words = [*extra]
    if hasattr(args, "files"):  # validate: files and overrides in any order
        words = [*args.files, *words]
        args.files = [w for w in words if _is_file_word(w)]
        args.overrides = [*args.overrides, *(w for w in words if not _is_file_word(w))]
        return
    if getattr(args, "needs_file", False) and args.config is not None and "=" in args.config:
        words, args.config = [args.config, *words], None  # `train key=value`: no file was given
    args.overrides = [*args.overrides, *words]


def _positive(kind: type) -> Any:
    """An argparse type: a number of ``kind`` above 0 (a flag out of range exits 2 naming it, as any bad flag)."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
        return value

    return parse


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("searchrl")
    except PackageNotFoundError:  # run from a source tree that is not installed
        from searchrl import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="searchrl", description=__doc__)
    p.add_argument("--debug", action="store_true", help="show the traceback of a user error")
    p.add_argument("--version", action="version", version=f"searchrl {_version()}")
    sub = p.add_subparsers(dest="command", required=True)
    for add in SUBCOMMANDS:
        add(sub)
    return p


def _add_world(sub: Any) -> None:
    w = sub.add_parser("world", help="generate a synthetic multi-hop world (corpus + questions)")
    w.add_argument(
        "--seed", type=int, default=0, help="the world's random seed (the same seed gives the same world)"
    )
    w.add_argument(
        "--out", required=True, type=Path, help="the world's directory (world.json, corpus, questions)"
    )
    w.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="world settings, e.g. persons=200")
    w.set_defaults(fn=commands.cmd_world)


def _executor(parser: Any, help: str) -> None:
    parser.add_argument("--executor", choices=["local", "slurm"], default="local", help=help)


def _add_train(sub: Any) -> None:
    tr = sub.add_parser("train", help="train an experiment (warm start, algorithm, evaluation)")
    _experiment(tr)
    tr.add_argument("--resume", action="store_true", help="continue from the last checkpoint of each stage")
    tr.add_argument(
        "--dry-run",
        action="store_true",
        help="build every stage as training would (data, index, tokenizer, template, batch shapes, the model on "
        "the meta device) and stop before the first step",
    )
    tr.add_argument(
        "--force",
        action="store_true",
        help="start over in a run directory trained with another config (deletes its results)",
    )
    _executor(tr, "local: train here; slurm: submit the run as a SLURM job (through submitit) and return")
    tr.add_argument(
        "--slurm",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a job resource with --executor slurm (nodes, gpus_per_node, time_min, partition, …; docs/distributed.md)",
    )
    tr.set_defaults(fn=commands.cmd_train)


def _add_validate(sub: Any) -> None:
    v = sub.add_parser(
        "validate",
        help="check experiment files without running them: whatever train would refuse at any stage's start",
    )
    v.add_argument("files", nargs="*", metavar="FILE [KEY=VALUE]", help="files, then overrides as for train")
    v.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override applied to each file"
    )
    v.add_argument(
        "-v", "--verbose", action="store_true", help="also say which checks could not run, and why"
    )
    v.add_argument(
        "--allow-missing",
        action="store_true",
        help="list inputs that are not there yet (data files to download, a model an earlier run writes) "
        "instead of failing on them; every other check still runs",
    )
    v.add_argument(
        "--print-config",
        action="store_true",
        help="print each file's resolved config (bases merged, overrides applied, defaults filled in) as YAML",
    )
    v.set_defaults(fn=commands.cmd_validate, overrides=[])


def _add_config_reference(sub: Any) -> None:
    c = sub.add_parser(
        "config-reference", help="print every config key with its type, default, range and help"
    )
    c.set_defaults(fn=commands.cmd_config_reference)


def _add_build_model(sub: Any) -> None:
    b = sub.add_parser(
        "build-model",
        help="build a random-weight Qwen2 model: a tokenizer trained on a world, or Qwen's real vocabulary "
        "at Qwen2.5's shapes (qwen2.5-0.5b, -1.5b, -7b) for memory and speed checks",
    )
    b.add_argument("--world", type=Path, help="a world directory (default: the config's world)")
    b.add_argument(
        "--size",
        default="small",
        help="the model's shape: tiny, small, base, or qwen2.5-0.5b / -1.5b / -7b (random weights)",
    )
    b.add_argument("--out", required=True, type=Path, help="the model directory to write (save_pretrained)")
    b.add_argument(
        "--tokenizer",
        choices=["local", "qwen2.5", "qwen3"],
        default=None,
        help="local: trained on the world (default for the small sizes); qwen2.5 (default for the qwen sizes), "
        "qwen3: Qwen's vocabulary, no world needed (the qwen extra)",
    )
    b.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], default="float32", help="the weights' dtype"
    )
    b.add_argument(
        "--device", default="cpu", help="where the weights are drawn (cuda: a 7B shape in seconds)"
    )
    b.add_argument(
        "--config", default=None, help="an experiment file whose world and model settings to build from"
    )
    _overrides(b)
    b.set_defaults(fn=commands.cmd_build_model)


def _add_tokenizer(sub: Any) -> None:
    k = sub.add_parser(
        "tokenizer",
        help="write a real model's tokenizer offline (Qwen2.5's or Qwen3's from the qwen extra; Mistral's tekken "
        "from the mistral extra; DeepSeek-V3's, and V3.2's format on it, from the deepseek extra)",
    )
    k.add_argument(
        "name",
        choices=["qwen2.5", "qwen3", "mistral-tekken", "deepseek-v3", "deepseek-v3.2"],
        help="the vocabulary (deepseek-v3.2: DeepSeek-V3's with V3.2's prompt format, DSML tool calls)",
    )
    k.add_argument("--out", required=True, type=Path, help="the directory to write the tokenizer to")
    k.set_defaults(fn=commands.cmd_tokenizer)


def _add_index(sub: Any) -> None:
    i = sub.add_parser("index", help="build and save a BM25 or dense index of a corpus")
    i.add_argument("--retriever", default="bm25", help="bm25, tantivy or dense")
    i.add_argument(
        "--corpus",
        required=True,
        help="the corpus file (JSONL of id and contents, or JSON of title and text)",
    )
    i.add_argument("--out", required=True, type=Path, help="the index directory to write")
    i.add_argument("--arg", action="append", default=[], metavar="KEY=VALUE", help="retriever argument")
    i.add_argument(
        "--index-type",
        help="dense: a faiss index-factory spec (Flat, HNSW32, IVF1024,SQ8, IVF1024,PQ64, OPQ64,IVF1024,PQ64)",
    )
    i.set_defaults(fn=commands.cmd_index)


def _add_serve_retriever(sub: Any) -> None:
    s = sub.add_parser("serve-retriever", help="serve a retriever over Search-R1's HTTP protocol")
    s.add_argument(
        "--retriever",
        default="bm25",
        help="the retriever to serve: bm25, tantivy, dense (with --corpus) or a saved --index",
    )
    s.add_argument("--corpus", help="a corpus file to index at start (or --index)")
    s.add_argument("--index", help="a directory written by `searchrl index`")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port)")
    s.add_argument("--arg", action="append", default=[], metavar="KEY=VALUE", help="retriever argument")
    s.add_argument(
        "--max-queries",
        type=_positive(int),
        default=None,
        help="queries per HTTP request, at most (default 1024; not with --mcp, whose calls are one query each)",
    )
    s.add_argument("--max-topk", type=_positive(int), default=100, help="documents per query, at most")
    s.add_argument(
        "--timeout", type=_positive(float), default=60.0, help="seconds a request may take (then HTTP 504)"
    )
    s.add_argument(
        "--mcp",
        choices=["stdio", "http"],
        help="serve it as an MCP server with a `search` tool instead (the mcp extra): over stdin/stdout, or "
        "streamable HTTP at http://HOST:PORT/mcp",
    )
    s.set_defaults(fn=commands.cmd_serve)


def _add_serve_model(sub: Any) -> None:
    m = sub.add_parser("serve-model", help="serve a local model over the OpenAI chat-completions protocol")
    m.add_argument("--model", required=True, help="a local Hugging Face model directory")
    m.add_argument(
        "--name", default=None, help="the model name reported to clients (default: directory name)"
    )
    m.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1: this machine only)")
    m.add_argument("--port", type=int, default=8001, help="port to listen on (0: any free port)")
    m.add_argument("--max-tokens", type=_positive(int), default=1024, help="cap on a request's max_tokens")
    m.add_argument(
        "--timeout", type=_positive(float), default=300.0, help="seconds a request may take (then HTTP 504)"
    )
    m.set_defaults(fn=commands.cmd_serve_model)


def _add_serve_policy(sub: Any) -> None:
    from searchrl.core.config import CallFormat

    m = sub.add_parser(
        "serve-policy",
        help="serve a policy over the OpenAI chat and completions API, recording the exact ids of every call "
        "(agent programs, docs/agents.md)",
    )
    m.add_argument("--model", required=True, help="a local Hugging Face model directory with a chat template")
    m.add_argument("--name", default="policy", help="the model name reported to clients")
    m.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1: this machine only)")
    m.add_argument("--port", type=int, default=8002, help="port to listen on (0: any free port)")
    m.add_argument(
        "--max-tokens", type=_positive(int), default=1024, help="cap on a call's completion tokens"
    )
    m.add_argument(
        "--max-context", type=_positive(int), default=8192, help="prompt and completion, in tokens"
    )
    m.add_argument(
        "--call-format",
        default="auto",
        choices=typing.get_args(CallFormat),
        help="how the model writes tool calls (auto: read from its chat template)",
    )
    m.add_argument(
        "--timeout", type=_positive(float), default=300.0, help="seconds a request may take (then HTTP 504)"
    )
    m.add_argument(
        "--backend",
        default="hf",
        choices=["hf", "vllm"],
        help="the sampler: hf (transformers, in this process) or vllm (the directory's weights, on a GPU)",
    )
    m.add_argument(
        "--gpu-memory-utilization",
        type=_positive(float),
        default=0.9,
        help="vllm: the share of the GPU's memory the engine may take",
    )
    m.set_defaults(fn=commands.cmd_serve_policy)


def _add_collect_process_data(sub: Any) -> None:
    c = sub.add_parser("collect-process-data", help="RAG-Gym step-level preference data from a policy")
    _experiment(c)
    c.add_argument("--model", required=True, help="the policy that proposes the candidate actions")
    c.set_defaults(fn=commands.cmd_collect)


def _add_sweep(sub: Any) -> None:
    w = sub.add_parser(
        "sweep",
        help="run a grid of experiments (resumable; failures recorded, not fatal); `sweep status FILE`, "
        "`sweep collect FILE` read a submitted sweep",
    )
    w.add_argument(
        "sweep",
        nargs="+",
        metavar="[status|collect] FILE",
        help="the sweep YAML file (base experiment, variants, grid), after status or collect to read it",
    )
    _executor(
        w, "local: run here as subprocesses; slurm: submit each run as a job (the file's slurm: resources)"
    )
    w.add_argument("--jobs", type=int, default=1, help="runs at once on this machine")
    w.add_argument("--dry-run", action="store_true", help="list the runs and their commands")
    w.add_argument(
        "--launch-config", default=None, help="start each run with accelerate launch --config_file"
    )
    w.add_argument("--root", default="runs/sweeps", help="the directory the runs are written under")
    w.set_defaults(fn=commands.cmd_sweep)


def _add_report(sub: Any) -> None:
    r = sub.add_parser("report", help="tables, plots and an HTML page from runs or sweeps")
    r.add_argument("dirs", nargs="+", help="run or sweep directories")
    r.add_argument("--out", default="report", help="the report's directory")
    r.set_defaults(fn=commands.cmd_report)


def _add_view(sub: Any) -> None:
    vw = sub.add_parser(
        "view", help="a static HTML viewer of evaluations, a paired comparison and training samples"
    )
    vw.add_argument("target", metavar="RUN_OR_FILE", help="a run directory or a *.predictions.jsonl file")
    vw.add_argument("--compare", metavar="OTHER", default=None, help="a second run or predictions file")
    vw.add_argument(
        "--out", default=None, help="output folder (default: RUN/view, or NAME.view beside a file)"
    )
    vw.add_argument(
        "--serve",
        type=int,
        nargs="?",
        const=0,
        default=None,
        metavar="PORT",
        help="also serve the folder on 127.0.0.1 (PORT, or any free port)",
    )
    vw.set_defaults(fn=commands.cmd_view)


def _add_teacher(sub: Any) -> None:
    t = sub.add_parser("teacher", help="write scripted-teacher trajectories for a split (SFT data)")
    _experiment(t)
    t.add_argument("--split", default="train", help="the split whose questions the teacher answers")
    t.add_argument("--out", required=True, type=Path, help="the JSONL file to write")
    t.set_defaults(fn=commands.cmd_teacher)


def _add_eval(sub: Any) -> None:
    e = sub.add_parser("eval", help="evaluate an agent on a split: EM, F1, searches, invalid actions")
    _experiment(e)
    e.add_argument(
        "--agent", default=None, help="policy (default), teacher, or prm (PRM best-of-N, eval.best_of)"
    )
    e.add_argument("--split", default=None, help="the split to evaluate on (default: eval.split)")
    e.add_argument(
        "--data",
        action="append",
        default=[],
        metavar="NAME=QUESTIONS[,CORPUS]",
        help="evaluate on a question file with its corpus (repeatable: one table row per dataset)",
    )
    e.add_argument(
        "--data-format", default="auto", help="the files' format: auto, flashrag, hotpotqa, musique, 2wiki"
    )
    e.add_argument(
        "--model",
        default=None,
        help="model directory for the policy agent (default: the run's final model, else model.path)",
    )
    e.set_defaults(fn=commands.cmd_eval)


def _add_launch(sub: Any) -> None:
    la = sub.add_parser(
        "launch",
        help="accelerate launch for schedulers: preempted runs exit 75 with one line, errors 2",
        description="searchrl launch [ACCELERATE OPTIONS] train FILE [KEY=VALUE ...] [--resume]: accelerate's "
        "launcher (any `accelerate launch` option), with the exit code and one line that a scheduler and a user "
        "read: 75 when the processes stopped on SIGTERM / SIGUSR1 and saved (with the command that resumes), "
        "2 on a user error, 1 on a crash; the processes get the experiment's trainer.preempt_grace_s + 60 s to "
        "save before SIGKILL. See docs/distributed.md.",
    )
    la.add_argument(
        "rest",
        nargs=argparse.REMAINDER,
        metavar="[ACCELERATE OPTIONS] COMMAND ...",
        help="any `accelerate launch` option, then the command (train FILE ...)",
    )
    la.set_defaults(fn=commands.cmd_launch)


SUBCOMMANDS = (
    _add_world,
    _add_train,
    _add_launch,
    _add_validate,
    _add_config_reference,
    _add_build_model,
    _add_tokenizer,
    _add_index,
    _add_serve_retriever,
    _add_serve_model,
    _add_serve_policy,
    _add_collect_process_data,
    _add_sweep,
    _add_report,
    _add_view,
    _add_teacher,
    _add_eval,
)


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "launch":  # everything after the word goes to the launcher, options included
        words = list(sys.argv[1:] if argv is None else argv)
        args.rest, extra = words[words.index("launch") + 1 :], []
    # files and KEY=VALUE overrides may come after options (argparse stops collecting positionals at one)
    if extra or hasattr(args, "files") or getattr(args, "needs_file", False):
        _sort_words(parser, args, extra)
    try:
        if getattr(args, "needs_file", False) and args.config is None:
            raise SearchRLError(
                f"{args.command} needs an experiment file: searchrl {args.command} FILE [KEY=VALUE ...]"
            )
        args.fn(args)
    except (SearchRLError, OSError) as exc:  # a user's error (config, data, arguments, files, ports)
        if args.debug:
            raise
        code = getattr(exc, "exit_code", 2)  # 75: preempted, resume me (engine/preemption.py)
        from searchrl.app.launch import write_status

        if write_status(code, exc):  # under `searchrl launch`: the launcher prints it, once for all processes
            raise SystemExit(code) from None
        print(f"{'error' if code == 2 else 'stopped'}: {exc}", file=sys.stderr)
        if not isinstance(exc, SearchRLError):
            print("(run with --debug for the traceback)", file=sys.stderr)
        raise SystemExit(code) from None


if __name__ == "__main__":
    main()
