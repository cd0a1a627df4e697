"""``paradraft loadtest``: bounded-concurrency streaming load test of a server (gRPC, Triton's
HTTP or the OpenAI API), beside an in-process reference run of the same prompts; with
``--protocol chat``, request variants on our server and, with ``--peer llama-server``,
llama.cpp's own server on the same GGUF files, driven by the same client in the same run."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from paradraft.runtime.backends.manifest import read_manifest
from paradraft.runtime.checkpoints import DEMO_DIR, heldout_texts
from paradraft.runtime.serving.protocol import ServeConfig
from paradraft.runtime.tools import peer_server
from paradraft.runtime.tools.loadtest import (
    FOLLOWUPS,
    PROTOCOLS,
    WORKLOADS,
    ChatLoad,
    ReferenceProcess,
    parse_variants,
    print_results,
    read_chat_lines,
    read_chat_requests,
    run_chat_load,
    run_loadtest,
    write_outputs,
)

from .common import int_list
from .serve import add_openai_args, add_server_args, own_openai_server, own_server, serve_config


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("loadtest", help="bounded-concurrency streaming load test")
    add_server_args(p)
    add_openai_args(p)
    p.add_argument("--url", default=None,
                   help="a running server (default: start one): HOST:PORT of its gRPC port "
                   "(grpc), of Triton's HTTP port (http), or of the OpenAI API (openai)")
    p.add_argument("--protocol", choices=PROTOCOLS, default=None,
                   help="grpc (default): the ensemble model over gRPC streaming; http: "
                   "Triton's generate_stream; openai: /v1/completions, streamed; chat "
                   "(default with --peer, --variants or --workload multiturn): "
                   "/v1/chat/completions, streamed, greedy, a new connection per request")
    p.add_argument("--no-reference", dest="reference", action="store_false",
                   help="skip the in-process reference run (after each served level, the "
                   "same prompts through the same scheduler and decoder in a plain Python "
                   "process: no Triton, no network); --protocol chat never runs it")
    p.add_argument("--concurrency", default="1,4,8,16")
    p.add_argument("--requests", type=int, default=32, help="requests per level")
    p.add_argument("--repeats", type=int, default=3,
                   help="run the levels in turn this many times; ratios are medians")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--timeout", type=float, default=300,
                   help="a request that takes longer (grpc), or waits longer for its next "
                   "response (http, openai, chat), counts as lost")
    p.add_argument("--heldout", default=str(DEMO_DIR), help="dir holding heldout.jsonl")
    p.add_argument("--out", default="results/loadtest",
                   help="where loadtest.json and loadtest.png go")
    c = p.add_argument_group("chat (--protocol chat)")
    c.add_argument("--prompt-file", default=None, metavar="FILE.jsonl|humaneval:N",
                   help="chat requests, one {\"messages\": [...]} a line, optionally with "
                   "OpenAI's \"response_format\" (sent with it; each answer is checked "
                   "against its schema), or the first N HumanEval problems (default "
                   "humaneval:8)")
    c.add_argument("--variants", default=None, metavar="V[,V...]",
                   help="request variants on our server, in the request body: default (its "
                   "settings), plain (num_draft_tokens 0), ngram (drafter ngram), ngram:K "
                   "(and num_draft_tokens K). Default: default")
    c.add_argument("--workload", choices=WORKLOADS, default="single",
                   help="single: --requests requests per level; multiturn: --conversations "
                   "chats per level, each turn resending the history and the last answer")
    c.add_argument("--conversations", type=int, default=8,
                   help="multiturn: conversations per level")
    c.add_argument("--followups", type=Path, default=FOLLOWUPS, metavar="FILE.jsonl",
                   help="multiturn: the user turns after the first, one a line")
    g = p.add_argument_group("the peer (--peer llama-server)")
    g.add_argument("--peer", choices=(peer_server.PEER,), default=None,
                   help="after our server, llama.cpp's llama-server (built from the pinned "
                   "llama-cpp-python sdist into the cache, once) on the same GGUF files")
    g.add_argument("--peer-variants", default=None, metavar="V[,V...]",
                   help="plain, ngram-simple, ngram-mod, draft-simple, each optionally :K "
                   "(its draft length; bare: llama.cpp's default). Default: all four "
                   "(draft-simple only with a draft GGUF)")
    g.add_argument("--peer-verifier", type=Path, default=None, metavar="FILE.gguf",
                   help="default: the verifier GGUF of a llamacpp --engines dir")
    g.add_argument("--peer-draft", type=Path, default=None, metavar="FILE.gguf",
                   help="draft-simple's draft model; default: the llamacpp --engines dir's")
    g.add_argument("--peer-threads", type=int, default=2, help="llama-server -t")
    g.add_argument("--peer-slots", type=int, default=None,
                   help="llama-server -np (default: our server's --max-slots)")
    g.add_argument("--peer-ctx-per-slot", type=int, default=None, metavar="N",
                   help="positions per slot; -c is slots × N (default: our --max-seq-len)")
    g.add_argument("--peer-binary", type=Path, default=None,
                   help="a llama-server to run instead of the one built into the cache")
    p.set_defaults(run=run)


def chat_mode(args: argparse.Namespace) -> bool:
    """The options that only the chat protocol carries select it; another is refused."""
    wanted = args.peer or args.variants or args.workload != "single"
    if wanted and args.protocol not in (None, "chat"):
        raise ValueError(f"protocol: --peer, --variants and --workload multiturn drive the "
                         f"chat API (--protocol chat); got --protocol {args.protocol}")
    return bool(wanted) or args.protocol == "chat"


def check_range(args: argparse.Namespace, name: str, low: int, high: int) -> None:
    value = getattr(args, name)
    if value is not None and not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}]; got {value}")


def engine_ggufs(engines: str | None) -> tuple[Path | None, Path | None]:
    """(verifier, draft) GGUF files of a llamacpp engine dir (its manifest's weights)."""
    if not engines:
        return None, None
    manifest = read_manifest(engines, verify=False)
    if manifest.get("backend") != "llamacpp":
        return None, None
    models = manifest["models"]
    return tuple(Path(engines) / models[name]["weights"] if name in models else None
                 for name in ("verifier", "draft"))


@dataclass
class PeerPlan:
    binary: Path
    verifier: Path
    draft: Path | None
    variants: list[peer_server.PeerVariant]
    threads: int
    slots: int
    ctx_per_slot: int


def plan_peer(args: argparse.Namespace, config: ServeConfig) -> PeerPlan:
    """The peer's files, variants and sizes; its binary (built here the first time) checked
    for every variant's options before anything is measured."""
    verifier, draft = engine_ggufs(args.engines)
    verifier, draft = args.peer_verifier or verifier, args.peer_draft or draft
    if verifier is None:
        raise ValueError("peer_verifier: llama-server needs a GGUF file: pass --peer-verifier "
                         "(or --engines, a dir built with --backend llamacpp)")
    for name, path in (("peer_verifier", verifier), ("peer_draft", draft)):
        if path is not None and not path.is_file():
            raise FileNotFoundError(f"{name}: no file {path}")
    text = args.peer_variants or ",".join(m for m in peer_server.MODES
                                          if m != "draft-simple" or draft is not None)
    variants = peer_server.parse_peer_variants(text)
    binary = peer_server.server_binary(args.peer_binary)
    peer_server.check_variants(variants, draft, peer_server.server_help(binary))
    return PeerPlan(binary, verifier, draft, variants, args.peer_threads,
                    args.peer_slots or config.max_slots,
                    args.peer_ctx_per_slot or config.max_seq_len)


def run_peer(plan: PeerPlan, load: ChatLoad, out: Path) -> list:
    """Each peer variant in a llama-server of its own, one after another."""
    results = []
    for v in plan.variants:
        port = peer_server.free_port()
        argv = peer_server.server_argv(plan.binary, plan.verifier, v, plan.threads, plan.slots,
                                       plan.ctx_per_slot, port, plan.draft)
        print(f"paradraft: starting {' '.join(argv)}", flush=True)
        server = peer_server.start_server(
            argv, out / f"llama-server-{v.name.replace(':', '-')}.log", "127.0.0.1", port)
        try:
            results += run_chat_load(server.url, peer_server.PEER, {v.name: {}}, load)
        finally:
            server.stop()
    return results


PEER_OPTIONS = ("peer_variants", "peer_verifier", "peer_draft", "peer_slots",
                "peer_ctx_per_slot", "peer_binary")


def run_chat(args: argparse.Namespace, levels: list[int]) -> None:
    """Our server (its variants), then each llama-server variant: the same chat client and
    load; one loadtest.json and loadtest.png over all of them."""
    if args.peer is None:
        for name in PEER_OPTIONS:
            if getattr(args, name) is not None:
                raise ValueError(f"{name}: set only with --peer llama-server")
    check_range(args, "conversations", 1, 1024)
    check_range(args, "peer_threads", 1, 256)
    check_range(args, "peer_slots", 1, 256)
    check_range(args, "peer_ctx_per_slot", 16, 1 << 20)
    multiturn = args.workload == "multiturn"
    lines = read_chat_lines(args.prompt_file or "humaneval:8")
    formats = [response_format for _, response_format in lines]
    if multiturn and any(f is not None for f in formats):
        raise ValueError("prompt_file: response_format is sent with single requests; "
                         "--workload multiturn sends none")
    load = ChatLoad([messages for messages, _ in lines], levels,
                    args.max_tokens, args.requests, args.conversations,
                    read_chat_requests(args.followups) if multiturn else [], args.workload,
                    args.repeats, args.timeout, args.served_model_name,
                    formats if any(f is not None for f in formats) else [])
    config = serve_config(args)
    # a server at --url has its own --k: the server checks K there
    variants = parse_variants(args.variants or "default", None if args.url else config.k)
    plan = plan_peer(args, config) if args.peer else None  # may build llama-server: first
    out = Path(args.out)
    results = []
    # a server this run starts is started afresh for each variant, as each llama-server
    # variant is: each starts with an empty prefix cache (one server at --url serves all)
    for group in [variants] if args.url else [{n: v} for n, v in variants.items()]:
        server = api = None
        try:  # straight after each start: a signal from here on still stops the servers
            if args.url is None:
                server = own_server(args, config)
                api = own_openai_server(args, config, server)
            url = args.url or f"{api.config.host}:{api.config.port}"
            results += run_chat_load(url, "ours", group, load)
        finally:
            if api is not None:
                api.stop()
            if server is not None:
                server.stop()
    if plan is not None:  # after ours stopped: the two never share the cores
        results += run_peer(plan, load, out)
    meta = {"url": url, "protocol": "chat", "workload": args.workload,
            "prompt_file": args.prompt_file or "humaneval:8", "max_tokens": args.max_tokens,
            "requests_per_level": args.requests, "conversations": args.conversations,
            "repeats": args.repeats, "engines": args.engines, "max_slots": config.max_slots,
            "k": config.k, "variants": list(variants)}
    if plan is not None:
        meta["peer"] = {"binary": str(plan.binary), "verifier": str(plan.verifier),
                        "draft": str(plan.draft) if plan.draft else None,
                        "variants": [v.name for v in plan.variants], "threads": plan.threads,
                        "slots": plan.slots, "ctx_per_slot": plan.ctx_per_slot}
    data = peer_server.write_comparison(results, out, meta)
    peer_server.print_comparison(results, data["summary"])
    print(f"wrote {out / 'loadtest.json'} and loadtest.png")


def run(args: argparse.Namespace) -> None:
    levels = int_list(args.concurrency, "concurrency", 1, 256)
    for name in ("requests", "repeats"):
        if getattr(args, name) < 1:
            raise ValueError(f"{name} must be >= 1; got {getattr(args, name)}")
    if args.timeout <= 0:
        raise ValueError(f"timeout must be > 0 seconds; got {args.timeout}")
    if chat_mode(args):
        return run_chat(args, levels)
    if args.prompt_file is not None:
        raise ValueError("prompt_file: the chat protocol's requests (--protocol chat); the "
                         "other protocols send held-out text (--heldout)")
    args.protocol = args.protocol or "grpc"
    prompts = [t[:200] for t in heldout_texts(args.heldout)]
    # the settings of the server this run starts (a server at --url has its own; the
    # reference then assumes they match the options given here)
    config = serve_config(args)
    server = api = reference = None
    try:  # straight after each start: a signal from here on still stops the servers
        if args.url is None:
            server = own_server(args, config)
            if args.protocol == "openai":
                api = own_openai_server(args, config, server)
        url = args.url or {"grpc": server and server.grpc_url,
                           "http": server and f"{server.host}:{server.http_port}",
                           "openai": api and f"{api.config.host}:{api.config.port}"
                           }[args.protocol]
        if args.reference:
            print("paradraft: loading the in-process reference ...", flush=True)
            reference = ReferenceProcess(config, args.engines or args.verifier, prompts,
                                         args.requests, args.max_tokens)
        results = run_loadtest(url, prompts, levels, args.requests, args.max_tokens,
                               args.repeats, args.protocol, reference, args.timeout,
                               model=args.served_model_name)
    finally:
        if reference is not None:
            reference.stop()
        if api is not None:
            api.stop()
        if server is not None:
            server.stop()
    data = write_outputs(results, Path(args.out), {
        "url": url, "protocol": args.protocol, "requests_per_level": args.requests,
        "repeats": args.repeats, "max_tokens": args.max_tokens, "engines": args.engines,
        "max_slots": config.max_slots, "k": config.k, "drafter": args.drafter,
        "speculative_disable_by_batch_size": args.speculative_disable_by_batch_size,
        "draft_len_schedule": args.draft_len_schedule, "stream_interval": args.stream_interval})
    print_results(results)
    print(json.dumps(data["summary"], indent=2))
    print(f"wrote {Path(args.out) / 'loadtest.json'} and loadtest.png")
