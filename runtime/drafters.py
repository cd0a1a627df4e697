"""What proposes the draft block: one class per drafter, each with the same ``propose``.

- ``ModelDrafter``: a separate small model, K autoregressive steps on its own KV cache.
- ``ParallelDrafter``: one pass over [newest, mask × (K−1)] proposes all K tokens (PARD).
- ``SelfDrafter``: the verifier's first ``num_layers`` layers + final norm + LM head; it
  shares the verifier's cache for those layers (the verify pass writes identical K/V there).
- ``NgramDrafter``: model-free prompt lookup (``lookup``, not ``propose``): the tokens that
  followed an earlier occurrence of the row's last n tokens. It drafts only where it finds
  one, so a row may draft fewer than K tokens, or none.
- ``SuffixDrafter``: model-free suffix decoding (``lookup`` too): the row's longest suffix
  matched in its own tokens and in earlier requests' prompts and answers, drafting the most
  frequent continuation for as long as its estimated probability holds.

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

DRAFTERS = ("model", "parallel", "self", "ngram", "suffix", "grammar")
# need no model: an engine dir needs no graph for them
MODEL_FREE_DRAFTERS = ("ngram", "suffix", "grammar")
NGRAM_LIMIT = 16  # the longest suffix the lookup matches (ngram_max's upper end)
NGRAM_SHARED_REQUESTS = 16  # ended requests the n-gram lookup searches (ngram_shared)


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
                k_max: int, missed: int = 0, valid: Tensor | None = None
                ) -> tuple[Tensor, Tensor | None]:
        # re-feed the token before the newest (missing from the cache after a fully accepted
        # block) and, for the widest row, ``missed`` more: a row whose cache holds fewer
        # positions (``valid``: a lazy prefill, undrafted rounds) catches up in this call, the
        # others repeat their first position (the same token at the same place)
        window = 2 + missed
        pos = lengths[:, None] + torch.arange(1 - window, 1, device=lengths.device)
        floor = 0 if valid is None else torch.minimum(valid, lengths - 1)[:, None]
        pos = torch.maximum(pos, torch.as_tensor(floor, device=lengths.device))
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
                k_max: int, missed: int = 0, valid: Tensor | None = None
                ) -> tuple[Tensor, Tensor | None]:
        # re-feed the last K_max+1 real tokens (the cache may lack up to that many after a
        # fully accepted block), then K−1 masks; outputs at offsets 0..k−1 are the drafts.
        # A row whose cache holds fewer (``valid``) catches up from there (``missed``: the
        # widest row's extra positions)
        back = k_max + missed
        offsets = torch.arange(-back, k, device=lengths.device)
        floor = 0 if valid is None else (torch.minimum(valid, lengths - k_max).clamp(min=0)
                                         [:, None])
        pos = torch.maximum(lengths[:, None] + offsets,
                            torch.as_tensor(floor, device=lengths.device))
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
                k_max: int, missed: int = 0, valid: Tensor | None = None
                ) -> tuple[Tensor, Tensor | None]:
        # the verify pass already wrote these layers' K/V: feed only the newest token
        pos = lengths[:, None]
        return autoregressive_drafts(self.model, tokens.gather(1, pos), pos, lengths, k, cache,
                                     kv_len, rows, sampling, streams, self.num_layers)


@dataclass
class NgramDrafter:
    """Prompt lookup (model-free): match the longest suffix of the row, ``ngram_min`` to
    ``ngram_max`` tokens, against the row's earlier tokens (the prompt and the output so far)
    and draft the up to K tokens that followed the match.

    Of several occurrences of the longest matching suffix it takes the most recent. HF prompt
    lookup and TensorRT-LLM's default (``is_use_oldest``) take the earliest, which is most
    often in the prompt's fixed preamble (a chat template, a system message, the task's
    instructions) for the short, common n-grams a lookup matches. The most recent one sits
    in the text being copied right now: when an answer copies its input (a rewrite, a code
    fix), the latest occurrence of the suffix is in the stretch being copied or in the
    answer's own copy of it; when a small model repeats itself, it is the last repetition.
    The lookup also compares at most ``ngram_max`` tokens per candidate, so its cost does not
    depend on which occurrence wins.

    Its drafts are deterministic: the ``q`` of speculative sampling is one-hot on them (the
    correction's ``draft_probs=None``), which keeps the ``exact`` rule lossless."""

    kind: ClassVar[str] = "ngram"
    model: ClassVar[None] = None  # model-free: no weights, no cache, no prefill
    num_layers: ClassVar[None] = None
    shares_verifier_cache: ClassVar[bool] = False
    ngram_min: int = 2
    ngram_max: int = 4
    # the shortest match drafted from in a round of several rows (None: ngram_min). On a CPU
    # a batched verify pass costs about a plain token per drafted position, so only drafts
    # that are nearly always right pay there: those that continue a long match (a copy)
    ngram_batched_min: int | None = None
    # also search the server's other cache slots (earlier requests' prompts and answers,
    # the other groups' running requests): a retry, a regenerated answer or a template the
    # server keeps producing is drafted from the last time. Lossless as any draft, but a
    # request's speed then depends on what others sent (a timing side channel): off by default
    ngram_shared: bool = False

    def __post_init__(self) -> None:
        for name, low, high in (("ngram_min", 1, NGRAM_LIMIT),
                                ("ngram_max", self.ngram_min, NGRAM_LIMIT),
                                ("ngram_batched_min", self.ngram_min, self.ngram_max)):
            value = getattr(self, name)
            if value is None and name == "ngram_batched_min":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or not (
                    low <= value <= high):
                bounds = {"ngram_max": " (>= ngram_min)",
                          "ngram_batched_min": " (ngram_min to ngram_max)"}.get(name, "")
                raise ValueError(f"{name} must be an integer in [{low}, {high}]{bounds}; "
                                 f"got {value!r}")
        if not isinstance(self.ngram_shared, bool):
            raise ValueError(f"ngram_shared must be true or false; got {self.ngram_shared!r}")

    @property
    def cached_requests(self) -> int:
        """How many ended requests the decoder keeps for this drafter's lookups."""
        return NGRAM_SHARED_REQUESTS if self.ngram_shared else 0

    def lookup(self, tokens: Tensor, lengths: Tensor, k: int, history: int,
               shared: Tensor | None = None, shared_lengths: Tensor | None = None
               ) -> tuple[Tensor, Tensor]:
        """Drafts [B, k] and how many of each row's are real, [B] in [0, k] (0: no match).

        ``tokens`` [B, T]: row b's tokens, its newest at ``lengths[b]`` (positions past it are
        stale); ``history`` > max(lengths): the columns that can hold a row's tokens. Every
        end position e < lengths[b] of an earlier occurrence is scored at once: the length
        of the match ending there (up to ``ngram_max`` compares), then recency. With several
        rows a match must be ``ngram_batched_min`` long, where set.

        ``shared`` [S, T'] (newest at ``shared_lengths``, ``history`` > their max too): other
        sequences searched as well (``ngram_shared``: the server's other cache slots, earlier
        requests' prompts and answers); a match there is taken where it is longer, or as long
        with more to follow, than the row's own best."""
        suffix = tokens.gather(1, (lengths[:, None] - torch.arange(
            self.ngram_max, device=tokens.device)).clamp(min=0))  # [B, n_max]
        shortest = self.ngram_min if tokens.shape[0] == 1 or self.ngram_batched_min is None \
            else self.ngram_batched_min
        key, best = self._best_match(suffix, tokens[:, None], lengths[:, None], k, history,
                                     shortest)  # [B, 1]
        key, best, source = key[:, 0], best[:, 0], tokens
        if shared is not None and shared.shape[0]:
            key_s, best_s = self._best_match(suffix, shared[None], shared_lengths[None], k,
                                             history, shortest)  # [B, S]
            key_s, slot = key_s.max(1)
            best_s = best_s.gather(1, slot[:, None])[:, 0]
            take = key_s > key  # ties: the row's own
            key = torch.where(take, key_s, key)
            best = torch.where(take, best_s, best)
            own = torch.cat([tokens, tokens.new_zeros(tokens.shape[0], max(
                0, shared.shape[1] - tokens.shape[1]))], 1)
            other = torch.cat([shared, shared.new_zeros(shared.shape[0], max(
                0, tokens.shape[1] - shared.shape[1]))], 1)[slot]
            source = torch.where(take[:, None], other, own)
            end = torch.where(take, shared_lengths[slot], lengths)
        else:
            end = lengths
        found = key >= 0
        counts = torch.where(found, (end - best).clamp(max=k), 0)
        follow = (best[:, None] + 1 + torch.arange(k, device=tokens.device)).clamp(
            max=end[:, None])
        return source.gather(1, follow), counts

    def _best_match(self, suffix: Tensor, seqs: Tensor, seq_lengths: Tensor, k: int,
                    history: int, shortest: int) -> tuple[Tensor, Tensor]:
        """For each row's ``suffix`` [B, n_max] (newest last-first) and each of the sequences
        ``seqs`` [B or 1, S, T] (newest at ``seq_lengths`` [B or 1, S]): the best match's key
        (its length, then the tokens to follow it, at most k; -1: none of ``shortest``
        tokens) and where it ends, each [B, S]."""
        dev = suffix.device
        ends = torch.arange(history - 1, device=dev)  # e: where an earlier occurrence ends
        back = torch.arange(self.ngram_max, device=dev)
        starts = ends - back[:, None]  # [n_max, E]: e - i, the i-th token back from e
        earlier = seqs[:, :, starts.clamp(min=0)]  # [B|1, S, n_max, E]
        same = (earlier == suffix[:, None, :, None]) & (starts >= 0)
        run = same.int().cumprod(2).sum(2)  # [B, S, E]: length of the match ending at e
        run = run * (ends < seq_lengths[..., None])  # only before the newest token
        # what followed it, up to the newest token: the longest match, then the one with the
        # most of K to follow (in a loop of period p < K the latest match has p), then the
        # most recent; below the shortest: none
        follows = (seq_lengths[..., None] - ends).clamp(max=k)
        key = run * (k + 1) + follows
        score = torch.where(run >= shortest, key * history + ends, -1)
        best = score.argmax(-1)  # [B, S]
        key = torch.where(score.gather(-1, best[..., None])[..., 0] >= 0,
                          key.gather(-1, best[..., None])[..., 0], -1)
        return key, best


SUFFIX_DEPTH_LIMIT = 64  # the longest suffix the suffix drafter matches (suffix_depth's top)
SUFFIX_CANDIDATES = 32  # occurrences of the longest match it weighs: the most recent ones


@dataclass
class SuffixDrafter:
    """Suffix decoding (Oliaro et al., arXiv 2411.04975; ArcticInference's, vLLM's
    ``suffix``), model-free: find the longest suffix of the row, up to ``suffix_depth``
    tokens, that occurred before, in the row's own tokens (prompt and output so far) or in
    the server's memory of earlier requests' prompts and answers; of the tokens that followed
    its occurrences, draft the most frequent continuation, token by token, while the share of
    occurrences that agree with it (the estimated probability of the draft so far) stays at
    least ``suffix_min_prob``, and at most as many tokens as the match is long.

    What a suffix tree's node holds, counted directly: the occurrences of the matched suffix
    (its most recent ``SUFFIX_CANDIDATES``) are the node's subtree, the continuations that
    agree with the draft for j tokens are its child's count. The most frequent continuation
    is the one whose counts, position by position, are largest (lexicographically; then the
    most recent). The row's own draft and the memory's compete by score, the expected number
    of accepted tokens (the sum of the drafted positions' probabilities); ties: the row's.

    The memory (``suffix_cached_requests`` ended requests, oldest evicted first) lives in the
    decoder; its lookup costs a compare per position and depth, so its size is bounded.
    Drafts are deterministic (q one-hot), so the ``exact`` rule stays lossless."""

    kind: ClassVar[str] = "suffix"
    model: ClassVar[None] = None
    num_layers: ClassVar[None] = None
    shares_verifier_cache: ClassVar[bool] = False
    suffix_depth: int = 24  # vLLM's suffix_decoding_max_tree_depth default
    suffix_min_prob: float = 0.1  # vLLM's suffix_decoding_min_token_prob default
    # with several rows: on a CPU a batched drafted position costs about 0.7 of a plain
    # token (docs/results.md), so only drafts that likely are right pay there
    suffix_batched_min_prob: float = 0.7
    suffix_cached_requests: int = 64  # 0: the row's own tokens only

    def __post_init__(self) -> None:
        for name, low, high in (("suffix_depth", 1, SUFFIX_DEPTH_LIMIT),
                                ("suffix_cached_requests", 0, 4096)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise ValueError(f"{name} must be an integer in [{low}, {high}]; got {value!r}")
        for name in ("suffix_min_prob", "suffix_batched_min_prob"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                    0.0 < value <= 1.0):
                raise ValueError(f"{name} must be a number in (0, 1]; got {value!r}")

    @property
    def cached_requests(self) -> int:
        """How many ended requests the decoder keeps for this drafter's lookups."""
        return self.suffix_cached_requests

    def lookup(self, tokens: Tensor, lengths: Tensor, k: int, history: int,
               memory: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Drafts [B, k] and how many of each row's are real, [B] in [0, k] (0: none).

        ``tokens`` [B, T]: row b's tokens, its newest at ``lengths[b]``; ``history`` >
        max(lengths): the columns that can hold a row's tokens. ``memory`` [E]: earlier
        requests' tokens end to end, each followed by -1 (no match or draft crosses it)."""
        min_prob = self.suffix_min_prob if tokens.shape[0] == 1 else self.suffix_batched_min_prob
        dev = tokens.device
        depth = torch.arange(self.suffix_depth, device=dev)
        suffix = tokens.gather(1, (lengths[:, None] - depth).clamp(min=0))  # newest first
        suffix = torch.where(lengths[:, None] - depth >= 0, suffix, -2)  # -2 matches nothing
        own = tokens[:, :history]
        ends = torch.arange(history, device=dev)
        drafts, counts, score = self._draft(suffix, own, ends[None] < lengths[:, None],
                                            lengths, k, min_prob)
        if memory is not None and memory.numel():
            memory = memory[None].expand(tokens.shape[0], -1)
            last = torch.full_like(lengths, memory.shape[1] - 1)
            drafts_m, counts_m, score_m = self._draft(suffix, memory, memory >= 0, last, k,
                                                      min_prob)
            take = score_m > score
            drafts = torch.where(take[:, None], drafts_m, drafts)
            counts = torch.where(take, counts_m, counts)
        return drafts, counts

    def _draft(self, suffix: Tensor, seqs: Tensor, ends_ok: Tensor, last: Tensor, k: int,
               min_prob: float) -> tuple[Tensor, Tensor, Tensor]:
        """Each row's draft [B, k], its length [B] and score [B] from the occurrences in its
        sequence ``seqs`` [B, E] (an occurrence may end where ``ends_ok``; tokens up to
        ``last`` [B] follow it; -1 separates requests)."""
        B, E = seqs.shape
        dev = seqs.device
        depth = suffix.shape[1]
        ends = torch.arange(E, device=dev)
        starts = ends - torch.arange(depth, device=dev)[:, None]  # [D, E]
        earlier = seqs[:, starts.clamp(min=0)]  # [B, D, E]
        same = (earlier == suffix[:, :, None]) & (starts >= 0)
        run = same.int().cumprod(1).sum(1) * ends_ok  # [B, E]: match length ending at e
        longest = run.max(1).values  # [B]
        # the most recent occurrences of the longest match: the candidates
        recent = torch.where((run == longest[:, None]) & (longest[:, None] > 0), ends, -1)
        num = min(SUFFIX_CANDIDATES, E)
        where = recent.topk(num, 1).values  # newest first; -1: no candidate
        is_cand = where >= 0
        follow = where.clamp(min=0)[:, :, None] + 1 + torch.arange(k, device=dev)  # [B, C, k]
        cont = seqs.gather(1, follow.clamp(max=E - 1).flatten(1)).view(B, num, k)
        usable = (follow <= last[:, None, None]) & (cont >= 0) & is_cand[:, :, None]
        usable = usable.int().cumprod(2).bool()  # a continuation ends at its first gap
        # count[b, c, j]: candidates that continue as c does for j + 1 tokens
        agree = (cont[:, :, None] == cont[:, None]) & usable[:, :, None] & usable[:, None]
        count = agree.int().cumprod(3).sum(2)  # [B, C, k]
        best = is_cand.clone()
        for j in range(k):  # the most frequent path: largest counts, position by position
            at = torch.where(best, count[:, :, j], -1)
            best &= at == at.max(1, keepdim=True).values
        chosen = best.int().argmax(1)  # the first kept: the most recent
        path = cont.gather(1, chosen[:, None, None].expand(B, 1, k))[:, 0]
        path_count = count.gather(1, chosen[:, None, None].expand(B, 1, k))[:, 0]
        prob = path_count.double() / is_cand.sum(1, keepdim=True).clamp(min=1)
        cap = longest.clamp(max=k)  # drafts at most as long as the match
        drafted = (prob >= min_prob) & (torch.arange(k, device=dev) < cap[:, None]) & (
            path_count > 0)
        drafted = drafted.int().cumprod(1).bool()
        return path.clamp(min=0), drafted.sum(1), (prob * drafted).sum(1)


@dataclass(frozen=True)
class GrammarDrafter:
    """The grammar's own proposals, alone: it looks up nothing, so a constrained row drafts
    exactly what its grammar forces (a key name, ``":"``, a closing brace: the decoder's
    ``_grammar_drafts``) and an unconstrained row decodes as plain decoding does. No model,
    no memory; deterministic drafts (one-hot q)."""

    kind: ClassVar[str] = "grammar"
    model: ClassVar[None] = None
    num_layers: ClassVar[None] = None
    shares_verifier_cache: ClassVar[bool] = False
    cached_requests: ClassVar[int] = 0

    def lookup(self, tokens: Tensor, lengths: Tensor, k: int, history: int
               ) -> tuple[Tensor, Tensor]:
        """No drafts: [B, k] zeros, none of them real."""
        B = tokens.shape[0]
        return (torch.zeros(B, k, dtype=torch.long, device=tokens.device),
                torch.zeros(B, dtype=torch.long, device=tokens.device))


AnyDrafter = (ModelDrafter | ParallelDrafter | SelfDrafter | NgramDrafter | SuffixDrafter
              | GrammarDrafter)


def Drafter(kind: str, model: Transformer | None = None, num_layers: int | None = None,
            mask_token_id: int | None = None, ngram_min: int | None = None,
            ngram_max: int | None = None, ngram_batched_min: int | None = None,
            ngram_shared: bool | None = None, **suffix_options: int | float) -> AnyDrafter:
    """The drafter of ``kind`` (the CLI's ``--drafter`` names) over ``model`` (none for the
    model-free ``ngram`` and ``suffix``); ``suffix_options``: SuffixDrafter's fields, by name."""
    if kind not in DRAFTERS:
        raise ValueError(f"drafter must be one of {', '.join(DRAFTERS)}; got {kind!r}")
    if num_layers is not None and kind != "self":
        raise ValueError(f"num_layers is for the self drafter only; got {num_layers} for {kind!r}")
    if mask_token_id is not None and kind != "parallel":
        raise ValueError(f"mask_token_id is for the parallel drafter only; got {mask_token_id} "
                         f"for {kind!r}")
    sizes = {name: v for name, v in (("ngram_min", ngram_min), ("ngram_max", ngram_max),
                                     ("ngram_batched_min", ngram_batched_min),
                                     ("ngram_shared", ngram_shared))
             if v is not None}
    unknown = set(suffix_options) - {f for f in SuffixDrafter.__dataclass_fields__}
    if unknown:
        raise ValueError(f"unknown drafter option {sorted(unknown)[0]!r}")
    suffix_options = {name: v for name, v in suffix_options.items() if v is not None}
    if kind in MODEL_FREE_DRAFTERS and model is not None:
        raise ValueError(f"the {kind} drafter is model-free: pass no model")
    for options, owner in ((sizes, "ngram"), (suffix_options, "suffix")):
        if options and kind != owner:
            raise ValueError(f"{next(iter(options))} is for the {owner} drafter only; got "
                             f"{next(iter(options.values()))} for {kind!r}")
    if kind == "ngram":
        return NgramDrafter(**sizes)
    if kind == "suffix":
        return SuffixDrafter(**suffix_options)
    if kind == "grammar":
        return GrammarDrafter()
    if model is None:
        raise ValueError(f"the {kind!r} drafter needs a model")
    if kind == "model":
        return ModelDrafter(model)
    if kind == "parallel":
        return ParallelDrafter(model, mask_token_id)
    return SelfDrafter(model, num_layers)
