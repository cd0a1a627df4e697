"""A real Triton server on 127.0.0.1 (started and stopped here), queried with tritonclient."""

import os
import queue
import random
import re
import socket
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from conftest import have_tritonserver

from paradraft.runtime.checkpoints import load_tokenizer
from paradraft.runtime.correction import RuleParams
from paradraft.runtime.drafters import Drafter
from paradraft.runtime.model import load_model
from paradraft.runtime.serving import client as serving_client
from paradraft.runtime.serving import protocol
from paradraft.runtime.serving import server as serving_server
from paradraft.runtime.speculative import SpeculativeDecoder, row_seeds

grpcclient = pytest.importorskip("tritonclient.grpc")

MODELS = Path(os.environ.get("PARADRAFT_TEST_MODELS",
                             Path(__file__).resolve().parent.parent / "models" / "demo"))
SLOTS = 4
MAX_SEQ = 320

HAVE_SERVER = have_tritonserver()
pytestmark = [
    pytest.mark.skipif(not (MODELS / "verifier" / "tokenizer.json").is_file(),
                       reason=f"no models with a tokenizer in {MODELS}"),
    pytest.mark.skipif(not HAVE_SERVER and not os.environ.get("CI"),
                       reason="tritonserver not unpacked (make serve-deps)"),
]
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n", "class Parser:\n    def __init__",
           "    return self._", "for i in range(", "# Copyright", "x = [", "if __name__ =="]


def free_port() -> int:
    """A port to serve on, drawn below the kernel's ephemeral range (where every client
    socket of the suite takes its own port, and may take one just handed out here before the
    server binds it) from a block of this xdist worker's own."""
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    low = 20000 + 2000 * (worker % 6)
    while True:
        port = random.randrange(low, low + 2000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    config = protocol.ServeConfig(
        verifier=str(MODELS / "verifier"), draft=str(MODELS / "draft"), k=4,
        max_slots=SLOTS, max_queue=32, max_seq_len=MAX_SEQ, max_input_tokens=256,
        eos_token_id=load_model(MODELS / "verifier").config.eos_token_ids)
    srv = serving_server.start_server(config, str(MODELS / "verifier" / "tokenizer.json"),
                             grpc_port=free_port(), http_port=free_port(),
                             metrics_port=free_port(),
                             workdir=tmp_path_factory.mktemp("triton"))
    yield srv, config
    assert srv.stop() == 0, srv.log_excerpt()


@pytest.fixture(scope="module")
def local(server):
    """The in-process runtime with the server's settings: the reference outputs."""
    _, config = server
    verifier = load_model(config.verifier)
    dec = SpeculativeDecoder(verifier, Drafter("model", load_model(config.draft)),
                             RuleParams("greedy"), k=config.k, max_batch_size=1,
                             max_seq_len=MAX_SEQ)
    tok = load_tokenizer(config.verifier)

    def run(prompt, max_tokens):
        ids = dec.generate([tok.encode(prompt).ids], max_tokens,
                           eos_token_id=config.eos_token_id).token_ids[0]
        return tok.decode(ids, skip_special_tokens=True)

    return run


def raw_stream(url, inputs, model="ensemble", cancel_after=None, timeout=120):
    """Send one request on a gRPC stream; returns (responses, error)."""
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    client.async_stream_infer(model, inputs, enable_empty_final_response=True)
    responses, error = [], None
    try:
        while True:
            result, error = results.get(timeout=timeout)
            if error is not None:
                break
            responses.append(result)
            if cancel_after is not None and len(responses) >= cancel_after:
                break
            final = result.get_response().parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                break
    finally:
        client.stop_stream(cancel_requests=cancel_after is not None)
        client.close()
    return responses, error


def tensor(name, value, dtype, np_dtype, shape=(1, 1)):
    t = grpcclient.InferInput(name, list(shape), dtype)
    t.set_data_from_numpy(np.array(value, dtype=np_dtype).reshape(shape))
    return t


def metrics(srv, labelled: bool = False) -> dict[str, float]:
    """paradraft_* metrics by name (the last series of each), or by name and labels."""
    url = f"http://{srv.host}:{srv.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(paradraft_[a-z_]+)(\{[^}]*\})? ([0-9.e+-]+)$", line)
        if m and "le=" not in (m.group(2) or ""):
            out[m.group(1) + (m.group(2) or "") if labelled else m.group(1)] = float(m.group(3))
    return out


def test_greedy_over_grpc_equals_the_runtime_and_streaming_concatenates(server, local):
    srv, _ = server
    for prompt in PROMPTS[:3]:
        want = local(prompt, 40)
        whole = serving_client.complete(srv.grpc_url, prompt, 40, stream=False)
        streamed = serving_client.complete(srv.grpc_url, prompt, 40, stream=True)
        assert whole.text == want
        assert len(whole.chunks) == 1
        assert len(streamed.chunks) > 2  # several responses before the final one
        assert "".join(streamed.chunks) == whole.text
        assert 0.0 <= whole.acceptance_rate <= 1.0
        assert whole.total_draft_tokens > 0


