"""``paradraft demo``: the whole pipeline: start Triton, stream one completion over gRPC, print
the stats, stop the server."""

from __future__ import annotations

import argparse
import sys

from paradraft.runtime.serving.client import complete

from .serve import add_server_args, own_server, serve_config


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="the whole pipeline: start Triton, stream one completion "
                                    "over gRPC, print the stats, stop the server")
    add_server_args(p)
    p.add_argument("--prompt", default="def fibonacci(n):")
    p.add_argument("--max-tokens", type=int, default=64)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    server = own_server(args, serve_config(args))
    try:
        print(f"paradraft: Triton ready on {server.grpc_url}; streaming one completion over "
              f"gRPC\n", file=sys.stderr, flush=True)
        sys.stdout.write(args.prompt)

        def show(text: str) -> None:
            sys.stdout.write(text)
            sys.stdout.flush()

        r = complete(server.grpc_url, args.prompt, args.max_tokens, stream=True, on_text=show)
        tokens = sum(r.chunk_tokens)
        print(f"\n\n[{tokens} tokens in {len(r.chunks)} streamed responses; acceptance rate "
              f"{r.acceptance_rate:.2f} ({r.total_accepted_draft_tokens}/"
              f"{r.total_draft_tokens} draft tokens); first response after "
              f"{r.first_token_s * 1e3:.0f} ms; {tokens / r.chunk_times[-1]:.1f} tok/s]",
              flush=True)
    finally:
        server.stop()
        print("paradraft: tritonserver stopped", file=sys.stderr)
