"""Benchmark: one ONNX Runtime call of each graph, for engine dirs side by side.

Times the verifier's step graph (T tokens) and the draft model's fused k-step graph alone,
with the sessions the runtime creates, on a cache filled to ``--cache-len`` positions,
for each engine dir in turn within every pass; reports each dir's best pass (ms per call,
the median of ``--calls`` calls) and the speed over the first dir. ``--after-draft`` also
times each verifier graph right after an (untimed) call of the fused draft graph, the order
of a speculative round: what the draft's run leaves behind (caches, idle workers) costs the
verifier in the decoding loop. JSON.

    .venv/bin/python scripts/time_engine_graphs.py --engines engines/before,engines/after
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from paradraft.runtime.bench import engine_dir_list
from paradraft.runtime.engines import load_engines, step_inputs
from paradraft.runtime.model import new_kv_cache


def graph_calls(engine_dir: str, batch_size: int, verify_tokens: list[int], k: int,
                cache_len: int, after_draft: bool = False, threads: int | None = None) -> dict:
    """{label: (an untimed no-argument function to run first or None, one timed call)}."""
    verifier, drafters = load_engines(engine_dir, threads=threads)[:2]
    draft = drafters["model"].model
    calls = {}
    for model, name, n_tokens, reach in [
            *((verifier, f"verifier T={t}", t, 0) for t in verify_tokens),
            (draft, f"draft fused K={k}", 2, k - 1)]:
        cache = new_kv_cache(model.config, batch_size, cache_len + 16, torch.float32)
        pos = (cache_len + torch.arange(n_tokens)).expand(batch_size, -1)
        tokens = torch.randint(0, model.config.vocab_size, (batch_size, n_tokens))
        inputs = step_inputs(tokens, pos, cache, cache_len + 12, None, None,
                             model.config.n_layers, reach=reach)
        if reach:
            del inputs["output_index"]
            model.greedy_drafts(tokens, pos, cache, k, kv_len=cache_len + 12)  # the session
            graph = model._draft_steps[(None, k)]
        else:
            model(tokens, pos, cache, kv_len=cache_len + 12)  # creates the session
            graph = model._graphs[None]
        feeds = {key: t.numpy() for key, t in inputs.items()}
        calls[name] = (None, lambda s=graph.session, f=feeds: s.run(None, f))
    if after_draft:
        draft_call = calls[f"draft fused K={k}"][1]
        calls.update({f"{name} after draft": (draft_call, call)
                      for name, (_, call) in list(calls.items()) if name.startswith("verifier")})
    return calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", required=True, help="comma-separated engine dirs (>= 2)")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--verify-tokens", default="1,5")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--cache-len", type=int, default=120)
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--after-draft", action="store_true",
                    help="also time each verifier graph right after a draft graph call")
    ap.add_argument("--threads", type=int, default=None,
                    help="ONNX Runtime intra-op threads of the verifier (default: torch's)")
    ap.add_argument("--out", default="out/engine_graphs")
    args = ap.parse_args()
    dirs = engine_dir_list(args.engines)
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"threads must be >= 1; got {args.threads}")
    for name in ("batch_size", "passes", "calls", "cache_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"{name} must be >= 1; got {getattr(args, name)}")
    if args.k < 2:  # fused graphs exist for k >= 2; k = 1 is the plain step graph
        raise ValueError(f"k must be >= 2 (a fused draft graph); got {args.k}")
    calls = {d: graph_calls(d, args.batch_size, [int(t) for t in args.verify_tokens.split(",")],
                            args.k, args.cache_len, args.after_draft, args.threads)
             for d in dirs}
    best: dict[tuple[str, str], float] = {}
    for _ in range(args.passes):
        for d, graphs in calls.items():
            for label, (before, call) in graphs.items():
                for _ in range(20):  # warm-up
                    call()
                times = []
                for _ in range(args.calls):
                    if before is not None:
                        before()
                    t0 = time.perf_counter()
                    call()
                    times.append(time.perf_counter() - t0)
                ms = statistics.median(times) * 1e3
                best[(d, label)] = min(best.get((d, label), ms), ms)
    rows = [{"engines": d, "graph": label, "batch_size": args.batch_size, "ms_per_call": ms,
             "speed_vs_reference": best[(dirs[0], label)] / ms}
            for (d, label), ms in best.items()]
    for r in rows:
        print(f"{r['engines']:28s} {r['graph']:30s} B{r['batch_size']} "
              f"{r['ms_per_call']:7.3f} ms  {r['speed_vs_reference']:5.2f}x")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "engine_graphs.json").write_text(json.dumps({"engines": dirs, "rows": rows,
                                                        "passes": args.passes,
                                                        "calls": args.calls,
                                                        "after_draft": args.after_draft,
                                                        "threads": args.threads},
                                                       indent=2))
    print(f"wrote {out / 'engine_graphs.json'}")


if __name__ == "__main__":
    main()
