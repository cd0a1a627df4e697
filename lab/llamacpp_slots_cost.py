"""What extra llama.cpp sequences cost: the prefix cache's cache slots are sequences of the
context (``serve --cache-slots``). Times, side by side in one run, a prompt's prefill and
single-token decode steps of one sequence in contexts of ``--slots`` sequences each (the
contexts alternate, so a slow spell hits both alike), and prints the ratios to the first.

    .venv/bin/python lab/llamacpp_slots_cost.py --engines engines/qwen --slots 4,16
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from paradraft.runtime.backends.loader import load_engines


def time_engine(engine, prompt_len: int, steps: int) -> tuple[float, float]:
    """(prefill seconds, seconds per decode step) of sequence 0 from an empty cache."""
    engine.reset()
    prompt = torch.arange(100, 100 + prompt_len)[None]
    t0 = time.perf_counter()
    engine(prompt, torch.arange(prompt_len)[None], output_index=torch.tensor([[prompt_len - 1]]))
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(steps):
        engine(torch.tensor([[200 + i]]), torch.tensor([[prompt_len + i]]))
    return prefill, (time.perf_counter() - t0) / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", required=True)
    p.add_argument("--slots", default="4,16")
    p.add_argument("--prompt-len", type=int, default=129)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    sizes = [int(s) for s in args.slots.split(",")]
    engines = {s: load_engines(args.engines, threads=args.threads, slots=s)[0] for s in sizes}
    runs: dict[int, list[tuple[float, float]]] = {s: [] for s in sizes}
    for _ in range(args.repeats):
        for s in sizes:
            runs[s].append(time_engine(engines[s], args.prompt_len, args.steps))
    out = {}
    base = sizes[0]
    for s in sizes:
        prefill = statistics.median(r[0] for r in runs[s])
        step = statistics.median(r[1] for r in runs[s])
        out[s] = {"prefill_s": prefill, "step_s": step,
                  "prefill_vs_first": prefill / statistics.median(r[0] for r in runs[base]),
                  "step_vs_first": step / statistics.median(r[1] for r in runs[base])}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
