"""The llama.cpp backend (runtime/backends/llamacpp.py, build/llamacpp.py) on tiny random
qwen2 GGUFs: its logits against our torch decoder on the imported weights, rollback, greedy
speculation equal to greedy plain decoding through the engine dir, and the refusals.

llama-cpp-python compiles from its sdist (`make llamacpp`), so these tests skip, saying so,
where it is not installed; `make test-llamacpp` installs it and runs them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from paradraft.cli.main import main
from paradraft.runtime import gguf as g
from paradraft.runtime.backends.loader import load_engines
from paradraft.runtime.correction import RuleParams
from paradraft.runtime.drafters import SuffixDrafter
from paradraft.runtime.model import load_config, load_model, new_kv_cache
from paradraft.runtime.speculative import SpeculativeDecoder

pytest.importorskip("gguf")
pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (make llamacpp)")
from test_gguf import tiny_tokenizer_meta, write_tiny_gguf

from paradraft.runtime.backends.llamacpp import LlamaCppModel


def sharpen_gguf(path: Path) -> None:
    """Scale the F32 output norm so the random model's next-token distributions are peaked:
    greedy choices then have no near-ties for two kernels' rounding to flip."""
    reader = __import__("gguf").GGUFReader(str(path), "r+")
    for t in reader.tensors:
        if t.name == "output_norm.weight":
            t.data[:] = t.data * 8.0


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory) -> tuple[Path, Path]:
    """A qwen2 verifier (Q8_0) and a different random draft (Q4_K) over one tokenizer."""
    d = tmp_path_factory.mktemp("tiny_qwen2")
    meta = tiny_tokenizer_meta()
    verifier = write_tiny_gguf(d / "verifier.gguf", meta, qtype="Q8_0", arch="qwen2")
    draft = write_tiny_gguf(d / "draft.gguf", meta, qtype="Q8_0", arch="qwen2", seed=1)
    for f in (verifier, draft):
        sharpen_gguf(f)
    return verifier, draft


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_logits_match_our_decoder_on_the_same_file(tmp_path: Path, qtype: str):
    """llama.cpp's logits at every position against our fp32 decoder on the imported
    weights. llama.cpp quantizes the activations to 8 bits before each product, so they
    agree to a tolerance, not bit for bit; the argmax agrees wherever our top two logits are
    further apart than that."""
    path = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_tokenizer_meta(), qtype=qtype,
                           arch="qwen2")
    ours = load_model(g.import_gguf(path, tmp_path / "hf"))
    engine = LlamaCppModel(path, ours.config, 1, 64, threads=1)
    ids = torch.tensor([[1, 40, 198, 60, 30, 216, 33, 34, 2, 77, 91, 5]])
    pos = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        expected, _ = ours(ids, pos, new_kv_cache(ours.config, 1, 64, torch.float32),
                           kv_len=ids.shape[1])
    got, _ = engine(ids, pos)
    assert got.shape == expected.shape
    scale = float(expected.abs().max())
    assert scale > 0.1  # the comparison means something
    gap = float((got - expected).abs().max())
    assert gap < 0.05 * scale
    top2 = expected.topk(2, -1).values
    clear = (top2[..., 0] - top2[..., 1]) > 2 * gap
    assert clear.sum() >= ids.shape[1] // 2
    assert torch.equal(got.argmax(-1)[clear], expected.argmax(-1)[clear])


def test_rows_are_sequences_and_rollback_drops_the_tail(tiny_pair):
    """Rows keep separate caches; feeding a row from an earlier position drops what it held
    from there (the decoder's rollback), so the logits equal a fresh decode of the kept
    tokens; a gap is refused by name."""
    verifier, _ = tiny_pair
    config = load_config(g.import_gguf(verifier, verifier.parent / "cfg", weights=False))
    engine = LlamaCppModel(verifier, config, 2, 64, threads=1)
    a = torch.tensor([[5, 6, 7, 8, 9, 10]])
    b = torch.tensor([[50, 60, 70, 80, 90, 100]])
    pos = torch.arange(6)[None]
    engine(torch.cat([a, b]), torch.cat([pos, pos]))
    # row 0 rewrites positions 3..5 with row 1's tokens; row 1 is untouched
    got, _ = engine(b[:, 3:], pos[:, 3:], rows=torch.tensor([0]))
    fresh = LlamaCppModel(verifier, config, 1, 64, threads=1)
    want, _ = fresh(torch.cat([a[:, :3], b[:, 3:]], 1), pos)
    np.testing.assert_allclose(got.numpy(), want[:, 3:].numpy(), atol=1e-4)
    next_b, _ = engine(torch.tensor([[7]]), torch.tensor([[6]]), rows=torch.tensor([1]))
    want_b, _ = fresh(torch.cat([b, torch.tensor([[7]])], 1), torch.arange(7)[None])
    np.testing.assert_allclose(next_b[:, 0].numpy(), want_b[:, 6].numpy(), atol=1e-4)
    with pytest.raises(ValueError, match="row 1 is fed from position 9"):
        engine(torch.tensor([[1]]), torch.tensor([[9]]), rows=torch.tensor([1]))
    with pytest.raises(ValueError, match="audit=True"):
        engine(a, pos, audit=True)


