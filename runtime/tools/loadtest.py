"""``paradraft loadtest``: bounded-concurrency streaming against a running server.

For each concurrency level a fixed number of requests is sent by that many client threads
(each sends its next request when the previous one finished), so the run stops by itself.
Four protocols: ``grpc`` (the ``ensemble`` model over a gRPC stream, what TensorRT-LLM's
clients use), ``http`` (its ``generate_stream`` server-sent events), ``openai``
(``/v1/completions`` streamed) and ``chat`` (``/v1/chat/completions`` streamed, greedy, a new
connection per request: what ``--peer llama-server`` drives both servers with). Reports output
tokens/s, time to first token and inter-token latency (p50/p90/p99), errors (error
responses), lost requests (no final response: none came in time, or the stream broke off),
acceptance and the prompt tokens the server reported as cached. ``run_multiturn`` sends
conversations whose every turn resends the history. The in-process reference (``run_reference``)
runs the same prompts through the same scheduler and decoder in this process, with no
serving at all, so served / in-process is the serving overhead. Ratios between levels come
from one run against one server; with ``repeats`` > 1 the levels are run in turn (c1, c4, …
c1, c4, …) so a slow spell of a shared machine hits every level alike, and the reported
ratio is the median of the per-repeat ratios.
"""

from __future__ import annotations

import http.client
import json
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from tqdm import tqdm

from ..grammar import response_format_guide
from ..serving.client import (
    MODEL,
    Completion,
    LostRequest,
    ServerError,
    is_final,
    raw_outputs,
    raw_request,
)
from . import humaneval

PROTOCOLS = ("grpc", "http", "openai", "chat")
REFERENCE = "in-process"
WORKLOADS = ("single", "multiturn")
# the follow-up user turns of the multiturn workload, one {"messages": [...]} a line
FOLLOWUPS = Path(__file__).resolve().parents[2] / "prompts" / "multiturn_followups.jsonl"


@dataclass
class LevelResult:
    concurrency: int
    repeat: int
    requests: int
    answered: int
    errors: int
    lost: int
    output_tokens: int
    seconds: float
    tokens_per_second: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    acceptance_rate: float
    # CPU the load generator itself used (all its threads) per second of the level: on a
    # machine it shares with the server, this much compute was not the server's
    client_cpu_share: float
    error_messages: list[str]
    protocol: str = "grpc"  # or http, openai, chat, in-process (the reference)
    ttft_p90_ms: float = 0.0
    itl_p90_ms: float = 0.0
    # prompt tokens the server reported as read from its cache, summed over the requests
    cached_tokens: int = 0
    prompt_tokens: int = 0
    system: str = "ours"  # or the peer's name (llama-server)
    variant: str = "default"  # the request variant (ours) or the server variant (the peer)
    workload: str = "single"  # or multiturn
    # multiturn: per turn number, {"turn", "requests", "ttft_p50_ms", "cached_tokens", ...}
    per_turn: list[dict] = field(default_factory=list)
    # answers to requests with a JSON response_format, and how many of them validate
    constrained: int = 0
    schema_valid: int = 0


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))]


# -- one streamed request per protocol: each returns a Completion or raises ServerError (an
# error response) or LostRequest (no final response) ----------------------------------------

def sse_events(response: http.client.HTTPResponse):
    """The JSON payloads of a server-sent event stream (``data: [DONE]`` as None)."""
    for raw in response:
        line = raw.decode().strip()
        if line.startswith("data: "):
            data = line[len("data: "):]
            yield None if data == "[DONE]" else json.loads(data)


def http_stream(conn: http.client.HTTPConnection, path: str, body: dict, timeout: float):
    """POST ``body`` and return the open response; an error status is an error response."""
    conn.timeout = timeout
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
    except (OSError, http.client.HTTPException) as e:
        conn.close()  # the next request reconnects
        raise LostRequest(f"{type(e).__name__}: {e}") from None
    if response.status != 200:
        message = response.read().decode(errors="replace")[:300]
        raise ServerError(f"HTTP {response.status}: {message}", str(response.status))
    return response


def drain(conn: http.client.HTTPConnection, response: http.client.HTTPResponse) -> None:
    """Read the stream to its end, so that the keep-alive connection takes the next request."""
    try:
        response.read()
    except (OSError, http.client.HTTPException):
        conn.close()


