"""Benchmark: fused k-step draft graphs against k single-step calls, side by side in one run.

Loads one ONNX engine dir (``paradraft build``; the demo engines by default) and decodes the
same held-out prompts, greedy, with the autoregressive drafters (draft model, self-draft):
the plain baseline, then each drafter with its fused graphs (one ONNX Runtime call per
block) and with single steps (the same engine without them, ``OrtModel.single_step``), the
variants in turn within each repeat. Reports tokens/s, speed-up over the baseline,
acceptance, fused over single-step as the median of per-repeat ratios, and whether both
drafted the same (same output and acceptance: the graphs compute the same argmaxes).
Writes JSON.

    .venv/bin/python scripts/bench_fused_drafts.py --engines engines/demo \
        --out results/fused_drafts
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from paradraft.runtime.bench import (
    BenchRow,
    add_script_args,
    median_ratio,
    run_ours,
    script_prompts,
)
from paradraft.runtime.correction import RuleParams
from paradraft.runtime.engines import load_engines
from paradraft.runtime.speculative import Drafter

MODES = ("single-step", "fused")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default="engines/demo")
    add_script_args(ap, prompts=48, repeats=2)
    ap.add_argument("--ks", default="4")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--drafters", default="model,self")
    ap.add_argument("--out", default="out/fused_drafts")
    args = ap.parse_args()
    prompts = script_prompts(args)
    verifier, drafters, _, manifest = load_engines(args.engines)
    kinds = args.drafters.split(",")
    for kind in kinds:
        if kind not in drafters or kind == "parallel":
            raise ValueError(f"drafters must be autoregressive drafters built into "
                             f"{args.engines} (model, self); got {kind!r}")
    ks = [int(k) for k in args.ks.split(",")]
    built = {g["k"] for m in manifest["models"].values() for g in m["graphs"].values()
             if "k" in g}
    if not set(ks) <= built:
        raise ValueError(f"ks must have fused graphs in {args.engines} (k in {sorted(built)}); "
                         f"got {args.ks!r}")
    variants = {(kind, "fused"): drafters[kind] for kind in kinds}
    variants.update({(kind, "single-step"): Drafter(kind, drafters[kind].model.single_step(),
                                                    num_layers=drafters[kind].num_layers)
                     for kind in kinds})
    rows: list[tuple[str, BenchRow]] = []  # (mode or "-", row)
    for bs in [int(b) for b in args.batch_sizes.split(",")]:
        rows.append(("-", BenchRow("ours", "baseline", "greedy", 0, bs, False, backend="onnx")))
        rows += [(mode, BenchRow("ours", kind, "greedy", k, bs, False, backend="onnx"))
                 for k in ks for kind in kinds for mode in MODES]
    outputs: dict[tuple, list[list[int]]] = {}
    for repeat in range(args.repeats):
        for mode, row in rows:
            drafter = variants.get((row.variant, mode))
            tokens: list[list[int]] = []
            run_ours(verifier, drafter, RuleParams("greedy"), row.k, prompts,
                     args.max_new_tokens, row.batch_size, 0, row, tokens)
            row.repeat_tokens_per_second.append(row.tokens / row.seconds)
            outputs[(mode, row.variant, row.k, row.batch_size)] = tokens
            print(f"repeat {repeat}: B{row.batch_size} {row.variant:5s} K={row.k} {mode:11s} "
                  f"{row.repeat_tokens_per_second[-1]:7.1f} tok/s", flush=True)
    report = {"engines": args.engines, "draft_precision": manifest.get("draft_precision"),
              "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
              "repeats": args.repeats, "torch_threads": torch.get_num_threads(), "rows": []}
    for mode, row in rows:
        base = next(r for _, r in rows if r.variant == "baseline"
                    and r.batch_size == row.batch_size)
        entry = {"batch_size": row.batch_size, "drafter": row.variant, "k": row.k,
                 "mode": mode, "tokens_per_second": row.tokens_per_second,
                 "repeat_tokens_per_second": row.repeat_tokens_per_second,
                 "speedup_vs_baseline": median_ratio(row, base),
                 "acceptance_rate": row.acceptance_rate,
                 "mean_acceptance_length": row.mean_acceptance_length,
                 "time_share": row.time_share}
        if mode == "fused":
            single = next(r for m, r in rows if m == "single-step" and r.variant == row.variant
                          and r.k == row.k and r.batch_size == row.batch_size)
            entry["fused_over_single_step"] = median_ratio(row, single)
            entry["same_drafts"] = (
                outputs[("fused", row.variant, row.k, row.batch_size)]
                == outputs[("single-step", row.variant, row.k, row.batch_size)]
                and row.acceptance_rate == single.acceptance_rate)
        report["rows"].append(entry)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fused_drafts.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"{'B':>2} {'drafter':8s} {'K':>2} {'mode':11s} {'tok/s':>7} {'vs base':>7} "
          f"{'accept':>6} {'fused/single':>12}")
    for e in report["rows"]:
        acc = "" if e["acceptance_rate"] is None else f"{e['acceptance_rate']:.3f}"
        ratio = (f"{e['fused_over_single_step']:.2f}"
                 f"{'' if e['same_drafts'] else ' (drafts differ)'}"
                 if "fused_over_single_step" in e else "")
        print(f"{e['batch_size']:>2} {e['drafter']:8s} {e['k']:>2} {e['mode']:11s} "
              f"{e['tokens_per_second']:7.1f} {e['speedup_vs_baseline']:7.2f} {acc:>6} "
              f"{ratio:>12}")
    print(f"wrote {out / 'fused_drafts.json'}")


if __name__ == "__main__":
    main()
