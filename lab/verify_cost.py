"""The cost of a verify pass against a plain decoding step, for a model of a real checkpoint's
shape: seconds per forward of K + 1 positions over seconds per forward of one position, at a
few batch sizes, with the decoder's own model code (torch eager) on a CPU or a GPU.

Weights are random (the shape alone sets the cost), so it runs where the checkpoint cannot be
taken, e.g. on a GPU host without the GGUF: ``--config`` is the config.json that
``paradraft import`` writes; SMOLLM2 below is that file for SmolLM2-135M-Instruct.

    python lab/verify_cost.py --device cuda --dtype bfloat16 --out verify_cost.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from paradraft.runtime.model import ModelConfig, Transformer, new_kv_cache

SMOLLM2 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
           "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
           "num_key_value_heads": 3, "head_dim": 64, "hidden_act": "silu",
           "rms_norm_eps": 1e-5, "max_position_embeddings": 8192, "vocab_size": 49152,
           "tie_word_embeddings": True, "rope_theta": 100000.0}


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` calls after two warm-ups."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=None, help="config.json (default: SmolLM2)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--ks", default="1,2,4,8")
    p.add_argument("--context", type=int, default=256, help="tokens already in the cache")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", type=Path, default=Path("results/verify_cost.json"))
    args = p.parse_args()
    hf = json.loads(args.config.read_text()) if args.config else SMOLLM2
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.manual_seed(0)
    with torch.device(device):
        model = Transformer(ModelConfig.from_hf(hf)).to(dtype).eval()
    ks = [int(k) for k in args.ks.split(",")]
    rows = []
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        cache = new_kv_cache(model.config, batch, args.context + max(ks) + 2, dtype, device)
        seconds = {}
        for width in (1, *(k + 1 for k in ks)):
            tokens = torch.randint(0, hf["vocab_size"], (batch, width), device=device)
            pos = args.context + torch.arange(width, device=device).expand(batch, -1)
            with torch.no_grad():
                seconds[width] = timed(lambda t=tokens, q=pos, c=cache: model(t, q, c),
                                       device, args.repeats)
        for k in ks:
            rows.append({"batch_size": batch, "k": k, "step_ms": seconds[1] * 1e3,
                         "verify_ms": seconds[k + 1] * 1e3,
                         "verify_vs_plain_step": seconds[k + 1] / seconds[1]})
            print(json.dumps(rows[-1]), flush=True)
    device_name = (torch.cuda.get_device_name(device) if device.type == "cuda"
                   else "cpu")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"device": device_name, "dtype": args.dtype,
                                    "torch": torch.__version__, "context": args.context,
                                    "config": hf, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