def triton_http(conn: http.client.HTTPConnection, prompt: str, max_tokens: int,
                timeout: float) -> Completion:
    """Triton's ``generate_stream`` on the served model: one event per response; the final
    one carries a finish_reason."""
    t0 = time.perf_counter()
    response = http_stream(conn, f"/v2/models/{MODEL}/generate_stream",
                           {"text_input": prompt, "max_tokens": max_tokens, "stream": True},
                           timeout)
    chunks, times, counts, last = [], [], [], {}
    try:
        for event in sse_events(response):
            if event is None:
                continue
            if "error" in event:
                drain(conn, response)
                raise ServerError(event["error"])
            last = event
            chunks.append(event["text_output"])
            times.append(time.perf_counter() - t0)
            counts.append(event["sequence_length"] - sum(counts))
            if event.get("finish_reason"):
                break
        drain(conn, response)
    except (OSError, http.client.HTTPException, ValueError) as e:
        conn.close()
        raise LostRequest(f"{type(e).__name__}: {e}") from None
    if not last.get("finish_reason"):
        conn.close()
        raise LostRequest("the stream ended without a final response")
    return Completion("".join(chunks), chunks, last["acceptance_rate"],
                      last["total_accepted_draft_tokens"], last["total_draft_tokens"],
                      times[0], times, counts, last["finish_reason"])


def read_openai_stream(conn: http.client.HTTPConnection, response, t0: float,
                       text_of: Callable[[dict], str | None]
                       ) -> tuple[list[str], list[float], str, dict, dict, dict]:
    """An OpenAI-style SSE stream to its end: (texts, their arrival seconds after ``t0``,
    finish_reason, usage, our ``paradraft`` object, llama-server's ``timings``).
    ``text_of``: a choice's text (completions: ``text``; chat: ``delta.content``). Raises
    ServerError for an error event, LostRequest for a stream with no final chunk."""
    chunks, times, done, reason, usage, stats, timings = [], [], False, "", None, {}, {}
    try:
        for event in sse_events(response):
            if event is None:
                done = True
                break
            if "error" in event:
                drain(conn, response)
                error = event["error"]
                raise ServerError(error.get("message", str(event)) if isinstance(
                    error, dict) else str(error))
            for choice in event.get("choices", []):
                text = text_of(choice)
                if text:
                    chunks.append(text)
                    times.append(time.perf_counter() - t0)
                reason = choice.get("finish_reason") or reason
            usage = event.get("usage") or usage
            stats = event.get("paradraft") or stats
            timings = event.get("timings") or timings
        drain(conn, response)
    except (OSError, http.client.HTTPException, ValueError) as e:
        conn.close()
        raise LostRequest(f"{type(e).__name__}: {e}") from None
    if not done or not reason or usage is None:
        conn.close()
        raise LostRequest("the stream ended without a final response")
    return chunks, times, reason, usage, stats, timings


def openai_http(conn: http.client.HTTPConnection, prompt: str, max_tokens: int,
                timeout: float, model: str = "paradraft", extra: dict | None = None
                ) -> Completion:
    """``/v1/completions`` streamed, with the usage chunk. Chunks carry no token counts, so
    each chunk's share of the completion tokens is taken as equal (for the ITL only).
    ``extra``: more body fields (a request variant: ``num_draft_tokens``, ``drafter``)."""
    t0 = time.perf_counter()
    response = http_stream(conn, "/v1/completions", {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
        "stream_options": {"include_usage": True}, **(extra or {})}, timeout)
    chunks, times, reason, usage, stats, _ = read_openai_stream(
        conn, response, t0, lambda choice: choice.get("text"))
    counts = even_counts(usage["completion_tokens"], len(chunks))
    return Completion("".join(chunks), chunks, stats.get("acceptance_rate", 0.0),
                      stats.get("accepted_draft_tokens", 0), stats.get("draft_tokens", 0),
                      times[0] if times else 0.0, times, counts, reason)


