"""Causal correction rules: the single source of truth.

Every rule sees the verifier logits for the K draft positions plus the bonus position
([B, K+1, V]), the draft tokens [B, K] (and the draft's probabilities where the rule needs
them), and returns per row the number of accepted draft tokens and the token that follows
them. Position i of the logits scores draft token i. Acceptance is a prefix: everything after
the first rejection is discarded (causal rollback). At the stop position n the next token is
a correction drawn from the verifier's distribution at n, or, when all drafted tokens pass,
the bonus token from position K.

All randomness comes in as tensors (``Randoms``) so that the ONNX Runtime op, the GPU kernel
and the TensorRT plugin can be checked against this module for the same random numbers.
Sampling uses the exponential race: argmax(p / E) with E ~ Exp(1) draws from p.

Distributions: ``exact`` compares the temperature + top-p distribution the baseline samples
from (that is what makes it lossless). The heuristic rules (``threshold``, ``ratio``,
``dynamic``) and Medusa typical acceptance (``typical``) test the plain verifier softmax, and
sample their correction with temperature + top-p. The top-p set is found without a sort
(``top_p_floor``); tokens of equal probability are all in it or all out.

Cost: ``greedy`` is an argmax per position and a compare, nothing else. The other rules make
one softmax per position (the stop position reuses it where the distribution is the same),
the entropy only for ``dynamic`` and ``typical``, and the top-p set only where it is used.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

RULES = ("exact", "greedy", "threshold", "ratio", "dynamic", "typical")
MAX_K = 64


# each sampling and rule parameter's range: (low, high, whether low itself is excluded).
# Temperature from 1e-5 (vLLM's sampling epsilon): logits / T must not overflow float32, or
# the softmax turns to NaN; the OpenAI API reads a lower temperature as 0, greedy
PARAMETER_RANGES = {
    "temperature": (1e-5, 100.0, False), "top_p": (0.0, 1.0, True), "tau": (0.0, 1.0, False),
    "gamma": (0.0, 1e6, True), "alpha": (0.0, 100.0, False), "epsilon": (0.0, 1.0, False),
    "delta": (0.0, 1e6, False)}


@dataclass(frozen=True)
class RuleParams:
    """Correction rule and sampling parameters (validated on construction)."""

    rule: str = "exact"
    temperature: float = 1.0
    top_p: float = 1.0
    tau: float = 0.3  # threshold: τ; dynamic: τ_base
    gamma: float = 1.0  # ratio: accept while p(draft) / p(best alternative) >= γ
    alpha: float = 0.1  # dynamic: τ_i = τ_base · (1 + α · H_i)
    top_p_membership: bool = False  # dynamic: also reject drafts outside the top-p set
    epsilon: float = 0.09  # typical: accept while p > min(ε, δ · exp(−H))
    delta: float = 0.3

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"rule must be one of {', '.join(RULES)}; got {self.rule!r}")
        for name, (low, high, low_open) in PARAMETER_RANGES.items():
            check_range(name, getattr(self, name), low, high, low_open)

    @property
    def is_greedy(self) -> bool:
        return self.rule == "greedy"


def check_range(
    name: str, value: float, low: float, high: float, low_open: bool = False
) -> None:
    """Raise ValueError naming the parameter and its allowed range."""
    ok = isinstance(value, int | float) and math.isfinite(value)
    ok = ok and (value > low if low_open else value >= low) and value <= high
    if not ok:
        bracket = "(" if low_open else "["
        raise ValueError(f"{name} must be in {bracket}{low:g}, {high:g}]; got {value!r}")


def check_k(k: int, name: str = "k") -> None:
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_K:
        raise ValueError(f"{name} must be an integer in [1, {MAX_K}]; got {k!r}")


@dataclass
class Randoms:
    accept_uniforms: Tensor  # [B, K] in [0, 1): exact rule's acceptance test
    sample_noise: Tensor  # [B, V] ~ Exp(1): one sample per row at the stop position


def exponential_noise(shape: tuple[int, ...], generator: torch.Generator | None,
                      device="cpu") -> Tensor:
    """Exp(1) noise as −log U, U ~ Uniform(0, 1) kept above the smallest normal float, so every
    value is finite and > 0. A sampled round draws a vocabulary row per sequence and per
    sampled draft, and on the CPU ``Tensor.exponential_`` costs 2.7–5.2× as much (measured
    here, 1 × 8192: 269 vs 99 µs; 16 × 8192: 3976 vs 762 µs)."""
    u = torch.rand(shape, generator=generator, device=device)
    return u.clamp_(min=torch.finfo(u.dtype).tiny).log_().neg_()


def draw_randoms(
    batch: int, k: int, vocab: int, generator: torch.Generator | None, device="cpu"
) -> Randoms:
    return Randoms(
        accept_uniforms=torch.rand(batch, k, generator=generator, device=device),
        sample_noise=exponential_noise((batch, vocab), generator, device),
    )


MASK32 = 0xFFFFFFFF
STREAM_ACCEPT, STREAM_SAMPLE, STREAM_DRAFT = 0, 1, 2  # draft step j uses STREAM_DRAFT + j


def mix32(x: Tensor) -> Tensor:
    """A full-avalanche 32-bit integer hash (lowbias32), on int64 tensors holding 32-bit
    values: the products wrap past 2**63, and the mask keeps their low 32 bits, which wrapping
    leaves exact."""
    x = x ^ (x >> 16)  # a new tensor: the rest works in place (a [B, V] draw per round)
    x.mul_(0x7FEB352D).bitwise_and_(MASK32)
    x ^= x >> 15
    x.mul_(0x846CA68B).bitwise_and_(MASK32)
    x ^= x >> 16
    return x


@dataclass
class RowStreams:
    """Counter-based random numbers, one stream per row: row b's numbers hash (its seed, its
    counter, a stream id, the element index) and nothing else, so a request's samples do not
    depend on which rows share its batch or where it sits in it (a shared torch.Generator
    hands rows consecutive chunks of one sequence). ``counters`` must differ between the
    draws of a row: the decoder passes the tokens generated so far."""

    keys: Tensor  # [B] int64 in [0, 2**32): mix of seed and counter

    @classmethod
    def for_rows(cls, seeds: Tensor, counters: Tensor) -> RowStreams:
        seed_key = mix32((seeds & MASK32) ^ mix32((seeds >> 32) & MASK32 ^ 0x5BD1E995))
        return cls(mix32(seed_key ^ mix32((counters + 0x27D4EB2F) & MASK32)))

    def uniform(self, stream: int, shape: tuple[int, ...]) -> Tensor:
        """[B, *shape] float32 uniforms in (0, 1): 24 bits, so 0 and 1 are never produced."""
        index = torch.arange(math.prod(shape), device=self.keys.device).view(shape)
        per_index = mix32(index ^ mix32(torch.tensor(stream * 0x9E3779B9 & MASK32)))
        bits = mix32(self.keys.view(-1, *[1] * len(shape)) ^ per_index) >> 8
        return (bits.float() + 0.5) * (1.0 / (1 << 24))

    def exponential(self, stream: int, shape: tuple[int, ...]) -> Tensor:
        """[B, *shape] Exp(1) noise, finite and > 0 (−log of ``uniform``)."""
        return self.uniform(stream, shape).log_().neg_()


def row_randoms(streams: RowStreams, k: int, vocab: int) -> Randoms:
    """The correction's random numbers of one round, from each row's own stream."""
    return Randoms(accept_uniforms=streams.uniform(STREAM_ACCEPT, (k,)),
                   sample_noise=streams.exponential(STREAM_SAMPLE, (vocab,)))


RADIX_BITS = 10  # a float32 in [0, 1] has 30 bits below its sign and top exponent bit
# top_p_floor's histograms per distribution: 3 rounds of 2 * 2^RADIX_BITS bins, whatever the
# vocabulary (with a small one they, not the logits, are a row's temporaries)
TOP_P_ELEMENTS = 3 * 2 * (1 << RADIX_BITS)
TOP_P_SMALLEST = 2.0**-20  # top_p_floor's effective least top_p (the same nucleus below it)


def top_p_floor(probs: Tensor, top_p: float) -> tuple[Tensor, Tensor]:
    """The top-p set (nucleus) of each row of ``probs`` (distributions over the last dim),
    without a sort. Returns (floor, mass), both [..., 1]: the nucleus is the tokens whose
    probability's float32 bit pattern read as int32 is > floor (non-negative floats order
    like their bit patterns), and mass is the probability it holds.

    The definition, shared with the fused kernels: a token is in the nucleus iff the tokens
    strictly more probable than it hold less than top_p. That is the smallest set of most
    probable tokens whose mass reaches top_p, with tokens of equal probability all in or all
    out (a sort would have to order them, and where it cut them would depend on that order).

    A radix select finds the nucleus' least probable bit pattern: three rounds, each a
    histogram of the next 10 bits of the tokens in the range the rounds before left, keep the
    lowest bin whose mass strictly above is < top_p. Three scatter-add passes over the rows,
    for any distribution; the kernels bisect the same bit patterns, one bit per pass."""
    # a top_p below float32's resolution near 1 is lost in ``top - top_p`` below, which then
    # skips every bin (an empty nucleus: NaN probabilities). Any top_p <= 2^-20 keeps the
    # same nucleus, the likeliest tokens only: the top one holds >= 1/V > 2^-20 of the mass
    # for any vocabulary under 2^20
    top_p = max(top_p, TOP_P_SMALLEST)
    flat = probs.reshape(-1, probs.shape[-1])
    row_elements = max(flat.shape[-1], TOP_P_ELEMENTS)
    if len(row_blocks(flat.shape[0], row_elements, flat.device)) > 1:
        # on the CPU in row blocks: the histograms of many rows would not fit the heap
        floor, mass = by_row_blocks(lambda rows: top_p_floor(rows, top_p), row_elements, flat)
        return floor.reshape(*probs.shape[:-1], 1), mass.reshape(*probs.shape[:-1], 1)
    p = probs.float().contiguous()
    bits = p.view(torch.int32)
    lead, width = p.shape[:-1], 1 << RADIX_BITS
    hists = p.new_zeros(3, *lead, 2 * width)
    start = bits.new_zeros(*lead, 1)  # the range left: the prefix of its bit patterns
    above = p.new_zeros(*lead, 1)  # the mass above the range
    prefix = None
    for level, shift in enumerate((2 * RADIX_BITS, RADIX_BITS, 0)):
        hist = hists[level]
        fine = bits >> shift if shift else bits
        if prefix is None:  # the first round: the top bits, < 1017 (p <= 1)
            index = fine
        else:
            # tokens outside the range go to bins width.. by their own bits (piled into one
            # bin, the adds would each wait on the one before): + width where prefix != start
            index = (prefix ^ start).clamp_(max=1).mul_(width).add_(fine & (width - 1))
        cum = hist.scatter_add_(-1, index.long(), p)[..., :width].cumsum(-1)
        top = above + cum[..., -1:]  # the mass from the range's bottom up
        # skip the bins whose mass strictly above reaches top_p: they hold no member. At most
        # width - 1 of them, so float rounding can't move the boundary out of the range
        skip = (cum[..., : width - 1] <= top - top_p).sum(-1, keepdim=True)
        above = top - cum.gather(-1, skip)
        start = (start << RADIX_BITS) + skip.int()
        prefix = fine
    return start - 1, above + hist.gather(-1, skip)


def top_p_mask(probs: Tensor, top_p: float) -> Tensor:
    """Boolean mask of the nucleus of ``probs`` (distributions over the last dim): the tokens
    whose strictly more probable tokens hold less than top_p (``top_p_floor``)."""
    if top_p >= 1.0:
        return torch.ones_like(probs, dtype=torch.bool)
    floor, _ = top_p_floor(probs, top_p)
    return probs.float().contiguous().view(torch.int32) > floor


def softmax_at(logits: Tensor, temperature: float) -> Tensor:
    """softmax(logits / T) in float32; float32 logits are not copied at T = 1."""
    if temperature != 1.0:
        logits = logits.float() / temperature
    return torch.softmax(logits, dim=-1, dtype=torch.float32)


def sampling_probs(logits: Tensor, temperature: float, top_p: float) -> Tensor:
    """The distribution plain decoding samples from: softmax(logits / T) cut to top-p."""
    probs = softmax_at(logits, temperature)
    if top_p < 1.0:
        floor, mass = top_p_floor(probs, top_p)
        probs.mul_(probs.view(torch.int32) > floor).div_(mass)
    return probs


def sample(probs: Tensor, noise: Tensor) -> Tensor:
    """Draw from probs (unnormalised is fine) with the exponential race; noise ~ Exp(1)."""
    return (probs / noise).argmax(dim=-1)


def check_randoms(params: RuleParams, randoms: Randoms | None) -> None:
    """Every rule but greedy samples (its acceptance or its correction): it needs randoms."""
    if randoms is None and not params.is_greedy:
        raise ValueError(f"rule {params.rule!r} samples: it needs random numbers (Randoms)")


BLOCK_ELEMENTS = 1 << 20


def row_blocks(rows: int, row_elements: int, device: torch.device) -> list[slice]:
    """Slices of ``rows`` whose float32 temporaries hold at most BLOCK_ELEMENTS (4 MB) on the
    CPU: glibc maps a buffer over 32 MB afresh for every call, and faulting its pages in costs
    more than the arithmetic on it, while smaller ones reuse the heap. One slice on an
    accelerator, whose caching allocator keeps its memory."""
    if torch.device(device).type != "cpu":
        return [slice(0, rows)]
    step = max(1, BLOCK_ELEMENTS // max(row_elements, 1))
    return [slice(i, i + step) for i in range(0, max(rows, 1), step)]


def by_row_blocks(fn: Callable[..., tuple[Tensor, ...]], row_elements: int,
                  *tensors: Tensor | None) -> tuple[Tensor, ...]:
    """fn over the row blocks (``row_blocks``) of tensors that share dim 0 (None passes
    through), each of its results concatenated over the blocks."""
    first = next(t for t in tensors if t is not None)
    parts = [fn(*(t if t is None else t[rows] for t in tensors))
             for rows in row_blocks(first.shape[0], row_elements, first.device)]
    return parts[0] if len(parts) == 1 else tuple(torch.cat(p) for p in zip(*parts, strict=True))


def mass_above(probs: Tensor, p: Tensor) -> Tensor:
    """For each row of ``probs`` [..., V], the mass of the tokens more probable than p [...]:
    whether p's token is in the nucleus, without finding the nucleus (mass_above < top_p)."""
    return (probs * (probs > p[..., None])).sum(-1)


