"""The OpenAI-compatible API's request and response bodies as pydantic models: what
``/openapi.json`` describes (for client generators, API gateways and schemathesis) and the
contract every request body is checked against.

The request models say exactly what the server accepts: a field it refuses at every value but
the neutral ones (``tools``, ``echo``, ...) is pinned to those values, so a body
the schema allows is never refused for its shape, and a body it forbids always is (a 400
naming the field). ``openai_api.parse_job`` checks the same fields first, with messages that
name the allowed range; ``validate_body`` is its catch-all for everything else the schema
forbids (nested shapes, the fields accepted for compatibility).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from ..correction import PARAMETER_RANGES
from ..logprobs import MAX_TOP_LOGPROBS

MAX_STOP = 16  # stop strings per request
N_MAX = 16  # choices per request (n): each is a request in the served batch
TEMPERATURE_MAX = PARAMETER_RANGES["temperature"][1]  # and 0: greedy
INT32_MAX = 2**31 - 1  # what an INT32 tensor holds
RULE_PARAMETERS = ("tau", "gamma", "alpha", "epsilon", "delta")


def json_integer(value: object) -> object:
    """JSON has one number type: 3.0 is the integer 3 (JSON Schema says so too)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def integer(**bounds) -> object:
    """An integer field (``bounds``: pydantic's ge / le), 3.0 read as 3."""
    return Annotated[int, Field(**bounds), BeforeValidator(json_integer)]


class Body(BaseModel):
    # strict: "1" is not 1 and 1.0 is not an integer; forbid: an unknown field is refused
    model_config = ConfigDict(extra="forbid", strict=True)


def only(value: float) -> object:
    """A number accepted only at ``value`` (the neutral setting of a feature we do not run)."""
    return Annotated[float, Field(ge=value, le=value)]


def in_range(name: str) -> object:
    low, high, low_open = PARAMETER_RANGES[name]
    return Annotated[float, Field(gt=low) if low_open else Field(ge=low), Field(le=high)]


class StreamOptions(Body):
    include_usage: bool | None = None


class TextFormat(Body):
    type: Literal["text"]


class JsonObjectFormat(Body):
    """Any JSON object (compact: no whitespace between tokens)."""

    type: Literal["json_object"]


class JsonSchemaSpec(Body):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    # "schema" would shadow pydantic's own attribute: read through an alias
    json_schema: dict | None = Field(None, alias="schema",
                                     description="the JSON schema the output follows")
    strict: bool | None = Field(None, description="always strict here: the output follows "
                                                  "the schema exactly")


class JsonSchemaFormat(Body):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


class Sampling(Body):
    """The fields of both endpoints: OpenAI's, vLLM's extras, and ours (speculation)."""

    model: str = Field(description="the served model name (GET /v1/models)")
    stream: bool | None = None
    stream_options: StreamOptions | None = Field(None, description="only with stream true")
    max_tokens: integer(ge=1) | None = Field(
        None, description="at most max_seq_len minus the prompt's tokens")
    temperature: Annotated[float, Field(ge=0, le=TEMPERATURE_MAX)] | None = None
    top_p: in_range("top_p") | None = None
    n: integer(ge=1, le=N_MAX) | None = Field(
        None, description="choices, sampled as rows of one batch; with seed, choice i "
                          "samples with seed + i")
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    seed: integer(ge=-2**63, le=2**64 - 1) | None = None
    presence_penalty: only(0) | None = None
    frequency_penalty: only(0) | None = None
    logit_bias: Annotated[dict[str, float], Field(max_length=0)] | None = None
    response_format: TextFormat | JsonObjectFormat | JsonSchemaFormat | None = Field(
        None, description="json_object or json_schema: the output follows it (guided "
                          "decoding; rejected drafts roll the grammar back)")
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's extras
    ignore_eos: bool | None = None
    top_k: Literal[-1, 0, 1] | None = Field(None, description="-1 or 0: off; 1: greedy")
    min_tokens: Literal[0, 1] | None = None
    repetition_penalty: only(1) | None = None
    # ours
    num_draft_tokens: integer(ge=0, le=INT32_MAX) | None = Field(
        None, description="draft tokens per round for this request (0: no speculation); at "
                          "most the server's --k")
    drafter: str | None = Field(None, description="the server's drafter, or a model-free one "
                                                  "(ngram, suffix)")
    correction_rule: str | None = Field(None, description="greedy, exact, typical, ...")
    tau: in_range("tau") | None = None
    gamma: in_range("gamma") | None = None
    alpha: in_range("alpha") | None = None
    epsilon: in_range("epsilon") | None = None
    delta: in_range("delta") | None = None


TokenIds = Annotated[list[integer(ge=0)], Field(min_length=1)]


class CompletionRequest(Sampling):
    prompt: (Annotated[str, Field(min_length=1)] | TokenIds
             | Annotated[list[Annotated[str, Field(min_length=1)]],
                         Field(min_length=1, max_length=1)]
             | Annotated[list[TokenIds], Field(min_length=1, max_length=1)]) = Field(
        description="one prompt per request: a string or token ids")
    best_of: integer(ge=1, le=1) | None = None
    logprobs: integer(ge=0, le=MAX_TOP_LOGPROBS) | None = Field(
        None, description="each token's log-probability under the verifier, with this many "
                          "likeliest tokens")
    echo: Literal[False] | None = None
    suffix: Annotated[str, Field(max_length=0)] | None = None


class TextPart(Body):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    # extra keys (name, tool_call_id, ...) go to the chat template as they are
    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: str | list[TextPart] | None = None


class FunctionDefinition(Body):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict | None = Field(None, description="a JSON schema the arguments follow "
                                                      "(where the call is constrained)")
    strict: bool | None = None


class Tool(Body):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Body):
    name: str


class NamedToolChoice(Body):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: integer(ge=1) | None = None
    logprobs: bool | None = Field(
        None, description="each token's log-probability under the verifier")
    top_logprobs: integer(ge=0, le=MAX_TOP_LOGPROBS) | None = Field(
        None, description="with logprobs true: this many likeliest tokens per position")
    tools: list[Tool] | None = Field(
        None, description="functions the model may call, rendered by the chat template "
                          "(Hermes format where it has no tools)")
    functions: Annotated[list[dict], Field(max_length=0)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="required or a named function: one call, its arguments following "
                          "the function's schema (guided decoding)")
    function_call: Literal["none"] | None = None


REQUESTS = {"completions": CompletionRequest, "chat": ChatCompletionRequest}


def request_fields(kind: str) -> set[str]:
    return set(REQUESTS[kind].model_fields)


def validate_body(body: dict, kind: str) -> tuple[str, str] | None:
    """(the top-level field, a message naming it) for the first thing in ``body`` the
    ``kind`` request schema forbids; None when the body conforms."""
    try:
        REQUESTS[kind].model_validate(body)
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        where = ".".join(str(p) for p in first["loc"])
        got = repr(first.get("input"))[:80]
        return str(first["loc"][0]) if first["loc"] else "", f"{where}: {first['msg']}; " \
            f"got {got}"
    return None


# -- responses (documentation: /openapi.json) ---------------------------------------------------

class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="prompt tokens read from the prefix cache")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class SpeculationStats(BaseModel):
    acceptance_rate: float
    accepted_draft_tokens: int
    draft_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]
    refusal: None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"]


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    paradraft: SpeculationStats


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="JSON")


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "tool_calls"]


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    paradraft: SpeculationStats


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Health(BaseModel):
    """Empty when ready."""
