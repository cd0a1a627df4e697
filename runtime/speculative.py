"""Batched speculative decoding: draft K → verify K+1 in one pass → correct → roll back.

State per row: ``lengths[b]`` tokens have K/V in the verifier cache, and the newest token
(not yet in the cache) sits in ``tokens[b, lengths[b]]``. A round drafts K tokens after it,
runs the verifier once over [newest, d_1 … d_K] at the row's own positions, lets the
correction rule accept a prefix of n tokens, and moves the row to ``lengths + n + 1`` with the
rule's token as the new newest one. Rolling back is that assignment: cache entries past the
new length are never read before the next round overwrites them. The draft caches follow the
same lengths (each draft pass re-feeds the few real tokens it may not have seen yet).

The device work of a round is vectorised over rows and positions; the round ends with one
host transfer (each row's accepted count and emitted block). The host keeps what it can
derive from that transfer (lengths, the stop rule, the metrics) in plain lists, so a round
runs few small device ops: on a CPU each costs microseconds, enough to show next to a small
model's step.

Fused correction: where the verifier engine ends in the ``CausalCorrection`` op (an engine
dir's correction graph), verify and correct can be one engine call that returns only the
accepted counts and next tokens, not [B, K+1, V] logits. Both paths take the same per-row
random numbers, so they give the same tokens.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch import Tensor

from .backends.kernels import correct_for
from .correction import MAX_K, RowStreams, RuleParams, check_k, check_range, row_randoms
from .drafters import AnyDrafter, Drafter, NgramDrafter, SuffixDrafter
from .grammar import RowGrammar, allowed_tokens
from .k_policy import (
    RoundCosts,
    RoundPlan,
    adapt_k,
    calibration_batch_sizes,
    check_draft_len_schedule,
    measure_round_costs,
    plan_round,
    round_k,
)
from .logprobs import LogprobEntry, check_top_logprobs, host_entries, token_logprobs
from .metrics import AcceptanceMonitor, GenerationResult, RoundStats, SpecStats, aggregate
from .model import KVCache, Transformer, new_kv_cache, token_ids
from .threads import glue_threads

# Drafter and the metrics are re-exported: ``paradraft.runtime.speculative`` was their home
# before the split, and the Python API keeps working from there
__all__ = ["Drafter", "GenerationResult", "SpecStats", "SpeculativeDecoder", "aggregate"]
log = logging.getLogger("paradraft")
MAX_STOP_IDS = 16  # end ids per request (Llama 3 lists 3, chat formats add end-of-turn ids)
EosIds = int | Sequence[int] | None
FUSED_MODES = ("on", "off", "auto")
# per round a drafter sits out, its acceptance evidence fades by this factor, so that the
# goodput policy tries it again: at 0.99 the evidence halves in about 70 rounds (at 0.97,
# about 23, the policy re-tried a poor drafter often enough to cost throughput under load)
EVIDENCE_FADE = 0.99
AUDIT_NEEDS_LOGITS = "audit: the attention causal audit needs the verifier's logits"
# a slot's counts, as SpecStats names them
_COUNTS = ("verify_steps", "draft_tokens", "accepted_tokens", "rollbacks", "num_drafts",
           "causal_leaks")


class SpeculativeDecoder:
    """Batched speculative decoding over preallocated caches (one slot per row).

    ``drafter=None`` or ``k=0`` is plain autoregressive decoding through the same loop (the
    baseline). ``adaptive_k``: per row, K += 2 after a fully accepted block, K −= 1 otherwise,
    within [1, k]. ``audit_epsilon``: run the verifier with the attention causal audit and
    roll back at the first draft position that attends to a later one with weight > ε.
    ``disable_by_batch_size``: a round with at least this many running rows decodes without
    drafts (vLLM's ``speculative_disable_by_batch_size``); a separate draft model's cache then
    falls behind and the next drafted round re-feeds the missed tokens.
    ``draft_len_schedule``: the round's K by batch size, TensorRT-LLM's {threshold: K}, or
    ``"auto"``: the goodput policy (k_policy.py), per round and per drafter, over round costs
    measured by ``calibrate`` and refreshed by every round; a request that named its K
    (``num_draft_tokens``) keeps it. Each drafter (the model, the n-gram lookup) has its
    own running acceptance (``monitors``).
    ``fused_correction``: ``"on"``: verify and correct in one engine call (the verifier engine
    must carry a correction graph); ``"off"``: logits out of the engine, ``correct()`` here;
    ``"auto"``: on where the backend measured it faster (its ``fused_by_default``). A round
    that one call cannot carry (the audit needs the logits; rule parameters the engine has
    no graph for) runs unfused and counts its reason in ``fused_fallback``.
    ``lookup``: an n-gram lookup that a request may draft with instead of ``drafter`` (a
    drafter with a model): ``prefill``'s ``lookup_drafts``, per request.
    """

    def __init__(
        self,
        verifier: Transformer,
        drafter: AnyDrafter | None = None,
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
        fused_correction: str = "auto",
        lookup: NgramDrafter | SuffixDrafter | None = None,
        max_running: int | None = None,
    ):
        self.verifier = verifier
        self.drafter = drafter
        if lookup is not None and (drafter is None or drafter.model is None):
            raise ValueError("lookup is the per-request alternative to a drafter with a model; "
                             f"the drafter is {getattr(drafter, 'kind', None)!r}")
        self.lookup = lookup
        self.clear_memory()
        self.params = params or RuleParams()
        self.k = 0 if drafter is None else k
        if drafter is not None:
            check_k(k)
            if drafter.kind == "parallel" and k > MAX_K // 2:
                raise ValueError(f"k must be <= {MAX_K // 2} for the parallel drafter; got {k}")
            if drafter.model is not None and (
                    drafter.model.config.vocab_size != verifier.config.vocab_size):
                raise ValueError(
                    f"draft vocab_size {drafter.model.config.vocab_size} != verifier vocab_size "
                    f"{verifier.config.vocab_size}: load the draft with "
                    "paradraft.runtime.checkpoints.load_draft, which widens a draft padded "
                    "differently (after checking the tokenizers agree)"
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
        # "auto": the round parts' seconds, measured by calibrate(), refreshed by each round
        self.costs: RoundCosts | None = None
        self.rounds = RoundStats([0] * (self.k + 1))
        check_range("acceptance_floor", acceptance_floor, 0.0, 1.0)
        # each drafter's own running acceptance: the model's drafts and the lookup's differ
        # too much for one α to steer both
        # (the model-free drafter's under "ngram", named by its kind)
        lookup_kind = getattr(self.lookup_drafter, "kind", "ngram")
        self.monitors = {name: AcceptanceMonitor(floor=acceptance_floor, name=label)
                         for name, label in (("model", "model"), ("ngram", lookup_kind))}
        self.primary = "ngram" if drafter is not None and drafter.model is None else "model"
        self.adaptive_k = adaptive_k
        self.audit_epsilon = audit_epsilon
        self.calibrating = False  # calibrate()'s dummy rounds draft full blocks
        self.fused = fused_on(verifier, fused_correction)
        if self.fused and verifier.fused_reason(self.params) is None:
            verifier.prepare_correction(self.params)  # its session, before the first round
        # sampled drafts (with their q) only pay off for the lossless sampling rule
        self.draft_sampling = self.params.rule == "exact" if draft_sampling is None else (
            draft_sampling)
        self.max_batch_size = max_batch_size
        # the most rows one round runs (a server's slots for requests); the other cache slots
        # only keep finished requests' prefixes for the next ones (``cached_prefix``)
        self.max_running = max_batch_size if max_running is None else max_running
        if not isinstance(self.max_running, int) or not 1 <= self.max_running <= max_batch_size:
            raise ValueError(f"max_running must be an integer in [1, {max_batch_size}] (the "
                             f"cache slots); got {max_running!r}")
        self.max_seq_len = max_seq_len
        self.margin = 2 * self.k + 2  # room for a round's draft/verify writes past the length
        dtype, device = verifier.dtype, verifier.device
        self.device = device
        self.engine_on_cpu = device.type == "cpu" and not isinstance(verifier, torch.nn.Module)
        size = max_seq_len + self.margin
        # an engine that keeps its own cache (llama.cpp) gets none from the decoder
        self.cache = None if getattr(verifier, "owns_cache", False) else new_kv_cache(
            verifier.config, max_batch_size, size, dtype, device)
        self.draft_cache: KVCache | None = None
        # a draft model with a cache of its own (ours, or the engine's)
        self.separate_draft = drafter is not None and drafter.model is not None and (
            not drafter.shares_verifier_cache)
        if self.separate_draft and not getattr(drafter.model, "owns_cache", False):
            self.draft_cache = new_kv_cache(
                drafter.model.config, max_batch_size, size, drafter.model.dtype, device
            )

    # -- one round -------------------------------------------------------------------------

    def step(self, slots: list[int], k: int | None = None
             ) -> tuple[list[list[int]], list[bool]]:
        """One round for the running ``slots``: draft → verify → correct → roll back.
        ``k``: the round's K (default: ``round_k``; 0: no drafts).
        Returns, per slot, the tokens it gained and whether it is still running."""
        with glue_threads(self.glue()):
            return self._step(slots, k)

    def _step(self, slots: list[int], k: int | None) -> tuple[list[list[int]], list[bool]]:
        t0 = time.perf_counter()
        dev = self.device
        lengths_before = [self.host_lengths[s] for s in slots]
        rows, cache_rows = self._rows(slots)
        lengths, tokens = self.lengths[rows], self.tokens[rows]
        # each row's own random numbers (its seed, its tokens so far): what a request samples
        # never depends on the rows beside it; greedy rounds draw none
        streams = None if self.params.is_greedy and not self.draft_sampling else (
            RowStreams.for_rows(self.seeds[rows], self.generated[rows]))
        # the round drafts at most the largest K of its rows (capped by a fixed schedule; the
        # goodput policy picks within it); each row stops at its own K (adaptive K, or a
        # per-request num_draft_tokens)
        if k is None:
            k, auto = self.round_k(slots), self.draft_len_schedule == "auto"
        else:  # the caller's K: no policy
            k, auto = min(k, self.k), False
        # attend over the live part of the cache only (host-side bound: no sync needed)
        bound = max(self.host_lengths[s] for s in slots) + 2 * self.k + 2
        # 1. draft
        draft_tokens, draft_probs, keep, drafted, k_draft, draft_seconds, plan = (
            self._draft_block(slots, tokens, lengths, k, auto and self.costs is not None,
                              bound, streams, rows, cache_rows))
        # constrained rows draft what their grammar forces (a key, '":'), when it does
        draft_tokens, draft_probs, keep, replaced = self._grammar_drafts(
            slots, draft_tokens, draft_probs, keep, drafted)
        # constrained rows: the tokens their grammar allows at each verified position (and,
        # greedy, no drafts past the first one it forbids: they are never kept)
        allowed, keep = self._grammar_masks(slots, draft_tokens, drafted, keep)
        t1 = time.perf_counter()
        # 2. verify [newest, d_1 … d_K] in one pass, each row at its own positions
        width = draft_tokens.shape[1]
        verify_in = torch.cat([tokens.gather(1, lengths[:, None]), draft_tokens], 1)
        pos = lengths[:, None] + self.offsets[: width + 1]
        # the drafts each row may keep (None: every row keeps all ``width``, so there is no
        # mask to apply)
        num_drafted = None if min(drafted) == width else keep
        randoms = None if self.params.is_greedy else row_randoms(  # greedy draws nothing
            streams, width, self.verifier.config.vocab_size)
        leaked_rows = None
        # rows that asked for logprobs: the most top_logprobs among them (None: no row did)
        top = max((self.logprob_tops[s] for s in slots if self.logprob_tops[s] is not None),
                  default=None)
        logprobs = None
        if self._fused_round() and allowed is None and top is None:
            # (the logits must be masked, or read for logprobs, out here)
            # 2 + 3 in one engine call: only the counts and tokens leave it, not the logits
            # (its time counts as verify time)
            num_accepted, next_token, _ = self.verifier.verify_and_correct(
                verify_in, pos, self.cache, self.params, randoms, draft_probs, num_drafted,
                kv_len=bound, rows=cache_rows)
            t2 = time.perf_counter()
        else:
            audit = self.audit_epsilon is not None
            # an engine that feeds rows ragged (llama.cpp) skips the padding past each row's
            # drafts: on a CPU every fed position costs
            ragged = {"num_tokens": keep + 1} if num_drafted is not None and getattr(
                self.verifier, "feeds_ragged", False) else {}
            logits, leak = self.verifier(verify_in, pos, self.cache, kv_len=bound,
                                         rows=cache_rows, audit=audit, **ragged)
            raw_logits = logits
            if allowed is not None:
                logits = logits.masked_fill(~allowed, float("-inf"))
            t2 = time.perf_counter()
            # 3. correct: a position that looked at a later one (the audit) is not trusted
            if audit:
                leaked = leak > self.audit_epsilon
                leaked_rows = leaked.any(1)
                num_drafted = torch.minimum(
                    torch.where(leaked_rows, leaked.int().argmax(1), width), keep)
            num_accepted, next_token = correct_for(dev)(
                logits, draft_tokens, draft_probs, self.params, randoms, num_drafted)
        # 4. roll back: accepted drafts, then the rule's token at index num_accepted; the new
        # length is all the rollback there is
        emitted = torch.cat([draft_tokens, next_token[:, None]], 1)
        emitted.scatter_(1, num_accepted[:, None], next_token[:, None])
        if top is not None:  # a second host transfer, only for rounds whose rows asked
            logprobs = host_entries(*token_logprobs(raw_logits, emitted, top))
        self.tokens[rows[:, None], pos + 1] = emitted
        advance = num_accepted + 1
        self.lengths.index_add_(0, rows, advance)
        # the counter of each row's random stream; a row that stopped this round is not
        # stepped again, so only running rows need it exact
        self.generated.index_add_(0, rows, advance)
        # the round's one host transfer: the counts and tokens, and what only the device
        # knows this round (audited drafts, adapted K); the host mirrors the rest
        columns = [num_accepted[:, None]]
        if leaked_rows is not None:
            columns += [num_drafted[:, None], leaked_rows[:, None].long()]
        if self.adaptive_k:
            # a block is full when all the row kept passed; a row that kept none (its lookup
            # found nothing, the policy drafted none, its request asked for none) keeps its K
            k_rows = self.k_rows[rows]
            full = torch.where(num_accepted == keep, k_rows, num_accepted)
            k_rows = torch.where(keep > 0, adapt_k(k_rows, full, self.k), k_rows)
            self.k_rows[rows] = k_rows
            columns.append(k_rows[:, None])
        host = torch.cat([*columns, emitted], 1).tolist()
        out = self._account(slots, host, drafted, audited=leaked_rows is not None,
                            logprobs=logprobs)
        if k_draft and self.separate_draft:
            # the draft model fed each row its newest token and its own drafts: a model row's
            # cache now holds all but its newest two; a lookup row kept other drafts (maybe
            # more than the model's K), so only what was there before this round and the
            # newest token
            for s, before in zip(slots, lengths_before, strict=True):
                fed = k_draft if self.drafter_of(s) == "model" and s not in replaced else 1
                self.draft_valid[s] = min(self.host_lengths[s] - 1, before + fed)
        t3 = time.perf_counter()
        self.last_round = (k_draft, width, draft_seconds, t3 - t1)
        # a round whose draft pass caught a row up (its lazy prefill) is no sample of a
        # draft's cost
        if self.costs is not None and not self.caught_up:
            self.costs.observe(len(slots), k_draft, width, draft_seconds, t3 - t1)
        if plan is not None:
            tokens = sum(len(t) for t in out[0])
            self.rounds.add(plan.rows, plan.plain_seconds, plan.expected_tokens, plan.seconds,
                            tokens, t3 - t0)
            # what the plan expected of its drafters against what they made: each drafter
            # that drafted learns the policy's error on its rounds
            realized = tokens / (t3 - t0) * plan.plain_seconds / plan.rows
            for name, k_used in (("model", plan.k_model), ("ngram", plan.k_lookup)):
                if k_used:
                    self.monitors[name].judge(realized / plan.expected_speedup)
        self.rounds.by_width[width] += 1
        for s in slots:
            times = self.slot_times[s]
            times[0] += t1 - t0
            times[1] += t2 - t1
            times[2] += t3 - t2
            times[3] += t3 - t0
        return out

    def _account(self, slots: list[int], host: list[list[int]], drafted: list[int],
                 audited: bool, logprobs: list[list[LogprobEntry]] | None = None
                 ) -> tuple[list[list[int]], list[bool]]:
        """The host side of a round, from its one transfer (per row: accepted count, [the
        drafts it kept and whether the audit cut it], [its next K], the emitted block): the
        host mirrors, the metrics and the stop handling. ``logprobs``: per row, its emitted
        positions' entries (rows that asked keep those of the tokens they gained).
        Returns, per slot, the tokens it gained and whether it is still running."""
        skip = 1 + (2 if audited else 0) + (1 if self.adaptive_k else 0)  # before the block
        gained, running = [], []
        totals = {name: [0, 0, 0] for name in self.monitors}  # drafted, accepted, reached
        for i, (slot, row, d) in enumerate(zip(slots, host, drafted, strict=True)):
            n = row[0]
            leak = 0
            if audited:
                d, leak = row[1], row[2]
            if self.adaptive_k:
                self.host_k[slot] = row[skip - 1]
            self.host_lengths[slot] += n + 1
            counts = self.slot_counts[slot]  # as SpecStats' fields, in _COUNTS order
            counts[0] += 1
            counts[1] += d
            counts[2] += n
            counts[3] += n < d
            counts[4] += d > 0
            counts[5] += leak
            self.accepted_hist[slot][n] += 1
            self.drafted_hist[slot][d] += 1
            total = totals[self.drafter_of(slot)]
            total[0] += d
            total[1] += n
            total[2] += n + (n < d)  # the accepted positions, and the rejected one if any
            block = row[skip: skip + n + 1]
            grammar = self.grammars[slot]
            if grammar is not None:  # the row ends where its grammar is complete
                block = grammar.advance(block)
            self.host_tokens[slot] += block  # as the cache holds them (past a stop too)
            tokens, alive = self._stop(slot, block)
            if self.logprob_tops[slot] is not None:
                self._keep_logprobs(slot, logprobs[i][: len(tokens)])
            gained.append(tokens)
            running.append(alive)
        for name, (d, n, reached) in totals.items():
            self.monitors[name].update(d, n, reached)
        return gained, running

    def _grammar_drafts(self, slots: list[int], draft_tokens: Tensor, draft_probs: Tensor | None,
                        keep: Tensor, drafted: list[int]
                        ) -> tuple[Tensor, Tensor | None, Tensor, set[int]]:
        """Where a constrained row's grammar forces its next tokens (known without a model:
        verified, they are accepted unless the row ends), they become the row's drafts, in
        place of the drafter's, unless it proposed them already (and maybe more). The round
        widens for them up to the row's K (a lookup that found nothing leaves it 0),
        except past sampled drafts, whose q has no room. Returns the drafts, their q, the
        kept counts (copies where changed) and the slots whose drafts were replaced (a draft
        model's cache holds none of them); ``drafted`` is updated in place."""
        replaced: set[int] = set()
        if not self.k or all(self.grammars[s] is None for s in slots):
            return draft_tokens, draft_probs, keep, replaced
        width = draft_tokens.shape[1]
        room = width if draft_probs is not None else self.k
        # at most the row's own K: a request that asked for none (num_draft_tokens 0)
        # decodes plainly, constrained
        forced = [[] if self.grammars[s] is None or not self.host_k[s] else
                  self.grammars[s].forced()[:min(room, self.host_k[s])] for s in slots]
        if not any(forced):
            return draft_tokens, draft_probs, keep, replaced
        host_drafts = draft_tokens.tolist()  # one transfer, in rounds where a grammar forces
        wider = max(width, max(map(len, forced)))
        draft_tokens = torch.nn.functional.pad(draft_tokens, (0, wider - width))
        keep = keep.clone()
        draft_probs = None if draft_probs is None else draft_probs.clone()
        for b, s in enumerate(slots):
            n = len(forced[b])
            if not n or (drafted[b] >= n and host_drafts[b][:n] == forced[b]):
                continue
            draft_tokens[b, :n] = torch.tensor(forced[b], device=draft_tokens.device)
            keep[b] = n
            drafted[b] = n
            if draft_probs is not None:  # a certain draft: q is one-hot
                draft_probs[b, :n] = 0
                draft_probs[b, torch.arange(n), forced[b]] = 1
            replaced.add(s)
        return draft_tokens, draft_probs, keep, replaced

    def _grammar_masks(self, slots: list[int], draft_tokens: Tensor, drafted: list[int],
                       keep: Tensor) -> tuple[Tensor | None, Tensor]:
        """(Bool [B, width + 1, vocab]: the tokens each row's grammar allows at each verified
        position, after the drafts before it (all, for rows without one), or None when no
        row has a grammar; the drafts each row keeps). The matchers live on the host, so a
        round with a constrained row moves its drafts there (one transfer); the walk is per
        constrained row. Greedy, a row keeps no draft past the first its grammar forbids:
        the masked verifier never picks it, so the output is the same and those positions
        are not verified (an engine fed ragged skips them; ``drafted`` is cut in place).
        Sampled rows keep them: a rejected draft's residual is part of the exact rule."""
        if all(self.grammars[s] is None for s in slots):
            return None, keep
        vocab = self.verifier.config.vocab_size
        width = draft_tokens.shape[1]
        bitmasks = np.full((len(slots), width + 1, (vocab + 31) // 32), -1, dtype=np.int32)
        drafts = draft_tokens.tolist()
        cut = False
        for b, s in enumerate(slots):
            grammar = self.grammars[s]
            if grammar is not None:
                valid = grammar.masks(drafts[b][: drafted[b]], bitmasks[b])
                if self.params.is_greedy and valid < drafted[b]:
                    drafted[b], cut = valid, True
        if cut:
            keep = torch.minimum(keep, torch.tensor(drafted, device=keep.device))
        return allowed_tokens(bitmasks, vocab).to(self.device), keep

    def drafter_of(self, slot: int) -> str:
        """Which drafter drafts this slot's request: "ngram" (the lookup) or "model"."""
        return "ngram" if self.primary == "ngram" or self.host_lookup[slot] else "model"

    @property
    def monitor(self) -> AcceptanceMonitor:
        """The running acceptance of the decoder's own drafter (``monitors`` has each)."""
        return self.monitors[self.primary]

    def _stop(self, slot: int, tokens: list[int]) -> tuple[list[int], bool]:
        """Stop handling for one row, on the host: keep ``tokens`` up to the first end id and
        within max_new_tokens; a row whose grammar is complete ends. Returns the kept tokens
        and whether the row runs on."""
        eos = self.host_eos[slot]
        given = len(tokens)  # the block, as host_tokens ends with it
        ended = False
        for i, t in enumerate(tokens):
            if t in eos:
                tokens, ended = tokens[: i + 1], True
                break
        grammar = self.grammars[slot]
        ended = ended or (grammar is not None and grammar.done)  # the grammar is complete
        kept = tokens[: self.host_limit[slot] - self.host_generated[slot]]
        self.host_generated[slot] += len(kept)
        alive = not ended and self.host_generated[slot] < self.host_limit[slot]
        if not alive and self.answers.maxlen and not self.calibrating:
            # its prompt and answer, for later lookups
            held = self.host_tokens[slot]
            self.answers.append(held[: len(held) - given + len(kept)])
            self.answers_tensors = None
        return kept, alive

    @property
    def lookup_drafter(self) -> NgramDrafter | SuffixDrafter | None:
        """The model-free drafter rows may draft with (the decoder's own, or ``lookup``)."""
        if self.lookup is not None:
            return self.lookup
        return self.drafter if self.drafter is not None and self.drafter.model is None else None

    def clear_memory(self) -> None:
        """Forget the ended requests the lookup searches (``reset`` keeps them: they are
        the server's, not a batch's)."""
        lookup = self.lookup_drafter
        # the ended requests' prompts and answers (the lookup's memory), oldest evicted first
        self.answers: collections.deque[list[int]] = collections.deque(
            maxlen=0 if lookup is None else lookup.cached_requests)
        self.answers_tensors: dict[str, Tensor] | None = None

    @property
    def memory_tokens(self) -> int:
        """Tokens the lookup's memory of ended requests holds now (bounded by its size)."""
        return sum(len(a) for a in self.answers)

    def _shared_lookup(self) -> dict[str, Tensor]:
        """The lookup's memory: the prompts and answers of the last requests that ended
        (kept apart from the cache slots, which a retry of the same prompt overwrites as it
        goes). For the n-gram lookup as [M, T] tokens and [M] newest indices; for the suffix
        drafter end to end, each followed by -1."""
        if not self.answers:
            return {}
        if self.answers_tensors is None and isinstance(self.lookup_drafter, SuffixDrafter):
            flat = [t for a in self.answers for t in (*a, -1)]
            self.answers_tensors = {"memory": torch.tensor(flat, device=self.device)}
        if self.answers_tensors is None:
            width = self.tokens.shape[1]
            seqs = [a[:width] for a in self.answers]
            tokens = torch.zeros(len(seqs), width, dtype=torch.long)
            for i, a in enumerate(seqs):
                tokens[i, : len(a)] = torch.tensor(a)
            self.answers_tensors = {
                "shared": tokens.to(self.device),
                "shared_lengths": torch.tensor([len(a) - 1 for a in seqs], device=self.device)}
        return self.answers_tensors

    def _rows(self, slots: list[int]) -> tuple[Tensor, Tensor | None]:
        """The rows tensor of ``slots`` and the engine's ``rows`` argument: None for slots
        0..B-1 (the scheduler hands out the lowest free slot, so a steady batch is a prefix
        of the pool): plain cache slices, no per-layer gather copy. Made once per slot set:
        a steady batch builds no tensor from a list."""
        key = tuple(slots)
        if key not in self._rows_cache:
            if len(self._rows_cache) >= 64:  # the scheduler's slot sets come and go
                self._rows_cache.clear()
            rows = torch.tensor(slots, device=self.device)
            self._rows_cache[key] = rows, None if key == tuple(range(len(key))) else rows
        return self._rows_cache[key]

    def _fused_round(self) -> bool:
        """Whether this round verifies and corrects in one engine call. A round that cannot
        (the audit needs the logits; rule parameters the engine has no graph for) counts its
        reason in ``fused_fallback``. Host-side bookkeeping only."""
        if not self.fused:
            return False
        why = (AUDIT_NEEDS_LOGITS if self.audit_epsilon is not None
               else self.verifier.fused_reason(self.params))
        if why is None:
            self.fused_rounds += 1
            return True
        if why not in self.fused_fallback:
            log.warning("fused correction: rounds run unfused (logits + correct()): %s", why)
        self.fused_fallback[why] = self.fused_fallback.get(why, 0) + 1
        return False

    def fused_stats(self) -> dict:
        """Fused correction since the last ``reset``: whether it is on, the rounds it ran,
        and the rounds that fell back to the unfused path, by reason."""
        return {"fused_correction": self.fused, "fused_rounds": self.fused_rounds,
                "fused_fallback": dict(self.fused_fallback)}

    def _draft_block(self, slots: list[int], tokens: Tensor, lengths: Tensor, k: int,
                     auto: bool, bound: int, streams: RowStreams | None, rows: Tensor,
                     cache_rows: Tensor | None
                     ) -> tuple[Tensor, Tensor | None, Tensor, list[int], int, float,
                                RoundPlan | None]:
        """The round's drafts, at most ``k`` a row: tokens [B, width], their q (None: the
        drafts are deterministic), the drafts each row keeps on the device and on the host,
        the draft model's K (0: it sat out), its seconds, and the goodput plan (``auto``;
        else None). Rows that draft by lookup (the drafter is one, or their request asked
        for the one beside a model) look up first: it is cheap, and what each found is what
        the plan weighs. Its width is the most any row keeps: 0 when none does, and the
        round is a plain step. The found counts cross to the host (B integers) because that
        choice is the host's."""
        B = len(slots)
        if self.drafter is None:  # plain decoding
            empty = torch.zeros(B, 0, dtype=torch.long, device=self.device)
            return empty, None, empty.sum(1), [0] * B, 0, 0.0, None
        lookup = self.drafter if self.drafter.model is None else self.lookup
        by_lookup = [self.drafter_of(s) == "ngram" for s in slots]
        model_rows = [i for i in range(B) if not by_lookup[i]]
        looked = None
        found_host = [0] * B
        if k and any(by_lookup):
            history = max(self.host_lengths[s] for s in slots) + 1
            shared = self._shared_lookup()
            if "shared" in shared:
                history = max(history, max(len(a) for a in self.answers))
            looked, found = lookup.lookup(tokens, lengths, k, min(history, tokens.shape[1]),
                                          **shared)
            if self.calibrating:  # time a full block whatever the dummy prompt matches
                found = torch.full_like(found, k)
            found = torch.minimum(found, self.k_rows[rows])
            found_host = found.tolist()
        caps = [min(self.host_k[slots[i]], k) for i in model_rows]
        pinned = [self.host_pinned[s] for s in slots]
        k_model = k_lookup = k
        plan = None
        if auto and k:  # (with K = 0 there is nothing to choose)
            size = B - 1
            lookup_rows = [i for i in range(B) if by_lookup[i]]
            plan = plan_round(self.costs.verify[size], self.costs.draft[size],
                              self.monitors["model"].alpha, self.monitors["ngram"].alpha,
                              caps, [pinned[i] for i in model_rows],
                              [found_host[i] for i in lookup_rows],
                              [pinned[i] for i in lookup_rows],
                              self.monitors["model"].trust, self.monitors["ngram"].trust)
            k_model, k_lookup = plan.k_model, plan.k_lookup
            if (k_model or k_lookup) and self.costs.plain_is_stale(B) and not any(pinned):
                # re-time the baseline: a plain step now and then
                k_model = k_lookup = 0
                plan = RoundPlan(0, 0, B, float(B), plan.plain_seconds, plan.plain_seconds)
            for name, sat_out in [("model", model_rows and not k_model),
                                  ("ngram", lookup_rows and not k_lookup)]:
                if sat_out:  # no evidence this round: α drifts back, so it tries again
                    self.monitors[name].relax(EVIDENCE_FADE)
        # what each row keeps: a model row min(its K, the model's), a lookup row min(what it
        # found, the cap); a pinned row (its request named its K) all of its own
        kept = [min(self.host_k[s], k) if not by_lookup[i] else found_host[i]
                for i, s in enumerate(slots)]
        drafted = [n if pinned[i] else min(n, k_lookup if by_lookup[i] else k_model)
                   for i, n in enumerate(kept)]
        k_draft = max((drafted[i] for i in model_rows), default=0)
        t = time.perf_counter()
        model_drafts, q = self._draft_round(slots, tokens, lengths, k_draft, bound, streams,
                                            cache_rows)
        draft_seconds = time.perf_counter() - t
        width = max(drafted)
        keep = torch.tensor(drafted, device=self.device)  # host → device: no sync
        if looked is None:  # model rows only
            return model_drafts[:, :width], q if q is None else q[:, :width], keep, drafted, \
                k_draft, draft_seconds, plan
        looked = looked[:, :width]
        if not model_rows:
            return looked, None, keep, drafted, 0, draft_seconds, plan
        on = self.lookup_rows[rows]
        model_drafts = torch.nn.functional.pad(model_drafts, (0, width - k_draft))
        drafts = torch.where(on[:, None], looked, model_drafts)
        if q is not None:  # sampled drafts: a lookup row's q is one-hot on its drafts
            point = torch.nn.functional.one_hot(drafts, q.shape[-1]).to(q.dtype)
            point[:, :k_draft] = torch.where(on[:, None, None], point[:, :k_draft], q)
            q = point
        return drafts, q, keep, drafted, k_draft, draft_seconds, plan

    def _draft_round(self, slots: list[int], tokens: Tensor, lengths: Tensor, k: int,
                     bound: int, streams: RowStreams | None, cache_rows: Tensor | None,
                     ) -> tuple[Tensor, Tensor | None]:
        """The draft model's drafts for every row (none when ``k`` is 0: it sits the round
        out). A separate draft cache holds each row's positions below ``draft_valid``: its
        prefill is lazy (a request that never drafts with the model never pays it), and
        undrafted rounds leave it behind; the drafted round re-feeds what it lacks, every
        row in the same call."""
        self.caught_up = False
        if not k:
            return torch.zeros(len(slots), 0, dtype=torch.long, device=self.device), None
        valid = missed = None
        if self.separate_draft:
            lacking = [self.host_lengths[s] - 1 - self.draft_valid[s] for s in slots]
            missed = max(0, max(lacking))
            self.caught_up = missed > self.k
            valid = torch.tensor([self.draft_valid[s] for s in slots], device=self.device)
        return self._draft(tokens, lengths, k, bound, streams, cache_rows, missed or 0, valid)

    def _draft(self, tokens: Tensor, lengths: Tensor, k: int, bound: int,
               streams: RowStreams | None, rows: Tensor | None = None, missed: int = 0,
               valid: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """``valid``: per row, the positions its draft cache holds; ``missed``: the most
        positions a row lacks before the usual re-fed window."""
        cache = self.cache if self.drafter.shares_verifier_cache else self.draft_cache
        # sampled drafts (with their q) only for the rules that use q
        sampling = self.params if self.draft_sampling else None
        return self.drafter.propose(tokens, lengths, k, cache, bound, rows, sampling, streams,
                                    k_max=self.k, missed=missed, valid=valid)

    def glue(self) -> int | None:
        """Torch threads for this decoder's own ops (None: torch's count). With engines on
        the CPU, torch only indexes, takes argmaxes and softmaxes and, for top-p, a few
        histogram passes (``top_p_floor``: no sort): one thread, since idle OpenMP workers
        competed with ONNX Runtime's for the cores."""
        return 1 if self.engine_on_cpu else None

    # -- the round's K (k_policy.py) ---------------------------------------------------------

    def round_k(self, slots: list[int]) -> int:
        """The most a round over ``slots`` drafts: the largest of the rows' K, capped by a
        fixed schedule for this batch size (0: a plain decoding step). The goodput policy
        picks within it."""
        k = max(self.host_k[s] for s in slots) if self.k else 0
        return round_k(len(slots), k, self.disable_by_batch_size, self.draft_len_schedule)

    def calibrate(self, passes: int = 3, rounds: int = 2) -> RoundCosts:
        """Time the round's parts (``RoundCosts``) for K = 0..k at batch sizes 1, 2, 4, …
        up to max_running on a dummy request (``k_policy.measure_round_costs``): a
        lookup's rounds draft full blocks here. The per-slot state is reset after, so call
        it before serving. Sets ``costs``."""
        sizes = calibration_batch_sizes(self.max_running)
        prompt_len = max(1, min(64, self.max_seq_len // 4))
        room = self.max_seq_len - prompt_len
        vocab = self.verifier.config.vocab_size
        prompt = [(7 * i + 3) % vocab for i in range(prompt_len)]
        filled = {"size": 0, "left": 0}  # the running dummy batch and its room to grow

        def time_round(batch_size: int, k: int) -> tuple[float, float]:
            slots = list(range(batch_size))
            if filled["size"] != batch_size or filled["left"] < (rounds + 1) * (k + 1):
                self.reset()  # one prefill per batch size, while the rows have room
                self.prefill(slots, [prompt] * batch_size, [room] * batch_size,
                             [None] * batch_size, [0] * batch_size)
                filled.update(size=batch_size, left=room - 1)
            # an untimed round first: the first after a prefill or another K paid more
            self.step(slots, k=k)
            draft = verify = float("inf")
            for _ in range(rounds):
                self.step(slots, k=k)
                _, _, draft_s, verify_s = self.last_round
                draft, verify = min(draft, draft_s), min(verify, verify_s)
            filled["left"] -= (rounds + 1) * (k + 1)
            return draft, verify

        # the dummy rounds' acceptance must neither count nor alert, nor their K show
        monitors, rounds_stats = self.monitors, self.rounds
        self.monitors = {name: AcceptanceMonitor(floor=0.0, name=name) for name in monitors}
        self.rounds = RoundStats([0] * (self.k + 1))
        self.calibrating = True
        try:
            verify, draft = measure_round_costs(time_round, sizes, self.k, passes)
        finally:
            self.calibrating = False
            self.reset()
            self.monitors, self.rounds = monitors, rounds_stats
        self.costs = RoundCosts.from_calibration(sizes, verify, draft, self.max_running)
        log.info("round costs by batch size %s (rows) and K 0..%d (columns): verify %s, "
                 "draft %s", sizes, self.k, verify.tolist(), draft.tolist())
        return self.costs

    # -- per-slot state: rows of a batch are cache slots, so requests can join and leave ----

    def reset(self) -> None:
        """(Re)allocate the per-slot state; the caches keep their memory."""
        S, dev = self.max_batch_size, self.device
        width = max(self.k, 1)
        self.tokens = torch.zeros(S, self.max_seq_len + self.margin, dtype=torch.long,
                                  device=dev)
        self.lengths = torch.zeros(S, dtype=torch.long, device=dev)
        self.generated = torch.zeros(S, dtype=torch.long, device=dev)
        self.seeds = torch.zeros(S, dtype=torch.long, device=dev)
        self.k_rows = torch.full((S,), width, dtype=torch.long, device=dev)
        self.lookup_rows = torch.zeros(S, dtype=torch.bool, device=dev)  # draft by lookup
        self.offsets = torch.arange(self.margin, device=dev)  # a round's positions past length
        self._rows_cache: dict[tuple[int, ...], tuple[Tensor, Tensor | None]] = {}
        # host mirrors of lengths and K, kept by each round's single transfer
        self.host_lengths = [0] * S
        self.host_k = [width] * S
        self.host_lookup = [False] * S
        self.host_pinned = [False] * S  # the request named its K: the policy leaves it be
        # the rest of the per-slot state lives on the host only: each request's stop rule,
        # its tokens so far and its metrics (SpecStats' counts in _COUNTS order; per round,
        # how many drafts it accepted and kept, which give the per-position counts; seconds of
        # draft, verify, correct and the whole round)
        self.host_generated = [0] * S
        self.host_limit = [0] * S
        self.host_eos: list[frozenset[int]] = [frozenset()] * S
        self.slot_counts = [[0] * len(_COUNTS) for _ in range(S)]
        self.accepted_hist = [[0] * (width + 1) for _ in range(S)]
        self.drafted_hist = [[0] * (width + 1) for _ in range(S)]
        self.slot_times = [[0.0] * 4 for _ in range(S)]
        # each slot's tokens (position i at index i; the newest, not yet in the cache, last)
        # and the positions whose K/V a separate draft's cache holds: what a new request in
        # the slot may reuse (``cached_prefix``), and what a draft pass must re-feed
        self.host_tokens: list[list[int]] = [[] for _ in range(S)]
        self.draft_valid = [0] * S
        self.slot_cached = [0] * S  # prompt tokens the slot's request found in the cache
        self.grammars: list[RowGrammar | None] = [None] * S  # constrained requests' matchers
        # requests that asked for logprobs: their top_logprobs (None: none asked), and the
        # entries of the tokens gained since ``take_logprobs`` last read them
        self.logprob_tops: list[int | None] = [None] * S
        self.slot_logprobs: list[list[LogprobEntry]] = [[] for _ in range(S)]
        self.caught_up = False  # the last draft pass re-fed a lazy prefill
        self.fused_rounds = 0  # rounds verified and corrected in one engine call
        self.fused_fallback: dict[str, int] = {}  # rounds run unfused though fused is on

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
        eos_token_ids: list[EosIds],
        seeds: list[int],
        num_draft_tokens: list[int | None] | None = None,
        lookup_drafts: list[bool] | None = None,
        cached: list[int] | None = None,
        grammars: list[RowGrammar | None] | None = None,
        logprobs: list[int | None] | None = None,
    ) -> tuple[list[list[int]], list[bool]]:
        """Start requests in free slots: run the verifier over the prompts and take the
        first token from the same correction code (K=0). A separate draft model's prefill
        waits for the first round that drafts with it (``_draft_round``).
        ``cached``: per request, how many leading prompt tokens the slot's cache already
        holds (at most ``cached_prefix``: an earlier request's prefix, or ``feed_prompt``'s
        chunks); only the rest is fed.
        ``seeds``: per request, the seed of its own random stream (``RowStreams``).
        ``eos_token_ids``: per request, an end id, a list of them (generation stops at any)
        or None. ``num_draft_tokens``: per-request K (<= the decoder's K; None: K, left to the
        goodput policy; a K named here is the request's own, which the policy leaves be;
        0: no drafts). ``lookup_drafts``: per request, draft with the decoder's ``lookup``
        instead of its drafter (default: no request does). ``grammars``: per request, the
        matcher (``grammar.RowGrammar``, fresh) its output must follow, or None.
        ``logprobs``: per request, how many top log-probabilities each emitted token reports
        (0: only its own; None: no logprobs), read with ``take_logprobs``.
        Returns, per slot, the tokens it gained and whether it is still running."""
        with glue_threads(self.glue()):
            return self._prefill(slots, prompts, max_new_tokens, eos_token_ids, seeds,
                                 num_draft_tokens, lookup_drafts, cached, grammars, logprobs)

    def _prefill(self, slots: list[int], prompts: list[list[int]], max_new_tokens: list[int],
                 eos_token_ids: list[EosIds], seeds: list[int],
                 num_draft_tokens: list[int | None] | None, lookup_drafts: list[bool] | None,
                 cached: list[int] | None, grammars: list[RowGrammar | None] | None = None,
                 logprobs: list[int | None] | None = None
                 ) -> tuple[list[list[int]], list[bool]]:
        for p, m in zip(prompts, max_new_tokens, strict=True):
            self.check_request(p, m)
        logprobs = [None] * len(slots) if logprobs is None else logprobs
        for top in logprobs:
            check_top_logprobs(top)
        cached = self._check_cached(slots, prompts, cached)
        eos = []
        for ids in eos_token_ids:  # host-side, once per request
            ids = token_ids("eos_token_id", ids)
            if len(ids) > MAX_STOP_IDS:
                raise ValueError(f"eos_token_id must list at most {MAX_STOP_IDS} ids; got "
                                 f"{len(ids)}")
            eos.append(frozenset(ids))
        width = max(self.k, 1)
        if num_draft_tokens is None:
            num_draft_tokens = [None] * len(slots)
        pinned = [k is not None for k in num_draft_tokens]
        num_draft_tokens = [width if k is None else k for k in num_draft_tokens]
        for k in num_draft_tokens:  # 0: this request decodes without drafts
            if not isinstance(k, int) or not 0 <= k <= width:
                raise ValueError(f"num_draft_tokens must be an integer in [0, {width}]; got {k!r}")
        if lookup_drafts is None:
            lookup_drafts = [False] * len(slots)
        if any(lookup_drafts) and self.lookup is None:
            raise ValueError("lookup_drafts: this decoder has no n-gram lookup beside its "
                             f"drafter {getattr(self.drafter, 'kind', None)!r}")
        t0 = time.perf_counter()
        dev, B = self.device, len(slots)
        rows = torch.tensor(slots, device=dev)
        prompt_lens = torch.tensor([len(p) for p in prompts], device=dev)
        t_prompt = max(len(p) for p in prompts)
        padded = torch.zeros(B, t_prompt, dtype=torch.long)
        for b, p in enumerate(prompts):  # host → device once per request
            padded[b, : len(p)] = torch.tensor(p)
        self.tokens[rows, :t_prompt] = padded.to(dev)
        self.lengths[rows] = prompt_lens
        self.generated[rows] = 0
        self.seeds[rows] = torch.tensor(seeds, dtype=torch.long, device=dev)
        self.k_rows[rows] = torch.tensor(num_draft_tokens, device=dev)
        self.lookup_rows[rows] = torch.tensor(lookup_drafts, device=dev)
        for b, s in enumerate(slots):
            self.host_k[s] = num_draft_tokens[b]
            self.host_pinned[s] = pinned[b]
            self.host_lookup[s] = bool(lookup_drafts[b])
            self.host_generated[s], self.host_limit[s] = 0, max_new_tokens[b]
            self.host_eos[s] = eos[b]
            self.slot_counts[s] = [0] * len(_COUNTS)
            self.accepted_hist[s] = [0] * (width + 1)
            self.drafted_hist[s] = [0] * (width + 1)
            self.slot_times[s] = [0.0] * 4
            self.slot_cached[s] = cached[b]
            self.grammars[s] = None if grammars is None else grammars[b]
            self.logprob_tops[s], self.slot_logprobs[s] = logprobs[b], []
        logits = self._feed_prompts(slots, prompts, cached, [len(p) for p in prompts])
        empty = torch.zeros(B, 0, dtype=torch.long, device=dev)
        allowed, _ = self._grammar_masks(slots, empty, [0] * B,
                                         torch.zeros(B, dtype=torch.long, device=dev))
        masked = logits if allowed is None else logits.masked_fill(~allowed, float("-inf"))
        vocab = self.verifier.config.vocab_size
        randoms = None if self.params.is_greedy else row_randoms(
            RowStreams.for_rows(self.seeds[rows], self.generated[rows]), 0, vocab)
        _, first = correct_for(dev)(masked, empty, None, self.params, randoms)
        self.tokens[rows, prompt_lens] = first
        self.generated[rows] = 1
        top = max((t for t in logprobs if t is not None), default=None)
        entries = None if top is None else host_entries(
            *token_logprobs(logits.reshape(B, 1, -1), first[:, None], top))
        first = first.tolist()
        out = []
        for b, (s, t) in enumerate(zip(slots, first, strict=True)):
            self.host_tokens[s].append(t)
            grammar = self.grammars[s]
            if grammar is not None:
                grammar.advance([t])
            out.append(self._stop(s, [t]))
            if logprobs[b] is not None:
                self._keep_logprobs(s, entries[b])
        for s in slots:
            self.slot_times[s][3] += time.perf_counter() - t0
        return [tokens for tokens, _ in out], [alive for _, alive in out]

    def _keep_logprobs(self, slot: int, entries: list[LogprobEntry]) -> None:
        """A round's entries for the tokens the slot kept, each cut to the request's own
        top_logprobs (the round computed its rows' most)."""
        top = self.logprob_tops[slot]
        self.slot_logprobs[slot] += [(lp, best[:top]) for lp, best in entries]

    def take_logprobs(self, slot: int) -> list[LogprobEntry]:
        """The entries of the tokens the slot gained since the last call (one per token, in
        order; empty where its request asked for none)."""
        entries, self.slot_logprobs[slot] = self.slot_logprobs[slot], []
        return entries

    def cached_prefix(self, slot: int, prompt: list[int]) -> int:
        """How many leading tokens of ``prompt`` the slot's verifier cache already holds
        (what its last request left there), at most all but the last: the prefill must
        feed one token for the first token's logits."""
        return min(self.common_prefix(slot, prompt), len(prompt) - 1)

    def common_prefix(self, slot: int, tokens: list[int]) -> int:
        """How many leading ``tokens`` the slot's cache holds."""
        held = self.host_tokens[slot][: self.host_lengths[slot]]
        return next((i for i, (a, b) in enumerate(zip(held, tokens, strict=False)) if a != b),
                    min(len(held), len(tokens)))

    @property
    def copies_prefixes(self) -> bool:
        """Whether ``copy_prefix`` can copy between slots: caches of the decoder's own, or
        engines that copy theirs (llama.cpp)."""
        engines = [self.verifier] + ([self.drafter.model] if self.separate_draft else [])
        return all(not getattr(e, "owns_cache", False) or hasattr(e, "copy_prefix")
                   for e in engines)

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Slot ``dst`` gets the first ``n`` positions of slot ``src``'s caches (the
        verifier's, and what a separate draft's holds of them) and tokens: a request reuses
        a prefix another slot holds without taking that slot (whose own tokens may come back:
        a conversation's next turn)."""
        n = min(n, self.host_lengths[src])
        caches = [(self.verifier, self.cache, n)]
        if self.separate_draft:
            drafted = min(n, self.draft_valid[src])
            caches.append((self.drafter.model, self.draft_cache, drafted))
            self.draft_valid[dst] = drafted
        for engine, cache, m in caches:
            if cache is None:  # the engine keeps it
                engine.copy_prefix(src, dst, m)
            else:
                for layer in (*cache.k, *cache.v):
                    layer[dst, :m] = layer[src, :m]
        self.host_tokens[dst] = self.host_tokens[src][:n]
        self.host_lengths[dst] = n

    def forget(self, slots: list[int]) -> None:
        """The slots' caches hold nothing reusable (a round that failed may have left them
        half written)."""
        for s in slots:
            self.host_lengths[s] = self.draft_valid[s] = 0
            self.host_tokens[s] = []

    def feed_prompt(self, slots: list[int], prompts: list[list[int]], starts: list[int],
                    ends: list[int]) -> None:
        """A chunk of each prompt into the verifier cache (``prompts[b][starts[b]:ends[b]]``,
        ``starts[b]`` at most ``cached_prefix``), so that a long prompt is read over several
        scheduler rounds beside the running requests; ``prefill(..., cached=ends)`` reads
        the rest and starts the request."""
        for p, start, end in zip(prompts, starts, ends, strict=True):
            if not start < end < len(p):
                raise ValueError(f"feed_prompt: a chunk must end before the prompt's last "
                                 f"token; got [{start}, {end}) of {len(p)}")
        self._check_cached(slots, prompts, starts)
        with glue_threads(self.glue()):
            self._feed_prompts(slots, prompts, starts, ends)

    def _check_cached(self, slots: list[int], prompts: list[list[int]],
                      cached: list[int] | None) -> list[int]:
        if cached is None:
            return [0] * len(slots)
        for s, p, n in zip(slots, prompts, cached, strict=True):
            if not isinstance(n, int) or not 0 <= n <= self.cached_prefix(s, p):
                raise ValueError(f"cached must be in [0, {self.cached_prefix(s, p)}] for slot "
                                 f"{s} (the prefix its cache holds); got {n!r}")
        return list(cached)

    def _feed_prompts(self, slots: list[int], prompts: list[list[int]], starts: list[int],
                      ends: list[int]) -> Tensor:
        """Run the verifier over ``prompts[b][starts[b]:ends[b]]`` at their positions, in
        one call; the logits at each row's last fed position, [B, 1, V]. Shorter rows are
        padded with their last token at its own position again (the same K/V, written
        twice), so no row writes past its end."""
        dev = self.device
        width = max(e - s for s, e in zip(starts, ends, strict=True))
        fed = torch.zeros(len(slots), width, dtype=torch.long)
        pos = torch.zeros(len(slots), width, dtype=torch.long)
        for b, (p, start, end) in enumerate(zip(prompts, starts, ends, strict=True)):
            n = end - start
            fed[b, :n] = torch.tensor(p[start:end])
            fed[b, n:] = p[end - 1]
            pos[b] = torch.arange(start, start + width).clamp(max=end - 1)
        for s, p, start, end in zip(slots, prompts, starts, ends, strict=True):
            # the prefix the draft's cache holds of this prompt
            self.draft_valid[s] = min(self.draft_valid[s], start)
            self.host_tokens[s] = list(p[:end])
            self.host_lengths[s] = end
        rows = torch.tensor(slots, device=dev)
        last = torch.full((len(slots), 1), width - 1, device=dev)
        logits, _ = self.verifier(fed.to(dev), pos.to(dev), self.cache, kv_len=max(ends),
                                  rows=rows, output_index=last)
        return logits

    def slot_stats(self, slot: int) -> SpecStats:
        counts = dict(zip(_COUNTS, self.slot_counts[slot], strict=True))
        t = self.slot_times[slot]
        return SpecStats(
            **counts, generated_tokens=self.host_generated[slot],
            accepted_per_position=more_than(self.accepted_hist[slot])[: self.k],
            drafted_per_position=more_than(self.drafted_hist[slot])[: self.k],
            draft_time=t[0], verify_time=t[1], correct_time=t[2], total_time=t[3],
            cached_tokens=self.slot_cached[slot],
        )

    # -- a fixed batch, start to finish ------------------------------------------------

    def stream(
        self,
        prompts: list[list[int]],
        max_new_tokens: int | list[int],
        seed: int = 0,
        eos_token_id: EosIds = None,
        stats: list[SpecStats] | None = None,
        seeds: list[int] | None = None,
        grammars: list[RowGrammar | None] | None = None,
        logprobs: int | None = None,
    ) -> Iterator[list[list[int]]]:
        """Yield, per round, the tokens each row gained (an empty list for finished rows).
        ``eos_token_id``: an id or a list of ids; a row stops after the first it emits.
        ``seeds``: each row's own seed (default: ``row_seeds(seed, B)``), so that a prompt
        samples as it does alone with that seed, whatever batch it runs in.

        ``stats``: pass an empty list to receive per-row SpecStats (filled when done).
        ``grammars``: per row, a fresh matcher its output must follow, or None.
        ``logprobs``: top_logprobs for every row (``prefill``'s), read with ``take_logprobs``.
        """
        B = len(prompts)
        if not 1 <= B <= self.max_batch_size:
            raise ValueError(f"batch size must be in [1, {self.max_batch_size}]; got {B}")
        if isinstance(max_new_tokens, int):
            max_new_tokens = [max_new_tokens] * B
        for p, m in zip(prompts, max_new_tokens, strict=True):
            self.check_request(p, m)
        if self.draft_len_schedule == "auto" and self.k and self.costs is None:
            self.calibrate()
        self.reset()
        slots = list(range(B))
        t0 = time.perf_counter()
        if seeds is not None and len(seeds) != B:
            raise ValueError(f"seeds: one per prompt; got {len(seeds)} for {B}")
        new, running = self.prefill(slots, prompts, max_new_tokens, [eos_token_id] * B,
                                    row_seeds(seed, B) if seeds is None else seeds,
                                    grammars=grammars, logprobs=[logprobs] * B)
        while True:
            out = [[] for _ in range(B)]
            for slot, tokens in zip(slots, new, strict=True):
                out[slot] = tokens
            yield out
            slots = [s for s, r in zip(slots, running, strict=True) if r]
            if not slots:
                break
            new, running = self.step(slots)
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
        eos_token_id: EosIds = None,
        seeds: list[int] | None = None,
        grammars: list[RowGrammar | None] | None = None,
        logprobs: int | None = None,
    ) -> GenerationResult:
        out: list[list[int]] = [[] for _ in prompts]
        entries: list[list[LogprobEntry]] = [[] for _ in prompts]
        row_stats: list[SpecStats] = []
        for step in self.stream(prompts, max_new_tokens, seed, eos_token_id, row_stats,
                                seeds, grammars, logprobs):
            for b, (row, new) in enumerate(zip(out, step, strict=True)):
                row.extend(new)
                entries[b] += self.take_logprobs(b)
        return GenerationResult(out, row_stats, aggregate(row_stats),
                                None if logprobs is None else entries)




def more_than(hist: list[int]) -> list[int]:
    """From hist[n] = rounds with value n: for each p, the rounds with a value above p (the
    rounds that accepted, or drafted, position p)."""
    out, total = [], sum(hist)
    for count in hist[:-1]:
        total -= count
        out.append(total)
    return out


def fused_on(verifier: object, mode: str) -> bool:
    """Resolve ``fused_correction`` (on / off / auto) for this verifier engine."""
    if mode not in FUSED_MODES:
        raise ValueError(f"fused_correction must be one of {', '.join(FUSED_MODES)}; "
                         f"got {mode!r}")
    carries = getattr(verifier, "has_correction", False)
    if mode == "on" and not carries:
        raise ValueError("fused_correction='on' needs a verifier engine with a correction "
                         "graph (an engine dir from `paradraft build`: ONNX Runtime or "
                         "TensorRT); this verifier has none: use 'auto' or 'off'")
    return carries and (mode == "on" or (mode == "auto" and verifier.fused_by_default))


def row_seeds(seed: int, batch_size: int) -> list[int]:
    """Distinct per-row seeds for a batch generated under one ``seed``; row 0 gets ``seed``
    itself, so a prompt generated alone samples as a served request with that seed."""
    return [(seed + b * 1_000_003) % 2**63 for b in range(batch_size)]
