"""Correction time as a share of a verify step, for every rule and for plain greedy decoding.

Each setting times the correction before and after issue 25 side by side in one process
(calls alternate, medians of ``--repeats``), checks that both make the same decisions, and
divides by the time of the verify step the correction follows:

- ``demo``: the demo pair's vocabulary (V from models/demo/verifier's config) at batch 1 and
  16 with K=4. The logits are the demo verifier's own over held-out text, drafts are drawn
  near them, and the verify step is one call of the ONNX engine in engines/demo (what runs on
  the CPU; ``--demo-verifier torch``: runtime.model's Transformer) over K+1 tokens per row.
  Plain decoding (K=0: greedy is an argmax of the last logits) is set against a one-token
  step.
- ``large``: B=64, K=8, V=32000 with synthetic logits (N(0, 2²), eight tokens raised by 6: a
  flat distribution whose top-p set holds thousands of tokens). The verify step is a Llama
  with TinyLlama-1.1B's dimensions (dim 2048, 22 layers, 32 heads, 4 KV heads, MLP 5632,
  V 32000, random weights) over K+1 tokens per row at context 128, timed with 1 and with 2
  layers and extrapolated linearly to 22 (LM head + norm + 22 × one layer), as whole steps at
  that batch are too slow to repeat on a small CPU. The share against the 56M-parameter
  Llama of the earlier figures (dim 512, 8 layers, V 32000, timed whole) is reported too.

Threads: the verify step runs on ``--threads`` (default 1), the correction on one thread
(SpeculativeDecoder.glue next to a CPU engine, top-p rounds included: top-p takes a few
histogram passes, not a sort). Writes JSON (default results/bench_correction.json) and prints
a table.

    .venv/bin/python lab/bench_correction.py [--only demo|large] [--repeats 21]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from torch import Tensor

from paradraft.runtime.correction import (
    Randoms,
    RuleParams,
    correct,
    draw_randoms,
)
from paradraft.runtime.model import (
    ModelConfig,
    Transformer,
    load_config,
    load_model,
    new_kv_cache,
)

REPO = Path(__file__).resolve().parent.parent


# -- the correction before issue 25, verbatim (for the side-by-side comparison only) --------


def _top_p_mask_before(probs: Tensor, top_p: float) -> Tensor:
    if top_p >= 1.0:
        return torch.ones_like(probs, dtype=torch.bool)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    keep_sorted = mass_before < top_p
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


def _sampling_probs_before(logits: Tensor, temperature: float, top_p: float) -> Tensor:
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        probs = probs * _top_p_mask_before(probs, top_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def _acceptance_mask_before(logits: Tensor, draft_tokens: Tensor, draft_probs: Tensor | None,
                            params: RuleParams, accept_uniforms: Tensor | None) -> Tensor:
    d = draft_tokens[..., None]
    if params.rule == "greedy":
        return logits.argmax(-1) == draft_tokens
    if params.rule == "exact":
        p_draft = _sampling_probs_before(logits, params.temperature, params.top_p).gather(
            -1, d)[..., 0]
        q_draft = 1.0 if draft_probs is None else draft_probs.gather(-1, d)[..., 0]
        return accept_uniforms * q_draft < p_draft
    x = logits.float()
    x_draft = x.gather(-1, d)[..., 0]
    if params.rule == "ratio":
        top2, top2_ids = x.topk(2, dim=-1)
        best_alt = torch.where(top2_ids[..., 0] == draft_tokens, top2[..., 1], top2[..., 0])
        return x_draft - best_alt >= math.log(params.gamma)
    lse = x.logsumexp(-1)
    p_draft = (x_draft - lse).exp()
    if params.rule == "threshold":
        return p_draft > params.tau
    probs = (x - lse[..., None]).exp()
    h = lse - torch.where(probs > 0, probs * x, 0.0).sum(-1)
    if params.rule == "dynamic":
        accept = p_draft > params.tau * (1.0 + params.alpha * h)
        if params.top_p_membership:
            accept &= _top_p_mask_before(probs, params.top_p).gather(-1, d)[..., 0]
        return accept
    return p_draft > torch.clamp(params.delta * torch.exp(-h), max=params.epsilon)


def correct_before(target_logits: Tensor, draft_tokens: Tensor, draft_probs: Tensor | None,
                   params: RuleParams, randoms: Randoms | None,
                   num_drafted: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """correction.correct as of commit 7aaa871."""
    K = draft_tokens.shape[1]
    positions = torch.arange(K, device=draft_tokens.device)
    if params.rule == "greedy":
        target_tokens = target_logits.argmax(-1)
        accept = target_tokens[:, :K] == draft_tokens
    else:
        accept = _acceptance_mask_before(
            target_logits[:, :K], draft_tokens, draft_probs, params,
            None if randoms is None else randoms.accept_uniforms)
    if num_drafted is not None:
        accept &= positions < num_drafted[:, None]
    num_accepted = accept.long().cumprod(-1).sum(-1)
    if params.rule == "greedy":
        return num_accepted, target_tokens.gather(1, num_accepted[:, None])[:, 0]
    stop_logits = target_logits.gather(
        1, num_accepted[:, None, None].expand(-1, 1, target_logits.shape[-1]))[:, 0]
    probs = _sampling_probs_before(stop_logits, params.temperature, params.top_p)
    if params.rule == "exact" and K > 0:
        stop = num_accepted.clamp(max=K - 1)
        if draft_probs is None:
            q = torch.nn.functional.one_hot(
                draft_tokens.gather(1, stop[:, None])[:, 0], probs.shape[-1]).to(probs.dtype)
        else:
            q = draft_probs.gather(1, stop[:, None, None].expand(-1, 1, probs.shape[-1]))[:, 0]
        residual = (probs - q).clamp(min=0)
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, probs)
        limit = K if num_drafted is None else num_drafted
        rejected = num_accepted < limit
        probs = torch.where(rejected[:, None], residual, probs)
    return num_accepted, (probs / randoms.sample_noise).argmax(dim=-1)


# -- the cases ----------------------------------------------------------------------------------


def rule_cases() -> list[tuple[str, RuleParams, bool]]:
    """(name, params, sampled drafts with q): every rule at the project's defaults, sampling
    at T=0.8 with and without top-p, and plain greedy (K=0)."""
    sampling = dict(temperature=0.8, top_p=0.9)
    return [
        ("plain greedy (K=0)", RuleParams("greedy"), False),
        ("plain sampling (K=0)", RuleParams("exact", **sampling), False),
        ("greedy", RuleParams("greedy"), False),
        ("exact T=0.8", RuleParams("exact", temperature=0.8), True),
        ("exact T=0.8 top_p=0.9", RuleParams("exact", **sampling), True),
        ("threshold", RuleParams("threshold"), False),
        ("ratio", RuleParams("ratio"), False),
        ("dynamic", RuleParams("dynamic"), False),
        ("dynamic top_p=0.9 membership",
         RuleParams("dynamic", top_p=0.9, top_p_membership=True), False),
        ("typical", RuleParams("typical"), False),
    ]


def drafts_near(logits: Tensor, params: RuleParams, sampled: bool, g: torch.Generator
                ) -> tuple[Tensor, Tensor | None]:
    """Drafts from a drafter that roughly agrees with the verifier: its logits are the
    verifier's plus N(0, 1) noise; sampled from its temperature + top-p distribution (with
    that distribution as q) or its argmax."""
    noisy = logits + torch.randn(logits.shape, generator=g)
    if not sampled:
        return noisy.argmax(-1), None
    q = _sampling_probs_before(noisy, params.temperature, params.top_p)
    return torch.multinomial(q.flatten(0, 1), 1, generator=g).view(q.shape[:2]), q


def timed_pair(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each function, called in turn (so a slow spell hits all)."""
    for fn in fns.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
    return {name: statistics.median(s) for name, s in samples.items()}


