"""What proposes the draft block: one class per drafter, each with the same ``propose``.

- ``ModelDrafter``: a separate small model, K autoregressive steps on its own KV cache.
- ``ParallelDrafter``: one pass over [newest, mask × (K−1)] proposes all K tokens (PARD).
- ``SelfDrafter``: the verifier's first ``num_layers`` layers + final norm + LM head; it
  shares the verifier's cache for those layers (the verify pass writes identical K/V there).

``propose`` returns the K draft tokens per row and, for sampled drafts, the distributions
they were drawn from (the ``q`` of Leviathan et al. speculative sampling; None when greedy).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from .correction import STREAM_DRAFT, RowStreams, RuleParams, sample, sampling_probs
from .model import KVCache, Transformer

DRAFTERS = ("model", "parallel", "self")


def choose_drafts(logits: Tensor, sampling: RuleParams | None, streams: RowStreams | None,
                  step: int = 0) -> tuple[Tensor, Tensor | None]:
    """Greedy drafts (``sampling`` None), or drafts sampled at the rule's temperature and top-p
    with the distributions they came from; draft step ``step`` draws from its own stream."""
    if sampling is None:
        return logits.argmax(-1), None
    q = sampling_probs(logits, sampling.temperature, sampling.top_p)
    return sample(q, streams.exponential(STREAM_DRAFT + step, q.shape[1:])), q


def autoregressive_drafts(model: Transformer, inputs: Tensor, pos: Tensor, lengths: Tensor,
                          k: int, cache: KVCache, kv_len: int, rows: Tensor | None,
                          sampling: RuleParams | None, streams: RowStreams | None,
                          num_layers: int | None) -> tuple[Tensor, Tensor | None]:
    """K steps, each feeding the last draft; ``inputs`` ends with the newest real token.
    Greedy drafts take one engine call where the engine has a fused k-step graph."""
    fused = getattr(model, "greedy_drafts", None)
    if fused is not None and sampling is None and k > 1:
        drafts = fused(inputs, pos, cache, k, kv_len=kv_len, rows=rows, num_layers=num_layers)
        if drafts is not None:
            return drafts, None
    B = lengths.shape[0]
    last = torch.full((B, 1), inputs.shape[1] - 1, device=lengths.device)
    drafts, probs = [], []
    for i in range(k):
        logits, _ = model(inputs, pos, cache, kv_len=kv_len, rows=rows, output_index=last,
                          num_layers=num_layers)
        token, q = choose_drafts(logits, sampling, streams, i)
        drafts.append(token)
        probs.append(q)
        inputs, pos = token, lengths[:, None] + 1 + i
        last = torch.zeros((B, 1), dtype=torch.long, device=lengths.device)
    return torch.cat(drafts, 1), None if probs[0] is None else torch.cat(probs, 1)


@dataclass
class ModelDrafter:
    """A separate small model with its own KV cache."""

    kind: ClassVar[str] = "model"
    num_layers: ClassVar[None] = None
    shares_verifier_cache: ClassVar[bool] = False
    model: Transformer

    def propose(self, tokens: Tensor, lengths: Tensor, k: int, cache: KVCache, kv_len: int,
                rows: Tensor | None, sampling: RuleParams | None, streams: RowStreams | None,
                k_max: int, missed: int = 0) -> tuple[Tensor, Tensor | None]:
        # re-feed the token before the newest (missing from the cache after a fully accepted
        # block) and one more per round the cache skipped (``missed`` undrafted rounds)
        window = 2 + missed
        pos = (lengths[:, None] + torch.arange(1 - window, 1, device=lengths.device)).clamp(min=0)
        return autoregressive_drafts(self.model, tokens.gather(1, pos), pos, lengths, k, cache,
                                     kv_len, rows, sampling, streams, None)


@dataclass
class ParallelDrafter:
    """PARD: one pass over [newest, mask × (K−1)]; the draft model is trained for it."""

    kind: ClassVar[str] = "parallel"
    num_layers: ClassVar[None] = None
    shares_verifier_cache: ClassVar[bool] = False
    model: Transformer
    mask_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.mask_token_id is None:
            self.mask_token_id = self.model.config.mask_token_id
            if self.mask_token_id is None:
                raise ValueError(
                    "parallel drafter needs mask_token_id (set it in the draft's config.json)"
                )

    def propose(self, tokens: Tensor, lengths: Tensor, k: int, cache: KVCache, kv_len: int,
                rows: Tensor | None, sampling: RuleParams | None, streams: RowStreams | None,
                k_max: int, missed: int = 0) -> tuple[Tensor, Tensor | None]:
        # re-feed the last K_max+1 real tokens (the cache may lack up to that many after a
        # fully accepted block), then K−1 masks; outputs at offsets 0..k−1 are the drafts
        back = k_max + missed
        offsets = torch.arange(-back, k, device=lengths.device)
        pos = (lengths[:, None] + offsets).clamp(min=0)
        inputs = torch.where(offsets <= 0, tokens.gather(1, pos), self.mask_token_id)
        out_idx = (back + torch.arange(k, device=lengths.device)).expand(lengths.shape[0], -1)
        logits, _ = self.model(inputs, pos, cache, kv_len=kv_len, rows=rows,
                               output_index=out_idx)
        return choose_drafts(logits, sampling, streams)


@dataclass
class SelfDrafter:
    """The verifier's first ``num_layers`` layers, on the verifier's own cache."""

    kind: ClassVar[str] = "self"
    shares_verifier_cache: ClassVar[bool] = True
    model: Transformer
    num_layers: int | None = None

    def __post_init__(self) -> None:
        n = self.model.config.n_layers
        if self.num_layers is None:
            self.num_layers = self.model.config.self_draft_layers or 1
        if not 1 <= self.num_layers < n:
            raise ValueError(f"self_draft_layers must be in [1, {n - 1}]; got {self.num_layers}")

    def propose(self, tokens: Tensor, lengths: Tensor, k: int, cache: KVCache, kv_len: int,
                rows: Tensor | None, sampling: RuleParams | None, streams: RowStreams | None,
                k_max: int, missed: int = 0) -> tuple[Tensor, Tensor | None]:
        # the verify pass already wrote these layers' K/V: feed only the newest token
        pos = lengths[:, None]
        return autoregressive_drafts(self.model, tokens.gather(1, pos), pos, lengths, k, cache,
                                     kv_len, rows, sampling, streams, self.num_layers)


AnyDrafter = ModelDrafter | ParallelDrafter | SelfDrafter


def Drafter(kind: str, model: Transformer, num_layers: int | None = None,
            mask_token_id: int | None = None) -> AnyDrafter:
    """The drafter of ``kind`` (the CLI's ``--drafter`` names) over ``model``."""
    if num_layers is not None and kind != "self":
        raise ValueError(f"num_layers is for the self drafter only; got {num_layers} for {kind!r}")
    if mask_token_id is not None and kind != "parallel":
        raise ValueError(f"mask_token_id is for the parallel drafter only; got {mask_token_id} "
                         f"for {kind!r}")
    if kind == "model":
        return ModelDrafter(model)
    if kind == "parallel":
        return ParallelDrafter(model, mask_token_id)
    if kind == "self":
        return SelfDrafter(model, num_layers)
    raise ValueError(f"drafter must be one of {', '.join(DRAFTERS)}; got {kind!r}")
