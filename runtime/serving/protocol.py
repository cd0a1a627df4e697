"""The serving protocol: the deployment's configuration, the scheduler it hosts, the
tokenisation and validation of every request. The only serving module the Triton model
(``triton_repo/ensemble/1/model.py``) imports: it stays a thin adapter around these plain
functions, which are tested in process.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..backends.loader import load_engines
from ..backends.trt import check_limits
from ..checkpoints import DTYPES, load_draft, resolve_dtype
from ..compiled import compile_decoder
from ..correction import RULES, RuleParams, check_range
from ..drafters import DRAFTERS, MODEL_FREE_DRAFTERS, Drafter, NgramDrafter, SuffixDrafter
from ..grammar import GUIDE_TYPES, Guide, RowGrammar, compile_guide
from ..k_policy import check_draft_len_schedule
from ..logprobs import MAX_TOP_LOGPROBS
from ..model import load_model
from ..scheduler import Scheduler
from ..speculative import FUSED_MODES, SpeculativeDecoder

if TYPE_CHECKING:
    from tokenizers import Tokenizer


@dataclass
class ServeConfig:
    """What the paradraft Triton model builds; written as JSON into the model repository."""

    verifier: str
    draft: str | None
    drafter: str = "model"  # model | parallel | self | ngram
    # the ngram drafter's suffix lengths (prompt lookup; vLLM's prompt_lookup_min / _max):
    # the server's drafter, or the one a request names (``drafter`` ngram) beside a model
    ngram_min: int = NgramDrafter.ngram_min
    ngram_max: int = NgramDrafter.ngram_max
    ngram_batched_min: int | None = None  # with several requests running (NgramDrafter)
    ngram_shared: bool = False  # the lookup searches the other cache slots too
    # the suffix drafter's (SuffixDrafter's fields): the server's drafter, where it is one
    suffix_depth: int = SuffixDrafter.suffix_depth
    suffix_min_prob: float = SuffixDrafter.suffix_min_prob
    suffix_batched_min_prob: float = SuffixDrafter.suffix_batched_min_prob
    suffix_cached_requests: int = SuffixDrafter.suffix_cached_requests
    engines: str | None = None  # an engine dir (ONNX Runtime backend) instead of checkpoints
    k: int = 4
    max_slots: int = 16
    max_queue: int = 64
    max_seq_len: int = 512
    max_input_tokens: int = 384
    rule: str = "greedy"
    temperature: float = 1.0
    top_p: float = 1.0
    # the checkpoint's end ids (generation_config.json's win); a request's end_id replaces them
    eos_token_id: int | tuple[int, ...] | None = None
    rule_defaults: dict = field(default_factory=dict)
    # per rule, the parameters calibrated to the verifier (the engine manifest's calibration,
    # through Calibration.params_for): a request of that rule that leaves them unset gets
    # these rather than rule_defaults' fixed values, which suit only a verifier as confident
    # as the one they were chosen for
    calibrated: dict[str, dict[str, float]] = field(default_factory=dict)
    # rounds with at least this many running requests decode without drafts (None: never)
    disable_by_batch_size: int | None = None
    # the round's K by batch size: TensorRT-LLM's {threshold: K}, or "auto" (goodput policy,
    # calibrated when the model loads); None: K every round
    draft_len_schedule: dict[int, int] | str | None = None
    # a streamed request's first tokens go out at once, later ones once this many have
    # gathered (SGLang's --stream-interval): each response is an IPC hop to the server
    # process, which a busy CPU pays for in throughput
    stream_interval: int = 1
    # threads of the drafting engines; None: the backend's default (load_engines)
    draft_threads: int | None = None
    acceptance_floor: float = 0.6  # warn when the running acceptance rate falls below
    # verify and correct in one engine call (engine dirs with a correction graph): on | off |
    # auto, as SpeculativeDecoder's fused_correction
    fused_correction: str = "auto"
    # the torch models' draft and verify steps from torch.compile graphs (CUDA graphs on a
    # GPU), compiled before the first request (runtime/compiled.py); checkpoints only
    compile: bool = False
    # weights and KV cache of checkpoints (float32 | bfloat16 | float16); None: the
    # checkpoint's torch_dtype on CUDA, float32 on the CPU (as `generate`)
    dtype: str | None = None
    # where the model instances run, `instances` on each entry (cpu, cuda, cuda:N; cuda is
    # cuda:0): each instance is its own process with its own slots and caches, and Triton
    # spreads requests over them (the model's instance_group follows this list)
    devices: tuple[str, ...] = ("cpu",)
    instances: int = 1
    # a new request reuses the K/V a finished one left in a slot for their common prompt
    # prefix (scheduler.py); ``cache_slots``: cache slots beyond ``max_slots`` that only keep
    # finished requests' prefixes (the least recently used is overwritten first)
    prefix_cache: bool = True
    cache_slots: int = 0
    # while requests run, admitted prompts are fed at most this many tokens a round beside
    # them (None: whole prompts at once)
    prefill_chunk: int | None = 128

    def __post_init__(self) -> None:
        for name, low in [("k", 1), ("max_slots", 1), ("max_queue", 0), ("max_seq_len", 2),
                          ("max_input_tokens", 1), ("stream_interval", 1),
                          ("draft_threads", 1), ("instances", 1), ("cache_slots", 0),
                          ("prefill_chunk", 1)]:
            value = getattr(self, name)
            if name in ("draft_threads", "prefill_chunk") and value is None:
                continue
            if not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}; got {value!r}")
        check_range("acceptance_floor", self.acceptance_floor, 0.0, 1.0)
        self.devices = tuple(self.devices)  # JSON brings a list
        if not self.devices:
            raise ValueError("devices must list at least one device (cpu, cuda or cuda:N)")
        for device in self.devices:
            gpu_index(device)  # the syntax; whether the device exists is the caller's check
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)} or unset; "
                             f"got {self.dtype!r}")
        if self.fused_correction not in FUSED_MODES:
            raise ValueError(f"fused_correction must be one of {', '.join(FUSED_MODES)}; "
                             f"got {self.fused_correction!r}")
        if not isinstance(self.prefix_cache, bool):
            raise ValueError(f"prefix_cache must be true or false; got {self.prefix_cache!r}")
        if self.cache_slots and not self.prefix_cache:
            raise ValueError("cache_slots keep prefixes for the prefix cache: set it to 0 "
                             "with prefix_cache off")
        if not isinstance(self.compile, bool):
            raise ValueError(f"compile must be true or false; got {self.compile!r}")
        if self.compile and self.engines:
            raise ValueError("compile compiles the torch backend's models (checkpoints); an "
                             "engine dir's backend has its own graphs: drop --compile")
        if self.fused_correction == "on" and not self.engines:
            raise ValueError("fused_correction 'on' needs engines (an engine dir whose "
                             "verifier carries the correction graph); checkpoints have none")
        if self.disable_by_batch_size is not None and (
                not isinstance(self.disable_by_batch_size, int) or self.disable_by_batch_size < 1):
            raise ValueError("speculative_disable_by_batch_size must be an integer >= 1 or "
                             f"unset; got {self.disable_by_batch_size!r}")
        if isinstance(self.draft_len_schedule, dict):  # JSON keys arrive as strings
            try:
                self.draft_len_schedule = {int(size): n for size, n
                                           in self.draft_len_schedule.items()}
            except ValueError:
                raise ValueError("draft_len_schedule keys must be batch sizes; got "
                                 f"{self.draft_len_schedule!r}") from None
        check_draft_len_schedule(self.draft_len_schedule, self.k)
        if self.max_input_tokens >= self.max_seq_len:
            raise ValueError(f"max_input_tokens must be in [1, {self.max_seq_len - 1}] "
                             f"(below max_seq_len); got {self.max_input_tokens}")
        if self.drafter not in DRAFTERS:
            raise ValueError(f"drafter must be one of {', '.join(DRAFTERS)}; "
                             f"got {self.drafter!r}")
        # the sizes, validated by name
        NgramDrafter(self.ngram_min, self.ngram_max, self.ngram_batched_min, self.ngram_shared)
        SuffixDrafter(**self.suffix_options)
        check_calibrated(self.calibrated)
        default_params(self)  # rule, temperature, top_p and rule defaults, validated
        for rule in self.calibrated:  # each rule's calibrated values, validated
            try:
                rule_params(self, rule)
            except ValueError as e:
                raise ValueError(f"calibrated[{rule!r}]: {e}") from None

    @property
    def suffix_options(self) -> dict:
        """The suffix drafter's fields, by name."""
        return {name: getattr(self, name) for name in SuffixDrafter.__dataclass_fields__
                if name.startswith("suffix_")}


