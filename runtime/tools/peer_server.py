"""``loadtest --peer llama-server``: llama.cpp's own OpenAI-compatible server, on the same GGUF
files, threads and slots, driven by the same chat client as ours in the same run.

``llama-server`` is built once into the cache from the sources vendored in the pinned
``llama-cpp-python`` sdist (``peer_llamacpp.build_tools``), so both servers run the same
kernels. Each server variant is a process of its own, started on a free local port in a
session of its own (as tritonserver is, so a shared machine's per-session CPU share treats
the two alike), waited for on ``/health`` and stopped after its levels:

- ``plain``: no speculation;
- ``ngram-simple``, ``ngram-mod``: its n-gram lookups;
- ``draft-simple``: the draft model (``-md``).

A bare mode runs at llama.cpp's own defaults; ``MODE:K`` sets its draft length with the flag
that governs that mode in this build (``SPEC_LENGTH_FLAGS``: in this llama.cpp
``--spec-draft-n-max`` bounds the draft model only). Every flag a variant needs is checked
against the binary's ``--help`` first, and a variant the build lacks is refused by name.
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .loadtest import LevelResult
from .peer_llamacpp import SERVER, PeerError, build_tools, tools_dir

PEER = SERVER
MODES = ("plain", "ngram-simple", "ngram-mod", "draft-simple")
K_RANGE = (1, 64)
# the flag that sets a mode's draft length in this llama.cpp (common/arg.cpp,
# common/speculative.cpp): ngram-simple drafts its m-gram (default 48 tokens), ngram-mod up
# to n_max (default 64), the draft model up to --spec-draft-n-max (default 3)
SPEC_LENGTH_FLAGS = {"ngram-simple": "--spec-ngram-simple-size-m",
                     "ngram-mod": "--spec-ngram-mod-n-max",
                     "draft-simple": "--spec-draft-n-max"}
# ngram-mod drops a draft shorter than its n_min (default 48 of n_max 64); with K as n_max,
# n_min keeps that share, so a shorter K still drafts
NGRAM_MOD_MIN_SHARE = 48 / 64
HEALTH_TIMEOUT_S = 600  # loading a GGUF (and its draft) into a slow machine's memory


@dataclass(frozen=True)
class PeerVariant:
    mode: str  # one of MODES
    k: int | None = None  # draft length; None: llama.cpp's default for the mode

    @property
    def name(self) -> str:
        return self.mode if self.k is None else f"{self.mode}:{self.k}"


def parse_peer_variants(text: str) -> list[PeerVariant]:
    """``plain,ngram-simple,ngram-mod:16,draft-simple:3`` → variants, in order."""
    out = []
    for item in (t.strip() for t in text.split(",")):
        mode, _, k = item.partition(":")
        if mode not in MODES:
            raise ValueError(f"peer_variants: {item!r} is not one of {', '.join(MODES)} "
                             "(each optionally :K)")
        if not k:
            out.append(PeerVariant(mode))
            continue
        if mode == "plain":
            raise ValueError(f"peer_variants: plain drafts nothing and takes no :K; got "
                             f"{item!r}")
        if not k.isdigit() or not K_RANGE[0] <= int(k) <= K_RANGE[1]:
            raise ValueError(f"peer_variants: {item!r}: K must be an integer in "
                             f"[{K_RANGE[0]}, {K_RANGE[1]}]")
        out.append(PeerVariant(mode, int(k)))
    if len({v.name for v in out}) != len(out):
        raise ValueError(f"peer_variants: each variant once; got {text!r}")
    return out


def spec_flags(variant: PeerVariant, draft: Path | None) -> list[str]:
    """llama-server's speculation options for ``variant``."""
    if variant.mode == "plain":
        return []
    flags = ["--spec-type", variant.mode]
    if variant.mode == "draft-simple":
        if draft is None:
            raise ValueError("peer_draft: the draft-simple variant needs a draft GGUF "
                             "(--peer-draft, or an engine dir built with one)")
        flags += ["-md", str(draft)]
    if variant.k is not None:
        flags += [SPEC_LENGTH_FLAGS[variant.mode], str(variant.k)]
        if variant.mode == "ngram-mod":
            n_min = max(1, int(variant.k * NGRAM_MOD_MIN_SHARE))
            flags += ["--spec-ngram-mod-n-min", str(n_min)]
    return flags


def server_argv(binary: Path, verifier: Path, variant: PeerVariant, threads: int, slots: int,
                ctx_per_slot: int, port: int, draft: Path | None = None,
                host: str = "127.0.0.1") -> list[str]:
    """The command line of one llama-server variant: ``slots`` parallel sequences of
    ``ctx_per_slot`` positions each (the context is split evenly among the slots)."""
    return [str(binary), "-m", str(verifier), "-t", str(threads), "-np", str(slots),
            "-c", str(slots * ctx_per_slot), "--host", host, "--port", str(port),
            *spec_flags(variant, draft)]


def help_options(help_text: str) -> tuple[set[str], set[str]]:
    """(the option names, the --spec-type values) that a ``llama-server --help`` lists."""
    flags = set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", help_text))
    types = re.search(r"--spec-type\s+([\w,-]+)", help_text)
    return flags, set(types.group(1).split(",")) if types else set()