def test_ragged_rows_feed_only_their_own_tokens(tiny_pair):
    """``num_tokens``: a row feeds its first n tokens only (a verify pass whose rows drafted
    different counts); its logits equal a padded call's there, later positions repeat its
    last, and its cache holds n positions."""
    verifier, _ = tiny_pair
    config = load_config(g.import_gguf(verifier, verifier.parent / "cfg", weights=False))
    engine = LlamaCppModel(verifier, config, 2, 64, threads=1)
    tokens = torch.tensor([[5, 6, 7, 8], [50, 60, 70, 80]])
    pos = torch.arange(4).expand(2, -1)
    padded, _ = engine(tokens, pos)
    engine.reset()
    got, _ = engine(tokens, pos, num_tokens=torch.tensor([4, 2]))
    np.testing.assert_allclose(got[0].numpy(), padded[0].numpy(), atol=1e-4)
    np.testing.assert_allclose(got[1, :2].numpy(), padded[1, :2].numpy(), atol=1e-4)
    assert torch.equal(got[1, 2:], got[1, 1:2].expand(2, -1))
    # row 1 holds positions 0, 1: the next call goes on from 2; from 3 is a gap
    with pytest.raises(ValueError, match="row 1 is fed from position 3"):
        engine(torch.tensor([[1]]), torch.tensor([[3]]), rows=torch.tensor([1]))
    nxt, _ = engine(tokens[1:, 2:], pos[1:, 2:], rows=torch.tensor([1]))
    np.testing.assert_allclose(nxt.numpy(), padded[1:, 2:].numpy(), atol=1e-4)
    for bad in ([0, 2], [5, 1], [1]):
        with pytest.raises(ValueError, match="num_tokens must be"):
            engine(tokens, pos, num_tokens=torch.tensor(bad))
    with pytest.raises(ValueError, match="exclusive"):
        engine(tokens, pos, num_tokens=torch.tensor([1, 1]),
               output_index=torch.tensor([[0], [0]]))


@pytest.fixture(scope="module")
def tiny_engines(tiny_pair, tmp_path_factory) -> Path:
    verifier, draft = tiny_pair
    out = tmp_path_factory.mktemp("llamacpp_engines")
    main(["build", "--backend", "llamacpp", "--verifier", str(verifier), "--draft", str(draft),
          "--max-batch-size", "3", "--max-k", "4", "--max-seq-len", "96", "--out", str(out)])
    return out


def test_engine_dir_stands_alone(tiny_engines: Path, tiny_pair):
    manifest = json.loads((tiny_engines / "manifest.json").read_text())
    assert manifest["backend"] == "llamacpp"
    assert manifest["drafters"] == {"model": "draft"}
    assert set(manifest["checksums"]) == {"verifier.gguf", "draft.gguf", "tokenizer.json"}
    assert (tiny_engines / "verifier.gguf").read_bytes() == tiny_pair[0].read_bytes()
    verifier, drafters, tokenizer, _ = load_engines(tiny_engines, threads=1)
    assert tokenizer == tiny_engines / "tokenizer.json"
    assert sorted(drafters) == ["model", "ngram", "suffix"]  # the model-free ones: always
    assert verifier.owns_cache and drafters["model"].model.threads == 1