def gpu_index(device: str) -> int | None:
    """The GPU of a ``devices`` entry: None for ``cpu``, N for ``cuda:N`` (0 for ``cuda``)."""
    if device == "cpu":
        return None
    if device == "cuda":
        return 0
    head, _, index = device.partition(":")
    if head != "cuda" or not index.isdigit():
        raise ValueError(f"devices entries must be cpu, cuda or cuda:N; got {device!r}")
    return int(index)


def instance_device(config: ServeConfig, kind: str = "", device_id: int = 0) -> str:
    """The torch device of one model instance: Triton's ``model_instance_kind`` (CPU / GPU)
    and ``model_instance_device_id``; without them (in process), the first of ``devices``."""
    if kind == "GPU":
        return f"cuda:{device_id}"
    if kind == "CPU":
        return "cpu"
    first = gpu_index(config.devices[0])
    return "cpu" if first is None else f"cuda:{first}"


def build_scheduler(config: ServeConfig, device: str | None = None):
    """The decoder behind the server: in-flight batching over ``max_slots`` cache slots, on
    ``device`` (default: the first of ``config.devices``)."""
    device = device or instance_device(config)
    slots = config.max_slots + config.cache_slots
    if device.startswith("cuda"):  # TensorRT engines bind the current CUDA device
        torch.cuda.set_device(device)
    if config.engines:
        verifier, drafters, _, manifest = load_engines(
            config.engines, draft_threads=config.draft_threads, ngram_min=config.ngram_min,
            ngram_max=config.ngram_max, ngram_batched_min=config.ngram_batched_min,
            ngram_shared=config.ngram_shared, slots=slots, **config.suffix_options)
        if manifest["backend"] == "tensorrt":  # plan profiles are hard limits: refuse at start
            check_limits(manifest, slots, config.max_seq_len, config.k)
        drafter = drafters[config.drafter]
        lookup = drafters["ngram"]
    else:
        lookup = Drafter("ngram", ngram_min=config.ngram_min, ngram_max=config.ngram_max,
                         ngram_batched_min=config.ngram_batched_min,
                         ngram_shared=config.ngram_shared)
        dtype = resolve_dtype(config.verifier, torch.device(device), config.dtype)
        verifier = load_model(config.verifier, dtype=dtype, device=device)
        if config.drafter == "self":
            drafter = Drafter("self", verifier)
        elif config.drafter == "ngram":
            drafter = lookup
        elif config.drafter == "suffix":
            drafter = Drafter("suffix", **config.suffix_options)
        elif config.drafter == "grammar":
            drafter = Drafter("grammar")
        else:
            drafter = Drafter(config.drafter, load_draft(config.draft, config.verifier,
                                                         verifier.config.vocab_size,
                                                         dtype=dtype, device=device))
    decoder = SpeculativeDecoder(
        verifier, drafter, default_params(config), k=config.k,
        max_batch_size=slots, max_running=config.max_slots, max_seq_len=config.max_seq_len,
        disable_by_batch_size=config.disable_by_batch_size,
        draft_len_schedule=config.draft_len_schedule, acceptance_floor=config.acceptance_floor,
        fused_correction=config.fused_correction,
        # a request may draft with the lookup instead (its drafter "ngram")
        lookup=None if drafter.model is None else lookup,
    )
    if config.compile:  # every shape compiled (on CUDA captured) before the first request
        compile_decoder(decoder)
    if config.draft_len_schedule == "auto":
        decoder.calibrate()  # before the scheduler owns the slots, on the compiled steps
    return Scheduler(decoder, max_queue=config.max_queue, prefill_chunk=config.prefill_chunk,
                     prefix_cache=config.prefix_cache)


