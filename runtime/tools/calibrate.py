"""Rule defaults calibrated to the verifier: the one-off measurement ``build`` stores in the
engine manifest (and ``eval`` / ``tune`` report).

The heuristic rules compare the verifier's probabilities with fixed constants (τ 0.3 for
``threshold``, τ_base 0.3 for ``dynamic``), which only suit a verifier as confident as the one
they were chosen for: on a weaker verifier the argmax itself often falls below τ and those
rules accept almost nothing. Calibration instead reads the verifier's own confidence at the
positions where the rules decide: the verifier samples continuations of a few prompts, and at
each generated position we record its top-1 probability p1, runner-up p2 and entropy H. Then

- ``threshold`` τ = the ``quantile`` (0.2) of p1: a draft equal to the verifier's argmax
  passes at 80 % of positions;
- ``dynamic`` τ_base = the same quantile of p1 / (1 + α·H), so that the entropy-scaled
  threshold τ_i = τ_base·(1 + α·H_i) lets the argmax pass as often;
- ``ratio`` γ = the median of p2 / p1: a runner-up draft is accepted where the verifier is
  less sure between its top two than it usually is (the argmax always passes, r ≥ 1 ≥ γ).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor

from ..checkpoints import load_tokenizer
from ..correction import RuleParams, check_range
from ..model import new_kv_cache
from ..speculative import SpeculativeDecoder

# the rule parameters calibration sets, by rule
CALIBRATED = {"threshold": ("tau",), "dynamic": ("tau",), "ratio": ("gamma",)}


@dataclass(frozen=True)
class Calibration:
    tau: float  # threshold rule's τ
    dynamic_tau: float  # dynamic rule's τ_base, at ``alpha``
    gamma: float  # ratio rule's γ
    alpha: float
    quantile: float
    positions: int  # generated positions measured

    def to_dict(self) -> dict:
        return asdict(self)

    def params_for(self, rule: str) -> dict[str, float]:
        """The calibrated parameters of ``rule`` (empty for rules without any)."""
        if rule == "threshold":
            return {"tau": self.tau}
        if rule == "dynamic":
            return {"tau": self.dynamic_tau, "alpha": self.alpha}
        if rule == "ratio":
            return {"gamma": self.gamma}
        return {}


def verifier_confidence(verifier, prompts: list[list[int]], new_tokens: int, seed: int = 0
                        ) -> tuple[Tensor, Tensor, Tensor]:
    """(p1, p2, H) over every generated position: the verifier samples ``new_tokens`` after
    each prompt (temperature 1), then one teacher-forced pass reads its distribution there."""
    max_len = max(len(p) for p in prompts) + new_tokens
    sampler = SpeculativeDecoder(verifier, None, RuleParams("exact"), max_batch_size=len(prompts),
                                 max_seq_len=max_len)
    continuations = sampler.generate(prompts, new_tokens, seed=seed).token_ids
    seqs = [p + c for p, c in zip(prompts, continuations, strict=True)]
    width = max(len(s) for s in seqs)
    tokens = torch.zeros(len(seqs), width, dtype=torch.long)
    for b, s in enumerate(seqs):
        tokens[b, : len(s)] = torch.tensor(s)
    dev = verifier.device
    cache = new_kv_cache(verifier.config, len(seqs), width, verifier.dtype, dev)
    pos = torch.arange(width, device=dev).expand(len(seqs), -1)
    with torch.no_grad():
        logits, _ = verifier(tokens.to(dev), pos, cache, kv_len=width)
    # the distribution each generated token was drawn from: positions len(p)-1 … len(s)-2
    picked = [logits[b, len(p) - 1: len(s) - 1] for b, (p, s) in
              enumerate(zip(prompts, seqs, strict=True))]
    logp = torch.log_softmax(torch.cat(picked).float(), -1)
    top2 = logp.topk(2, dim=-1).values.exp()
    probs = logp.exp()
    entropy = -(probs * logp.nan_to_num(neginf=0.0)).sum(-1)
    return top2[:, 0], top2[:, 1], entropy


def calibrate(verifier, prompts: list[list[int]], new_tokens: int = 32, quantile: float = 0.2,
              alpha: float = 0.1, seed: int = 0) -> Calibration:
    """The calibrated defaults of the threshold, dynamic and ratio rules (module docstring)."""
    check_range("quantile", quantile, 0.0, 0.5, low_open=True)
    if not prompts:
        raise ValueError("calibration needs at least one prompt")
    p1, p2, entropy = verifier_confidence(verifier, prompts, new_tokens, seed)
    return Calibration(
        tau=float(p1.quantile(quantile)),
        dynamic_tau=float((p1 / (1.0 + alpha * entropy)).quantile(quantile)),
        gamma=float((p2 / p1).median()),
        alpha=alpha, quantile=quantile, positions=int(p1.numel()))


# generic openings (prose, code, data) for a checkpoint with a tokenizer: the verifier's own
# continuations, which calibration measures, matter more than the prompt
CALIBRATION_TEXTS = (
    "The history of the city begins in", "def parse_config(path):\n", "import numpy as np\n",
    "Once upon a time, there was a", "SELECT name, count(*) FROM users", "Q: What is the",
    "class Node:\n    def __init__(self", "The results of the experiment show that")


def default_prompts(vocab_size: int, n: int = 8, length: int = 16, seed: int = 0
                    ) -> list[list[int]]:
    """Prompts for a checkpoint without a tokenizer: random ids."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (n, length), generator=g).tolist()


def calibration_prompts(model_dir: str | Path, vocab_size: int) -> list[list[int]]:
    """``CALIBRATION_TEXTS`` through the checkpoint's tokenizer, else ``default_prompts``."""
    if not (Path(model_dir) / "tokenizer.json").is_file():
        return default_prompts(vocab_size)
    tokenizer = load_tokenizer(model_dir)
    prompts = [tokenizer.encode(t).ids for t in CALIBRATION_TEXTS]
    return [p for p in prompts if p and max(p) < vocab_size] or default_prompts(vocab_size)

