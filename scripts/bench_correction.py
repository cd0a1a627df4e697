"""Benchmark: the vectorised correction rules against the seed's per-row reference loop.

Runs both side by side in one process at B=64, K=8, V=32000 (defaults), checks that they
accept the same number of tokens, and puts the correction time next to one verifier step
(a Llama-shaped model over K+1 positions) so its share of a round is visible. Writes JSON.

    python scripts/bench_correction.py --out out/bench_correction.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch

from paradraft.runtime.correction import RuleParams, correct, draw_randoms
from paradraft.runtime.model import ModelConfig, Transformer, new_kv_cache


def seed_loop(logits: torch.Tensor, drafts: torch.Tensor, params: RuleParams) -> list[int]:
    """The seed's pseudo-code: a Python loop over rows and positions with .item() calls
    (acceptance only; the correction sample is drawn the same way for every rule)."""
    probs = torch.softmax(logits, dim=-1)
    accepted = []
    for b in range(drafts.shape[0]):
        n = 0
        for i in range(drafts.shape[1]):
            token = drafts[b, i].item()
            p = probs[b, i]
            p_draft = p[token].item()
            if params.rule == "greedy":
                ok = token == p.argmax().item()
            elif params.rule == "threshold":
                ok = p_draft > params.tau
            elif params.rule == "ratio":
                alt = p.clone()
                alt[token] = 0
                ok = p_draft / alt.max().item() >= params.gamma
            else:  # dynamic
                h = -(p * torch.log(p + 1e-10)).sum().item()
                ok = p_draft > params.tau * (1 + params.alpha * h)
            if not ok:
                break
            n += 1
        if n < drafts.shape[1]:  # correction sample at the rejection point (seed: multinomial)
            torch.multinomial(torch.softmax(logits[b, n] / params.temperature, -1), 1).item()
        accepted.append(n)
    return accepted


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="out/bench_correction.json")
    args = ap.parse_args()
    B, K, V = args.batch, args.k, args.vocab
    torch.manual_seed(0)
    # peaked verifier logits and drafts that mostly match them, so rows stop at mixed places
    logits = torch.randn(B, K + 1, V) * 2
    logits[:, :, :8] += 6
    drafts = logits[:, :K].argmax(-1)
    flip = torch.rand(B, K) < 0.15
    drafts = torch.where(flip, torch.randint(0, V, (B, K)), drafts)

    rows = []
    for params in [RuleParams("greedy"), RuleParams("threshold", tau=0.1),
                   RuleParams("ratio", gamma=0.5), RuleParams("dynamic", tau=0.05, alpha=0.1)]:
        gen = torch.Generator().manual_seed(0)
        randoms = draw_randoms(B, K, V, gen)
        n_vec, _ = correct(logits, drafts, None, params, randoms)
        n_loop = seed_loop(logits, drafts, params)
        assert n_vec.tolist() == n_loop, f"{params.rule}: vectorised and loop disagree"
        t_vec = timed(lambda p=params, r=randoms: correct(logits, drafts, None, p, r),
                      args.repeats)
        t_loop = timed(lambda p=params: seed_loop(logits, drafts, p), args.repeats)
        rows.append({"rule": params.rule, "vectorised_ms": t_vec * 1e3,
                     "seed_loop_ms": t_loop * 1e3, "speedup": t_loop / t_vec,
                     "mean_accepted": float(n_vec.float().mean())})
    # rules without a seed loop: time only
    q = torch.softmax(torch.randn(B, K, V), -1)
    for params, dp in [(RuleParams("exact", temperature=0.8), q),
                       (RuleParams("exact", temperature=0.8, top_p=0.9), q),
                       (RuleParams("typical"), None)]:
        randoms = draw_randoms(B, K, V, torch.Generator().manual_seed(0))
        t_vec = timed(lambda p=params, r=randoms, d=dp: correct(logits, drafts, d, p, r),
                      args.repeats)
        name = params.rule + ("+top_p" if params.top_p < 1 else "")
        rows.append({"rule": name, "vectorised_ms": t_vec * 1e3})

    # one verifier step over K+1 positions for the same batch (Llama-shaped, random weights)
    config = ModelConfig(model_type="llama", vocab_size=V, dim=512, n_layers=8, n_heads=8,
                         n_kv_heads=4, head_dim=64, intermediate_size=1408, norm_eps=1e-5,
                         max_position_embeddings=1024)
    with torch.device("cpu"):
        model = Transformer(config).eval()
    cache = new_kv_cache(config, B, 256, torch.float32)
    ctx = 128
    tokens = torch.randint(0, V, (B, K + 1))
    pos = ctx + torch.arange(K + 1).expand(B, -1)
    with torch.no_grad():
        t_verify = timed(lambda: model(tokens, pos, cache, kv_len=ctx + K + 1), args.repeats)
    params_m = sum(p.numel() for p in model.parameters())
    for r in rows:
        r["share_of_verifier_step"] = r["vectorised_ms"] / (t_verify * 1e3)
    result = {"batch": B, "k": K, "vocab": V, "torch_threads": torch.get_num_threads(),
              "verifier": {"params_m": params_m / 1e6, "step_ms": t_verify * 1e3,
                           "context": ctx},
              "rules": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"B={B} K={K} V={V}; verifier step ({params_m / 1e6:.0f}M params, {K + 1} tokens/row):"
          f" {t_verify * 1e3:.1f} ms")
    print(f"{'rule':14s} {'vectorised ms':>14s} {'seed loop ms':>13s} {'speed-up':>9s} "
          f"{'share of verify':>16s}")
    for r in rows:
        loop = f"{r['seed_loop_ms']:13.1f}" if "seed_loop_ms" in r else f"{'-':>13s}"
        sp = f"{r['speedup']:8.0f}x" if "speedup" in r else f"{'-':>9s}"
        share = r["share_of_verifier_step"]
        print(f"{r['rule']:14s} {r['vectorised_ms']:14.2f} {loop} {sp} {share:15.1%}")
    assert not math.isnan(t_verify)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