@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_greedy_speculation_equals_plain_decoding(tiny_engines: Path, drafter: str,
                                                  monkeypatch):
    """Ragged batch of three, K=3: the random draft is rejected often, so every round rolls
    llama.cpp's caches back; the tokens equal plain greedy decoding's."""
    verifier, drafters, _, _ = load_engines(tiny_engines, threads=1)
    prompts = [[5, 6, 7, 8, 9], [40, 41], [100, 101, 102, 103, 104, 105, 106, 5, 6, 7]]
    plain = SpeculativeDecoder(verifier, None, RuleParams("greedy"), max_batch_size=3,
                               max_seq_len=96).generate(prompts, 24)
    verifier.reset()
    dec = SpeculativeDecoder(verifier, drafters[drafter], RuleParams("greedy"), k=3,
                             max_batch_size=3, max_seq_len=96)
    calls = []  # (tokens given, tokens fed) of each call: a row that drafted fewer feeds fewer
    call = LlamaCppModel.__call__

    def spy(self, tokens, *args, num_tokens=None, **kwargs):
        calls.append((tokens.numel(), tokens.numel() if num_tokens is None
                      else int(num_tokens.sum())))
        return call(self, tokens, *args, num_tokens=num_tokens, **kwargs)

    monkeypatch.setattr(LlamaCppModel, "__call__", spy)
    spec = dec.generate(prompts, 24)
    assert spec.token_ids == plain.token_ids
    assert spec.stats.draft_tokens > 0
    if drafter == "ngram":  # lookups find different counts per row: ragged passes
        assert any(fed < given for given, fed in calls)
    if drafter == "model":  # a random draft: rejections, so rollbacks happened
        assert spec.stats.rollbacks > 0


def test_served_with_cache_hits_chunks_and_a_lazy_draft_equals_plain(tiny_engines: Path):
    """The scheduler over llama.cpp sequences: 2 running of 4 cache slots, prompts that
    share prefixes (hits), a long prompt read in chunks beside a running request, the draft
    model's lazy prefill; every request's tokens equal plain greedy decoding's alone."""
    import threading

    from paradraft.runtime.scheduler import Request, Scheduler

    verifier, drafters, _, _ = load_engines(tiny_engines, threads=1, slots=4)
    base = list(range(5, 23))  # 18 tokens: a preamble worth copying between sequences
    prompts = [[*base, 40, 41], [*base, 40, 41, 42], [*base, 60], (base * 4)[:45], [70, 71],
               [*base, 40, 41]]
    plain = SpeculativeDecoder(verifier, None, RuleParams("greedy"), max_batch_size=4,
                               max_seq_len=96)
    want = [plain.generate([p], 20).token_ids[0] for p in prompts]
    verifier.reset()
    dec = SpeculativeDecoder(verifier, drafters["model"], RuleParams("greedy"), k=3,
                             max_batch_size=4, max_running=2, max_seq_len=96)
    sched = Scheduler(dec, prefill_chunk=8)
    got, cached = [[] for _ in prompts], [0] * len(prompts)
    try:
        # two at a time, the second joining a round; 5 repeats 0; 2 and 3 share only the
        # preamble with 0 and 1, whose slots they leave be: they take empty ones, into
        # which the preamble is copied
        for pair in ((0, 1), (2, 3), (5, 4)):
            done = [threading.Event() for _ in pair]
            for i, ev in zip(pair, done, strict=True):
                def on_done(stats, error, i=i, ev=ev):
                    cached[i] = stats.cached_tokens
                    ev.set()
                sched.submit(Request(prompts[i], 20, RuleParams("greedy"), got[i].extend,
                                     on_done, num_draft_tokens=None if i % 2 else 0))
            assert all(ev.wait(60) for ev in done)
    finally:
        sched.stop()
    assert got == want
    # 1 copies 0's prompt if 0 was read by the time 1 is admitted (the two arrive together)
    assert cached[0] == 0 and cached[1] in (0, len(prompts[0]))
    assert cached[2:4] == [len(base), len(base)]
    assert cached[5] == len(prompts[5]) - 1


def test_lookup_rows_drafting_past_the_models_k_keep_the_draft_cache_consistent(
        tiny_engines: Path):
    """A lookup row (K 4) beside a draft-model row (K 1) in one round: the lookup row may
    advance past what the draft model fed it, so its draft cache is trusted only up to the
    newest token it held (else the next model round feeds it past a gap); both equal plain."""
    import threading

    from paradraft.runtime.drafters import NgramDrafter
    from paradraft.runtime.scheduler import Request, Scheduler

    verifier, drafters, _, _ = load_engines(tiny_engines, threads=1, slots=3)
    # the random verifier falls into loops of its own, which the lookup then drafts whole
    loop = [7, 8, 9, 10, 11, 12] * 2
    prompts = [loop, [30, 31, 32, 33], [*loop[:8], 50]]
    plain = SpeculativeDecoder(verifier, None, RuleParams("greedy"), max_batch_size=3,
                               max_seq_len=96)
    want = [plain.generate([p], 64).token_ids[0] for p in prompts]
    verifier.reset()
    dec = SpeculativeDecoder(verifier, drafters["model"], RuleParams("greedy"), k=4,
                             max_batch_size=3, max_seq_len=96, lookup=NgramDrafter(1, 4))
    sched = Scheduler(dec)
    got, errors, done = [[] for _ in prompts], [], [threading.Event() for _ in prompts]
    try:
        for i, p in enumerate(prompts):
            def on_done(stats, error, i=i):
                errors.append(error)
                done[i].set()
            sched.submit(Request(p, 64, RuleParams("greedy"), got[i].extend, on_done,
                                 lookup_drafts=i != 1, num_draft_tokens=4 if i != 1 else 1))
        assert all(ev.wait(60) for ev in done)
    finally:
        sched.stop()
    assert errors == [None] * 3
    assert got == want


