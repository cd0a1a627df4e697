"""aiperf (a client we did not write) against `paradraft serve` at its defaults and against the
same engines served with drafting off (`--draft-len-schedule 1:0`), side by side.

Both servers run at once, on ``--server-cpus`` (aiperf on ``--client-cpus``); each load
level goes to one, then the other, in turn (``--repeats`` times), so that a slow spell of the
machine hits both. Prompt sets are chat prompts from
prompts/*.jsonl (a user message each), sent as aiperf's ``single_turn`` custom dataset to
the OpenAI API, streamed, ``max_tokens`` fixed with ``ignore_eos``. The server that goes
first alternates between repeats. Besides aiperf's tok/s, each run records the CPU seconds the
server's processes (tritonserver, its Python stub, the OpenAI API) spent per output token, read
from /proc: a figure that a slow spell of the machine moves far less than wall-clock
throughput. Writes every aiperf run's artifacts and a summary JSON (per server, set and
concurrency; ratios are of medians) under ``--out``.

    python lab/aiperf_goodput.py --engines engines/smollm2 --aiperf /tmp/aiperf-venv/bin/aiperf
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SERVER_CPUS, CLIENT_CPUS = "0", "1"  # set from --server-cpus / --client-cpus


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(engines: str, extra: list[str], log: Path) -> tuple[subprocess.Popen, int]:
    port = free_port()
    cmd = [sys.executable, "-m", "paradraft.cli", "serve", "--engines", engines,
           "--grpc-port", str(free_port()), "--http-port", str(free_port()),
           "--metrics-port", str(free_port()), "--openai-port", str(port), *extra]
    proc = subprocess.Popen(["taskset", "-c", SERVER_CPUS, *cmd], stdout=log.open("w"),
                            stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}); see {log}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2)
            return proc, port
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"server not ready in 600 s; see {log}")


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process under it (Linux /proc)."""
    pids = [pid]
    for parent in pids:
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                pids += [int(c) for c in (task / "children").read_text().split()]
            except OSError:  # it exited meanwhile
                continue
    return pids


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds the processes have used (those gone since are skipped)."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime in clock ticks
    return total / os.sysconf("SC_CLK_TCK")


def dataset(prompt_files: list[str], out: Path) -> Path:
    """aiperf's single_turn custom dataset: one {"text": user message} per line."""
    rows = []
    for name in prompt_files:
        for line in (ROOT / name).read_text().splitlines():
            if line.strip():
                rows.append({"text": json.loads(line)["messages"][-1]["content"]})
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def run_aiperf(aiperf: str, port: int, tokenizer: str, data: Path, concurrency: int,
               requests: int, max_tokens: int, extra_inputs: list[str], out: Path) -> dict:
    # aiperf's timing manager keeps a core busy: it gets a core of its own (CLIENT_CPUS), as a
    # load generator on another machine would; at the lowest priority it starved, and its
    # late reads slowed both servers
    cmd = ["taskset", "-c", CLIENT_CPUS, aiperf, "profile", "--model", "paradraft", "--url", f"http://127.0.0.1:{port}",
           "--endpoint-type", "chat", "--streaming", "--tokenizer", tokenizer,
           "--input-file", str(data), "--custom-dataset-type", "single_turn",
           "--concurrency", str(concurrency), "--request-count", str(requests),
           "--output-tokens-mean", str(max_tokens),
           "--extra-inputs", f"max_tokens:{max_tokens}", "--extra-inputs", "ignore_eos:true",
           "--artifact-dir", str(out), "--ui-type", "none", "--workers-max", "1",
           "--record-processors", "1"]
    for item in extra_inputs:
        cmd += ["--extra-inputs", item]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    found = sorted(out.rglob("profile_export_aiperf.json"))
    if not found:
        raise RuntimeError(f"aiperf wrote no profile_export_aiperf.json under {out}")
    return json.loads(found[-1].read_text())


