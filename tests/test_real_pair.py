"""The Qwen2.5-Coder pair (1.5B verifier, 0.5B draft; Q4_K_M GGUFs): fidelity on the real
files. Opt-in (`make test-real-pair`, marker ``real_pair``): the files are a 1.6 GB download
(`paradraft fetch`), so these tests skip, saying so, where they are not cached.

- Greedy speculation through the llama.cpp engine dir (the draft model, and n-gram lookup at
  a long K) equals greedy plain decoding on the same engine, on 8 HumanEval chat prompts.
- Served through the scheduler, with the prefix cache, chunked prefill and the lazy draft
  prefill, every prompt twice (the second time a cache hit): the same greedy tokens.
- Our fp32 import of the 1.5B GGUF decodes the same greedy tokens as transformers loading
  the same file, on the same 8 prompts x 64 tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from paradraft.runtime.backends.loader import load_engines
from paradraft.runtime.checkpoints import chat_stop_token_ids, load_tokenizer
from paradraft.runtime.correction import RuleParams
from paradraft.runtime.drafters import NgramDrafter
from paradraft.runtime.speculative import SpeculativeDecoder
from paradraft.runtime.tools.bench import read_prompt_file
from paradraft.runtime.tools.fetch import model_path

pytestmark = pytest.mark.real_pair
PROMPTS, NEW_TOKENS = 8, 64


def cached(name: str) -> Path:
    path = model_path(name)
    if not path.is_file():
        pytest.skip(f"{name} is not cached at {path}: `paradraft fetch {name}`")
    return path


@pytest.fixture(scope="module")
def pair() -> tuple[Path, Path]:
    return cached("qwen2.5-coder-1.5b-instruct"), cached("qwen2.5-coder-0.5b-instruct")


@pytest.fixture(scope="module")
def engines(pair, tmp_path_factory) -> Path:
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed "
                        "(make llamacpp)")
    from paradraft.build.llamacpp import build_engines

    out = tmp_path_factory.mktemp("qwen_llamacpp")
    build_engines(pair[0], out, pair[1], max_batch_size=1, max_k=16, max_seq_len=512)
    return out


@pytest.fixture(scope="module")
def prompts(engines: Path) -> list[list[int]]:
    return read_prompt_file(f"humaneval:{PROMPTS}", engines)[0]


def test_greedy_speculation_equals_plain_decoding(engines: Path, prompts):
    verifier, drafters, _, _ = load_engines(engines)
    eos = tuple(dict.fromkeys((*verifier.config.eos_token_ids,
                               *chat_stop_token_ids(engines))))

    def decode(drafter, k: int) -> list[list[int]]:
        dec = SpeculativeDecoder(verifier, drafter, RuleParams("greedy"), k=k,
                                 max_batch_size=1, max_seq_len=512)
        out = []
        for p in prompts:  # batch 1, as the benchmarks run
            verifier.reset()
            if drafter is not None and drafter.model is not None:
                drafter.model.reset()
            out += dec.generate([p], NEW_TOKENS, eos_token_id=eos).token_ids
        return out

    plain = decode(None, 0)
    assert sum(map(len, plain)) > PROMPTS * NEW_TOKENS // 2  # real answers, not stops
    assert decode(drafters["model"], 3) == plain
    assert decode(drafters["ngram"], 16) == plain


def test_served_with_prefix_cache_hits_equals_plain_decoding(engines: Path, prompts):
    """The scheduler as `serve` runs it (2 running, 10 cache slots, 64-token prefill chunks,
    the draft model's lazy prefill, and the n-gram lookup per request as the llama.cpp default
    sizes it, K 16 beside the model's 3, with the shared lookup on, so verify passes are
    ragged): each prompt twice, the second time read from the prefix cache and drafted from
    its first answer; greedy tokens equal plain decoding's."""
    import threading

    from paradraft.runtime.scheduler import Request, Scheduler

    verifier, drafters, _, _ = load_engines(engines, slots=10)
    eos = tuple(dict.fromkeys((*verifier.config.eos_token_ids,
                               *chat_stop_token_ids(engines))))
    plain = SpeculativeDecoder(verifier, None, RuleParams("greedy"), max_batch_size=10,
                               max_seq_len=512)
    want = [plain.generate([p], NEW_TOKENS, eos_token_id=eos).token_ids[0] for p in prompts]
    verifier.reset()
    lookup = NgramDrafter(2, 12, ngram_batched_min=6, ngram_shared=True)
    dec = SpeculativeDecoder(verifier, drafters["model"], RuleParams("greedy"), k=16,
                             max_batch_size=10, max_running=2, max_seq_len=512,
                             lookup=lookup)
    sched = Scheduler(dec, prefill_chunk=64)
    runs = [(i, p) for i, p in enumerate(prompts)] * 2
    got = [[] for _ in runs]
    cached = [0] * len(runs)
    done = [threading.Event() for _ in runs]
    try:
        for j, (i, p) in enumerate(runs):
            def on_done(stats, error, j=j):
                cached[j] = -1 if error else stats.cached_tokens
                done[j].set()
            sched.submit(Request(p, NEW_TOKENS, RuleParams("greedy"), got[j].extend, on_done,
                                 eos_token_id=eos, lookup_drafts=i % 2 == 1,
                                 num_draft_tokens=16 if i % 2 else 3))
        assert all(ev.wait(600) for ev in done)
    finally:
        sched.stop()
    assert got == want + want
    assert all(n == len(p) - 1 for n, (_, p) in zip(cached[len(prompts):], runs[len(prompts):],
                                                     strict=True))


