"""``bench --peer openvino``: OpenVINO GenAI, the CPU runtime a user would pick instead of us,
in the same run as our rows.

The same HF checkpoints are exported with optimum-intel (``optimum-cli export openvino``, from
the local dirs) in each precision asked, and run by ``openvino_genai.LLMPipeline``: plain, and
with the same draft model and K (``draft_model``); batch > 1 through its continuous batching
(``SchedulerConfig``). The rows join the bench plan, so they run warm and interleaved with ours,
on the same prompts and token counts. Greedy agreement with our fp32 verifier is checked per row.

OpenVINO is an optional extra, never a dependency: optimum-intel pins a transformers release the
project's environment does not use, so the peer runs in an interpreter of its own
(``openvino_worker.py`` as a subprocess), e.g. a venv made with
``pip install openvino==2026.4.1 openvino-genai==2026.4.1.0 openvino-tokenizers==2026.4.1.0
optimum-intel==2.2.0 nncf==3.4.0 torch==2.13.0`` (then ``pip uninstall torchvision``: the
release optimum-intel pulls in does not import with torch 2.13).
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from .bench import BenchRow

WORKER = Path(__file__).with_name("openvino_worker.py")
PIP = ("openvino==2026.4.1 openvino-genai==2026.4.1.0 openvino-tokenizers==2026.4.1.0 "
       "optimum-intel==2.2.0 nncf==3.4.0")
# precision → (optimum-cli export options, OpenVINO properties). "fp32": fp32 weights, math
# and KV cache (equal to our fp32 engines); "default": what `optimum-cli export openvino` and
# the CPU plugin give a new user (fp16-compressed weights, the CPU's default inference and KV
# cache precisions); int4 in groups of 32 input features, as our --weights int4 (NNCF's
# default group of 128 does not divide a hidden size of 576 and the export fails)
PRECISIONS: dict[str, tuple[list[str], dict]] = {
    "fp32": (["--weight-format", "fp32"],
             {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"}),
    "default": ([], {}),
    "int8": (["--weight-format", "int8"], {}),
    "int4": (["--weight-format", "int4", "--group-size", "32"], {}),
}


class PeerError(RuntimeError):
    """The OpenVINO side failed: the message says which request and why."""


@dataclass
class OpenVinoPeer:
    """The OpenVINO GenAI process and the models it runs. ``python``: the interpreter with
    openvino-genai and optimum-intel; ``cache_dir``: where exports are kept (one per checkpoint
    and precision, reused); ``threads``: OpenVINO's inference threads (ours: the same count)."""

    python: str
    verifier: Path
    draft: Path | None
    precisions: tuple[str, ...]
    cache_dir: Path
    threads: int
    proc: subprocess.Popen | None = None
    loaded: set = field(default_factory=set)
    outputs: dict = field(default_factory=dict)  # row label → the last repeat's tokens

    def __post_init__(self):
        unknown = [p for p in self.precisions if p not in PRECISIONS]
        if unknown or not self.precisions:
            raise ValueError(f"openvino precisions must be a non-empty list of "
                             f"{', '.join(PRECISIONS)}; got {', '.join(unknown) or 'none'}")
        check = subprocess.run([self.python, "-c", "import openvino_genai, optimum.intel"],
                               capture_output=True, text=True)
        if check.returncode:
            raise PeerError(f"--peer openvino: {self.python} cannot import openvino_genai and "
                            f"optimum.intel ({check.stderr.strip().splitlines()[-1:]}); "
                            f"install them in an environment of their own: pip install {PIP}, "
                            "and pass its python as --openvino-python")

    def export(self, checkpoint: Path, precision: str) -> Path:
        """``checkpoint`` exported in ``precision`` (cached under ``cache_dir``)."""
        options, _ = PRECISIONS[precision]
        out = self.cache_dir / f"{checkpoint.resolve().name}-{precision}"
        if (out / "openvino_model.xml").is_file():
            return out
        argv = [self.python, "-m", "optimum.commands.optimum_cli", "export", "openvino",
                "--model", str(checkpoint), "--task", "text-generation-with-past", *options]
        done = subprocess.run([*argv, str(out)], capture_output=True, text=True,
                              env={**os.environ, "HF_HUB_OFFLINE": "1"})
        if done.returncode or not (out / "openvino_model.xml").is_file():
            raise PeerError(f"optimum-cli export of {checkpoint} ({precision}) failed: "
                            f"{done.stderr.strip()[-2000:]}")
        return out

    def call(self, request: dict) -> dict:
        if self.proc is None:
            self.proc = subprocess.Popen([self.python, str(WORKER)], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True)
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise PeerError(f"the OpenVINO worker exited during {request['cmd']} "
                            f"{request.get('key')}")
        reply = json.loads(line)
        if "error" in reply:
            raise PeerError(f"OpenVINO {request['cmd']} {request.get('key')}: {reply['error']}")
        return reply

    def plan(self, batch_sizes: list[int], ks: list[int]) -> list[BenchRow]:
        """Per precision and batch size: plain decoding, and with the draft model at each K
        of the batch-1 sweep (K <= 4 at larger batches, as our rows)."""
        rows = []
        k_default = 4 if 4 in ks else ks[len(ks) // 2]
        for bs in batch_sizes:
            for p in self.precisions:
                rows.append(BenchRow("openvino", f"generate-{p}", "greedy", 0, bs, False))
                if self.draft is not None:
                    sweep = ks if bs == batch_sizes[0] else [k for k in ks if k <= k_default]
                    rows += [BenchRow("openvino", f"speculative-{p}", "greedy", k, bs, False)
                             for k in sweep]
        return rows

    def key(self, row: BenchRow) -> str:
        """The pipeline of ``row``: speculative rows share one per precision (K is a
        generation setting); batch > 1 runs on the continuous-batching pipeline."""
        kind, precision = row.variant.split("-", 1)
        return f"{kind}-{precision}-{'cb' if row.batch_size > 1 else 'b1'}"

    def run(self, row: BenchRow, prompts: list[list[int]], max_new_tokens: int,
            eos_token_id: int | tuple[int, ...] | None = None) -> BenchRow:
        """Decode ``prompts`` in batches of ``row.batch_size`` (after one warm-up call), each
        to ``max_new_tokens`` or an id of ``eos_token_id`` (None: exactly max_new_tokens)."""
        eos = None if eos_token_id is None else sorted(
            {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id))
        key = self.key(row)
        kind, precision = row.variant.split("-", 1)
        if key not in self.loaded:
            _, config = PRECISIONS[precision]
            request = {"cmd": "load", "key": key, "config": {
                **config, "INFERENCE_NUM_THREADS": self.threads},
                "model": str(self.export(self.verifier, precision))}
            if kind == "speculative":
                request["draft"] = str(self.export(self.draft, precision))
            if row.batch_size > 1:  # continuous batching (the stateful pipeline: one prompt)
                request["scheduler"] = {"max_num_seqs": row.batch_size, "cache_size": 1}
            self.call(request)
            self.loaded.add(key)
            self.call({"cmd": "generate", "key": key, "prompts": prompts[:row.batch_size],
                       "max_new_tokens": 4, "k": row.k})
        outputs = []
        for i in range(0, len(prompts), row.batch_size):
            reply = self.call({"cmd": "generate", "key": key, "max_new_tokens": max_new_tokens,
                               "prompts": prompts[i: i + row.batch_size], "k": row.k,
                               "eos": eos})
            row.seconds += reply["seconds"]
            row.tokens += sum(len(t) for t in reply["tokens"])
            outputs += reply["tokens"]
        self.outputs[label(row)] = (prompts, outputs)
        return row

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
            self.proc = None


def label(row: BenchRow) -> str:
    return f"{row.variant} k={row.k} bs={row.batch_size}"


def compare(rows: list[BenchRow], peer: OpenVinoPeer,
            reference: dict[tuple[int, ...], list[int]]) -> dict:
    """Per batch size: our fastest greedy row (any drafter, K or K policy, fused mode) against
    OpenVINO's fastest row (any precision, plain or speculative), each as a median of
    per-repeat tokens/s; and per OpenVINO row its greedy agreement with ``reference`` ({prompt:
    our fp32 verifier's greedy continuation}, cut where the rows stop)."""
    from .bench import median_ratio
    from .evaluate import prefix_agreement

    out: dict = {"rows": {}}
    for r in rows:
        if r.system == "openvino" and label(r) in peer.outputs:
            prompts, got = peer.outputs[label(r)]
            agreement, identical = prefix_agreement(got, [reference[tuple(p)] for p in prompts])
            out["rows"][label(r)] = {"tokens_per_second": r.tokens_per_second,
                                     "greedy_agreement": agreement,
                                     "identical_sequences": identical}
    for bs in sorted({r.batch_size for r in rows}):
        ours = [r for r in rows if r.system == "ours" and r.batch_size == bs and not r.sampling]
        theirs = [r for r in rows if r.system == "openvino" and r.batch_size == bs]
        if not ours or not theirs:
            continue
        best = max(ours, key=lambda r: r.tokens_per_second)
        peer_best = max(theirs, key=lambda r: r.tokens_per_second)
        out[f"batch_{bs}"] = {
            "ours": f"{best.backend} {best.variant} k={best.k} ({best.schedule}) "
                    f"fused={best.fused_correction}",
            "ours_tokens_per_second": best.tokens_per_second,
            "openvino": label(peer_best),
            "openvino_tokens_per_second": peer_best.tokens_per_second,
            "ratio": median_ratio(best, peer_best)}
    return out