def metric(export: dict, name: str) -> float:
    value = export[name]
    return value["avg"] if isinstance(value, dict) else value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", required=True)
    ap.add_argument("--aiperf", required=True, help="aiperf executable (a scratch venv)")
    ap.add_argument("--concurrency", default="1,4,8,16")
    ap.add_argument("--requests-per-slot", type=int, default=4,
                    help="requests per level: this × max(concurrency, 4)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--sets", default="open,grounded",
                    help="open: prompts/coding_open + open_ended (the server's drafter); "
                         "grounded: prompts/grounded (drafter ngram, named per request)")
    ap.add_argument("--grounded-concurrency", default="1,8")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "aiperf_goodput")
    ap.add_argument("--server-cpus", default="0", help="taskset list for both servers")
    ap.add_argument("--client-cpus", default="1", help="taskset list for aiperf")
    args = ap.parse_args()
    global SERVER_CPUS, CLIENT_CPUS
    SERVER_CPUS, CLIENT_CPUS = args.server_cpus, args.client_cpus
    args.out.mkdir(parents=True, exist_ok=True)
    sets = {"open": (["prompts/coding_open.jsonl", "prompts/open_ended.jsonl"], [],
                     [int(c) for c in args.concurrency.split(",")]),
            "grounded": (["prompts/grounded.jsonl"], ["drafter:ngram"],
                         [int(c) for c in args.grounded_concurrency.split(",")])}
    chosen = {name: sets[name] for name in args.sets.split(",")}
    servers = {}
    try:
        for name, extra in [("spec", []), ("plain", ["--draft-len-schedule", "1:0"])]:
            servers[name] = start_server(args.engines, extra, args.out / f"{name}.log")
        results: dict = {}
        for repeat in range(args.repeats):
            for set_name, (files, extra_inputs, levels) in chosen.items():
                data = dataset(files, args.out / f"{set_name}.jsonl")
                for c in levels:
                    order = list(servers.items())  # who goes first alternates: no order bias
                    for name, (proc, port) in order[::-1] if repeat % 2 else order:
                        out = args.out / name / f"{set_name}_c{c}_r{repeat}"
                        requests = args.requests_per_slot * max(c, 4)
                        pids = process_tree(proc.pid)
                        cpu_before = cpu_seconds(pids)
                        export = run_aiperf(args.aiperf, port, args.engines, data, c,
                                            requests, args.max_tokens, extra_inputs, out)
                        cpu = cpu_seconds(pids) - cpu_before
                        row = results.setdefault(set_name, {}).setdefault(str(c), {})
                        row.setdefault(name, []).append({
                            "output_tok_s": metric(export, "output_token_throughput"),
                            "request_latency_ms": metric(export, "request_latency"),
                            "ttft_ms": metric(export, "time_to_first_token"),
                            "server_cpu_ms_per_token": 1000 * cpu / (requests * args.max_tokens)})
                        print(f"{set_name} c={c} {name} r{repeat}: "
                              f"{row[name][-1]['output_tok_s']:.1f} tok/s, server CPU "
                              f"{row[name][-1]['server_cpu_ms_per_token']:.2f} ms/token",
                              flush=True)
        summary = {}
        for set_name, levels in results.items():
            for c, row in levels.items():
                med = {name: statistics.median(r["output_tok_s"] for r in runs)
                       for name, runs in row.items()}
                cpu = {name: statistics.median(r["server_cpu_ms_per_token"] for r in runs)
                       for name, runs in row.items()}
                summary.setdefault(set_name, {})[c] = {
                    **{f"{name}_tok_s": v for name, v in med.items()},
                    **{f"{name}_cpu_ms_per_token": v for name, v in cpu.items()},
                    "ratio": med["spec"] / med["plain"],
                    # plain's CPU per token over spec's: > 1 where speculation saves CPU
                    "cpu_ratio": cpu["plain"] / cpu["spec"],
                    "ratios_per_repeat": [a["output_tok_s"] / b["output_tok_s"] for a, b in
                                          zip(row["spec"], row["plain"], strict=True)]}
        (args.out / "summary.json").write_text(json.dumps(
            {"summary": summary, "runs": results, "args": {k: str(v) for k, v in
                                                           vars(args).items()}}, indent=1))
        for set_name, levels in summary.items():
            for c, s in levels.items():
                print(f"{set_name:8s} c={c:>2}: spec {s['spec_tok_s']:7.1f}  plain "
                      f"{s['plain_tok_s']:7.1f}  ratio {s['ratio']:.3f}  per repeat "
                      + " ".join(f"{r:.3f}" for r in s["ratios_per_repeat"])
                      + f"  CPU/token plain/spec {s['cpu_ratio']:.3f}")
    finally:
        for proc, _ in servers.values():
            proc.terminate()
        for proc, _ in servers.values():
            proc.wait(60)


if __name__ == "__main__":
    main()