def test_a_request_drafts_with_the_ngram_lookup_when_it_names_it(server, local):
    """drafter "ngram" on a server that drafts with a model: the request gets the same text
    and drafts what the lookup drafts in process (their counts), while a request beside it
    keeps the model; a drafter the server lacks is INVALID_ARGUMENT naming it."""
    srv, config = server
    verifier, tok = load_model(config.verifier), load_tokenizer(config.verifier)
    lookup = SpeculativeDecoder(verifier, Drafter("ngram"), RuleParams("greedy"), k=config.k,
                                max_batch_size=1, max_seq_len=MAX_SEQ)
    prompt = PROMPTS[1]  # repeats itself: the lookup finds drafts
    want = lookup.generate([tok.encode(prompt).ids], 60, eos_token_id=config.eos_token_id)
    results = {}

    def ask(drafter):
        results[drafter] = serving_client.complete(srv.grpc_url, prompt, 60, drafter=drafter)

    threads = [threading.Thread(target=ask, args=(d,)) for d in ("ngram", "model")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    text = local(prompt, 60)
    assert results["ngram"].text == results["model"].text == text
    assert results["ngram"].total_draft_tokens == want.stats.draft_tokens
    assert results["ngram"].total_accepted_draft_tokens == want.stats.accepted_tokens
    assert results["model"].total_draft_tokens != want.stats.draft_tokens
    with pytest.raises(serving_client.ServerError,
                       match="drafter must be one of model, ngram on this server; got 'self'"
                       ) as e:
        serving_client.complete(srv.grpc_url, prompt, 8, drafter="self")
    assert e.value.code == "INVALID_ARGUMENT"


def test_stream_interval_sends_fewer_larger_responses_and_loses_no_text(server, local,
                                                                      tmp_path_factory):
    _, base = server
    config = protocol.ServeConfig(**{**base.__dict__, "stream_interval": 8})
    srv = serving_server.start_server(config, str(MODELS / "verifier" / "tokenizer.json"),
                             grpc_port=free_port(), http_port=free_port(),
                             metrics_port=free_port(),
                             workdir=tmp_path_factory.mktemp("triton_interval"))
    try:
        for prompt in PROMPTS[:2]:
            streamed = serving_client.complete(srv.grpc_url, prompt, 40, stream=True)
            assert streamed.text == local(prompt, 40)
            # the first response at once (one round's tokens), then at least 8 tokens each;
            # the final one carries what is left
            assert streamed.chunk_tokens[0] <= config.k + 1
            assert all(n >= 8 for n in streamed.chunk_tokens[1:-1]), streamed.chunk_tokens
            assert sum(streamed.chunk_tokens) <= 40 and len(streamed.chunks) >= 3
    finally:
        assert srv.stop() == 0, srv.log_excerpt()
    # the model's finalize() ran and ended its threads (what a hung unload is measured by)
    assert re.search(r"paradraft: \S+ unloaded its threads in [\d.]+ s", srv.log.read_text())


def test_a_stack_dump_of_the_stub_leaves_it_serving(server):
    """What stop() does before it kills a tritonserver that does not exit: each model
    stub prints its threads' stacks to the log; the model keeps serving."""
    srv, _ = server
    before = srv.log.read_text().count("most recent call first")
    srv.log_stub_stacks(wait=2.0)
    log = srv.log.read_text()
    assert log.count("most recent call first") > before, srv.log_excerpt()
    assert "paradraft-scheduler" in log or "scheduler.py" in log, srv.log_excerpt()
    assert serving_client.complete(srv.grpc_url, PROMPTS[0], 8).text


def test_sixteen_concurrent_streams_each_get_their_solo_output(server, local):
    srv, _ = server
    jobs = [(PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)), 8 + 5 * i)
            for i in range(16)]
    want = [local(p, n) for p, n in jobs]
    got: list = [None] * 16

    def run(i):
        got[i] = serving_client.complete(srv.grpc_url, jobs[i][0], jobs[i][1], stream=True).text

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert got == want


def test_a_stock_client_cancelling_its_ensemble_stream_frees_the_slot_within_a_round(server):
    """What a TensorRT-LLM client does: a stock tritonclient.grpc stream to `ensemble`,
    cancelled mid-stream (stop_stream(cancel_requests=True)) and no stop request. The
    served model is the decoupled Python model itself, so the cancellation reaches it: the
    slot frees within about a round, and the request never counts as finished."""
    srv, _ = server
    before = metrics(srv).get("paradraft_requests_total", 0)
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(srv.grpc_url)
    try:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        client.async_stream_infer("ensemble", [
            tensor("text_input", b"def long_function():", "BYTES", np.object_),
            tensor("max_tokens", 300, "INT32", np.int32),
            tensor("stream", True, "BOOL", np.bool_),
            tensor("end_id", -1, "INT32", np.int32)])
        for _ in range(2):  # it runs: two streamed responses
            _, error = results.get(timeout=120)
            assert error is None, error
        deadline = time.monotonic() + 10  # the gauge goes out within 50 ms of a change
        while metrics(srv)["paradraft_active_sequences"] != 1:
            assert time.monotonic() < deadline, "the request does not hold a slot"
            time.sleep(0.02)
        client.stop_stream(cancel_requests=True)
        cancelled = time.monotonic()
        while metrics(srv)["paradraft_active_sequences"] > 0:
            assert time.monotonic() - cancelled < 1.0, "the cancelled request holds its slot"
            time.sleep(0.02)
    finally:
        client.close()
    time.sleep(0.2)  # past a metrics flush: a finished request would have been counted
    assert metrics(srv)["paradraft_requests_total"] == before
    assert serving_client.complete(srv.grpc_url, PROMPTS[0], 8).text