def even_counts(tokens: int, chunks: int) -> list[int]:
    """``tokens`` spread over ``chunks`` as evenly as whole tokens allow."""
    return [tokens // chunks + (i < tokens % chunks) for i in range(chunks)]


@dataclass
class ChatCompletion(Completion):
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the server read from its cache


def cached_prompt_tokens(usage: dict | None, timings: dict | None) -> int:
    """The prompt tokens a server reports as cached: OpenAI's
    ``usage.prompt_tokens_details.cached_tokens`` (ours, and llama-server's), else
    llama-server's own ``timings.cache_n``."""
    details = (usage or {}).get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        return int(details["cached_tokens"])
    return int((timings or {}).get("cache_n", 0))


def chat_body(messages: list[dict], max_tokens: int, model: str, extra: dict | None) -> dict:
    """A greedy streamed chat request that asks for the usage chunk."""
    return {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, **(extra or {})}


def openai_chat(conn: http.client.HTTPConnection, messages: list[dict], max_tokens: int,
                timeout: float, model: str = "paradraft", extra: dict | None = None
                ) -> ChatCompletion:
    """``/v1/chat/completions`` streamed (``chat_body``). A chunk's text is its
    ``delta.content``; as with ``openai_http``, the completion tokens are spread evenly over
    the chunks that carried text. Draft statistics come from our ``paradraft`` object or
    llama-server's ``timings`` (``draft_n``, ``draft_n_accepted``)."""
    t0 = time.perf_counter()
    response = http_stream(conn, "/v1/chat/completions",
                           chat_body(messages, max_tokens, model, extra), timeout)
    chunks, times, reason, usage, stats, timings = read_openai_stream(
        conn, response, t0, lambda choice: (choice.get("delta") or {}).get("content"))
    drafted = stats.get("draft_tokens", timings.get("draft_n", 0))
    accepted = stats.get("accepted_draft_tokens", timings.get("draft_n_accepted", 0))
    return ChatCompletion(
        "".join(chunks), chunks, accepted / drafted if drafted else 0.0, accepted, drafted,
        times[0] if times else 0.0, times,
        even_counts(usage["completion_tokens"], len(chunks)) if chunks else [], reason,
        prompt_tokens=usage.get("prompt_tokens", 0),
        cached_tokens=cached_prompt_tokens(usage, timings))


def grpc_stream(stub, prompt: str, max_tokens: int, timeout: float) -> Completion:
    """The served model over one gRPC stream, read in this thread from the raw protobuf (no
    tritonclient result objects, no stream thread: the load generator shares the server's
    cores). No status-code header, so an error response arrives in the stream and a broken
    stream (an RPC error, or no final response within ``timeout`` seconds) is a lost request."""
    import grpc

    request = raw_request(MODEL, {"text_input": ("BYTES", [prompt.encode()]),
                                  "max_tokens": ("INT32", [max_tokens]),
                                  "stream": ("BOOL", [True])})
    t0 = time.perf_counter()
    chunks, times, counts, last = [], [], [], {}
    final = False
    try:
        # read to the end of the stream, which the server closes after the final response:
        # leaving it earlier cancels the RPC after it completed, which Triton 2.51's gRPC
        # frontend mishandles (an ensemble request cancelled that late was never released)
        for response in stub.ModelStreamInfer(iter([request]), timeout=timeout):
            if response.error_message:
                raise ServerError(response.error_message)
            out = raw_outputs(response.infer_response)
            if "text_output" in out:
                last = out
                chunks.append(out["text_output"])
                times.append(time.perf_counter() - t0)
                counts.append(out["sequence_length"] - sum(counts))
            final = final or is_final(response.infer_response)
    except grpc.RpcError as e:
        raise LostRequest(f"{e.code()}: {e.details()}") from None
    if not final or not last.get("finish_reason"):
        raise LostRequest("the stream ended without a final response")
    return Completion("".join(chunks), chunks, last["acceptance_rate"],
                      last["total_accepted_draft_tokens"], last["total_draft_tokens"],
                      times[0], times, counts, last["finish_reason"])


def requester(protocol: str, url: str, timeout: float, model: str = "paradraft",
              extra: dict | None = None) -> tuple[Callable, Callable]:
    """(send(prompt, max_tokens) -> Completion, close) for one worker: one channel or
    keep-alive connection per worker, reused by its requests (as perf_analyzer does): a new
    one per request is client CPU taken from a server on the same cores. ``chat`` (a prompt
    is a list of messages) is the exception: a new connection per request, because
    llama-server's keep-alive breaks some clients, and ours gets the same for fairness.
    ``extra``: more body fields of every request (openai, chat)."""
    if protocol == "grpc":
        import grpc
        from tritonclient.grpc import service_pb2_grpc

        channel = grpc.insecure_channel(url)
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        return (lambda prompt, n: grpc_stream(stub, prompt, n, timeout)), channel.close
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {', '.join(PROTOCOLS)}; got {protocol!r}")
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if protocol == "chat":
        def send(messages: list[dict], n: int, fields: dict | None = None) -> ChatCompletion:
            conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
            try:
                return openai_chat(conn, messages, n, timeout, model, {**(extra or {}),
                                                                       **(fields or {})})
            finally:
                conn.close()

        return send, lambda: None
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    if protocol == "http":
        return (lambda prompt, n: triton_http(conn, prompt, n, timeout)), conn.close
    return (lambda prompt, n: openai_http(conn, prompt, n, timeout, model, extra)), conn.close


def level_result(results: list[Completion], errors: list[str], lost: list[str], requests: int,
                 concurrency: int, repeat: int, seconds: float, client_cpu: float,
                 protocol: str) -> LevelResult:
    tokens = sum(sum(r.chunk_tokens) for r in results)
    ttft = [r.first_token_s * 1e3 for r in results]
    # inter-token latency: each gap between responses spread over the tokens it delivered
    itl = []
    for r in results:
        for gap, n in zip(
            [b - a for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False)],
            r.chunk_tokens[1:], strict=True,
        ):
            itl += [gap * 1e3 / n] * n if n else []
    drafted = sum(r.total_draft_tokens for r in results)
    accepted = sum(r.total_accepted_draft_tokens for r in results)
    return LevelResult(
        concurrency=concurrency, repeat=repeat, requests=requests,
        answered=len(results) + len(errors), errors=len(errors), lost=len(lost),
        output_tokens=tokens, seconds=seconds, tokens_per_second=tokens / seconds,
        ttft_p50_ms=percentile(ttft, 50), ttft_p99_ms=percentile(ttft, 99),
        itl_p50_ms=percentile(itl, 50), itl_p99_ms=percentile(itl, 99),
        acceptance_rate=accepted / drafted if drafted else 0.0,
        client_cpu_share=client_cpu / seconds,
        error_messages=sorted(set(errors + lost))[:5], protocol=protocol,
        ttft_p90_ms=percentile(ttft, 90), itl_p90_ms=percentile(itl, 90),
        cached_tokens=sum(getattr(r, "cached_tokens", 0) for r in results),
        prompt_tokens=sum(getattr(r, "prompt_tokens", 0) for r in results),
    )


