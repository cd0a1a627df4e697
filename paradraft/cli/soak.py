"""``paradraft soak``: serve the engines (Triton and the OpenAI API, as `serve --openai-port`
runs them) under mixed, misbehaving load for ``--duration`` seconds, then check that nothing
was lost or hung, memory stayed flat, every slot is free and the counters add up
(runtime/tools/soak.py). Writes soak.json and soak.png; exits non-zero on a failure."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from paradraft.runtime.tools.soak import SoakConfig, run_soak, write_report

from .serve import add_openai_args, add_server_args, own_openai_server, own_server, serve_config


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("soak", help="a long mixed load with cancellations and disconnects; "
                                    "checks that nothing is lost and memory stays flat")
    add_server_args(p)
    add_openai_args(p)
    p.add_argument("--duration", type=float, default=1800.0, help="seconds of load")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=48, help="the most a request asks for")
    p.add_argument("--sample-seconds", type=float, default=5.0,
                   help="how often memory and tokens/s are sampled")
    p.add_argument("--out", default="results/soak")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    for name, low in (("duration", 1.0), ("concurrency", 1), ("max_tokens", 1),
                      ("sample_seconds", 0.1)):
        if not getattr(args, name) >= low:
            raise ValueError(f"{name} must be >= {low:g}; got {getattr(args, name)}")
    config = serve_config(args)
    server = own_server(args, config)
    api = None
    try:
        api = own_openai_server(args, config, server)
        processes = {"tritonserver": server.process.pid, "openai_api": api.process.pid,
                     **{f"stub{i}": pid for i, pid in enumerate(server.stubs)}}
        drafters = (None, "ngram")  # the server's own, and the lookup every engine dir has
        report = run_soak(SoakConfig(
            api.config.host, api.config.port,
            f"http://{server.host}:{server.metrics_port}/metrics", processes,
            duration_s=args.duration, concurrency=args.concurrency, max_tokens=args.max_tokens,
            drafters=drafters, max_draft_tokens=config.k, sample_s=args.sample_seconds))
    finally:
        if api is not None:
            api.stop()
        server.stop()
    out = Path(args.out)
    write_report(report, out)
    failures = report.check()
    print(f"paradraft: soak of {args.duration:g} s: requests {report.requests}; errors "
          f"{report.errors}; RSS growth {report.rss_growth}; counters {report.counters}; "
          f"settled in {report.settled_s}; {out / 'soak.json'}", flush=True)
    if failures:
        raise RuntimeError("soak failed: " + "; ".join(failures))
    print("paradraft: soak passed", file=sys.stderr, flush=True)
