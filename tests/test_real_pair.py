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
