"""The torch runtime on CUDA in bfloat16: what scripts/gpu_check.sh runs on a GPU machine
(skipped where torch sees no CUDA device)."""

import pytest
import torch
from conftest import VOCAB
from test_lossless import NEW_TOKENS, assert_joint_distribution, prompts

from paradraft.runtime.correction import RuleParams
from paradraft.runtime.drafters import Drafter
from paradraft.runtime.model import load_model
from paradraft.runtime.speculative import SpeculativeDecoder

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def cuda_models(pair):
    vdir, ddir, pdir, _ = pair
    return tuple(load_model(d, torch.bfloat16, "cuda") for d in (vdir, ddir, pdir))


@pytest.mark.parametrize("kind", ["model", "parallel", "self"])
def test_bf16_on_cuda_greedy_speculative_equals_greedy_plain(cuda_models, kind):
    verifier, draft, parallel = cuda_models
    plain = SpeculativeDecoder(verifier, None, RuleParams("greedy"), max_batch_size=8)
    want = plain.generate(prompts(), NEW_TOKENS).token_ids
    assert plain.cache.k[0].device.type == "cuda" and plain.cache.k[0].dtype == torch.bfloat16
    model = {"model": draft, "parallel": parallel, "self": verifier}[kind]
    dec = SpeculativeDecoder(verifier, Drafter(kind, model), RuleParams("greedy"), k=4,
                             max_batch_size=8)
    result = dec.generate(prompts(), NEW_TOKENS)
    assert result.token_ids == want
    assert result.stats.accepted_tokens > 0


def test_bf16_on_cuda_exact_rule_keeps_the_verifier_distribution(cuda_models):
    verifier, draft, _ = cuda_models
    assert_joint_distribution(verifier, Drafter("model", draft), VOCAB)


@pytest.mark.parametrize("rule", ["exact", "greedy", "threshold", "ratio", "dynamic", "typical"])
def test_compiled_kernel_on_cuda_equals_correct(rule):
    """The fused correction kernel, compiled for this GPU (not the interpreter that
    tests/test_kernel.py runs on the CPU), against correction.correct on the same inputs:
    planted drafts so every rule accepts a non-trivial prefix, a partial last vocab tile,
    top-p, temperature, sampled drafts with their q, and rows with fewer drafts."""
    from paradraft.runtime.backends import kernels as ck
    from paradraft.runtime.correction import Randoms, correct, draw_randoms

    B, K, V = 6, 4, 1000
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(B, K + 1, V, generator=g) * 2
    drafts = torch.randint(0, V, (B, K), generator=g)
    for b, planted in enumerate([K, 2, K, 0, 1, 3]):
        logits[b, torch.arange(planted), drafts[b, :planted]] += 9.0
    q = torch.softmax(torch.randn(B, K, V, generator=g) * 2, -1)
    num_drafted = torch.tensor([K, K, K - 1, 0, K, 2])
    randoms = draw_randoms(B, K, V, g)
    for params, with_q in [(RuleParams(rule, temperature=1.3), False),
                           (RuleParams(rule, temperature=0.7, top_p=0.8,
                                       top_p_membership=True), rule != "greedy")]:
        r = None if params.is_greedy else randoms
        want = correct(logits, drafts, q if with_q else None, params, r, num_drafted)
        cuda = [t.cuda() if isinstance(t, torch.Tensor) else t
                for t in (logits, drafts, q if with_q else None, num_drafted)]
        r_cuda = None if r is None else Randoms(r.accept_uniforms.cuda(), r.sample_noise.cuda())
        got = ck.correct_fused(cuda[0], cuda[1], cuda[2], params, r_cuda, cuda[3])
        assert got[0].is_cuda
        assert got[0].cpu().tolist() == want[0].tolist(), params
        assert got[1].cpu().tolist() == want[1].tolist(), params


def test_ngram_drafter_on_cuda_is_lossless(cuda_models):
    verifier, _, _ = cuda_models
    repeat = [[5, 9, 14, 5, 9, 14, 5, 9], [3, 4, 3, 4, 3, 4, 7]]
    plain = SpeculativeDecoder(verifier, None, RuleParams("greedy"), max_batch_size=2)
    dec = SpeculativeDecoder(verifier, Drafter("ngram"), RuleParams("greedy"), k=4,
                             max_batch_size=2)
    assert dec.generate(repeat, 24).token_ids == plain.generate(repeat, 24).token_ids


# captured steps (runtime/compiled.py): CUDA graphs through torch.compile, the whole model per
# graph. One shape for every call (8 rows, 2K + 2 positions, as on the CPU): the toy pair's
# models share it, so the step compiles a few graphs, not a bucket set's dozens.
COMPILED_K = 3


@pytest.fixture(scope="module")
def compiled_cuda_models(pair):
    from paradraft.runtime.compiled import Shapes, compile_model

    shapes = Shapes((8,), (2 * COMPILED_K + 2,))
    return tuple(compile_model(load_model(d, torch.bfloat16, "cuda"), k=COMPILED_K,
                               shapes=shapes) for d in pair[:3])


# ids: "-k ngram" (the kernel step of scripts/gpu_check.sh) must not pick these
@pytest.mark.parametrize("kind", ["model", "parallel", "self", "ngram"],
                         ids=["model", "parallel", "self", "lookup"])
def test_captured_bf16_greedy_equals_eager(cuda_models, compiled_cuda_models, kind):
    from test_compile import assert_same_or_tie

    def run(verifier, draft, parallel):
        model = {"model": draft, "parallel": parallel, "self": verifier, "ngram": None}[kind]
        drafter = Drafter("ngram") if kind == "ngram" else Drafter(kind, model)
        dec = SpeculativeDecoder(verifier, drafter, RuleParams("greedy"), k=COMPILED_K,
                                 max_batch_size=8)
        return dec.generate(prompts(), NEW_TOKENS)

    want = run(*cuda_models).token_ids
    result = run(*compiled_cuda_models)
    forward = compiled_cuda_models[0].forward
    assert (forward.mode, forward.unit, forward.graphs) == ("reduce-overhead", "model", True)
    for p, got, w in zip(prompts(), result.token_ids, want, strict=True):
        # bfloat16: fused kernels round differently, a near tie may flip
        assert_same_or_tie(forward.eager, cuda_models[0], p, got, w, epsilon=0.1)
    assert result.stats.accepted_tokens > 0


def test_captured_bf16_exact_rule_keeps_the_verifier_distribution(cuda_models,
                                                                   compiled_cuda_models):
    verifier, draft, _ = compiled_cuda_models
    assert_joint_distribution(verifier, Drafter("model", draft), VOCAB, rows=8, seeds=384,
                              reference=cuda_models[0])
