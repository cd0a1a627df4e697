"""In-flight batching: many requests over a fixed pool of KV-cache slots.

Requests join the running batch between rounds (a batched prefill into free slots) and leave
as soon as they finish or are cancelled; their slot is reused by the next request. Requests
wait in a bounded queue: at most ``max_queue`` beyond the free slots (which the next round
fills). A full queue first drops the requests cancelled while they waited, then refuses a
request at once (``QueueFull``) instead of letting work pile up. One background thread owns
the decoder.

The decoder's correction is vectorised over rows with one set of rule parameters, so the
running requests form one group per parameter set (rule, temperature, top-p, rule
parameters); each round steps every group in turn. A request never waits for another
group to drain: with one parameter set (the usual case) a round is one batched step. Each
request samples from its own counter-based stream (its seed and its tokens so far), so its
output never depends on what runs beside it. K (``num_draft_tokens``) is per request; 0
turns drafting off for that request alone. So is the drafter, where the decoder has an
n-gram lookup beside a draft model (``lookup_drafts``).

Prefix caching: a finished request leaves its K/V in its slot, and the decoder keeps its
tokens. A new request takes the free slot whose cache holds the longest prefix of its prompt
(a system prompt, the earlier turns of a chat, a retry) and only the rest of its prompt is
fed; with no such slot, the least recently used one (``_pick_slot``), into which a longer
prefix another slot holds (a shared system prompt) is copied first. The decoder may have
more cache slots than requests run at once (``max_running``): the others only keep
prefixes.

Chunked prefill: while requests run, an admitted prompt is fed at most ``prefill_chunk``
tokens a round (over all prompts), beside the running requests' round, so a long prompt
never stalls the other streams for more than a chunk. With nothing running, whole prompts
go in at once.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .correction import RuleParams
from .grammar import RowGrammar
from .logprobs import LogprobEntry
from .metrics import SpecStats
from .speculative import SpeculativeDecoder

log = logging.getLogger("paradraft")
CANCEL_CHECK_S = 0.05  # how often running requests are asked whether they were cancelled
# the fewest prompt tokens a prefix copy from another slot must save: a llama.cpp sequence
# copies whole (tens of MB of K/V), which costs about what a few prompt tokens do
MIN_COPY = 16


class QueueFull(RuntimeError):
    pass


class ShuttingDown(RuntimeError):
    """The scheduler stopped: requests still queued or running end with this (a server
    answers them "unavailable: retry elsewhere", as a full queue)."""


@dataclass
class Request:
    prompt: list[int]
    max_new_tokens: int
    params: RuleParams
    on_tokens: Callable[[list[int]], None]  # the tokens gained in a round
    on_done: Callable[[SpecStats | None, BaseException | None], None]
    num_draft_tokens: int | None = None
    # draft with the decoder's n-gram lookup instead of its drafter (a request's drafter
    # "ngram" on a server whose drafter has a model)
    lookup_drafts: bool = False
    seed: int = 0
    eos_token_id: int | tuple[int, ...] | None = None  # generation stops at any of these
    is_cancelled: Callable[[], bool] = lambda: False
    # token sequences that end the request once the output contains one (TensorRT-LLM's
    # stop_words: the output keeps the stop sequence)
    stop_sequences: list[list[int]] = field(default_factory=list)
    arrival: float = field(default_factory=time.perf_counter)
    recent: list[int] = field(default_factory=list)  # output tail a stop sequence may start in
    grammar: RowGrammar | None = None  # a fresh matcher the output must follow
    logprobs: int | None = None  # top_logprobs per token (0: its own only; None: none)
    # the logprob entries of the tokens gained in a round, just before ``on_tokens``
    on_logprobs: Callable[[list[LogprobEntry]], None] = lambda entries: None


def group_key(params: RuleParams) -> RuleParams:
    """The parameters a group shares: greedy ignores temperature, top-p and the rule
    parameters, so every greedy request joins one group."""
    return RuleParams("greedy") if params.is_greedy else params


def tell_done(request: Request, stats: SpecStats | None, error: BaseException | None) -> None:
    """``request.on_done``; a callback that raises is logged, so the scheduler and the other
    requests go on."""
    try:
        request.on_done(stats, error)
    except Exception:
        log.exception("request callback failed")


def stop_cut(recent: list[int], new: list[int], stop_sequences: list[list[int]]) -> int | None:
    """How many of the ``new`` tokens to keep when the earliest stop sequence ends among
    them (``recent``: the output just before them), else None."""
    text = recent + new
    for end in range(len(recent) + 1, len(text) + 1):
        if any(text[max(end - len(stop), 0): end] == stop for stop in stop_sequences):
            return end - len(recent)
    return None


@dataclass
class Prefilling:
    """An admitted request whose prompt is partly in its slot's cache (``done`` tokens)."""

    request: Request
    done: int
    cached: int  # of ``done``, the tokens a earlier request left in the slot


