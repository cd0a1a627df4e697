"""Analysis: would n-gram (prompt-lookup) drafts help the demo pair? Counts, no timing.

vLLM's ``ngram`` and TensorRT-LLM's prompt-lookup drafters propose the K tokens that
followed the latest earlier occurrence of the context's last n tokens: no draft model, no
draft time. Greedy decoding is deterministic, so the accepted length of any proposal at
any point of the verifier's greedy continuation is its common prefix with that
continuation. This script decodes held-out prompts greedily with the verifier (torch), then
counts, at each round start the speculative loop would reach, the tokens per verify round
of: the draft model (teacher-forced on the continuation, which is exact until its first
miss), n-gram proposals alone (no match: no drafts), the hybrid "n-gram when the suffix
match is at least m tokens long, else the draft model", and an oracle that always picks the
longer. Writes JSON.

A hybrid round that skips the draft model saves the draft's share of a round's time
(``--draft-share``, measured by ``paradraft bench``: draft seconds / total seconds at K);
``modelled_speed_vs_model`` combines that with the counts (every round without the draft
model is costed as a verify of K+1 positions: slightly high for rounds with fewer drafts).
Measured speed needs the real loop; this only says whether building it could pay.

    .venv/bin/python scripts/sim_ngram_drafts.py --out results/ngram_drafts
"""

from __future__ import annotations

import argparse

import torch

from paradraft.runtime.bench import add_script_args, script_prompts, write_report
from paradraft.runtime.cli import DEMO_DIR
from paradraft.runtime.correction import RuleParams
from paradraft.runtime.model import Transformer, load_model, new_kv_cache
from paradraft.runtime.speculative import SpeculativeDecoder


def ngram_proposal(context: list[int], k: int, max_n: int) -> tuple[list[int], int]:
    """(up to k tokens that followed the latest earlier match of the longest suffix of
    length max_n..1, that length); ([], 0) without a match."""
    for n in range(min(max_n, len(context) - 1), 0, -1):
        suffix = context[-n:]
        for start in range(len(context) - n - 1, -1, -1):
            if context[start: start + n] == suffix:
                return context[start + n: start + n + k], n
    return [], 0


def common_prefix(proposal: list[int], truth: list[int]) -> int:
    n = 0
    while n < len(proposal) and n < len(truth) and proposal[n] == truth[n]:
        n += 1
    return n


@torch.no_grad()
def draft_hits(draft: Transformer, prompt: list[int], continuation: list[int]) -> list[bool]:
    """hits[t]: the draft's greedy token after prompt + continuation[:t] is continuation[t]."""
    ids = prompt + continuation
    cache = new_kv_cache(draft.config, 1, len(ids), torch.float32)
    logits, _ = draft(torch.tensor([ids]), torch.arange(len(ids))[None], cache)
    predicted = logits[0, len(prompt) - 1: len(ids) - 1].argmax(-1)
    return (predicted == torch.tensor(continuation)).tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_script_args(ap, prompts=32, repeats=1)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-n", type=int, default=8, help="longest suffix n-gram matched")
    ap.add_argument("--draft-share", type=float, default=0.25,
                    help="the draft's share of a speculative round's time, in [0, 1)")
    ap.add_argument("--out", default="out/ngram_drafts")
    args = ap.parse_args()
    if not 1 <= args.k <= 16:
        raise ValueError(f"k must be in [1, 16]; got {args.k}")
    if args.max_n < 1:
        raise ValueError(f"max_n must be >= 1; got {args.max_n}")
    if not 0.0 <= args.draft_share < 1.0:
        raise ValueError(f"draft_share must be in [0, 1); got {args.draft_share}")
    prompts = script_prompts(args)
    verifier = load_model(DEMO_DIR / "verifier")
    draft = load_model(DEMO_DIR / "draft")
    decoder = SpeculativeDecoder(verifier, None, RuleParams("greedy"), max_batch_size=1,
                                 max_seq_len=max(map(len, prompts)) + args.max_new_tokens)
    # "ngram only": no match, no drafts (a plain step); "ngram if match >= m": the draft
    # model when the longest suffix match is shorter than m
    policies = ["model", "ngram only", *(f"ngram if match >= {m}" for m in (1, 2, 3, 4, 6)),
                "oracle"]
    counts = {p: {"rounds": 0, "tokens": 0, "model_rounds": 0} for p in policies}
    for prompt in prompts:
        truth = decoder.generate([prompt], args.max_new_tokens).token_ids[0]
        hits = draft_hits(draft, prompt, truth)
        for policy, c in counts.items():
            t = 0
            while t < len(truth):
                model_len = common_prefix([True] * args.k, hits[t:])
                proposal, n = ngram_proposal(prompt + truth[:t], args.k, args.max_n)
                ngram_len = common_prefix(proposal, truth[t:])
                if policy == "oracle":
                    use_model = model_len > ngram_len
                elif policy == "ngram only":
                    use_model = False
                else:
                    use_model = policy == "model" or n < int(policy.rsplit(" ", 1)[1])
                accepted = model_len if use_model else ngram_len
                c["rounds"] += 1
                c["model_rounds"] += use_model
                c["tokens"] += min(accepted + 1, len(truth) - t)
                t += accepted + 1
    model_tpr = counts["model"]["tokens"] / counts["model"]["rounds"]
    rows = []
    for policy, c in counts.items():
        tpr = c["tokens"] / c["rounds"]
        model_fraction = c["model_rounds"] / c["rounds"]
        # a round without the draft model costs (1 - draft_share) of a drafted round
        round_cost = 1.0 - args.draft_share * (1.0 - model_fraction)
        rows.append({"policy": policy, "tokens_per_round": tpr,
                     "model_draft_rounds": model_fraction,
                     "modelled_speed_vs_model": tpr / model_tpr / round_cost})
        print(f"{policy:22s} tokens/round {tpr:5.2f}  draft-model rounds "
              f"{model_fraction:5.2f}  modelled speed vs the draft model "
              f"{rows[-1]['modelled_speed_vs_model']:5.2f}x")
    write_report(args.out, "ngram_drafts.json", {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
