"""Generated requests against real servers on 127.0.0.1 (the tiny demo models): schemathesis
reads the OpenAI API's own ``/openapi.json`` and sends bodies that conform to it and bodies that
do not; hypothesis builds Triton requests for stock tritonclient with wrong dtypes, shapes,
sizes and bytes. What must hold: no 5xx / INTERNAL for anything the client got wrong, every
4xx names the field, a schema-valid body is refused only for the server's own limits, and a
well-formed request is served between every two fuzzed ones.

``PARADRAFT_FUZZ_EXAMPLES`` sets the examples per operation and mode (CI's short run; ``make
fuzz`` runs the long one)."""

import os
import queue
import re

import numpy as np
import pytest
from test_openai import api  # noqa: F401  (the module's server: a fixture)

from paradraft.runtime.serving.server import stub_pids

schemathesis = pytest.importorskip("schemathesis")
requests = pytest.importorskip("requests")
grpcclient = pytest.importorskip("tritonclient.grpc")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

EXAMPLES = int(os.environ.get("PARADRAFT_FUZZ_EXAMPLES", "25"))
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance, negative_data_rejection]
# a schema-valid body may still be refused for what the schema cannot know: the prompt's
# length against max_seq_len, names the server resolves (drafter, correction rule) and
# limits of its configuration (num_draft_tokens against --k, n against its slots and queue),
# fields that need another (stream_options without stream, top_logprobs without logprobs,
# tool_choice naming a function tools lack) and tools whose schemas do not compile or whose
# names repeat
SERVER_LIMITS = {"stream_options", "prompt", "messages", "max_tokens", "max_completion_tokens",
                 "drafter", "correction_rule", "num_draft_tokens", "n", "top_logprobs",
                 "tools", "tool_choice", "response_format"}


def fuzz_settings(examples: int = EXAMPLES):
    return settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                    phases=[Phase.generate], suppress_health_check=list(HealthCheck))


def still_serving(session, base: str) -> None:
    reply = session.post(f"{base}/v1/completions", timeout=60,
                         json={"model": "paradraft", "prompt": "def f():", "max_tokens": 2})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 2


def fuzz_operation(op, mode, base: str, session, statuses: dict) -> None:
    """Send ``op`` the bodies schemathesis generates in ``mode``; check each reply."""
    positive = mode is GenerationMode.POSITIVE

    @fuzz_settings()
    @given(case=op.as_strategy(generation_mode=mode))
    def send(case):
        if isinstance(case.body, dict) and positive:
            # a few tokens each (unset, chat runs to max_seq_len): the fuzzing is of the
            # request, not of decoding
            name = "max_tokens" if case.body.get("max_completion_tokens") is None else \
                "max_completion_tokens"
            case.body[name] = min(case.body.get(name) or 4, 4)
        response = case.call(base_url=base, session=session, timeout=120)
        case.validate_response(response, checks=CHECKS)
        statuses.setdefault((op.path, mode.value), set()).add(response.status_code)
        if 400 <= response.status_code < 500:
            error = response.json()["error"]
            if error["param"] is not None:  # None: the body is not a JSON object
                assert error["param"] in error["message"], error
            if positive and response.status_code == 400:
                assert error["param"] in SERVER_LIMITS, (repr(case.body.get(error["param"])), error)
        still_serving(session, base)

    send()


