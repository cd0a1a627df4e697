"""Speculation metrics (named as vLLM names them), generation results, and the
acceptance-floor alert."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

log = logging.getLogger("paradraft")
TRUST_MAX = 1.25  # AcceptanceMonitor.trust's cap


@dataclass
class AcceptanceMonitor:
    """The acceptance-floor alert: warn when the running acceptance rate falls below ``floor``.

    The rate is taken over roughly the last ``window`` drafted tokens (exponential decay);
    it warns once per crossing and again only after it has recovered to ``floor +
    hysteresis`` (at most halfway from the floor to 1): a rate that hovers at the floor
    would otherwise warn every few rounds."""

    floor: float = 0.6
    name: str = "model"  # the drafter whose drafts it counts
    window: int = 512
    min_drafted: int = 64
    hysteresis: float = 0.05
    drafted: float = 0.0
    accepted: float = 0.0
    reached: float = 0.0  # draft positions reached: accepted + rejections
    alerting: bool = False
    alerts: int = 0
    # the goodput policy's realized over expected speed-up in the planned rounds this drafter
    # drafted in (an exponential average; 1 until it has drafted): what the policy's model
    # of a round (α, the calibrated costs) misses, such as the draft cache's catch-up after
    # plain rounds, it learns here and discounts the drafter's plans by
    trust: float = 1.0

    @property
    def alpha(self) -> float:
        """Running per-token acceptance P(accept | position reached) (Leviathan's α), with a
        prior of 1/2 worth two positions, so that it starts, and relaxes back, at 0.5."""
        return (self.accepted + 1.0) / (self.reached + 2.0)

    def relax(self, factor: float) -> None:
        """Fade the evidence (rounds without drafts): α drifts back to the prior, so a policy
        that stopped drafting on a low α tries again later (its exploration)."""
        self.drafted *= factor
        self.accepted *= factor
        self.reached *= factor
        self.trust = 1.0 + (self.trust - 1.0) * factor

    def judge(self, realized_over_expected: float, weight: float = 0.1) -> None:
        """A planned round this drafter drafted in made ``realized_over_expected`` of the
        speed-up the policy expected of it (capped at ``TRUST_MAX``: one lucky round must
        not make a drafter look better than its model says)."""
        self.trust += weight * (min(realized_over_expected, TRUST_MAX) - self.trust)

    def update(self, drafted: int, accepted: int, reached: int | None = None) -> None:
        if not drafted:
            return
        decay = max(0.0, 1.0 - drafted / self.window)
        self.drafted = self.drafted * decay + drafted
        self.accepted = self.accepted * decay + accepted
        self.reached = self.reached * decay + (drafted if reached is None else reached)
        rate = self.accepted / self.drafted
        if self.drafted >= self.min_drafted and rate < self.floor and not self.alerting:
            self.alerting = True
            self.alerts += 1
            log.warning("running acceptance rate of the %s drafter %.3f fell below the floor "
                        "%.3f", self.name, rate, self.floor)
        # re-arm past the hysteresis, capped halfway to 1 so that a floor near 1 re-arms too
        elif rate >= self.floor + min(self.hysteresis, (1.0 - self.floor) / 2):
            self.alerting = False


@dataclass
class RoundStats:
    """Rounds since the decoder started: how many verified each width (the K a round ran;
    0: a plain step), and, for rounds the goodput policy planned, the tokens it expected
    against those the round gave. Both goodputs are counted in plain-step tokens: what a
    plain step at the round's batch size (its predicted cost) makes in the round's predicted
    or measured time. So ``expected_speedup`` and ``realized_speedup`` are speed-ups over
    plain decoding, and their ratio is the policy's error. Sums only: a reader takes
    differences."""

    by_width: list[int]
    tokens: int = 0
    expected_tokens: float = 0.0
    plain_tokens: float = 0.0  # in the rounds' measured time
    plain_tokens_expected: float = 0.0  # in the rounds' predicted time

    def add(self, rows: int, plain_seconds: float, expected_tokens: float,
            predicted_seconds: float, tokens: int, seconds: float) -> None:
        """A planned round of ``rows`` (a plain step of them costs ``plain_seconds``) that
        was expected to gain ``expected_tokens`` in ``predicted_seconds`` and gained
        ``tokens`` in ``seconds``."""
        rate = rows / plain_seconds
        self.tokens += tokens
        self.expected_tokens += expected_tokens
        self.plain_tokens += seconds * rate
        self.plain_tokens_expected += predicted_seconds * rate

    @property
    def expected_speedup(self) -> float:
        return self.expected_tokens / self.plain_tokens_expected if self.plain_tokens else 0.0

    @property
    def realized_speedup(self) -> float:
        return self.tokens / self.plain_tokens if self.plain_tokens else 0.0


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
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache

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
            "cached_tokens": self.cached_tokens,
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
    # per row, each token's (logprob, top (id, logprob) pairs), where they were asked for
    logprobs: list[list[tuple[float, list[tuple[int, float]]]]] | None = None


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
                     "generated_tokens", "rollbacks", "causal_leaks", "cached_tokens"):
            setattr(total, name, getattr(total, name) + getattr(r, name))
        total.accepted_per_position = [
            a + b for a, b in zip(total.accepted_per_position, r.accepted_per_position,
                                  strict=True)]
        total.drafted_per_position = [
            a + b for a, b in zip(total.drafted_per_position, r.drafted_per_position,
                                  strict=True)]
    return total