def check_variants(variants: list[PeerVariant], draft: Path | None, help_text: str) -> None:
    """Refuse, by name, a variant whose options or speculation type this build lacks."""
    flags, types = help_options(help_text)
    for v in variants:
        wanted = spec_flags(v, draft)
        missing = [f for f in wanted if f.startswith("-") and f not in flags]
        if v.mode != "plain" and v.mode not in types:
            missing.append(f"--spec-type {v.mode}")
        if missing:
            raise ValueError(f"peer_variants: this llama-server build does not support "
                             f"{v.name!r} (no {', '.join(missing)} in its --help)")


def server_binary(binary: Path | None = None) -> Path:
    """``binary``, or llama-server built into the cache (the first time: minutes)."""
    if binary is not None:
        if not binary.is_file():
            raise FileNotFoundError(f"peer_binary: no file {binary}")
        return binary
    return build_tools(tools_dir(), (SERVER,)) / SERVER


def server_help(binary: Path) -> str:
    done = subprocess.run([str(binary), "--help"], capture_output=True, text=True, timeout=60)
    if done.returncode:
        raise PeerError(f"{binary} --help failed ({done.returncode}): "
                        f"{(done.stderr or done.stdout)[-800:]}")
    return done.stdout + done.stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(host: str, port: int) -> bool:
    """``GET /health`` answers 200: the model is loaded (503 while it loads)."""
    conn = http.client.HTTPConnection(host, port, timeout=5)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


@dataclass
class LlamaServer:
    """A running llama-server (``start_server``); ``url`` is HOST:PORT of its API."""

    process: subprocess.Popen
    host: str
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"{self.host}:{self.port}"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def log_tail(log: Path, chars: int = 1500) -> str:
    return log.read_text(errors="replace")[-chars:] if log.is_file() else ""


