"""Benchmark: the runtime's thread settings against each one undone, side by side in one run.

Variants, each differing from ``runtime`` (the current settings) in one thing:
- ``blocking``: ONNX Runtime workers block after every node
  (``session.intra_op.allow_spinning`` = 0) instead of spinning within a run;
- ``torch_threads``: the decoder's own torch ops run on torch's thread count instead of one
  (``speculative.glue_threads`` off).
The engine dir is loaded once per variant. Each decodes the same held-out prompts, greedy,
in turn within every repeat: the plain baseline and the draft model at each K and batch
size. Reports tokens/s, the runtime's speed over each variant (median of per-repeat
ratios), and whether the outputs are equal. JSON.

    .venv/bin/python scripts/bench_runtime_threads.py --engines engines/demo \
        --out results/runtime_threads
"""

from __future__ import annotations

import argparse
from contextlib import contextmanager, nullcontext
from unittest import mock

import torch

from paradraft.runtime import onnx_backend, speculative
from paradraft.runtime.bench import (
    BenchRow,
    add_script_args,
    median_ratio,
    run_ours,
    script_prompts,
    write_report,
)
from paradraft.runtime.correction import RuleParams
from paradraft.runtime.engines import load_engines

VARIANTS = ("runtime", "blocking", "torch_threads")


@contextmanager
def blocking_workers():
    """Sessions created inside block their workers after every node."""
    runtime_options = onnx_backend.session_options

    def options(*args, **kwargs):
        so = runtime_options(*args, **kwargs)
        so.log_severity_level = 3  # not the warning that an entry is overwritten
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        return so

    onnx_backend.session_options = options
    try:
        yield
    finally:
        onnx_backend.session_options = runtime_options


@contextmanager
def torch_glue():
    """The decoder's torch ops on torch's own thread count."""
    with mock.patch.object(speculative, "glue_threads", lambda n: nullcontext()):
        yield


def variant_context(variant: str):
    return {"blocking": blocking_workers, "torch_threads": torch_glue}.get(variant,
                                                                           nullcontext)()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default="engines/demo")
    add_script_args(ap, prompts=24, repeats=3)
    ap.add_argument("--ks", default="4")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--out", default="out/runtime_threads")
    args = ap.parse_args()
    prompts = script_prompts(args)
    cases = [(bs, k) for bs in map(int, args.batch_sizes.split(","))
             for k in [0, *map(int, args.ks.split(","))]]
    loaded = {}
    for variant in VARIANTS:
        verifier, drafters = load_engines(args.engines)[:2]
        loaded[variant] = verifier, drafters["model"]
    rows = {(variant, case): BenchRow("ours", "baseline" if case[1] == 0 else "model",
                                      "greedy", case[1], case[0], False, backend="onnx")
            for case in cases for variant in VARIANTS}
    outputs: dict[tuple, list[list[int]]] = {}
    for repeat in range(args.repeats):
        for (variant, (bs, k)), row in rows.items():
            verifier, draft = loaded[variant]
            tokens: list[list[int]] = []
            # sessions are created on first use: the blocking copy's inside the patch
            with variant_context(variant):
                run_ours(verifier, draft if k else None, RuleParams("greedy"), k, prompts,
                         args.max_new_tokens, bs, 0, row, tokens)
            row.repeat_tokens_per_second.append(row.tokens / row.seconds)
            outputs[(variant, bs, k)] = tokens
            print(f"repeat {repeat}: {variant} B{bs} K={k} "
                  f"{row.repeat_tokens_per_second[-1]:7.1f} tok/s", flush=True)
    report = {"engines": args.engines, "prompts": len(prompts),
              "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
              "torch_threads": torch.get_num_threads(), "rows": []}
    print(f"{'variant':13s} {'B':>2} {'K':>2} {'tok/s':>7} {'vs K=0':>7} "
          f"{'runtime vs it':>13} same")
    for (variant, case), row in rows.items():
        bs, k = case
        entry = {"variant": variant, "batch_size": bs, "k": k,
                 "tokens_per_second": row.tokens_per_second,
                 "repeat_tokens_per_second": row.repeat_tokens_per_second,
                 "speedup_vs_baseline": median_ratio(row, rows[(variant, (bs, 0))]),
                 "runtime_speed_over_this": median_ratio(rows[("runtime", case)], row),
                 "acceptance_rate": row.acceptance_rate,
                 "same_output": outputs[(variant, bs, k)] == outputs[("runtime", bs, k)]}
        report["rows"].append(entry)
        print(f"{variant:13s} {bs:2d} {k:2d} {row.tokens_per_second:7.1f} "
              f"{entry['speedup_vs_baseline']:7.2f} {entry['runtime_speed_over_this']:13.2f} "
              f"{entry['same_output']}")
    write_report(args.out, "runtime_threads.json", report)


if __name__ == "__main__":
    main()
