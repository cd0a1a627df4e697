"""``paradraft distill``: train a small draft for a verifier on the verifier's own outputs."""

from __future__ import annotations

import argparse
import json

from paradraft.runtime.tools.distill import KINDS, DistillConfig, distill

from .common import checkpoint


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("distill", help="train a draft (model or PARD parallel) for a verifier "
                                       "on its own greedy and sampled continuations")
    p.add_argument("--verifier", type=checkpoint, required=True, help="HF-format dir")
    p.add_argument("--out", required=True, help="the draft dir to write (HF format)")
    p.add_argument("--kind", choices=KINDS, default="model",
                   help="model: an autoregressive draft; parallel: a PARD draft")
    p.add_argument("--prompts", default=None,
                   help='JSONL of {"messages": [...]} or {"prompt": "..."} lines (default: the '
                        "verifier writes its own prompts from seed instructions)")
    p.add_argument("--minutes", type=float, default=60.0,
                   help="wall-clock budget for data generation and training together")
    p.add_argument("--data-share", type=float, default=0.5,
                   help="share of --minutes spent generating data")
    p.add_argument("--max-sequences", type=int, default=None,
                   help="stop data generation after this many sequences")
    p.add_argument("--steps", type=int, default=None,
                   help="training steps (default: train until the budget is spent)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out")
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate-size", type=int, default=1024)
    p.add_argument("--gen-batch", type=int, default=32, help="rows per generation batch")
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--batch-rows", type=int, default=8, help="training rows per step")
    p.add_argument("--train-len", type=int, default=256, help="training window in tokens")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--teacher-topk", type=int, default=32,
                   help="train towards the verifier's top-k next-token distribution at each "
                        "generated position (0: towards its tokens only)")
    p.add_argument("--mask-token-id", type=int, default=None,
                   help="--kind parallel: the mask token (default: the tokenizer's mask_token)")
    p.add_argument("--eval-prompts", type=int, default=16,
                   help="held-out prompts for the final acceptance check (0: skip)")
    p.add_argument("--save-dtype", choices=("float32", "bfloat16", "float16"),
                   default="bfloat16")
    p.add_argument("--train-dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                   help="training matmuls (auto: bfloat16 where the CPU has bf16 instructions)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    metrics = distill(DistillConfig(
        verifier=args.verifier, out=args.out, kind=args.kind, prompts=args.prompts,
        minutes=args.minutes, data_share=args.data_share, max_sequences=args.max_sequences,
        steps=args.steps, resume=args.resume, hidden_size=args.hidden_size,
        num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.kv_heads,
        intermediate_size=args.intermediate_size, gen_batch=args.gen_batch,
        max_new_tokens=args.max_new_tokens, batch_rows=args.batch_rows,
        train_len=args.train_len, lr=args.lr, teacher_topk=args.teacher_topk,
        mask_token_id=args.mask_token_id,
        eval_prompts=args.eval_prompts, save_dtype=args.save_dtype,
        train_dtype=args.train_dtype, seed=args.seed))
    print(json.dumps({k: v for k, v in metrics.items() if k != "training"}
                     | {"training": {k: v for k, v in metrics["training"].items()
                                     if k != "history"}}, indent=2))
