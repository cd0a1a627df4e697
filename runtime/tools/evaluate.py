"""Quality: perplexity and diversity per correction rule (``paradraft eval``), and the tuning
loop (``paradraft tune``): sweep a rule's parameters, print the speed/quality frontier and the
best settings within the quality budget (default: perplexity ≤ +10 % versus lossless
``exact`` sampling).

Perplexity under the verifier alone rewards text that collapses into repetition (a loop the
verifier predicts well scores low), so a setting also fails when its distinct-2 falls more than
the diversity budget below ``exact``'s. Each perplexity change carries a paired-bootstrap 95 %
interval over the generated sequences: with few samples even two lossless samplers differ by
more than 10 %, and the interval says whether a verdict is resolved."""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, field

import torch

from ..correction import RuleParams, check_range
from ..drafters import AnyDrafter
from ..model import Transformer, new_kv_cache
from ..speculative import SpeculativeDecoder


def perplexity_from_logprobs(logprobs: list[float]) -> float:
    """exp of the mean negative log-likelihood per token."""
    if not logprobs:
        raise ValueError("perplexity needs at least one token")
    return math.exp(-sum(logprobs) / len(logprobs))


@torch.no_grad()
def continuation_log_softmax(model: Transformer, prompt: list[int], continuation: list[int]
                             ) -> torch.Tensor:
    """[len(continuation), V]: log p(· | prompt, continuation_<t) under ``model`` (teacher
    forcing)."""
    ids = torch.tensor([prompt + continuation])
    cache = new_kv_cache(model.config, 1, ids.shape[1], model.dtype)
    logits, _ = model(ids, torch.arange(ids.shape[1])[None], cache)
    return torch.log_softmax(logits[0, len(prompt) - 1: -1], dim=-1)


def continuation_logprobs(model: Transformer, prompt: list[int], continuation: list[int]
                          ) -> list[float]:
    """log p(continuation_t | prompt, continuation_<t) under ``model``."""
    logp = continuation_log_softmax(model, prompt, continuation)
    return logp.gather(-1, torch.tensor(continuation)[:, None])[:, 0].tolist()


def heldout_perplexity(verifier: Transformer, pairs: list[tuple[list[int], list[int]]],
                       max_new_tokens: int) -> float:
    """The verifier's perplexity on the held-out reference continuations of the prompts, each
    cut to ``max_new_tokens`` as the generated ones are: what human-written text of the same
    length scores, the reference point for the perplexities of generated text (sampled text
    can score far below it by looping, or above it when a rule is lossy)."""
    logprobs: list[float] = []
    for prompt, reference in pairs:
        logprobs += continuation_logprobs(verifier, prompt, reference[:max_new_tokens])
    return perplexity_from_logprobs(logprobs)


