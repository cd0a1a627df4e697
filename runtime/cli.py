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


def load_drafters(args: argparse.Namespace, verifier: Transformer, dtype: torch.dtype
                  ) -> dict[str, Drafter]:
    names = args.drafters.split(",")
    for n in names:
        if n not in DRAFTERS:
            raise ValueError(f"drafters must be a comma list of {', '.join(DRAFTERS)}; got {n!r}")
    drafters = {}
    for n in names:
        if n == "self":
            drafters[n] = Drafter("self", verifier, num_layers=args.self_draft_layers)
        else:
            path = args.draft if n == "model" else args.parallel_draft
            drafters[n] = Drafter(n, load_model(path, dtype=dtype))
    return drafters


def int_list(text: str, name: str, low: int, high: int) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(f"{name} must be a comma list of integers; got {text!r}") from None
    if not values or any(not low <= v <= high for v in values):
        raise ValueError(f"{name} values must be in [{low}, {high}]; got {text!r}")
    return values


def eval_prompts(args: argparse.Namespace) -> list[list[int]]:
    from .evaluate import heldout_prompts, heldout_texts

    tokenizer = load_tokenizer(args.verifier)
    texts = heldout_texts(args.heldout)
    pairs = heldout_prompts(tokenizer, texts, args.prompts, args.prompt_tokens, args.seed)
    return [p for p, _ in pairs]


def add_eval_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--verifier", default=str(DEMO_DIR / "verifier"))
    p.add_argument("--draft", default=str(DEMO_DIR / "draft"))
    p.add_argument("--parallel-draft", default=str(DEMO_DIR / "parallel_draft"))
    p.add_argument("--self-draft-layers", type=int, default=None)
    p.add_argument("--heldout", default=str(DEMO_DIR), help="dir holding heldout.jsonl")
    p.add_argument("--prompts", type=int, default=8, help="held-out prompts per variant")
    p.add_argument("--prompt-tokens", type=int, default=48)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="out")


def cmd_bench(args: argparse.Namespace) -> None:
    from .bench import print_rows, run_bench, summary, write_outputs

    verifier = load_model(args.verifier)
    drafters = load_drafters(args, verifier, torch.float32)
    ks = int_list(args.ks, "ks", 1, 16)
    batch_sizes = int_list(args.batch_sizes, "batch_sizes", 1, 256)
    prompts = eval_prompts(args)
    hf_dirs = None if args.no_hf else (args.verifier, args.draft)
    rows = run_bench(verifier, drafters, prompts, args.max_new_tokens, batch_sizes, ks,
                     hf_dirs, seed=args.seed, temperature=args.temperature)
    meta = {"prompts": len(prompts), "prompt_tokens": args.prompt_tokens,
            "max_new_tokens": args.max_new_tokens, "torch_threads": torch.get_num_threads(),
            "verifier": args.verifier, "draft": args.draft,
            "parallel_draft": args.parallel_draft, "temperature": args.temperature}
    write_outputs(rows, Path(args.out), meta)
    print_rows(rows)
    print(json.dumps(summary(rows), indent=2))
    print(f"wrote {Path(args.out) / 'bench.json'} and bench.png")


def cmd_eval(args: argparse.Namespace, tune: bool = False) -> None:
    from dataclasses import asdict

    from .evaluate import compare, frontier, measure, print_table, tune_grid

    verifier = load_model(args.verifier)
    drafter = load_drafters(args, verifier, torch.float32)[args.drafters.split(",")[0]]
    prompts = eval_prompts(args)
    seeds = list(range(args.seeds))
    common = dict(prompts=prompts, max_new_tokens=args.max_new_tokens, seeds=seeds,
                  batch_size=args.batch_size)
    base_params = RuleParams("exact", temperature=args.temperature, top_p=args.top_p)
    baseline = measure(verifier, None, base_params, 0, label="autoregressive (exact)",
                       **common)
    rows = [measure(verifier, drafter, base_params, args.k, label="exact (lossless)", **common)]
    if tune:
        settings = [dict(rule=args.rule, **kw) for kw in tune_grid(args.rule)]
    else:
        settings = [dict(rule=r, temperature=args.temperature, top_p=args.top_p)
                    for r in ("greedy", "threshold", "ratio", "dynamic", "typical")]
    for kw in settings:
        params = RuleParams(**kw)
        label = " ".join(f"{k}={v}" for k, v in kw.items())
        rows.append(measure(verifier, drafter, params, args.k, label=label, **common))
    compare([baseline, *rows], baseline.tokens_per_second, args.budget)
    print_table([baseline, *rows], f"quality vs exact (budget +{args.budget:.0%} perplexity)")
    result = {"baseline": asdict(baseline), "rows": [asdict(r) for r in rows],
              "budget": args.budget}
    if tune:
        front = frontier(rows)
        ok = [r for r in rows if r.within_budget and r.rule == args.rule]
        best = max(ok, key=lambda r: r.speedup) if ok else None
        print_table(front, "speed/quality frontier")
        print("best within budget:", best.label if best else "none")
        result["frontier"] = [r.label for r in front]
        result["best_within_budget"] = asdict(best) if best else None
    else:
        result["passing"] = [r.label for r in rows if r.within_budget]
        print("within the budget:", ", ".join(result["passing"]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "tune.json" if tune else "eval.json"
    (out / name).write_text(json.dumps(result, indent=2))
    print(f"wrote {out / name}")


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
    b = sub.add_parser("bench", help="speed-up / acceptance side by side with transformers")
    add_eval_args(b)
    b.add_argument("--drafters", default="model,parallel,self")
    b.add_argument("--ks", default="1,2,3,4,5,6,7,8")
    b.add_argument("--batch-sizes", default="1,4,16")
    b.add_argument("--temperature", type=float, default=1.0, help="for the sampling rows")
    b.add_argument("--no-hf", action="store_true", help="skip the transformers peers")
    for name, helptext in [("eval", "perplexity / diversity per rule vs exact"),
                           ("tune", "sweep a rule's parameters: speed/quality frontier")]:
        e = sub.add_parser(name, help=helptext)
        add_eval_args(e)
        e.add_argument("--drafters", default="model", help="the drafter to evaluate with")
        e.add_argument("--k", type=int, default=4)
        e.add_argument("--temperature", type=float, default=1.0)
        e.add_argument("--top-p", type=float, default=1.0)
        e.add_argument("--seeds", type=int, default=2)
        e.add_argument("--batch-size", type=int, default=8)
        e.add_argument("--budget", type=float, default=0.10,
                       help="allowed perplexity increase vs exact (0.10 = +10%%)")
        if name == "tune":
            e.add_argument("--rule", default="dynamic",
                           choices=["dynamic", "threshold", "ratio", "typical"])
    args = parser.parse_args(argv)
    try:
        if args.command == "generate":
            cmd_generate(args)
        elif args.command == "bench":
            cmd_bench(args)
        elif args.command in ("eval", "tune"):
            cmd_eval(args, tune=args.command == "tune")
    except (ValueError, FileNotFoundError) as e:
        parser.exit(2, f"paradraft: error: {e}\n")


if __name__ == "__main__":
    main()