def run_workers(concurrency: int, requests: int, work: Callable[[int], None],
                progress: tqdm | None) -> tuple[float, float]:
    """``work(i)`` for i in 0..requests-1 over ``concurrency`` threads; (seconds, CPU)."""
    jobs = list(range(requests))
    lock = threading.Lock()

    def worker():
        while True:
            with lock:
                if not jobs:
                    return
                i = jobs.pop()
            work(i)
            if progress is not None:
                progress.update(1)

    t0, cpu0 = time.perf_counter(), time.process_time()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, time.process_time() - cpu0


def run_level(url: str, prompts: list, concurrency: int, requests: int, max_tokens: int,
              progress: tqdm | None = None, repeat: int = 0, protocol: str = "grpc",
              timeout: float = 300, model: str = "paradraft", extra: dict | None = None,
              formats: list[dict | None] | None = None) -> LevelResult:
    """``requests`` requests over ``concurrency`` workers; ``prompts``: strings, or (chat)
    message lists; ``extra``: more body fields of every request (openai, chat); ``formats``
    (chat): each prompt's ``response_format`` or None, its answers checked against it."""
    lock = threading.Lock()
    results, errors, lost, answers = [], [], [], []
    local = threading.local()
    senders: list[Callable] = []

    def work(i: int) -> None:
        if not hasattr(local, "send"):
            local.send, close = requester(protocol, url, timeout, model, extra)
            with lock:
                senders.append(close)
        response_format = formats[i % len(formats)] if formats else None
        try:
            if response_format is None:
                r = local.send(prompts[i % len(prompts)], max_tokens)
            else:
                r = local.send(prompts[i % len(prompts)], max_tokens,
                               {"response_format": response_format})
            schema = schema_of(response_format)
            with lock:
                results.append(r)
                if schema is not None:
                    answers.append((r.text, schema))
        except ServerError as e:  # counted, never raised: the run must finish
            with lock:
                errors.append(str(e)[:200])
        except Exception as e:  # LostRequest, or a client that broke: no final response
            with lock:
                lost.append(f"lost: {type(e).__name__}: {str(e)[:170]}")

    try:
        seconds, cpu = run_workers(concurrency, requests, work, progress)
    finally:
        for close in senders:
            close()
    level = level_result(results, errors, lost, requests, concurrency, repeat, seconds, cpu,
                         protocol)
    level.constrained, level.schema_valid = len(answers), valid_answers(answers)
    return level


# -- chat requests and the multiturn workload ---------------------------------------------