def test_fp32_import_equals_transformers(pair, engines: Path, prompts):
    """Greedy, fp32, no end ids (every prompt decodes all 64 tokens)."""
    transformers = pytest.importorskip("transformers")
    from paradraft.runtime.gguf import cached_import
    from paradraft.runtime.model import load_model

    verifier = pair[0]
    ours = load_model(cached_import(verifier))
    dec = SpeculativeDecoder(ours, None, RuleParams("greedy"), max_batch_size=PROMPTS,
                             max_seq_len=512)
    got = dec.generate(prompts, NEW_TOKENS).token_ids
    del dec, ours
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        verifier.parent, gguf_file=verifier.name, dtype=torch.float32).eval()
    ref.generation_config.eos_token_id = None  # decode all 64 tokens, as ours does
    text = load_tokenizer(engines)
    with torch.no_grad():
        for i, p in enumerate(prompts):  # one at a time: no padding in the reference
            out = ref.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False,
                               pad_token_id=0)
            want = out[0, len(p):].tolist()
            assert got[i] == want, (f"prompt {i}: ours {text.decode(got[i])!r} vs "
                                    f"transformers {text.decode(want)!r}")


JSON_PROMPTS = 6  # of prompts/json_extraction.jsonl


def test_constrained_greedy_speculation_equals_constrained_plain_decoding(engines: Path):
    """JSON extraction on the real pair: with each request's schema, greedy speculation with
    the draft model, the n-gram lookup, the suffix drafter (serve's default for llama.cpp
    engine dirs, K 16) and the grammar's own proposals emits exactly what
    constrained plain decoding emits; every output that ended parses and validates."""
    import json

    import jsonschema

    from paradraft.runtime.grammar import Guide
    from paradraft.runtime.tools.bench import matchers

    path = Path(__file__).resolve().parents[1] / "prompts" / "json_extraction.jsonl"
    prompts, stop, guides = read_prompt_file(path, engines)
    prompts, guides = prompts[:JSON_PROMPTS], guides[:JSON_PROMPTS]
    verifier, drafters, _, _ = load_engines(engines)
    eos = tuple(dict.fromkeys((*verifier.config.eos_token_ids, *stop)))
    tokenizer_json = str(engines / "tokenizer.json")

    def decode(drafter, k: int) -> tuple[list[list[int]], int]:
        dec = SpeculativeDecoder(verifier, drafter, RuleParams("greedy"), k=k,
                                 max_batch_size=1, max_seq_len=512)
        out, accepted = [], 0
        for p, g in zip(prompts, guides, strict=True):
            verifier.reset()
            if drafter is not None and drafter.model is not None:
                drafter.model.reset()
            result = dec.generate([p], 160, eos_token_id=eos,
                                  grammars=matchers([g], tokenizer_json, verifier))
            out += result.token_ids
            accepted += result.stats.accepted_tokens
        return out, accepted

    plain, _ = decode(None, 0)
    for name, k in (("model", 4), ("ngram", 8), ("suffix", 16), ("grammar", 8)):
        got, accepted = decode(drafters[name], k)
        assert got == plain, name
        assert accepted > 0, name
    tokenizer = load_tokenizer(engines)
    ended = [(g, ids) for g, ids in zip(guides, plain, strict=True) if len(ids) < 160]
    assert len(ended) >= JSON_PROMPTS - 1
    for guide, ids in ended:
        assert isinstance(guide, Guide)
        jsonschema.validate(json.loads(tokenizer.decode(ids, skip_special_tokens=True)),
                            json.loads(guide.text))


