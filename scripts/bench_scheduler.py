"""Benchmark: the in-flight scheduler in process, driven like `paradraft loadtest`.

What the server's decoder can do without Triton, gRPC or a client on the same cores: the
same ``Scheduler`` the Triton model hosts (``serve.build_scheduler``), fed closed-loop by
``c`` request threads (each sends its next held-out prompt when the last one finished),
for each concurrency in turn within every repeat. Reports output tokens/s per level and
each level over concurrency 1 (median of per-repeat ratios). JSON.

    .venv/bin/python scripts/bench_scheduler.py --engines engines/demo \
        --out results/scheduler_in_process
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

from paradraft.runtime.bench import add_script_args, script_prompts, write_report
from paradraft.runtime.cli import DEMO_DIR
from paradraft.runtime.correction import RuleParams
from paradraft.runtime.scheduler import Request
from paradraft.runtime.serve import ServeConfig, build_scheduler


def closed_loop(scheduler, prompts: list[list[int]], concurrency: int, requests: int,
                max_tokens: int) -> float:
    """Output tokens/s of ``requests`` requests sent by ``concurrency`` threads."""
    lock = threading.Lock()
    sent, tokens = [0], [0]

    def client() -> None:
        while True:
            with lock:
                if sent[0] == requests:
                    return
                i = sent[0]
                sent[0] += 1
            done = threading.Event()

            def on_tokens(new: list[int]) -> None:
                with lock:
                    tokens[0] += len(new)

            scheduler.submit(Request(prompts[i % len(prompts)], max_tokens,
                                     RuleParams("greedy"), on_tokens,
                                     lambda stats, error, done=done: done.set()))
            done.wait()

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return tokens[0] / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default="engines/demo")
    add_script_args(ap, prompts=96, repeats=3)
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--requests", type=int, default=64, help="requests per level")
    ap.add_argument("--max-slots", type=int, default=16)
    ap.add_argument("--out", default="out/scheduler_in_process")
    args = ap.parse_args()
    prompts = script_prompts(args)
    levels = [int(c) for c in args.concurrency.split(",")]
    if args.requests < 1 or min(levels) < 1:
        raise ValueError(f"requests and concurrency must be >= 1; got {args.requests}, "
                         f"{args.concurrency!r}")
    config = ServeConfig(verifier=str(DEMO_DIR / "verifier"), draft=None,
                         engines=args.engines, max_slots=args.max_slots,
                         acceptance_floor=0.0)  # a benchmark: no monitoring warnings
    scheduler = build_scheduler(config)
    try:
        closed_loop(scheduler, prompts, 2, 4, 8)  # warm-up: sessions, allocations
        runs = {c: [] for c in levels}
        for repeat in range(args.repeats):
            for c in levels:
                runs[c].append(closed_loop(scheduler, prompts, c, args.requests,
                                           args.max_new_tokens))
                print(f"repeat {repeat}: concurrency {c:2d} {runs[c][-1]:7.1f} tok/s",
                      flush=True)
    finally:
        scheduler.stop()
    first = levels[0]
    report = {"engines": args.engines, "requests": args.requests,
              "max_tokens": args.max_new_tokens, "max_slots": args.max_slots,
              "levels": {c: {"tokens_per_second": statistics.median(runs[c]),
                             "repeat_tokens_per_second": runs[c],
                             f"vs_c{first}": statistics.median(
                                 a / b for a, b in zip(runs[c], runs[first], strict=True))}
                         for c in levels}}
    for c, level in report["levels"].items():
        print(f"concurrency {c:2d}: {level['tokens_per_second']:7.1f} tok/s, "
              f"{level[f'vs_c{first}']:.2f}x concurrency {first}")
    write_report(args.out, "scheduler.json", report)


if __name__ == "__main__":
    main()
