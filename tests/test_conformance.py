"""One conformance suite for every engine backend on this machine (torch, onnx, tensorrt).

Each backend must give the torch backend's greedy tokens and acceptance counts for a ragged
batch with every drafter, roll back correctly after forced rejections (also with slot
subsets, as rows finish at different times), and — where the verifier graph ends in the
CausalCorrection op — give exactly what ``correction.correct()`` gives for every rule."""

from __future__ import annotations

import shutil

import pytest
import torch

from paradraft.runtime.correction import RULES, RuleParams, correct, draw_randoms, sampling_probs
from paradraft.runtime.drafters import Drafter
from paradraft.runtime.model import load_model, new_kv_cache
from paradraft.runtime.speculative import SpeculativeDecoder

BACKENDS = ["torch", "onnx", "tensorrt"]
DRAFTERS = ["model", "parallel", "self"]
PROMPTS = [[4, 8, 15], [16, 23, 42, 7, 7, 3, 1], [9]]
MAX_NEW = [24, 9, 17]  # rows finish at different rounds: later rounds run on slot subsets
K = 4


def torch_models(pair, device="cpu") -> tuple:
    vdir, ddir, pdir, _ = pair
    verifier = load_model(vdir, device=device)
    drafters = {"model": Drafter("model", load_model(ddir, device=device)),
                "parallel": Drafter("parallel", load_model(pdir, device=device)),
                "self": Drafter("self", verifier, num_layers=1)}
    return verifier, drafters


@pytest.fixture(scope="module")
def reference(pair):
    return torch_models(pair)


@pytest.fixture(scope="module")
def pair_trt_engines(pair_engines, tmp_path_factory):
    """The ``pair`` ONNX engine dir, copied and built into TensorRT plans (GPU only)."""
    from paradraft.build.tensorrt import build_plans

    out = tmp_path_factory.mktemp("trt") / "engines"
    shutil.copytree(pair_engines, out)
    build_plans(out)
    return out


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request, pair):
    """(name, verifier engine, {drafter kind: Drafter}) for one backend."""
    name = request.param
    if name == "torch":
        return name, *torch_models(pair)
    if name == "onnx":
        pytest.importorskip("onnxruntime")
        from paradraft.runtime.backends.loader import load_engines

        verifier, drafters, _, _ = load_engines(request.getfixturevalue("pair_engines"))
        return name, verifier, drafters
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        pytest.skip("TensorRT not installed (the tensorrt backend needs tensorrt>=10.9 and an "
                    "NVIDIA GPU)")
    if not torch.cuda.is_available():
        pytest.skip("the tensorrt backend needs a CUDA GPU (torch.cuda.is_available() is False)")
    from paradraft.runtime.backends.loader import load_engines

    verifier, drafters, _, _ = load_engines(request.getfixturevalue("pair_trt_engines"))
    return name, verifier, drafters


@pytest.fixture(scope="module")
def truth(reference):
    """Plain greedy continuations of the torch verifier (what greedy speculation must give)."""
    dec = SpeculativeDecoder(reference[0], None, RuleParams("greedy"), max_batch_size=3)
    return dec.generate(PROMPTS, 40).token_ids


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_greedy_tokens_and_acceptance_equal_torch(backend, reference, truth, drafter):
    _, verifier, drafters = backend
    runs = []
    for v, d in [reference, (verifier, drafters)]:
        dec = SpeculativeDecoder(v, d[drafter], RuleParams("greedy"), k=K, max_batch_size=4,
                                 acceptance_floor=0.0)
        runs.append(dec.generate(PROMPTS, MAX_NEW))
    ref, got = runs
    assert got.token_ids == ref.token_ids == [t[:n] for t, n in zip(truth, MAX_NEW, strict=True)]
    assert got.stats.draft_tokens == ref.stats.draft_tokens > 0
    assert got.stats.accepted_tokens == ref.stats.accepted_tokens
    assert got.stats.accepted_per_position == ref.stats.accepted_per_position
    assert 0 < got.stats.accepted_tokens < got.stats.draft_tokens  # partly accepted blocks


