"""OpenAI-compatible HTTP API (FastAPI + uvicorn) in front of the Triton deployment.

``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions``, streamed (server-sent
events ending with ``data: [DONE]``) or not. The API tokenises the prompt itself (chat: the
verifier's chat template, ``checkpoints.format_chat``) and calls the served model
(``ensemble``) over one gRPC stream per request, with token ids in (``input_ids``) and text
out; a client that goes away cancels its gRPC stream, which frees the slot.

Every request field is either honoured, accepted because it changes nothing (``user``,
``metadata``, ``store``, ``service_tier``, ``stream_options``), or refused with a 400 naming
it. Speculation statistics ride along in a ``paradraft`` object next to ``usage``. The app
runs in its own process (``start_openai_server``), so a load generator or a test never shares
its interpreter.
"""

import asyncio
import json
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..checkpoints import chat_stop_token_ids, format_chat, load_tokenizer, renders_tools
from ..correction import PARAMETER_RANGES
from ..grammar import response_format_guide
from ..logprobs import MAX_TOP_LOGPROBS
from .client import MODEL, answers, is_final, raw_arrays, raw_outputs, raw_request
from .openai_logprobs import (
    TokenLogprob,
    TokenTexts,
    chat_logprobs,
    completion_logprobs,
    read_entries,
)
from .openai_schema import (
    INT32_MAX,
    MAX_STOP,
    N_MAX,
    REQUESTS,
    RULE_PARAMETERS,
    TEMPERATURE_MAX,
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ErrorResponse,
    Health,
    ModelList,
    json_integer,
    request_fields,
    validate_body,
)
from .openai_tools import (
    CallSplitter,
    ToolError,
    Tools,
    call_guide,
    parse_calls,
    parse_tools,
    tags_are_tokens,
)
from .openai_tools import template_messages as tool_template_messages

RETRY_AFTER_S = 1  # what a 503 (queue full) asks the client to wait
# one server-sent event of a streamed response: a JSON chunk, an error, or [DONE]
SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}
HEALTH_TIMEOUT_S = 2.0  # how long /health waits for Triton's answer
FP32_TINY = 2.0**-149  # the smallest positive 32-bit float
# the request fields: every one is honoured, refused but at its neutral values, or accepted
# because it changes nothing in the output (user, metadata, store, service_tier,
# parallel_tool_calls)
FIELDS = {kind: request_fields(kind) for kind in REQUESTS}
OUTPUTS = ("text_output", "sequence_length", "total_accepted_draft_tokens", "total_draft_tokens",
           "finish_reason", "cached_tokens")
# a request with logprobs reads its tokens and their logprobs too
LOGPROB_OUTPUTS = frozenset({"output_ids", "output_log_probs", "top_logprobs",
                             "top_logprob_ids"})


@dataclass
class OpenAIConfig:
    grpc_url: str  # the Triton server's gRPC address
    tokenizer_dir: str  # tokenizer.json, and for chat tokenizer_config.json / a chat template
    max_seq_len: int  # prompt + output tokens per request (the server's --max-seq-len)
    served_model_name: str = "paradraft"  # the id /v1/models lists and requests must name
    # the most requests the server holds at once (its slots and queue places): n beyond it
    # could never be served, so it is refused as invalid, not as overloaded
    max_choices: int = N_MAX
    host: str = "127.0.0.1"
    port: int = 8080


class ApiError(Exception):
    """An OpenAI-style error response."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": None}}


def invalid(param: str, message: str) -> ApiError:
    return ApiError(400, message, param)


@dataclass
class Job:
    """One validated request: the prompt's token ids and the Triton inputs for it."""

    chat: bool
    prompt_ids: list[int]
    max_tokens: int
    stream: bool
    include_usage: bool
    stop: list[str]
    inputs: dict[str, tuple[str, object]] = field(default_factory=dict)  # name -> (type, value)
    n: int = 1  # choices: one served request each
    logprobs: int | None = None  # top_logprobs per token (0: the token's own; None: none)
    tools: Tools | None = None  # the functions the model may call (chat)

    def choice_inputs(self, index: int) -> dict[str, tuple[str, object]]:
        """Choice ``index``'s inputs: with a seed, its own (seed + index), so choice 0 is what
        n = 1 gives; without, each request draws its own seed on the server."""
        if index == 0 or "random_seed" not in self.inputs:
            return self.inputs
        seed = self.inputs["random_seed"][1][0]
        return {**self.inputs, "random_seed": ("UINT64", [(seed + index) % 2**64])}


# -- request validation: plain functions over the JSON body ------------------------------------