def acceptance_mask(
    logits: Tensor,
    draft_tokens: Tensor,
    draft_probs: Tensor | None,
    params: RuleParams,
    accept_uniforms: Tensor | None,
    probs: Tensor | None = None,
    nucleus: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """[B, K] whether each draft token passes the rule on its own (before the prefix scan).

    logits [B, K, V] at the draft positions. probs: the distribution the rule tests there,
    if already computed (``exact``: softmax(logits / T); the others: softmax(logits)), and
    for ``exact`` with top-p its nucleus (``top_p_floor``)."""
    d = draft_tokens[..., None]
    if params.rule == "greedy":
        return logits.argmax(-1) == draft_tokens
    if params.rule == "ratio":
        # p(d) / p(best alternative) = exp(x_d − x_alt): the logits alone decide
        best_alt = logits.scatter(-1, d, float("-inf")).amax(-1)
        return logits.gather(-1, d)[..., 0].float() - best_alt.float() >= math.log(params.gamma)
    exact = params.rule == "exact"
    if probs is None:
        probs = softmax_at(logits, params.temperature if exact else 1.0)
    p_draft = probs.gather(-1, d)[..., 0]
    if exact:
        if accept_uniforms is None:
            raise ValueError("rule 'exact' samples: it needs random numbers (Randoms)")
        if params.top_p < 1.0:
            floor, mass = top_p_floor(probs, params.top_p) if nucleus is None else nucleus
            inside = p_draft.view(torch.int32) > floor[..., 0]
            p_draft = torch.where(inside, p_draft / mass[..., 0], 0.0)
        q_draft = 1.0 if draft_probs is None else draft_probs.gather(-1, d)[..., 0]
        # accept with probability min(1, p/q), written without a division
        return accept_uniforms * q_draft < p_draft
    if params.rule == "threshold":
        return p_draft > params.tau
    # entropy −Σ p log p = lse − Σ p·x, with lse = max x − log max p (the top token's p is
    # 1 / Σ exp(x − max x)). Tokens with p = 0 and x = −inf (a masked vocabulary) make
    # 0·(−inf) = NaN terms: nansum leaves them out, as their 0 contribution
    lse = logits.amax(-1).float() - probs.amax(-1).log()
    h = lse - (probs * logits).nansum(-1)
    if params.rule == "dynamic":
        accept = p_draft > params.tau * (1.0 + params.alpha * h)
        if params.top_p_membership and params.top_p < 1.0:
            accept &= mass_above(probs, p_draft) < params.top_p
        return accept
    # typical (Medusa): p > min(ε, δ · exp(−H))
    return p_draft > torch.clamp(params.delta * torch.exp(-h), max=params.epsilon)


def accepted_length(accept: Tensor, num_drafted: Tensor | None = None) -> Tensor:
    """[B] the accepted prefix of each row of accept [B, K]; positions at or past
    num_drafted [B] count as rejected."""
    if num_drafted is not None:
        positions = torch.arange(accept.shape[1], device=accept.device)
        accept = accept & (positions < num_drafted[:, None])
    return accept.long().cumprod(-1).sum(-1)


def correct_greedy(target_logits: Tensor, draft_tokens: Tensor,
                   num_drafted: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``correct`` for the greedy rule: an argmax per position and a compare."""
    B, K = draft_tokens.shape
    if K == 0:  # plain greedy decoding: the argmax of the last logits
        return (torch.zeros(B, dtype=torch.long, device=target_logits.device),
                target_logits[:, 0].argmax(-1))
    target = target_logits.argmax(-1)  # [B, K+1]: the test and the next token
    num_accepted = accepted_length(target[:, :K] == draft_tokens, num_drafted)
    return num_accepted, target.gather(1, num_accepted[:, None])[:, 0]


def correct_sampled(
    target_logits: Tensor,
    draft_tokens: Tensor,
    draft_probs: Tensor | None,
    accept_uniforms: Tensor,
    sample_noise: Tensor,
    num_drafted: Tensor | None,
    params: RuleParams,
) -> tuple[Tensor, Tensor]:
    """``correct`` for the rules that sample, on rows that fit one block (``row_blocks``)."""
    B, K = draft_tokens.shape
    rows = torch.arange(B, device=draft_tokens.device)
    T, top_p, exact = params.temperature, params.top_p, params.rule == "exact"
    probs = nucleus = None
    if K == 0:  # plain sampling from position 0
        num_accepted = torch.zeros(B, dtype=torch.long, device=draft_tokens.device)
    else:
        # exact tests the distribution it samples; the other rules test the plain softmax,
        # the sampled one too at T = 1. Then one softmax (and nucleus) over the K+1 positions
        # serves the test and the stop position; the ratio rule tests the logits alone
        shared = exact or T == 1.0
        if params.rule != "ratio":
            probs = softmax_at(target_logits[:, : K + shared], T if exact else 1.0)
            if exact and top_p < 1.0:
                nucleus = top_p_floor(probs, top_p)
        accept = acceptance_mask(
            target_logits[:, :K], draft_tokens, draft_probs, params, accept_uniforms,
            None if probs is None else probs[:, :K],
            None if nucleus is None else (nucleus[0][:, :K], nucleus[1][:, :K]))
        num_accepted = accepted_length(accept, num_drafted)
        probs = probs if shared else None

    # the token at the stop position: from the temperature + top-p distribution p
    if probs is None:
        stop_logits = target_logits[:, 0] if K == 0 else target_logits[rows, num_accepted]
        probs = softmax_at(stop_logits, T)
    else:
        probs = probs[rows, num_accepted]
        if nucleus is not None:
            nucleus = nucleus[0][rows, num_accepted], nucleus[1][rows, num_accepted]
    if top_p < 1.0:
        floor, mass = top_p_floor(probs, top_p) if nucleus is None else nucleus
        probs.mul_(probs.view(torch.int32) > floor)
        if exact and K:  # the residual below needs p normalised (a race alone does not)
            probs.div_(mass)
    if not exact or K == 0:
        return num_accepted, sample(probs, sample_noise)
    # exact: rejected rows draw from norm(max(p − q, 0)); rows past their drafts take the bonus
    stop = num_accepted.clamp(max=K - 1)
    if draft_probs is None:  # one-hot q: the residual is p without the rejected token
        residual = probs.scatter(-1, draft_tokens[rows, stop, None], 0.0)
    else:
        residual = (probs - draft_probs[rows, stop]).clamp_(min=0.0)
    score = residual.div_(sample_noise)
    from_residual = score.argmax(-1)
    # p == q leaves no residual mass; such a row was accepted with probability 1 anyway
    has_mass = score.gather(1, from_residual[:, None])[:, 0] > 0
    rejected = num_accepted < (K if num_drafted is None else num_drafted)
    return num_accepted, torch.where(rejected & has_mass, from_residual,
                                     sample(probs, sample_noise))


def correct(
    target_logits: Tensor,
    draft_tokens: Tensor,
    draft_probs: Tensor | None,
    params: RuleParams,
    randoms: Randoms | None,
    num_drafted: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Apply the rule: returns (num_accepted [B], next_token [B]).

    target_logits [B, K+1, V]; draft_tokens [B, K]; draft_probs [B, K, V] or None (a greedy
    draft: one-hot). randoms may be None for ``greedy`` (it draws nothing). num_drafted [B]
    (optional, <= K) treats positions at or past it as not drafted: the row stops there and
    takes the verifier's token (adaptive K, per-request K, causal audit).
    K = 0 is plain decoding: the next token comes from position 0.
    """
    check_randoms(params, randoms)
    if params.is_greedy:
        return correct_greedy(target_logits, draft_tokens, num_drafted)
    # rows are independent: on the CPU they go in blocks that keep temporaries small
    positions, vocab = target_logits.shape[1:]
    num_accepted, next_token = by_row_blocks(
        lambda *tensors: correct_sampled(*tensors, params), positions * max(vocab, TOP_P_ELEMENTS),
        target_logits, draft_tokens, draft_probs, randoms.accept_uniforms,
        randoms.sample_noise, num_drafted)
    return num_accepted, next_token