def test_sampled_tokens_equal_torch(backend, reference, pair):
    """The exact rule with sampled drafts: same seed, same randoms, same tokens."""
    _, verifier, drafters = backend
    if verifier.device.type != "cpu":  # same randoms: a torch reference on the same device
        reference = torch_models(pair, verifier.device)
    params = RuleParams("exact", temperature=0.9, top_p=0.95)
    out = []
    for v, d in [reference, (verifier, drafters)]:
        dec = SpeculativeDecoder(v, d["model"], params, k=K, max_batch_size=3,
                                 acceptance_floor=0.0)
        out.append(dec.generate(PROMPTS, 20, seed=5))
    assert out[1].token_ids == out[0].token_ids
    assert out[1].stats.accepted_tokens == out[0].stats.accepted_tokens


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_forced_rejections_roll_back(backend, truth, drafter, monkeypatch):
    """Every round, row b's block is the true continuation with a wrong token at j_b (after
    the real drafter has run, so its cache sees the drafts): each round accepts exactly j_b,
    the caches roll back, and the output is still plain greedy decoding."""
    _, verifier, drafters = backend
    dec = SpeculativeDecoder(verifier, drafters[drafter], RuleParams("greedy"), k=K,
                             max_batch_size=3, acceptance_floor=0.0)
    wrong_at = torch.tensor([0, 2, 3])
    prompt_lens = torch.tensor([len(p) for p in PROMPTS])
    real_draft = dec._draft

    def planted(tokens, lengths, k, bound, gen, rows=None, missed=0, valid=None):
        real_draft(tokens, lengths, k, bound, gen, rows, missed, valid)
        slots = torch.arange(len(lengths)) if rows is None else rows.cpu()  # None: 0..B-1
        done = (lengths.cpu() - prompt_lens[slots]).tolist()  # index of the newest generated
        drafts = torch.tensor([truth[s][g + 1: g + 1 + k]
                               for s, g in zip(slots.tolist(), done, strict=True)])
        j = wrong_at[slots, None]
        wrong = (drafts + 1) % verifier.config.vocab_size
        drafts = torch.where(torch.arange(k) == j, wrong, drafts)
        return drafts.to(lengths.device), None

    monkeypatch.setattr(dec, "_draft", planted)
    result = dec.generate(PROMPTS, MAX_NEW)
    assert result.token_ids == [t[:n] for t, n in zip(truth, MAX_NEW, strict=True)]
    for row, j in zip(result.row_stats, wrong_at.tolist(), strict=True):
        assert row.rollbacks == row.verify_steps > 0
        assert row.accepted_tokens == j * row.verify_steps
        assert row.accepted_per_position == [row.verify_steps] * j + [0] * (K - j)


def rule_cases() -> list[tuple[str, bool, bool]]:
    return [(rule, probs, drafted) for rule in RULES for probs in (False, True)
            for drafted in (False, True)]


@pytest.mark.parametrize(("rule", "with_probs", "with_num_drafted"), rule_cases())
def test_correction_op_equals_correct(backend, truth, rule, with_probs, with_num_drafted):
    """The verifier + CausalCorrection graph gives correct()'s outputs for the same logits,
    drafts and random numbers: every rule, with and without draft_probs / num_drafted."""
    name, verifier, _ = backend
    if name == "torch":
        pytest.skip("the torch backend calls correct() itself")
    c, dev = verifier.config, verifier.device
    # tau / epsilon / delta are not float32-exact: the op must still use these decimals
    params = RuleParams(rule, temperature=0.8, top_p=0.9, tau=0.3, gamma=0.7, alpha=0.1,
                        top_p_membership=rule == "dynamic", epsilon=0.09, delta=0.3)
    g = torch.Generator().manual_seed(RULES.index(rule) * 4 + 2 * with_probs + with_num_drafted)
    B, slots = 3, torch.tensor([2, 0, 3], device=dev)
    prompts = torch.tensor([t[:6] for t in truth], device=dev)
    caches = [new_kv_cache(c, 4, 32, torch.float32, dev) for _ in range(2)]
    for cache in caches:
        verifier(prompts, torch.arange(6, device=dev).expand(B, -1), cache, kv_len=6, rows=slots)
    # drafts: the true continuation with ~1/3 of the tokens replaced
    drafts = torch.tensor([t[7: 7 + K] for t in truth])
    noise = torch.randint(0, c.vocab_size, drafts.shape, generator=g)
    drafts = torch.where(torch.rand(drafts.shape, generator=g) < 0.35, noise, drafts)
    tokens = torch.cat([torch.tensor([[t[6]] for t in truth]), drafts], 1)
    pos = 6 + torch.arange(K + 1).expand(B, -1)
    randoms = None if rule == "greedy" else draw_randoms(B, K, c.vocab_size, g)  # greedy: none
    draft_probs = None
    if with_probs:
        draft_probs = sampling_probs(torch.randn(B, K, c.vocab_size, generator=g) * 3, 1.0, 1.0)
    num_drafted = torch.tensor([4, 1, 3]) if with_num_drafted else None
    # drawn on the CPU (same numbers for every backend), then onto the engine's device
    drafts, tokens, pos = drafts.to(dev), tokens.to(dev), pos.to(dev)
    if randoms is not None:
        randoms.accept_uniforms = randoms.accept_uniforms.to(dev)
        randoms.sample_noise = randoms.sample_noise.to(dev)
    draft_probs = None if draft_probs is None else draft_probs.to(dev)
    num_drafted = None if num_drafted is None else num_drafted.to(dev)

    logits, _ = verifier(tokens, pos, caches[0], kv_len=12, rows=slots)
    want_n, want_next = correct(logits, drafts, draft_probs, params, randoms, num_drafted)
    got_n, got_next, block = verifier.verify_and_correct(
        tokens, pos, caches[1], params, randoms, draft_probs, num_drafted, kv_len=12, rows=slots)
    assert torch.equal(got_n, want_n) and torch.equal(got_next, want_next)
    for b in range(B):
        n = int(want_n[b])
        assert block[b].tolist() == [*drafts[b, :n].tolist(), int(want_next[b])] + [-1] * (K - n)
    # the correction graph also wrote this step's K/V, like the logits graph did
    for a, b_ in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v, strict=True):
        assert torch.equal(a, b_)