def number(body: dict, name: str, low: float, high: float, low_open: bool = False
           ) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise invalid(name, f"{name} must be a number; got {value!r}")
    if not (low < value if low_open else low <= value) or value > high:
        bracket = "(" if low_open else "["
        raise invalid(name, f"{name} must be in {bracket}{low:g}, {high:g}]; got {value}")
    return float(value)


def integer(body: dict, name: str, low: int | None = None, high: int | None = None
            ) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    value = json_integer(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(name, f"{name} must be an integer; got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise invalid(name, f"{name} must be an integer in [{low}, {high}]; got {value}")
    return value


def fp32(value: float) -> float:
    """``value`` as an FP32 tensor carries it, a positive value staying positive: rounded to
    0, a top_p or temperature just above 0 would leave its allowed range."""
    if 0 < value < FP32_TINY:
        return FP32_TINY
    return value


def refuse_unless(body: dict, name: str, ok, allowed: str) -> None:
    """Refuse a field that would change the output at any value but the neutral ones."""
    if name in body and body[name] is not None and not ok(body[name]):
        raise invalid(name, f"{name} is not supported by paradraft (allowed: {allowed}); "
                            f"got {body[name]!r}")


def check_fields(body: dict, kind: str) -> None:
    unknown = sorted(set(body) - FIELDS[kind])
    if unknown:
        raise invalid(unknown[0], f"unsupported field {unknown[0]!r}: paradraft refuses fields "
                                  "it would otherwise ignore")
    refuse_unless(body, "best_of", lambda v: v == 1 and not isinstance(v, bool), "1")
    refuse_unless(body, "echo", lambda v: v is False, "false")
    refuse_unless(body, "suffix", lambda v: v == "", "an empty string")
    for name in ("presence_penalty", "frequency_penalty"):
        refuse_unless(body, name, lambda v: v == 0 and not isinstance(v, bool), "0")
    refuse_unless(body, "logit_bias", lambda v: v == {}, "{}")
    refuse_unless(body, "functions", lambda v: v == [], "[] (no function calls)")
    refuse_unless(body, "function_call", lambda v: v == "none", '"none"')
    refuse_unless(body, "top_k", lambda v: v in (-1, 0, 1) and not isinstance(v, bool),
                  "-1 or 0 (off), 1 (greedy)")
    refuse_unless(body, "min_tokens", lambda v: v in (0, 1) and not isinstance(v, bool), "0, 1")
    refuse_unless(body, "repetition_penalty", lambda v: v == 1 and not isinstance(v, bool), "1")


def logprobs_asked(body: dict, chat: bool) -> int | None:
    """The request's top_logprobs (0: each token's own logprob only), or None: chat's
    ``logprobs`` (a boolean) with ``top_logprobs``; the completions API's ``logprobs`` (how
    many likeliest tokens)."""
    if not chat:
        return integer(body, "logprobs", 0, MAX_TOP_LOGPROBS)
    wanted = body.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise invalid("logprobs", f"logprobs must be a boolean; got {wanted!r}")
    top = integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top is not None and not wanted:
        raise invalid("top_logprobs", "top_logprobs needs logprobs true")
    return (top or 0) if wanted else None


def guide_inputs(response_format) -> dict[str, tuple[str, object]]:
    """The served model's guided decoding inputs for ``response_format`` (none for text)."""
    try:
        guide = response_format_guide(response_format)
    except ValueError as e:
        raise invalid("response_format", str(e)) from None
    if guide is None:
        return {}
    inputs = {"guided_decoding_guide_type": ("BYTES", [guide.kind.encode()])}
    if guide.text:
        inputs["guided_decoding_guide"] = ("BYTES", [guide.text.encode()])
    return inputs


def stop_strings(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    words = [stop] if isinstance(stop, str) else stop
    if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
        raise invalid("stop", f"stop must be a string or a list of strings; got {stop!r}")
    if len(words) > MAX_STOP:
        raise invalid("stop", f"stop must hold at most {MAX_STOP} strings; got {len(words)}")
    return [w for w in words if w]


def prompt_ids(body: dict, tokenizer) -> list[int]:
    """``prompt``: a string, or token ids, or a list holding one of either."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise invalid("prompt", "prompt is empty")
        return tokenizer.encode(prompt).ids
    if isinstance(prompt, list):
        prompt = [json_integer(i) for i in prompt]
    if (isinstance(prompt, list) and prompt
            and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt)):
        vocab = tokenizer.get_vocab_size(with_added_tokens=True)
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise invalid("prompt", f"prompt token ids must be in [0, {vocab - 1}]")
        return prompt
    raise invalid("prompt", "prompt must be one non-empty string or one list of token ids "
                            f"(one prompt per request); got {str(prompt)[:80]!r}")


def chat_prompt(body: dict, chat_dir: str, tools: Tools | None = None) -> str:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "messages must be a non-empty list")
    flat = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise invalid("messages", f"messages[{i}] must be an object with a string 'role'")
        content = message.get("content")
        if isinstance(content, list):  # content parts: text only
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    kind = part.get("type") if isinstance(part, dict) else part
                    raise invalid("messages", f"messages[{i}].content: only text parts are "
                                              f"supported; got {kind!r}")
                texts.append(str(part.get("text", "")))
            content = "\n".join(texts)
        elif content is not None and not isinstance(content, str):
            raise invalid("messages", f"messages[{i}].content must be a string or a list of "
                                      "text parts")
        flat.append({**message, "content": content})
    try:
        flat, definitions = tool_template_messages(flat, tools, renders_tools(chat_dir))
        return format_chat(chat_dir, flat, add_generation_prompt=True, tools=definitions)
    except ToolError as e:
        raise invalid(e.param, str(e)) from None
    except ValueError as e:  # no template, or the template refused the messages
        raise invalid("messages", str(e)) from None


def parse_job(body: dict, kind: str, tokenizer, config: OpenAIConfig,
              chat_stop_ids: tuple[int, ...]) -> Job:
    """Validate one request body (``kind``: ``completions`` or ``chat``) into a Job."""
    if not isinstance(body, dict):
        raise invalid(None, "the request body must be a JSON object")
    check_fields(body, kind)
    model = body.get("model")
    if model != config.served_model_name:
        raise ApiError(404, f"model {model!r} does not exist; this server serves "
                            f"{config.served_model_name!r}", "model", "not_found_error")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise invalid("stream", f"stream must be a boolean; got {stream!r}")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not stream):
        raise invalid("stream_options", "stream_options must be an object, and only with "
                                        "stream true")
    include_usage = bool((options or {}).get("include_usage", False))
    chat = kind == "chat"
    tools = None
    if chat:
        try:
            tools = parse_tools(body.get("tools"), body.get("tool_choice"))
        except ToolError as e:
            raise invalid(e.param, str(e)) from None
        ids = tokenizer.encode(chat_prompt(body, config.tokenizer_dir, tools),
                               add_special_tokens=False).ids  # the template wrote them
    else:
        ids = prompt_ids(body, tokenizer)
    if not 1 <= len(ids) < config.max_seq_len:
        field_name = "messages" if chat else "prompt"
        raise invalid(field_name, f"{field_name}: the prompt is {len(ids)} tokens; allowed "
                                  f"1..{config.max_seq_len - 1}")
    room = config.max_seq_len - len(ids)
    name = "max_tokens"
    max_tokens = integer(body, "max_tokens")
    if chat and body.get("max_completion_tokens") is not None:
        name, max_tokens = "max_completion_tokens", integer(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = room if chat else min(16, room)  # OpenAI's defaults
    if not 1 <= max_tokens <= room:
        raise invalid(name, f"{name} must be in [1, {room}] for this prompt ({len(ids)} "
                            f"tokens, max_seq_len {config.max_seq_len}); got {max_tokens}")
    inputs: dict[str, tuple[str, object]] = {
        "input_ids": ("INT32", ids), "input_lengths": ("INT32", [len(ids)]),
        "max_tokens": ("INT32", [max_tokens]), "stream": ("BOOL", [stream])}
    temperature = number(body, "temperature", 0.0, TEMPERATURE_MAX)
    top_p = number(body, "top_p", *PARAMETER_RANGES["top_p"])
    rule = body.get("correction_rule")
    if rule is not None and not isinstance(rule, str):
        raise invalid("correction_rule", f"correction_rule must be a string; got {rule!r}")
    # OpenAI's greedy: temperature 0, or below the sampling range (vLLM does the same)
    if ((temperature is not None and temperature < PARAMETER_RANGES["temperature"][0])
            or body.get("top_k") == 1):
        if rule not in (None, "greedy"):
            raise invalid("correction_rule", f"temperature 0 (greedy) and correction_rule "
                                             f"{rule!r} contradict each other")
        rule = "greedy"
    else:
        if temperature is not None:
            inputs["temperature"] = ("FP32", [fp32(temperature)])
        if top_p is not None:
            inputs["top_p"] = ("FP32", [fp32(top_p)])
    if rule is not None:
        inputs["correction_rule"] = ("BYTES", [rule.encode()])
    for name in RULE_PARAMETERS:
        value = number(body, name, *PARAMETER_RANGES[name])
        if value is not None:
            inputs[name] = ("FP32", [fp32(value)])
    seed = integer(body, "seed", -2**63, 2**64 - 1)
    if seed is not None:
        inputs["random_seed"] = ("UINT64", [seed % 2**64])
    k = integer(body, "num_draft_tokens", 0, INT32_MAX)  # the server's --k bounds it
    if k is not None:  # 0: this request decodes without speculation
        inputs["num_draft_tokens"] = ("INT32", [k])
    drafter = body.get("drafter")  # the server's drafter, or "ngram": the model checks
    if drafter is not None:
        if not isinstance(drafter, str):
            raise invalid("drafter", f"drafter must be a string; got {drafter!r}")
        inputs["drafter"] = ("BYTES", [drafter.encode()])
    ignore_eos = body.get("ignore_eos")
    if ignore_eos is not None and not isinstance(ignore_eos, bool):
        raise invalid("ignore_eos", f"ignore_eos must be a boolean; got {ignore_eos!r}")
    if ignore_eos:
        inputs["end_id"] = ("INT32", [-1])
    if chat and chat_stop_ids:  # the end-of-turn markers end the reply (one-token stop words)
        inputs["stop_words_ids"] = ("INT32", list(chat_stop_ids))
        inputs["stop_words_lengths"] = ("INT32", [1] * len(chat_stop_ids))
    stop = stop_strings(body)
    n = integer(body, "n", 1, min(N_MAX, config.max_choices))
    inputs.update(guide_inputs(body.get("response_format")))
    calls = None if tools is None else call_guide(tools, tags_are_tokens(tokenizer))
    if calls is not None:  # required, or a named function: one call, its schema followed
        if "guided_decoding_guide_type" in inputs:
            raise invalid("tool_choice", f"tool_choice {body.get('tool_choice')!r} constrains "
                                         "the output to a call: send it without "
                                         "response_format")
        inputs["guided_decoding_guide_type"] = ("BYTES", [b"lark"])
        inputs["guided_decoding_guide"] = ("BYTES", [calls.encode()])
    logprobs = logprobs_asked(body, chat)
    if logprobs is not None:
        inputs["top_logprobs"] = ("INT32", [logprobs])
    refused = validate_body(body, kind)  # the schema's catch-all, after the named checks
    if refused is not None:
        raise invalid(*refused)
    return Job(chat, ids, max_tokens, stream, include_usage, stop, inputs, n or 1, logprobs,
               tools)


# -- the gRPC call ---------------------------------------------------------------------------

@dataclass
class Piece:
    """What one Triton response adds."""

    text: str
    tokens: int  # tokens generated so far
    accepted: int
    drafted: int
    finish_reason: str  # "" until the final response
    cached: int = 0  # prompt tokens read from the prefix cache (the final response's)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # its tokens', where asked


def read_response(response, logprobs: bool = False) -> Piece:
    out = raw_outputs(response)
    return Piece(out.get("text_output", ""), out.get("sequence_length", 0),
                 out.get("total_accepted_draft_tokens", 0), out.get("total_draft_tokens", 0),
                 out.get("finish_reason", ""), out.get("cached_tokens", 0),
                 read_entries(raw_arrays(response, LOGPROB_OUTPUTS)) if logprobs else [])


def field_named(message: str, chat: bool) -> str | None:
    """The request field a server-side refusal names first (the model's messages begin with
    the input's name: ``num_draft_tokens must be in [0, 4] ...``)."""
    match = re.match(r"\s*(\w+)", message)
    name = match.group(1) if match else ""
    name = {"random_seed": "seed", "end_id": "ignore_eos",
            "guided_decoding_guide": "response_format",
            "guided_decoding_guide_type": "response_format",
            "input_ids": "messages" if chat else "prompt"}.get(name, name)
    return name if name in FIELDS["chat" if chat else "completions"] else None


def error_from_grpc(error, chat: bool, tools: bool = False) -> ApiError:
    """A Triton error (the stream asked for status codes) as an HTTP error (``tools``: the
    request's guide is its tools' call grammar)."""
    import grpc

    code, message = error.code(), error.details() or str(error)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        param = field_named(message, chat)
        if tools and param == "response_format":
            param = "tools"
        if param is not None and param not in message:
            message = f"{param}: {message}"
        return ApiError(400, message, param)
    if code == grpc.StatusCode.UNAVAILABLE:  # queue full, or the server is not there
        return ApiError(503, message, kind="server_error")
    return ApiError(500, message, kind="server_error")


class StopMatcher:
    """OpenAI's ``stop``: the output ends before the first stop string, which is left out.
    Text that could still become a stop string is held back until it cannot."""

    def __init__(self, stop: list[str]):
        self.stop = stop
        self.text = ""
        self.sent = 0

    def feed(self, piece: str, final: bool) -> tuple[str, bool]:
        """The text that may go out now, and whether a stop string ended the output."""
        self.text += piece
        if not self.stop:
            out, self.sent = self.text[self.sent:], len(self.text)
            return out, False
        # text before ``sent`` went out, so it cannot hold the start of a stop string
        hits = [i for i in (self.text.find(s, self.sent) for s in self.stop) if i >= 0]
        if hits:
            out = self.text[self.sent:min(hits)]
            self.sent = len(self.text)
            return out, True
        hold = 0 if final else max((k for s in self.stop for k in range(1, len(s))
                                    if self.text.endswith(s[:k])), default=0)
        end = len(self.text) - hold
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out, False


async def generate(stub, job: Job, index: int = 0) -> AsyncIterator[Piece]:
    """Run the job's choice ``index`` on Triton; yield the text as it comes, the final
    piece last (its ``finish_reason`` set). Cancelling the iteration cancels the gRPC stream,
    and with it the request on the server."""
    # not output_ids: every tensor a response carries costs time
    asked = job.logprobs is not None
    request = raw_request(MODEL, job.choice_inputs(index), uuid.uuid4().hex,
                          OUTPUTS + (tuple(sorted(LOGPROB_OUTPUTS)) if asked else ()))

    async def requests():
        yield request

    call = stub.ModelStreamInfer(requests(), metadata=(("triton_grpc_error", "true"),))
    matcher = StopMatcher(job.stop)
    finished = False
    try:
        async for response in call:
            if response.error_message:
                raise ApiError(500, response.error_message, kind="server_error")
            final = is_final(response.infer_response)
            if not response.infer_response.outputs:  # the empty final response
                if final:
                    break
                continue
            piece = read_response(response.infer_response, asked)
            piece.text, stopped = matcher.feed(piece.text, final)
            finished = final
            if stopped:
                piece.finish_reason = "stop"
                yield piece
                return  # the finally cancels the rest of the generation
            yield piece
            if final:
                return
        finished = True
        raise ApiError(500, "the server ended the stream without a final response",
                       kind="server_error")
    except Exception as e:
        import grpc

        if isinstance(e, grpc.aio.AioRpcError):
            raise error_from_grpc(e, job.chat, job.tools is not None) from None
        raise
    finally:
        if finished:  # let the server close the stream: a cancel that arrives after it
            await call.code()  # completed confuses Triton's gRPC frontend
        else:  # the client went away, or a stop string ended the output early:
            call.cancel()  # the server drops the request (its slot frees within ~0.1 s)


# -- the app -----------------------------------------------------------------------------------

def usage(job: Job, pieces: list[Piece]) -> dict:
    """OpenAI's usage over the choices' last pieces: the prompt counted once, the
    completions summed; cached tokens are the least any choice read from the cache."""
    completion = sum(p.tokens for p in pieces)
    return {"prompt_tokens": len(job.prompt_ids), "completion_tokens": completion,
            "total_tokens": len(job.prompt_ids) + completion,
            "prompt_tokens_details": {"cached_tokens": min(p.cached for p in pieces)}}


def spec_stats(pieces: list[Piece]) -> dict:
    """The ``paradraft`` object of a response: its speculation so far, over its choices."""
    accepted, drafted = sum(p.accepted for p in pieces), sum(p.drafted for p in pieces)
    return {"acceptance_rate": accepted / drafted if drafted else 0.0,
            "accepted_draft_tokens": accepted, "draft_tokens": drafted}


async def all_or_none(awaitables) -> list:
    """Await them all; if one fails (or this is cancelled), cancel the rest and wait until
    they have stopped (a stream can be closed only then), and raise."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def first_pieces(streams: list[AsyncIterator[Piece]]) -> list[Piece]:
    """Each choice's first piece (a full queue refuses the request before any byte goes
    out); if one fails, the others are cancelled and closed and its error raised."""
    try:
        return await all_or_none(anext(s) for s in streams)
    except BaseException:
        await close_all(streams)
        raise


async def close_all(streams: list[AsyncIterator[Piece]]) -> None:
    for stream in streams:
        await stream.aclose()  # cancels its gRPC call if it has not ended


async def to_end(first: Piece, pieces: AsyncIterator[Piece]
                 ) -> tuple[str, Piece, list[TokenLogprob]]:
    """One choice's whole text, its final piece and its tokens' logprobs (where asked)."""
    texts, piece, entries = [first.text], first, list(first.logprobs)
    while not piece.finish_reason:
        piece = await anext(pieces)
        texts.append(piece.text)
        entries += piece.logprobs
    return "".join(texts), piece, entries


async def merged(firsts: list[Piece], streams: list[AsyncIterator[Piece]]
                 ) -> AsyncIterator[tuple[int, Piece]]:
    """The choices' pieces as they come, each with its choice's index; the first error
    any choice meets ends it all. Closing it cancels what still runs."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, piece: Piece, pieces: AsyncIterator[Piece]) -> None:
        try:
            while True:
                await queue.put((index, piece, None))
                if piece.finish_reason:
                    return
                piece = await anext(pieces)
        except ApiError as e:
            await queue.put((index, None, e))
        except Exception as e:  # a bug: the stream still ends with an error event
            await queue.put((index, None, ApiError(500, f"internal error: {e}",
                                                   kind="server_error")))

    pumps = [asyncio.ensure_future(pump(i, first, stream))
             for i, (first, stream) in enumerate(zip(firsts, streams, strict=True))]
    try:
        running = len(streams)
        while running:
            index, piece, error = await queue.get()
            if error is not None:
                raise error
            yield index, piece
            running -= bool(piece.finish_reason)
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        await close_all(streams)


def create_app(config: OpenAIConfig):
    """The FastAPI app; one gRPC channel to Triton, opened on start-up."""
    from contextlib import asynccontextmanager

    import grpc
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    tokenizer = load_tokenizer(config.tokenizer_dir)
    try:
        chat_stop_ids = chat_stop_token_ids(config.tokenizer_dir)
    except ValueError:  # no chat template: chat requests get the 400 that says so
        chat_stop_ids = ()
    logprobs = Logprobs(TokenTexts(tokenizer), frozenset(chat_stop_ids))
    state = {}

    @asynccontextmanager
    async def lifespan(app):
        channel = grpc.aio.insecure_channel(config.grpc_url)
        state["stub"] = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        yield
        await channel.close()

    app = FastAPI(title="paradraft OpenAI-compatible API", lifespan=lifespan)

    def error_response(e: ApiError) -> JSONResponse:
        headers = {"Retry-After": str(RETRY_AFTER_S)} if e.status == 503 else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [
            {"id": config.served_model_name, "object": "model", "created": 0,
             "owned_by": "paradraft"}]})

    async def handle(request: Request, kind: str):
        try:
            try:
                body = await request.json()
            except (ValueError, UnicodeDecodeError):
                raise invalid(None, "the request body is not valid JSON") from None
            job = parse_job(body, kind, tokenizer, config, chat_stop_ids)
            ident = ("chatcmpl-" if job.chat else "cmpl-") + uuid.uuid4().hex
            # one served request per choice: they run as rows of the same batches
            streams = [generate(state["stub"], job, i) for i in range(job.n)]
            # the first responses before any byte goes out: a full queue is still a 503
            firsts = await until_disconnect(request, first_pieces(streams))
        except ApiError as e:
            return error_response(e)
        except ClientGone:
            return JSONResponse({}, status_code=499)
        head = {"id": ident, "created": int(time.time()), "model": config.served_model_name}
        if job.stream:
            return StreamingResponse(sse(job, head, merged(firsts, streams), logprobs),
                                     media_type="text/event-stream")
        try:
            ends = await until_disconnect(request, all_or_none(
                to_end(first, s) for first, s in zip(firsts, streams, strict=True)))
        except ApiError as e:
            return error_response(e)
        except ClientGone:
            return JSONResponse({}, status_code=499)
        finally:
            await close_all(streams)
        choices = [{"index": i, **assistant_message(job, text, piece.finish_reason),
                    "logprobs": logprobs.of(job, entries)} if job.chat else
                   {"index": i, "text": text, "logprobs": logprobs.of(job, entries),
                    "finish_reason": piece.finish_reason}
                   for i, (text, piece, entries) in enumerate(ends)]
        lasts = [piece for _, piece, _ in ends]
        return JSONResponse({
            **head, "object": "chat.completion" if job.chat else "text_completion",
            "choices": choices, "usage": usage(job, lasts), "paradraft": spec_stats(lasts)})

    async def completions(request: Request):
        return await handle(request, "completions")

    async def chat_completions(request: Request):
        return await handle(request, "chat")

    async def health(request: Request):  # ready: Triton's model is (a dead model instance is not)
        try:
            reply = await state["stub"].ModelReady(service_pb2.ModelReadyRequest(name=MODEL),
                                                   timeout=HEALTH_TIMEOUT_S)
            if reply.ready:
                return JSONResponse({})
            reason = f"the model {MODEL!r} is not ready"
        except grpc.aio.AioRpcError as e:
            reason = f"Triton at {config.grpc_url} does not answer ({e.code().name})"
        return error_response(ApiError(503, reason, kind="server_error"))

    # the handlers take the raw request: parse_job validates the body and names every field it
    # refuses; the request models (openai_schema) document it in /openapi.json
    errors = {400: {"model": ErrorResponse, "description": "invalid or unsupported field"},
              404: {"model": ErrorResponse, "description": "no such model"},
              503: {"model": ErrorResponse, "description": "overloaded or draining: retry "
                                                           "after Retry-After seconds"}}

    def body_of(model) -> dict:
        return {"requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}

    def streamed(model) -> dict:
        return {200: {"model": model, "description": "the completion; with stream true, "
                      "server-sent events (chunks, then data: [DONE])",
                      "content": {"text/event-stream": {"schema": SSE_EVENT}}}}

    app.add_api_route("/health", health, methods=["GET"], response_model=Health,
                      responses={503: {"model": ErrorResponse, "description": "not ready"}},
                      summary="Readiness: the served model is ready")
    app.add_api_route("/v1/models", models, methods=["GET"], response_model=ModelList)
    app.add_api_route("/v1/completions", completions, methods=["POST"],
                      responses={**streamed(Completion), **errors},
                      openapi_extra=body_of(CompletionRequest))
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"],
                      responses={**streamed(ChatCompletion), **errors},
                      openapi_extra=body_of(ChatCompletionRequest))

    def openapi() -> dict:  # FastAPI's document, with the request models it does not see
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi
            from pydantic.json_schema import models_json_schema

            document = get_openapi(title=app.title, version=app.version, routes=app.routes)
            _, defs = models_json_schema(
                [(model, "validation") for model in REQUESTS.values()],
                ref_template="#/components/schemas/{model}")
            for model in REQUESTS.values():  # this server serves one model: say which
                defs["$defs"][model.__name__]["properties"]["model"]["enum"] = [
                    config.served_model_name]
            document.setdefault("components", {}).setdefault("schemas", {}).update(
                defs["$defs"])
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi
    return app


class ClientGone(Exception):
    pass


def assistant_message(job: Job, text: str, finish_reason: str) -> dict:
    """A chat choice's ``message`` and ``finish_reason``: with tools, the calls the text
    holds come out as ``tool_calls``."""
    if job.tools is None:
        return {"message": {"role": "assistant", "content": text},
                "finish_reason": finish_reason}
    content, calls = parse_calls(text)
    if not calls:
        return {"message": {"role": "assistant", "content": text},
                "finish_reason": finish_reason}
    return {"message": {"role": "assistant", "content": content, "tool_calls": calls},
            "finish_reason": "tool_calls"}


@dataclass
class Logprobs:
    """A response's ``logprobs`` objects, as the request asked (chat leaves its
    end-of-turn tokens out, as it leaves them out of the content)."""

    texts: TokenTexts
    chat_stop_ids: frozenset[int]

    def of(self, job: Job, entries: list[TokenLogprob], offset: int = 0) -> dict | None:
        """The object for ``entries`` (None where none was asked; ``offset``: the
        completion's characters before them)."""
        if job.logprobs is None:
            return None
        if job.chat:
            return chat_logprobs(self.texts, [e for e in entries
                                              if e.token_id not in self.chat_stop_ids])
        return completion_logprobs(self.texts, entries, offset)[0]


async def until_disconnect(request, awaitable):
    """Await ``awaitable`` unless the client disconnects first (then cancel it)."""
    task = asyncio.ensure_future(awaitable)
    gone = asyncio.ensure_future(wait_disconnect(request))
    done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        gone.cancel()
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)  # stopped: its streams can be closed
    raise ClientGone()


