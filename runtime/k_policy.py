"""How many tokens a round drafts (K).

- Per row, adaptive K: +2 after a fully accepted block, −1 otherwise, within [1, K] (the
  heuristic of transformers' assisted generation).
- Per round, by batch size: TensorRT-LLM's ``draft_len_schedule`` ({threshold: K}), vLLM's
  ``speculative_disable_by_batch_size``, or ``"auto"``: the goodput policy, the K with the most
  expected tokens per second given the running acceptance α and round times measured on this
  machine (``measure_round_seconds``). A batched verify pass costs more per extra position as
  the batch grows, so the best K shrinks with the batch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

RoundSeconds = tuple[list[int], Tensor]  # (batch sizes, seconds per round [size, K = 0..k])


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


def seconds_per_round(round_seconds: RoundSeconds, batch_size: int) -> list[float]:
    """Measured seconds per round for K = 0..k at this batch size (linear in between)."""
    sizes, table = round_seconds
    i = max(j for j, size in enumerate(sizes) if size <= batch_size or j == 0)
    if i + 1 == len(sizes) or sizes[i] >= batch_size:
        return table[i].tolist()
    w = (batch_size - sizes[i]) / (sizes[i + 1] - sizes[i])
    return ((1 - w) * table[i] + w * table[i + 1]).tolist()


def round_k(batch_size: int, k: int, disable_by_batch_size: int | None,
            schedule: dict[int, int] | str | None, round_seconds: RoundSeconds | None,
            alpha: float) -> int:
    """K for a round of ``batch_size`` rows whose largest own K is ``k``, capped by the
    schedule for this batch size (0: a plain decoding step)."""
    if disable_by_batch_size is not None and batch_size >= disable_by_batch_size:
        return 0
    if isinstance(schedule, dict):
        return min(k, schedule[max(size for size in schedule if size <= batch_size)])
    if schedule == "auto" and k and round_seconds is not None:
        return goodput_k(seconds_per_round(round_seconds, batch_size)[: k + 1], alpha)
    return k


def adapt_k(k_rows: Tensor, num_accepted: Tensor, k_max: int) -> Tensor:
    """Adaptive K per row: +2 after a fully accepted block, −1 otherwise, within [1, K]."""
    return torch.where(num_accepted == k_rows, k_rows + 2, k_rows - 1).clamp(1, k_max)


def calibration_batch_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, … up to ``max_batch_size`` (included)."""
    return sorted({min(2 ** i, max_batch_size) for i in range(16)})


def measure_round_seconds(time_round: Callable[[int, int], float], batch_sizes: list[int],
                          k: int, passes: int = 3) -> Tensor:
    """Seconds per round [batch size, K = 0..k]: ``time_round(batch_size, k)`` times fresh
    rounds, and each cell keeps its fastest. A shared machine only ever adds time, and the
    ``passes`` sweep every cell in turn so a slow spell cannot favour one K."""
    table = torch.full((len(batch_sizes), k + 1), float("inf"), dtype=torch.float64)
    for _ in range(passes):
        for i, batch_size in enumerate(batch_sizes):
            for j in range(k + 1):
                table[i, j] = min(table[i, j].item(), time_round(batch_size, j))
    return table
