"""OpenAI's ``logprobs`` objects from the served model's per-token outputs
(``output_ids``, ``output_log_probs``, ``top_logprobs``, ``top_logprob_ids``): chat's
``{"content": [{token, logprob, bytes, top_logprobs}]}`` and the completions API's
``{tokens, token_logprobs, top_logprobs, text_offset}``.

A token's text is its own bytes (a byte-level BPE token may hold part of a UTF-8 character:
``bytes`` keeps them whole, ``token`` decodes them with replacement characters, as OpenAI
does).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np


@dataclass
class TokenLogprob:
    """One emitted token: its id, its log-probability and the likeliest (id, logprob)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


def read_entries(outputs: dict[str, np.ndarray]) -> list[TokenLogprob]:
    """A response's tokens and their logprobs, from its output arrays."""
    ids = outputs.get("output_ids", np.zeros(0, np.int32)).reshape(-1).tolist()
    logprobs = outputs.get("output_log_probs", np.zeros(0, np.float32)).reshape(-1).tolist()
    top_values = outputs.get("top_logprobs", np.zeros((len(ids), 0), np.float32))
    top_ids = outputs.get("top_logprob_ids", np.zeros((len(ids), 0), np.int32))
    top_values = top_values.reshape(len(ids), -1).tolist() if ids else []
    top_ids = top_ids.reshape(len(ids), -1).tolist() if ids else []
    return [TokenLogprob(i, lp, list(zip(best_ids, best, strict=True)))
            for i, lp, best_ids, best in zip(ids, logprobs, top_ids, top_values, strict=True)]


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the printable character that stands for each
    byte in a byte-level BPE vocabulary."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


class TokenTexts:
    """Each token id's bytes and text under one tokenizer (a ``tokenizers.Tokenizer``)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.byte_level = type(tokenizer.decoder).__name__ == "ByteLevel"
        self.cache: dict[int, bytes] = {}

    def bytes_of(self, token_id: int) -> bytes:
        raw = self.cache.get(token_id)
        if raw is None:
            piece = self.tokenizer.id_to_token(token_id) or ""
            decoder = _byte_decoder()
            if self.byte_level and all(c in decoder for c in piece):
                raw = bytes(decoder[c] for c in piece)
            else:  # an added or special token, or a vocabulary that is not byte-level
                raw = self.tokenizer.decode([token_id], skip_special_tokens=False).encode()
            self.cache[token_id] = raw
        return raw

    def text_of(self, token_id: int) -> str:
        return self.bytes_of(token_id).decode("utf-8", errors="replace")

    def entry(self, token_id: int, logprob: float) -> dict:
        return {"token": self.text_of(token_id), "logprob": logprob,
                "bytes": list(self.bytes_of(token_id))}


def chat_logprobs(texts: TokenTexts, entries: list[TokenLogprob]) -> dict:
    """Chat's ``choices[i].logprobs`` (a streamed chunk's: its tokens only)."""
    return {"content": [{**texts.entry(e.token_id, e.logprob),
                         "top_logprobs": [texts.entry(i, lp) for i, lp in e.top]}
                        for e in entries], "refusal": None}


def completion_logprobs(texts: TokenTexts, entries: list[TokenLogprob], offset: int = 0
                        ) -> tuple[dict, int]:
    """The completions API's ``choices[i].logprobs``, its text offsets counted from
    ``offset`` (the characters of the completion before these tokens), and the offset
    after them."""
    tokens, offsets = [], []
    for e in entries:
        offsets.append(offset)
        tokens.append(texts.text_of(e.token_id))
        offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{texts.text_of(i): lp for i, lp in e.top} for e in entries],
            "text_offset": offsets}, offset
