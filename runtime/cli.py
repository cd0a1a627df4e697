"""The ``paradraft`` command."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from .correction import RULES, RuleParams
from .model import Transformer, load_model
from .speculative import DRAFTERS, Drafter, SpeculativeDecoder

DEMO_DIR = Path(__file__).resolve().parent.parent / "models" / "demo"


def load_tokenizer(model_dir: str | Path):
    from tokenizers import Tokenizer

    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"missing {path}: pass --prompt-ids or add a tokenizer.json")
    return Tokenizer.from_file(str(path))


def rule_params(args: argparse.Namespace) -> RuleParams:
    return RuleParams(
        rule=args.rule, temperature=args.temperature, top_p=args.top_p, tau=args.tau,
        gamma=args.gamma, alpha=args.alpha, top_p_membership=args.top_p_membership,
        epsilon=args.epsilon, delta=args.delta,
    )


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--verifier", default=str(DEMO_DIR / "verifier"), help="HF-format dir")
    p.add_argument("--draft", default=None,
                   help="HF-format dir (default: the demo draft for --drafter model, "
                        "the demo parallel_draft for --drafter parallel)")
    p.add_argument("--drafter", choices=DRAFTERS, default="model")
    p.add_argument("--self-draft-layers", type=int, default=None,
                   help="verifier layers the self-draft uses (default: config or 1)")
    p.add_argument("--rule", choices=RULES, default="greedy")
    p.add_argument("--k", type=int, default=4, help="draft tokens per round (K)")
    p.add_argument("--adaptive-k", action="store_true", help="per-row K in [1, --k]")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--tau", type=float, default=0.3, help="threshold τ / dynamic τ_base")
    p.add_argument("--gamma", type=float, default=1.0, help="ratio rule γ")
    p.add_argument("--alpha", type=float, default=0.1, help="dynamic rule α")
    p.add_argument("--top-p-membership", action="store_true", help="dynamic rule top-p test")
    p.add_argument("--epsilon", type=float, default=0.09, help="typical rule ε")
    p.add_argument("--delta", type=float, default=0.3, help="typical rule δ")
    p.add_argument("--audit-epsilon", type=float, default=None,
                   help="enable the attention causal audit with this ε")
    p.add_argument("--no-speculation", action="store_true",
                   help="plain autoregressive decoding of the verifier (the baseline)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--seed", type=int, default=0)


def build_decoder(args: argparse.Namespace, max_batch_size: int, max_seq_len: int
                  ) -> tuple[SpeculativeDecoder, Transformer]:
    dtype = getattr(torch, args.dtype)
    verifier = load_model(args.verifier, dtype=dtype)
    drafter = None
    if not args.no_speculation:
        if args.drafter == "self":
            drafter = Drafter("self", verifier, num_layers=args.self_draft_layers)
        else:
            default = DEMO_DIR / ("parallel_draft" if args.drafter == "parallel" else "draft")
            drafter = Drafter(args.drafter, load_model(args.draft or default, dtype=dtype))
    decoder = SpeculativeDecoder(
        verifier, drafter, rule_params(args), k=args.k, adaptive_k=args.adaptive_k,
        audit_epsilon=args.audit_epsilon, max_batch_size=max_batch_size,
        max_seq_len=max_seq_len,
    )
    return decoder, verifier


def cmd_generate(args: argparse.Namespace) -> None:
    if args.prompt_ids:
        prompt = [int(t) for t in args.prompt_ids.split(",")]
        tokenizer = None
    else:
        tokenizer = load_tokenizer(args.verifier)
        prompt = tokenizer.encode(args.prompt).ids
    decoder, verifier = build_decoder(args, 1, len(prompt) + args.max_new_tokens)
    eos = None if args.ignore_eos else verifier.config.eos_token_id
    out: list[int] = []
    row_stats: list = []
    stream = decoder.stream([prompt], args.max_new_tokens, args.seed, eos, row_stats)
    printed = ""
    for step in stream:
        out.extend(step[0])
        if not args.json and tokenizer is not None:
            text = tokenizer.decode(out)
            # print only what is stable (an incomplete multi-byte char decodes to U+FFFD)
            stable = text.rstrip("\ufffd")
            sys.stdout.write(stable[len(printed):])
            sys.stdout.flush()
            printed = stable
    text = tokenizer.decode(out) if tokenizer is not None else None
    stats = row_stats[0]
    if args.json:
        print(json.dumps({"text": text, "token_ids": out, "stats": stats.to_dict()}))
        return
    if tokenizer is None:
        print(out)
    else:
        sys.stdout.write(text[len(printed):] + "\n")
    s = stats
    print(f"\n[{s.generated_tokens} tokens, {s.tokens_per_second:.1f} tok/s, "
          f"acceptance {s.acceptance_rate:.2f}, mean acceptance length "
          f"{s.mean_acceptance_length:.2f}, verify steps {s.verify_steps}]", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="paradraft", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="speculative generation for one prompt")
    add_model_args(g)
    g.add_argument("--prompt", default="def ")
    g.add_argument("--prompt-ids", default=None, help="comma-separated token ids (no tokenizer)")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    try:
        if args.command == "generate":
            cmd_generate(args)
    except (ValueError, FileNotFoundError) as e:
        parser.exit(2, f"paradraft: error: {e}\n")


if __name__ == "__main__":
    main()