GLUE_THREADS = 1  # the decoder's torch threads for the correction next to a CPU engine (glue)


def bench_rules(logits: Tensor, k: int, step_s: dict[int, float], repeats: int, threads: int,
                seed: int = 0) -> list[dict]:
    """Every case on ``logits`` [B, k+1, V]; step_s: verify step seconds by K (0 and k)."""
    B, _, V = logits.shape
    rows = []
    for name, params, sampled in rule_cases():
        g = torch.Generator().manual_seed(seed)
        kk = 0 if name.startswith("plain") else k
        x = logits[:, : kk + 1].contiguous()
        drafts, q = drafts_near(x[:, :kk], params, sampled, g)
        randoms = None if params.is_greedy else draw_randoms(B, kk, V, g)
        want = correct_before(x, drafts, q, params, randoms)
        got = correct(x, drafts, q, params, randoms)
        same = [bool((a == b).all()) for a, b in zip(want, got, strict=True)]
        torch.set_num_threads(GLUE_THREADS)
        inputs = (x, drafts, q, params, randoms)
        t = timed_pair({"before": partial(correct_before, *inputs),
                        "after": partial(correct, *inputs)}, repeats)
        torch.set_num_threads(threads)
        rows.append({"case": name, "batch": B, "k": kk, "vocab": V,
                     "threads": GLUE_THREADS,
                     "before_ms": t["before"] * 1e3, "after_ms": t["after"] * 1e3,
                     "before_share": t["before"] / step_s[kk],
                     "after_share": t["after"] / step_s[kk],
                     "mean_accepted": float(got[0].float().mean()),
                     "same_num_accepted": same[0], "same_next_token": same[1]})
    return rows


