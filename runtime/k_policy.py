"""How many tokens a round drafts (K).

- Per row, adaptive K: +2 after a fully accepted block, −1 otherwise, within [1, K] (the
  heuristic of transformers' assisted generation).
- Per round, by batch size: TensorRT-LLM's ``draft_len_schedule`` ({threshold: K}), vLLM's
  ``speculative_disable_by_batch_size``, or ``"auto"`` (the default where a drafter runs): the
  goodput policy (``plan_round``). Per round it picks the draft model's K and the cap on the
  n-gram lookup's drafts with the most expected tokens per second, from each drafter's own
  running acceptance α and the costs of the round's parts measured on this machine
  (``RoundCosts``: calibrated at start, refreshed from every live round). A batched verify pass
  costs more per extra position as the batch grows, so the best K shrinks with the batch, and
  K = 0 (a plain step) wins whenever no K is expected to beat it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor


def analytic_length(alpha: float, k: int) -> float:
    """Expected tokens per verify step for per-token acceptance α (Leviathan et al.)."""
    if alpha >= 1.0:
        return k + 1.0
    return (1 - alpha ** (k + 1)) / (1 - alpha)


PLAIN_PROBE_ROUNDS = 32  # a drafting policy re-times a plain step once in this many rounds
# a round drafts only where it is expected to beat a plain step by this factor: the model
# (analytic length at the running α, costs from earlier rounds) was 10-20 % optimistic
# against the realized goodput under load (paradraft_goodput_expected / _realized)
DRAFT_MARGIN = 1.10


@dataclass
class RoundCosts:
    """Seconds a round's parts take on this machine, per running batch size (row b: b + 1
    rows) and K (column k): ``verify``: the verifier over K + 1 positions, the correction and
    the host's bookkeeping; ``draft``: the draft model proposing K tokens (0 at K = 0). An
    n-gram lookup's cost is in neither: it runs before the policy decides, whatever it picks.
    Calibrated at start (``from_calibration``), then each live round moves its batch size's
    row (``observe``, ``follow``): costs move with the context length, the load and the rule."""

    verify: list[list[float]]
    draft: list[list[float]]
    refresh: float = 0.1  # a live round's weight in its row (an exponential average)
    revision: int = 0  # bumped by every change: the metrics resend only what moved
    # planned rounds at each batch size since its plain step (K = 0) was last timed: the
    # baseline every plan is weighed against, which a policy that keeps drafting would never
    # refresh (one slow spell while it was calibrated, and it drafts at a loss for good)
    since_plain: list[int] | None = None

    def __post_init__(self) -> None:
        if self.since_plain is None:
            self.since_plain = [0] * len(self.verify)

    def plain_is_stale(self, batch_size: int) -> bool:
        """Whether this round should be a plain step that re-times the baseline: one in
        ``PLAIN_PROBE_ROUNDS`` planned rounds at a batch size, when the plan drafted."""
        return self.since_plain[batch_size - 1] >= PLAIN_PROBE_ROUNDS

    @classmethod
    def from_calibration(cls, sizes: list[int], verify: Tensor, draft: Tensor,
                         max_batch_size: int) -> RoundCosts:
        """Measured at ``sizes`` (rows of ``verify`` and ``draft``), filled in for every
        batch size up to ``max_batch_size`` (linear in between)."""
        def fill(table: Tensor) -> list[list[float]]:
            return [interpolate(sizes, table, b) for b in range(1, max_batch_size + 1)]
        return cls(fill(verify), fill(draft))

    def observe(self, batch_size: int, k_draft: int, width: int, draft_seconds: float,
                verify_seconds: float) -> None:
        """A live round of ``batch_size`` rows: the draft model drafted ``k_draft`` (0: it
        sat out) and the verifier checked ``width`` drafts."""
        self.since_plain[batch_size - 1] = 0 if width == 0 else (
            self.since_plain[batch_size - 1] + 1)
        follow(self.verify[batch_size - 1], width, verify_seconds, self.refresh)
        if k_draft:
            follow(self.draft[batch_size - 1], k_draft, draft_seconds, self.refresh)
        self.revision += 1


def follow(row: list[float], column: int, seconds: float, weight: float) -> None:
    """Move a batch size's costs toward a live round that took ``seconds`` at ``column``,
    every K by the same factor. What moves a round's cost while serving (longer contexts,
    the server's own work beside the loop, a catch-up of the draft cache) moves every K
    alike, while the calibration timed the K side by side; a lone cell that followed its own
    rounds would go stale whenever its K is not run. The plain cell, refreshed by nearly
    every round of a server that rarely drafts, rose above the drafting cells' calibrated
    times, and drafting looked nearly free."""
    if row[column] <= 0.0:  # nothing to scale from
        row[column] = seconds
        return
    factor = 1.0 + weight * (seconds / row[column] - 1.0)
    row[:] = [cost * factor for cost in row]


def interpolate(sizes: list[int], table: Tensor, batch_size: int) -> list[float]:
    """Row of ``table`` (measured at ``sizes``) for ``batch_size``, linear in between."""
    i = max(j for j, size in enumerate(sizes) if size <= batch_size or j == 0)
    if i + 1 == len(sizes) or sizes[i] >= batch_size:
        return table[i].tolist()
    w = (batch_size - sizes[i]) / (sizes[i + 1] - sizes[i])
    return ((1 - w) * table[i] + w * table[i + 1]).tolist()


@dataclass
class RoundPlan:
    """The goodput policy's choice for one round, with what it expects of it."""

    k_model: int  # the draft model's K for its unpinned rows (0: it sits the round out)
    k_lookup: int  # the cap on an unpinned lookup row's drafts
    rows: int
    expected_tokens: float
    seconds: float  # the round's predicted cost
    plain_seconds: float  # a plain step's at this batch size

    @property
    def expected_speedup(self) -> float:
        """Expected tokens per second over a plain step's (one token a row)."""
        return self.expected_tokens / self.seconds * self.plain_seconds / self.rows


