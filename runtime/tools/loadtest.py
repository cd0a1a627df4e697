"""``paradraft loadtest``: bounded-concurrency gRPC streaming against a running server.

For each concurrency level a fixed number of requests is sent by that many client threads
(each sends its next request when the previous one finished), so the run stops by itself.
Reports output tokens/s, time to first token and inter-token latency (p50/p99), errors,
lost requests (sent but never answered) and acceptance. Ratios between levels come from one
run against one server; with ``repeats`` > 1 the levels are run in turn (c1, c4, … c1, c4, …)
so a slow spell of a shared machine hits every level alike, and the reported ratio is the
median of the per-repeat ratios.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import tritonclient.grpc as grpcclient
from tqdm import tqdm

from ..serving.client import complete


@dataclass
class LevelResult:
    concurrency: int
    repeat: int
    requests: int
    answered: int
    errors: int
    lost: int
    output_tokens: int
    seconds: float
    tokens_per_second: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    acceptance_rate: float
    # CPU the load generator itself used (all its threads) per second of the level: on a
    # machine it shares with the server, this much compute was not the server's
    client_cpu_share: float
    error_messages: list[str]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))]


def run_level(url: str, prompts: list[str], concurrency: int, requests: int, max_tokens: int,
              progress: tqdm | None = None, repeat: int = 0) -> LevelResult:
    jobs = list(range(requests))
    lock = threading.Lock()
    results, errors = [], []

    def worker():
        # one channel per worker, reused by its requests (as perf_analyzer does): a new
        # channel per request is client CPU taken from a server on the same cores
        client = grpcclient.InferenceServerClient(url)
        try:
            while True:
                with lock:
                    if not jobs:
                        return
                    i = jobs.pop()
                try:
                    r = complete(url, prompts[i % len(prompts)], max_tokens, stream=True,
                                 client=client)
                    with lock:
                        results.append(r)
                except Exception as e:  # counted, never raised: the run must finish
                    with lock:
                        errors.append(str(e)[:200])
                if progress is not None:
                    progress.update(1)
        finally:
            client.close()

    t0, cpu0 = time.perf_counter(), time.process_time()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    client_cpu = time.process_time() - cpu0
    tokens = sum(sum(r.chunk_tokens) for r in results)
    ttft = [r.first_token_s * 1e3 for r in results]
    # inter-token latency: each gap between responses spread over the tokens it delivered
    itl = []
    for r in results:
        for gap, n in zip(
            [b - a for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False)],
            r.chunk_tokens[1:], strict=True,
        ):
            itl += [gap * 1e3 / n] * n if n else []
    drafted = sum(r.total_draft_tokens for r in results)
    accepted = sum(r.total_accepted_draft_tokens for r in results)
    return LevelResult(
        concurrency=concurrency, repeat=repeat, requests=requests,
        answered=len(results) + len(errors),
        errors=len(errors), lost=requests - len(results) - len(errors), output_tokens=tokens,
        seconds=seconds, tokens_per_second=tokens / seconds,
        ttft_p50_ms=percentile(ttft, 50), ttft_p99_ms=percentile(ttft, 99),
        itl_p50_ms=percentile(itl, 50), itl_p99_ms=percentile(itl, 99),
        acceptance_rate=accepted / drafted if drafted else 0.0,
        client_cpu_share=client_cpu / seconds,
        error_messages=sorted(set(errors))[:5],
    )


def run_loadtest(url: str, prompts: list[str], levels: list[int], requests: int,
                 max_tokens: int, repeats: int = 1) -> list[LevelResult]:
    """Every level ``repeats`` times, the levels in turn; results in run order."""
    complete(url, prompts[0], 4)  # warm-up
    out = []
    with tqdm(total=requests * len(levels) * repeats, desc="loadtest", unit="req") as bar:
        for r in range(repeats):
            for c in levels:
                out.append(run_level(url, prompts, c, requests, max_tokens, bar, r))
    return out


def summarize(results: list[LevelResult]) -> dict:
    """Per level: median tokens/s over repeats and its range; per level above the first:
    the median over repeats of its tokens/s over the first level's in the same repeat."""
    levels = list(dict.fromkeys(r.concurrency for r in results))
    tps = {c: {r.repeat: r.tokens_per_second for r in results if r.concurrency == c}
           for c in levels}
    base = levels[0]
    out: dict = {}
    for c in levels[1:]:
        ratios = [tps[c][i] / tps[base][i] for i in tps[c] if i in tps[base]]
        out[f"c{c}_vs_c{base}"] = statistics.median(ratios)
        if len(ratios) > 1:
            out[f"c{c}_vs_c{base}_per_repeat"] = ratios
    out["tokens_per_second_median"] = {f"c{c}": statistics.median(tps[c].values())
                                       for c in levels}
    out["errors"] = sum(r.errors for r in results)
    out["lost"] = sum(r.lost for r in results)
    return out


def write_outputs(results: list[LevelResult], out_dir: Path, meta: dict) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    data = {"meta": meta, "summary": summarize(results), "levels": [asdict(r) for r in results]}
    (out_dir / "loadtest.json").write_text(json.dumps(data, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for rep in sorted({r.repeat for r in results}):
        runs = [r for r in results if r.repeat == rep]
        a1.plot([r.concurrency for r in runs], [r.tokens_per_second for r in runs], marker="o",
                label=f"repeat {rep + 1}")
    a1.set(xlabel="concurrent streams", ylabel="output tokens/s", title="throughput")
    a1.legend()
    runs = [r for r in results if r.repeat == 0]
    c = [r.concurrency for r in runs]
    a2.plot(c, [r.ttft_p50_ms for r in runs], marker="o", label="TTFT p50")
    a2.plot(c, [r.ttft_p99_ms for r in runs], marker="o", label="TTFT p99")
    a2.plot(c, [r.itl_p50_ms for r in runs], marker="s", label="ITL p50")
    a2.plot(c, [r.itl_p99_ms for r in runs], marker="s", label="ITL p99")
    a2.set(xlabel="concurrent streams", ylabel="ms", title="latency", yscale="log")
    a2.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "loadtest.png", dpi=110)
    plt.close(fig)
    return data


def print_results(results: list[LevelResult]) -> None:
    print(f"{'rep':>3s} {'conc':>4s} {'req':>4s} {'err':>3s} {'lost':>4s} {'tok/s':>8s} "
          f"{'TTFT p50':>9s} {'p99':>7s} {'ITL p50':>8s} {'p99':>7s} {'accept':>6s} "
          f"{'client CPU':>10s}")
    for r in results:
        print(f"{r.repeat + 1:3d} {r.concurrency:4d} {r.requests:4d} {r.errors:3d} {r.lost:4d} "
              f"{r.tokens_per_second:8.1f} {r.ttft_p50_ms:8.0f}ms {r.ttft_p99_ms:6.0f}ms "
              f"{r.itl_p50_ms:7.1f}ms {r.itl_p99_ms:6.1f}ms {r.acceptance_rate:6.2f} "
              f"{r.client_cpu_share:9.2f}c")
