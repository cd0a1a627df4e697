"""Grammars that constrain a request's output (a JSON schema, any JSON object, a regular
expression, a Lark grammar), compiled and followed by llguidance: one matcher per row.

Under speculation a grammar meets the drafts at one point. Each verified position's logits are
masked by the grammar's state after the drafts before it, so a draft the grammar forbids has
probability 0 there and is rejected, and the positions after it are never reached. The
matcher walks the drafts to make the masks and rolls back; after the correction it advances
by what the row emitted, exactly as the KV cache does. Masked logits are what plain
constrained decoding would see at each position, so every correction rule keeps its
guarantee (greedy: the same tokens; ``exact``: the masked verifier's distribution). Where the
grammar forces tokens (a key name, ``":"``) it proposes them itself (``forced``).

llguidance (MIT) rather than xgrammar, measured at Qwen2.5's 151,936-token vocabulary
(lab/grammar_mask_cost.py, docs/results.md): xgrammar fills a mask faster, but either costs
well under 1 % of a plain step of the 1.5B model on a CPU, while llguidance compiles a
schema about 20 times faster (that cost is on the request's path) and needs neither
transformers nor torch: it reads tokenizer.json.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
from torch import Tensor

# TensorRT-LLM's guided_decoding_guide_type names (ebnf_grammar is Lark here: llguidance's
# grammar language)
GUIDE_TYPES = ("json", "json_schema", "regex", "lark")
# JSON is written compact (no whitespace between tokens; a schema's "x-guidance" may say
# otherwise): whitespace a grammar allows anywhere is where a model can loop until its token
# limit, and compact JSON leaves more tokens for the grammar to force
COMPACT = {"whitespace_flexible": False}


def _need_llguidance():
    try:
        import llguidance
    except ImportError as e:  # a pinned dependency: only a broken install lacks it
        raise ImportError("constrained decoding needs llguidance (pip install "
                          "llguidance==1.9.1)") from e
    return llguidance


@dataclass(frozen=True)
class Guide:
    """What a request constrains its output to: ``kind`` (one of GUIDE_TYPES) and its text
    (the schema as JSON, the pattern, the grammar; ignored for ``json``: any JSON object)."""

    kind: str
    text: str = ""


def response_format_guide(response_format: object, schema_required: bool = False
                          ) -> Guide | None:
    """OpenAI's ``response_format`` as a guide: None for text (or none), any JSON object for
    ``json_object``, the schema of ``json_schema`` (any JSON object where it gives none,
    unless ``schema_required``); ValueError naming response_format otherwise."""
    if response_format is None or response_format == {"type": "text"}:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "json_object":
        return Guide("json")
    spec = response_format.get("json_schema") if kind == "json_schema" else None
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(spec, dict) or not isinstance(
            schema if schema_required else schema or {}, dict):
        raise ValueError("response_format must be {\"type\": \"text\"}, {\"type\": "
                         "\"json_object\"} or {\"type\": \"json_schema\", \"json_schema\": "
                         f"{{\"name\": ..., \"schema\": {{...}}}}}}; got {response_format!r}")
    return Guide("json_schema", json.dumps(schema or {"type": "object"}))


@lru_cache(maxsize=16)
def grammar_tokenizer(tokenizer_json: str, vocab_size: int):
    """llguidance's view of a tokenizer, its masks ``vocab_size`` wide (the model's, which may
    pad past the tokenizer's ids). About a second to build: cached."""
    return _need_llguidance().LLTokenizer(tokenizer_json, n_vocab=vocab_size)


@lru_cache(maxsize=256)
def compile_guide(guide: Guide, tokenizer_json: str, vocab_size: int) -> str:
    """The guide as an llguidance grammar, checked against the tokenizer; ValueError naming
    ``guided_decoding_guide`` and the reason (a ``$ref`` that points nowhere, an unknown
    format, a pattern that does not compile). Cached by guide: a schema sent again is not
    compiled again."""
    llg = _need_llguidance()
    if guide.kind not in GUIDE_TYPES:
        raise ValueError(f"guided_decoding_guide_type must be one of {', '.join(GUIDE_TYPES)}; "
                         f"got {guide.kind!r}")
    if guide.kind == "json":
        grammar = llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=COMPACT)
    elif guide.kind == "json_schema":
        try:
            schema = json.loads(guide.text)
        except ValueError as e:
            raise ValueError(f"guided_decoding_guide: the JSON schema is not JSON ({e})") from None
        if not isinstance(schema, dict):
            raise ValueError("guided_decoding_guide: a JSON schema must be an object")
        try:
            grammar = llg.LLMatcher.grammar_from_json_schema(schema, defaults=COMPACT)
        except ValueError as e:
            raise ValueError(f"guided_decoding_guide: {e}") from None
    elif guide.kind == "regex":
        grammar = llg.LLMatcher.grammar_from_regex(guide.text)
    else:
        grammar = llg.LLMatcher.grammar_from_lark(guide.text)
    error = llg.LLMatcher.validate_grammar(grammar, grammar_tokenizer(tokenizer_json,
                                                                      vocab_size))
    if error and not error.startswith("WARNING"):
        raise ValueError(f"guided_decoding_guide: {error.strip()}")
    return grammar


class RowGrammar:
    """One row's matcher: the masks of a round's verified positions, the advance after it,
    and the tokens the grammar forces next."""

    def __init__(self, grammar: str, tokenizer_json: str, vocab_size: int):
        llg = _need_llguidance()
        self.matcher = llg.LLMatcher(grammar_tokenizer(tokenizer_json, vocab_size), grammar)
        if self.matcher.is_error():
            raise ValueError(f"guided_decoding_guide: {self.matcher.get_error()}")
        self.words = (vocab_size + 31) // 32

    def masks(self, drafts: list[int], out: np.ndarray) -> int:
        """Fill ``out[i]`` (int32 bitmasks, one bit per token) with the tokens the grammar
        allows at verified position i, after drafts[:i]; positions past the first draft it
        forbids allow all (they are never reached). Returns how many drafts it allows in a
        row. The matcher ends where it began."""
        out.fill(-1)
        self.matcher.unsafe_compute_mask_ptr(out[0].ctypes.data, out[0].nbytes)
        allowed = self.matcher.validate_tokens(drafts)
        for i in range(allowed):
            self.matcher.consume_token(drafts[i])
            self.matcher.unsafe_compute_mask_ptr(out[i + 1].ctypes.data, out[i + 1].nbytes)
        if allowed:
            self.matcher.rollback(allowed)
        return allowed

    def advance(self, tokens: list[int]) -> list[int]:
        """The row emitted ``tokens`` (each allowed by the masks that chose it); returns those
        up to where the grammar is complete (a round may emit past it: an end token after
        the closing brace), so a constrained row ends where plain decoding would."""
        for i, token in enumerate(tokens):
            if self.matcher.is_stopped():
                return tokens[:i]
            if not self.matcher.consume_token(token):
                raise RuntimeError(f"the grammar refused emitted token {token}: "
                                   f"{self.matcher.get_error()}")
        return tokens

    def forced(self) -> list[int]:
        """The tokens the grammar allows alone from here (none when it allows a choice)."""
        return self.matcher.compute_ff_tokens()

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more but the end of the sequence."""
        return self.matcher.is_stopped()


def allowed_tokens(bitmasks: np.ndarray, vocab_size: int) -> Tensor:
    """Bool [..., vocab_size] from int32 bitmasks [..., words] (bit j of word w: token
    32 w + j), vectorised."""
    bits = torch.from_numpy(bitmasks).unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)
    return (bits & 1).bool().flatten(-2)[..., :vocab_size]