def plan_round(verify: list[float], draft: list[float], alpha_model: float,
               alpha_lookup: float, model_caps: list[int], model_pinned: list[bool],
               lookup_found: list[int], lookup_pinned: list[bool], trust_model: float = 1.0,
               trust_lookup: float = 1.0) -> RoundPlan:
    """SmartSpec's goodput, per drafter: the draft model's K and the lookup's cap with the
    most expected tokens per second for this round. ``verify`` / ``draft``: ``RoundCosts``'
    row for this batch size. Model rows: each drafts min(its cap, K) (a pinned row, whose
    request named its K, drafts its cap whatever K is) and gains ``analytic_length(α_model,
    ·)``; lookup rows: each keeps min(what its lookup found, cap) (pinned: all it found) and
    gains ``analytic_length(α_lookup, ·)``. The round costs the draft model's K (when any
    model row drafts) and a verify pass as wide as the widest row. (0, 0) is a plain step,
    and a plan that drafts must beat it by ``DRAFT_MARGIN``; among those, ties go to the
    smaller K. A plan's tokens per second are weighed by the trust (``AcceptanceMonitor.
    trust``: realized over expected in its past rounds) of the least trusted drafter it
    drafts with. Host arithmetic over K only: rows are counted by their cap."""
    def gains(alpha: float, caps: list[int], pinned: list[bool], top: int
              ) -> tuple[list[float], int]:
        """Expected tokens of these rows for each K in 0..top, and the width the pinned
        rows force."""
        free = [0] * (top + 1)  # unpinned rows by cap
        length = [analytic_length(alpha, k) for k in range(top + 1)]
        fixed_tokens, forced = 0.0, 0
        for cap, pin in zip(caps, pinned, strict=True):
            if pin:
                fixed_tokens += length[cap]
                forced = max(forced, cap)
            else:
                free[cap] += 1
        return [fixed_tokens + sum(n * length[min(cap, k)] for cap, n in enumerate(free))
                for k in range(top + 1)], forced

    top_model = max(model_caps, default=0)
    top_lookup = max(lookup_found, default=0)
    model_tokens, model_forced = gains(alpha_model, model_caps, model_pinned, top_model)
    lookup_tokens, lookup_forced = gains(alpha_lookup, lookup_found, lookup_pinned, top_lookup)
    rows = len(model_caps) + len(lookup_found)
    best = None
    for k_model in range(top_model + 1):
        model_width = max(k_model, model_forced) if model_caps else 0
        for k_lookup in range(top_lookup + 1):
            width = max(model_width, min(k_lookup, top_lookup), lookup_forced)
            seconds = verify[width] + (draft[model_width] if model_width else 0.0)
            tokens = model_tokens[k_model] + lookup_tokens[k_lookup]
            plan = RoundPlan(k_model, k_lookup, rows, tokens, seconds, verify[0])
            trusts = [t for t, k in ((trust_model, k_model), (trust_lookup, k_lookup)) if k]
            rate = tokens / seconds * min(trusts, default=1.0)
            if best is None:  # (0, 0) first, or the width the pinned rows force
                best, best_rate, plain_rate = plan, rate, rate
            elif rate > best_rate * (1 + 1e-9) and rate > plain_rate * DRAFT_MARGIN:
                best, best_rate = plan, rate
    return best


