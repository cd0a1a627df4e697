"""Triton Python model (decoupled): the speculative decoder behind an in-flight scheduler.

execute() validates each request, hands it to the scheduler and returns at once; the
scheduler thread streams responses as rounds complete, through one sender thread: each
send (and metric update) is an IPC round trip to the server process (~0.3 ms), which the
sender thread overlaps with the next round's compute instead of stalling the batch.
Request parsing and the decoder set-up are paradraft.runtime.serving.protocol's (tested in
process); this file only adapts them to Triton."""

import json
import queue
import site
import threading

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
LENGTH_BUCKETS = [1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0, 17.0]


class Metrics:
    """Custom Prometheus metrics on Triton's metrics port."""

    def __init__(self):
        self.families = []  # a MetricFamily must outlive its Metrics: keep them all

        def family(name, kind, text):
            self.families.append(pb_utils.MetricFamily(name=name, description=text, kind=kind))
            return self.families[-1]

        counter, gauge = pb_utils.MetricFamily.COUNTER, pb_utils.MetricFamily.GAUGE
        labels = {"model": "paradraft"}
        self.drafted = family("paradraft_draft_tokens_total", counter,
                              "draft tokens proposed").Metric(labels=labels)
        self.accepted = family("paradraft_accepted_tokens_total", counter,
                               "draft tokens accepted").Metric(labels=labels)
        self.rollbacks = family("paradraft_rollbacks_total", counter,
                                "verify steps that rejected a draft token").Metric(labels=labels)
        self.requests = family("paradraft_requests_total", counter,
                               "requests finished").Metric(labels=labels)
        self.active = family("paradraft_active_sequences", gauge,
                             "sequences in the running batch").Metric(labels=labels)
        self.queued = family("paradraft_queue_depth", gauge,
                             "requests waiting for a slot").Metric(labels=labels)
        self.last_state = None
        kind = getattr(pb_utils.MetricFamily, "HISTOGRAM", None)
        self.length_hist = None
        self.length_counts = None
        if kind is not None:
            # per request, not per step: a metric update is a round trip to the server
            # process, too dear for every request in every round
            self.length_hist = family(
                "paradraft_acceptance_length", kind,
                "per finished request: its tokens gained per verify step (accepted + 1)"
            ).Metric(labels=labels, buckets=LENGTH_BUCKETS)
        else:  # older Python backends: one counter per length, labelled like buckets
            fam = family("paradraft_acceptance_length_count", counter,
                         "finished requests by tokens gained per verify step")
            self.length_counts = {b: fam.Metric(labels={**labels, "length": str(b)})
                                  for b in LENGTH_BUCKETS}

    def set_state(self, state):
        """The active / queue gauges, sent only when they change: every metric call is a
        round trip from this stub to the server process, and these are called per response."""
        now = (state["active"], state["queued"])
        if now != self.last_state:
            self.active.set(now[0])
            self.queued.set(now[1])
            self.last_state = now

    def observe_length(self, n):
        if self.length_hist is not None:
            self.length_hist.observe(float(n))
        else:
            bucket = min((b for b in LENGTH_BUCKETS if b >= n), default=LENGTH_BUCKETS[-1])
            self.length_counts[bucket].increment(1)