def test_cancelled_token_id_streams_free_their_slots(server):
    """The same with token ids in (input_ids, as the OpenAI API sends them) and every slot
    busy; afterwards the slots serve new requests."""
    srv, config = server
    before = metrics(srv)
    ids = load_tokenizer(config.verifier).encode("def long_function():").ids
    long = [tensor("input_ids", ids, "INT32", np.int32, shape=(1, len(ids))),
            tensor("input_lengths", len(ids), "INT32", np.int32),
            tensor("max_tokens", 280, "INT32", np.int32),
            tensor("stream", True, "BOOL", np.bool_),
            tensor("end_id", -1, "INT32", np.int32)]
    threads = [threading.Thread(target=raw_stream, args=(srv.grpc_url, long),
                                kwargs=dict(cancel_after=1))
               for _ in range(SLOTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    deadline = time.monotonic() + 60
    while metrics(srv).get("paradraft_active_sequences", 1) > 0:
        assert time.monotonic() < deadline, "cancelled requests still hold their slots"
        time.sleep(0.2)
    # they left by cancellation, not by finishing their 280 tokens
    after = metrics(srv)
    assert after["paradraft_requests_total"] == before.get("paradraft_requests_total", 0)
    burst = [None] * SLOTS

    def run(i):
        burst[i] = serving_client.complete(srv.grpc_url, PROMPTS[i], 12, stream=True)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(SLOTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert all(b is not None and b.text for b in burst)


def test_refusals_between_cancelled_streams_leave_the_server_up(server):
    """Cancelled streams, then refused requests on streams that asked for status codes (as
    complete() and the OpenAI API open theirs). Answered at once, such refusals crashed
    Triton 2.51 (SIGSEGV) in 2 of 3 runs of this test, so the model answers them a little
    later (REFUSAL_DELAY_S in its model.py). A few refusals, spaced: a burst of them is a
    Triton 2.51 crash of its own (serving.md)."""
    srv, _ = server
    long = [tensor("text_input", b"def long_function():", "BYTES", np.object_),
            tensor("max_tokens", 280, "INT32", np.int32),
            tensor("stream", True, "BOOL", np.bool_), tensor("end_id", -1, "INT32", np.int32)]
    for _ in range(2):
        for _ in range(4):
            responses, error = raw_stream(srv.grpc_url, long, cancel_after=2)
            assert error is None and len(responses) == 2, error
            time.sleep(0.3)
        for _ in range(4):
            with pytest.raises(serving_client.ServerError, match="max_tokens must be in") as e:
                serving_client.complete(srv.grpc_url, "def f():", 0)
            assert e.value.code == "INVALID_ARGUMENT"
            time.sleep(0.3)
    assert srv.process.poll() is None, srv.log_excerpt()
    assert serving_client.complete(srv.grpc_url, PROMPTS[0], 8).text


def test_stop_request_frees_the_slot(server):
    """TensorRT-LLM's other way: a request with the same request id and ``stop`` true, on a
    stream of its own; the stopped stream ends with a final response."""
    srv, _ = server
    before = metrics(srv)
    # every slot busy with a long stream, one more request waiting in the queue
    ids = [f"long-{i}" for i in range(SLOTS + 1)]
    outcome = {}

    def run(rid):
        try:
            outcome[rid] = serving_client.complete(srv.grpc_url, "def long_function():", 280,
                                          stream=True, request_id=rid, end_id=-1)
        except Exception as e:  # recorded for the assertion below
            outcome[rid] = e

    threads = [threading.Thread(target=run, args=(rid,)) for rid in ids]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while metrics(srv).get("paradraft_active_sequences", 0) < SLOTS:
        assert time.monotonic() < deadline, "the long requests did not start"
        time.sleep(0.1)
    for rid in ids:
        serving_client.stop_request(srv.grpc_url, rid)
    for t in threads:
        t.join(60)
    # each stopped stream (the queued one too) ended with a final response, early
    for rid in ids:
        assert not isinstance(outcome[rid], Exception), outcome[rid]
        assert sum(outcome[rid].chunk_tokens) < 280, rid
    deadline = time.monotonic() + 30
    while metrics(srv).get("paradraft_active_sequences", 1) > 0:
        assert time.monotonic() < deadline, "stopped requests still hold their slots"
        time.sleep(0.2)
    assert metrics(srv)["paradraft_requests_total"] == before.get("paradraft_requests_total", 0)
    with pytest.raises(RuntimeError, match="no request with id 'nobody'"):
        serving_client.stop_request(srv.grpc_url, "nobody")
    assert serving_client.complete(srv.grpc_url, PROMPTS[0], 8).text


def test_an_abandoned_completion_frees_its_slot_by_cancelling_its_stream(server):
    """complete() cancels its stream when its caller gives up half-way (here on_text
    raising), and sends no stop: the slot frees at once instead of after 280 tokens."""
    srv, _ = server
    before = metrics(srv).get("paradraft_requests_total", 0)
    chunks = []

    def give_up(text):
        chunks.append(text)
        if len(chunks) == 3:
            raise KeyboardInterrupt("enough")

    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        serving_client.complete(srv.grpc_url, "def long_function():", 280, on_text=give_up,
                                end_id=-1)
    deadline = time.monotonic() + 30
    while metrics(srv).get("paradraft_active_sequences", 1) > 0:
        assert time.monotonic() < deadline, "the abandoned request still holds its slot"
        time.sleep(0.05)
    assert time.monotonic() - t0 < 30
    assert metrics(srv).get("paradraft_requests_total", 0) == before  # it did not finish


HOSTILE = {
    "empty text": ([("text_input", b"", "BYTES", np.object_),
                    ("max_tokens", 8, "INT32", np.int32)], "text_input is empty"),
    "huge text": ([("text_input", b"x = 1\n" * 50_000, "BYTES", np.object_),
                   ("max_tokens", 8, "INT32", np.int32)], "text_input is"),
    "invalid utf-8": ([("text_input", b"def \xff\xfe(x):", "BYTES", np.object_),
                       ("max_tokens", 8, "INT32", np.int32)], "not valid UTF-8"),
    "max_tokens 0": ([("text_input", b"def f():", "BYTES", np.object_),
                      ("max_tokens", 0, "INT32", np.int32)], "max_tokens must be in"),
    "max_tokens negative": ([("text_input", b"def f():", "BYTES", np.object_),
                             ("max_tokens", -5, "INT32", np.int32)], "max_tokens must be in"),
    "max_tokens above limit": ([("text_input", b"def f():", "BYTES", np.object_),
                                ("max_tokens", 100_000, "INT32", np.int32)],
                               "max_tokens must be in"),
    "temperature 0": ([("text_input", b"def f():", "BYTES", np.object_),
                       ("max_tokens", 8, "INT32", np.int32),
                       ("temperature", 0.0, "FP32", np.float32)], "temperature must be in"),
    "top_p 1.5": ([("text_input", b"def f():", "BYTES", np.object_),
                   ("max_tokens", 8, "INT32", np.int32),
                   ("top_p", 1.5, "FP32", np.float32)], "top_p must be in"),
    "top_p 0": ([("text_input", b"def f():", "BYTES", np.object_),
                 ("max_tokens", 8, "INT32", np.int32),
                 ("top_p", 0.0, "FP32", np.float32)], "top_p must be in"),
    "unknown rule": ([("text_input", b"def f():", "BYTES", np.object_),
                      ("max_tokens", 8, "INT32", np.int32),
                      ("correction_rule", b"yolo", "BYTES", np.object_)],
                     "correction_rule must be one of"),
    "num_draft_tokens too big": ([("text_input", b"def f():", "BYTES", np.object_),
                                  ("max_tokens", 8, "INT32", np.int32),
                                  ("num_draft_tokens", 99, "INT32", np.int32)],
                                 "num_draft_tokens must be in"),
    "beam search": ([("text_input", b"def f():", "BYTES", np.object_),
                     ("max_tokens", 8, "INT32", np.int32), ("beam_width", 2, "INT32", np.int32)],
                    "beam_width must be 1"),
    "top_k 5": ([("text_input", b"def f():", "BYTES", np.object_),
                 ("max_tokens", 8, "INT32", np.int32), ("top_k", 5, "INT32", np.int32)],
                "top_k must be 0 (off) or 1"),
    "top_k 1 with sampling": ([("text_input", b"def f():", "BYTES", np.object_),
                               ("max_tokens", 8, "INT32", np.int32),
                               ("top_k", 1, "INT32", np.int32),
                               ("correction_rule", b"exact", "BYTES", np.object_)],
                              "top_k 1 asks for greedy decoding"),
    "prompt in output": ([("text_input", b"def f():", "BYTES", np.object_),
                          ("max_tokens", 8, "INT32", np.int32),
                          ("exclude_input_in_output", False, "BOOL", np.bool_)],
                         "exclude_input_in_output must be true"),
    "bad_words": ([("text_input", b"def f():", "BYTES", np.object_),
                   ("max_tokens", 8, "INT32", np.int32),
                   ("bad_words", [b"import"], "BYTES", np.object_, (1, 1))], "bad_words"),
    "17 stop words": ([("text_input", b"def f():", "BYTES", np.object_),
                       ("max_tokens", 8, "INT32", np.int32),
                       ("stop_words", [b"w%d" % i for i in range(17)], "BYTES", np.object_,
                        (1, 17))], "stop_words must hold at most 16"),
    "wrong dtype": ([("text_input", b"def f():", "BYTES", np.object_),
                     ("max_tokens", 8.0, "FP32", np.float32)], "max_tokens"),
    "missing max_tokens": ([("text_input", b"def f():", "BYTES", np.object_)], "max_tokens"),
    "missing text_input": ([("max_tokens", 8, "INT32", np.int32)], "text_input"),
    "text and ids": ([("text_input", b"def f():", "BYTES", np.object_),
                      ("input_ids", [5, 6], "INT32", np.int32, (1, 2)),
                      ("max_tokens", 8, "INT32", np.int32)],
                     "send exactly one of text_input (the prompt as text) and input_ids"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_input_gets_an_error_and_the_server_keeps_serving(server, case):
    srv, _ = server
    spec, message = HOSTILE[case]
    inputs = [tensor(*s) for s in spec]
    _, error = raw_stream(srv.grpc_url, inputs)
    assert error is not None, f"{case}: no error"
    assert message in str(error), f"{case}: {error}"
    ok = serving_client.complete(srv.grpc_url, "def ok():", 6, stream=False)
    assert ok.text


def test_a_bad_request_is_invalid_argument_over_grpc_and_400_over_http(server):
    """Error classes: a stream opened with Triton's triton_grpc_error header closes with the
    error's gRPC status code (the model sends INVALID_ARG);
    Triton's HTTP generate endpoint answers 400."""
    import json

    srv, _ = server
    for prompt, max_tokens, message in [("def f():", 0, "max_tokens must be in"),
                                        ("", 8, "text_input is empty")]:
        with pytest.raises(serving_client.ServerError, match=message) as e:
            serving_client.complete(srv.grpc_url, prompt, max_tokens)
        assert e.value.code == "INVALID_ARGUMENT"
        body = json.dumps({"text_input": prompt, "max_tokens": max_tokens}).encode()
        req = urllib.request.Request(
            f"http://{srv.host}:{srv.http_port}/v2/models/ensemble/generate", data=body,
            method="POST")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=60)
        assert e.value.code == 400 and message in e.value.read().decode()


def test_wrong_shape_is_refused(server):
    srv, _ = server
    inputs = [tensor("text_input", [b"a", b"b"], "BYTES", np.object_, shape=(1, 2)),
              tensor("max_tokens", 8, "INT32", np.int32)]
    _, error = raw_stream(srv.grpc_url, inputs)
    assert error is not None and "text_input" in str(error)
    assert serving_client.complete(srv.grpc_url, "def ok():", 6).text


def test_http_generate_endpoint(server):
    srv, _ = server
    import json

    body = json.dumps({"text_input": "def f(x):", "max_tokens": 10}).encode()
    req = urllib.request.Request(f"http://{srv.host}:{srv.http_port}/v2/models/ensemble/generate",
                                 data=body, method="POST")
    reply = json.loads(urllib.request.urlopen(req, timeout=60).read())
    assert reply["text_output"] == serving_client.complete(srv.grpc_url, "def f(x):", 10).text
    assert reply["total_draft_tokens"] > 0


def test_http_generate_stream_endpoint(server):
    """Triton's HTTP generate_stream (server-sent events): several events whose texts
    concatenate to the non-streaming text; the last one carries the request's stats."""
    srv, _ = server
    import json

    body = json.dumps({"text_input": "def g(y):", "max_tokens": 12, "stream": True}).encode()
    req = urllib.request.Request(
        f"http://{srv.host}:{srv.http_port}/v2/models/ensemble/generate_stream", data=body,
        method="POST")
    raw = urllib.request.urlopen(req, timeout=60).read().decode()
    events = [json.loads(line.removeprefix("data: ")) for line in raw.splitlines()
              if line.startswith("data: ")]
    assert len(events) > 2
    assert "".join(e["text_output"] for e in events) == serving_client.complete(
        srv.grpc_url, "def g(y):", 12).text
    assert events[-1]["sequence_length"] == 12
    assert events[-1]["total_draft_tokens"] > 0


def test_custom_metrics_move(server):
    srv, _ = server
    before = metrics(srv)
    done = serving_client.complete(srv.grpc_url, "def metric_test():", 32)
    after = metrics(srv)
    for name in ("paradraft_draft_tokens_total", "paradraft_accepted_tokens_total",
                 "paradraft_requests_total", "paradraft_acceptance_length_count"):
        assert after[name] > before.get(name, 0), name
    # a round that rejected a draft rolled back (this greedy request has such rounds)
    assert done.total_accepted_draft_tokens < done.total_draft_tokens
    assert after["paradraft_rollbacks_total"] > before.get("paradraft_rollbacks_total", 0)
    assert "paradraft_queue_depth" in after
    assert after["paradraft_active_sequences"] == 0
    assert after["paradraft_slots"] == SLOTS


def test_goodput_policy_metrics_show_its_k_costs_and_goodput(tmp_path):
    """A server on the goodput policy (``paradraft serve``'s default): Prometheus shows the
    K of each round (a histogram), the plain rounds, the expected and realized speed-up over
    plain decoding, each drafter's α, and the round costs it measured at start."""
    config = protocol.ServeConfig(
        verifier=str(MODELS / "verifier"), draft=str(MODELS / "draft"), k=2, max_slots=2,
        max_queue=8, max_seq_len=128, max_input_tokens=64, draft_len_schedule="auto",
        eos_token_id=load_model(MODELS / "verifier").config.eos_token_ids)
    srv = serving_server.start_server(config, str(MODELS / "verifier" / "tokenizer.json"),
                                      grpc_port=free_port(), http_port=free_port(),
                                      metrics_port=free_port(), workdir=tmp_path)
    try:
        done = serving_client.complete(srv.grpc_url, "def goodput():", 24, end_id=-1)
        time.sleep(0.3)  # past a metrics flush
        m = metrics(srv, labelled=True)
    finally:
        assert srv.stop() == 0, srv.log_excerpt()
    one = 'instance="ensemble_0_0",model="ensemble"'
    rounds = m[f"paradraft_rounds_total{{{one}}}"]
    assert rounds == m[f"paradraft_round_k_count{{{one}}}"] > 0  # every round observed once
    assert 0 <= m.get(f"paradraft_plain_rounds_total{{{one}}}", 0) <= rounds
    # one request alone: each round verified the drafts it drafted
    assert m[f"paradraft_round_k_sum{{{one}}}"] == done.total_draft_tokens
    for name in ("paradraft_goodput_expected", "paradraft_goodput_realized"):
        assert m[f"{name}{{{one}}}"] > 0, name
    assert 0 < m[f'paradraft_acceptance_alpha{{drafter="model",{one}}}'] < 1
    costs = {key: v for key, v in m.items() if key.startswith("paradraft_round_cost_seconds")}
    # verify at K 0..2 and draft at K 1..2, for batch sizes 1 and 2
    assert len(costs) == 2 * (3 + 2) and all(v > 0 for v in costs.values())


def test_metrics_move_every_round_while_a_request_runs(server):
    """Scrapes during one long stream: the acceptance counters (per position too) climb
    while the request still holds its slot, not only when it finishes."""
    srv, _ = server
    before = metrics(srv, labelled=True)
    one = 'instance="ensemble_0_0",model="ensemble"'  # labelled by model instance
    thread = threading.Thread(target=serving_client.complete,
                              args=(srv.grpc_url, "def long_function():", 280),
                              kwargs=dict(end_id=-1))
    thread.start()
    seen = []
    deadline = time.monotonic() + 60
    drafted = f'paradraft_draft_tokens_total{{{one}}}'
    while len(seen) < 2 and time.monotonic() < deadline:
        m = metrics(srv, labelled=True)
        # the gauge goes out at admission, the counters with the next flush: wait for both
        if m.get(f'paradraft_active_sequences{{{one}}}') == 1 and m.get(drafted, 0) > (
                seen[-1][drafted] if seen else before.get(drafted, 0)):
            seen.append(m)
        time.sleep(0.05)
    thread.join(120)
    assert len(seen) == 2, "no two scrapes saw the counters move during the stream"
    first = f'paradraft_draft_tokens_by_position_total{{{one},position="1"}}'
    assert seen[1][first] > seen[0][first] > before.get(first, 0)
    finished = f'paradraft_requests_total{{{one}}}'
    assert seen[1][finished] == before.get(finished, 0)  # it was still running
    accepted = [seen[1][f'paradraft_accepted_tokens_by_position_total{{{one},position="{i}"}}']
                for i in range(1, 5)]
    assert accepted == sorted(accepted, reverse=True)  # a block is accepted as a prefix


def test_loadtest_runs_every_level_in_turn_and_loses_nothing(server, tmp_path):
    from paradraft.runtime.tools.loadtest import run_loadtest, write_outputs

    srv, _ = server
    results = run_loadtest(srv.grpc_url, PROMPTS, [1, 2], requests=3, max_tokens=6, repeats=2)
    # levels in turn: c1, c2, c1, c2
    assert [(r.repeat, r.concurrency) for r in results] == [(0, 1), (0, 2), (1, 1), (1, 2)]
    for r in results:
        assert (r.answered, r.errors, r.lost) == (3, 0, 0), r.error_messages
        assert r.output_tokens == 3 * 6 and r.tokens_per_second > 0
        assert r.client_cpu_share > 0  # the generator's own CPU, measured per level
    data = write_outputs(results, tmp_path, {})
    ratios = [results[i + 1].tokens_per_second / results[i].tokens_per_second for i in (0, 2)]
    assert data["summary"]["c2_vs_c1_per_repeat"] == pytest.approx(ratios)
    assert (tmp_path / "loadtest.png").stat().st_size > 0


def test_loadtest_counts_errors_and_lost_requests_and_runs_the_in_process_reference(
        server, tmp_path):
    """Error responses (max_tokens past the limit) count as errors, requests with no final
    response in time as lost; over Triton's HTTP endpoint too; and each served level is
    followed by the same prompts through a scheduler with the server's settings in a plain
    Python process."""
    from paradraft.runtime.tools.loadtest import (
        REFERENCE,
        ReferenceProcess,
        run_level,
        run_loadtest,
        write_outputs,
    )

    srv, config = server
    http_url = f"{srv.host}:{srv.http_port}"
    for kind, url in [("grpc", srv.grpc_url), ("http", http_url)]:
        r = run_level(url, PROMPTS, 2, 3, 10_000, protocol=kind)
        assert (r.errors, r.lost) == (3, 0), (kind, r.error_messages)
        assert "max_tokens must be in" in r.error_messages[0]
        r = run_level(url, PROMPTS, 2, 3, 200, protocol=kind, timeout=0.001)
        assert (r.errors, r.lost) == (0, 3), (kind, r.error_messages)
    reference = ReferenceProcess(config, config.verifier, PROMPTS, requests=3, max_tokens=6)
    try:
        results = run_loadtest(http_url, PROMPTS, [1, 2], requests=3, max_tokens=6,
                               protocol="http", reference=reference)
    finally:
        reference.stop()
    assert [(r.protocol, r.concurrency) for r in results] == [
        ("http", 1), (REFERENCE, 1), ("http", 2), (REFERENCE, 2)]
    for r in results:
        assert (r.answered, r.errors, r.lost, r.output_tokens) == (3, 0, 0, 18), r
    summary = write_outputs(results, tmp_path, {})["summary"]
    assert summary["served_vs_in_process"]["c1"] == pytest.approx(
        results[0].tokens_per_second / results[1].tokens_per_second)


def tritonservers_in(workdir: Path) -> list[int]:
    """pids of tritonserver processes started with a model repository under ``workdir``, and
    of OpenAI API processes whose chat dir is there."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if (("tritonserver" in cmdline or "serve_forever" in cmdline)
                and str(workdir) in cmdline):
            pids.append(int(proc.name))
    return pids


def start_serve_command(workdir: Path, *extra: str, launcher: tuple[str, ...] = ()):
    import subprocess
    import sys

    cmd = [*launcher, sys.executable, "-m", "paradraft.cli", "serve",
           "--verifier", str(MODELS / "verifier"), "--draft", str(MODELS / "draft"),
           "--max-slots", "2", "--max-seq-len", "128", "--grpc-port", str(free_port()),
           "--http-port", str(free_port()), "--metrics-port", str(free_port()),
           "--workdir", str(workdir), *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.parametrize("when", ["starting", "ready"])
def test_serve_command_leaves_no_tritonserver_after_sigterm(tmp_path, when):
    """`paradraft serve` as users run it: SIGTERM while it waits for readiness, or once it
    serves, stops its tritonserver (which runs in its own session and never sees the
    signal) and exits cleanly. Once ready it also serves the OpenAI API (--openai-port), which
    stops with it."""
    import json
    import signal

    openai_port = free_port()
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    extra = () if when == "starting" else ("--openai-port", str(openai_port),
                                          "--chat-template", str(template))
    proc = start_serve_command(tmp_path, *extra)
    try:
        deadline = time.monotonic() + 240
        if when == "starting":
            while not tritonservers_in(tmp_path) and time.monotonic() < deadline:
                assert proc.poll() is None, proc.stdout.read()
                time.sleep(0.05)
        else:
            line = ""
            while "Triton ready" not in line and time.monotonic() < deadline:
                line = proc.stdout.readline()
                assert line or proc.poll() is None, "serve exited before it was ready"
            assert f"OpenAI API http://127.0.0.1:{openai_port}/v1" in line
            body = json.dumps({"model": "paradraft", "max_tokens": 3,
                               "messages": [{"role": "user", "content": "def f():"}]})
            req = urllib.request.Request(f"http://127.0.0.1:{openai_port}/v1/chat/completions",
                                         data=body.encode(), method="POST")
            reply = json.loads(urllib.request.urlopen(req, timeout=60).read())
            assert reply["usage"]["completion_tokens"] == 3
            assert len(tritonservers_in(tmp_path)) == 2  # tritonserver and the API
        assert tritonservers_in(tmp_path), "no tritonserver was started"
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert ("interrupted before tritonserver was ready" if when == "starting"
            else "tritonserver stopped (0)") in out
    time.sleep(0.5)  # the kernel reaps the stopped server
    assert tritonservers_in(tmp_path) == []


def test_served_text_leaves_special_tokens_out(server):
    """A sampled request whose output holds special tokens (<|endoftext|>, <pad>: found in
    process at a flat temperature; each request samples from its own seeded stream, so the
    server draws the same): the served text is the decode without them, streamed or not."""
    srv, config = server
    tok = load_tokenizer(config.verifier)
    rows, n = 16, 200
    dec = SpeculativeDecoder(load_model(config.verifier),
                             Drafter("model", load_model(config.draft)),
                             RuleParams("exact", temperature=100.0), k=config.k,
                             max_batch_size=rows, max_seq_len=MAX_SEQ)
    prompt = tok.encode("def f(x):").ids
    specials = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    for first in range(0, 8 * rows, rows):  # 16 seeds a batch: row b gets row_seeds' seed
        outputs = dec.generate([prompt] * rows, n, seed=first, eos_token_id=None).token_ids
        hits = [b for b, ids in enumerate(outputs) if specials & set(ids)]
        if hits:
            seed, ids = row_seeds(first, rows)[hits[0]], outputs[hits[0]]
            break
    else:
        pytest.fail(f"no seed of 128 sampled a special token in {n} tokens")
    want = tok.decode(ids, skip_special_tokens=True)
    assert want != tok.decode(ids, skip_special_tokens=False)
    for stream in (False, True):
        done = serving_client.complete(srv.grpc_url, "def f(x):", n, stream,
                                       temperature=100.0, random_seed=seed, end_id=-1)
        assert done.text == want, (seed, stream)
        assert "".join(done.chunks) == done.text and sum(done.chunk_tokens) == n


def test_stop_words_end_the_output_after_their_first_occurrence(server, local):
    """A stop word taken from the greedy output: the output runs up to and including its
    first occurrence (TensorRT-LLM keeps the stop word), streamed or not."""
    srv, config = server
    tok = load_tokenizer(config.verifier)
    prompt = "def fibonacci(n):"
    full = local(prompt, 48)
    ids = tok.encode(full).ids
    # a token in the middle whose text tokenises back to itself alone
    stop = next(t for t in ids[10:] if tok.encode(tok.decode([t])).ids == [t]
                and tok.decode([t]).strip())
    word = tok.decode([stop])
    want = tok.decode(ids[: ids.index(stop) + 1])
    assert len(want) < len(full)
    for stream in (False, True):
        done = serving_client.complete(srv.grpc_url, prompt, 48, stream, stop_words=[word, ""])
        assert done.text == "".join(done.chunks) == want, (stream, word)


def test_tensorrt_llm_client_defaults_are_accepted(server, local):
    """What TensorRT-LLM's example clients send by default changes nothing: top_k 1 means
    greedy, empty bad/stop words mean none."""
    srv, _ = server
    prompt = "class Parser:"
    inputs = [*serving_client.request_inputs(prompt, 24, False),
              tensor("bad_words", [b""], "BYTES", np.object_, (1, 1)),
              tensor("stop_words", [b""], "BYTES", np.object_, (1, 1)),
              tensor("top_k", 1, "INT32", np.int32), tensor("beam_width", 1, "INT32", np.int32),
              tensor("pad_id", 1, "INT32", np.int32), tensor("min_length", 1, "INT32", np.int32),
              tensor("temperature", 0.7, "FP32", np.float32),  # top_k 1 wins: greedy
              tensor("repetition_penalty", 1.0, "FP32", np.float32),
              tensor("presence_penalty", 0.0, "FP32", np.float32),
              tensor("frequency_penalty", 0.0, "FP32", np.float32),
              tensor("length_penalty", 1.0, "FP32", np.float32),
              tensor("exclude_input_in_output", True, "BOOL", np.bool_),
              tensor("return_log_probs", False, "BOOL", np.bool_),
              tensor("return_context_logits", False, "BOOL", np.bool_),
              tensor("return_generation_logits", False, "BOOL", np.bool_)]
    responses, error = raw_stream(srv.grpc_url, inputs)
    assert error is None, error
    assert responses[-1].as_numpy("text_output").reshape(-1)[0].decode() == local(prompt, 24)


@pytest.fixture(scope="module")
def onnx_server(tmp_path_factory):
    """A server on ONNX engines of the shipped models, as `make demo` runs one, with the
    correction fused into the verifier call (`serve --fused-correction on`)."""
    pytest.importorskip("onnxruntime")
    from paradraft.build.onnx import build_engines

    engines = tmp_path_factory.mktemp("engines")
    # without the fused k-step drafting graphs (10 s of CI's budget): in process and served
    # alike the draft runs its single steps; test_onnx checks the fused graphs against them
    build_engines(MODELS / "verifier", engines, MODELS / "draft", max_batch_size=SLOTS,
                  max_k=4, max_seq_len=MAX_SEQ, fused_drafts=False)
    config = protocol.ServeConfig(
        verifier=str(MODELS / "verifier"), draft=None, engines=str(engines), k=4,
        max_slots=SLOTS, max_queue=8, max_seq_len=MAX_SEQ, max_input_tokens=256,
        eos_token_id=load_model(MODELS / "verifier").config.eos_token_ids,
        fused_correction="on")
    srv = serving_server.start_server(config, str(engines / "tokenizer.json"),
                                      grpc_port=free_port(), http_port=free_port(),
                                      metrics_port=free_port(),
                                      workdir=tmp_path_factory.mktemp("triton_onnx"))
    yield srv, config
    assert srv.stop() == 0, srv.log_excerpt()


def test_onnx_engine_server_streams_what_the_engines_decode_in_process(onnx_server):
    """Served with the fused correction, decoded in process without it: the same tokens."""
    from paradraft.runtime.backends.loader import load_engines

    srv, config = onnx_server
    verifier, drafters = load_engines(config.engines)[:2]
    dec = SpeculativeDecoder(verifier, drafters["model"], RuleParams("greedy"), k=4,
                             max_batch_size=1, max_seq_len=MAX_SEQ)
    tok = load_tokenizer(config.engines)
    for prompt in PROMPTS[:3]:
        ids = dec.generate([tok.encode(prompt).ids], 24,
                           eos_token_id=config.eos_token_id).token_ids[0]
        got = serving_client.complete(srv.grpc_url, prompt, 24, stream=True)
        assert got.text == "".join(got.chunks) == tok.decode(ids, skip_special_tokens=True), prompt
        assert len(got.chunks) > 1 and got.total_draft_tokens > 0


def test_corrupt_engine_weights_are_refused_at_load_naming_the_file(onnx_server, tmp_path):
    """Served from an engine dir whose weights were truncated on disk: the model instance
    refuses them by checksum; start_server fails fast, naming the file, with no traceback."""
    import dataclasses
    import shutil

    config = onnx_server[1]
    engines = tmp_path / "engines"
    shutil.copytree(config.engines, engines)
    weights = engines / "verifier.weights"
    weights.write_bytes(weights.read_bytes()[:-100])
    bad = dataclasses.replace(config, engines=str(engines))
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as e:
        serving_server.start_server(bad, str(engines / "tokenizer.json"), grpc_port=free_port(),
                                    http_port=free_port(), metrics_port=free_port(),
                                    workdir=tmp_path / "triton")
    assert time.monotonic() - t0 < 60
    message = str(e.value)
    assert f"{weights} does not match its sha256" in message, message
    assert "Traceback" not in message, message


def by_instance(srv, name: str) -> dict[str, float]:
    """One paradraft_* metric per model instance: {instance name: value}."""
    out = {}
    for key, value in metrics(srv, labelled=True).items():
        m = re.fullmatch(name + r'\{.*instance="([^"]+)".*\}', key)
        if m:
            out[m.group(1)] = value
    return out


def test_two_cpu_instances_share_the_traffic_and_each_request_gets_its_solo_output(
        tmp_path_factory):
    """`serve --instances 2`: two model instances (processes, each with its own slots and
    caches). Triton spreads the requests over both (their per-instance metrics move), and
    every request, greedy or seeded sampled, gets what it gets alone in process. Stopping
    the server with a stream still running ends that stream as UNAVAILABLE, and
    tritonserver exits 0."""
    config = protocol.ServeConfig(
        verifier=str(MODELS / "verifier"), draft=str(MODELS / "draft"), k=4, max_slots=2,
        max_queue=16, max_seq_len=MAX_SEQ, max_input_tokens=256, instances=2,
        eos_token_id=load_model(MODELS / "verifier").config.eos_token_ids)
    assert "count: 2, kind: KIND_CPU" in serving_server.instance_group(config)
    tok = load_tokenizer(config.verifier)
    verifier, draft = load_model(config.verifier), load_model(config.draft)

    def solo(prompt, n, params, seed=0):
        dec = SpeculativeDecoder(verifier, Drafter("model", draft), params, k=config.k,
                                 max_batch_size=1, max_seq_len=MAX_SEQ)
        ids = dec.generate([tok.encode(prompt).ids], n, seed=seed,
                           eos_token_id=config.eos_token_id).token_ids[0]
        return tok.decode(ids, skip_special_tokens=True)

    # (prompt, tokens, sampling inputs): half greedy, half sampled with their own seeds
    jobs = [(PROMPTS[i], 24 + 4 * i, {} if i % 2 == 0 else
             {"temperature": 0.8, "random_seed": 1000 + i}) for i in range(8)]
    want = [solo(p, n, RuleParams("exact", temperature=kw["temperature"]) if kw
                 else RuleParams("greedy"), kw.get("random_seed", 0)) for p, n, kw in jobs]
    srv = serving_server.start_server(config, str(MODELS / "verifier" / "tokenizer.json"),
                                      grpc_port=free_port(), http_port=free_port(),
                                      metrics_port=free_port(),
                                      workdir=tmp_path_factory.mktemp("triton_instances"))
    try:
        assert srv.instances == 2
        slots = by_instance(srv, "paradraft_slots")
        assert slots == {"ensemble_0_0": 2, "ensemble_0_1": 2}, slots
        got: list = [None] * len(jobs)

        def run(i):
            p, n, kw = jobs[i]
            got[i] = serving_client.complete(srv.grpc_url, p, n, stream=True, **kw).text

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert got == want
        deadline = time.monotonic() + 10  # the finished requests' metrics flush at once
        while sum(by_instance(srv, "paradraft_requests_total").values()) < len(jobs):
            assert time.monotonic() < deadline, by_instance(srv, "paradraft_requests_total")
            time.sleep(0.1)
        finished = by_instance(srv, "paradraft_requests_total")
        drafted = by_instance(srv, "paradraft_draft_tokens_total")
        assert set(finished) == set(drafted) == {"ensemble_0_0", "ensemble_0_1"}
        assert all(n > 0 for n in [*finished.values(), *drafted.values()]), (finished, drafted)
        # a stream still running when the server stops ends as UNAVAILABLE (retry elsewhere)
        started = threading.Event()
        outcome = {}

        def long_stream():
            try:
                outcome["done"] = serving_client.complete(
                    srv.grpc_url, "def long_function():", 280, end_id=-1,
                    on_text=lambda text: started.set())
            except serving_client.ServerError as e:
                outcome["error"] = e

        thread = threading.Thread(target=long_stream)
        thread.start()
        assert started.wait(60)
    finally:
        code = srv.stop()
    thread.join(60)
    assert code == 0, srv.log_excerpt()
    assert "error" in outcome, "the stream finished before the stop reached it"
    assert outcome["error"].code == "UNAVAILABLE"
    assert "server shutting down" in str(outcome["error"])


def test_sigterm_drains_running_streams_refuses_new_requests_and_exits_0(tmp_path):
    """`paradraft serve --drain-seconds` as an orchestrator stops it: SIGTERM mid-stream.
    New requests are refused as UNAVAILABLE over gRPC and with a 503 + Retry-After by the
    OpenAI API, the running and queued streams finish whole, serve exits 0, and neither
    tritonserver nor the API process is left (checked by pid)."""
    import json
    import signal
    import types

    openai_port = free_port()
    template = tmp_path / "chat.jinja"  # the API's chat dir in tmp_path: its pid is found
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    # one slot and one queue place: the second long request waits in the queue (and must
    # finish too), and any other request is refused at once, as queue full until the drain
    proc = start_serve_command(tmp_path, "--max-slots", "1", "--max-queue", "1",
                               "--max-seq-len", "512", "--drain-seconds", "120",
                               "--openai-port", str(openai_port),
                               "--chat-template", str(template))
    outcome: dict = {}
    threads = []
    try:
        line = ""
        deadline = time.monotonic() + 240
        while "Triton ready" not in line and time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "serve exited before it was ready"
        url = re.search(r"gRPC (\S+),", line).group(1)
        port = int(re.search(r"metrics http://[^:]+:(\d+)/", line).group(1))
        srv = types.SimpleNamespace(host="127.0.0.1", metrics_port=port)  # for metrics()
        pids = tritonservers_in(tmp_path)
        assert len(pids) == 2  # tritonserver and the API

        def long_stream(i):
            try:
                outcome[i] = serving_client.complete(url, "def long_function():", 250,
                                                     end_id=-1)
            except Exception as e:  # recorded for the assertions below
                outcome[i] = e

        threads = [threading.Thread(target=long_stream, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while (metrics(srv).get("paradraft_active_sequences"),
               metrics(srv).get("paradraft_queue_depth")) != (1, 1):
            assert time.monotonic() < deadline, "the long streams did not start"
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        while "paradraft: draining" not in line:
            line = proc.stdout.readline()
            assert line, "serve exited instead of draining"
        # a few probes, spaced: the instance reads the drain within 0.1 s (Triton 2.51 can
        # crash under a storm of refused gRPC streams, a race of its own; see serving.md)
        for _ in range(20):
            time.sleep(0.3)
            with pytest.raises(serving_client.ServerError) as e:
                serving_client.complete(url, "def f():", 1)
            assert e.value.code == "UNAVAILABLE", e.value  # queue full, then draining
            if "draining" in str(e.value):
                break
        assert "server shutting down (draining)" in str(e.value), e.value
        assert any(t.is_alive() for t in threads), "the streams ended before the drain began"
        body = json.dumps({"model": "paradraft", "prompt": "def f():", "max_tokens": 4})
        req = urllib.request.Request(f"http://127.0.0.1:{openai_port}/v1/completions",
                                     data=body.encode(), method="POST")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=60)
        assert e.value.code == 503 and e.value.headers["Retry-After"] == "1"
        assert "draining" in json.loads(e.value.read())["error"]["message"]
        for t in threads:
            t.join(120)
        out = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:  # a failure above: SIGINT stops serve and its tritonserver
            proc.send_signal(signal.SIGINT)  # (SIGKILL would orphan it in its own session)
            try:
                proc.wait(60)
            except Exception:
                proc.kill()
    for i in range(2):
        done = outcome[i]
        assert not isinstance(done, Exception), done
        assert sum(done.chunk_tokens) == 250 and done.finish_reason == "length"
    assert proc.returncode == 0, out
    assert "paradraft: drained" in out and "tritonserver stopped (0)" in out, out
    time.sleep(0.5)  # the kernel reaps the stopped processes
    assert not [pid for pid in pids if Path(f"/proc/{pid}").exists()]
    assert tritonservers_in(tmp_path) == []
