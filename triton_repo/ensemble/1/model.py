"""Triton Python model (decoupled), the one model clients call (``ensemble``): the
speculative decoder behind an in-flight scheduler.

It is named ``ensemble`` with TensorRT-LLM's ensemble tensors so that its clients work
unchanged, but it is not a Triton ensemble: Triton 2.51's ensemble scheduler checks a
client's cancellation only between steps, so a cancelled stream never reached a decoupled
step already running, and the request held its slot to the end. Called directly, the
client's cancellation reaches this model's response sender (TensorRT-LLM's
tensorrt_llm_bls is a Python model too).

execute() tokenises and validates each request, hands it to the scheduler and returns at
once; the scheduler thread streams responses as rounds complete, through one sender thread,
which also answers refused requests (REFUSAL_DELAY_S says why not execute() itself).
Every send, metric update and cancellation query is an IPC round trip to the server process
(measured on the CPU build: send ~0.15 ms, a metric update ~0.02 ms, is_cancelled ~0.03 ms),
which the sender thread overlaps with the next round's compute instead of stalling the batch.

The model tokenises its input and detokenises its output (incrementally, special tokens
left out): one IPC hop per response, and no pre- or postprocessing model. Tokenisation,
request parsing, detokenisation and the decoder set-up are
paradraft.runtime.serving.protocol's (tested in process); this file only adapts them to
Triton.

Each model instance (``instance_group``) is a process of its own on its device, with its own
scheduler and slots; its metrics carry its name. A control thread follows ``paradraft
serve``'s drain and stop (``Server.drain``, ``Server.stop`` in runtime/serving/server.py)."""

import contextlib
import faulthandler
import functools
import json
import locale
import queue
import signal
import site
import threading
import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
# error classes (pb_utils.TritonError's codes; the stub defines TritonError only once a model
# loads, so they are looked up by name): the HTTP endpoint answers 400 / 503 / 500, a gRPC
# stream opened with the header triton_grpc_error: true closes with INVALID_ARGUMENT /
# UNAVAILABLE / INTERNAL
INVALID, UNAVAILABLE, INTERNAL = "INVALID_ARG", "UNAVAILABLE", "INTERNAL"
# how a received request ended (paradraft_requests_ended_total's outcome label)
OUTCOMES = ("finished", "cancelled", "refused", "failed")
LENGTH_BUCKETS = [1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0, 17.0]
# how often a running request's response sender is asked whether the client cancelled (an
# IPC round trip, made by the sender thread); the answer is a flag the scheduler reads free
CANCEL_POLL_S = 0.05
# the live metrics go out at most this often while requests run (every flush is one IPC round
# trip per metric that moved: 2 + 2K counters a round would cost a c1 round ~5 %), and at once
# when a request finishes
METRICS_FLUSH_S = 0.05
# how often an instance reads `paradraft serve`'s control file (a drain or a stop)
CONTROL_POLL_S = 0.1
# while a drain or stop waits on open requests, the log says how many every this often
OPEN_NOTE_S = 2.0
# a stop closes the requests still open this long after the scheduler ended them all
STOP_GRACE_S = 3.0
# a refused request's error response goes out this long after execute() took the request,
# from the sender thread. Triton 2.51's gRPC frontend races on an error response that comes
# back quickly to a stream opened with triton_grpc_error (as complete() and the OpenAI API
# open theirs): with cancelled streams in between, tritonserver crashed (SIGSEGV) in 2 of 3
# runs of tests/test_triton.py's refusal test when the model answered inside execute(), in
# 2 of 9 when the sender thread answered at once, and in 0 of 24 with this delay. (Through
# the old ensemble the error took two more hops; upstream fixed a use-after-free in that
# handling after 2.51, PR #8708.) A refusal is rare, and 20 ms does not matter to it.
REFUSAL_DELAY_S = 0.02
# how long finalize() waits for each of the instance's threads
FINALIZE_WAIT_S = 5.0
# how long the stub process may take to exit once finalize() returned (it exits in about a
# second): past it, the stub prints every thread's stack to tritonserver's log and exits, so
# that Triton, which waits for the stub before the model counts as unloaded, is not held to
# its exit timeout and killed (seen twice under a full test suite's load, cause unknown)
STUB_EXIT_WAIT_S = 8.0
# `Server.stop` sends this to the stub when tritonserver does not exit in time: the stub
# prints every thread's stack to the log (where it hung) before it is killed
STACKS_SIGNAL = signal.SIGUSR1