class Scheduler:
    def __init__(self, decoder: SpeculativeDecoder, max_queue: int = 64,
                 prefill_chunk: int | None = None, prefix_cache: bool = True,
                 spread_slots: bool | None = None):
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0; got {max_queue}")
        if prefill_chunk is not None and (not isinstance(prefill_chunk, int)
                                          or prefill_chunk < 1):
            raise ValueError(f"prefill_chunk must be an integer >= 1 or None (whole prompts); "
                             f"got {prefill_chunk!r}")
        self.decoder = decoder
        self.max_queue = max_queue
        self.prefill_chunk = prefill_chunk
        self.prefix_cache = prefix_cache
        # with no prefix hit, a request takes the least recently used free slot (spread), or
        # the lowest free one: where the decoder owns the cache, rounds over slots 0..B-1
        # read plain slices of it and rounds over any other set gather its rows in every
        # layer. Default: spread where slots are llama.cpp sequences, or kept beyond the
        # running ones (cache slots)
        self.spread_slots = (getattr(decoder.verifier, "owns_cache", False)
                             or decoder.max_batch_size > decoder.max_running
                             ) if spread_slots is None else spread_slots
        self.max_running = decoder.max_running  # requests in slots; the rest keep prefixes
        self.queue: collections.deque[Request] = collections.deque()
        self.running: dict[int, Request] = {}  # slot -> request
        self.prefilling: dict[int, Prefilling] = {}  # slot -> admitted, prompt partly in
        self.free = list(range(decoder.max_batch_size))
        self.last_used = [0.0] * decoder.max_batch_size  # when each slot was freed (LRU)
        self.lock = threading.Condition()
        self.stopping = False
        self.last_cancel_check = 0.0
        decoder.reset()
        self.thread = threading.Thread(target=self._loop, name="paradraft-scheduler",
                                       daemon=True)
        self.thread.start()

    # -- called from request threads ----------------------------------------------------

    def submit(self, request: Request) -> None:
        """Validate and enqueue; raises ValueError (bad request) or QueueFull."""
        self.decoder.check_request(request.prompt, request.max_new_tokens)
        if any(not stop for stop in request.stop_sequences):
            raise ValueError("stop_sequences must not contain an empty sequence")
        k = request.num_draft_tokens
        width = max(self.decoder.k, 1)
        if k is not None and (not isinstance(k, int) or not 0 <= k <= width):
            raise ValueError(f"num_draft_tokens must be an integer in [0, {width}] (0: no "
                             f"drafts); got {k!r}")
        if request.lookup_drafts and self.decoder.lookup is None:
            raise ValueError("drafter: this server drafts with "
                             f"{getattr(self.decoder.drafter, 'kind', None)!r} only")
        dropped: list[Request] = []
        with self.lock:
            if self.stopping:
                raise ShuttingDown("scheduler is shutting down")
            if len(self.queue) >= self.max_queue + self._room():
                # requests cancelled while they waited give their places up now, not only
                # when a slot frees: clients that gave up must not keep others out
                dropped = [req for req in self.queue if req.is_cancelled()]
                for req in dropped:
                    self.queue.remove(req)
            waiting, free_slots = len(self.queue), self._room()
            limit = self.max_queue + free_slots
            if waiting < limit:
                self.queue.append(request)
                self.lock.notify()
        for req in dropped:  # outside the lock: the callback talks to the client
            tell_done(req, None, None)
        if waiting >= limit:
            raise QueueFull(f"queue full ({waiting} waiting: max_queue {self.max_queue} + "
                            f"{free_slots} free slots); retry later")

    def _room(self) -> int:
        """Requests that may start now (under the lock)."""
        return self.max_running - len(self.running) - len(self.prefilling)

    def stats(self) -> dict:
        with self.lock:
            return {"active": len(self.running) + len(self.prefilling),
                    "queued": len(self.queue), "free_slots": self._room()}

    def stop(self, timeout: float = 30) -> None:
        with self.lock:
            self.stopping = True
            self.lock.notify()
        self.thread.join(timeout=timeout)

    # -- the scheduler thread -----------------------------------------------------------

    def _admit(self) -> list[tuple[int, Request]]:
        """Take queued requests into free slots, in arrival order: each into the slot that
        holds the longest prefix of its prompt, else the least recently used one."""
        admitted, dropped = [], []
        with self.lock:
            while (not self.queue and not self.running and not self.prefilling
                   and not self.stopping):
                self.lock.wait()
            while self.queue and self._room() > 0:
                head = self.queue.popleft()
                if head.is_cancelled():  # stopped while it waited: it never starts
                    dropped.append(head)
                    continue
                slot, cached = self._pick_slot(head.prompt)
                self.free.remove(slot)
                self.prefilling[slot] = Prefilling(head, cached, cached)
                admitted.append((slot, head))
        for req in dropped:  # outside the lock: the callback talks to the client
            tell_done(req, None, None)
        return admitted

    def _pick_slot(self, prompt: list[int]) -> tuple[int, int]:
        """(slot, prompt tokens its cache holds). A hit overwrites what the slot held past
        the common prefix: take it where the prompt continues (or repeats) the slot's
        tokens, or shares at least half of them; else the least recently used slot (an
        empty one first; or the lowest, ``spread_slots``), so that a shared system prompt
        alone does not evict a conversation that may come back."""
        if not self.prefix_cache:
            return self.free[0], 0
        hits = {}
        for s in self.free:
            common, held = self.decoder.common_prefix(s, prompt), self.decoder.host_lengths[s]
            worth = common in (held, len(prompt)) or 2 * common >= held
            hits[s] = min(common, len(prompt) - 1) if worth else 0
        slot = max(self.free, key=lambda s: (
            hits[s], -self.last_used[s] if self.spread_slots else -s))
        # the slot picked is overwritten past the common prefix anyway: reuse what it shares
        cached = self.decoder.cached_prefix(slot, prompt)
        if self.decoder.copies_prefixes:  # or a longer prefix another slot holds, copied
            source = max(range(self.decoder.max_batch_size),
                         key=lambda s: self.decoder.cached_prefix(s, prompt))
            longest = self.decoder.cached_prefix(source, prompt)
            if longest >= cached + MIN_COPY:
                self.decoder.copy_prefix(source, slot, longest)
                cached = longest
        return slot, cached

    def _loop(self) -> None:
        while True:
            self._admit()
            if self.stopping:
                # a stop may land between the admission and this check: the requests just
                # admitted end here too (else their clients never get a final response, and
                # Triton waits for it to unload)
                self._fail_all(ShuttingDown("server shutting down"))
                return
            try:
                if self.prefilling:
                    self._prefill_chunk()
                self._drop_cancelled()
                groups = self._groups(self.running.items())
                # with several groups a fixed schedule and disable_by_batch_size see
                # everything running, not one group's share of it; each group still drafts
                # at most its own rows' K (a wider round would draw other random numbers).
                # The goodput policy plans each group's step at that step's own cost.
                cap = self.decoder.round_k(sorted(self.running)) if len(groups) > 1 and (
                    self.decoder.draft_len_schedule != "auto") else None
                for params, slots in groups:
                    self._use(params)
                    k = None if cap is None else min(
                        cap, max(self.decoder.host_k[s] for s in slots))
                    new, alive = self.decoder.step(slots, k)
                    self._deliver(slots, new, alive)
            except Exception as e:  # a failing round fails its requests, not the server
                self._fail_all(e)

    @staticmethod
    def _groups(slot_requests) -> list[tuple[RuleParams, list[int]]]:
        """(parameters, their slots in order), groups in order of their first slot."""
        groups: dict[RuleParams, list[int]] = {}
        for slot, req in sorted(slot_requests, key=lambda item: item[0]):
            groups.setdefault(group_key(req.params), []).append(slot)
        return list(groups.items())

    def _use(self, params: RuleParams) -> None:
        self.decoder.params = params
        self.decoder.draft_sampling = params.rule == "exact"

    def _prefill_chunk(self) -> None:
        """Feed the admitted prompts, in admission order, at most ``prefill_chunk`` tokens
        while others run (all of them when none does); those whose prompt is then complete
        start (their first token) and join the running batch."""
        budget = self.prefill_chunk if self.running and self.prefill_chunk else None
        starting, partial = [], []
        for slot, p in list(self.prefilling.items()):
            left = len(p.request.prompt) - p.done
            if budget is None or left <= budget:
                starting.append(slot)
                budget = None if budget is None else budget - left
            elif budget > 0:
                partial.append((slot, p.done + budget))
                budget = 0
        if partial:
            slots = [s for s, _ in partial]
            self.decoder.feed_prompt(slots, [self.prefilling[s].request.prompt for s in slots],
                                     [self.prefilling[s].done for s in slots],
                                     [end for _, end in partial])
            for slot, end in partial:
                self.prefilling[slot].done = end
        if starting:
            self._prefill(starting)

    def _prefill(self, starting: list[int]) -> None:
        pending = {s: self.prefilling[s] for s in starting}
        for params, slots in self._groups((s, p.request) for s, p in pending.items()):
            reqs = [pending[s].request for s in slots]
            self._use(params)
            new, alive = self.decoder.prefill(
                slots, [r.prompt for r in reqs], [r.max_new_tokens for r in reqs],
                [r.eos_token_id for r in reqs], [r.seed for r in reqs],
                [r.num_draft_tokens for r in reqs],  # None: the decoder's K, planned
                [r.lookup_drafts for r in reqs], [pending[s].done for s in slots],
                [r.grammar for r in reqs], [r.logprobs for r in reqs])
            for slot, req in zip(slots, reqs, strict=True):
                # the tokens a earlier request left, not the chunks this one fed
                self.decoder.slot_cached[slot] = pending[slot].cached
                with self.lock:
                    del self.prefilling[slot]
                self.running[slot] = req
            self._deliver(slots, new, alive)

    def _deliver(self, slots: list[int], new: list[list[int]], alive: list[bool]) -> None:
        for slot, tokens, running in zip(slots, new, alive, strict=True):
            req = self.running[slot]
            entries = None if req.logprobs is None else self.decoder.take_logprobs(slot)
            try:
                if req.stop_sequences and tokens:
                    keep = stop_cut(req.recent, tokens, req.stop_sequences)
                    if keep is not None:  # the tokens after the stop sequence never go out
                        tokens, running = tokens[:keep], False
                    tail = max(map(len, req.stop_sequences)) - 1
                    req.recent = (req.recent + tokens)[-tail:] if tail else []
                if tokens:
                    if entries is not None:
                        req.on_logprobs(entries[:len(tokens)])
                    req.on_tokens(tokens)
                if not running:
                    self._release(slot)
                    req.on_done(self.decoder.slot_stats(slot), None)
            except Exception as e:  # a broken callback must not stop everyone else
                self._release(slot)
                tell_done(req, None, e)

    def _drop_cancelled(self) -> None:
        # asking a Triton response sender is a round trip to the server process (~0.1 ms per
        # request): every CANCEL_CHECK_S is soon enough for a client that went away
        now = time.perf_counter()
        if now - self.last_cancel_check < CANCEL_CHECK_S:
            return
        self.last_cancel_check = now
        for slot, req in list(self.running.items()):
            if req.is_cancelled():
                self._release(slot)
                tell_done(req, None, None)
        for slot, p in list(self.prefilling.items()):
            if p.request.is_cancelled():  # its chunks so far stay cached for a retry
                self._release(slot)
                tell_done(p.request, None, None)

    def _release(self, slot: int) -> None:
        with self.lock:
            if self.running.pop(slot, None) is None and self.prefilling.pop(slot, None) is None:
                return
            self.free.append(slot)
            self.free.sort()
            self.last_used[slot] = time.perf_counter()

    def _fail_all(self, error: BaseException) -> None:
        ended = [(s, r) for s, r in self.running.items()] + [
            (s, p.request) for s, p in self.prefilling.items()]
        # a failed round may have left their caches half written
        self.decoder.forget([s for s, _ in ended])
        for slot, req in ended:
            self._release(slot)
            tell_done(req, None, error)
        with self.lock:
            waiting = list(self.queue)
            self.queue.clear()
        if self.stopping:
            for req in waiting:
                tell_done(req, None, error)
        else:
            with self.lock:
                self.queue.extend(waiting)
