"""Batched speculative decoding: draft K → verify K+1 in one pass → correct → roll back.

State per row: ``lengths[b]`` tokens have K/V in the verifier cache, and the newest token
(not yet in the cache) sits in ``tokens[b, lengths[b]]``. A round drafts K tokens after it,
runs the verifier once over [newest, d_1 … d_K] at the row's own positions, lets the
correction rule accept a prefix of n tokens, and moves the row to ``lengths + n + 1`` with the
rule's token as the new newest one. Rolling back is that assignment: cache entries past the
new length are never read before the next round overwrites them. The draft caches follow the
same lengths (each draft pass re-feeds the few real tokens it may not have seen yet).

The device work of a round is vectorised over rows and positions; the round ends with one
host transfer (the tokens each row gained, for streaming, plus the stop flags).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .correction import (
    MAX_K,
    RuleParams,
    check_k,
    correct,
    draw_randoms,
    sample,
    sampling_probs,
)
from .model import KVCache, Transformer, new_kv_cache

DRAFTERS = ("model", "parallel", "self")


@dataclass
class Drafter:
    """What proposes the draft block.

    model: a separate small model, K autoregressive steps on its own KV cache.
    parallel: one pass over [newest, mask × (K−1)] proposes all K tokens (PARD-style).
    self: the verifier's first ``num_layers`` layers + final norm + LM head; it shares the
    verifier's cache for those layers (the verify pass writes identical K/V for them).
    """

    kind: str
    model: Transformer
    num_layers: int | None = None
    mask_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in DRAFTERS:
            raise ValueError(f"drafter must be one of {', '.join(DRAFTERS)}; got {self.kind!r}")
        if self.kind == "parallel" and self.mask_token_id is None:
            self.mask_token_id = self.model.config.mask_token_id
            if self.mask_token_id is None:
                raise ValueError(
                    "parallel drafter needs mask_token_id (set it in the draft's config.json)"
                )
        if self.kind == "self":
            n = self.model.config.n_layers
            if self.num_layers is None:
                self.num_layers = self.model.config.self_draft_layers or 1
            if not 1 <= self.num_layers < n:
                raise ValueError(
                    f"self_draft_layers must be in [1, {n - 1}]; got {self.num_layers}"
                )


@dataclass
class SpecStats:
    """Speculation metrics, named as vLLM names them."""

    num_drafts: int = 0  # verify steps that carried at least one draft token
    verify_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    generated_tokens: int = 0
    rollbacks: int = 0  # verify steps that rejected a draft token
    causal_leaks: int = 0  # verify steps cut short by the attention audit
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    draft_time: float = 0.0
    verify_time: float = 0.0
    correct_time: float = 0.0
    total_time: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verify step, the bonus/correction token included."""
        return (self.accepted_tokens + self.verify_steps) / max(self.verify_steps, 1)

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in
                zip(self.accepted_per_position, self.drafted_per_position, strict=True)]

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.total_time if self.total_time else 0.0

    def to_dict(self) -> dict:
        busy = self.draft_time + self.verify_time + self.correct_time
        return {
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "verify_steps": self.verify_steps,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "generated_tokens": self.generated_tokens,
            "rollbacks": self.rollbacks,
            "causal_leaks": self.causal_leaks,
            "per_position_acceptance": self.per_position_acceptance,
            "tokens_per_second": self.tokens_per_second,
            "time_s": {"draft": self.draft_time, "verify": self.verify_time,
                       "correct": self.correct_time, "total": self.total_time},
            "time_share": {k: (v / busy if busy else 0.0) for k, v in
                           [("draft", self.draft_time), ("verify", self.verify_time),
                            ("correct", self.correct_time)]},
        }


@dataclass
class GenerationResult:
    token_ids: list[list[int]]  # generated tokens per row, prompt excluded
    row_stats: list[SpecStats]
    stats: SpecStats  # aggregate over rows (times are for the whole batch)