class Metrics:
    """Custom Prometheus metrics on Triton's metrics port, updated every round.

    The scheduler thread adds each round's deltas here (no IPC); the sender thread sends
    them (``flush``), one flush at a time: rounds that finish while a flush is queued are
    folded into it, so a busy server sends fewer, larger updates."""

    def __init__(self, k, slots, model, instance):
        self.families = []  # a MetricFamily must outlive its Metrics: keep them all

        def family(name, kind, text):
            self.families.append(pb_utils.MetricFamily(name=name, description=text, kind=kind))
            return self.families[-1]

        counter, gauge = pb_utils.MetricFamily.COUNTER, pb_utils.MetricFamily.GAUGE
        labels = {"model": model, "instance": instance}  # Triton's names, as its own metrics
        self.labels = labels
        self.drafted = family("paradraft_draft_tokens_total", counter,
                              "draft tokens proposed").Metric(labels=labels)
        self.accepted = family("paradraft_accepted_tokens_total", counter,
                               "draft tokens accepted").Metric(labels=labels)
        self.rollbacks = family("paradraft_rollbacks_total", counter,
                                "verify steps that rejected a draft token").Metric(labels=labels)
        self.requests = family("paradraft_requests_total", counter,
                               "requests finished").Metric(labels=labels)
        # received = the sum of ended over its outcomes once nothing runs or waits (a soak
        # checks it): finished, cancelled (by the client or a stop request), refused (bad,
        # or the queue full, or draining), failed (the decoder raised, or the server stopped)
        self.received = family("paradraft_requests_received_total", counter,
                               "requests received (not counting stop requests)"
                               ).Metric(labels=labels)
        ended = family("paradraft_requests_ended_total", counter, "requests ended, by outcome")
        self.ended = {outcome: ended.Metric(labels={**labels, "outcome": outcome})
                      for outcome in OUTCOMES}
        # vLLM's prefix_cache_queries / prefix_cache_hits, in tokens: the hit rate is their
        # ratio
        self.prompt_tokens = family("paradraft_prompt_tokens_total", counter,
                                    "prompt tokens of finished requests").Metric(labels=labels)
        self.cached_tokens = family("paradraft_prefix_cache_hit_tokens_total", counter,
                                    "prompt tokens of finished requests whose K/V came from "
                                    "the prefix cache").Metric(labels=labels)
        by_drafted = family("paradraft_draft_tokens_by_position_total", counter,
                            "draft tokens proposed at each block position (1 = first)")
        by_accepted = family("paradraft_accepted_tokens_by_position_total", counter,
                             "draft tokens accepted at each block position (1 = first)")
        self.drafted_at = [by_drafted.Metric(labels={**labels, "position": str(i + 1)})
                           for i in range(k)]
        self.accepted_at = [by_accepted.Metric(labels={**labels, "position": str(i + 1)})
                            for i in range(k)]
        self.active = family("paradraft_active_sequences", gauge,
                             "sequences in the running batch (KV-cache slots in use)"
                             ).Metric(labels=labels)
        self.queued = family("paradraft_queue_depth", gauge,
                             "requests waiting for a slot").Metric(labels=labels)
        family("paradraft_slots", gauge, "KV-cache slots (the largest running batch)").Metric(
            labels=labels).set(slots)
        kind = getattr(pb_utils.MetricFamily, "HISTOGRAM", None)
        self.length_hist = None
        self.length_counts = None
        if kind is not None:
            self.length_hist = family(
                "paradraft_acceptance_length", kind,
                "per finished request: its tokens gained per verify step (accepted + 1)"
            ).Metric(labels=labels, buckets=LENGTH_BUCKETS)
        else:  # older Python backends: one counter per length, labelled like buckets
            fam = family("paradraft_acceptance_length_count", counter,
                         "finished requests by tokens gained per verify step")
            self.length_counts = {b: fam.Metric(labels={**labels, "length": str(b)})
                                  for b in LENGTH_BUCKETS}
        # the rounds: the K each verified (0: a plain step), the goodput policy's expected
        # against realized speed-up over plain decoding, each drafter's running α, and the
        # round costs it plans with (protocol.round_metrics)
        self.rounds_total = family("paradraft_rounds_total", counter,
                                   "decoding rounds (one verify pass each)").Metric(labels=labels)
        self.plain_rounds = family("paradraft_plain_rounds_total", counter,
                                   "rounds that verified no draft (plain steps)"
                                   ).Metric(labels=labels)
        self.round_k_hist = self.round_k_counts = None
        if kind is not None:
            self.round_k_hist = family(
                "paradraft_round_k", kind, "per round: the drafts it verified (its K)"
            ).Metric(labels=labels, buckets=[float(n) for n in range(k + 1)])
        else:
            fam = family("paradraft_round_k_count", counter, "rounds by the K they verified")
            self.round_k_counts = [fam.Metric(labels={**labels, "k": str(n)})
                                   for n in range(k + 1)]
        self.goodput_expected = family(
            "paradraft_goodput_expected", gauge, "the goodput policy's expected speed-up over "
            "plain decoding, over the rounds since the last update").Metric(labels=labels)
        self.goodput_realized = family(
            "paradraft_goodput_realized", gauge, "the same rounds' realized speed-up over "
            "plain decoding (at the plain step's calibrated cost)").Metric(labels=labels)
        alpha = family("paradraft_acceptance_alpha", gauge,
                       "running per-token acceptance of each drafter")
        self.alpha = {name: alpha.Metric(labels={**labels, "drafter": name})
                      for name in ("model", "ngram")}
        self.cost_family = family("paradraft_round_cost_seconds", gauge,
                                  "seconds of a round's part (verify: the verifier over K + 1 "
                                  "positions and the correction; draft: the draft model's K) "
                                  "by batch size and K, as the goodput policy plans with them")
        self.cost_cells = {}
        self.sent_rounds = None
        self.k = k
        self.lock = threading.Lock()
        self.pending = self.empty()
        self.flush_queued = False
        self.last_flush = 0.0
        self.sent_state = None

    def empty(self):
        return {"drafted": 0, "accepted": 0, "rollbacks": 0, "requests": 0, "lengths": [],
                "received": 0, "ended": dict.fromkeys(OUTCOMES, 0),
                "prompt_tokens": 0, "cached_tokens": 0,
                "drafted_at": [0] * self.k, "accepted_at": [0] * self.k, "state": None,
                "rounds": None}

    def add(self, drafted=0, accepted=0, rollbacks=0, drafted_at=(), accepted_at=(),
            scheduler=None, length=None, now=False, rounds=None, prompt=(0, 0), received=0,
            outcome=None):
        """Fold deltas in (and the scheduler's running / queued counts, read under this lock
        so that a slow caller cannot overwrite a newer reading with an older one); True when
        the caller must queue a ``flush``: none is queued, and the last went out at least
        METRICS_FLUSH_S ago (or ``now``). Deltas held back go out with the next flush."""
        with self.lock:
            p = self.pending
            p["drafted"] += drafted
            p["accepted"] += accepted
            p["rollbacks"] += rollbacks
            for i, n in enumerate(drafted_at):
                p["drafted_at"][i] += n
            for i, n in enumerate(accepted_at):
                p["accepted_at"][i] += n
            if scheduler is not None:
                state = scheduler.stats()
                p["state"] = (state["active"], state["queued"])
            if rounds is not None:  # the newest reading (sums: flush takes differences)
                p["rounds"] = rounds
            if length is not None:
                p["requests"] += 1
                p["lengths"].append(length)
            p["prompt_tokens"] += prompt[0]
            p["cached_tokens"] += prompt[1]
            p["received"] += received
            if outcome is not None:
                p["ended"][outcome] += 1
            due = now or time.perf_counter() - self.last_flush >= METRICS_FLUSH_S
            queue_it = due and not self.flush_queued
            self.flush_queued = self.flush_queued or queue_it
        return queue_it

    def flush_held(self):
        """Flush deltas that no queued flush will carry (called when the sender is idle)."""
        with self.lock:
            held = not self.flush_queued and self.pending != self.empty()
        if held:
            self.flush()

    def flush(self):
        with self.lock:
            p, self.pending, self.flush_queued = self.pending, self.empty(), False
            self.last_flush = time.perf_counter()
        for metric, n in [(self.drafted, p["drafted"]), (self.accepted, p["accepted"]),
                          (self.rollbacks, p["rollbacks"]), (self.requests, p["requests"]),
                          (self.prompt_tokens, p["prompt_tokens"]),
                          (self.cached_tokens, p["cached_tokens"]),
                          (self.received, p["received"]),
                          *((self.ended[o], n) for o, n in p["ended"].items()),
                          *zip(self.drafted_at, p["drafted_at"], strict=True),
                          *zip(self.accepted_at, p["accepted_at"], strict=True)]:
            if n:  # only what moved: every call is a round trip to the server process
                metric.increment(n)
        state = p["state"]
        if state is not None and state != self.sent_state:
            self.active.set(state[0])
            self.queued.set(state[1])
            self.sent_state = state
        if p["rounds"] is not None:
            self.flush_rounds(p["rounds"])
        for n in p["lengths"]:
            if self.length_hist is not None:
                self.length_hist.observe(float(n))
            else:
                bucket = min((b for b in LENGTH_BUCKETS if b >= n), default=LENGTH_BUCKETS[-1])
                self.length_counts[bucket].increment(1)


    def flush_rounds(self, now):
        before = self.sent_rounds or {"by_width": [0] * len(now["by_width"]), "tokens": 0,
                                      "expected_tokens": 0.0, "plain_tokens": 0.0,
                                      "plain_tokens_expected": 0.0, "alpha": {}}
        self.sent_rounds = now
        by_width = [a - b for a, b in zip(now["by_width"], before["by_width"], strict=True)]
        if sum(by_width):
            self.rounds_total.increment(sum(by_width))
        if by_width[0]:
            self.plain_rounds.increment(by_width[0])
        for width, n in enumerate(by_width[: self.k + 1]):
            if self.round_k_hist is not None:
                for _ in range(n):
                    self.round_k_hist.observe(float(width))
            elif n:
                self.round_k_counts[width].increment(n)
        plain = now["plain_tokens"] - before["plain_tokens"]
        if plain > 0:  # rounds the goodput policy planned
            self.goodput_realized.set((now["tokens"] - before["tokens"]) / plain)
            self.goodput_expected.set(
                (now["expected_tokens"] - before["expected_tokens"])
                / (now["plain_tokens_expected"] - before["plain_tokens_expected"]))
        for name, value in now["alpha"].items():
            if value != before["alpha"].get(name):
                self.alpha[name].set(value)
        for (part, batch_size, k), seconds in now["costs"].items():
            cell = self.cost_cells.get((part, batch_size, k))
            if cell is None:
                cell = self.cost_cells[part, batch_size, k] = [self.cost_family.Metric(
                    labels={**self.labels, "part": part, "batch_size": str(batch_size),
                            "k": str(k)}), None]
            if cell[1] != seconds:
                cell[0].set(seconds)
                cell[1] = seconds


