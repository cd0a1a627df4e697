"""Fused vs unfused correction on an engine dir: two decoders over the same engine, one with
``fused_correction="on"`` and one with ``"off"``, timed in alternation (on/off, then off/on, …)
so that both see the same machine; prints the median tokens/s of each and the median of the
paired on/off ratios, and checks that both gave the same tokens.

    .venv/bin/python lab/fused_correction_timing.py --engines engines/demo
"""

from __future__ import annotations

import argparse
import statistics
import time

from paradraft.runtime.backends.loader import load_engines
from paradraft.runtime.checkpoints import (
    DEMO_DIR,
    heldout_prompts,
    heldout_texts,
    load_tokenizer,
)
from paradraft.runtime.correction import RuleParams
from paradraft.runtime.speculative import SpeculativeDecoder


def timed(dec: SpeculativeDecoder, batches: list[list[list[int]]], new_tokens: int
          ) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    out = [t for b in batches for t in dec.generate(b, new_tokens, seed=1).token_ids]
    return sum(map(len, out)) / (time.perf_counter() - t0), out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", default="engines/demo")
    p.add_argument("--drafter", default="model")
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=48)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--pairs", type=int, default=11, help="on/off alternations per config")
    args = p.parse_args()
    verifier, drafters, _, _ = load_engines(args.engines)
    prompts = [t for t, _ in heldout_prompts(load_tokenizer(args.engines),
                                             heldout_texts(DEMO_DIR), args.prompts,
                                             args.prompt_tokens)]
    for bs in map(int, args.batch_sizes.split(",")):
        batches = [prompts[i: i + bs] for i in range(0, len(prompts), bs)]
        for rule, k in (("greedy", 0), ("greedy", 4), ("exact", 4)):
            decs = {mode: SpeculativeDecoder(
                verifier, drafters[args.drafter] if k else None, RuleParams(rule), k=k or 1,
                max_batch_size=bs, max_seq_len=args.prompt_tokens + args.max_new_tokens,
                acceptance_floor=0.0, fused_correction=mode) for mode in ("on", "off")}
            for dec in decs.values():
                dec.generate(batches[0], 4)  # warm-up
            tps: dict[str, list[float]] = {"on": [], "off": []}
            for i in range(args.pairs):
                outs = {}
                for mode in ("on", "off") if i % 2 == 0 else ("off", "on"):
                    rate, outs[mode] = timed(decs[mode], batches, args.max_new_tokens)
                    tps[mode].append(rate)
                if outs["on"] != outs["off"]:
                    raise SystemExit(f"batch {bs} {rule} K={k}: fused and unfused tokens differ")
                if decs["on"].fused_stats()["fused_fallback"]:
                    raise SystemExit(f"fused rounds fell back: {decs['on'].fused_stats()}")
            ratio = statistics.median(a / b for a, b in zip(tps["on"], tps["off"], strict=True))
            print(f"batch {bs} {rule:6s} K={k}: on {statistics.median(tps['on']):7.1f} tok/s, "
                  f"off {statistics.median(tps['off']):7.1f} tok/s, on/off {ratio:.3f} "
                  f"(median of {args.pairs} pairs; same tokens)", flush=True)


if __name__ == "__main__":
    main()
