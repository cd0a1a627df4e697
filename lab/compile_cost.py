"""Captured steps against eager ones, for models of a real checkpoint's shape with random
weights: per model shape and batch size, a plain decoding step eager and compiled
(``runtime/compiled.py``: CUDA graphs on a GPU), the verify pass of K + 1 positions in plain
steps, and tokens/s of speculative decoding (n-gram lookup, greedy) against plain decoding,
both compiled. The GPU step of ``scripts/gpu_check.sh``.

Random weights fix the cost, not the acceptance: the lookup's acceptance on a random
model's (often repetitive) greedy text is printed beside its tokens/s and says nothing of a
real model's. ``--budget-s`` bounds the run: a block (one model shape, one batch size) that
would start past it is listed as skipped, so the script fits a lent GPU's time.

    python lab/compile_cost.py --device cuda --out results/compile_cost.json
    python lab/compile_cost.py --device cpu --tiny       # a smoke check of the script
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
from verify_cost import SMOLLM2, timed

from paradraft.runtime.compiled import Shapes, compile_model
from paradraft.runtime.correction import RuleParams
from paradraft.runtime.drafters import Drafter
from paradraft.runtime.model import KVCache, ModelConfig, Transformer, new_kv_cache
from paradraft.runtime.speculative import SpeculativeDecoder

# Qwen2.5-1.5B-Instruct's config.json (the math fields)
QWEN25_1_5B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
               "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
               "num_attention_heads": 12, "num_key_value_heads": 2, "hidden_act": "silu",
               "rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "vocab_size": 151936,
               "tie_word_embeddings": True, "rope_theta": 1000000.0,
               "use_sliding_window": False}
TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 256, "max_position_embeddings": 1024}


def random_model(hf: dict, device: torch.device, dtype: torch.dtype) -> Transformer:
    with torch.device(device):
        model = Transformer(ModelConfig.from_hf(hf))
    return model.to(dtype).eval().requires_grad_(False)


def step_seconds(forward: Callable[..., tuple], model: Transformer, batch: int, width: int,
                 context: int, cache: KVCache, device: torch.device, repeats: int) -> float:
    """Median seconds of one call of ``width`` positions per row after ``context`` cached
    ones, as the decoder makes it (its attention bound, rows 0..B-1)."""
    vocab = model.config.vocab_size
    tokens = torch.randint(0, vocab, (batch, width), device=device)
    pos = context + torch.arange(width, device=device).expand(batch, -1)
    bound = context + width + 1
    return timed(lambda: forward(tokens, pos, cache, kv_len=bound), device, repeats)


def decode_tokens_per_second(model: Transformer, batch: int, slots: int, k: int,
                             prompt_len: int, new_tokens: int, seed: int = 0) -> dict:
    """Tokens/s of greedy plain decoding and of n-gram speculation with K = ``k``, both
    through the decoder on the (compiled) ``model``, ``batch`` rows in ``slots`` slots; one
    untimed run first (a new cache is captured anew)."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=g)
    out = {}
    for name, drafter in (("plain", None), ("ngram", Drafter("ngram"))):
        # the same cache shape for both (plain decoding's margin is 2, not 2K + 2): the
        # shapes compiled for the step timings, no new compile
        max_seq_len = prompt_len + new_tokens + (2 * k if drafter is None else 0)
        dec = SpeculativeDecoder(model, drafter, RuleParams("greedy"), k=k,
                                 max_batch_size=slots, max_seq_len=max_seq_len)
        dec.generate(prompts.tolist(), new_tokens)
        sync(model.device)
        t0 = time.perf_counter()
        result = dec.generate(prompts.tolist(), new_tokens)
        sync(model.device)
        seconds = time.perf_counter() - t0
        out[name] = {"tokens_per_s": sum(map(len, result.token_ids)) / seconds,
                     "acceptance": result.stats.acceptance_rate}
    out["speculative_vs_plain"] = out["ngram"]["tokens_per_s"] / out["plain"]["tokens_per_s"]
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def graph_counters() -> dict:
    """Inductor's CUDA graph counters (a skipped graph says why: a mutated input, a CPU
    tensor, ...)."""
    from torch._dynamo.utils import counters

    return {k: v for k, v in counters["inductor"].items() if "cudagraph" in k}