async def wait_disconnect(request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def sse(job: Job, head: dict, pieces: AsyncIterator[tuple[int, Piece]], logprobs: Logprobs):
    """The server-sent events of a streamed response (OpenAI's chunk format), the choices'
    chunks interleaved as they come. Starlette cancels this generator when the client
    disconnects; closing ``pieces`` then cancels the gRPC streams."""
    kind = "chat.completion.chunk" if job.chat else "text_completion"
    offsets = [0] * job.n  # completions: each choice's characters so far (text_offset)

    # chat with tools: each choice's text, split where its first call begins
    splitters = [CallSplitter() for _ in range(job.n)] if job.tools is not None else None

    def chunk(index: int, text: str | None, reason: str | None, role: bool = False,
              entries: list[TokenLogprob] = (), calls: list[dict] | None = None,
              **extra) -> str:
        lp = logprobs.of(job, list(entries), offsets[index]) if entries else None
        if job.chat:
            delta = {"role": "assistant", "content": ""} if role else (
                {} if text is None else {"content": text})
            if calls:  # each call whole, as OpenAI's deltas add up to it
                delta = {"tool_calls": [{"index": j, **call} for j, call in enumerate(calls)]}
            choice = {"index": index, "delta": delta, "logprobs": lp,
                      "finish_reason": reason}
        else:
            choice = {"index": index, "text": text or "", "logprobs": lp,
                      "finish_reason": reason}
            if lp is not None:
                offsets[index] += sum(map(len, lp["tokens"]))
        body = {**head, "object": kind, "choices": [choice], **extra}
        if job.include_usage:
            body.setdefault("usage", None)
        return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"

    async def events():
        lasts: list[Piece | None] = [None] * job.n
        try:
            if job.chat:
                for index in range(job.n):
                    yield chunk(index, None, None, role=True)
            async for index, piece in pieces:
                lasts[index] = piece
                text, reason = piece.text, piece.finish_reason
                if splitters is not None:
                    text = splitters[index].feed(text)
                if text or piece.logprobs:
                    yield chunk(index, text, None, entries=piece.logprobs)
                if reason and splitters is not None:
                    rest, calls = splitters[index].finish()
                    if rest:
                        yield chunk(index, rest, None)
                    if calls:
                        yield chunk(index, None, None, calls=calls)
                        reason = "tool_calls"
                if reason:
                    yield chunk(index, None, reason, paradraft=spec_stats([piece]))
            if job.include_usage:  # OpenAI's usage chunk: no choices
                last = {**head, "object": kind, "choices": [], "usage": usage(job, lasts),
                        "paradraft": spec_stats(lasts)}
                yield f"data: {json.dumps(last, separators=(',', ':'))}\n\n"
        except ApiError as e:  # after the headers went out: an error event ends the stream
            yield f"data: {json.dumps(e.body())}\n\n"
        finally:
            await pieces.aclose()
        yield "data: [DONE]\n\n"

    return events()


# -- the process -------------------------------------------------------------------------------

def serve_forever(config: OpenAIConfig) -> None:
    """Run the API until SIGINT / SIGTERM (uvicorn's handlers: graceful shutdown)."""
    import uvicorn

    # uvicorn re-raises the signal that stopped it once it has shut down; with these
    # handlers that ends the process normally (exit 0) instead of by the signal
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: None)
    uvicorn.run(create_app(config), host=config.host, port=config.port, log_level="warning",
                access_log=False)