def round_metrics(decoder: SpeculativeDecoder) -> dict:
    """What the server's metrics show of the decoder's rounds, read on the scheduler thread
    (the decoder is not locked): rounds by the K they verified, the goodput policy's sums
    (``metrics.RoundStats``), each drafter's running α, and the round costs per part, batch
    size and K (``k_policy.RoundCosts``; none before a calibration)."""
    rounds = decoder.rounds
    costs = decoder.costs
    cells = {} if costs is None else {
        (part, b + 1, k): seconds
        for part, table in (("verify", costs.verify), ("draft", costs.draft))
        for b, row in enumerate(table) for k, seconds in enumerate(row)
        if part == "verify" or k}
    return {"by_width": list(rounds.by_width), "tokens": rounds.tokens,
            "expected_tokens": rounds.expected_tokens, "plain_tokens": rounds.plain_tokens,
            "plain_tokens_expected": rounds.plain_tokens_expected,
            "alpha": {name: m.alpha for name, m in decoder.monitors.items()},
            "costs": cells}


# the rule parameters a calibration may set (Calibration.params_for's keys)
CALIBRATED_PARAMETERS = ("tau", "gamma", "alpha")


def check_calibrated(calibrated: dict[str, dict[str, float]]) -> None:
    for rule, params in calibrated.items():
        if rule not in RULES:
            raise ValueError(f"calibrated: rule must be one of {', '.join(RULES)}; got {rule!r}")
        unknown = sorted(set(params) - set(CALIBRATED_PARAMETERS))
        if unknown:
            raise ValueError(f"calibrated[{rule!r}]: parameters must be among "
                             f"{', '.join(CALIBRATED_PARAMETERS)}; got {unknown[0]!r}")


