"""Log-probabilities of emitted tokens, as OpenAI's ``logprobs`` / ``top_logprobs`` report
them: the verifier's own distribution at each position (its raw logits, temperature 1, before
top-p and a grammar's mask: what vLLM returns by default), read from the same logits the
correction rule saw. A speculative round gives them for every emitted position at once (its
verify pass), so they equal plain decoding's up to the verify pass's rounding.
"""

from __future__ import annotations

import torch
from torch import Tensor

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for top_logprobs

# one emitted token's entry: its log-probability and the ``top`` likeliest (id, logprob)
LogprobEntry = tuple[float, list[tuple[int, float]]]


def check_top_logprobs(top: int | None) -> None:
    if top is not None and (isinstance(top, bool) or not isinstance(top, int)
                            or not 0 <= top <= MAX_TOP_LOGPROBS):
        raise ValueError(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}] or None "
                         f"(no logprobs); got {top!r}")


def token_logprobs(logits: Tensor, tokens: Tensor, top: int
                   ) -> tuple[Tensor, Tensor, Tensor]:
    """``logits`` [B, W, V], ``tokens`` [B, W]: each token's log-probability [B, W], and the
    ``top`` likeliest tokens' log-probabilities and ids [B, W, top] (float32)."""
    logp = torch.log_softmax(logits.float(), -1)
    chosen = logp.gather(-1, tokens[..., None]).squeeze(-1)
    values, ids = logp.topk(top, -1) if top else (logp[..., :0], tokens[..., None][..., :0])
    return chosen, values, ids


def host_entries(chosen: Tensor, values: Tensor, ids: Tensor) -> list[list[LogprobEntry]]:
    """token_logprobs' tensors as per-row lists of entries (one host transfer each)."""
    chosen_rows, value_rows, id_rows = chosen.tolist(), values.tolist(), ids.tolist()
    return [[(c, list(zip(i, v, strict=True))) for c, i, v in zip(cs, ids_row, vs, strict=True)]
            for cs, ids_row, vs in zip(chosen_rows, id_rows, value_rows, strict=True)]
