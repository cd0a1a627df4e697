"""The decoding loop of this working tree against an earlier commit's, side by side in one
process: tokens/s, and per round the time inside ONNX Runtime's runs (engine) and the rest of
the round's wall clock (host: binding, indexing, correction, bookkeeping), for plain decoding
and the draft-model and parallel drafters at K=4.

The earlier commit's ``runtime/`` is exported (``git archive``) into a temporary package, so
both loops run on the same engines dir, prompts and machine. Passes alternate between the two
(ABBA), so a slow spell on a shared machine hits both; ratios are medians of per-pass ratios.
Each pass decodes ``--prompts`` held-out prompts in batches. Both must produce the same tokens
(printed per row). Writes JSON (default results/bench_hot_loop.json) and prints a table.

    .venv/bin/python lab/bench_hot_loop.py --before 792c0d2 [--rule exact] [--passes 10]
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import onnxruntime

REPO = Path(__file__).resolve().parent.parent
KINDS = ("plain", "model", "parallel")


def export_runtime(ref: str, into: Path) -> str:
    """``ref``'s runtime/ as the package ``pd_before`` under ``into``; returns its name."""
    package = into / "pd_before"
    package.mkdir()
    (package / "__init__.py").write_text("")
    archive = subprocess.run(["git", "archive", ref, "runtime"], cwd=REPO, check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(package)], input=archive, check=True)
    sys.path.insert(0, str(into))
    return "pd_before"


class EngineClock:
    """Seconds spent inside ONNX Runtime's runs (every session, both loops), and the last
    run's (a round's last run is its verify pass)."""

    def __init__(self) -> None:
        self.seconds = self.last = 0.0
        run = onnxruntime.InferenceSession.run_with_iobinding

        def timed(session, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return run(session, *args, **kwargs)
            finally:
                self.last = time.perf_counter() - t0
                self.seconds += self.last

        onnxruntime.InferenceSession.run_with_iobinding = timed


def decode_pass(dec, prompts: list[list[int]], batch: int, tokens: int, seed: int,
                clock: EngineClock
                ) -> tuple[float, list[float], list[tuple[float, float]], list[list[int]]]:
    """(wall seconds, per round after the prefill its host seconds and its engine seconds
    (drafting, verify pass), tokens per prompt)."""
    out, host, engine_time = [], [], []
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        rows = [[] for _ in prompts[i: i + batch]]
        stream = dec.stream(prompts[i: i + batch], tokens, seed=seed)
        for r, new in zip(rows, next(stream), strict=True):  # the prefill's token
            r.extend(new)
        while True:
            engine, start = clock.seconds, time.perf_counter()
            new = next(stream, None)
            if new is None:
                break
            host.append(time.perf_counter() - start - (clock.seconds - engine))
            engine_time.append((clock.seconds - engine - clock.last, clock.last))
            for r, gained in zip(rows, new, strict=True):
                r.extend(gained)
        out += rows
    return time.perf_counter() - t0, host, engine_time, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", default="HEAD", help="the commit to compare with")
    ap.add_argument("--engines", default=str(REPO / "engines/demo"))
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--rule", choices=("greedy", "exact"), default="greedy",
                    help="exact: speculative sampling at T=0.8, top-p 0.9 (plain: sampling)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--passes", type=int, default=10)
    ap.add_argument("--out", default=str(REPO / "results/bench_hot_loop.json"))
    args = ap.parse_args()
    from paradraft.runtime import correction, speculative
    from paradraft.runtime.backends import loader
    from paradraft.runtime.checkpoints import heldout_prompts, heldout_texts, load_tokenizer

    tmp = tempfile.TemporaryDirectory(prefix="paradraft-before-")
    name = export_runtime(args.before, Path(tmp.name))
    old = {m: importlib.import_module(f"{name}.runtime.{m}") for m in
           ("backends.loader", "correction", "speculative")}
    new = {"backends.loader": loader, "correction": correction, "speculative": speculative}
    clock = EngineClock()
    sampling = dict(temperature=0.8, top_p=0.9) if args.rule == "exact" else {}
    tok = load_tokenizer(REPO / "models/demo/verifier")
    texts = heldout_texts(REPO / "models/demo")
    prompts = [p for p, _ in heldout_prompts(tok, texts, args.prompts, 48)]
    loops = {}  # each loop loads the engines with its own backend code
    for label, mods in (("before", old), ("after", new)):
        verifier, drafters, _, _ = mods["backends.loader"].load_engines(args.engines)
        loops[label] = (mods, verifier, drafters)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                            capture_output=True, text=True).stdout.strip()
    result = {"date": time.strftime("%Y-%m-%d"), "before": args.before,
              "after": f"working tree on {commit}", "rule": args.rule, "rows": []}
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        for kind in KINDS:
            decs = {}
            for label, (mods, verifier, drafters) in loops.items():
                drafter = None if kind == "plain" else drafters[kind]
                params = mods["correction"].RuleParams(args.rule, **sampling)
                decs[label] = mods["speculative"].SpeculativeDecoder(
                    verifier, drafter, params, k=4 if drafter else 0, max_batch_size=batch,
                    max_seq_len=48 + args.max_new_tokens, acceptance_floor=0.0)
                decs[label].generate(prompts[:batch], 4)  # warm-up
            walls = {label: [] for label in decs}
            hosts = {label: [] for label in decs}
            engine = {label: [] for label in decs}
            outputs = {}
            for p in range(args.passes):
                for label in ("before", "after") if p % 2 == 0 else ("after", "before"):
                    wall, host, engine_time, outputs[label] = decode_pass(
                        decs[label], prompts, batch, args.max_new_tokens, p, clock)
                    walls[label].append(wall)
                    hosts[label] += host
                    engine[label] += engine_time
            tokens = sum(map(len, outputs["after"]))
            row = {"batch": batch, "variant": kind, "tokens_per_pass": tokens,
                   "same_tokens": outputs["before"] == outputs["after"],
                   "speedup_median": statistics.median(
                       b / a for b, a in zip(walls["before"], walls["after"], strict=True))}
            for label in decs:
                row[f"{label}_tokens_per_s"] = tokens / statistics.median(walls[label])
                row[f"{label}_host_ms_per_round"] = 1e3 * statistics.median(hosts[label])
                for i, part in enumerate(("draft", "verify")):
                    row[f"{label}_engine_{part}_ms_per_round"] = 1e3 * statistics.median(
                        e[i] for e in engine[label])
            result["rows"].append(row)
            print(f"B={batch} {kind:8s} {args.rule}: tok/s {row['before_tokens_per_s']:7.1f} "
                  f"-> {row['after_tokens_per_s']:7.1f} (x{row['speedup_median']:.2f} median "
                  f"per pass); host ms/round {row['before_host_ms_per_round']:.3f} -> "
                  f"{row['after_host_ms_per_round']:.3f}; engine draft + verify ms/round "
                  f"{row['after_engine_draft_ms_per_round']:.3f} + "
                  f"{row['after_engine_verify_ms_per_round']:.3f}; same tokens "
                  f"{row['same_tokens']}",
                  flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
