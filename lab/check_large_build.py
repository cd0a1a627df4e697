"""Slow check (not in CI): `paradraft build --backend onnx` of a model of a real size.

Writes a random-weight checkpoint with Llama-3.2-1B's dimensions (hidden 2048, 16 layers, 32
heads, 8 KV heads, intermediate 8192, vocab 128256, tied embeddings, rope llama3; bf16, ~2.5 GB)
and a small random draft with the same vocabulary, builds them with the CLI's default flags,
then loads the engine dir and decodes a few tokens with every drafter. Reports, as JSON (also
written to WORK/report.json): the build's wall time and peak memory (ru_maxrss of the build
process itself), the engine dir's size by file kind against the models' fp32 weights, and the
load's peak memory. Past 2 GB a graph needs ONNX external data; the graphs of one model share
its one weights file.

    .venv/bin/python lab/check_large_build.py [--work /tmp/paradraft_large] [--max-k 8]

About 25 GB of disk under --work; the build must stay within a 24 GiB machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parent.parent
LLAMA_3_2_1B = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 2048,
    "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
    "intermediate_size": 8192, "vocab_size": 128256, "tie_word_embeddings": True,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "hidden_act": "silu",
    "rope_theta": 500000.0, "bos_token_id": 128000, "eos_token_id": 128001,
    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "torch_dtype": "bfloat16",
}
DRAFT = {**LLAMA_3_2_1B, "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 1024}


def rope_note(config: dict) -> tuple[dict, str]:
    """``config`` as is if this checkout's model code takes its rope type, else with default
    rope (and a note saying so): the check is about size, not about the rope."""
    from paradraft.runtime.model import ModelConfig

    try:
        ModelConfig.from_hf(config)
        return config, f"rope {config['rope_scaling']['rope_type']}"
    except ValueError as e:
        if "rope" not in str(e):
            raise
        plain = {k: v for k, v in config.items() if k != "rope_scaling"}
        return plain, f"rope default (this checkout refuses llama3: {e})"


def write_checkpoint(path: Path, config: dict, seed: int) -> int:
    """A random bf16 checkpoint in HF layout, one safetensors shard per layer (so that this
    process never holds the whole model); returns its parameter count."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    g = torch.Generator().manual_seed(seed)
    D, F, H = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * H, config["num_key_value_heads"] * H

    def randn(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    count = 0

    def save(tensors: dict, name: str) -> None:
        nonlocal count
        count += sum(t.numel() for t in tensors.values())
        save_file(tensors, str(path / name), metadata={"format": "pt"})

    save({"model.embed_tokens.weight": randn(config["vocab_size"], D),
          "model.norm.weight": torch.ones(D, dtype=torch.bfloat16)}, "embed.safetensors")
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        save({p + "self_attn.q_proj.weight": randn(q, D), p + "self_attn.k_proj.weight":
              randn(kv, D), p + "self_attn.v_proj.weight": randn(kv, D),
              p + "self_attn.o_proj.weight": randn(D, q), p + "mlp.gate_proj.weight":
              randn(F, D), p + "mlp.up_proj.weight": randn(F, D), p + "mlp.down_proj.weight":
              randn(D, F), p + "input_layernorm.weight": torch.ones(D, dtype=torch.bfloat16),
              p + "post_attention_layernorm.weight": torch.ones(D, dtype=torch.bfloat16)},
             f"layer{i:02d}.safetensors")
    return count


def run_measured(cmd: list[str], log: Path) -> dict:
    """Run ``cmd`` (output to ``log``); its exit status, wall time and peak resident memory
    (ru_maxrss of that process and its children, from wait4)."""
    start = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return {"returncode": proc.returncode, "wall_s": round(time.perf_counter() - start, 1),
            "peak_rss_gib": round(usage.ru_maxrss / 2**20, 2)}  # ru_maxrss: KiB on Linux


LOAD_CHECK = """
import json, resource, sys, time
from paradraft.runtime.backends.loader import load_engines
from paradraft.runtime.correction import RuleParams
from paradraft.runtime.speculative import SpeculativeDecoder
start = time.perf_counter()
verifier, drafters, _, manifest = load_engines(sys.argv[1])
out = {"load_s": round(time.perf_counter() - start, 1)}
prompt = [[128000, 791, 4062, 14198, 39935]]
for kind, drafter in sorted(drafters.items()):
    start = time.perf_counter()
    dec = SpeculativeDecoder(verifier, drafter, RuleParams("greedy"), k=4, max_batch_size=1,
                             max_seq_len=64, acceptance_floor=0.0)
    got = dec.generate(prompt, 8)
    out[kind] = {"tokens": got.token_ids[0], "s": round(time.perf_counter() - start, 1)}
out["peak_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
print(json.dumps(out))
"""


def dir_sizes(engine_dir: Path) -> dict:
    kinds: dict[str, int] = {}
    for f in engine_dir.iterdir():
        kinds[f.suffix or f.name] = kinds.get(f.suffix or f.name, 0) + f.stat().st_size
    return {"total_gib": round(sum(kinds.values()) / 2**30, 3),
            **{k: round(v / 2**30, 3) for k, v in sorted(kinds.items())}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", default="/tmp/paradraft_large", type=Path)
    ap.add_argument("--max-k", type=int, default=8, help="the build's --max-k (its default: 8)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints and engines")
    args = ap.parse_args()
    work: Path = args.work
    shutil.rmtree(work, ignore_errors=True)
    verifier_config, note = rope_note(LLAMA_3_2_1B)
    draft_config, _ = rope_note(DRAFT)
    params = {"verifier": write_checkpoint(work / "verifier", verifier_config, 0),
              "draft": write_checkpoint(work / "draft", draft_config, 1)}
    # fp32 bytes as the graphs hold them: the tied LM head once more, transposed
    fp32 = {name: 4 * (n + cfg["vocab_size"] * cfg["hidden_size"]) for (name, n), cfg in
            zip(params.items(), (verifier_config, draft_config), strict=True)}
    engines = work / "engines"
    build = run_measured([sys.executable, "-m", "paradraft.cli", "build", "--backend", "onnx",
                          "--verifier", str(work / "verifier"), "--draft", str(work / "draft"),
                          "--out", str(engines), "--max-k", str(args.max_k)],
                         work / "build.log")
    report = {
        "what": "paradraft build --backend onnx, random Llama-3.2-1B dims + small draft",
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                                 capture_output=True, text=True).stdout.strip(),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
                                     / 2**30, 1)},
        "note": note, "max_k": args.max_k, "params": params,
        "fp32_weights_gib": {k: round(v / 2**30, 3) for k, v in fp32.items()},
        "build": build,
    }
    if build["returncode"] == 0:
        report["engine_dir"] = dir_sizes(engines)
        manifest = json.loads((engines / "manifest.json").read_text())
        report["precisions"] = {f"{name}/{role}": g["precision"] for name, m in
                                manifest["models"].items() for role, g in m["graphs"].items()}
        load = run_measured([sys.executable, "-c", LOAD_CHECK, str(engines)],
                            work / "load.log")
        report["load"] = load
        if load["returncode"] == 0:
            report["load"].update(json.loads((work / "load.log").read_text().splitlines()[-1]))
    else:
        report["build_log_tail"] = (work / "build.log").read_text()[-3000:]
    (work / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    if not args.keep:
        for name in ("verifier", "draft", "engines"):
            shutil.rmtree(work / name, ignore_errors=True)
    sys.exit(build["returncode"])


if __name__ == "__main__":
    main()