def read_chat_lines(spec: str | Path) -> list[tuple[list[dict], dict | None]]:
    """(messages, response_format or None) of each line of a JSONL file, one ``{"messages":
    [...]}`` a line, optionally with OpenAI's ``"response_format"`` (sent as it is; blank
    lines skipped; a bad line, or another field, refused naming its number), or of
    ``humaneval[:N]``: the first N HumanEval problems as chat requests (``humaneval.py``)."""
    count = humaneval.parse_spec(str(spec))
    if count is not False:
        return [(humaneval.chat_request(p)["messages"], None) for p in humaneval.problems(count)]
    out = []
    for number, line in enumerate(Path(spec).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            request = json.loads(line)
        except json.JSONDecodeError:
            request = None
        messages = request.get("messages") if isinstance(request, dict) else None
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str) for m in messages):
            raise ValueError(f"{spec}, line {number}: a chat request is an object "
                             '{"messages": [{"role": ..., "content": ...}, ...]}')
        extra = sorted(set(request) - {"messages", "response_format"})
        if extra:
            raise ValueError(f"{spec}, line {number}: {', '.join(extra)}: a chat request "
                             "carries only 'messages' and optionally 'response_format'")
        response_format = request.get("response_format")
        if response_format is not None and not isinstance(response_format, dict):
            raise ValueError(f"{spec}, line {number}: response_format must be an object")
        try:
            schema_of(response_format)
        except ValueError as e:
            raise ValueError(f"{spec}, line {number}: {e}") from None
        out.append((messages, response_format))
    if not out:
        raise ValueError(f"{spec}: no chat requests (one JSON object per line)")
    return out


def read_chat_requests(spec: str | Path) -> list[list[dict]]:
    """The message lists of ``read_chat_lines``; a line with a ``response_format`` is
    refused (the multiturn follow-ups, which carry only messages)."""
    lines = read_chat_lines(spec)
    for number, (_, response_format) in enumerate(lines, 1):
        if response_format is not None:
            raise ValueError(f"{spec}, request {number}: response_format: not taken here")
    return [messages for messages, _ in lines]


def schema_of(response_format: dict | None) -> dict | None:
    """The JSON schema an answer must follow, read as the server reads it
    (``grammar.response_format_guide``): ``json_schema``'s schema, any JSON object for
    ``json_object``, None for text or no response_format."""
    guide = response_format_guide(response_format)
    if guide is None:
        return None
    return json.loads(guide.text) if guide.kind == "json_schema" else {"type": "object"}


def valid_answers(answers: list[tuple[str, dict]]) -> int:
    """How many of (text, schema) answers parse as JSON and validate against their
    schema (``jsonschema``, a dev dependency: refused by name where it is missing)."""
    if not answers:
        return 0
    try:
        import jsonschema
    except ImportError:
        raise RuntimeError("response_format: checking the answers against their schemas "
                           "needs jsonschema (pip install -e '.[dev]')") from None
    valid = 0
    for text, schema in answers:
        try:
            jsonschema.validate(json.loads(text), schema)
        except (json.JSONDecodeError, jsonschema.ValidationError):
            continue
        valid += 1
    return valid


def turn_stats(turn: int, done: list[Completion], failed: int) -> dict:
    ttft = [r.first_token_s * 1e3 for r in done]
    return {"turn": turn, "requests": len(done) + failed, "answered": len(done),
            "ttft_p50_ms": percentile(ttft, 50), "ttft_p90_ms": percentile(ttft, 90),
            "cached_tokens": sum(getattr(r, "cached_tokens", 0) for r in done),
            "prompt_tokens": sum(getattr(r, "prompt_tokens", 0) for r in done)}


def run_multiturn(url: str, openers: list[list[dict]], followups: list[list[dict]],
                  conversations: int, concurrency: int, max_tokens: int,
                  progress: tqdm | None = None, repeat: int = 0, timeout: float = 300,
                  model: str = "paradraft", extra: dict | None = None) -> LevelResult:
    """``conversations`` chats over the ``chat`` protocol, ``concurrency`` at a time, each
    one of its turns after another: turn 1 is ``openers[i % len(openers)]``, turn t + 1
    resends the whole history, the answer to turn t as the assistant's message, and
    ``followups[t - 1]``. A failed turn ends its conversation; its later turns count as lost
    (never sent). The result is over all turns, with ``per_turn`` statistics."""
    turns = 1 + len(followups)
    lock = threading.Lock()
    done: dict[int, list[Completion]] = {t: [] for t in range(1, turns + 1)}
    failed = dict.fromkeys(done, 0)
    errors, lost = [], []

    def converse(i: int) -> None:
        send, _ = requester("chat", url, timeout, model, extra)
        history = list(openers[i % len(openers)])
        for turn in range(1, turns + 1):
            try:
                r = send(history, max_tokens)
            except Exception as e:  # ServerError (counted as an error) or a lost request
                with lock:
                    (errors if isinstance(e, ServerError) else lost).append(
                        f"turn {turn}: {type(e).__name__}: {str(e)[:170]}")
                    failed[turn] += 1
                    for later in range(turn + 1, turns + 1):
                        lost.append(f"lost: turn {later} not sent: turn {turn} failed")
                        failed[later] += 1
                return
            with lock:
                done[turn].append(r)
            if turn < turns:
                history = [*history, {"role": "assistant", "content": r.text},
                           *followups[turn - 1]]

    seconds, cpu = run_workers(concurrency, conversations, converse, progress)
    results = [r for t in done for r in done[t]]
    level = level_result(results, errors, lost, conversations * turns, concurrency, repeat,
                         seconds, cpu, "chat")
    level.workload = "multiturn"
    level.per_turn = [turn_stats(t, done[t], failed[t]) for t in done]
    return level