def prepare(hf: dict, args: argparse.Namespace, slots: int) -> tuple[Transformer, KVCache]:
    """A random model, compiled at every (batch size, width 1 or K + 1), and its cache: one
    shape for the step timings and the decode runs (every slot, the decoders' length), so
    nothing compiles twice."""
    device, dtype, k = torch.device(args.device), getattr(torch, args.dtype), args.k
    torch.manual_seed(0)
    model = random_model(hf, device, dtype)
    cache = new_kv_cache(model.config, slots, args.context + args.new_tokens + 2 * k + 2,
                         dtype, device)
    sizes = tuple(int(b) for b in args.batch_sizes.split(","))
    compile_model(model, k=k, mode=args.mode, unit=args.unit, shapes=Shapes(sizes, (1, k + 1)))
    return model, cache


def measure(model: Transformer, cache: KVCache, batch: int, args: argparse.Namespace) -> dict:
    """One block: compile (+ capture) time, the plain step and the verify pass eager and
    compiled, and the decode runs."""
    device, k, context = model.device, args.k, args.context
    row: dict = {}
    eager = model.forward.eager
    with torch.no_grad():
        t0 = time.perf_counter()
        for width in (1, k + 1):  # the first calls compile and capture: timed apart
            step_seconds(model, model, batch, width, context, cache, device, 1)
        row["compile_s"] = time.perf_counter() - t0
        seconds = {(kind, w): step_seconds(fn, model, batch, w, context, cache, device,
                                           args.repeats)
                   for kind, fn in (("eager", eager), ("compiled", model)) for w in (1, k + 1)}
        for kind in ("eager", "compiled"):
            row[f"{kind}_step_ms"] = seconds[kind, 1] * 1e3
            row[f"{kind}_verify_ms"] = seconds[kind, k + 1] * 1e3
            row[f"{kind}_verify_vs_plain_step"] = seconds[kind, k + 1] / seconds[kind, 1]
        row["step_speedup"] = seconds["eager", 1] / seconds["compiled", 1]
        row["decode"] = decode_tokens_per_second(model, batch, cache.num_slots, k, context,
                                                 args.new_tokens)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--mode", default="auto", help="torch.compile mode (compiled.COMPILE_MODES)")
    p.add_argument("--unit", default="auto", help="model or layer (compiled.CompiledForward)")
    p.add_argument("--batch-sizes", default=None,
                   help="in the order measured; default 1,32,8 (--tiny: 1,2)")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--context", type=int, default=256,
                   help="tokens in the cache when a step is timed; the decode runs' prompt")
    p.add_argument("--new-tokens", type=int, default=128, help="per row in the decode runs")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--tiny", action="store_true",
                   help="one tiny model shape, short runs: a smoke check (e.g. on the CPU)")
    p.add_argument("--budget-s", type=float, default=300.0,
                   help="start no block past this many seconds")
    p.add_argument("--out", type=Path, default=Path("results/compile_cost.json"))
    args = p.parse_args()
    shapes = {"smollm2-135m": SMOLLM2, "qwen2.5-1.5b": QWEN25_1_5B}
    if args.tiny:
        shapes = {"tiny": TINY}
        args.context, args.new_tokens, args.repeats = 16, 16, 3
    args.batch_sizes = args.batch_sizes or ("1,2" if args.tiny else "1,32,8")
    deadline = time.monotonic() + args.budget_s
    device = torch.device(args.device)
    meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "dtype": args.dtype, "torch": torch.__version__, "mode": args.mode,
            "unit": args.unit, "context": args.context, "new_tokens": args.new_tokens,
            "configs": shapes}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []

    def write(row: dict) -> None:  # after every block: a stopped run keeps what it measured
        rows.append(row)
        print(json.dumps(row), flush=True)
        args.out.write_text(json.dumps({**meta, "cuda_graph_counters": graph_counters(),
                                        "rows": rows}, indent=2))

    sizes = [int(b) for b in args.batch_sizes.split(",")]
    models = {name: prepare(hf, args, max(sizes)) for name, hf in shapes.items()}
    # blocks in the order of --batch-sizes (the targets first: 1, then 32), each
    # model shape in turn, so a run cut short by the budget still has them
    for batch in sizes:
        for name, (model, cache) in models.items():
            row = {"model": name, "batch_size": batch, "k": args.k}
            if time.monotonic() > deadline:
                write({**row, "skipped": "past --budget-s"})
                continue
            write({**row, **measure(model, cache, batch, args)})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
