"""Statistical check, end to end on real models: does ``exact`` speculative sampling draw
from the verifier's distribution over whole continuations?

For plain sampling and for exact speculation with each drafter, generates many continuations
of held-out prompts and scores them under the verifier (teacher forcing). Two numbers per
sampler, each with its standard error over sequences:

- mean NLL per token: equal for every lossless sampler;
- calibration, mean of (−log p(x_t) − H(p_t)): zero for a sampler that draws x_t from p_t
  (a sharper sampler goes negative, a flatter one positive) — needs no second sampler.

`paradraft eval` compares perplexities on a few dozen sequences; this is the check to run
when its "sampling noise" line looks like more than noise.

    python scripts/check_exact_sampling.py --seeds 40 --out out/check_exact_sampling.json
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from tokenizers import Tokenizer

from paradraft.runtime.cli import DEMO_DIR
from paradraft.runtime.correction import RuleParams
from paradraft.runtime.evaluate import continuation_log_softmax, heldout_prompts, heldout_texts
from paradraft.runtime.model import Transformer, load_model
from paradraft.runtime.speculative import Drafter, SpeculativeDecoder


def surprise_and_entropy(verifier: Transformer, prompt: list[int], continuation: list[int]
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    logp = continuation_log_softmax(verifier, prompt, continuation).double()
    surprise = -logp.gather(-1, torch.tensor(continuation)[:, None])[:, 0]
    return surprise, -(logp.exp() * logp).sum(-1)


def mean_and_error(values: torch.Tensor) -> tuple[float, float]:
    return float(values.mean()), float(values.std() / math.sqrt(values.numel()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--demo", default=str(DEMO_DIR))
    ap.add_argument("--drafters", default="model,parallel,self")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--seeds", type=int, default=40)
    ap.add_argument("--first-seed", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", default="out/check_exact_sampling.json")
    args = ap.parse_args()
    demo = Path(args.demo)
    verifier = load_model(demo / "verifier")
    tokenizer = Tokenizer.from_file(str(demo / "verifier" / "tokenizer.json"))
    prompts = [p for p, _ in heldout_prompts(tokenizer, heldout_texts(demo), args.prompts, 48)]
    drafters = {"model": lambda: Drafter("model", load_model(demo / "draft")),
                "parallel": lambda: Drafter("parallel", load_model(demo / "parallel_draft")),
                "self": lambda: Drafter("self", verifier)}
    samplers = {"autoregressive": None} | {
        name: drafters[name]() for name in args.drafters.split(",") if name}
    results = {}
    for name, drafter in samplers.items():
        decoder = SpeculativeDecoder(verifier, drafter, RuleParams("exact"),
                                     k=args.k if drafter else 0,
                                     max_batch_size=args.batch_size,
                                     max_seq_len=48 + args.max_new_tokens, acceptance_floor=0.0)
        nll, calibration = [], []
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            for i in range(0, len(prompts), args.batch_size):
                batch = prompts[i: i + args.batch_size]
                out = decoder.generate(batch, args.max_new_tokens, seed=seed * len(prompts) + i)
                for prompt, continuation in zip(batch, out.token_ids, strict=True):
                    if not continuation:
                        continue
                    surprise, entropy = surprise_and_entropy(verifier, prompt, continuation)
                    nll.append(surprise.mean())
                    calibration.append((surprise - entropy).mean())
        results[name] = {"sequences": len(nll),
                         "nll": mean_and_error(torch.stack(nll)),
                         "calibration": mean_and_error(torch.stack(calibration))}
        r = results[name]
        print(f"{name:15s} {r['sequences']:5d} sequences  NLL/token {r['nll'][0]:.4f} ± "
              f"{r['nll'][1]:.4f}  calibration {r['calibration'][0]:+.4f} ± "
              f"{r['calibration'][1]:.4f}", flush=True)
    reference = results["autoregressive"]["nll"]
    for name, r in results.items():
        # the error as for independent samples: the shared seeds only correlate them
        # positively, so this overstates it
        diff = (r["nll"][0] - reference[0], math.hypot(r["nll"][1], reference[1]))
        r["nll_vs_autoregressive"] = diff
        print(f"{name:15s} NLL/token vs autoregressive {diff[0]:+.4f} ± {diff[1]:.4f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "samplers": results}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