# started with ``python -c``: a plain subprocess needs no importable __main__ (multiprocessing's
# spawn would re-import the caller's script)
ENTRY = ("import json, sys; from paradraft.runtime.serving.openai_api import OpenAIConfig, "
         "serve_forever; serve_forever(OpenAIConfig(**json.loads(sys.argv[1])))")


@dataclass
class OpenAIServer:
    process: subprocess.Popen
    config: OpenAIConfig

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.config.port}/v1"

    def stop(self, timeout: float = 30) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)  # uvicorn shuts down gracefully
            try:
                self.process.wait(timeout)
            except BaseException:  # slow, or a second Ctrl-C: never leave it up
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def start_openai_server(config: OpenAIConfig, ready_timeout: float = 120,
                        log: Path | None = None) -> OpenAIServer:
    """Start the API in its own process (its own session: the caller stops it, as it does
    tritonserver) and wait until it answers ``/v1/models``. ``log``: where its output goes."""
    if not 1 <= config.port <= 65535:
        raise ValueError(f"openai_port must be in [1, 65535]; got {config.port}")
    if not (Path(config.tokenizer_dir) / "tokenizer.json").is_file():
        raise FileNotFoundError(f"missing {Path(config.tokenizer_dir) / 'tokenizer.json'}")
    out = log.open("w") if log is not None else subprocess.DEVNULL
    process = subprocess.Popen([sys.executable, "-c", ENTRY, json.dumps(asdict(config))],
                               stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    server = OpenAIServer(process, config)
    deadline = time.monotonic() + ready_timeout
    try:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                tail = log.read_text()[-3000:] if log is not None else ""
                raise RuntimeError(f"the OpenAI API server exited with {process.returncode}"
                                   + (f"; log {log}:\n{tail}" if log is not None else ""))
            if answers(f"{server.url}/models"):
                return server
            time.sleep(0.2)
        raise TimeoutError(f"the OpenAI API server was not ready after {ready_timeout}s")
    except BaseException:
        server.stop()
        raise
