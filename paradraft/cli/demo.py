"""``paradraft demo``: the whole pipeline. Start Triton with the engines and the OpenAI API in
front of it, stream one chat answer over tritonclient gRPC (the server's drafter), ask the same
question through the official ``openai`` client with another drafter named in the request
(default: the n-gram lookup), print acceptance and tok/s for both, stop everything."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from paradraft.runtime.checkpoints import format_chat
from paradraft.runtime.serving.client import complete
from paradraft.runtime.serving.protocol import ServeConfig

from .serve import (
    add_openai_args,
    add_server_args,
    chat_dir,
    own_openai_server,
    own_server,
    serve_config,
)

QUESTION = "What is the capital of France, and what is it famous for? Answer in three sentences."


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="the whole pipeline: start Triton and the OpenAI API, "
                                    "stream one chat answer over gRPC and one through the "
                                    "openai client, print the stats, stop the servers")
    add_server_args(p)
    add_openai_args(p)
    p.add_argument("--question", default=QUESTION, help="the user message")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--openai-drafter", default="ngram", metavar="NAME",
                   help="the drafter the openai client's request names (per request; default "
                        "ngram, the prompt lookup, beside the server's own drafter over gRPC)")
    p.add_argument("--num-draft-tokens", type=int, default=None, metavar="K",
                   help="K of the gRPC request (its num_draft_tokens, in [0, the server's "
                        "K]; default: the server's K). The shipped SmolLM2 draft is fastest at "
                        "1 (docs/results.md)")
    p.add_argument("--no-openai", action="store_true",
                   help="gRPC only (the openai client is a dev dependency)")
    p.set_defaults(run=run)


def show(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def k_label(config: ServeConfig, num_draft_tokens: int | None) -> str:
    """The K a request drafts with: its own, else the server's (the goodput policy's pick,
    at most K, under the default schedule)."""
    if num_draft_tokens is not None:
        return f"K={num_draft_tokens}"
    return f"K=auto<={config.k}" if config.draft_len_schedule == "auto" else f"K={config.k}"


def ask_grpc(url: str, prompt: str, max_tokens: int, num_draft_tokens: int | None) -> None:
    k = {} if num_draft_tokens is None else {"num_draft_tokens": num_draft_tokens}
    r = complete(url, prompt, max_tokens, stream=True, on_text=show, **k)  # server's drafter
    tokens = sum(r.chunk_tokens)
    print(f"\n[gRPC: {tokens} tokens in {len(r.chunks)} streamed responses, "
          f"{tokens / r.chunk_times[-1]:.1f} tok/s; acceptance rate {r.acceptance_rate:.2f} "
          f"({r.total_accepted_draft_tokens}/{r.total_draft_tokens} draft tokens); first "
          f"response after {r.first_token_s * 1e3:.0f} ms]\n", flush=True)


def ask_openai(base_url: str, model: str, question: str, max_tokens: int,
               drafter: str) -> None:
    try:
        import openai
    except ImportError:
        raise RuntimeError("the demo's second half needs the official openai client: pip "
                           "install openai (or pass --no-openai)") from None
    client = openai.OpenAI(base_url=base_url, api_key="unused")
    t0 = time.perf_counter()
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": question}], max_tokens=max_tokens,
        temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"drafter": drafter})
    usage, stats = None, {}
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            show(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage, stats = chunk.usage, (chunk.model_extra or {}).get("paradraft") or {}
    seconds = time.perf_counter() - t0
    tokens = usage.completion_tokens if usage else 0
    print(f"\n[OpenAI API (openai {openai.__version__}): {tokens} tokens, "
          f"{tokens / seconds:.1f} tok/s; acceptance rate "
          f"{stats.get('acceptance_rate', float('nan')):.2f}]", flush=True)


def run(args: argparse.Namespace) -> None:
    config = serve_config(args)
    if args.num_draft_tokens is not None and not 0 <= args.num_draft_tokens <= config.k:
        raise ValueError(f"--num-draft-tokens must be in [0, {config.k}] (the server's K; 0: no "
                         f"speculation); got {args.num_draft_tokens}")
    server = own_server(args, config)
    api = None
    try:
        if not args.no_openai:
            api = own_openai_server(args, config, server)
        prompt = format_chat(chat_dir(args, server.workdir),
                             [{"role": "user", "content": args.question}])
        print(f"paradraft: Triton ready on {server.grpc_url} (drafter {config.drafter!r}, "
              f"K={config.k}, rule {config.rule}); the chat template of "
              f"{Path(args.engines or args.verifier).name} applied\n\nuser: {args.question}\n",
              file=sys.stderr, flush=True)
        # the first calls into each engine graph are slow (ONNX Runtime's first runs): one
        # short request per drafter first, so that the two answers' tok/s compare the drafters
        for drafter in dict.fromkeys([config.drafter, args.openai_drafter]):
            complete(server.grpc_url, prompt, 8, stream=False, drafter=drafter)
        sys.stdout.write(f"assistant (tritonclient gRPC, streaming; drafter {config.drafter}, "
                         f"{k_label(config, args.num_draft_tokens)}):\n")
        ask_grpc(server.grpc_url, prompt, args.max_tokens, args.num_draft_tokens)
        if api is not None:
            sys.stdout.write("assistant (openai client, /v1/chat/completions; drafter "
                             f"{args.openai_drafter}, named in the request, "
                             f"{k_label(config, None)}):\n")
            ask_openai(f"http://127.0.0.1:{api.config.port}/v1", args.served_model_name,
                       args.question, args.max_tokens, args.openai_drafter)
    finally:
        if api is not None:
            api.stop()
        server.stop()
        print("paradraft: servers stopped", file=sys.stderr)