def test_serve_defaults_for_llama_cpp_engines(tiny_engines: Path):
    import argparse

    from paradraft.cli import serve

    def config(*argv):
        parser = argparse.ArgumentParser()
        serve.add_parser(parser.add_subparsers())
        return serve.serve_config(parser.parse_args(["serve", "--engines", str(tiny_engines),
                                                     *argv]))

    default = config()  # the engines' max_k is 4
    assert (default.drafter, default.k, default.draft_len_schedule) == ("suffix", 4, {1: 4})
    assert default.suffix_options == SuffixDrafter().__dict__  # SuffixDrafter's defaults
    assert config("--suffix-batched-min-prob", "0.9").suffix_batched_min_prob == 0.9
    with pytest.raises(ValueError, match=r"suffix_depth must be an integer in \[1, 64\]"):
        config("--suffix-depth", "65")
    assert default.cache_slots == 3 * default.max_slots
    # the n-gram lookup's options have no use on a suffix server: refused by name
    with pytest.raises(ValueError, match="--ngram-max is for the ngram drafter; the drafters "
                                         "here: suffix"):
        config("--ngram-max", "4")
    ngram = config("--drafter", "ngram", "--ngram-max", "12", "--ngram-shared", "on")
    assert (ngram.drafter, ngram.ngram_max, ngram.ngram_shared) == ("ngram", 12, True)
    chosen = config("--drafter", "model")
    assert (chosen.drafter, chosen.k, chosen.draft_len_schedule) == ("model", 4, "auto")


def refusal(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_build_refuses_what_it_does_not_read(tiny_pair, hf_models, tmp_path: Path, capsys):
    verifier, _ = tiny_pair
    build = ["build", "--backend", "llamacpp", "--out", str(tmp_path / "out")]
    assert "is not one" in refusal([*build, "--verifier", hf_models["qwen2"][1]], capsys)
    assert "--weights: not read by --backend llamacpp" in refusal(
        [*build, "--verifier", str(verifier), "--weights", "int4"], capsys)
    assert "needs --verifier" in refusal(build, capsys)
    meta = tiny_tokenizer_meta()
    tokens = meta["tokenizer.ggml.tokens"]
    # the same tokens, two control ids swapped: a draft that would propose the wrong ids
    other = write_tiny_gguf(tmp_path / "other.gguf", {
        **meta, "tokenizer.ggml.tokens": [*tokens[:-2], tokens[-1], tokens[-2]]}, arch="qwen2")
    assert "differs from the verifier's" in refusal(
        [*build, "--verifier", str(verifier), "--draft", str(other)], capsys)


def test_an_amx_build_gets_no_repacked_weights(tiny_pair, monkeypatch):
    """A llama.cpp built with AMX segfaults in its AMX matmul (llama.cpp #20824): such a
    library loads weights without the extra buffer types, warning, and an explicit
    repack=True is refused by name."""
    from paradraft.runtime.backends import llamacpp

    verifier, _ = tiny_pair
    config = load_config(g.import_gguf(verifier, verifier.parent / "hf_amx", weights=False))
    monkeypatch.setattr(llamacpp, "built_with_amx", lambda lib: True)
    with pytest.warns(UserWarning, match="built with AMX"):
        engine = LlamaCppModel(verifier, config, 1, 32, threads=1)
    logits, _ = engine(torch.tensor([[1, 40, 198]]), torch.arange(3)[None])
    assert torch.isfinite(logits).all()
    with pytest.raises(ValueError, match=r"repack=True: this llama\.cpp was built with AMX"):
        LlamaCppModel(verifier, config, 1, 32, threads=1, repack=True)
