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

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .correction import (
    MAX_K,
    RuleParams,
    check_k,
    check_range,
    draw_randoms,
    exponential_noise,
    sample,
    sampling_probs,
)
from .correction_kernel import correct_for
from .model import KVCache, Transformer, new_kv_cache

DRAFTERS = ("model", "parallel", "self")
log = logging.getLogger("paradraft")


@dataclass
class AcceptanceMonitor:
    """The seed's §6.1 alert: warn when the running acceptance rate falls below ``floor``.

    The rate is taken over roughly the last ``window`` drafted tokens (exponential decay);
    it warns once per crossing and again only after it has recovered to ``floor +
    hysteresis`` (at most halfway from the floor to 1): a rate that hovers at the floor
    would otherwise warn every few rounds."""

    floor: float = 0.6
    window: int = 512
    min_drafted: int = 64
    hysteresis: float = 0.05
    drafted: float = 0.0
    accepted: float = 0.0
    reached: float = 0.0  # draft positions reached: accepted + rejections
    alerting: bool = False
    alerts: int = 0

    @property
    def alpha(self) -> float:
        """Running per-token acceptance P(accept | position reached) (Leviathan's α), with a
        prior of 1/2 worth two positions, so that it starts, and relaxes back, at 0.5."""
        return (self.accepted + 1.0) / (self.reached + 2.0)

    @property
    def alpha_optimistic(self) -> float:
        """α plus an uncertainty bonus that shrinks with the evidence (an upper confidence
        bound): with little evidence a policy keeps drafting, so it keeps measuring."""
        return min(1.0, self.alpha + 0.5 / (self.reached + 2.0) ** 0.5)

    def relax(self, factor: float) -> None:
        """Fade the evidence (rounds without drafts): α drifts back to the prior, so a policy
        that stopped drafting on a low α tries again later."""
        self.drafted *= factor
        self.accepted *= factor
        self.reached *= factor

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
            log.warning("running acceptance rate %.3f fell below the floor %.3f", rate,
                        self.floor)
        # re-arm past the hysteresis, capped halfway to 1 so that a floor near 1 re-arms too
        elif rate >= self.floor + min(self.hysteresis, (1.0 - self.floor) / 2):
            self.alerting = False


@contextmanager
def glue_threads(n: int | None) -> Iterator[None]:
    """Run the block with ``n`` torch intra-op threads (None: as they are).

    torch's thread count is process-wide: another thread whose first torch op falls inside
    the block keeps ``n`` threads. The decoder's caller (the CLI, the server's one
    scheduler thread) is the process's only heavy torch user, so this is safe there; an
    application running its own torch work in other threads should set the count itself."""
    if n is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def analytic_length(alpha: float, k: int) -> float:
    """Expected tokens per verify step for per-token acceptance α (Leviathan et al.)."""
    if alpha >= 1.0:
        return k + 1.0
    return (1 - alpha ** (k + 1)) / (1 - alpha)


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


