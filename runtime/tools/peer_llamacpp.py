"""``bench --peer llamacpp``: llama.cpp's own programs on the same GGUF files, prompts, threads
and token budget, in the same run as our rows.

The peer is what a CPU user runs today: ``llama-completion`` for plain decoding and
``llama-speculative-simple`` for llama.cpp's speculation (``draft-simple`` with the draft
model, and the n-gram modes ``ngram-simple`` and ``ngram-mod``), greedy, batch 1. They are
built once into the cache from the sources vendored in the pinned ``llama-cpp-python`` sdist
(the same llama.cpp our llamacpp backend links), so both sides run the same kernels. Their
own timing lines are parsed: prompt and decode seconds, tokens decoded. ``loadtest --peer
llama-server`` builds ``llama-server`` the same way (``build_tools(tools=(SERVER,))``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ..backends.llamacpp import NO_AMX_FLAGS
from ..gguf import cache_root
from .bench import BenchRow, median_ratio

VERSION = "0.3.36"  # llama-cpp-python, as the [llamacpp] extra pins it
TOOLS = ("llama-completion", "llama-speculative-simple")
SERVER = "llama-server"  # loadtest --peer llama-server
NGRAM_MODES = ("ngram-simple", "ngram-mod")
# static: the programs are copied out of the build dir, with no shared library to find;
# without AMX, as our backend's build (NO_AMX_FLAGS says why): both run the same kernels
CMAKE = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF",
         "-DLLAMA_BUILD_TESTS=OFF",
         "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
         f"-DCMAKE_C_FLAGS={NO_AMX_FLAGS}", f"-DCMAKE_CXX_FLAGS={NO_AMX_FLAGS}"]
# the server's web UI would otherwise be downloaded (a prebuilt bundle) or built with npm at
# build time; without it the server embeds no UI, and its HTTP API is all a load test uses
SERVER_CMAKE = [f for f in CMAKE if f != "-DLLAMA_BUILD_SERVER=OFF"] + [
    "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_UI=OFF"]


class PeerError(RuntimeError):
    """A llama.cpp program failed: the message names it and its last output."""


def tools_dir() -> Path:
    return cache_root() / f"llama.cpp-{VERSION}-noamx" / "bin"


def cmake_flags(tools: tuple[str, ...]) -> list[str]:
    return SERVER_CMAKE if SERVER in tools else CMAKE


def build_tools(dest: Path | None = None, tools: tuple[str, ...] = TOOLS) -> Path:
    """Compile ``tools`` (cmake targets) from the llama-cpp-python sdist into ``dest`` (once;
    minutes)."""
    dest = dest or tools_dir()
    if all((dest / t).is_file() for t in tools):
        return dest
    print(f"paradraft: building llama.cpp's {', '.join(tools)} (llama-cpp-python {VERSION} "
          f"sdist) into {dest}: a few minutes, once", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="llama-tools-") as tmp:
        tmp = Path(tmp)
        run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary",
             ":all:", f"llama-cpp-python=={VERSION}", "-d", str(tmp)], "pip download")
        with tarfile.open(next(tmp.glob("llama_cpp_python-*.tar.gz"))) as tar:
            tar.extractall(tmp, filter="data")
        src = next(tmp.glob("llama_cpp_python-*")) / "vendor" / "llama.cpp"
        run(["cmake", "-S", str(src), "-B", str(tmp / "build"), *cmake_flags(tools)],
            "cmake configure")
        # one job a core: a bare -j is make's unbounded parallelism, a compiler per file
        run(["cmake", "--build", str(tmp / "build"), "-j", str(os.cpu_count() or 1),
             "--target", *tools], "cmake build")
        dest.mkdir(parents=True, exist_ok=True)
        for t in tools:
            shutil.copy2(tmp / "build" / "bin" / t, dest / t)
    return dest


def run(argv: list[str], what: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode:
        raise PeerError(f"{what} failed ({done.returncode}): "
                        f"{(done.stderr or done.stdout).strip()[-1500:]}")
    return done.stdout + done.stderr


def parse_timings(log: str, speculative: bool) -> tuple[int, float, float]:
    """(tokens generated, prompt seconds, decode seconds) from a program's log."""
    if speculative:  # "encoded  168 tokens in 1.8 seconds", "decoded  113 tokens in 2.1 ..."
        enc = re.search(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds", log)
        dec = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", log)
        if not enc or not dec:
            raise PeerError(f"llama-speculative-simple printed no timings: {log[-1500:]}")
        return int(dec.group(1)), float(enc.group(2)), float(dec.group(2))
    prompt = re.search(r"prompt eval time =\s+([\d.]+) ms", log)
    decode = re.search(r"\beval time =\s+([\d.]+) ms /\s+(\d+) runs", log.split(
        "prompt eval time")[-1])
    if not prompt or not decode:
        raise PeerError(f"llama-completion printed no timings: {log[-1500:]}")
    # the first token comes from the prompt's pass; each run after it decodes one
    return int(decode.group(2)) + 1, float(prompt.group(1)) / 1e3, float(decode.group(1)) / 1e3


@dataclass
class LlamaCppPeer:
    """llama.cpp's programs on ``verifier`` (and ``draft``) GGUF files; ``decode``: token ids
    → the text the programs tokenize again (the engine dir's tokenizer, special tokens kept)."""

    verifier: Path
    draft: Path | None
    threads: int
    decode: object
    tools: Path = field(default_factory=tools_dir)
    outputs: dict = field(default_factory=dict)

    def __post_init__(self):
        self.tools = build_tools(self.tools)

    def plan(self, batch_sizes: list[int], ks: list[int]) -> list[BenchRow]:
        """Batch 1 (the programs decode one sequence): plain, the draft model at each K, and
        each n-gram mode at each K."""
        if 1 not in batch_sizes:
            return []
        # backend: what ran them (llama.cpp's own programs), not the default "torch"
        rows = [BenchRow("llamacpp", "generate", "greedy", 0, 1, False, backend="llamacpp")]
        kinds = (["draft-simple"] if self.draft is not None else []) + list(NGRAM_MODES)
        return rows + [BenchRow("llamacpp", kind, "greedy", k, 1, False, backend="llamacpp")
                       for kind in kinds for k in ks]

    def argv(self, row: BenchRow, prompt_file: Path, max_new_tokens: int, stop: bool,
             schema: str | None = None) -> list[str]:
        """``schema``: a JSON schema the output follows (llama.cpp's own grammar sampler,
        ``--json-schema``)."""
        common = ["-m", str(self.verifier), "-f", str(prompt_file), "-n", str(max_new_tokens),
                  "-t", str(self.threads), "--temp", "0", "-c", "4096", "--seed", "0"]
        if not stop:
            common.append("--ignore-eos")
        if schema is not None:
            common += ["--json-schema", schema]
        if row.variant == "generate":
            return [str(self.tools / "llama-completion"), *common, "-no-cnv", "--no-warmup"]
        spec = ["--spec-type", row.variant, "--spec-draft-n-max", str(row.k)]
        if row.variant == "draft-simple":
            spec += ["-md", str(self.draft)]
        return [str(self.tools / "llama-speculative-simple"), *common, *spec]

    def run(self, row: BenchRow, prompts: list[list[int]], max_new_tokens: int,
            eos_token_id: int | tuple[int, ...] | None = None,
            guides: list | None = None) -> BenchRow:
        """Each prompt in its own run of the program (its load time not counted);
        ``guides``: each prompt's (grammar.Guide: a JSON schema, or any JSON object) or
        None."""
        with tempfile.TemporaryDirectory(prefix="llama-peer-") as tmp:
            for i, prompt in enumerate(prompts):
                f = Path(tmp) / f"prompt{i}.txt"
                f.write_text(self.decode(prompt), encoding="utf-8")
                guide = None if guides is None else guides[i]
                schema = None if guide is None else (
                    guide.text if guide.kind == "json_schema" else '{"type": "object"}')
                log = run(self.argv(row, f, max_new_tokens, eos_token_id is not None, schema),
                          f"llama.cpp {row.variant} k={row.k}")
                tokens, prompt_s, decode_s = parse_timings(log, row.variant != "generate")
                row.tokens += tokens
                row.seconds += prompt_s + decode_s
                row.decode_tokens += tokens - 1
                row.decode_seconds += decode_s
        return row

    def close(self) -> None:
        pass


def compare(rows: list[BenchRow]) -> dict:
    """Batch 1: our plain decoding against llama.cpp's, and our fastest greedy row against
    llama.cpp's fastest (plain or speculative), end to end and decode only (prefill out),
    each the median of per-repeat ratios."""
    ours = [r for r in rows if r.system == "ours" and r.batch_size == 1 and not r.sampling]
    theirs = [r for r in rows if r.system == "llamacpp"]
    if not ours or not theirs:
        return {}
    name = lambda r: f"{r.backend} {r.variant} k={r.k} ({r.schedule})"  # noqa: E731
    out = {}
    for metric, field_name in (("end_to_end", "repeat_tokens_per_second"),
                               ("decode", "repeat_decode_tokens_per_second")):
        key = lambda r, f=field_name: sorted(getattr(r, f))[len(getattr(r, f)) // 2]  # noqa: E731
        base = next(r for r in ours if r.variant == "baseline")
        plain = next(r for r in theirs if r.variant == "generate")
        best, peer_best = max(ours, key=key), max(theirs, key=key)
        out[metric] = {
            "ours_plain_over_llamacpp_plain": median_ratio(base, plain, field_name),
            "ours_best": name(best), "ours_best_tokens_per_second": key(best),
            "llamacpp_best": f"{peer_best.variant} k={peer_best.k}",
            "llamacpp_best_tokens_per_second": key(peer_best),
            "ours_best_over_llamacpp_best": median_ratio(best, peer_best, field_name),
            "llamacpp_tokens_per_second": {f"{r.variant} k={r.k}": key(r) for r in theirs}}
    return out
