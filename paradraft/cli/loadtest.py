"""``paradraft loadtest``: bounded-concurrency streaming load test of a server (gRPC, Triton's
HTTP or the OpenAI API), beside an in-process reference run of the same prompts."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from paradraft.runtime.checkpoints import DEMO_DIR, heldout_texts
from paradraft.runtime.tools.loadtest import (
    PROTOCOLS,
    ReferenceProcess,
    print_results,
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
    p.add_argument("--protocol", choices=PROTOCOLS, default="grpc",
                   help="grpc: the ensemble model over gRPC streaming; http: Triton's "
                   "generate_stream; openai: /v1/completions, streamed")
    p.add_argument("--no-reference", dest="reference", action="store_false",
                   help="skip the in-process reference run (after each served level, the "
                   "same prompts through the same scheduler and decoder in a plain Python "
                   "process: no Triton, no network)")
    p.add_argument("--concurrency", default="1,4,8,16")
    p.add_argument("--requests", type=int, default=32, help="requests per level")
    p.add_argument("--repeats", type=int, default=3,
                   help="run the levels in turn this many times; ratios are medians")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--timeout", type=float, default=300,
                   help="a request that takes longer (grpc), or waits longer for its next "
                   "response (http, openai), counts as lost")
    p.add_argument("--heldout", default=str(DEMO_DIR), help="dir holding heldout.jsonl")
    p.add_argument("--out", default="results/loadtest",
                   help="where loadtest.json and loadtest.png go")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    levels = int_list(args.concurrency, "concurrency", 1, 256)
    for name in ("requests", "repeats"):
        if getattr(args, name) < 1:
            raise ValueError(f"{name} must be >= 1; got {getattr(args, name)}")
    if args.timeout <= 0:
        raise ValueError(f"timeout must be > 0 seconds; got {args.timeout}")
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
