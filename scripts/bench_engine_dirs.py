"""Benchmark: two or more ONNX engine dirs of the same models, side by side in one run.

For an export or build change: build the engines before and after (``paradraft build``),
then decode the same held-out prompts, greedy, with each dir in turn within every repeat:
the plain baseline and each drafter at each K and batch size. Reports tokens/s, speed-up
over the dir's own baseline, speed over the first dir (the reference) for the same variant
as the median of per-repeat ratios, and whether the output equals the reference's. JSON.

    .venv/bin/python scripts/bench_engine_dirs.py --engines engines/before,engines/after \
        --out results/engine_dirs
"""

from __future__ import annotations

import argparse

import torch

from paradraft.runtime.bench import (
    BenchRow,
    add_script_args,
    engine_dir_list,
    median_ratio,
    run_ours,
    script_prompts,
    write_report,
)
from paradraft.runtime.correction import RuleParams
from paradraft.runtime.engines import load_engines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", required=True, help="comma-separated engine dirs (>= 2)")
    add_script_args(ap, prompts=48, repeats=2)
    ap.add_argument("--ks", default="4")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--drafters", default="model,parallel")
    ap.add_argument("--out", default="out/engine_dirs")
    args = ap.parse_args()
    dirs = engine_dir_list(args.engines)
    prompts = script_prompts(args)
    loaded = {d: load_engines(d)[:2] for d in dirs}
    kinds = args.drafters.split(",")
    for d, (_, drafters) in loaded.items():
        if not set(kinds) <= set(drafters):
            raise ValueError(f"drafters must be built into every engine dir ({d} has "
                             f"{sorted(drafters)}); got {args.drafters!r}")
    variants = [(bs, kind, k) for bs in map(int, args.batch_sizes.split(","))
                for kind, k in [("baseline", 0)] + [(kind, int(k)) for k in
                                                    args.ks.split(",") for kind in kinds]]
    rows = {(d, v): BenchRow("ours", v[1], "greedy", v[2], v[0], False, backend="onnx")
            for v in variants for d in dirs}
    outputs: dict[tuple, list[list[int]]] = {}
    for repeat in range(args.repeats):
        for (d, (bs, kind, k)), row in rows.items():
            verifier, drafters = loaded[d]
            tokens: list[list[int]] = []
            run_ours(verifier, drafters.get(kind), RuleParams("greedy"), k, prompts,
                     args.max_new_tokens, bs, 0, row, tokens)
            row.repeat_tokens_per_second.append(row.tokens / row.seconds)
            outputs[(d, bs, kind, k)] = tokens
            print(f"repeat {repeat}: {d} B{bs} {kind} K={k} "
                  f"{row.repeat_tokens_per_second[-1]:7.1f} tok/s", flush=True)
    report = {"engines": dirs, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
              "repeats": args.repeats, "torch_threads": torch.get_num_threads(), "rows": []}
    print(f"{'engines':28s} {'B':>2} {'drafter':8s} {'K':>2} {'tok/s':>7} {'vs base':>7} "
          f"{'vs ' + dirs[0][-20:]:>24} {'accept':>6} same")
    for (d, v), row in rows.items():
        bs, kind, k = v
        entry = {"engines": d, "batch_size": bs, "drafter": kind, "k": k,
                 "tokens_per_second": row.tokens_per_second,
                 "repeat_tokens_per_second": row.repeat_tokens_per_second,
                 "speedup_vs_baseline": median_ratio(row, rows[(d, (bs, "baseline", 0))]),
                 "speed_vs_reference": median_ratio(row, rows[(dirs[0], v)]),
                 "acceptance_rate": row.acceptance_rate,
                 "same_output_as_reference": outputs[(d, *v)] == outputs[(dirs[0], *v)]}
        report["rows"].append(entry)
        acc = "" if row.acceptance_rate is None else f"{row.acceptance_rate:.3f}"
        print(f"{d[-28:]:28s} {bs:>2} {kind:8s} {k:>2} {entry['tokens_per_second']:7.1f} "
              f"{entry['speedup_vs_baseline']:7.2f} {entry['speed_vs_reference']:24.2f} "
              f"{acc:>6} {entry['same_output_as_reference']}")
    write_report(args.out, "engine_dirs.json", report)


if __name__ == "__main__":
    main()