def test_logprobs_of_speculation_equal_plain_decodings(engines: Path, prompts):
    """The draft model's greedy speculation reports plain decoding's log-probabilities
    (within 1e-4) and top 5 on the llama.cpp engines."""
    verifier, drafters, _, _ = load_engines(engines)
    results = []
    for drafter, k in ((None, 0), (drafters["model"], 4)):
        dec = SpeculativeDecoder(verifier, drafter, RuleParams("greedy"), k=k,
                                 max_batch_size=1, max_seq_len=512)
        out = []
        for p in prompts[:3]:
            verifier.reset()
            if drafter is not None:
                drafter.model.reset()
            out.append(dec.generate([p], 32, logprobs=5))
        results.append(out)
    # llama.cpp's quantized matmuls round a verify pass's rows differently from a one-token
    # step (the tokens stay the same): the log-probabilities agree to about 1e-2, not the
    # 1e-4 of the fp32 engines (tests/test_logprobs.py, tests/test_openai.py)
    worst = worst_top = 0.0
    for plain, spec in zip(*results, strict=True):
        assert spec.token_ids == plain.token_ids and spec.stats.accepted_tokens > 0
        for (lp, best), (lp0, best0) in zip(spec.logprobs[0], plain.logprobs[0], strict=True):
            worst = max(worst, abs(lp - lp0))
            worst_top = max(worst_top, *(abs(a - b) for (i, a), (j, b) in zip(
                best, best0, strict=True) if i == j))
    print(f"largest logprob difference, speculation against plain: {worst:.4f} (the "
          f"emitted tokens), {worst_top:.4f} (the top 5)")
    assert worst <= 0.05, worst


def test_qwens_template_renders_tools_and_a_named_call_follows_its_schema(engines: Path):
    """Qwen2.5's own chat template renders the tools (no Hermes text of ours), and a named
    tool choice makes the 1.5B model write one call whose arguments validate."""
    import json

    import jsonschema

    from paradraft.runtime.checkpoints import format_chat, renders_tools
    from paradraft.runtime.grammar import Guide
    from paradraft.runtime.serving.openai_tools import (
        call_guide,
        parse_calls,
        parse_tools,
        tags_are_tokens,
        template_messages,
    )
    from paradraft.runtime.tools.bench import matchers

    weather = {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False}}}
    tools = parse_tools([weather], {"type": "function", "function": {"name": "get_weather"}})
    assert renders_tools(engines)
    messages, definitions = template_messages(
        [{"role": "user", "content": "How warm is it in Lisbon, in celsius?"}], tools, True)
    text = format_chat(engines, messages, tools=definitions)
    assert "<tools>" in text and '"name": "get_weather"' in text
    tokenizer = load_tokenizer(engines)
    verifier, drafters, _, _ = load_engines(engines)
    eos = tuple(dict.fromkeys((*verifier.config.eos_token_ids,
                               *chat_stop_token_ids(engines))))
    dec = SpeculativeDecoder(verifier, drafters["model"], RuleParams("greedy"), k=4,
                             max_batch_size=1, max_seq_len=512)
    assert tags_are_tokens(tokenizer)  # Qwen2.5's vocabulary holds them: named as tokens
    grammar = matchers([Guide("lark", call_guide(tools, True))],
                       str(engines / "tokenizer.json"), verifier)
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    out = dec.generate([ids], 80, eos_token_id=eos, grammars=grammar).token_ids[0]
    content, calls = parse_calls(tokenizer.decode(out, skip_special_tokens=True))
    assert content is None and len(calls) == 1, tokenizer.decode(out)
    arguments = json.loads(calls[0]["function"]["arguments"])
    jsonschema.validate(arguments, weather["function"]["parameters"])
    assert arguments["city"] == "Lisbon"
