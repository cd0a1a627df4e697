"""Benchmark: int8 against float32 drafting graphs (ONNX Runtime), side by side in one run.

Builds the demo pair twice (``paradraft build --draft-precision int8`` / ``float32``; the
verifier graphs are float32 in both) and decodes the same held-out prompts, greedy, with
every drafter at each batch size: the plain baseline, then each drafter with the float32
and the int8 drafting graph, the variants in turn within each repeat. Reports tokens/s,
speed-up over the baseline, acceptance, and int8 over float32 as the median of per-repeat
ratios, and whether the greedy output was the same with both (the verifier decides, so it
should be). Writes JSON.

    .venv/bin/python scripts/bench_draft_precision.py --out results/draft_precision
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from paradraft.build.onnx import build_engines
from paradraft.runtime.bench import (
    BenchRow,
    add_script_args,
    median_ratio,
    run_ours,
    script_prompts,
)
from paradraft.runtime.cli import DEMO_DIR
from paradraft.runtime.correction import RuleParams
from paradraft.runtime.engines import load_engines

PRECISIONS = ("float32", "int8")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_script_args(ap, prompts=48, repeats=2)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--drafters", default="model,parallel,self")
    ap.add_argument("--out", default="out/draft_precision")
    args = ap.parse_args()
    prompts = script_prompts(args)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    kinds = args.drafters.split(",")
    rows: list[tuple[str, BenchRow]] = []  # (precision or "-", row)
    for bs in batch_sizes:
        rows.append(("-", BenchRow("ours", "baseline", "greedy", 0, bs, False, backend="onnx")))
        rows += [(p, BenchRow("ours", kind, "greedy", args.k, bs, False, backend="onnx"))
                 for kind in kinds for p in PRECISIONS]
    outputs: dict[tuple, list[list[int]]] = {}
    with tempfile.TemporaryDirectory(prefix="paradraft-precision-") as tmp:
        engines = {}
        for p in PRECISIONS:
            build_engines(DEMO_DIR / "verifier", Path(tmp) / p, DEMO_DIR / "draft",
                          DEMO_DIR / "parallel_draft", draft_precision=p)
            engines[p] = load_engines(Path(tmp) / p)[:2]
        for repeat in range(args.repeats):
            for precision, row in rows:
                verifier, drafters = engines["float32" if precision == "-" else precision]
                tokens: list[list[int]] = []
                run_ours(verifier, drafters.get(row.variant), RuleParams("greedy"), row.k,
                         prompts, args.max_new_tokens, row.batch_size, 0, row, tokens)
                row.repeat_tokens_per_second.append(row.tokens / row.seconds)
                outputs[(precision, row.variant, row.batch_size)] = tokens
                print(f"repeat {repeat}: B{row.batch_size} {row.variant:9s} {precision:8s} "
                      f"{row.repeat_tokens_per_second[-1]:7.1f} tok/s", flush=True)
    report = {"prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "k": args.k,
              "repeats": args.repeats, "torch_threads": torch.get_num_threads(), "rows": []}
    for bs in batch_sizes:
        base = next(r for p, r in rows if r.variant == "baseline" and r.batch_size == bs)
        for precision, row in rows:
            if row.batch_size != bs:
                continue
            entry = {"batch_size": bs, "drafter": row.variant, "draft_precision": precision,
                     "tokens_per_second": row.tokens_per_second,
                     "repeat_tokens_per_second": row.repeat_tokens_per_second,
                     "speedup_vs_baseline": median_ratio(row, base),
                     "acceptance_rate": row.acceptance_rate,
                     "mean_acceptance_length": row.mean_acceptance_length,
                     "time_share": row.time_share}
            if precision == "int8":
                fp32 = next(r for p, r in rows if p == "float32" and r.variant == row.variant
                            and r.batch_size == bs)
                entry["int8_over_float32"] = median_ratio(row, fp32)
                # the verifier decides: equal unless a near-tie flips with the verify width
                entry["same_greedy_output"] = (outputs[("int8", row.variant, bs)]
                                               == outputs[("float32", row.variant, bs)])
            report["rows"].append(entry)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "draft_precision.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"{'B':>2} {'drafter':9s} {'drafts':8s} {'tok/s':>7} {'vs base':>7} {'accept':>6} "
          f"{'int8/fp32':>9}")
    for e in report["rows"]:
        acc = "" if e["acceptance_rate"] is None else f"{e['acceptance_rate']:.3f}"
        ratio = (f"{e['int8_over_float32']:.2f}"
                 f"{'' if e['same_greedy_output'] else ' (output differs)'}"
                 if "int8_over_float32" in e else "")
        print(f"{e['batch_size']:>2} {e['drafter']:9s} {e['draft_precision']:8s} "
              f"{e['tokens_per_second']:7.1f} {e['speedup_vs_baseline']:7.2f} {acc:>6} "
              f"{ratio:>9}")
    print(f"wrote {out / 'draft_precision.json'}")


if __name__ == "__main__":
    main()