def rule_params(config: ServeConfig, rule: str, temperature: float | None = None,
                top_p: float | None = None, **explicit: float) -> RuleParams:
    """``rule``'s parameters: those given (a request's own), else the rule's calibrated
    value (``config.calibrated``), else the fixed default (``config.rule_defaults``, the
    manifest's, else RuleParams')."""
    return RuleParams(
        rule,
        temperature=config.temperature if temperature is None else temperature,
        top_p=config.top_p if top_p is None else top_p,
        **{**config.rule_defaults, **config.calibrated.get(rule, {}), **explicit})


def default_params(config: ServeConfig) -> RuleParams:
    """The server's default rule with its defaults (calibrated where the rule has them)."""
    return rule_params(config, config.rule)


@dataclass
class ParsedRequest:
    prompt: list[int]
    max_new_tokens: int
    params: RuleParams
    num_draft_tokens: int | None  # None: the server's (planned) K
    seed: int
    eos_token_id: int | tuple[int, ...] | None
    stream: bool
    stop_sequences: list[list[int]]
    lookup_drafts: bool = False  # drafter "ngram" on a server whose drafter has a model
    guide: Guide | None = None  # what the output must follow (the model compiles it)
    logprobs: int | None = None  # top_logprobs per token (0: the token's own; None: none)


def request_drafters(config: ServeConfig) -> tuple[str, ...]:
    """The drafters a request may name: the server's, and the model-free n-gram lookup
    (every server can run it beside its own)."""
    if config.drafter in MODEL_FREE_DRAFTERS:  # the decoder runs one model-free drafter
        return (config.drafter,)
    return (config.drafter, "ngram")


# TensorRT-LLM ensemble inputs that change nothing at these values, which its clients send
# by default: accepted so those clients work unchanged, anything else refused by name
NEUTRAL_INPUTS = {
    "beam_width": (int, {1}, "1 (no beam search)"),
    "top_k": (int, {0, 1}, "0 (off) or 1 (greedy)"),
    "min_length": (int, {0, 1}, "0 or 1"),
    "repetition_penalty": (float, {1.0}, "1.0"),
    "presence_penalty": (float, {0.0}, "0.0"),
    "frequency_penalty": (float, {0.0}, "0.0"),
    "exclude_input_in_output": (bool, {True}, "true (text_output is the generated text only)"),
    "return_context_logits": (bool, {False}, "false"),
    "return_generation_logits": (bool, {False}, "false"),
}
IGNORED_INPUTS = {"pad_id": int, "length_penalty": float}  # no padding, no beams here
MAX_STOP_WORDS, MAX_STOP_WORD_TOKENS = 16, 32
# bytes per allowed token beyond which a text is refused before it is tokenised: text runs at
# about 4 bytes a token, and tokenising megabytes would hold up the instance's other requests
MAX_TOKEN_BYTES = 64
# every input of the served model that parse_request reads (triton_repo/ensemble)
REQUEST_INPUTS = ("text_input", "input_ids", "input_lengths", "max_tokens", "stream",
                  "temperature", "top_p", "random_seed", "num_draft_tokens", "drafter", "end_id",
                  "correction_rule", "tau", "gamma", "alpha", "epsilon", "delta", "stop_words",
                  "bad_words", "stop_words_ids", "stop_words_lengths",
                  "guided_decoding_guide_type", "guided_decoding_guide", "return_log_probs",
                  "top_logprobs", *NEUTRAL_INPUTS, *IGNORED_INPUTS)
