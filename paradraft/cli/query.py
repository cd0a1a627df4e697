"""``paradraft query``: one completion from a running paradraft server (gRPC)."""

from __future__ import annotations

import argparse
import json
import sys

from paradraft.runtime.correction import RULES
from paradraft.runtime.serving.client import complete


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("query", help="stream a completion from a paradraft Triton server")
    p.add_argument("--url", default="127.0.0.1:8001", help="gRPC HOST:PORT")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--stream", action="store_true")
    p.add_argument("--json", action="store_true")
    p.add_argument("--rule", choices=RULES, default=None)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--num-draft-tokens", type=int, default=None)
    p.add_argument("--drafter", default=None,
                   help="this request's drafter: the server's, or ngram (prompt lookup)")
    p.add_argument("--stop-word", action="append", default=None, dest="stop_words",
                   help="end the completion once its tokens contain this word's (repeatable)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    def show(text: str) -> None:
        if args.stream and not args.json:
            sys.stdout.write(text)
            sys.stdout.flush()

    optional = dict(temperature=args.temperature, top_p=args.top_p, random_seed=args.seed,
                    num_draft_tokens=args.num_draft_tokens, drafter=args.drafter,
                    correction_rule=args.rule,
                    stop_words=args.stop_words)
    result = complete(args.url, args.prompt, args.max_tokens, stream=args.stream,
                      on_text=show, **optional)
    stats = {"acceptance_rate": result.acceptance_rate,
             "total_accepted_draft_tokens": result.total_accepted_draft_tokens,
             "total_draft_tokens": result.total_draft_tokens,
             "responses": len(result.chunks), "first_response_s": result.first_token_s}
    if args.json:
        print(json.dumps({"text": result.text, "stats": stats}))
    else:
        if not args.stream:
            sys.stdout.write(result.text)
        print(f"\n[{stats}]", file=sys.stderr)