def check_draft_len_schedule(schedule: dict[int, int] | str | None, k: int
                             ) -> dict[int, int] | str | None:
    """TensorRT-LLM's ``draft_len_schedule``: {batch-size threshold: K}, the K of the largest
    threshold <= the running batch size ({1: 4, 4: 2, 8: 0}: K=4 below 4 rows, 2 below 8, no
    drafts from 8 on); it must hold 1. ``"auto"``: the goodput policy (``goodput_k``)."""
    if schedule is None or schedule == "auto":
        return schedule
    if not isinstance(schedule, dict) or 1 not in schedule:
        raise ValueError("draft_len_schedule must be 'auto' or a {batch size: K} mapping that "
                         f"holds batch size 1; got {schedule!r}")
    for size, n in schedule.items():
        if not isinstance(size, int) or size < 1 or not isinstance(n, int) or not 0 <= n <= k:
            raise ValueError(f"draft_len_schedule entries must be batch size >= 1 -> K in "
                             f"[0, {k}]; got {size!r}: {n!r}")
    return dict(sorted(schedule.items()))


def parse_draft_len_schedule(text: str) -> dict[int, int] | str:
    """'auto' or '1:4,4:2,8:0' (the CLI form)."""
    if text == "auto":
        return text
    try:
        return {int(a): int(b) for a, b in (item.split(":") for item in text.split(","))}
    except ValueError:
        raise ValueError("draft_len_schedule must be 'auto' or 'SIZE:K,SIZE:K,...' (e.g. "
                         f"1:4,4:2,8:0); got {text!r}") from None


def round_k(batch_size: int, k: int, disable_by_batch_size: int | None,
            schedule: dict[int, int] | str | None) -> int:
    """K for a round of ``batch_size`` rows whose largest own K is ``k``: capped by a fixed
    schedule for this batch size (0: a plain decoding step). The goodput policy
    (``"auto"``) decides later in the round (``plan_round``), within this K."""
    if disable_by_batch_size is not None and batch_size >= disable_by_batch_size:
        return 0
    if isinstance(schedule, dict):
        return min(k, schedule[max(size for size in schedule if size <= batch_size)])
    return k


def adapt_k(k_rows: Tensor, num_accepted: Tensor, k_max: int) -> Tensor:
    """Adaptive K per row: +2 after a fully accepted block, −1 otherwise, within [1, K]."""
    return torch.where(num_accepted == k_rows, k_rows + 2, k_rows - 1).clamp(1, k_max)


def calibration_batch_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, … up to ``max_batch_size`` (included)."""
    return sorted({min(2 ** i, max_batch_size) for i in range(16)})


def measure_round_costs(time_round: Callable[[int, int], tuple[float, float]],
                        batch_sizes: list[int], k: int, passes: int = 3
                        ) -> tuple[Tensor, Tensor]:
    """Seconds of the verify and draft parts, each [batch size, K = 0..k]:
    ``time_round(batch_size, k)`` times fresh rounds ((draft, verify) seconds), and each cell
    keeps its fastest. A shared machine only ever adds time, and the ``passes`` sweep every
    cell in turn so a slow spell cannot favour one K."""
    verify = torch.full((len(batch_sizes), k + 1), float("inf"), dtype=torch.float64)
    draft = torch.zeros_like(verify)
    draft[:, 1:] = float("inf")
    for _ in range(passes):
        for i, batch_size in enumerate(batch_sizes):
            for j in range(k + 1):
                draft_s, verify_s = time_round(batch_size, j)
                verify[i, j] = min(verify[i, j].item(), verify_s)
                if j:
                    draft[i, j] = min(draft[i, j].item(), draft_s)
    return verify, draft