# the outputs a request with logprobs gets beside the others (per token of the response)
LOGPROB_OUTPUTS = frozenset({"output_log_probs", "top_logprobs", "top_logprob_ids"})


def scalar(inputs: dict[str, np.ndarray], name: str, kind: type):
    """One value of an optional input, or None; a wrong shape or dtype names the input."""
    if name not in inputs:
        return None
    value = np.asarray(inputs[name])
    if value.size != 1:
        raise ValueError(f"{name} must hold exactly one value; got shape {list(value.shape)}")
    item = value.reshape(-1)[0]
    if kind is str:
        return item.decode("utf-8", "replace") if isinstance(item, bytes) else str(item)
    if kind is bool:
        if value.dtype != np.bool_:
            raise ValueError(f"{name} must be BOOL; got {value.dtype}")
        return bool(item)
    if kind is int and not np.issubdtype(value.dtype, np.integer):
        raise ValueError(f"{name} must be an integer tensor; got {value.dtype}")
    if kind is float and not np.issubdtype(value.dtype, np.floating):
        raise ValueError(f"{name} must be a float tensor; got {value.dtype}")
    return kind(item)


def one_text(raw: object, name: str) -> str:
    """One BYTES element as text; invalid UTF-8 is refused, naming the input."""
    if not isinstance(raw, bytes):
        return str(raw)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{name} is not valid UTF-8 ({e.reason} at byte {e.start})") from None


def prompt_text(inputs: dict[str, np.ndarray], max_input_tokens: int) -> str:
    """``text_input``'s one prompt: valid UTF-8, not empty, and no longer in bytes than
    ``max_input_tokens`` tokens could be (checked before tokenising)."""
    values = np.asarray(inputs["text_input"], dtype=object).reshape(-1)
    if values.size != 1:
        raise ValueError(f"text_input must hold exactly one prompt; got {values.size}")
    raw = values[0] if isinstance(values[0], bytes) else str(values[0]).encode()
    if len(raw) > MAX_TOKEN_BYTES * max_input_tokens:
        raise ValueError(f"text_input is {len(raw)} bytes; the limit is {max_input_tokens} "
                         "tokens")
    text = one_text(raw, "text_input")
    if not text:
        raise ValueError("text_input is empty")
    return text


def encode_prompt(inputs: dict[str, np.ndarray], tokenizer: Tokenizer,
                  max_input_tokens: int) -> list[int]:
    """``text_input`` through the engine's (or verifier's) tokenizer, with its special tokens
    (BOS), as the verifier was trained: 1 … ``max_input_tokens`` tokens."""
    ids = tokenizer.encode(prompt_text(inputs, max_input_tokens)).ids
    if not 1 <= len(ids) <= max_input_tokens:
        raise ValueError(f"text_input is {len(ids)} tokens; allowed 1..{max_input_tokens}")
    return ids


def given_ids(inputs: dict[str, np.ndarray], tokenizer: Tokenizer | None,
              max_input_tokens: int) -> list[int]:
    """``input_ids`` as sent (TensorRT-LLM's name), with ``input_lengths`` (optional) equal to
    their count and every id in the tokenizer's vocabulary (an id past the embedding would
    fail the whole running batch, not just this request)."""
    ids = np.asarray(inputs["input_ids"])
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"input_ids must be an integer tensor; got {ids.dtype}")
    prompt = ids.reshape(-1).astype(np.int64).tolist()
    if not 1 <= len(prompt) <= max_input_tokens:
        raise ValueError(f"input_ids is {len(prompt)} tokens; allowed 1..{max_input_tokens}")
    length = scalar(inputs, "input_lengths", int)
    if length is not None and length != len(prompt):
        raise ValueError(f"input_lengths must be {len(prompt)} (the number of input_ids); "
                         f"got {length}")
    if tokenizer is not None:
        vocab = tokenizer.get_vocab_size(with_added_tokens=True)
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"input_ids must be token ids in [0, {vocab - 1}]; got "
                             f"{min(prompt) if min(prompt) < 0 else max(prompt)}")
    return prompt