# -- request variants on one server, and a chat run over them ----------------------------

VARIANTS = ("default", "plain", "ngram")


def request_variant(name: str, max_k: int | None = None) -> dict:
    """The body fields of one of our request variants: ``default`` (the server's own
    settings), ``plain`` (``num_draft_tokens`` 0: no speculation), ``ngram`` (the n-gram
    lookup drafter) or ``ngram:K`` (that drafter, ``num_draft_tokens`` K, at most ``max_k``,
    the server's --k, when it is known)."""
    kind, _, k = name.partition(":")
    if kind not in VARIANTS or (k and kind != "ngram"):
        raise ValueError(f"variants: {name!r} is not one of default, plain, ngram, ngram:K")
    if kind == "default":
        return {}
    if kind == "plain":
        return {"num_draft_tokens": 0}
    if not k:
        return {"drafter": "ngram"}
    high = max_k if max_k is not None else 64
    if not k.isdigit() or not 1 <= int(k) <= high:
        raise ValueError(f"variants: {name!r}: K must be an integer in [1, {high}]"
                         + (" (the server's --k)" if max_k is not None else ""))
    return {"drafter": "ngram", "num_draft_tokens": int(k)}


def parse_variants(text: str, max_k: int | None = None) -> dict[str, dict]:
    """``default,plain,ngram:16`` → {name: body fields}, in order."""
    names = [t.strip() for t in text.split(",")]
    if len(set(names)) != len(names):
        raise ValueError(f"variants: each variant once; got {text!r}")
    return {name: request_variant(name, max_k) for name in names}


@dataclass
class ChatLoad:
    """What one chat run sends: ``openers`` (each request's messages, or each
    conversation's first turn), ``followups`` (multiturn: the later user turns) and how."""

    openers: list[list[dict]]
    levels: list[int]
    max_tokens: int
    requests: int = 32  # per level (single)
    conversations: int = 8  # per level (multiturn)
    followups: list[list[dict]] = field(default_factory=list)
    workload: str = "single"
    repeats: int = 1
    timeout: float = 300
    model: str = "paradraft"
    # single workload: each opener's response_format (None: text), its answers validated
    formats: list[dict | None] = field(default_factory=list)


def run_chat_load(url: str, system: str, variants: dict[str, dict], load: ChatLoad
                  ) -> list[LevelResult]:
    """Every level ``load.repeats`` times, the levels in turn, and at each level every
    variant (``{name: body fields}``) in turn, so a slow spell hits them alike; after one
    warm-up request. Multiturn: each run's conversations open with the next openers, so
    with enough of them no run's first turn repeats an earlier run's prompt. Results in run
    order, labelled with ``system`` and the variant."""
    send, _ = requester("chat", url, load.timeout, load.model)
    send(load.openers[0], 4)  # warm-up
    per_run = load.conversations if load.workload == "multiturn" else load.requests
    runs = len(load.levels) * load.repeats * len(variants)
    out = []
    with tqdm(total=per_run * runs, desc=f"loadtest {system}", unit="req") as bar:
        for r in range(load.repeats):
            for c in load.levels:
                for name, extra in variants.items():
                    if load.workload == "multiturn":
                        first = len(out) * load.conversations
                        openers = [load.openers[(first + i) % len(load.openers)]
                                   for i in range(len(load.openers))]
                        level = run_multiturn(url, openers, load.followups,
                                              load.conversations, c, load.max_tokens, bar, r,
                                              load.timeout, load.model, extra)
                    else:
                        level = run_level(url, load.openers, c, load.requests,
                                          load.max_tokens, bar, r, "chat", load.timeout,
                                          load.model, extra, load.formats)
                    level.system, level.variant = system, name
                    out.append(level)
    return out