class SpeculativeDecoder:
    """Batched speculative decoding over preallocated caches (one slot per row).

    ``drafter=None`` or ``k=0`` is plain autoregressive decoding through the same loop (the
    baseline). ``adaptive_k``: per row, K += 2 after a fully accepted block, K −= 1 otherwise,
    within [1, k]. ``audit_epsilon``: run the verifier with the attention causal audit (seed
    scheme 3) and roll back at the first draft position that attends to a later one with
    weight > ε.
    """

    def __init__(
        self,
        verifier: Transformer,
        drafter: Drafter | None = None,
        params: RuleParams | None = None,
        k: int = 4,
        adaptive_k: bool = False,
        audit_epsilon: float | None = None,
        max_batch_size: int = 8,
        max_seq_len: int = 512,
        draft_sampling: bool | None = None,
    ):
        self.verifier = verifier
        self.drafter = drafter
        self.params = params or RuleParams()
        self.k = 0 if drafter is None else k
        if drafter is not None:
            check_k(k)
            if drafter.kind == "parallel" and k > MAX_K // 2:
                raise ValueError(f"k must be <= {MAX_K // 2} for the parallel drafter; got {k}")
            if drafter.model.config.vocab_size != verifier.config.vocab_size:
                raise ValueError(
                    f"draft vocab_size {drafter.model.config.vocab_size} != verifier vocab_size "
                    f"{verifier.config.vocab_size}"
                )
        if audit_epsilon is not None and not 0.0 <= audit_epsilon < 1.0:
            raise ValueError(f"audit_epsilon must be in [0, 1); got {audit_epsilon}")
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an integer >= 1; got {max_batch_size!r}")
        self.adaptive_k = adaptive_k
        self.audit_epsilon = audit_epsilon
        # sampled drafts (with their q) only pay off for the lossless sampling rule
        self.draft_sampling = self.params.rule == "exact" if draft_sampling is None else (
            draft_sampling)
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.margin = 2 * self.k + 2  # room for a round's draft/verify writes past the length
        dtype = next(verifier.parameters()).dtype
        device = next(verifier.parameters()).device
        self.device = device
        size = max_seq_len + self.margin
        self.cache = new_kv_cache(verifier.config, max_batch_size, size, dtype, device)
        self.draft_cache: KVCache | None = None
        if drafter is not None and drafter.kind != "self":
            draft_dtype = next(drafter.model.parameters()).dtype
            self.draft_cache = new_kv_cache(
                drafter.model.config, max_batch_size, size, draft_dtype, device
            )

    # -- one round's pieces -------------------------------------------------------------

    def _draft(
        self, tokens: Tensor, lengths: Tensor, k: int, bound: int, gen: torch.Generator
    ) -> tuple[Tensor, Tensor | None]:
        d = self.drafter
        B = lengths.shape[0]
        if d.kind == "parallel":
            # re-feed the last K_max+1 real tokens (the cache may lack up to that many after a
            # fully accepted block), then K−1 masks; outputs at offsets 0..k−1 are the drafts
            offsets = torch.arange(-self.k, k, device=lengths.device)
            pos = (lengths[:, None] + offsets).clamp(min=0)
            real = tokens.gather(1, pos)
            inputs = torch.where(offsets <= 0, real, d.mask_token_id)
            out_idx = (self.k + torch.arange(k, device=lengths.device)).expand(B, -1)
            logits, _ = d.model(inputs, pos, self.draft_cache, kv_len=bound, output_index=out_idx)
            return self._choose_drafts(logits, gen)
        # autoregressive drafters: the separate model re-feeds the token before the newest
        # (missing from its cache after a fully accepted block); the self-draft's layers were
        # already written by the verify pass, so it feeds only the newest token
        cache, window = (self.cache, 1) if d.kind == "self" else (self.draft_cache, 2)
        pos = lengths[:, None] + torch.arange(1 - window, 1, device=lengths.device)
        inputs = tokens.gather(1, pos)
        last = torch.full((B, 1), window - 1, device=lengths.device)
        drafts, probs = [], []
        for i in range(k):
            logits, _ = d.model(inputs, pos, cache, kv_len=bound, output_index=last,
                                num_layers=d.num_layers)
            token, q = self._choose_drafts(logits, gen)
            drafts.append(token)
            probs.append(q)
            inputs, pos = token, lengths[:, None] + 1 + i
            last = torch.zeros((B, 1), dtype=torch.long, device=lengths.device)
        return torch.cat(drafts, 1), None if probs[0] is None else torch.cat(probs, 1)

    def _choose_drafts(self, logits: Tensor, gen: torch.Generator) -> tuple[Tensor, Tensor | None]:
        if not self.draft_sampling:
            return logits.argmax(-1), None
        q = sampling_probs(logits, self.params.temperature, self.params.top_p)
        noise = torch.empty_like(q).exponential_(generator=gen)
        return sample(q, noise), q

    # -- the loop -----------------------------------------------------------------------

    def stream(
        self,
        prompts: list[list[int]],
        max_new_tokens: int | list[int],
        seed: int = 0,
        eos_token_id: int | None = None,
        stats: list[SpecStats] | None = None,
    ) -> Iterator[list[list[int]]]:
        """Yield, per round, the tokens each row gained (an empty list for finished rows).

        ``stats``: pass an empty list to receive per-row SpecStats (filled when done).
        """
        B = len(prompts)
        if not 1 <= B <= self.max_batch_size:
            raise ValueError(f"batch size must be in [1, {self.max_batch_size}]; got {B}")
        if isinstance(max_new_tokens, int):
            max_new_tokens = [max_new_tokens] * B
        vocab = self.verifier.config.vocab_size
        for p, m in zip(prompts, max_new_tokens, strict=True):
            if not p:
                raise ValueError("prompt must contain at least one token")
            if not isinstance(m, int) or m < 1:
                raise ValueError(f"max_new_tokens must be an integer >= 1; got {m!r}")
            if len(p) + m > self.max_seq_len:
                raise ValueError(
                    f"prompt length + max_new_tokens must be <= max_seq_len={self.max_seq_len}; "
                    f"got {len(p)} + {m}"
                )
            if min(p) < 0 or max(p) >= vocab:
                raise ValueError(f"prompt token ids must be in [0, {vocab - 1}]")
        dev = self.device
        gen = torch.Generator(device=dev).manual_seed(seed)
        k_max = self.k
        eos = -1 if eos_token_id is None else eos_token_id
        t_start = time.perf_counter()

        prompt_lens = torch.tensor([len(p) for p in prompts], device=dev)
        t_prompt = int(prompt_lens.max())
        tokens = torch.zeros(B, self.max_seq_len + self.margin, dtype=torch.long, device=dev)
        for b, p in enumerate(prompts):  # host → device once, before the loop
            tokens[b, : len(p)] = torch.tensor(p)
        limit = torch.tensor(max_new_tokens, device=dev)
        generated = torch.zeros(B, dtype=torch.long, device=dev)
        active = torch.ones(B, dtype=torch.bool, device=dev)
        k_rows = torch.full((B,), max(k_max, 1), device=dev)
        counters = torch.zeros(6, B, dtype=torch.long, device=dev)  # see _finish
        per_pos = torch.zeros(2, B, max(k_max, 1), dtype=torch.long, device=dev)
        times = [0.0, 0.0, 0.0]

        # prefill: verifier (and a separate draft) over the prompts, right-padded; the first
        # token comes from the same correction code with K = 0
        pos = torch.arange(t_prompt, device=dev).expand(B, -1)
        last = (prompt_lens - 1)[:, None]
        logits, _ = self.verifier(tokens[:, :t_prompt], pos, self.cache, kv_len=t_prompt,
                                  output_index=last)
        if self.draft_cache is not None:
            self.drafter.model(tokens[:, :t_prompt], pos, self.draft_cache, kv_len=t_prompt,
                               output_index=last)
        empty = torch.zeros(B, 0, dtype=torch.long, device=dev)
        _, first = correct(logits, empty, None, self.params, draw_randoms(B, 0, vocab, gen, dev))
        lengths = prompt_lens.clone()
        tokens.scatter_(1, lengths[:, None], first[:, None])
        emitted = first[:, None]
        num_accepted = torch.zeros(B, dtype=torch.long, device=dev)
        k_host = k_max

        while True:
            # stop handling, vectorised: keep tokens up to EOS and within max_new_tokens
            width = emitted.shape[1]
            valid = torch.arange(width, device=dev) <= num_accepted[:, None]
            is_eos = valid & (emitted == eos)
            first_eos = torch.where(is_eos.any(1), is_eos.int().argmax(1), width)
            keep = torch.minimum(num_accepted + 1, first_eos + 1)
            keep = torch.minimum(keep, limit - generated) * active
            generated += keep
            active &= (first_eos == width) & (generated < limit)
            if self.adaptive_k:
                grow = (num_accepted == k_rows)
                k_rows = torch.where(grow, k_rows + 2, k_rows - 1).clamp(1, max(k_max, 1))
            # the round's single host transfer
            host = torch.cat([keep[:, None], active[:, None], k_rows[:, None], lengths[:, None],
                              emitted], 1).tolist()
            yield [row[4: 4 + row[0]] for row in host]
            live = [row for row in host if row[1]]
            if not live:
                break
            bound = max(row[3] for row in live) + 2 * k_max + 2
            if k_max:
                k_host = max(row[2] for row in live) if self.adaptive_k else k_max

            t0 = time.perf_counter()
            if k_max:
                draft_tokens, draft_probs = self._draft(tokens, lengths, k_host, bound, gen)
            else:
                draft_tokens, draft_probs = empty, None
            t1 = time.perf_counter()
            verify_in = torch.cat([tokens.gather(1, lengths[:, None]), draft_tokens], 1)
            pos = lengths[:, None] + torch.arange(k_host + 1 if k_max else 1, device=dev)
            audit = self.audit_epsilon is not None
            logits, leak = self.verifier(verify_in, pos, self.cache, kv_len=bound, audit=audit)
            t2 = time.perf_counter()
            width = draft_tokens.shape[1]
            num_drafted = k_rows.clamp(max=width) if self.adaptive_k else None
            if audit:
                # a position that looked at a later one has untrustworthy logits: stop there
                leaked = leak > self.audit_epsilon
                first_leak = torch.where(leaked.any(1), leaked.int().argmax(1), width)
                cut = torch.minimum(first_leak, num_drafted if num_drafted is not None else
                                    torch.full_like(first_leak, width))
                counters[5] += (first_leak < width + 1) & leaked.any(1) & active
                num_drafted = cut
            randoms = draw_randoms(B, width, vocab, gen, dev)
            num_accepted, next_token = correct(
                logits, draft_tokens, draft_probs, self.params, randoms, num_drafted
            )
            # emitted block: accepted drafts, then the rule's token at index num_accepted
            emitted = torch.cat([draft_tokens, next_token[:, None]], 1)
            emitted.scatter_(1, num_accepted[:, None], next_token[:, None])
            write_pos = lengths[:, None] + 1 + torch.arange(width + 1, device=dev)
            tokens.scatter_(1, write_pos, emitted)
            drafted = num_drafted if num_drafted is not None else torch.full_like(lengths, width)
            lengths = torch.where(active, lengths + num_accepted + 1, lengths)
            # metrics, on device
            act = active.long()
            counters[0] += act
            counters[1] += drafted * act
            counters[2] += num_accepted * act
            counters[3] += (num_accepted < drafted).long() * act
            counters[4] += (drafted > 0).long() * act
            if width:
                p = torch.arange(width, device=dev)
                per_pos[0, :, :width] += (p < num_accepted[:, None]).long() * act[:, None]
                per_pos[1, :, :width] += (p < drafted[:, None]).long() * act[:, None]
            t3 = time.perf_counter()
            times[0] += t1 - t0
            times[1] += t2 - t1
            times[2] += t3 - t2

        if stats is not None:
            stats.extend(self._finish(counters, per_pos, generated, times, t_start))

    def _finish(self, counters, per_pos, generated, times, t_start) -> list[SpecStats]:
        total = time.perf_counter() - t_start
        c, pp, g = counters.tolist(), per_pos.tolist(), generated.tolist()
        k = self.k
        return [
            SpecStats(
                verify_steps=c[0][b], draft_tokens=c[1][b], accepted_tokens=c[2][b],
                rollbacks=c[3][b], num_drafts=c[4][b], causal_leaks=c[5][b],
                generated_tokens=g[b],
                accepted_per_position=pp[0][b][:k], drafted_per_position=pp[1][b][:k],
                draft_time=times[0], verify_time=times[1], correct_time=times[2],
                total_time=total,
            )
            for b in range(len(g))
        ]

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int | list[int],
        seed: int = 0,
        eos_token_id: int | None = None,
    ) -> GenerationResult:
        out: list[list[int]] = [[] for _ in prompts]
        row_stats: list[SpecStats] = []
        for step in self.stream(prompts, max_new_tokens, seed, eos_token_id, row_stats):
            for row, new in zip(out, step, strict=True):
                row.extend(new)
        return GenerationResult(out, row_stats, aggregate(row_stats))


def aggregate(rows: list[SpecStats]) -> SpecStats:
    """Sum per-row counts; wall-clock times are shared by the batch, so take them once."""
    if not rows:
        return SpecStats()
    total = SpecStats(
        draft_time=rows[0].draft_time, verify_time=rows[0].verify_time,
        correct_time=rows[0].correct_time, total_time=rows[0].total_time,
        accepted_per_position=[0] * len(rows[0].accepted_per_position),
        drafted_per_position=[0] * len(rows[0].drafted_per_position),
    )
    for r in rows:
        for name in ("num_drafts", "verify_steps", "draft_tokens", "accepted_tokens",
                     "generated_tokens", "rollbacks", "causal_leaks"):
            setattr(total, name, getattr(total, name) + getattr(r, name))
        total.accepted_per_position = [
            a + b for a, b in zip(total.accepted_per_position, r.accepted_per_position,
                                  strict=True)]
        total.drafted_per_position = [
            a + b for a, b in zip(total.drafted_per_position, r.drafted_per_position,
                                  strict=True)]
    return total