def start_server(argv: list[str], log: Path, host: str, port: int,
                 timeout: float = HEALTH_TIMEOUT_S) -> LlamaServer:
    """Start ``argv`` (``server_argv``), its output to ``log``, and wait for ``/health``;
    a server that exits or is not healthy in ``timeout`` seconds is stopped and refused
    with its log's tail."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
    server = LlamaServer(process, host, port, log)
    deadline = time.monotonic() + timeout
    try:
        while not healthy(host, port):
            if process.poll() is not None:
                raise PeerError(f"llama-server exited ({process.returncode}) before it was "
                                f"healthy: {log_tail(log)}")
            if time.monotonic() > deadline:
                raise PeerError(f"llama-server not healthy after {timeout:.0f} s: "
                                f"{log_tail(log)}")
            time.sleep(0.5)
    except BaseException:
        server.stop()
        raise
    return server


# -- ours against theirs: per concurrency, each row against llama-server's best variant ----

def row_name(r: LevelResult) -> str:
    return f"{r.system} {r.variant}"


def summarize_systems(results: list[LevelResult]) -> dict:
    """Per concurrency, per system and variant, medians over repeats: output tokens/s,
    TTFT p50 (and multiturn, per turn number: TTFT p50, its ratio to turn 1's, and the
    cached prompt tokens). With peer rows, llama-server's best variant at that concurrency
    (the highest tokens/s) and every row's tokens/s and TTFT p50 over that variant's."""
    out: dict = {"levels": {}}
    for c in dict.fromkeys(r.concurrency for r in results):
        rows: dict[str, list[LevelResult]] = {}
        for r in results:
            if r.concurrency == c:
                rows.setdefault(row_name(r), []).append(r)
        level = {name: row_summary(runs) for name, runs in rows.items()}
        peers = {name: s for name, s in level.items() if rows[name][0].system == PEER}
        if peers:
            best = max(peers, key=lambda name: peers[name]["tokens_per_second"])
            for s in level.values():
                s["tokens_per_second_vs_peer_best"] = ratio(
                    s["tokens_per_second"], peers[best]["tokens_per_second"])
                s["ttft_p50_vs_peer_best"] = ratio(s["ttft_p50_ms"], peers[best]["ttft_p50_ms"])
            level["peer_best"] = best
        out["levels"][f"c{c}"] = level
    out["errors"] = sum(r.errors for r in results)
    out["lost"] = sum(r.lost for r in results)
    return out


def ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def row_summary(runs: list[LevelResult]) -> dict:
    median = lambda key: statistics.median(getattr(r, key) for r in runs)  # noqa: E731
    s = {"system": runs[0].system, "variant": runs[0].variant,
         "tokens_per_second": median("tokens_per_second"),
         "ttft_p50_ms": median("ttft_p50_ms"), "ttft_p90_ms": median("ttft_p90_ms"),
         "itl_p50_ms": median("itl_p50_ms"), "itl_p90_ms": median("itl_p90_ms"),
         "acceptance_rate": median("acceptance_rate"),
         "cached_tokens": median("cached_tokens"),
         "errors": sum(r.errors for r in runs), "lost": sum(r.lost for r in runs)}
    if any(r.constrained for r in runs):
        s["constrained"] = sum(r.constrained for r in runs)
        s["schema_valid"] = sum(r.schema_valid for r in runs)
    if runs[0].per_turn:
        turns = [t["turn"] for t in runs[0].per_turn]
        first = statistics.median(r.per_turn[0]["ttft_p50_ms"] for r in runs)
        s["turns"] = []
        for i, turn in enumerate(turns):
            ttft = statistics.median(r.per_turn[i]["ttft_p50_ms"] for r in runs)
            s["turns"].append({
                "turn": turn, "ttft_p50_ms": ttft, "ttft_p50_vs_turn_1": ratio(ttft, first),
                "cached_tokens": statistics.median(r.per_turn[i]["cached_tokens"] for r in runs)})
    return s


def write_comparison(results: list[LevelResult], out_dir: Path, meta: dict) -> dict:
    """``loadtest.json`` (meta, ``summarize_systems``, every run) and ``loadtest.png``:
    tokens/s and TTFT p50 against concurrency per row, and multiturn TTFT p50 per turn."""
    out_dir.mkdir(parents=True, exist_ok=True)
    data = {"meta": meta, "summary": summarize_systems(results),
            "levels": [asdict(r) for r in results]}
    (out_dir / "loadtest.json").write_text(json.dumps(data, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    multiturn = any(r.per_turn for r in results)
    fig, axes = plt.subplots(1, 3 if multiturn else 2, figsize=(15 if multiturn else 10, 3.8))
    levels = data["summary"]["levels"]
    names = list(dict.fromkeys(row_name(r) for r in results))
    for name in names:
        cs = [int(c[1:]) for c in levels if name in levels[c]]
        style = "--" if name.startswith(PEER) else "-"
        for ax, key in zip(axes, ("tokens_per_second", "ttft_p50_ms"), strict=False):
            ax.plot(cs, [levels[f"c{c}"][name][key] for c in cs], style, marker="o",
                    label=name)
        if multiturn:
            c = cs[-1]  # the highest concurrency
            turns = levels[f"c{c}"][name].get("turns", [])
            axes[2].plot([t["turn"] for t in turns], [t["ttft_p50_ms"] for t in turns], style,
                         marker="o", label=f"{name} (c={c})")
    concurrencies = sorted({r.concurrency for r in results})
    for ax in axes[:2]:
        ax.set_xticks(concurrencies)
    axes[0].set(xlabel="concurrent streams", ylabel="output tokens/s", title="throughput")
    axes[1].set(xlabel="concurrent streams", ylabel="ms", title="TTFT p50", yscale="log")
    if multiturn:
        axes[2].set(xlabel="turn", ylabel="ms", title="TTFT p50 per turn", yscale="log")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "loadtest.png", dpi=110)
    plt.close(fig)
    return data


def print_comparison(results: list[LevelResult], summary: dict) -> None:
    """Every run, then per concurrency the medians with the ratios to llama-server's best."""
    print(f"{'system':>12s} {'variant':>16s} {'rep':>3s} {'conc':>4s} {'req':>4s} "
          f"{'err':>3s} {'lost':>4s} {'tok/s':>7s} {'TTFT p50':>9s} {'p90':>7s} "
          f"{'ITL p50':>8s} {'p90':>7s} {'accept':>6s} {'cached':>7s}")
    for r in results:
        print(f"{r.system:>12s} {r.variant:>16s} {r.repeat + 1:3d} {r.concurrency:4d} "
              f"{r.requests:4d} {r.errors:3d} {r.lost:4d} {r.tokens_per_second:7.1f} "
              f"{r.ttft_p50_ms:7.0f}ms {r.ttft_p90_ms:5.0f}ms {r.itl_p50_ms:6.1f}ms "
              f"{r.itl_p90_ms:5.1f}ms {r.acceptance_rate:6.2f} {r.cached_tokens:7d}")
    for e in sorted({m for r in results for m in r.error_messages})[:5]:
        print(f"  {e}")
    for c, level in summary["levels"].items():
        best = level.get("peer_best")
        print(f"\n{c}: medians over repeats" + (f"; vs {best}" if best else ""))
        for name, s in level.items():
            if name == "peer_best":
                continue
            vs = (f"  tok/s {s['tokens_per_second_vs_peer_best'] or 0:.2f}x  TTFT "
                  f"{s['ttft_p50_vs_peer_best'] or 0:.2f}x") if best else ""
            valid = (f"  schema-valid {s['schema_valid']}/{s['constrained']}"
                     if "constrained" in s else "")
            print(f"  {name:>30s} {s['tokens_per_second']:7.1f} tok/s  TTFT p50 "
                  f"{s['ttft_p50_ms']:6.0f}ms{vs}{valid}")
            for t in s.get("turns", []):
                print(f"  {'':>30s}   turn {t['turn']}: TTFT p50 {t['ttft_p50_ms']:6.0f}ms "
                      f"({t['ttft_p50_vs_turn_1'] or 0:.2f}x turn 1), cached "
                      f"{t['cached_tokens']:.0f} tokens")