def run_reference(scheduler, tokenizer, params, eos_token_id, prompts: list[str],
                  concurrency: int, requests: int, max_tokens: int, repeat: int = 0,
                  progress: tqdm | None = None) -> LevelResult:
    """The same prompts through ``scheduler`` (``protocol.build_scheduler`` with the server's
    settings; ``params``: its default rule parameters) in this process: the same decoder
    and batching, no Triton, no IPC, no network. Tokens come back through the scheduler's
    callbacks, as the server's do."""
    from ..scheduler import Request

    results: list[Completion] = []
    lock = threading.Lock()

    def work(i: int) -> None:
        done = threading.Event()
        t0 = time.perf_counter()
        times, counts = [], []

        def on_tokens(new):
            times.append(time.perf_counter() - t0)
            counts.append(len(new))

        def on_done(stats, error):
            if stats is not None:
                with lock:
                    results.append(Completion("", [], stats.acceptance_rate,
                                              stats.accepted_tokens, stats.draft_tokens,
                                              times[0] if times else 0.0, times, counts))
            done.set()

        ids = tokenizer.encode(prompts[i % len(prompts)]).ids
        scheduler.submit(Request(ids, max_tokens, params, on_tokens, on_done,
                                 eos_token_id=eos_token_id))
        done.wait()

    seconds, cpu = run_workers(concurrency, requests, work, progress)
    return level_result(results, [], [], requests, concurrency, repeat, seconds, cpu,
                        REFERENCE)


# the reference runs in a process of its own, started in a new session like tritonserver: on
# a shared machine the kernel gives each session (autogroup) a fair share of the CPU, so a
# reference inside the load generator's session would get less than the server and make
# serving look cheaper than it is
REFERENCE_ENTRY = ("from paradraft.runtime.tools.loadtest import reference_process_main; "
                   "reference_process_main()")


def reference_process_main() -> None:
    """The reference process: one JSON line of settings on stdin, then one line per level to
    run (concurrency, repeat); answers one LevelResult JSON line each."""
    import sys

    from ..checkpoints import load_tokenizer
    from ..serving.protocol import ServeConfig, build_scheduler, default_params

    setup = json.loads(sys.stdin.readline())
    config = ServeConfig(**setup["config"])
    scheduler = build_scheduler(config)
    tokenizer = load_tokenizer(setup["tokenizer_dir"])
    print("ready", flush=True)
    try:
        for line in sys.stdin:
            level = json.loads(line)
            r = run_reference(scheduler, tokenizer, default_params(config), config.eos_token_id,
                              setup["prompts"], level["concurrency"], setup["requests"],
                              setup["max_tokens"], level["repeat"])
            print(json.dumps(asdict(r)), flush=True)
    finally:
        scheduler.stop()


class ReferenceProcess:
    """``run_reference`` with the server's settings (a ``ServeConfig``) in its own process
    and session; call it as run_loadtest's ``reference``."""

    def __init__(self, config, tokenizer_dir: str, prompts: list[str], requests: int,
                 max_tokens: int):
        import subprocess
        import sys

        self.requests = requests
        self.process = subprocess.Popen([sys.executable, "-c", REFERENCE_ENTRY],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True, start_new_session=True)
        self.send({"config": asdict(config), "tokenizer_dir": tokenizer_dir,
                   "prompts": prompts, "requests": requests, "max_tokens": max_tokens})
        if self.process.stdout.readline().strip() != "ready":
            self.stop()
            raise RuntimeError("the in-process reference failed to start (see its stderr)")

    def send(self, message: dict) -> None:
        self.process.stdin.write(json.dumps(message) + "\n")
        self.process.stdin.flush()

    def __call__(self, concurrency: int, repeat: int = 0, progress: tqdm | None = None
                 ) -> LevelResult:
        self.send({"concurrency": concurrency, "repeat": repeat})
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError("the in-process reference exited (see its stderr)")
        if progress is not None:
            progress.update(self.requests)
        return LevelResult(**json.loads(line))

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()  # the reference stops at the end of its input
            try:
                self.process.wait(60)
            except BaseException:
                self.process.kill()
                self.process.wait()


def run_loadtest(url: str, prompts: list[str], levels: list[int], requests: int,
                 max_tokens: int, repeats: int = 1, protocol: str = "grpc",
                 reference: Callable[..., LevelResult] | None = None,
                 timeout: float = 300, model: str = "paradraft") -> list[LevelResult]:
    """Every level ``repeats`` times, the levels in turn; with a ``reference``
    (``reference(concurrency=, repeat=, progress=) -> LevelResult``: ``run_reference`` with
    the rest bound), each served level is followed by its in-process twin, so a slow spell
    hits both alike. Results in run order."""
    send, close = requester(protocol, url, timeout, model)
    try:
        send(prompts[0], 4)  # warm-up
    finally:
        close()
    out = []
    runs = requests * len(levels) * repeats * (2 if reference else 1)
    with tqdm(total=runs, desc="loadtest", unit="req") as bar:
        for r in range(repeats):
            for c in levels:
                out.append(run_level(url, prompts, c, requests, max_tokens, bar, r, protocol,
                                     timeout, model))
                if reference is not None:
                    out.append(reference(concurrency=c, repeat=r, progress=bar))
    return out


