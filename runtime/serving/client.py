"""A gRPC client of the deployment (stock ``tritonclient``): one completion, streamed or not,
with the speculation stats the server sends along; and stopping a request by id."""

from __future__ import annotations

import queue
import struct
import time
import urllib.request
import uuid
from dataclasses import dataclass

import numpy as np

# the model clients call: one decoupled Python model with TensorRT-LLM's ensemble name and
# tensors (triton_repo/ensemble), so a client's cancellation reaches the running request
MODEL = "ensemble"
# Triton >= 2.49 closes a stream that opened with this header with the error's gRPC status
# code (INVALID_ARGUMENT, UNAVAILABLE, ...) instead of an in-stream error message
STATUS_CODES = {"triton_grpc_error": "true"}


class ServerError(RuntimeError):
    """An error response. ``code``: its gRPC status name (``INVALID_ARGUMENT`` for a bad
    request, ``UNAVAILABLE`` for a full queue: retry later), when the stream carried one."""

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        self.code = code


class LostRequest(RuntimeError):
    """No final response: none came in time, or the stream broke off."""


@dataclass
class Completion:
    text: str
    chunks: list[str]
    acceptance_rate: float
    total_accepted_draft_tokens: int
    total_draft_tokens: int
    first_token_s: float
    chunk_times: list[float]
    chunk_tokens: list[int]  # tokens each response carried (from sequence_length)
    finish_reason: str = ""
    cached_tokens: int = 0  # prompt tokens read from the server's prefix cache


def stream_error(error, status_codes: bool) -> RuntimeError:
    """What a tritonclient stream error means: an in-stream error message is an error
    response; a closed stream is one too when the stream asked for status codes, else the
    request was lost (the connection broke, the server went away)."""
    status = error.status()
    code = status.removeprefix("StatusCode.") if status else None
    if code is None:
        return ServerError(error.message())
    if status_codes and code != "CANCELLED":
        return ServerError(error.message(), code)
    return LostRequest(f"{code}: {error.message()}")


# -- raw protobuf: what a client that sends many requests needs, without tritonclient's
# per-tensor objects and its stream thread ----------------------------------------------------

RAW_DTYPES = {"INT32": np.int32, "FP32": np.float32, "UINT64": np.uint64, "BOOL": np.bool_}


def raw_request(model: str, inputs: dict[str, tuple[str, list]], request_id: str = "",
                outputs: tuple[str, ...] = ()):
    """A ModelInferRequest (``inputs``: name -> (Triton datatype, values), each sent as a
    [1, n] tensor of raw little-endian bytes; ``outputs``: the ones to return, default all),
    with Triton's empty final response on, so a stream always ends with a final flag."""
    from tritonclient.grpc import service_pb2

    request = service_pb2.ModelInferRequest(model_name=model, id=request_id)
    request.parameters["triton_enable_empty_final_response"].bool_param = True
    for name in outputs:
        request.outputs.add(name=name)
    for name, (datatype, values) in inputs.items():
        request.inputs.add(name=name, datatype=datatype, shape=[1, len(values)])
        if datatype == "BYTES":
            raw = b"".join(struct.pack("<I", len(v)) + v for v in values)
        else:
            raw = np.asarray(values, dtype=RAW_DTYPES[datatype]).tobytes()
        request.raw_input_contents.append(raw)
    return request


def raw_outputs(response) -> dict:
    """A ModelInferResponse's outputs: each tensor's first element (BYTES as str)."""
    out = {}
    for tensor, raw in zip(response.outputs, response.raw_output_contents, strict=True):
        if tensor.datatype == "BYTES":
            (n,) = struct.unpack_from("<I", raw) if len(raw) >= 4 else (0,)
            out[tensor.name] = raw[4: 4 + n].decode("utf-8", "replace")
        elif raw:
            out[tensor.name] = np.frombuffer(raw, dtype=tensor.datatype.lower().replace(
                "fp", "float"))[0].item()
    return out


def raw_arrays(response, names: frozenset[str]) -> dict[str, np.ndarray]:
    """A ModelInferResponse's numeric outputs named in ``names``, whole and shaped (the
    batch dimension dropped)."""
    return {tensor.name: np.frombuffer(raw, dtype=tensor.datatype.lower().replace(
        "fp", "float")).reshape(list(tensor.shape)[1:])
        for tensor, raw in zip(response.outputs, response.raw_output_contents, strict=True)
        if tensor.name in names}


def is_final(response) -> bool:
    return response.parameters["triton_final_response"].bool_param


def answers(url: str) -> bool:
    """Whether ``url`` answers 200 now (a health or readiness probe)."""
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def stop_request(url: str, request_id: str, timeout: float = 60) -> None:
    """End the running or queued request ``request_id`` (TensorRT-LLM's ``stop`` input: the
    same id, on a stream of its own); raises RuntimeError with the server's message if none."""
    import tritonclient.grpc as grpcclient

    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    inputs = request_inputs(" ", 1, False)  # the model's required inputs; unused
    stop = grpcclient.InferInput("stop", [1, 1], "BOOL")
    stop.set_data_from_numpy(np.array([[True]]))
    try:
        client.start_stream(callback=lambda result, error: results.put((result, error)),
                            headers=STATUS_CODES)
        client.async_stream_infer(MODEL, [*inputs, stop], request_id=request_id,
                                  enable_empty_final_response=True)
        while True:
            result, error = results.get(timeout=timeout)
            if error is not None:
                raise stream_error(error, True)
            final = result.get_response().parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                return
    finally:
        client.stop_stream()
        client.close()


