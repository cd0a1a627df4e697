"""``paradraft loadtest``: bounded-concurrency gRPC streaming load test of a server."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from paradraft.runtime.checkpoints import DEMO_DIR, heldout_texts
from paradraft.runtime.tools.loadtest import print_results, run_loadtest, write_outputs

from .common import int_list
from .serve import add_server_args, own_server, serve_config


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("loadtest", help="bounded-concurrency gRPC streaming load test")
    add_server_args(p)
    p.add_argument("--url", default=None, help="a running server (default: start one)")
    p.add_argument("--concurrency", default="1,4,8,16")
    p.add_argument("--requests", type=int, default=32, help="requests per level")
    p.add_argument("--repeats", type=int, default=3,
                    help="run the levels in turn this many times; ratios are medians")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--heldout", default=str(DEMO_DIR), help="dir holding heldout.jsonl")
    p.add_argument("--out", default="results/loadtest",
                   help="where loadtest.json and loadtest.png go")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    levels = int_list(args.concurrency, "concurrency", 1, 256)
    if args.requests < 1:
        raise ValueError(f"requests must be >= 1; got {args.requests}")
    if args.repeats < 1:
        raise ValueError(f"repeats must be >= 1; got {args.repeats}")
    prompts = [t[:200] for t in heldout_texts(args.heldout)]
    # the settings of the server this run starts; a server at --url has its own
    config = None if args.url else serve_config(args)
    server = None if args.url else own_server(args, config)
    try:  # straight after the start: a signal from here on still stops the server
        url = args.url or server.grpc_url
        results = run_loadtest(url, prompts, levels, args.requests, args.max_tokens,
                               args.repeats)
    finally:
        if server is not None:
            server.stop()
    data = write_outputs(results, Path(args.out), {
        "url": url, "requests_per_level": args.requests, "repeats": args.repeats,
        "max_tokens": args.max_tokens, "engines": args.engines,
        "max_slots": config and config.max_slots, "k": config and config.k,
        "drafter": args.drafter,
        "speculative_disable_by_batch_size": args.speculative_disable_by_batch_size,
        "draft_len_schedule": args.draft_len_schedule, "stream_interval": args.stream_interval})
    print_results(results)
    print(json.dumps(data["summary"], indent=2))
    print(f"wrote {Path(args.out) / 'loadtest.json'} and loadtest.png")