class TritonPythonModel:
    def initialize(self, args):
        params = {k: v["string_value"]
                  for k, v in json.loads(args["model_config"])["parameters"].items()}
        site.addsitedir(params["site_packages"])  # the project's venv (.pth files included)
        from paradraft.runtime.scheduler import QueueFull, Request
        from paradraft.runtime.serving import protocol

        self.protocol, self.Request, self.QueueFull = protocol, Request, QueueFull
        with open(params["model_config"]) as f:
            self.config = protocol.ServeConfig(**json.load(f))
        self.scheduler = protocol.build_scheduler(self.config)
        self.metrics = Metrics()
        self.live = {}  # request id -> its stop flag, for requests running or queued
        # FIFO: one thread keeps every request's responses in order (final one last)
        self.outbox = queue.SimpleQueue()
        self.sender_thread = threading.Thread(target=self.send_loop, name="paradraft-sender",
                                              daemon=True)
        self.sender_thread.start()

    def send_loop(self):
        while True:
            job = self.outbox.get()
            if job is None:
                return
            try:
                job()
            except Exception as e:  # a client that went away must not stop the others
                pb_utils.Logger.log_warn(f"paradraft: sending a response failed: {e}")

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                stop = pb_utils.get_input_tensor_by_name(request, "stop")
                if stop is not None and bool(stop.as_numpy().reshape(-1)[0]):
                    self.stop(request.request_id(), sender)
                    continue
                inputs = {}
                for name in self.protocol.REQUEST_INPUTS:
                    tensor = pb_utils.get_input_tensor_by_name(request, name)
                    if tensor is not None:
                        inputs[name] = tensor.as_numpy()
                parsed = self.protocol.parse_request(inputs, self.config)
                self.scheduler.submit(self.make_request(parsed, sender,
                                                        request.request_id()))
            except (ValueError, self.QueueFull) as e:
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e))),
                            flags=FINAL)
        return None

    def stop(self, request_id, sender):
        """TensorRT-LLM's way to end a request: the same request id with ``stop`` true. It
        reaches this model through the ensemble, which a client's stream cancellation does
        not on Triton 2.51. The stopped request ends with a final response; so does this."""
        if not request_id:
            raise ValueError("stop needs the id of the request to stop (set request_id)")
        stopped = self.live.get(request_id)
        if stopped is None:
            raise ValueError(f"stop: no request with id {request_id!r} is running or queued")
        stopped[0] = True  # the scheduler drops it at its next cancellation check
        empty = np.zeros((1, 0), dtype=np.int32)
        zero = np.zeros((1, 1), dtype=np.int32)
        sender.send(pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("output_ids", empty), pb_utils.Tensor("prev_length", zero),
            pb_utils.Tensor("is_final", np.ones((1, 1), dtype=np.bool_)),
            pb_utils.Tensor("acceptance_rate", np.zeros((1, 1), dtype=np.float32)),
            pb_utils.Tensor("total_accepted_draft_tokens", zero),
            pb_utils.Tensor("total_draft_tokens", zero),
            pb_utils.Tensor("sequence_length", zero)]), flags=FINAL)

    def make_request(self, parsed, sender, request_id=""):
        tokens, sent, queued, stopped = [], [0], [0], [False]
        metrics, scheduler, live, outbox = self.metrics, self.scheduler, self.live, self.outbox
        interval = self.config.stream_interval
        if request_id:
            live[request_id] = stopped  # a later request with the same id takes it over

        def response(tokens, final, stats):
            accepted, drafted = (stats.accepted_tokens, stats.draft_tokens) if stats else (0, 0)
            rate = accepted / drafted if drafted else 0.0
            out = [pb_utils.Tensor("output_ids", np.array([tokens], dtype=np.int32)),
                   pb_utils.Tensor("prev_length", np.array([[sent[0]]], dtype=np.int32)),
                   pb_utils.Tensor("is_final", np.array([[final]], dtype=np.bool_)),
                   pb_utils.Tensor("acceptance_rate", np.array([[rate]], dtype=np.float32)),
                   pb_utils.Tensor("total_accepted_draft_tokens",
                                   np.array([[accepted]], dtype=np.int32)),
                   pb_utils.Tensor("total_draft_tokens", np.array([[drafted]], dtype=np.int32)),
                   pb_utils.Tensor("sequence_length",
                                   np.array([[len(tokens)]], dtype=np.int32))]
            sent[0] = len(tokens)
            return pb_utils.InferenceResponse(output_tensors=out)

        def on_tokens(new):
            tokens.extend(new)
            state = scheduler.stats()
            outbox.put(lambda: metrics.set_state(state))
            # the scheduler dropped cancelled requests just before this round: no second
            # is_cancelled() round trip here
            if parsed.stream and (not queued[0] or len(tokens) - queued[0] >= interval):
                queued[0] = len(tokens)
                snapshot = list(tokens)  # copied only for a response that goes out
                outbox.put(lambda: sender.send(response(snapshot, False, None)))

        def on_done(stats, error):
            if request_id and live.get(request_id) is stopped:
                del live[request_id]
            state, final_tokens = scheduler.stats(), list(tokens)
            outbox.put(lambda: finish(stats, error, state, final_tokens))

        def finish(stats, error, state, tokens):
            try:
                if error is not None:
                    sender.send(pb_utils.InferenceResponse(
                        error=pb_utils.TritonError(f"generation failed: {error}")), flags=FINAL)
                elif stats is None:  # cancelled: close the response stream
                    sender.send(flags=FINAL)
                else:
                    metrics.drafted.increment(stats.draft_tokens)
                    metrics.accepted.increment(stats.accepted_tokens)
                    metrics.rollbacks.increment(stats.rollbacks)
                    metrics.requests.increment(1)
                    metrics.observe_length(stats.mean_acceptance_length)
                    sender.send(response(tokens, True, stats), flags=FINAL)
            finally:
                metrics.set_state(state)

        return self.Request(parsed.prompt, parsed.max_new_tokens, parsed.params, on_tokens,
                            on_done, num_draft_tokens=parsed.num_draft_tokens,
                            seed=parsed.seed, eos_token_id=parsed.eos_token_id,
                            is_cancelled=lambda: stopped[0] or sender.is_cancelled(),
                            stop_sequences=parsed.stop_sequences)

    def finalize(self):
        self.scheduler.stop()
        self.outbox.put(None)
        self.sender_thread.join(timeout=30)