def request_inputs(prompt: str, max_tokens: int, stream: bool, **optional):
    """tritonclient.grpc InferInput list for the model (shapes with the batch dim 1)."""
    import tritonclient.grpc as grpcclient

    def tensor(name, value, dtype, np_dtype):
        t = grpcclient.InferInput(name, [1, 1], dtype)
        t.set_data_from_numpy(np.array([[value]], dtype=np_dtype))
        return t

    inputs = [tensor("text_input", prompt.encode() if isinstance(prompt, str) else prompt,
                     "BYTES", np.object_),
              tensor("max_tokens", max_tokens, "INT32", np.int32),
              tensor("stream", stream, "BOOL", np.bool_)]
    kinds = {"temperature": ("FP32", np.float32), "top_p": ("FP32", np.float32),
             "random_seed": ("UINT64", np.uint64), "num_draft_tokens": ("INT32", np.int32),
             "end_id": ("INT32", np.int32), "correction_rule": ("BYTES", np.object_),
             "drafter": ("BYTES", np.object_),
             "tau": ("FP32", np.float32), "gamma": ("FP32", np.float32),
             "alpha": ("FP32", np.float32), "epsilon": ("FP32", np.float32),
             "delta": ("FP32", np.float32)}
    for name, value in optional.items():
        if value is None:
            continue
        if name == "stop_words":  # a list of strings: TensorRT-LLM's [1, words] tensor
            words = grpcclient.InferInput(name, [1, len(value)], "BYTES")
            words.set_data_from_numpy(np.array([[w.encode() for w in value]], dtype=np.object_))
            inputs.append(words)
            continue
        if name not in kinds:
            raise ValueError(f"unknown request parameter {name!r}")
        dtype, np_dtype = kinds[name]
        if dtype == "BYTES":
            value = str(value).encode()
        inputs.append(tensor(name, value, dtype, np_dtype))
    return inputs


def complete(url: str, prompt: str, max_tokens: int, stream: bool = True,
             on_text=None, timeout: float = 300, request_id: str = "", client=None,
             status_codes: bool = True, **optional) -> Completion:
    """One completion over gRPC streaming (the API decoupled models need). ``request_id``
    names it for ``stop_request`` (default: a fresh id). ``client``: a ``tritonclient.grpc``
    client to reuse (one stream at a time; the caller closes it), as a load generator keeps
    one per worker instead of a new channel per request. Raises ``ServerError`` for an error
    response (with its gRPC status code unless ``status_codes`` is false) and
    ``LostRequest`` when no final response came (within ``timeout`` seconds of the last one).

    A completion abandoned half-way (a timeout, ``on_text`` raising, Ctrl-C) cancels its
    stream, which frees the request's slot within about 0.1 s."""
    import tritonclient.grpc as grpcclient

    results: queue.Queue = queue.Queue()
    own_client = client is None
    if own_client:
        client = grpcclient.InferenceServerClient(url)
    chunks, times, counts = [], [], []
    stats = (0.0, 0, 0)
    reason = ""
    cached = 0
    request_id = request_id or uuid.uuid4().hex
    ended = False  # a final or an error response came: nothing is left running
    t0 = time.perf_counter()
    try:
        client.start_stream(callback=lambda result, error: results.put((result, error)),
                            headers=STATUS_CODES if status_codes else None)
        client.async_stream_infer(MODEL, request_inputs(prompt, max_tokens, stream, **optional),
                                  request_id=request_id, enable_empty_final_response=True)
        while True:
            try:
                result, error = results.get(timeout=timeout)
            except queue.Empty:
                raise LostRequest(f"no response for {timeout} s") from None
            if error is not None:
                ended = True
                raise stream_error(error, status_codes)
            response = result.get_response()
            final = response.parameters.get("triton_final_response")
            if result.as_numpy("text_output") is not None:
                text = result.as_numpy("text_output").reshape(-1)[0].decode()
                chunks.append(text)
                times.append(time.perf_counter() - t0)
                length = int(result.as_numpy("sequence_length").reshape(-1)[0])
                counts.append(length - sum(counts))
                if result.as_numpy("finish_reason") is not None:  # the final response
                    stats = (float(result.as_numpy("acceptance_rate").reshape(-1)[0]),
                             int(result.as_numpy("total_accepted_draft_tokens").reshape(-1)[0]),
                             int(result.as_numpy("total_draft_tokens").reshape(-1)[0]))
                    reason = result.as_numpy("finish_reason").reshape(-1)[0].decode()
                    if result.as_numpy("cached_tokens") is not None:
                        cached = int(result.as_numpy("cached_tokens").reshape(-1)[0])
                if on_text is not None:
                    on_text(text)
            if final is not None and final.bool_param:
                ended = True
                break
    finally:
        client.stop_stream(cancel_requests=not ended)  # the server drops a cancelled request
        if own_client:
            client.close()
    return Completion("".join(chunks), chunks, *stats,
                      first_token_s=times[0] if times else 0.0, chunk_times=times,
                      chunk_tokens=counts, finish_reason=reason, cached_tokens=cached)