class Stream:
    """One request between the scheduler thread (which appends its tokens) and the sender
    thread (which detokenises and sends them)."""

    def __init__(self, parsed, sender, detokenizer, request_id, k):
        self.parsed = parsed
        self.sender = sender
        self.detokenizer = detokenizer
        self.request_id = request_id
        self.tokens = []
        self.logprobs = []  # the tokens' logprob entries, where the request asked for them
        self.queued = 0  # tokens already handed to the sender thread
        self.slot = None
        self.seen = (0, 0, 0, [0] * k, [0] * k)  # counters at the last round: metric deltas
        self.stopped = False  # a stop request or the client's cancellation; read by the scheduler
        self.last_poll = self.last_read = time.perf_counter()
        self.poll_queued = False


# what a request that names no outputs gets: TensorRT-LLM's ensemble outputs and ours, not
# output_ids (a client asks for it by name)
DEFAULT_OUTPUTS = frozenset({"text_output", "sequence_length", "acceptance_rate",
                             "total_accepted_draft_tokens", "total_draft_tokens",
                             "finish_reason", "cached_tokens"})


def response(wanted, text, ids, length, stats=None, reason="", logprobs=None):
    """The outputs the request asked for (``wanted``): building and sending each tensor is
    the costliest part of a response. ``stats``: the final response's (accepted, drafted,
    cached prompt tokens). ``logprobs``: the entries of ``ids`` (logprob, top pairs) and the
    request's top_logprobs, where it asked for them."""
    values = {"text_output": ([text.encode()], np.object_), "output_ids": (ids, np.int32),
              "sequence_length": ([length], np.int32)}
    if logprobs is not None:
        entries, top = logprobs
        pairs = [pair for _, best in entries for pair in best]
        shape = (len(entries), top)  # [tokens, top], however many (none, on a final response)
        values.update(
            output_log_probs=([lp for lp, _ in entries], np.float32),
            top_logprobs=(np.array([v for _, v in pairs], np.float32).reshape(shape),
                          np.float32),
            top_logprob_ids=(np.array([i for i, _ in pairs], np.int32).reshape(shape),
                             np.int32))
    if stats is not None:
        accepted, drafted, cached = stats
        values.update(
            cached_tokens=([cached], np.int32),
            acceptance_rate=([accepted / drafted if drafted else 0.0], np.float32),
            total_accepted_draft_tokens=([accepted], np.int32),
            total_draft_tokens=([drafted], np.int32), finish_reason=([reason.encode()], np.object_))
    return pb_utils.InferenceResponse(output_tensors=[
        pb_utils.Tensor(name, np.array([value], dtype=dtype))
        for name, (value, dtype) in values.items() if name in wanted])