# -- the verify steps ---------------------------------------------------------------------------


def demo_setting(batch: int, k: int, repeats: int, backend: str, ctx: int = 64) -> dict:
    """Real demo-verifier logits for [newest, K tokens] after ``ctx`` tokens of held-out text,
    and the verify-step time for K+1 and for 1 token per row: of the ONNX engine in
    engines/demo, or (backend "torch") of runtime.model's Transformer."""
    from tokenizers import Tokenizer

    from paradraft.runtime.backends.loader import load_engines

    if backend == "onnx":
        verifier, _, _, _ = load_engines(REPO / "engines/demo", threads=torch.get_num_threads())
        name = "ONNX engine engines/demo"
    else:
        verifier = load_model(REPO / "models/demo/verifier")
        name = "torch models/demo/verifier"
    tok = Tokenizer.from_file(str(REPO / "models/demo/verifier/tokenizer.json"))
    texts = [json.loads(line)["text"] for line in
             (REPO / "models/demo/heldout.jsonl").read_text().splitlines()]
    ids = [t for t in (tok.encode(s).ids for s in texts) if len(t) > ctx + k + 1][:batch]
    assert len(ids) == batch, "not enough held-out snippets"
    tokens = torch.tensor([t[: ctx + k + 1] for t in ids])
    c = verifier.config
    cache = new_kv_cache(c, batch, 512, torch.float32)
    prompt_pos = torch.arange(ctx).expand(batch, -1)
    with torch.no_grad():
        verifier(tokens[:, :ctx], prompt_pos, cache, kv_len=ctx)
    bound = ctx + 2 * k + 2  # the decoder's kv_len bound
    step_in = tokens[:, ctx - 1: ctx + k]
    pos = (ctx - 1 + torch.arange(k + 1)).expand(batch, -1)
    with torch.no_grad():
        logits, _ = verifier(step_in, pos, cache, kv_len=bound)
        t = timed_pair({
            "verify": lambda: verifier(step_in, pos, cache, kv_len=bound),
            "plain": lambda: verifier(step_in[:, :1], pos[:, :1], cache, kv_len=bound),
        }, repeats)
    return {"logits": logits, "step_s": {k: t["verify"], 0: t["plain"]},
            "verifier": f"{name} ({c.n_layers} layers, dim {c.dim}, V {c.vocab_size}), "
                        f"context {ctx}"}


def llama(dim: int, layers: int, heads: int, kv_heads: int, mlp: int, vocab: int
          ) -> Transformer:
    config = ModelConfig(model_type="llama", vocab_size=vocab, dim=dim, n_layers=layers,
                         n_heads=heads, n_kv_heads=kv_heads, head_dim=dim // heads,
                         intermediate_size=mlp, norm_eps=1e-5, max_position_embeddings=2048,
                         tie_embeddings=True)
    with torch.device("cpu"):
        return Transformer(config).eval()


def step_seconds(model: Transformer, B: int, T: int, repeats: int, ctx: int = 128) -> float:
    cache = new_kv_cache(model.config, B, ctx + T, torch.float32)
    tokens = torch.randint(0, model.config.vocab_size, (B, T))
    pos = ctx + torch.arange(T).expand(B, -1)
    with torch.no_grad():
        return timed_pair({"s": lambda: model(tokens, pos, cache, kv_len=ctx + T)},
                          repeats)["s"]


