"""A deeper copy of a verifier for cost experiments: the same tokens, more layers to run.

Appends as many layers again whose output and down projections are zero, so each adds
exactly nothing to the residual stream: greedy output and acceptance stay those of the
source model while every forward pass costs what a model of twice the depth costs. Writes
an HF-format dir (fp32, the source's tokenizer files) for ``paradraft build``.

    .venv/bin/python scripts/pad_verifier.py --out /tmp/pad8
    .venv/bin/paradraft build --backend onnx --verifier /tmp/pad8 --out /tmp/pad8_engines
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from paradraft.runtime.cli import DEMO_DIR


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--verifier", type=Path, default=DEMO_DIR / "verifier")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    weights = {k: v.float() for k, v in load_file(args.verifier / "model.safetensors").items()}
    config = json.loads((args.verifier / "config.json").read_text())
    if config.get("model_type") not in ("llama", "qwen2"):
        raise ValueError(f"verifier must be a Llama-family model (llama, qwen2: o_proj / "
                         f"down_proj weights); got model_type {config.get('model_type')!r}")
    n = config["num_hidden_layers"]
    g = torch.Generator().manual_seed(0)
    for i in range(n, 2 * n):
        for name, w in list(weights.items()):
            if not name.startswith("model.layers.0."):
                continue
            new = name.replace("model.layers.0.", f"model.layers.{i}.")
            if "o_proj" in name or "down_proj" in name:  # nothing reaches the residual
                weights[new] = torch.zeros_like(w)
            elif "norm" in name:
                weights[new] = torch.ones_like(w)
            else:
                weights[new] = torch.randn(w.shape, generator=g) * 0.02
    config.update(num_hidden_layers=2 * n, dtype="float32", torch_dtype="float32")
    args.out.mkdir(parents=True, exist_ok=True)
    save_file(weights, args.out / "model.safetensors")
    (args.out / "config.json").write_text(json.dumps(config, indent=2))
    for f in args.verifier.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json",
                                                         "generation_config.json"):
            shutil.copy(f, args.out / f.name)
    print(f"wrote {args.out}: {2 * n} layers, "
          f"{sum(w.numel() for w in weights.values()) / 1e6:.1f} M parameters")


if __name__ == "__main__":
    main()
