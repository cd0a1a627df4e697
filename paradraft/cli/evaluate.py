"""``paradraft eval`` and ``paradraft tune``: quality per rule against exact sampling, and a rule's
parameter sweep with its speed/quality frontier."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from paradraft.runtime.correction import RuleParams, check_k, check_range
from paradraft.runtime.model import load_model
from paradraft.runtime.tools.calibrate import CALIBRATED, calibrate
from paradraft.runtime.tools.evaluate import (
    compare,
    frontier,
    heldout_perplexity,
    measure,
    print_table,
    print_weights_table,
    tune_grid,
    weights_quality,
)

from .common import (
    add_eval_args,
    apply_demo_defaults,
    device_and_dtype,
    eval_prompt_pairs,
    load_drafters,
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    for name, helptext in [("eval", "perplexity / diversity per rule vs exact"),
                           ("tune", "sweep a rule's parameters: speed/quality frontier")]:
        e = sub.add_parser(name, help=helptext)
        add_eval_args(e, name)
        e.add_argument("--drafters", default="model", help="the drafter to evaluate with")
        e.add_argument("--k", type=int, default=4)
        e.add_argument("--temperature", type=float, default=1.0)
        e.add_argument("--top-p", type=float, default=1.0)
        e.add_argument("--seeds", type=int, default=2)
        e.add_argument("--batch-size", type=int, default=8)
        e.add_argument("--budget", type=float, default=0.10,
                       help="allowed perplexity increase vs exact (0.10 = +10%%)")
        e.add_argument("--diversity-budget", type=float, default=0.10,
                       help="allowed relative distinct-2 drop vs exact: perplexity alone "
                            "rewards text collapsing into repetition")
        if name == "eval":
            e.add_argument("--engines", default=None, metavar="DIR",
                           help="with --reference-engines: this engine dir's verifier (e.g. "
                                "`build --weights int4`) against the reference's: perplexity, "
                                "greedy agreement, top-1 agreement, KL side by side")
            e.add_argument("--reference-engines", default=None, metavar="DIR",
                           help="the fp32 engine dir --engines is measured against")
        if name == "tune":
            e.add_argument("--rule", default="dynamic",
                           choices=["dynamic", "threshold", "ratio", "typical"])
        e.set_defaults(run=run_tune if name == "tune" else run)


def run(args: argparse.Namespace, tune: bool = False) -> None:
    apply_demo_defaults(args)
    for name in ("prompts", "seeds", "batch_size", "max_new_tokens"):
        check_range(name, getattr(args, name), 1, 1e6)
    if getattr(args, "engines", None) or getattr(args, "reference_engines", None):
        return run_weights(args)
    check_k(args.k)
    check_range("budget", args.budget, 0.0, 100.0)
    check_range("diversity_budget", args.diversity_budget, 0.0, 1.0)
    device, dtype = device_and_dtype(args)
    verifier = load_model(args.verifier, dtype=dtype, device=device)
    drafter = load_drafters(args, verifier)[args.drafters.split(",")[0]]
    pairs = eval_prompt_pairs(args)
    prompts = [p for p, _ in pairs]
    seeds = list(range(args.seeds))
    common = dict(prompts=prompts, max_new_tokens=args.max_new_tokens, seeds=seeds,
                  batch_size=args.batch_size)
    # the seed rules at defaults calibrated to this verifier (what `build` stores in the
    # engine manifest), next to their fixed defaults
    calibration = calibrate(verifier, prompts, args.max_new_tokens, seed=args.seed)
    print(f"calibrated rule defaults ({calibration.positions} positions): "
          f"threshold tau={calibration.tau:.4f}, dynamic tau={calibration.dynamic_tau:.4f}, "
          f"ratio gamma={calibration.gamma:.4f}")
    if tune:
        settings = [dict(rule=args.rule, **kw) for kw in tune_grid(args.rule)]
    else:
        settings = [dict(rule=r, temperature=args.temperature, top_p=args.top_p)
                    for r in ("greedy", "threshold", "ratio", "dynamic", "typical")]
        settings += [dict(rule=r, temperature=args.temperature, top_p=args.top_p,
                          **calibration.params_for(r)) for r in CALIBRATED]
    # the flags set what a tune grid does not sweep (top_p for most rules)
    sampling = dict(temperature=args.temperature, top_p=args.top_p)
    measured = [(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                          for k, v in kw.items()), RuleParams(**{**sampling, **kw}))
                for kw in settings]
    # a setting is compared against exact sampling at its own temperature and top_p with the
    # same seeds: against another temperature's exact the change would be the temperature's.
    # eval has one such pair; tune's grid sweeps them
    references = list(dict.fromkeys((p.temperature, p.top_p) for _, p in measured))
    baselines, rows = [], []
    for temperature, top_p in references:
        base_params = RuleParams("exact", temperature=temperature, top_p=top_p)
        at = f" T={temperature} top_p={top_p}" if tune else ""
        baseline = measure(verifier, None, base_params, 0,
                           label="autoregressive (exact)" + at, **common)
        group = [measure(verifier, drafter, base_params, args.k, label="exact (lossless)" + at,
                         **common)]
        group += [measure(verifier, drafter, params, args.k, label=label, **common)
                  for label, params in measured
                  if (params.temperature, params.top_p) == (temperature, top_p)]
        compare([baseline, *group], group[0], baseline.tokens_per_second, args.budget,
                args.diversity_budget)
        print_table([baseline, *group],
                    f"quality vs exact at temperature={temperature} top_p={top_p} (budget: "
                    f"perplexity +{args.budget:.0%}, distinct-2 -{args.diversity_budget:.0%}; "
                    f"{len(baseline.sequence_nll)} sequences per setting)")
        low, high = baseline.ppl_change_interval
        print(f"sampling noise: the two lossless samplers differ by "
              f"{baseline.ppl_change_vs_exact:+.1%} [{low:+.1%}, {high:+.1%}] in perplexity; a "
              "Δppl inside such an interval is not resolved by this many sequences\n")
        baselines.append(baseline)
        rows += group
    heldout_ppl = heldout_perplexity(verifier, pairs, args.max_new_tokens)
    print(f"held-out text: the verifier's perplexity on the prompts' reference continuations "
          f"(cut to {args.max_new_tokens} tokens) is {heldout_ppl:.2f}: the reference point for "
          "the perplexities of the generated text above")
    result = {"heldout_text_perplexity": heldout_ppl, "rows": [asdict(r) for r in rows],
              "calibration": calibration.to_dict(),
              "budget": args.budget, "diversity_budget": args.diversity_budget}
    if tune:
        result["baselines"] = [asdict(b) for b in baselines]
        front = frontier(rows)
        ok = [r for r in rows if r.within_budget and r.rule == args.rule]
        best = max(ok, key=lambda r: r.speedup) if ok else None
        print_table(front, "speed/quality frontier (each Δ against the exact row at the "
                    "setting's own temperature and top_p)")
        print("best within budget:", best.label if best else "none")
        result["frontier"] = [r.label for r in front]
        result["best_within_budget"] = asdict(best) if best else None
    else:
        result["baseline"] = asdict(baselines[0])
        result["passing"] = [r.label for r in rows if r.within_budget]
        print("within the budget:", ", ".join(result["passing"]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "tune.json" if tune else "eval.json"
    (out / name).write_text(json.dumps(result, indent=2))
    print(f"wrote {out / name}")


def run_weights(args: argparse.Namespace) -> None:
    """`eval --engines DIR --reference-engines DIR`: the quality cost of an engine dir's
    verifier weights (``build --weights``) against the reference dir's."""
    from paradraft.runtime.backends.loader import load_engines
    from paradraft.runtime.backends.manifest import graph_precisions

    if not (args.engines and args.reference_engines):
        raise ValueError("--engines and --reference-engines go together (the engine dir and "
                         "the fp32 one it is measured against)")
    engines = {}
    for flag, path in (("--reference-engines", args.reference_engines),
                       ("--engines", args.engines)):
        verifier, _, tokenizer, manifest = load_engines(path)
        label = f"{path} ({graph_precisions(manifest)['verifier']})"
        if label in engines:
            label += f" {flag}"
        engines[label] = (verifier, tokenizer, manifest)
    (ref_label, (_, ref_tok, ref_manifest)), (_, (_, _, manifest)) = engines.items()
    if ref_manifest["models"]["verifier"]["config"] != manifest["models"]["verifier"]["config"]:
        raise ValueError(f"--engines {args.engines} and --reference-engines "
                         f"{args.reference_engines} hold different verifiers (configs differ)")
    if ref_tok is None:
        raise ValueError(f"--reference-engines {args.reference_engines}: no tokenizer.json to "
                         "tokenize the held-out prompts with")
    args.verifier = ref_tok.parent  # the prompts in the engines' own tokenizer
    pairs = eval_prompt_pairs(args)
    rows = weights_quality({k: v[0] for k, v in engines.items()}, ref_label, pairs,
                           args.max_new_tokens, args.batch_size)
    print_weights_table(rows, ref_label)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"reference": ref_label, "weights": [asdict(r) for r in rows],
              "precisions": {k: graph_precisions(v[2]) for k, v in engines.items()},
              "prompts": len(pairs), "max_new_tokens": args.max_new_tokens}
    (out / "eval.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {out / 'eval.json'}")


def run_tune(args: argparse.Namespace) -> None:
    run(args, tune=True)