def prompt_ids(inputs: dict[str, np.ndarray], tokenizer: Tokenizer | None,
               max_input_tokens: int) -> list[int]:
    """The request's prompt as token ids: from exactly one of ``text_input`` (tokenised
    here) and ``input_ids``. ``tokenizer``: None where only token ids are served."""
    given = [name for name in ("text_input", "input_ids") if name in inputs]
    if len(given) != 1:
        raise ValueError("send exactly one of text_input (the prompt as text) and input_ids "
                         f"(its token ids); got {' and '.join(given) or 'neither'}")
    if given == ["input_ids"]:
        return given_ids(inputs, tokenizer, max_input_tokens)
    if tokenizer is None:
        raise ValueError("text_input: this server has no tokenizer; send input_ids")
    return encode_prompt(inputs, tokenizer, max_input_tokens)


def words(inputs: dict[str, np.ndarray], name: str) -> list[str]:
    """The non-empty strings of an optional BYTES list input (TensorRT-LLM's clients send an
    empty string for none)."""
    if name not in inputs:
        return []
    texts = [one_text(raw, name) for raw in np.asarray(inputs[name], dtype=object).reshape(-1)]
    return [text for text in texts if text]


def stop_words_from_text(inputs: dict[str, np.ndarray], tokenizer: Tokenizer | None
                         ) -> list[list[int]]:
    """``stop_words`` tokenised each on its own, without special tokens (a word must match
    generated tokens, which carry no BOS); ``bad_words`` is refused unless empty."""
    if words(inputs, "bad_words"):
        raise ValueError("bad_words: not supported by paradraft (send none or empty)")
    texts = words(inputs, "stop_words")
    if not texts:
        return []
    if tokenizer is None:
        raise ValueError("stop_words: this server has no tokenizer; send stop_words_ids")
    if len(texts) > MAX_STOP_WORDS:  # before tokenising any
        raise ValueError(f"stop_words must hold at most {MAX_STOP_WORDS} words; "
                         f"got {len(texts)}")
    out = []
    for text in texts:
        if len(text.encode()) > MAX_TOKEN_BYTES * MAX_STOP_WORD_TOKENS:
            raise ValueError(f"stop_words: each word must be 1..{MAX_STOP_WORD_TOKENS} "
                             f"tokens; got one of {len(text.encode())} bytes")
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        if not 1 <= len(ids) <= MAX_STOP_WORD_TOKENS:
            raise ValueError(f"stop_words: each word must be 1..{MAX_STOP_WORD_TOKENS} "
                             f"tokens; {text[:40]!r} is {len(ids)}")
        out.append(ids)
    return out


def stop_sequences(inputs: dict[str, np.ndarray], tokenizer: Tokenizer | None = None
                   ) -> list[list[int]]:
    """The stop words' token ids: ``stop_words`` (text, tokenised here) and
    ``stop_words_ids`` (all ids in one flat tensor) with ``stop_words_lengths`` (each word's
    length), at most MAX_STOP_WORDS words in all."""
    ids = np.asarray(inputs.get("stop_words_ids", [])).reshape(-1).tolist()
    lengths = np.asarray(inputs.get("stop_words_lengths", [])).reshape(-1).tolist()
    if len(lengths) > MAX_STOP_WORDS:
        raise ValueError(f"stop_words must hold at most {MAX_STOP_WORDS} words; "
                         f"got {len(lengths)}")
    if any(not 1 <= n <= MAX_STOP_WORD_TOKENS for n in lengths) or sum(lengths) != len(ids):
        raise ValueError(f"stop_words: each word must be 1..{MAX_STOP_WORD_TOKENS} tokens "
                         f"(stop_words_lengths {lengths} for {len(ids)} stop_words_ids)")
    starts = np.cumsum([0, *lengths]).tolist()
    sequences = [ids[a:b] for a, b in itertools.pairwise(starts)]
    sequences += stop_words_from_text(inputs, tokenizer)
    if len(sequences) > MAX_STOP_WORDS:
        raise ValueError(f"stop_words must hold at most {MAX_STOP_WORDS} words "
                         f"(stop_words and stop_words_ids together); got {len(sequences)}")
    return sequences


