"""Captured decode steps (runtime/compiled.py) on the CPU: inductor's graphs give the eager
model's tokens, for every drafter, ragged batches, the toy pair and SmolLM2's real weights,
and the exact rule keeps the verifier's distribution.

Compile time sets the layout (each inductor compile is seconds of C++ on the CPU). Every toy
decoder here has K = 3, 16 slots and the default max_seq_len, so each call pads to one shape
(16 rows, 8 positions, the whole cache): the toy verifier, its drafts and the self-draft
share one layer graph, SmolLM2 adds one, and the whole-model graph one more (its layers'
kernels are the layer graph's, compiled once)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import VOCAB
from test_lossless import assert_equal_or_numerical_tie, assert_joint_distribution, prompts

from paradraft.cli import generate
from paradraft.cli.main import main
from paradraft.runtime.compiled import (
    CompiledForward,
    Shapes,
    compile_decoder,
    compile_model,
    default_shapes,
    pad,
    warm_up,
)
from paradraft.runtime.correction import RuleParams
from paradraft.runtime.drafters import Drafter
from paradraft.runtime.metrics import GenerationResult
from paradraft.runtime.model import load_model, new_kv_cache
from paradraft.runtime.speculative import SpeculativeDecoder

K = 3  # assert_joint_distribution's
SLOTS = 16  # the ragged batch's 8 rows padded to 16; the distribution test's rows
# per row: the batch shrinks as rows finish, so later rounds run padded rows
LENGTHS = [4, 8, 12, 16, 18, 20, 22, 24]
DRAFTERS = ["plain", "model", "parallel", "self", "ngram"]


def drafter(kind: str, verifier, draft, parallel):
    if kind == "plain":
        return None
    if kind == "ngram":
        return Drafter("ngram")
    return Drafter(kind, {"model": draft, "parallel": parallel, "self": verifier}[kind])


def decode(verifier, kind: str, draft=None, parallel=None, prompts_=None, lengths=None,
           slots: int = SLOTS, **kwargs) -> GenerationResult:
    dec = SpeculativeDecoder(verifier, drafter(kind, verifier, draft, parallel),
                             RuleParams("greedy"), k=K, max_batch_size=slots, **kwargs)
    return dec.generate(prompts_ or prompts(), lengths or LENGTHS)


@pytest.fixture(scope="module")
def parallel(pair):  # eager, beside conftest's verifier and draft
    return load_model(pair[2])


@pytest.fixture(scope="module")
def compiled(pair):
    """The toy pair compiled (CPU defaults: inductor, one layer graph per layer dims)."""
    vdir, ddir, pdir, _ = pair
    return tuple(compile_model(load_model(d), k=K, max_batch_size=SLOTS)
                 for d in (vdir, ddir, pdir))


@pytest.mark.parametrize("kind", DRAFTERS)
def test_compiled_greedy_equals_eager_for_every_drafter(pair, verifier, draft, parallel,
                                                        compiled, kind):
    want = decode(verifier, kind, draft, parallel).token_ids
    result = decode(compiled[0], kind, compiled[1], compiled[2])
    for p, g, w in zip(prompts(), result.token_ids, want, strict=True):
        assert_equal_or_numerical_tie(pair[3], p, g, w)
    if kind != "plain":  # drafts were made, some kept, some rolled back
        assert 0 < result.stats.accepted_tokens < result.stats.draft_tokens


def test_warm_up_compiles_the_decoders_shapes_before_a_request(pair, verifier, draft, compiled):
    dec = SpeculativeDecoder(compiled[0], Drafter("model", compiled[1]), RuleParams("greedy"),
                             k=K, max_batch_size=SLOTS)
    assert warm_up(dec) == 2  # one shape each (CPU defaults) for the verifier and the draft
    self_dec = SpeculativeDecoder(compiled[0], Drafter("self", compiled[0]), k=K,
                                  max_batch_size=SLOTS)
    assert warm_up(self_dec) == 2  # the verifier's, and its first layer's
    got = dec.generate(prompts(), LENGTHS).token_ids  # the warm-up's writes are not read
    want = decode(verifier, "model", draft).token_ids
    for p, g, w in zip(prompts(), got, want, strict=True):
        assert_equal_or_numerical_tie(pair[3], p, g, w)


def test_exact_rule_keeps_the_verifier_distribution_compiled(verifier, compiled):
    # 16 rows x 192 seeds: the 3072 samples of the eager test, at the decoders' one shape
    dec = assert_joint_distribution(compiled[0], Drafter("model", compiled[1]), VOCAB,
                                    rows=SLOTS, seeds=3072 // SLOTS, reference=verifier)
    assert isinstance(dec.verifier.forward, CompiledForward)


def test_whole_model_graph_with_the_cuda_graph_bookkeeping(pair, verifier):
    """unit="model" (CUDA's default) in mode "reduce-overhead": on the CPU inductor runs no
    CUDA graph, but the step marks, static cache buffers and output copies still run."""
    whole = compile_model(load_model(pair[0]), k=K, max_batch_size=SLOTS,
                          mode="reduce-overhead", unit="model")
    forward = whole.forward
    assert (forward.unit, forward.graphs) == ("model", True)
    got = decode(whole, "self").token_ids
    want = decode(verifier, "self").token_ids
    for p, g, w in zip(prompts(), got, want, strict=True):
        assert_equal_or_numerical_tie(pair[3], p, g, w)
    # one decoder's cache: its buffer and per-layer views made (and marked static) once
    assert len(forward._views) == 1


def test_calls_outside_the_shapes_run_eager(verifier, compiled):
    forward = compiled[0].forward
    cache = new_kv_cache(verifier.config, SLOTS, 64, torch.float32)
    ref_cache = new_kv_cache(verifier.config, SLOTS, 64, torch.float32)
    tokens = torch.randint(0, VOCAB, (2, 2 * K + 3))  # wider than the widest shape
    pos = torch.arange(tokens.shape[1]).expand(2, -1)
    calls = torch._dynamo.utils.counters["stats"]["calls_captured"]
    got, _ = compiled[0](tokens, pos, cache)
    want, _ = verifier(tokens, pos, ref_cache)
    torch.testing.assert_close(got, want)
    # the audit's explicit softmax returns the weights: eager, with its leak
    _, leak = compiled[0](tokens[:, :2], pos[:, :2], cache, audit=True)
    assert leak is not None and leak.shape == (2, 2)
    assert torch._dynamo.utils.counters["stats"]["calls_captured"] == calls  # nothing traced
    assert forward.shapes.width(2 * K + 3) is None


def test_smollm2_compiled_greedy_equals_eager(smollm2_gguf):
    """Real weights, a ragged batch of two, drafted by lookup (the toy pair covers the
    drafters with models: SmolLM2 adds no second model to compile). The decoder is compiled
    after an eager run, as ``generate --compile`` does before its first."""
    model = load_model(smollm2_gguf)  # imported once into $PARADRAFT_CACHE
    texts = [[1, 504, 3458, 282, 253, 1789, 30, 198, 504, 3458, 282],
             [1, 22, 2000, 3000, 2000, 3000]]
    lengths = [20, 12]
    dec = SpeculativeDecoder(model, Drafter("ngram"), RuleParams("greedy"), k=K,
                             max_batch_size=2, max_seq_len=64)
    want = dec.generate(texts, lengths).token_ids
    assert compile_decoder(dec) is dec and isinstance(model.forward, CompiledForward)
    result = dec.generate(texts, lengths)
    for p, g, w in zip(texts, result.token_ids, want, strict=True):
        assert_same_or_tie(model.forward.eager, model, p, g, w)
    assert result.stats.accepted_tokens > 0


def assert_same_or_tie(forward, model, prompt: list[int], got: list[int], want: list[int],
                       epsilon: float = 1e-3) -> None:
    """Equal, or the first divergence is where the eager model's top-2 logits are within
    ``epsilon`` (a near tie that rounding may flip)."""
    if got == want:
        return
    i = next(i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b)
    ids = prompt + want[:i]
    dev = model.device
    cache = new_kv_cache(model.config, 1, len(ids), model.dtype, dev)
    with torch.no_grad():
        logits, _ = forward(torch.tensor([ids], device=dev),
                            torch.arange(len(ids), device=dev)[None], cache)
    top2 = logits[0, -1].topk(2).values
    assert top2[0] - top2[1] < epsilon, f"divergence at {i} is not a near tie"


def test_shapes_pad_and_default_shapes():
    x = torch.tensor([[1, 2], [3, 4]])
    assert pad(x, 3, 4).tolist() == [[1, 2, 2, 2], [3, 4, 4, 4], [3, 4, 4, 4]]
    shapes = Shapes((1, 2, 4), (1, 2, 4), kv_block=16)
    assert [shapes.batch(b, 8) for b in (1, 2, 3, 4, 5)] == [1, 2, 4, 4, None]
    assert [shapes.width(t) for t in (1, 3, 4, 5)] == [1, 4, 4, None]
    assert [shapes.kv(n, 40) for n in (None, 1, 16, 17, 39)] == [40, 16, 16, 32, 40]
    assert Shapes(None, (8,)).batch(3, 8) == 8
    cuda = torch.device("cuda")
    assert default_shapes(cuda, 4, 12) == Shapes((1, 2, 4, 8, 12), (1, 5))
    assert default_shapes(cuda, 4, 1, "model") == Shapes((1,), (1, 2))
    assert default_shapes(cuda, 4, 2, "parallel") == Shapes((1, 2), (8,))
    assert default_shapes(cuda, 0, 1) == Shapes((1,), (1,))
    for role in ("verifier", "model", "parallel"):  # one shape, shared by every role
        assert default_shapes(torch.device("cpu"), 4, 12, role) == Shapes(None, (10,))
    with pytest.raises(ValueError, match="widths must be a non-empty tuple"):
        Shapes(None, ())


def test_compile_model_refuses_by_name(pair):
    engine = SimpleNamespace(verifier=object(), drafter=None, cache=None, draft_cache=None,
                             k=4, max_batch_size=1)
    with pytest.raises(ValueError, match="must be torch models"):
        compile_decoder(engine)
    model = load_model(pair[0])
    with pytest.raises(ValueError, match="compile mode must be one of"):
        compile_model(model, mode="fast")
    with pytest.raises(ValueError, match="compile unit must be one of"):
        compile_model(model, unit="block")
    with pytest.raises(ValueError, match="role must be one of"):
        compile_model(model, role="self")
    compile_model(model)
    with pytest.raises(ValueError, match="compiled already"):
        compile_model(model)


def test_generate_compile_flag_compiles_the_decoder(pair, capsys, monkeypatch):
    """``generate --compile`` hands its decoder to compile_decoder (spied on here: the real
    one runs in the SmolLM2 test) and refuses an engine dir by name."""
    seen = []
    monkeypatch.setattr(generate, "compile_decoder", seen.append)
    args = ["generate", "--verifier", pair[0], "--draft", pair[1], "--prompt-ids", "5,9,14",
            "--max-new-tokens", "4", "--ignore-eos", "--json"]
    main(args)
    assert seen == []
    main([*args, "--compile"])
    assert len(seen) == 1 and isinstance(seen[0], SpeculativeDecoder)
    assert seen[0].drafter.model is not None
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["generate", "--engines", str(pair[0]), "--compile", "--prompt-ids", "1"])
    assert "--compile compiles the torch backend's models" in capsys.readouterr().err