def test_generated_openai_requests_get_named_4xx_and_never_a_5xx(api):  # noqa: F811
    server = api[0]
    base = f"http://{server.config.host}:{server.config.port}"
    schema = schemathesis.openapi.from_url(f"{base}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {(op.method.upper(), op.path) for op in operations} == {
        ("GET", "/health"), ("GET", "/v1/models"), ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions")}
    session = requests.Session()
    statuses: dict[tuple[str, str], set[int]] = {}
    for op in operations:
        for mode in GenerationMode:
            if op.method.upper() == "GET" and mode is GenerationMode.NEGATIVE:
                continue  # no parameters: nothing to get wrong
            fuzz_operation(op, mode, base, session, statuses)
    triton = api[1]
    assert stub_pids(triton.process.pid) == triton.stubs  # no model instance restarted
    for path in ("/v1/completions", "/v1/chat/completions"):
        # both kinds were reached: bodies the server ran, and bodies it refused
        assert 200 in statuses[(path, "positive")], statuses
        assert statuses[(path, "negative")] <= {400, 404, 422}, statuses


# -- Triton over gRPC ---------------------------------------------------------------------------

# the model's inputs (triton_repo/ensemble/config.pbtxt) and their types
EXPECTED = {"max_tokens": "INT32", "input_ids": "INT32", "input_lengths": "INT32",
            "text_input": "BYTES", "stream": "BOOL", "temperature": "FP32", "top_p": "FP32",
            "random_seed": "UINT64", "num_draft_tokens": "INT32", "drafter": "BYTES",
            "end_id": "INT32", "correction_rule": "BYTES", "tau": "FP32",
            "stop_words": "BYTES", "stop_words_ids": "INT32", "top_k": "INT32",
            "beam_width": "INT32", "not_an_input": "INT32"}
NUMPY = {"INT32": np.int32, "INT64": np.int64, "FP32": np.float32, "BYTES": np.object_,
         "BOOL": np.bool_, "UINT8": np.uint8, "UINT64": np.uint64}


def values(dtype: str, size: int):
    if dtype == "BYTES":  # text, or bytes that are not UTF-8
        return st.lists(st.one_of(st.text(max_size=6).map(str.encode), st.binary(max_size=6)),
                        min_size=size, max_size=size)
    if dtype == "BOOL":
        return st.lists(st.booleans(), min_size=size, max_size=size)
    if dtype == "FP32":
        return st.lists(st.floats(width=32), min_size=size, max_size=size)
    info = np.iinfo(NUMPY[dtype])
    small = st.integers(max(info.min, -3), 40)
    return st.lists(st.one_of(small, st.integers(int(info.min), int(info.max))),
                    min_size=size, max_size=size)


@st.composite
def tensors(draw, name: str):
    """One input: mostly of its own type and shape [1, n], sometimes not."""
    right = EXPECTED[name]
    dtype = draw(st.sampled_from([right] * 4 + [d for d in NUMPY if d != right]))
    shape = draw(st.sampled_from([[1, 1]] * 4 + [[1, 0], [1, 3], [2, 1], [1], [1, 4096]]))
    data = draw(values(dtype, int(np.prod(shape))))
    return name, dtype, np.array(data, dtype=NUMPY[dtype]).reshape(shape)


@st.composite
def triton_requests(draw):
    names = draw(st.lists(st.sampled_from(sorted(set(EXPECTED) - {"max_tokens"})),
                          max_size=3, unique=True))
    if draw(st.integers(0, 9)):  # the one required input, nearly always
        names.append("max_tokens")
    return [draw(tensors(name)) for name in names]


def stream_once(url: str, inputs: list, timeout: float = 120) -> str:
    """Send one request on a stream of its own (the status-code header on, as our clients
    send it); its gRPC status name once its final response or its error came."""
    from paradraft.runtime.serving.client import MODEL, STATUS_CODES

    replies: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(lambda result, error: replies.put((result, error)),
                        headers=STATUS_CODES)
    try:
        client.async_stream_infer(MODEL, inputs, enable_empty_final_response=True)
        while True:
            result, error = replies.get(timeout=timeout)
            if error is not None:
                message = error.message() or ""
                # a Python exception's name or stack would be our bug reaching the client
                assert not re.search(r"Traceback|Exception|\w+Error\b", message), message
                return (error.status() or f"in-stream error: {message}").removeprefix(
                    "StatusCode.")
            if result.get_response().parameters["triton_final_response"].bool_param:
                return "OK"
    finally:
        client.stop_stream()  # the request has ended: nothing to cancel
        client.close()


def test_generated_triton_requests_get_invalid_argument_never_internal(api):  # noqa: F811
    triton = api[1]
    session = requests.Session()
    base = f"http://{api[0].config.host}:{api[0].config.port}"
    codes: set[str] = set()

    @fuzz_settings()
    @given(triton_requests())
    def send(fields):
        inputs = []
        for name, dtype, data in fields:
            tensor = grpcclient.InferInput(name, list(data.shape), dtype)
            tensor.set_data_from_numpy(data)
            inputs.append(tensor)
        code = stream_once(triton.grpc_url, inputs)
        codes.add(code)
        # the client's mistake is the client's: never INTERNAL / UNKNOWN. Triton's own checks
        # (dtypes, shapes, unknown inputs) answer in the stream, without a status
        assert code in ("OK", "INVALID_ARGUMENT") or code.startswith("in-stream error"), (
            code, fields)
        still_serving(session, base)

    send()
    assert "INVALID_ARGUMENT" in codes, codes
    assert stub_pids(triton.process.pid) == triton.stubs  # no model instance restarted