def send_or_close(sender, final):
    """Send a request's final response; if that fails (a response the client can no longer
    take), still close its stream with a bare final flag and re-raise: Triton holds a
    request until its final flag, and a model with one held request never unloads."""
    try:
        sender.send(final, flags=FINAL)
    except Exception:
        with contextlib.suppress(Exception):  # already closed: nothing more to do
            sender.send(flags=FINAL)
        raise


def error(message, code):
    return pb_utils.InferenceResponse(
        error=pb_utils.TritonError(message, getattr(pb_utils.TritonError, code)))


class TritonPythonModel:
    def initialize(self, args):
        params = {k: v["string_value"]
                  for k, v in json.loads(args["model_config"])["parameters"].items()}
        site.addsitedir(params["site_packages"])  # the project's venv (.pth files included)
        # the stub embeds Python without setting a locale, so open() without an encoding
        # would read ASCII; take the environment's (C.UTF-8, en_US.UTF-8, ...)
        locale.setlocale(locale.LC_CTYPE, "")
        faulthandler.register(STACKS_SIGNAL, all_threads=True)
        from tokenizers import Tokenizer

        from paradraft.runtime.scheduler import QueueFull, Request, ShuttingDown
        from paradraft.runtime.serving import protocol

        self.protocol, self.Request, self.QueueFull = protocol, Request, QueueFull
        self.ShuttingDown = ShuttingDown
        with open(params["model_config"]) as f:
            self.config = protocol.ServeConfig(**json.load(f))
        self.tokenizer = Tokenizer.from_file(params["tokenizer_path"])
        self.tokenizer_path = params["tokenizer_path"]  # guided decoding's grammars read it
        # this instance's device: Triton places each instance of the instance_group
        self.instance = args["model_instance_name"]
        device = protocol.instance_device(self.config, args["model_instance_kind"],
                                          int(args["model_instance_device_id"]))
        self.scheduler = protocol.build_scheduler(self.config, device)
        self.k = max(self.config.k, 1)
        self.metrics = Metrics(self.k, self.config.max_slots, args["model_name"], self.instance)
        self.rounds_read = -1  # rounds counted at the last snapshot of them (account)
        self.live = {}  # request id -> its Stream, for requests running or queued
        # the senders of requests accepted whose final response has not gone out yet (by
        # id): a drain waits until none is left, and a stop closes those a bug left open
        self.open = {}
        self.open_lock = threading.Lock()
        self.draining = False  # set by the control thread: new requests are refused
        self.control = Path(params["control_dir"])
        # FIFO: one thread keeps every request's responses in order (final one last)
        self.outbox = queue.SimpleQueue()
        self.sender_thread = threading.Thread(target=self.send_loop, name="paradraft-sender",
                                              daemon=True)
        self.sender_thread.start()
        self.closing = threading.Event()
        # its own thread: the sender may be busy for long, and a drain must not wait on it
        self.control_thread = threading.Thread(target=self.follow_control,
                                               name="paradraft-control", daemon=True)
        self.control_thread.start()

    def follow_control(self):
        """`paradraft serve` makes ``control_dir/drain`` (on SIGTERM: refuse new requests,
        finish the running ones) or ``control_dir/stop`` (before tritonserver exits: end them
        all now, as UNAVAILABLE); this instance answers with
        ``control_dir/<instance>.<mode>`` once its last request had its final response."""
        mode, reported, stop_asked = "", "", 0.0
        next_note = time.monotonic() + OPEN_NOTE_S
        while not self.closing.wait(CONTROL_POLL_S):
            # the modes are empty files (a full disk still takes them); stop outranks drain
            asked = next((m for m in ("stop", "drain") if (self.control / m).exists()), "")
            if not asked:
                continue
            self.draining = True
            if asked == "stop" and mode != "stop":
                self.scheduler.stop()  # running and queued requests end with ShuttingDown
                stop_asked = time.monotonic()
            mode = asked
            with self.open_lock:
                open_now = len(self.open)
            if open_now == 0 and mode != reported:
                (self.control / f"{self.instance}.{mode}").touch()
                reported = mode
            elif open_now and time.monotonic() >= next_note:  # says what a hung exit waits on
                next_note = time.monotonic() + OPEN_NOTE_S
                pb_utils.Logger.log_info(
                    f"paradraft: {self.instance} {mode}: {open_now} requests still open "
                    f"(ids {sorted(self.live)[:8]}, scheduler {self.scheduler.stats()}, "
                    f"its thread alive: {self.scheduler.thread.is_alive()})")
            if (open_now and mode == "stop" and not self.scheduler.thread.is_alive()
                    and time.monotonic() - stop_asked >= STOP_GRACE_S):
                self.close_open(open_now)

    def close_open(self, count):
        """The scheduler has stopped and every final response it queued had time to go
        out, yet ``count`` requests are open: a bug left them without one. Close them as
        UNAVAILABLE, loudly: Triton holds a model with an open request past its exit
        timeout, and their clients would wait for nothing."""
        pb_utils.Logger.log_error(f"paradraft: {self.instance} stop: closing {count} requests "
                                  "that never had a final response (a bug: please report it)")
        with self.open_lock:
            senders, self.open = list(self.open.values()), {}
        for sender in senders:
            with contextlib.suppress(Exception):  # a final that went out meanwhile
                send_or_close(sender, error("server shutting down: the request did not "
                                            "finish; retry", UNAVAILABLE))

    def opened(self, sender):
        with self.open_lock:
            self.open[id(sender)] = sender

    def closed(self, sender):
        with self.open_lock:
            self.open.pop(id(sender), None)

    def send_loop(self):
        while True:
            try:
                job = self.outbox.get(timeout=METRICS_FLUSH_S)
            except queue.Empty:  # idle: send what the throttle held back (the last request's
                job = self.metrics.flush_held  # end, a queue that drained, ...)
            if job is None:
                return
            try:
                job()
            except Exception as e:  # a client that went away must not stop the others
                pb_utils.Logger.log_warn(f"paradraft: sending a response failed: {e}")

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            received = False  # a stop request is not counted: it ends another one
            try:
                wanted = set(request.requested_output_names()) or DEFAULT_OUTPUTS
                stop = pb_utils.get_input_tensor_by_name(request, "stop")
                if stop is not None and bool(stop.as_numpy().reshape(-1)[0]):
                    self.stop(request.request_id(), sender, wanted)
                    continue
                self.count(received=1)
                received = True
                if self.draining:  # the same class as a full queue: retry (elsewhere)
                    raise self.ShuttingDown("server shutting down (draining): not admitting "
                                            "new requests; retry later")
                inputs = {}
                for name in self.protocol.REQUEST_INPUTS:
                    tensor_ = pb_utils.get_input_tensor_by_name(request, name)
                    if tensor_ is not None:
                        inputs[name] = tensor_.as_numpy()
                parsed = self.protocol.parse_request(inputs, self.config, self.tokenizer)
                self.submit(self.make_request(parsed, sender, wanted, request.request_id()),
                            sender)
                self.note_state()  # the queue depth moves at once, not at the next round
            except ValueError as e:
                self.count(outcome="refused" if received else None)
                self.refuse(sender, str(e), INVALID)
            except (self.QueueFull, RuntimeError) as e:  # full, or shutting down: retry later
                self.count(outcome="refused" if received else None)
                self.refuse(sender, str(e), UNAVAILABLE)
            except Exception as e:  # a bug of ours: the request still gets its final response
                pb_utils.Logger.log_error(f"paradraft: a request failed on arrival: {e!r}")
                self.count(outcome="failed" if received else None)
                self.refuse(sender, f"internal error: {e!r}", INTERNAL)
        return None

    def reply(self, sender, final, delay=0.0):
        """Answer a request with its one, final response from the sender thread (after
        ``delay`` seconds), not from inside execute()."""
        self.opened(sender)  # a drain or stop waits for it as for a request

        def send():
            try:
                send_or_close(sender, final)
            finally:
                self.closed(sender)

        if delay:
            threading.Timer(delay, self.outbox.put, (send,)).start()
        else:
            self.outbox.put(send)

    def refuse(self, sender, message, code):
        self.reply(sender, error(message, code), REFUSAL_DELAY_S)

    def submit(self, request, sender):
        """Hand a request to the scheduler; it counts as open until its final response."""
        self.opened(sender)
        try:
            self.scheduler.submit(request)
        except BaseException:
            self.closed(sender)  # refused: its caller answers it, and on_done never runs
            raise

    def count(self, received=0, outcome=None):
        if self.metrics.add(received=received, outcome=outcome):
            self.outbox.put(self.metrics.flush)

    def note_state(self):
        if self.metrics.add(scheduler=self.scheduler):
            self.outbox.put(self.metrics.flush)

    def stop(self, request_id, sender, wanted):
        """TensorRT-LLM's way to end a request: the same request id with ``stop`` true (on
        another stream; cancelling the request's own stream frees it too). The stopped
        request ends with a final response; so does this."""
        if not request_id:
            raise ValueError("stop needs the id of the request to stop (set request_id)")
        stopped = self.live.get(request_id)
        if stopped is None:
            raise ValueError(f"stop: no request with id {request_id!r} is running or queued")
        stopped.stopped = True  # the scheduler drops it at its next cancellation check
        self.reply(sender, response(wanted, "", [], 0, (0, 0, 0)))

    def account(self, s, stats, length=None, prompt=(0, 0)):
        """Fold a request's counters since they were last read into the metrics (scheduler
        thread: the decoder's counters are only read there). ``length``: the request
        finished (its acceptance length goes into the histogram; flushed at once)."""
        now = (stats.draft_tokens, stats.accepted_tokens, stats.rollbacks,
               stats.drafted_per_position, stats.accepted_per_position)
        before, s.seen = s.seen, now
        # the rounds' snapshot once per round, not once per request in it
        decoder = self.scheduler.decoder
        rounds_done = sum(decoder.rounds.by_width)
        rounds = None
        if rounds_done != self.rounds_read:
            rounds, self.rounds_read = self.protocol.round_metrics(decoder), rounds_done
        if self.metrics.add(now[0] - before[0], now[1] - before[1], now[2] - before[2],
                            [a - b for a, b in zip(now[3], before[3], strict=False)],
                            [a - b for a, b in zip(now[4], before[4], strict=False)],
                            self.scheduler, length, now=length is not None, rounds=rounds,
                            prompt=prompt):
            self.outbox.put(self.metrics.flush)

    def grammar_for(self, guide):
        """A fresh matcher for the request's guide (compiled here, in the request's thread,
        off the decode loop, and cached by guide), or None; ValueError names the input."""
        if guide is None:
            return None
        return self.protocol.row_grammar(guide, self.tokenizer_path,
                                         self.scheduler.decoder.verifier.config.vocab_size)

    def make_request(self, parsed, sender, wanted, request_id=""):
        grammar = self.grammar_for(parsed.guide)
        if parsed.logprobs is not None and wanted is DEFAULT_OUTPUTS:  # named none: with them
            wanted = DEFAULT_OUTPUTS | self.protocol.LOGPROB_OUTPUTS
        s = Stream(parsed, sender, self.protocol.Detokenizer(self.tokenizer, parsed.prompt),
                   request_id, self.k)
        scheduler, outbox, interval = self.scheduler, self.outbox, self.config.stream_interval
        if request_id:
            self.live[request_id] = s  # a later request with the same id takes it over

        def on_logprobs(entries):  # the scheduler thread, just before on_tokens
            s.logprobs += entries

        def on_tokens(new):  # the scheduler thread, once a round
            s.tokens += new
            if s.slot is None:
                s.slot = next(slot for slot, req in scheduler.running.items() if req is me)
            if parsed.stream and (not s.queued or len(s.tokens) - s.queued >= interval):
                chunk, s.queued = s.tokens[s.queued:], len(s.tokens)
                outbox.put(functools.partial(send, chunk, s.queued))
            now = time.perf_counter()
            if now - s.last_read >= METRICS_FLUSH_S:  # the slot's counters are cumulative
                s.last_read = now
                self.account(s, scheduler.decoder.slot_stats(s.slot))
            if not s.poll_queued and now - s.last_poll >= CANCEL_POLL_S:
                s.poll_queued, s.last_poll = True, now
                outbox.put(poll)

        def entries(end, count):  # the logprobs of the ``count`` tokens before ``end``
            return None if parsed.logprobs is None else (s.logprobs[end - count: end],
                                                         parsed.logprobs)

        def send(chunk, length):  # the sender thread, in order
            sender.send(response(wanted, s.detokenizer.add(chunk), chunk, length,
                                 logprobs=entries(length, len(chunk))))

        def poll():  # the sender thread
            s.poll_queued = False
            if sender.is_cancelled():
                s.stopped = True

        def on_done(stats, failure):  # the scheduler thread (or a request's, if dropped queued)
            if request_id and self.live.get(request_id) is s:
                del self.live[request_id]
            try:
                self.count(outcome="failed" if failure is not None else
                           "cancelled" if stats is None else "finished")
                if stats is not None:
                    self.account(s, stats, stats.mean_acceptance_length,
                                 (len(parsed.prompt), stats.cached_tokens))
                else:
                    self.note_state()
            finally:  # metrics that fail must not cost the client its final response
                outbox.put(functools.partial(finish, stats, failure, s.tokens[s.queued:],
                                             list(s.tokens)))

        def finish(stats, failure, chunk, tokens):  # the sender thread
            try:
                send_final(stats, failure, chunk, tokens)
            finally:
                self.closed(sender)

        def send_final(stats, failure, chunk, tokens):
            if failure is None and stats is not None:
                try:
                    text = s.detokenizer.add(chunk) + s.detokenizer.finish()
                    last = response(wanted, text, chunk, len(tokens),
                                    (stats.accepted_tokens, stats.draft_tokens,
                                     stats.cached_tokens),
                                    self.protocol.finish_reason(tokens, parsed),
                                    entries(len(tokens), len(chunk)))
                except Exception as e:  # every request must end with a final response:
                    failure = e  # Triton waits for it before the model can unload
            if isinstance(failure, self.ShuttingDown):  # the server stops: retry elsewhere
                send_or_close(sender, error(f"{failure}: the request did not finish; retry",
                                            UNAVAILABLE))
            elif failure is not None:
                send_or_close(sender, error(f"generation failed: {failure}", INTERNAL))
            elif stats is None:  # cancelled or stopped: close the response stream
                sender.send(flags=FINAL)
            else:
                send_or_close(sender, last)

        me = self.Request(parsed.prompt, parsed.max_new_tokens, parsed.params, on_tokens,
                          on_done, num_draft_tokens=parsed.num_draft_tokens,
                          lookup_drafts=parsed.lookup_drafts, grammar=grammar,
                          logprobs=parsed.logprobs, on_logprobs=on_logprobs,
                          seed=parsed.seed, eos_token_id=parsed.eos_token_id,
                          # a running request's flag is polled by the sender thread; a
                          # queued one is asked directly (only at admission, or when the
                          # queue is full)
                          is_cancelled=lambda: s.stopped or (s.slot is None
                                                             and sender.is_cancelled()),
                          stop_sequences=parsed.stop_sequences)
        return me

    def finalize(self):
        # bounded waits, well inside Triton's 30 s exit timeout: a thread stuck in an IPC
        # call while the model unloads must not hold tritonserver until it is killed (twice,
        # under a full test suite's load, the unload took 30 s); the threads are daemons and
        # end with the stub. The log lines and the exit watchdog say where the next one hangs.
        began = time.perf_counter()
        pb_utils.Logger.log_info(f"paradraft: {self.instance} unloading")
        self.closing.set()
        self.control_thread.join(timeout=FINALIZE_WAIT_S)
        self.scheduler.stop(timeout=FINALIZE_WAIT_S)
        time.sleep(2 * REFUSAL_DELAY_S)  # refusals still delayed reach the outbox first
        self.outbox.put(None)
        self.sender_thread.join(timeout=FINALIZE_WAIT_S)
        stuck = [t.name for t in (self.control_thread, self.scheduler.thread,
                                  self.sender_thread) if t.is_alive()]
        if stuck:
            pb_utils.Logger.log_warn(f"paradraft: unloading with {', '.join(stuck)} still "
                                     f"busy after {FINALIZE_WAIT_S} s")
        pb_utils.Logger.log_info(f"paradraft: {self.instance} unloaded its threads in "
                                 f"{time.perf_counter() - began:.1f} s")
        faulthandler.dump_traceback_later(STUB_EXIT_WAIT_S, exit=True)