def large_setting(B: int, k: int, V: int, repeats: int) -> dict:
    """Synthetic logits, and the verify step of TinyLlama-1.1B's shape (extrapolated from 1
    and 2 layers) and of the earlier 56M Llama, for K+1 and for 1 token per row."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, k + 1, V, generator=g) * 2
    logits[:, :, :8] += 6
    steps, info = {}, {}
    for T in (k + 1, 1):
        one, two = (step_seconds(llama(2048, n, 32, 4, 5632, V), B, T, repeats)
                    for n in (1, 2))
        steps[0 if T == 1 else k] = one + 21 * (two - one)
        info[f"tinyllama_1_layer_s_T{T}"], info[f"tinyllama_2_layers_s_T{T}"] = one, two
    small = llama(512, 8, 8, 4, 1408, V)
    info["llama56m_step_s"] = {k: step_seconds(small, B, k + 1, repeats),
                               0: step_seconds(small, B, 1, repeats)}
    return {"logits": logits, "step_s": steps, "info": info,
            "verifier": "TinyLlama-1.1B shape (random), LM head + 22 layers extrapolated from "
                        "1 and 2 layers, context 128"}


# -- report -------------------------------------------------------------------------------------


def table(rows: list[dict], title: str) -> str:
    head = (f"{'case':30s} {'B':>3s} {'K':>2s} {'before ms':>10s} {'after ms':>9s} "
            f"{'before %':>9s} {'after %':>8s} {'speed-up':>8s}")
    lines = [title, head]
    for r in rows:
        lines.append(f"{r['case']:30s} {r['batch']:3d} {r['k']:2d} {r['before_ms']:10.3f} "
                     f"{r['after_ms']:9.3f} {r['before_share']:9.1%} {r['after_share']:8.1%} "
                     f"{r['before_ms'] / r['after_ms']:7.1f}x"
                     + ("" if r["same_num_accepted"] and r["same_next_token"] else "  DIFFERS"))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=("demo", "large"))
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--large-repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch (and engine) threads; on a shared machine a second OpenMP "
                         "thread stalls at every barrier while it is descheduled")
    ap.add_argument("--demo-verifier", choices=("onnx", "torch"), default="onnx")
    ap.add_argument("--out", default=str(REPO / "results/bench_correction.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                            capture_output=True, text=True).stdout.strip()
    result = {"date": time.strftime("%Y-%m-%d"), "commit": commit,
              "machine": f"{platform.machine()}, {platform.processor() or '?'}",
              "cpus": os.cpu_count(), "threads": args.threads, "settings": []}
    if args.only in (None, "demo"):
        V = load_config(REPO / "models/demo/verifier").vocab_size
        for B in (1, 16):
            s = demo_setting(B, 4, args.repeats, args.demo_verifier)
            rows = bench_rules(s["logits"], 4, s["step_s"], args.repeats, args.threads)
            result["settings"].append({"name": f"demo B={B}", "verifier": s["verifier"],
                                       "vocab": V, "step_ms": {str(k): v * 1e3 for k, v in
                                                               s["step_s"].items()},
                                       "rows": rows})
            print(table(rows, f"demo, B={B}, K=4, V={V}: verify step "
                              f"{s['step_s'][4] * 1e3:.2f} ms, plain step "
                              f"{s['step_s'][0] * 1e3:.2f} ms ({s['verifier']})"))
    if args.only in (None, "large"):
        s = large_setting(64, 8, 32000, args.large_repeats)
        rows = bench_rules(s["logits"], 8, s["step_s"], args.large_repeats, args.threads)
        small = s["info"]["llama56m_step_s"]
        for r in rows:
            r["after_share_llama56m"] = r["after_ms"] / 1e3 / small[r["k"]]
            r["before_share_llama56m"] = r["before_ms"] / 1e3 / small[r["k"]]
        result["settings"].append({"name": "large B=64", "verifier": s["verifier"],
                                   "step_ms": {str(k): v * 1e3 for k, v in s["step_s"].items()},
                                   "info": s["info"], "rows": rows})
        print(table(rows, f"B=64, K=8, V=32000: verify step {s['step_s'][8]:.1f} s, plain "
                          f"step {s['step_s'][0]:.1f} s ({s['verifier']}); 56M Llama: "
                          f"{small[8]:.2f} s / {small[0]:.2f} s"))
        for r in rows:
            print(f"  {r['case']:30s} share of the 56M step: before "
                  f"{r['before_share_llama56m']:.1%}, after {r['after_share_llama56m']:.1%}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