def parse_request(inputs: dict[str, np.ndarray], config: ServeConfig,
                  tokenizer: Tokenizer | None = None) -> ParsedRequest:
    """Validate one request's tensors (TensorRT-LLM names plus ours) against the limits;
    ``text_input`` and ``stop_words`` are tokenised with ``tokenizer`` (the engine's
    ``tokenizer.json``, a ``tokenizers.Tokenizer``)."""
    prompt = prompt_ids(inputs, tokenizer, config.max_input_tokens)
    if "max_tokens" not in inputs:
        raise ValueError("max_tokens is required")
    max_tokens = scalar(inputs, "max_tokens", int)
    room = config.max_seq_len - len(prompt)
    if not 1 <= max_tokens <= room:
        raise ValueError(f"max_tokens must be in [1, {room}] for this prompt "
                         f"({len(prompt)} tokens, max_seq_len {config.max_seq_len}); "
                         f"got {max_tokens}")
    rule = scalar(inputs, "correction_rule", str)
    temperature = scalar(inputs, "temperature", float)
    top_p = scalar(inputs, "top_p", float)
    neutral = {name: scalar(inputs, name, kind) for name, (kind, _, _) in NEUTRAL_INPUTS.items()}
    for name, value in neutral.items():
        allowed, text = NEUTRAL_INPUTS[name][1:]
        if value is not None and value not in allowed:
            raise ValueError(f"{name} must be {text} on paradraft; got {value}")
    for name, kind in IGNORED_INPUTS.items():
        scalar(inputs, name, kind)  # the type is still checked
    if neutral["top_k"] == 1:  # TensorRT-LLM's clients ask for greedy so
        if rule not in (None, "greedy"):
            raise ValueError(f"top_k 1 asks for greedy decoding; correction_rule {rule!r} "
                             "samples (send one or the other)")
        rule = "greedy"
    if rule is None:
        # sampling parameters without a rule ask for sampling: use the lossless rule
        rule = "exact" if (temperature is not None or top_p is not None) else config.rule
    if rule not in RULES:
        raise ValueError(f"correction_rule must be one of {', '.join(RULES)}; got {rule!r}")
    overrides = {name: scalar(inputs, name, float)
                 for name in ("tau", "gamma", "alpha", "epsilon", "delta")}
    params = rule_params(config, rule, temperature, top_p,
                         **{k: v for k, v in overrides.items() if v is not None})
    # None: the server's K, which its schedule (the goodput policy by default) may lower; a
    # K named here is the request's own
    k = scalar(inputs, "num_draft_tokens", int)
    if k is not None and not 0 <= k <= config.k:  # 0: this request decodes without drafts
        raise ValueError(f"num_draft_tokens must be in [0, {config.k}] (0: no speculation); "
                         f"got {k}")
    drafter = scalar(inputs, "drafter", str)
    if drafter is not None and drafter not in request_drafters(config):
        raise ValueError(f"drafter must be one of {', '.join(request_drafters(config))} on "
                         f"this server; got {drafter!r}")
    seed = scalar(inputs, "random_seed", int)
    end_id = scalar(inputs, "end_id", int)
    stream = scalar(inputs, "stream", bool)
    if seed is None:  # each request samples from its own stream: unseeded ones draw a seed
        seed = random.getrandbits(63)
    return ParsedRequest(prompt, max_tokens, params, k, seed % 2**63,
                         config.eos_token_id if end_id is None else eos_or_none(end_id),
                         bool(stream), stop_sequences(inputs, tokenizer),
                         lookup_drafts=drafter == "ngram" and config.drafter != "ngram",
                         guide=guide_of(inputs), logprobs=logprobs_of(inputs))


def logprobs_of(inputs: dict[str, np.ndarray]) -> int | None:
    """``return_log_probs`` (TensorRT-LLM's: each token's log-probability) and
    ``top_logprobs`` (ours: that many likeliest tokens beside it, which implies the first):
    the request's top_logprobs, or None for no logprobs."""
    wanted = scalar(inputs, "return_log_probs", bool)
    top = scalar(inputs, "top_logprobs", int)
    if top is None:
        return 0 if wanted else None
    if wanted is False:
        raise ValueError("top_logprobs needs return_log_probs true (or unset)")
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]; got {top}")
    return top