def distinct_n(sequences: list[list[int]], n: int) -> float:
    """Distinct n-grams / total n-grams over all sequences (diversity)."""
    grams = [tuple(s[i: i + n]) for s in sequences for i in range(len(s) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


@dataclass
class QualityRow:
    label: str
    rule: str
    params: dict
    perplexity: float
    distinct_1: float
    distinct_2: float
    distinct_3: float
    acceptance_rate: float
    mean_acceptance_length: float
    tokens_per_second: float
    speedup: float = 0.0
    ppl_change_vs_exact: float = 0.0
    ppl_change_interval: tuple[float, float] = (0.0, 0.0)  # paired bootstrap, 95 %
    distinct_2_change_vs_exact: float = 0.0
    failed: list[str] = field(default_factory=list)  # "perplexity", "diversity"
    within_budget: bool = True
    reference: str = ""  # label of the exact row the changes are against
    # per generated sequence, in (seed, prompt) order: what the bootstrap resamples
    sequence_nll: list[float] = field(default_factory=list, repr=False)
    sequence_tokens: list[int] = field(default_factory=list, repr=False)


def measure(verifier: Transformer, drafter: AnyDrafter | None, params: RuleParams, k: int,
            prompts: list[list[int]], max_new_tokens: int, seeds: list[int], batch_size: int,
            label: str) -> QualityRow:
    """Generate for every prompt and seed; score the continuations under the verifier."""
    dec = SpeculativeDecoder(verifier, drafter, params, k=k, max_batch_size=batch_size,
                             max_seq_len=max(map(len, prompts)) + max_new_tokens,
                             acceptance_floor=0.0)
    outputs: list[list[int]] = []
    logprobs: list[float] = []
    sequence_nll: list[float] = []
    sequence_tokens: list[int] = []
    drafted = accepted = steps = generated = 0
    seconds = 0.0
    for seed in seeds:
        for i in range(0, len(prompts), batch_size):
            batch = prompts[i: i + batch_size]
            # a seed per batch: re-seeding every batch alike would hand row r of each batch
            # the same random numbers, correlating sequences the bootstrap counts as
            # independent
            result = dec.generate(batch, max_new_tokens, seed=seed * len(prompts) + i)
            s = result.stats
            drafted += s.draft_tokens
            accepted += s.accepted_tokens
            steps += s.verify_steps
            generated += s.generated_tokens
            seconds += s.total_time
            for p, out in zip(batch, result.token_ids, strict=True):
                outputs.append(out)
                scores = continuation_logprobs(verifier, p, out)
                logprobs += scores
                sequence_nll.append(-sum(scores))
                sequence_tokens.append(len(scores))
    return QualityRow(
        label=label, rule=params.rule, params=asdict(params),
        perplexity=perplexity_from_logprobs(logprobs),
        distinct_1=distinct_n(outputs, 1), distinct_2=distinct_n(outputs, 2),
        distinct_3=distinct_n(outputs, 3),
        acceptance_rate=accepted / drafted if drafted else 0.0,
        mean_acceptance_length=(accepted + steps) / max(steps, 1),
        tokens_per_second=generated / seconds if seconds else 0.0,
        sequence_nll=sequence_nll, sequence_tokens=sequence_tokens,
    )


def bootstrap_ppl_change(row: QualityRow, exact: QualityRow, resamples: int = 2000,
                        seed: int = 0) -> tuple[float, float]:
    """95 % paired-bootstrap interval of perplexity(row) / perplexity(exact) − 1: the same
    (seed, prompt) sequences of both are resampled together."""
    if len(row.sequence_nll) != len(exact.sequence_nll) or not row.sequence_nll:
        raise ValueError("the bootstrap pairs sequences: both rows need the same, non-zero "
                         f"number ({len(row.sequence_nll)} vs {len(exact.sequence_nll)})")
    nll = torch.tensor([row.sequence_nll, exact.sequence_nll], dtype=torch.float64)
    tokens = torch.tensor([row.sequence_tokens, exact.sequence_tokens], dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed)
    picks = torch.randint(nll.shape[1], (resamples, nll.shape[1]), generator=gen)
    log_ppl = nll[:, picks].sum(-1) / tokens[:, picks].sum(-1).clamp(min=1)  # [2, resamples]
    change = torch.expm1(log_ppl[0] - log_ppl[1])
    low, high = torch.quantile(change, torch.tensor([0.025, 0.975], dtype=torch.float64))
    return float(low), float(high)


def compare(rows: list[QualityRow], exact: QualityRow, baseline_tps: float,
            budget: float, diversity_budget: float = 0.10) -> None:
    """Fill speed-up (vs plain decoding) and the quality changes against ``exact`` (lossless
    speculative sampling): a row fails on perplexity above ``budget`` or on a distinct-2 drop
    beyond ``diversity_budget`` (both relative). Every row must share ``exact``'s temperature
    and top_p: against another temperature's exact the change would be the temperature's."""
    check_range("budget", budget, 0.0, 100.0)
    check_range("diversity_budget", diversity_budget, 0.0, 1.0)
    sampling = ("temperature", "top_p")
    for r in rows:
        if [r.params.get(k) for k in sampling] != [exact.params.get(k) for k in sampling]:
            raise ValueError(f"{r.label!r} is compared against {exact.label!r} at another "
                             "temperature or top_p")
    for r in rows:
        r.reference = exact.label
        r.speedup = r.tokens_per_second / baseline_tps if baseline_tps else 0.0
        r.ppl_change_vs_exact = r.perplexity / exact.perplexity - 1.0
        r.ppl_change_interval = bootstrap_ppl_change(r, exact)
        r.distinct_2_change_vs_exact = (r.distinct_2 / exact.distinct_2 - 1.0
                                        if exact.distinct_2 else 0.0)
        # lossless rows sample the verifier's own distribution: what separates them from
        # exact is sampling noise, not a quality loss
        r.failed = [] if r.rule == "exact" else (
            ["perplexity"] * (r.ppl_change_vs_exact > budget)
            + ["diversity"] * (r.distinct_2_change_vs_exact < -diversity_budget))
        r.within_budget = not r.failed


def print_table(rows: list[QualityRow], title: str) -> None:
    print(title)
    print(f"{'setting':44s} {'ppl':>8s} {'Δppl':>7s} {'95% interval':>18s} {'d-2':>5s} "
          f"{'Δd-2':>7s} {'accept':>6s} {'len':>5s} {'speed-up':>8s}  ok")
    for r in rows:
        low, high = r.ppl_change_interval
        verdict = ("lossless" if r.rule == "exact" else "yes" if r.within_budget
                   else "NO: " + ", ".join(r.failed))
        print(f"{r.label:44s} {r.perplexity:8.2f} {r.ppl_change_vs_exact:+7.1%} "
              f"[{low:+7.1%}, {high:+7.1%}] {r.distinct_2:5.2f} "
              f"{r.distinct_2_change_vs_exact:+7.1%} {r.acceptance_rate:6.2f} "
              f"{r.mean_acceptance_length:5.2f} {r.speedup:7.2f}x  {verdict}")


def tune_grid(rule: str) -> list[dict]:
    """The parameter sweep of ``paradraft tune`` for ``rule``."""
    if rule == "dynamic":
        # the ends of the dynamic rule's recommended ranges (τ_base 0.2–0.4, α 0.05–0.15,
        # T 0.8–1.2, top_p 0.8–0.95): 16 settings
        grid = itertools.product([0.2, 0.4], [0.05, 0.15], [0.8, 1.2], [0.8, 0.95])
        return [dict(tau=t, alpha=a, temperature=T, top_p=p) for t, a, T, p in grid]
    if rule == "threshold":
        return [dict(tau=t, temperature=T) for t in [0.1, 0.2, 0.3, 0.4, 0.5]
                for T in [0.8, 1.0]]
    if rule == "ratio":
        return [dict(gamma=g, temperature=T) for g in [0.25, 0.5, 1.0, 1.5, 2.0]
                for T in [0.8, 1.0]]
    if rule == "typical":
        return [dict(epsilon=e, delta=d, temperature=T) for e in [0.05, 0.09, 0.2]
                for d in [0.2, 0.3, 0.5] for T in [0.8, 1.0]]
    raise ValueError(f"tune supports dynamic, threshold, ratio, typical; got {rule!r}")


def frontier(rows: list[QualityRow]) -> list[QualityRow]:
    """Settings not beaten on both speed-up and perplexity change by another one. The change
    is against exact sampling at each row's own temperature and top-p: absolute perplexity
    would reward a low temperature, not the rule."""
    return [r for r in rows if not any(
        o.speedup >= r.speedup and o.ppl_change_vs_exact <= r.ppl_change_vs_exact
        and (o.speedup > r.speedup or o.ppl_change_vs_exact < r.ppl_change_vs_exact)
        for o in rows)]


# -- compressed weights against the fp32 verifier (``eval --reference-engines``) ------------


@dataclass
class WeightsQuality:
    """One verifier (an engine dir's weights) against the reference (fp32) verifier. The
    lossless rules are lossless with respect to the verifier they run, so this is the whole
    quality cost of compressed weights."""

    label: str
    heldout_perplexity: float  # on the held-out reference continuations, teacher forced
    greedy_perplexity: float  # of its own greedy continuations, scored by the REFERENCE
    top1_agreement: float  # teacher forced on held-out text: argmax == the reference's
    kl_from_reference: float  # mean KL(reference ‖ this) per held-out position, nats
    greedy_agreement: float  # mean share of each greedy continuation before the first
    # token that differs from the reference's greedy continuation
    identical_sequences: float  # share of prompts whose greedy continuation is identical
    tokens_per_second: float  # its plain greedy decoding, as run here


def greedy_continuations(model, prompts: list[list[int]], max_new_tokens: int,
                         batch_size: int) -> tuple[list[list[int]], float]:
    """Plain greedy decoding of every prompt (no drafter, no EOS stop, so every continuation
    has ``max_new_tokens``); returns (continuations, tokens per second)."""
    dec = SpeculativeDecoder(model, None, RuleParams("greedy"), k=0, max_batch_size=batch_size,
                             max_seq_len=max(map(len, prompts)) + max_new_tokens,
                             acceptance_floor=0.0)
    outs: list[list[int]] = []
    tokens = seconds = 0.0
    for i in range(0, len(prompts), batch_size):
        result = dec.generate(prompts[i: i + batch_size], max_new_tokens)
        outs += result.token_ids
        tokens += result.stats.generated_tokens
        seconds += result.stats.total_time
    return outs, tokens / seconds if seconds else 0.0


def prefix_agreement(outputs: list[list[int]], reference: list[list[int]]
                     ) -> tuple[float, float]:
    """(mean share of each sequence before its first token that differs from the reference
    sequence, share of sequences identical to it): how far greedy decoding follows the
    reference. Position-by-position matches after a divergence would compare unrelated
    texts, so they do not count."""
    if len(outputs) != len(reference) or not outputs:
        raise ValueError("prefix_agreement pairs sequences: both need the same, non-zero "
                         f"number ({len(outputs)} vs {len(reference)})")
    shares, identical = [], 0
    for out, ref in zip(outputs, reference, strict=True):
        n = max(len(out), len(ref))
        same = next((i for i, (a, b) in enumerate(zip(out, ref, strict=False)) if a != b),
                    min(len(out), len(ref)))
        shares.append(same / n if n else 1.0)
        identical += out == ref
    return sum(shares) / len(shares), identical / len(outputs)


@torch.no_grad()
def weights_quality(models: dict[str, object], reference: str,
                    pairs: list[tuple[list[int], list[int]]], max_new_tokens: int,
                    batch_size: int) -> list[WeightsQuality]:
    """Each of ``models`` ({label: verifier (a Transformer or an engine)}) against
    ``models[reference]``, on held-out (prompt, reference continuation) pairs."""
    if reference not in models:
        raise ValueError(f"reference {reference!r} is not among the models {list(models)}")
    prompts = [p for p, _ in pairs]
    refs = [c[:max_new_tokens] for _, c in pairs]
    ref_model = models[reference]
    ref_logp = [continuation_log_softmax(ref_model, p, c) for p, c in zip(prompts, refs,
                                                                            strict=True)]
    ref_greedy, _ = greedy_continuations(ref_model, prompts, max_new_tokens, batch_size)
    rows = []
    for label, model in models.items():
        logprobs: list[float] = []
        top1 = kl = positions = 0.0
        for p, c, ref in zip(prompts, refs, ref_logp, strict=True):
            logp = ref if model is ref_model else continuation_log_softmax(model, p, c)
            logprobs += logp.gather(-1, torch.tensor(c)[:, None])[:, 0].tolist()
            top1 += float((logp.argmax(-1) == ref.argmax(-1)).sum())
            kl += float((ref.exp() * (ref - logp)).nan_to_num().sum())
            positions += len(c)
        greedy, tps = greedy_continuations(model, prompts, max_new_tokens, batch_size)
        scored: list[float] = []
        for p, g in zip(prompts, greedy, strict=True):
            scored += continuation_logprobs(ref_model, p, g)
        agreement, identical = prefix_agreement(greedy, ref_greedy)
        rows.append(WeightsQuality(
            label=label, heldout_perplexity=perplexity_from_logprobs(logprobs),
            greedy_perplexity=perplexity_from_logprobs(scored),
            top1_agreement=top1 / positions, kl_from_reference=kl / positions,
            greedy_agreement=agreement, identical_sequences=identical, tokens_per_second=tps))
    return rows


def print_weights_table(rows: list[WeightsQuality], reference: str) -> None:
    print(f"verifier weights against {reference} (held-out text teacher forced; greedy "
          "continuations scored by the reference)")
    print(f"{'verifier':32s} {'ppl':>8s} {'Δppl':>7s} {'greedy ppl':>10s} {'top-1':>6s} "
          f"{'KL':>7s} {'greedy agree':>12s} {'identical':>9s} {'tok/s':>7s}")
    base = next(r for r in rows if r.label == reference)
    for r in rows:
        print(f"{r.label:32s} {r.heldout_perplexity:8.2f} "
              f"{r.heldout_perplexity / base.heldout_perplexity - 1:+7.1%} "
              f"{r.greedy_perplexity:10.2f} {r.top1_agreement:6.1%} {r.kl_from_reference:7.4f} "
              f"{r.greedy_agreement:12.1%} {r.identical_sequences:9.1%} "
              f"{r.tokens_per_second:7.1f}")
