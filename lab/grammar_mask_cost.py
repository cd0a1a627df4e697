"""Mask cost per token of two grammar engines, llguidance and xgrammar, on one tokenizer (by
default Qwen2.5's, 151,936 ids): for each JSON schema, compile it, then walk a valid instance's
tokens, timing the fill of the next-token bitmask before each token and the advance after it.
Writes JSON (per engine: compile ms, mask µs mean / p50 / p99 / max, advance µs).

    python lab/grammar_mask_cost.py --tokenizer DIR_WITH_TOKENIZER_JSON --out results/mask.json

Needs both engines installed (pip install llguidance xgrammar); run it alone on the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

SCHEMAS = [  # (schema, an instance of it): shapes agents and extraction apps send
    ({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
      "required": ["name", "age"]},
     {"name": "Ada Lovelace", "age": 36}),
    ({"type": "object", "properties": {
        "city": {"type": "string"}, "temperature_c": {"type": "number", "minimum": -90,
                                                       "maximum": 60},
        "conditions": {"enum": ["sunny", "cloudy", "rain", "snow"]}},
      "required": ["city", "temperature_c", "conditions"], "additionalProperties": False},
     {"city": "Lisbon", "temperature_c": 21.5, "conditions": "sunny"}),
    ({"type": "object", "properties": {"items": {"type": "array", "items": {
        "type": "object", "properties": {"sku": {"type": "string"},
                                         "quantity": {"type": "integer", "minimum": 1},
                                         "price": {"type": "number"}},
        "required": ["sku", "quantity", "price"]}}, "total": {"type": "number"}},
      "required": ["items", "total"]},
     {"items": [{"sku": "A-100", "quantity": 2, "price": 9.99},
                {"sku": "B-7", "quantity": 1, "price": 120.0}], "total": 139.98}),
    ({"type": "object", "properties": {"function": {"type": "string"}, "arguments": {
        "type": "object", "properties": {"path": {"type": "string"},
                                         "recursive": {"type": "boolean"}},
        "required": ["path"]}}, "required": ["function", "arguments"]},
     {"function": "list_files", "arguments": {"path": "src/paradraft", "recursive": True}}),
    ({"type": "object", "properties": {"result": {"anyOf": [
        {"type": "object", "properties": {"ok": {"const": True}, "value": {"type": "string"}},
         "required": ["ok", "value"]},
        {"type": "object", "properties": {"ok": {"const": False}, "error": {"type": "string"}},
         "required": ["ok", "error"]}]}}, "required": ["result"]},
     {"result": {"ok": False, "error": "file not found: config.yaml"}}),
]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(mask_us: list[float], advance_us: list[float], compile_ms: list[float]) -> dict:
    return {"tokens": len(mask_us), "compile_ms_mean": statistics.mean(compile_ms),
            "mask_us_mean": statistics.mean(mask_us), "mask_us_p50": percentile(mask_us, 0.5),
            "mask_us_p99": percentile(mask_us, 0.99), "mask_us_max": max(mask_us),
            "advance_us_mean": statistics.mean(advance_us)}


def run_llguidance(tokenizer_json: Path, walks: list[tuple[dict, list[int]]]) -> dict:
    import llguidance
    import llguidance.numpy
    import numpy as np

    t0 = time.perf_counter()
    tok = llguidance.LLTokenizer(str(tokenizer_json))
    setup_s = time.perf_counter() - t0
    mask = llguidance.numpy.allocate_token_bitmask(1, tok.vocab_size)
    mask_us, advance_us, compile_ms = [], [], []
    for schema, ids in walks:
        t0 = time.perf_counter()
        matcher = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False}))
        compile_ms.append((time.perf_counter() - t0) * 1e3)
        assert not matcher.is_error(), matcher.get_error()
        for token in ids:
            t0 = time.perf_counter()
            llguidance.numpy.fill_next_token_bitmask(matcher, mask)
            t1 = time.perf_counter()
            assert (mask[0, token // 32] >> (token % 32)) & 1, (schema, token)
            assert matcher.consume_token(token), matcher.get_error()
            t2 = time.perf_counter()
            mask_us.append((t1 - t0) * 1e6)
            advance_us.append((t2 - t1) * 1e6)
        np.testing.assert_equal(matcher.is_accepting(), True)
    return {"setup_s": setup_s, **summary(mask_us, advance_us, compile_ms)}


def run_xgrammar(tokenizer_dir: Path, walks: list[tuple[dict, list[int]]]) -> dict:
    import transformers
    import xgrammar

    t0 = time.perf_counter()
    hf = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=json.loads(
        (tokenizer_dir / "config.json").read_text())["vocab_size"])
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    setup_s = time.perf_counter() - t0
    mask = xgrammar.allocate_token_bitmask(1, info.vocab_size)
    mask_us, advance_us, compile_ms = [], [], []
    for schema, ids in walks:
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                separators=(",", ":"))
        matcher = xgrammar.GrammarMatcher(compiled)
        compile_ms.append((time.perf_counter() - t0) * 1e3)
        for token in ids:
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(mask)
            t1 = time.perf_counter()
            assert (int(mask[0, token // 32]) >> (token % 32)) & 1, (schema, token)
            assert matcher.accept_token(token)
            t2 = time.perf_counter()
            mask_us.append((t1 - t0) * 1e6)
            advance_us.append((t2 - t1) * 1e6)
        assert matcher.is_terminated() or matcher.accept_token(info.stop_token_ids[0])
    return {"setup_s": setup_s, **summary(mask_us, advance_us, compile_ms)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", type=Path, required=True,
                    help="a dir with tokenizer.json and config.json (vocab_size)")
    ap.add_argument("--repeats", type=int, default=3, help="walks of every schema")
    ap.add_argument("--out", type=Path, default=Path("results/grammar_mask_cost.json"))
    args = ap.parse_args()
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(args.tokenizer / "tokenizer.json"))
    walks = [(schema, tokenizer.encode(json.dumps(instance, separators=(",", ":")),
                                       add_special_tokens=False).ids)
             for schema, instance in SCHEMAS] * args.repeats
    out = {"tokenizer": str(args.tokenizer), "vocab_size": tokenizer.get_vocab_size(),
           "schemas": len(SCHEMAS), "repeats": args.repeats,
           "llguidance": run_llguidance(args.tokenizer / "tokenizer.json", walks),
           "xgrammar": run_xgrammar(args.tokenizer, walks)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
