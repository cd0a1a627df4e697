"""``paradraft import``: a GGUF file (llama.cpp) as an HF-format checkpoint dir."""

from __future__ import annotations

import argparse
import json

from paradraft.runtime.gguf import import_gguf


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("import", help="write a GGUF file as an HF-format checkpoint dir "
                                      "(config, fp32 safetensors, tokenizer, chat template)")
    p.add_argument("gguf", help="the .gguf file")
    p.add_argument("--out", required=True, help="the checkpoint dir to write")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    out = import_gguf(args.gguf, args.out)
    config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    print(json.dumps({"out": str(out), "architectures": config["architectures"],
                      "num_hidden_layers": config["num_hidden_layers"],
                      "vocab_size": config["vocab_size"],
                      "files": sorted(p.name for p in out.iterdir())}, indent=2))