def row_grammar(guide: Guide, tokenizer_json: str, vocab_size: int) -> RowGrammar:
    """A fresh matcher for a request's guide, compiled (or found in the cache) in the
    request's thread, off the decode loop; ValueError names guided_decoding_guide."""
    return RowGrammar(compile_guide(guide, tokenizer_json, vocab_size), tokenizer_json,
                      vocab_size)


def guide_of(inputs: dict[str, np.ndarray]) -> Guide | None:
    """TensorRT-LLM's guided decoding inputs: the guide's type and text (a JSON schema, a
    regex, a Lark grammar; none for ``json``: any JSON object)."""
    kind = scalar(inputs, "guided_decoding_guide_type", str)
    text = scalar(inputs, "guided_decoding_guide", str)
    if kind is None:
        if text is not None:
            raise ValueError("guided_decoding_guide needs guided_decoding_guide_type (one of "
                             f"{', '.join(GUIDE_TYPES)})")
        return None
    if kind not in GUIDE_TYPES:
        raise ValueError(f"guided_decoding_guide_type must be one of {', '.join(GUIDE_TYPES)}; "
                         f"got {kind!r}")
    if kind != "json" and not text:
        raise ValueError(f"guided_decoding_guide is required for guided_decoding_guide_type "
                         f"{kind!r}")
    return Guide(kind, text or "")


def eos_or_none(end_id: int) -> int | None:
    """end_id as TensorRT-LLM reads it: -1 means "no end token" (stop at max_tokens only)."""
    if end_id < -1:
        raise ValueError(f"end_id must be -1 (none) or a token id >= 0; got {end_id}")
    return None if end_id == -1 else end_id


def finish_reason(tokens: list[int], request: ParsedRequest) -> str:
    """Why a finished request stopped, as OpenAI names it: ``length`` when it ran out of
    ``max_new_tokens`` without ending on an end id or a stop sequence, else ``stop``."""
    if len(tokens) < request.max_new_tokens:
        return "stop"
    eos = request.eos_token_id
    ends = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
    if tokens and tokens[-1] in ends:
        return "stop"
    if any(tokens[-len(stop):] == stop for stop in request.stop_sequences):
        return "stop"
    return "length"


DETOKENIZER_CONTEXT = 8  # prompt tokens a detokeniser starts from (a leading space, say)


class Detokenizer:
    """Incremental detokenisation of one request's output, special tokens (EOS, chat
    markers) left out: each ``add`` costs work in proportion to its new tokens (tokenizers'
    DecodeStream), not to the output so far. Text that ends inside a multi-byte character
    is held back until the character completes, so every piece is valid UTF-8 and the
    pieces join up to ``tokenizer.decode(ids, skip_special_tokens=True)``; ``finish``
    flushes what is still held (as U+FFFD, as that decode shows it)."""

    def __init__(self, tokenizer, prompt: Sequence[int] = ()):
        from tokenizers.decoders import DecodeStream

        self.tokenizer = tokenizer
        # the prompt's tail as context: tokenizers that drop a leading space at the start of
        # a text (SentencePiece's ▁) keep it on the first generated token
        self.context = list(prompt[-DETOKENIZER_CONTEXT:])
        self.stream = DecodeStream(ids=self.context or None, skip_special_tokens=True)
        self.ids: list[int] = []
        self.chars = 0  # characters handed out so far
        self.held = False  # the last tokens are still held back

    def add(self, ids: list[int]) -> str:
        if not ids:
            return ""
        self.ids += ids
        text = self.stream.step(self.tokenizer, ids)
        self.held = text is None
        if text is None:
            return ""
        self.chars += len(text)
        return text

    def finish(self) -> str:
        """The held-back rest (only when the output ends inside a character: the one time
        the whole output is decoded again)."""
        if not self.held:
            return ""
        self.held = False
        decode = self.tokenizer.decode
        base = len(decode(self.context, skip_special_tokens=True)) if self.context else 0
        rest = decode(self.context + self.ids, skip_special_tokens=True)[base + self.chars:]
        self.chars += len(rest)
        return rest
