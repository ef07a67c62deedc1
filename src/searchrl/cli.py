"""The `searchrl` command line. Also runnable as `python -m searchrl` and `accelerate launch -m searchrl`."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from searchrl.errors import DataError, SearchRLError


def _overrides(p: argparse.ArgumentParser) -> None:
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. env.topk=5")


def cmd_world(args: argparse.Namespace) -> None:
    from searchrl.config import from_dict
    from searchrl.envs.synthetic.world import World, WorldConfig
    from searchrl.loader import parse_assignment

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
    from searchrl.experiment import check_arguments, load_experiment

    failed = 0
    for f in args.files:
        try:
            exp = load_experiment(f, args.set)
            check_arguments(exp, f)
            print(f"ok      {f}")
        except SearchRLError as exc:
            failed += 1
            print(f"invalid {exc}", file=sys.stderr)
    if failed:
        raise SystemExit(1)


def cmd_build_model(args: argparse.Namespace) -> None:
    from searchrl.envs.tags import ALL_TAG_STRINGS
    from searchrl.experiment import load_experiment
    from searchrl.models.tiny import SIZES, build_local_model
    from searchrl.runtime import Runtime, tokenizer_texts

    if args.size not in SIZES:
        raise SearchRLError(f"unknown --size {args.size!r}; valid: {', '.join(SIZES)}")
    exp = load_experiment(
        args.config, [*args.overrides, f"data.world_dir={args.world}"] if args.world else args.overrides
    )
    rt = Runtime(exp)
    if rt.world is None:
        raise SearchRLError("build-model trains its tokenizer on a synthetic world: pass --world DIR")
    out = build_local_model(
        args.size, tokenizer_texts(rt.world, rt.env()), args.out, seed=exp.seed, tags=ALL_TAG_STRINGS
    )
    print(f"built a {args.size} Qwen2 model and tokenizer in {out}")


def cmd_tokenizer(args: argparse.Namespace) -> None:
    from searchrl.models.qwen import qwen_tokenizer

    t = time.perf_counter()
    tok = qwen_tokenizer(args.out, args.name)
    print(
        f"{args.name} tokenizer ({len(tok)} tokens, chat template included) written to {args.out} in "
        f"{time.perf_counter() - t:.1f}s; load it with AutoTokenizer.from_pretrained('{args.out}')"
    )


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
    _check_port(args.port)
    retriever = build_retriever(
        args.retriever, corpus=args.corpus, index=args.index, **_retriever_kwargs(args.retriever, args.arg)
    )
    server = make_server(
        retriever,
        args.host,
        args.port,
        max_queries=args.max_queries,
        max_topk=args.max_topk,
        timeout=args.timeout,
    )
    _serve(server, f"serving {args.retriever} on {server.url}/retrieve (Ctrl-C to stop)")


def cmd_serve_model(args: argparse.Namespace) -> None:
    from searchrl.chat_server import make_chat_server
    from searchrl.rollout.chat import LocalChat

    _check_port(args.port)
    _check_model_dir(args.model)
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


def _check_port(port: int) -> None:
    if not 0 <= port <= 65535:
        raise SearchRLError(f"--port {port}: a port is a number from 0 to 65535 (0 picks a free one)")


def _check_model_dir(path: str | Path) -> None:
    """``--model``: a local model directory, or a hub id (``org/name``, passed on to transformers)."""
    p = Path(path)
    hub_id = (
        not p.exists() and not p.is_absolute() and str(path).count("/") == 1 and not str(path).startswith(".")
    )
    if hub_id:
        return
    if not p.is_dir() or not ((p / "config.json").exists() or (p / "adapter_config.json").exists()):
        why = "does not exist" if not p.exists() else "is not a model directory (no config.json)"
        raise SearchRLError(f"--model {p}: {why}; pass a Hugging Face model directory or hub id (org/name)")


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
    from searchrl.experiment import check_arguments, load_experiment
    from searchrl.process_data import run

    exp = load_experiment(args.config, args.overrides)
    check_arguments(exp, args.config, training=False)
    summary = run(exp, args.model)
    print(json.dumps(summary, indent=1))
    print(f"process data written to {exp.process_data.out}")


def cmd_sweep(args: argparse.Namespace) -> None:
    from searchrl.sweep import load_sweep, run_sweep

    sweep = load_sweep(args.sweep, args.root)
    status = run_sweep(sweep, args.jobs, args.launch_config, args.dry_run)
    failed = [n for n, s in status.items() if s.get("status") == "failed"]
    if failed:
        raise SearchRLError(f"{len(failed)} run(s) failed: {', '.join(failed)} (logs in {sweep.dir})")


def cmd_report(args: argparse.Namespace) -> None:
    from searchrl.report import report

    page = report(args.dirs, args.out)
    md = (page.parent / "report.md").read_text()
    print(md.split("![")[0].rstrip())  # the tables: means, intervals, paired tests
    print(f"\nreport: {page} (and report.md, PNGs beside it)")


def cmd_view(args: argparse.Namespace) -> None:
    from searchrl.viewer.build import serve, view

    index = view(args.target, args.compare, args.out)
    print(f"viewer: {index} (open it in a browser; it needs no server)")
    if args.serve is not None:
        serve(index, args.serve)


def cmd_teacher(args: argparse.Namespace) -> None:
    from searchrl.data.example import write_jsonl
    from searchrl.envs.synthetic.teacher import teacher_records
    from searchrl.experiment import load_experiment
    from searchrl.runtime import Runtime

    exp = load_experiment(args.config, args.overrides)
    rt = Runtime(exp)
    if rt.world is None:
        raise SearchRLError("the teacher needs the synthetic world (data.source: synthetic)")
    records = teacher_records(rt.env(), rt.world, rt.examples(args.split), exp.teacher)
    write_jsonl(args.out, records)
    print(f"{len(records)} teacher trajectories ({args.split}) written to {args.out}")


def cmd_eval(args: argparse.Namespace) -> None:
    from searchrl.eval import markdown_table

    rows: dict[str, dict[str, Any]] = {}
    for spec in args.data or [""]:  # one row per dataset (--data NAME=QUESTIONS[,CORPUS]), as in the papers
        name, _, path = spec.partition("=")
        if spec and not path:
            raise SearchRLError(f"--data takes NAME=QUESTIONS[,CORPUS], got {spec!r}")
        path, _, corpus = path.partition(",")
        data = [f"data.source={args.data_format}", f"data.test={path}", "eval.split=test"] if spec else []
        data += [f"data.corpus={corpus}"] if corpus else []
        rows.update(_evaluate(args, [*data, *args.overrides], name))
    print(markdown_table(rows))


def _evaluate(args: argparse.Namespace, overrides: list[str], dataset: str) -> dict[str, dict[str, Any]]:
    from searchrl.config import save_resolved
    from searchrl.eval import episode_metrics, write_results
    from searchrl.experiment import load_experiment
    from searchrl.runtime import Runtime

    if args.agent:
        overrides.append(f"eval.agent={args.agent}")
    if args.split:
        overrides.append(f"eval.split={args.split}")
    exp = load_experiment(args.config, overrides)
    rt = Runtime(exp)
    examples = rt.examples(exp.eval.split)[: exp.eval.limit]
    label = f"{dataset or exp.eval.split}"
    t = time.perf_counter()
    if args.model:
        _check_model_dir(args.model)
    if exp.eval.agent == "prm":  # the start policy guided by the trained PRM, one row per N
        return _evaluate_prm(args, exp, rt, label)
    from searchrl.eval import EVAL_AGENTS

    states = EVAL_AGENTS[exp.eval.agent](rt, examples, args.model, label)
    from searchrl.serving import check_failure_rates, failure_summary, service_metrics

    for line in failure_summary():
        print(line)
    check_failure_rates(service_metrics())  # a failing summarizer endpoint makes the numbers meaningless
    metrics = episode_metrics(states)
    metrics["seconds"] = time.perf_counter() - t
    design = "" if exp.env.agent == "react" else f"-{exp.env.agent}"
    name = f"eval-{exp.eval.agent}{design}-{label}"
    js, _ = write_results(exp.out, name, metrics, states)
    save_resolved(exp, exp.out, f"{name}.config.yaml")  # the run's own config.yaml is never rewritten
    print(json.dumps({k: metrics[k] for k in ("em_by_hops", "finish_reasons")}))
    print(f"results written to {js}")
    return {name: metrics}


def _evaluate_prm(args: argparse.Namespace, exp: Any, rt: Any, label: str) -> dict[str, dict[str, Any]]:
    """RAG-Gym Algorithm 1: the start policy (``--model``, the warm-start checkpoint, else the run's SFT
    model) guided by the PRM (``eval.prm``, else the run's final model), best-of-N for each N."""
    from searchrl.config import save_resolved
    from searchrl.train import evaluate_best_of_n

    ws = exp.warm_start
    policy = args.model or (ws.checkpoint if ws and ws.checkpoint else None) or exp.out / "sft" / "final"
    prm = exp.eval.prm or exp.out / "final"
    rows = {}
    for n in exp.eval.best_of:
        print(f"policy {policy} guided by the PRM in {prm}, best of {n}, on {label}")
        rows[f"prm-best-of-{n}-{label}"] = evaluate_best_of_n(rt, Path(policy), Path(prm), n)
        save_resolved(exp, exp.out / "eval", f"prm-best-of-{n}-{exp.eval.split}.config.yaml")
    return rows


def cmd_train(args: argparse.Namespace) -> None:
    from searchrl.experiment import check_arguments, load_experiment
    from searchrl.train import train

    exp = load_experiment(args.config, args.overrides)
    check_arguments(exp, args.config)
    train(exp, resume=args.resume, force=args.force)


def _kv(items: list[str]) -> dict:
    from searchrl.loader import parse_assignment

    return dict(parse_assignment(item, "--arg", "key=value") for item in items or [])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="searchrl", description=__doc__)
    p.add_argument("--debug", action="store_true", help="show the traceback of a user error")
    sub = p.add_subparsers(dest="command", required=True)

    w = sub.add_parser("world", help="generate a synthetic multi-hop world (corpus + questions)")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--out", required=True, type=Path)
    w.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="world settings, e.g. persons=200")
    w.set_defaults(fn=cmd_world)

    tr = sub.add_parser("train", help="train an experiment (warm start, algorithm, evaluation)")
    tr.add_argument("config")
    tr.add_argument("--resume", action="store_true", help="continue from the last checkpoint of each stage")
    tr.add_argument(
        "--force",
        action="store_true",
        help="start over in a run directory trained with another config (deletes its results)",
    )
    _overrides(tr)
    tr.set_defaults(fn=cmd_train)

    v = sub.add_parser("validate", help="check experiment files without running them")
    v.add_argument("files", nargs="+")
    v.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override applied to each file"
    )
    v.set_defaults(fn=cmd_validate)

    b = sub.add_parser("build-model", help="train a tokenizer on a world and build a local Qwen2 model")
    b.add_argument("--world", type=Path, help="a world directory (default: the config's world)")
    b.add_argument("--size", default="small")
    b.add_argument("--out", required=True, type=Path)
    b.add_argument("--config", default=None)
    _overrides(b)
    b.set_defaults(fn=cmd_build_model)

    k = sub.add_parser(
        "tokenizer", help="write a real model's tokenizer offline (Qwen2.5's, from the qwen extra)"
    )
    k.add_argument("name", choices=["qwen2.5"])
    k.add_argument("--out", required=True, type=Path)
    k.set_defaults(fn=cmd_tokenizer)

    i = sub.add_parser("index", help="build and save a BM25 or dense index of a corpus")
    i.add_argument("--retriever", default="bm25")
    i.add_argument("--corpus", required=True)
    i.add_argument("--out", required=True, type=Path)
    i.add_argument("--arg", action="append", default=[], metavar="KEY=VALUE", help="retriever argument")
    i.add_argument(
        "--index-type",
        help="dense: a faiss index-factory spec (Flat, HNSW32, IVF1024,SQ8, IVF1024,PQ64, OPQ64,IVF1024,PQ64)",
    )
    i.set_defaults(fn=cmd_index)

    s = sub.add_parser("serve-retriever", help="serve a retriever over Search-R1's HTTP protocol")
    s.add_argument("--retriever", default="bm25")
    s.add_argument("--corpus")
    s.add_argument("--index")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--arg", action="append", default=[], metavar="KEY=VALUE")
    s.add_argument("--max-queries", type=_positive(int), default=1024, help="queries per request, at most")
    s.add_argument("--max-topk", type=_positive(int), default=100, help="documents per query, at most")
    s.add_argument(
        "--timeout", type=_positive(float), default=60.0, help="seconds a request may take (then HTTP 504)"
    )
    s.set_defaults(fn=cmd_serve)

    m = sub.add_parser("serve-model", help="serve a local model over the OpenAI chat-completions protocol")
    m.add_argument("--model", required=True, help="a local Hugging Face model directory")
    m.add_argument(
        "--name", default=None, help="the model name reported to clients (default: directory name)"
    )
    m.add_argument("--host", default="127.0.0.1")
    m.add_argument("--port", type=int, default=8001)
    m.add_argument("--max-tokens", type=_positive(int), default=1024, help="cap on a request's max_tokens")
    m.add_argument(
        "--timeout", type=_positive(float), default=300.0, help="seconds a request may take (then HTTP 504)"
    )
    m.set_defaults(fn=cmd_serve_model)

    c = sub.add_parser("collect-process-data", help="RAG-Gym step-level preference data from a policy")
    c.add_argument("config")
    c.add_argument("--model", required=True, help="the policy that proposes the candidate actions")
    _overrides(c)
    c.set_defaults(fn=cmd_collect)

    w = sub.add_parser("sweep", help="run a grid of experiments (resumable; failures recorded, not fatal)")
    w.add_argument("sweep")
    w.add_argument("--jobs", type=int, default=1, help="runs at once on this machine")
    w.add_argument("--dry-run", action="store_true", help="list the runs and their commands")
    w.add_argument(
        "--launch-config", default=None, help="start each run with accelerate launch --config_file"
    )
    w.add_argument("--root", default="runs/sweeps")
    w.set_defaults(fn=cmd_sweep)

    r = sub.add_parser("report", help="tables, plots and an HTML page from runs or sweeps")
    r.add_argument("dirs", nargs="+")
    r.add_argument("--out", default="report")
    r.set_defaults(fn=cmd_report)

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
    vw.set_defaults(fn=cmd_view)

    t = sub.add_parser("teacher", help="write scripted-teacher trajectories for a split (SFT data)")
    t.add_argument("config")
    t.add_argument("--split", default="train")
    t.add_argument("--out", required=True, type=Path)
    _overrides(t)
    t.set_defaults(fn=cmd_teacher)

    e = sub.add_parser("eval", help="evaluate an agent on a split: EM, F1, searches, invalid actions")
    e.add_argument("config")
    e.add_argument(
        "--agent", default=None, help="policy (default), teacher, or prm (PRM best-of-N, eval.best_of)"
    )
    e.add_argument("--split", default=None)
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
    _overrides(e)
    e.set_defaults(fn=cmd_eval)
    return p


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # KEY=VALUE overrides may come after options (argparse stops collecting positionals at an option)
    if extra:
        if not hasattr(args, "overrides") or any(x.startswith("-") or "=" not in x for x in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    try:
        args.fn(args)
    except (SearchRLError, OSError) as exc:  # a user's error (config, data, arguments, files, ports)
        if args.debug:
            raise
        print(f"error: {exc}", file=sys.stderr)
        if not isinstance(exc, SearchRLError):
            print("(run with --debug for the traceback)", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