def summarize(results: list[LevelResult]) -> dict:
    """Per level: median tokens/s over repeats; per level above the first: the median over
    repeats of its tokens/s over the first level's in the same repeat; with in-process rows,
    per level the median over repeats of served / in-process tokens/s."""
    served = [r for r in results if r.protocol != REFERENCE]
    levels = list(dict.fromkeys(r.concurrency for r in served))
    tps = {c: {r.repeat: r.tokens_per_second for r in served if r.concurrency == c}
           for c in levels}
    base = levels[0]
    out: dict = {}
    for c in levels[1:]:
        ratios = [tps[c][i] / tps[base][i] for i in tps[c] if i in tps[base]]
        out[f"c{c}_vs_c{base}"] = statistics.median(ratios)
        if len(ratios) > 1:
            out[f"c{c}_vs_c{base}_per_repeat"] = ratios
    out["tokens_per_second_median"] = {f"c{c}": statistics.median(tps[c].values())
                                       for c in levels}
    local = {c: {r.repeat: r.tokens_per_second for r in results
                 if r.protocol == REFERENCE and r.concurrency == c} for c in levels}
    if any(local.values()):
        out["in_process_tokens_per_second_median"] = {
            f"c{c}": statistics.median(local[c].values()) for c in levels if local[c]}
        out["served_vs_in_process"] = {
            f"c{c}": statistics.median(tps[c][i] / local[c][i] for i in tps[c] if i in local[c])
            for c in levels if local[c]}
    out["errors"] = sum(r.errors for r in served)
    out["lost"] = sum(r.lost for r in served)
    return out


def write_outputs(results: list[LevelResult], out_dir: Path, meta: dict) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    data = {"meta": meta, "summary": summarize(results), "levels": [asdict(r) for r in results]}
    (out_dir / "loadtest.json").write_text(json.dumps(data, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for rep in sorted({r.repeat for r in results}):
        for kind, style in [("served", "-"), (REFERENCE, "--")]:
            runs = [r for r in results if r.repeat == rep
                    and (r.protocol == REFERENCE) == (kind == REFERENCE)]
            if runs:
                a1.plot([r.concurrency for r in runs], [r.tokens_per_second for r in runs],
                        style, marker="o", label=f"{runs[0].protocol}, repeat {rep + 1}")
    a1.set(xlabel="concurrent streams", ylabel="output tokens/s", title="throughput")
    a1.legend(fontsize=7)
    runs = [r for r in results if r.repeat == 0 and r.protocol != REFERENCE]
    c = [r.concurrency for r in runs]
    a2.plot(c, [r.ttft_p50_ms for r in runs], marker="o", label="TTFT p50")
    a2.plot(c, [r.ttft_p99_ms for r in runs], marker="o", label="TTFT p99")
    a2.plot(c, [r.itl_p50_ms for r in runs], marker="s", label="ITL p50")
    a2.plot(c, [r.itl_p99_ms for r in runs], marker="s", label="ITL p99")
    a2.set(xlabel="concurrent streams", ylabel="ms", title="latency", yscale="log")
    a2.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "loadtest.png", dpi=110)
    plt.close(fig)
    return data


def print_results(results: list[LevelResult]) -> None:
    print(f"{'protocol':>10s} {'rep':>3s} {'conc':>4s} {'req':>4s} {'err':>3s} {'lost':>4s} "
          f"{'tok/s':>8s} {'TTFT p50':>9s} {'p99':>7s} {'ITL p50':>8s} {'p99':>7s} "
          f"{'accept':>6s} {'client CPU':>10s}")
    for r in results:
        print(f"{r.protocol:>10s} {r.repeat + 1:3d} {r.concurrency:4d} {r.requests:4d} "
              f"{r.errors:3d} {r.lost:4d} {r.tokens_per_second:8.1f} {r.ttft_p50_ms:8.0f}ms "
              f"{r.ttft_p99_ms:6.0f}ms {r.itl_p50_ms:7.1f}ms {r.itl_p99_ms:6.1f}ms "
              f"{r.acceptance_rate:6.2f} {r.client_cpu_share:9.2f}c")
    for e in sorted({m for r in results for m in r.error_messages})[:5]:
        print(f"  {e}")