def goodput_k(round_seconds: list[float], alpha: float) -> int:
    """The K (index into ``round_seconds``, seconds per round for K = 0, 1, …) with the most
    expected tokens per second: SmartSpec's goodput, E[tokens per step](α, K) / round time.
    The batch size scales both alike, so it cancels."""
    return max(range(len(round_seconds)),
               key=lambda k: analytic_length(alpha, k) / round_seconds[k])


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
    weight > ε. ``disable_by_batch_size``: a round with at least this many running rows
    decodes without drafts (vLLM's ``speculative_disable_by_batch_size``): on a saturated
    device a batched plain step is cheaper per token than draft + verify. A separate draft
    model's cache then falls behind; the next drafted round re-feeds the missed tokens.
    ``draft_len_schedule``: the round's K by batch size, TensorRT-LLM's {threshold: K}, or
    ``"auto"``: each round takes the K of most expected tokens per second (``goodput_k``) from
    the running α and round times measured per (batch size, K) on this machine
    (``calibrate``). A batched verify pass costs more per extra position as the batch grows,
    so the best K shrinks with the batch (measured here: K=4 at batch 1, K=1 at batch 8).
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
        acceptance_floor: float = 0.6,
        disable_by_batch_size: int | None = None,
        draft_len_schedule: dict[int, int] | str | None = None,
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
        if disable_by_batch_size is not None and (
                not isinstance(disable_by_batch_size, int) or disable_by_batch_size < 1):
            raise ValueError("disable_by_batch_size must be an integer >= 1 or None; got "
                             f"{disable_by_batch_size!r}")
        self.disable_by_batch_size = disable_by_batch_size
        self.draft_len_schedule = check_draft_len_schedule(draft_len_schedule, self.k)
        # "auto": (batch sizes, seconds per round [size, K = 0..k]), measured by calibrate()
        self.round_seconds: tuple[list[int], Tensor] | None = None
        check_range("acceptance_floor", acceptance_floor, 0.0, 1.0)
        self.monitor = AcceptanceMonitor(floor=acceptance_floor)
        self.adaptive_k = adaptive_k
        self.audit_epsilon = audit_epsilon
        # sampled drafts (with their q) only pay off for the lossless sampling rule
        self.draft_sampling = self.params.rule == "exact" if draft_sampling is None else (
            draft_sampling)
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.margin = 2 * self.k + 2  # room for a round's draft/verify writes past the length
        dtype, device = verifier.dtype, verifier.device
        self.device = device
        self.engine_on_cpu = device.type == "cpu" and not isinstance(verifier, torch.nn.Module)
        size = max_seq_len + self.margin
        self.cache = new_kv_cache(verifier.config, max_batch_size, size, dtype, device)
        self.draft_cache: KVCache | None = None
        if drafter is not None and drafter.kind != "self":
            self.draft_cache = new_kv_cache(
                drafter.model.config, max_batch_size, size, drafter.model.dtype, device
            )

    # -- one round's pieces -------------------------------------------------------------

    def _draft(
        self, tokens: Tensor, lengths: Tensor, k: int, bound: int, gen: torch.Generator,
        rows: Tensor | None = None, missed: int = 0,
    ) -> tuple[Tensor, Tensor | None]:
        """``missed``: rounds the draft cache skipped (undrafted rounds): re-feed as many
        more real tokens."""
        d = self.drafter
        B = lengths.shape[0]
        if d.kind == "parallel":
            # re-feed the last K_max+1 real tokens (the cache may lack up to that many after a
            # fully accepted block), then K−1 masks; outputs at offsets 0..k−1 are the drafts
            back = self.k + missed
            offsets = torch.arange(-back, k, device=lengths.device)
            pos = (lengths[:, None] + offsets).clamp(min=0)
            real = tokens.gather(1, pos)
            inputs = torch.where(offsets <= 0, real, d.mask_token_id)
            out_idx = (back + torch.arange(k, device=lengths.device)).expand(B, -1)
            logits, _ = d.model(inputs, pos, self.draft_cache, kv_len=bound, rows=rows,
                                output_index=out_idx)
            return self._choose_drafts(logits, gen)
        # autoregressive drafters: the separate model re-feeds the token before the newest
        # (missing from its cache after a fully accepted block); the self-draft's layers were
        # already written by the verify pass, so it feeds only the newest token
        cache, window = (self.cache, 1) if d.kind == "self" else (self.draft_cache, 2 + missed)
        pos = (lengths[:, None] + torch.arange(1 - window, 1, device=lengths.device)).clamp(min=0)
        inputs = tokens.gather(1, pos)
        # greedy drafts in one engine call where the engine has a fused k-step graph
        fused = getattr(d.model, "greedy_drafts", None)
        if fused is not None and not self.draft_sampling and k > 1:
            drafts = fused(inputs, pos, cache, k, kv_len=bound, rows=rows,
                           num_layers=d.num_layers)
            if drafts is not None:
                return drafts, None
        last = torch.full((B, 1), window - 1, device=lengths.device)
        drafts, probs = [], []
        for i in range(k):
            logits, _ = d.model(inputs, pos, cache, kv_len=bound, rows=rows, output_index=last,
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
        noise = exponential_noise(q.shape, gen, q.device)
        return sample(q, noise), q

    def glue(self) -> int | None:
        """Torch threads for this decoder's own ops (None: torch's count). With engines on
        the CPU, torch only indexes, takes an argmax or a softmax: one thread, since idle
        OpenMP workers competed with ONNX Runtime's for the cores (measured on 2 cores: the
        draft model at K=4 1.11x at batch 1, 1.13x at batch 8). A round that samples with
        top-p < 1 keeps torch's threads: its sort over [B, K+1, V] is real work (batch 8,
        K=4, 8192 tokens: 20 ms a round on one thread, 11 ms on two)."""
        sorts = not self.params.is_greedy and self.params.top_p < 1.0
        return 1 if self.engine_on_cpu and not sorts else None

    # -- the round's K ---------------------------------------------------------------------

    def round_k(self, slots: list[int]) -> int:
        """K for a round over ``slots``: the largest of the rows' K, capped by the schedule
        for this batch size (0: a plain decoding step)."""
        batch = len(slots)
        k = max(self.host_k[s] for s in slots) if self.k else 0
        if self.disable_by_batch_size is not None and batch >= self.disable_by_batch_size:
            return 0
        schedule = self.draft_len_schedule
        if isinstance(schedule, dict):
            return min(k, schedule[max(size for size in schedule if size <= batch)])
        if schedule == "auto" and k and self.round_seconds is not None:
            return goodput_k(self.seconds_per_round(batch)[: k + 1],
                             self.monitor.alpha_optimistic)
        return k

    def seconds_per_round(self, batch_size: int) -> list[float]:
        """Measured seconds per round for K = 0..k at this batch size (linear in between)."""
        sizes, table = self.round_seconds
        i = max(j for j, size in enumerate(sizes) if size <= batch_size or j == 0)
        if i + 1 == len(sizes) or sizes[i] >= batch_size:
            return table[i].tolist()
        w = (batch_size - sizes[i]) / (sizes[i + 1] - sizes[i])
        return ((1 - w) * table[i] + w * table[i + 1]).tolist()

    def calibrate(self, passes: int = 3, rounds: int = 2) -> tuple[list[int], Tensor]:
        """Time rounds of K = 0..k at batch sizes 1, 2, 4, … up to max_batch_size on dummy
        requests, and keep each cell's fastest round: a shared machine only ever adds time,
        and the ``passes`` sweep every cell in turn so a slow spell cannot favour one K. The
        per-slot state is reset after, so call it before serving. Sets ``round_seconds``."""
        sizes = sorted({min(2 ** i, self.max_batch_size) for i in range(16)})
        prompt_len = max(1, min(64, self.max_seq_len // 4))
        new_tokens = min(rounds * (self.k + 1) + 1, self.max_seq_len - prompt_len)
        vocab = self.verifier.config.vocab_size
        prompt = [(7 * i + 3) % vocab for i in range(prompt_len)]
        gen = torch.Generator(device=self.device).manual_seed(0)
        # the dummy rounds' acceptance must neither count nor alert
        monitor, self.monitor = self.monitor, AcceptanceMonitor(floor=0.0)
        table = torch.full((len(sizes), self.k + 1), float("inf"), dtype=torch.float64)
        for _ in range(passes):
            for i, B in enumerate(sizes):
                slots = list(range(B))
                for k in range(self.k + 1):
                    self.reset()
                    self.prefill(slots, [prompt] * B, [new_tokens] * B, [None] * B, gen)
                    for _ in range(rounds):
                        t0 = time.perf_counter()
                        _, alive = self.step(slots, gen, k=k)
                        table[i, k] = min(table[i, k].item(), time.perf_counter() - t0)
                        if not all(alive):
                            break
        self.reset()
        self.monitor = monitor
        self.round_seconds = (sizes, table)
        log.info("round seconds by batch size %s (rows) and K 0..%d (columns): %s", sizes,
                 self.k, table.tolist())
        return self.round_seconds

    # -- per-slot state: rows of a batch are cache slots, so requests can join and leave ----

    def reset(self) -> None:
        """(Re)allocate the per-slot state; the caches keep their memory."""
        S, dev = self.max_batch_size, self.device
        width = max(self.k, 1)
        self.tokens = torch.zeros(S, self.max_seq_len + self.margin, dtype=torch.long,
                                  device=dev)
        self.lengths = torch.zeros(S, dtype=torch.long, device=dev)
        self.generated = torch.zeros(S, dtype=torch.long, device=dev)
        self.limit = torch.zeros(S, dtype=torch.long, device=dev)
        self.eos = torch.full((S,), -1, dtype=torch.long, device=dev)
        self.k_rows = torch.full((S,), width, dtype=torch.long, device=dev)
        # verify steps, drafted, accepted, rollbacks, steps with drafts, causal leaks
        self.counters = torch.zeros(6, S, dtype=torch.long, device=dev)
        self.per_pos = torch.zeros(2, S, width, dtype=torch.long, device=dev)
        self.times = torch.zeros(4, S, dtype=torch.float64)  # draft, verify, correct, total
        # host mirrors of lengths and K, refreshed by each round's single transfer
        self.host_lengths = [0] * S
        self.host_k = [width] * S
        self.draft_missed = [0] * S  # undrafted rounds since the draft cache was last fed

    def check_request(self, prompt: list[int], max_new_tokens: int) -> None:
        vocab = self.verifier.config.vocab_size
        if not prompt:
            raise ValueError("prompt must contain at least one token")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1; got {max_new_tokens!r}")
        if len(prompt) + max_new_tokens > self.max_seq_len:
            raise ValueError(
                f"prompt length + max_new_tokens must be <= max_seq_len={self.max_seq_len}; "
                f"got {len(prompt)} + {max_new_tokens}"
            )
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab - 1}]")

    def prefill(
        self,
        slots: list[int],
        prompts: list[list[int]],
        max_new_tokens: list[int],
        eos_token_ids: list[int | None],
        gen: torch.Generator,
        num_draft_tokens: list[int] | None = None,
    ) -> tuple[list[list[int]], list[bool]]:
        """Start requests in free slots: run the verifier (and a separate draft) over the
        right-padded prompts and take the first token from the same correction code (K=0).
        ``num_draft_tokens``: per-request K (<= the decoder's K; default: K).
        Returns, per slot, the tokens it gained and whether it is still running."""
        with glue_threads(self.glue()):
            return self._prefill(slots, prompts, max_new_tokens, eos_token_ids, gen,
                                 num_draft_tokens)

    def _prefill(self, slots: list[int], prompts: list[list[int]], max_new_tokens: list[int],
                 eos_token_ids: list[int | None], gen: torch.Generator,
                 num_draft_tokens: list[int] | None) -> tuple[list[list[int]], list[bool]]:
        for p, m in zip(prompts, max_new_tokens, strict=True):
            self.check_request(p, m)
        width = max(self.k, 1)
        if num_draft_tokens is None:
            num_draft_tokens = [width] * len(slots)
        for k in num_draft_tokens:
            if not isinstance(k, int) or not 1 <= k <= width:
                raise ValueError(f"num_draft_tokens must be an integer in [1, {width}]; got {k!r}")
        t0 = time.perf_counter()
        dev, B = self.device, len(slots)
        rows = torch.tensor(slots, device=dev)
        prompt_lens = torch.tensor([len(p) for p in prompts], device=dev)
        t_prompt = max(len(p) for p in prompts)
        padded = torch.zeros(B, t_prompt, dtype=torch.long)
        for b, p in enumerate(prompts):  # host → device once per request
            padded[b, : len(p)] = torch.tensor(p)
        padded = padded.to(dev)
        self.tokens[rows, :t_prompt] = padded
        self.lengths[rows] = prompt_lens
        self.generated[rows] = 0
        self.limit[rows] = torch.tensor(max_new_tokens, device=dev)
        self.eos[rows] = torch.tensor([-1 if e is None else e for e in eos_token_ids],
                                      device=dev)
        self.k_rows[rows] = torch.tensor(num_draft_tokens, device=dev)
        self.counters[:, rows] = 0
        self.per_pos[:, rows] = 0
        self.times[:, slots] = 0.0
        for s in slots:
            self.draft_missed[s] = 0
        pos = torch.arange(t_prompt, device=dev).expand(B, -1)
        last = (prompt_lens - 1)[:, None]
        logits, _ = self.verifier(padded, pos, self.cache, kv_len=t_prompt, rows=rows,
                                  output_index=last)
        if self.draft_cache is not None:
            self.drafter.model(padded, pos, self.draft_cache, kv_len=t_prompt, rows=rows,
                               output_index=last)
        empty = torch.zeros(B, 0, dtype=torch.long, device=dev)
        vocab = self.verifier.config.vocab_size
        _, first = correct_for(dev)(logits, empty, None, self.params,
                                    draw_randoms(B, 0, vocab, gen, dev))
        self.tokens[rows, prompt_lens] = first
        out = self._emit(rows, first[:, None], torch.zeros_like(first))
        self.times[3, slots] += time.perf_counter() - t0
        return out

    def _emit(self, rows: Tensor, emitted: Tensor, num_accepted: Tensor,
              drafted: Tensor | None = None) -> tuple[list[list[int]], list[bool]]:
        """Stop handling, vectorised (keep tokens up to EOS and within max_new_tokens), then
        the round's single host transfer."""
        width = emitted.shape[1]
        valid = torch.arange(width, device=emitted.device) <= num_accepted[:, None]
        is_eos = valid & (emitted == self.eos[rows, None])
        first_eos = torch.where(is_eos.any(1), is_eos.int().argmax(1), width)
        keep = torch.minimum(num_accepted + 1, first_eos + 1)
        generated = self.generated[rows]
        limit = self.limit[rows]
        keep = torch.minimum(keep, limit - generated)
        generated = generated + keep
        self.generated[rows] = generated
        active = (first_eos == width) & (generated < limit)
        drafted = torch.zeros_like(keep) if drafted is None else drafted
        host = torch.cat([keep[:, None], active[:, None], self.lengths[rows, None],
                          self.k_rows[rows, None], drafted[:, None], num_accepted[:, None],
                          emitted], 1).tolist()
        for slot, row in zip(rows.tolist(), host, strict=True):
            self.host_lengths[slot], self.host_k[slot] = row[2], row[3]
        # reached positions: the accepted ones plus the rejected one, if any
        self.monitor.update(sum(row[4] for row in host), sum(row[5] for row in host),
                            sum(row[5] + (row[5] < row[4]) for row in host))
        return [row[6: 6 + row[0]] for row in host], [bool(row[1]) for row in host]

    def step(self, slots: list[int], gen: torch.Generator, k: int | None = None
             ) -> tuple[list[list[int]], list[bool]]:
        """One round for the running ``slots``: draft → verify → correct → roll back.
        ``k``: the round's K (default: ``round_k``; 0: no drafts).
        Returns, per slot, the tokens it gained and whether it is still running."""
        with glue_threads(self.glue()):
            return self._step(slots, gen, k)

    def _step(self, slots: list[int], gen: torch.Generator, k: int | None
              ) -> tuple[list[list[int]], list[bool]]:
        t_start = time.perf_counter()
        dev = self.device
        rows = torch.tensor(slots, device=dev)
        # slots 0..B-1 (the scheduler hands out the lowest free slot, so a steady batch is a
        # prefix of the pool): plain cache slices, no per-layer gather copy
        cache_rows = None if slots == list(range(len(slots))) else rows
        lengths = self.lengths[rows]
        k_max = self.k
        # the round drafts the largest K of its rows (capped by the schedule); each row stops
        # at its own K (adaptive K, or a per-request num_draft_tokens)
        k_rows = self.k_rows[rows]
        k = self.round_k(slots) if k is None else min(k, k_max)
        # attend over the live part of the cache only (host-side bound: no sync needed)
        bound = max(self.host_lengths[s] for s in slots) + 2 * k_max + 2
        tokens = self.tokens[rows]
        t0 = time.perf_counter()
        if k:
            missed = max(self.draft_missed[s] for s in slots)
            draft_tokens, draft_probs = self._draft(tokens, lengths, k, bound, gen, cache_rows,
                                                    missed)
            for s in slots:
                self.draft_missed[s] = 0
        else:
            if self.draft_cache is not None:
                for s in slots:
                    self.draft_missed[s] += 1
            if self.draft_len_schedule == "auto":
                self.monitor.relax(0.97)
            draft_tokens = torch.zeros(len(slots), 0, dtype=torch.long, device=dev)
            draft_probs = None
        t1 = time.perf_counter()
        width = draft_tokens.shape[1]
        verify_in = torch.cat([tokens.gather(1, lengths[:, None]), draft_tokens], 1)
        pos = lengths[:, None] + torch.arange(width + 1, device=dev)
        audit = self.audit_epsilon is not None
        logits, leak = self.verifier(verify_in, pos, self.cache, kv_len=bound, rows=cache_rows,
                                     audit=audit)
        t2 = time.perf_counter()
        num_drafted = k_rows.clamp(max=width)
        leaked_rows = torch.zeros_like(lengths, dtype=torch.bool)
        if audit:
            # a position that looked at a later one has untrustworthy logits: stop there
            leaked = leak > self.audit_epsilon
            leaked_rows = leaked.any(1)
            first_leak = torch.where(leaked_rows, leaked.int().argmax(1), width)
            num_drafted = torch.minimum(first_leak, num_drafted)
        randoms = None if self.params.is_greedy else draw_randoms(  # greedy draws nothing
            len(slots), width, self.verifier.config.vocab_size, gen, dev)
        num_accepted, next_token = correct_for(dev)(
            logits, draft_tokens, draft_probs, self.params, randoms, num_drafted
        )
        # emitted block: accepted drafts, then the rule's token at index num_accepted
        emitted = torch.cat([draft_tokens, next_token[:, None]], 1)
        emitted.scatter_(1, num_accepted[:, None], next_token[:, None])
        write_pos = lengths[:, None] + 1 + torch.arange(width + 1, device=dev)
        self.tokens[rows[:, None], write_pos] = emitted
        self.lengths[rows] = lengths + num_accepted + 1  # the rollback: a length
        drafted = num_drafted
        if self.adaptive_k:  # +2 after a fully accepted block, −1 otherwise, within [1, K]
            grow = num_accepted == k_rows
            self.k_rows[rows] = torch.where(grow, k_rows + 2, k_rows - 1).clamp(1, k_max)
        # metrics, on device
        self.counters[:, rows] += torch.stack([
            torch.ones_like(lengths), drafted, num_accepted, (num_accepted < drafted).long(),
            (drafted > 0).long(), leaked_rows.long()])
        if width:
            p = torch.arange(width, device=dev)
            self.per_pos[0, rows, :width] += (p < num_accepted[:, None]).long()
            self.per_pos[1, rows, :width] += (p < drafted[:, None]).long()
        out = self._emit(rows, emitted, num_accepted, drafted)
        t3 = time.perf_counter()
        self.times[:, slots] += torch.tensor([t1 - t0, t2 - t1, t3 - t2, t3 - t_start],
                                             dtype=torch.float64)[:, None]
        return out

    def slot_stats(self, slot: int) -> SpecStats:
        c = self.counters[:, slot].tolist()
        pp = self.per_pos[:, slot].tolist()
        t = self.times[:, slot].tolist()
        return SpecStats(
            verify_steps=c[0], draft_tokens=c[1], accepted_tokens=c[2], rollbacks=c[3],
            num_drafts=c[4], causal_leaks=c[5], generated_tokens=int(self.generated[slot]),
            accepted_per_position=pp[0][: self.k], drafted_per_position=pp[1][: self.k],
            draft_time=t[0], verify_time=t[1], correct_time=t[2], total_time=t[3],
        )

    # -- a fixed batch, start to finish ------------------------------------------------

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
        for p, m in zip(prompts, max_new_tokens, strict=True):
            self.check_request(p, m)
        if self.draft_len_schedule == "auto" and self.k and self.round_seconds is None:
            self.calibrate()
        self.reset()
        gen = torch.Generator(device=self.device).manual_seed(seed)
        slots = list(range(B))
        t0 = time.perf_counter()
        new, running = self.prefill(slots, prompts, max_new_tokens, [eos_token_id] * B, gen)
        while True:
            out = [[] for _ in range(B)]
            for slot, tokens in zip(slots, new, strict=True):
                out[slot] = tokens
            yield out
            slots = [s for s, r in zip(slots, running, strict=True) if r]
            if not slots:
                break
            new, running = self.step(slots, gen)
        if stats is not None:
            total = time.perf_counter() - t0
            for b in range(B):
                s = self.slot_stats(b)
                s.total_time = total  # the batch's wall clock, for tokens/s
                stats.append(s)

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
