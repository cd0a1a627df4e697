"""Lossless guarantees: greedy speculative decoding reproduces greedy decoding token for token
(and transformers' generate), and the ``exact`` rule reproduces the verifier's distribution."""

import pytest
import torch
from conftest import VOCAB
from scipy.stats import chisquare

from paradraft.runtime.correction import Randoms, RuleParams, correct, sampling_probs
from paradraft.runtime.drafters import Drafter
from paradraft.runtime.model import load_model, new_kv_cache
from paradraft.runtime.speculative import SpeculativeDecoder

PROMPT_LENS = [1, 3, 5, 7, 9, 12, 15, 20]
NEW_TOKENS = 24


def prompts(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]


def assert_equal_or_numerical_tie(hf, prompt, got, want):
    """Equal, or the first divergence is at a position where the verifier's top-2 logits are
    within 1e-4 (checked here, on transformers' logits)."""
    if got == want:
        return
    i = next(i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + want[:i]])).logits[0, -1]
    top2 = logits.topk(2).values
    assert top2[0] - top2[1] < 1e-4, f"divergence at {i} is not a numerical tie"


@pytest.fixture(scope="module")
def models(pair):
    vdir, ddir, pdir, hf = pair
    return load_model(vdir), load_model(ddir), load_model(pdir), hf


@pytest.fixture(scope="module")
def baseline(models):
    verifier, _, _, hf = models
    dec = SpeculativeDecoder(verifier, None, RuleParams("greedy"), max_batch_size=8)
    out = dec.generate(prompts(), NEW_TOKENS).token_ids
    for p, o in zip(prompts(), out, strict=True):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                          do_sample=False, pad_token_id=0)[0, len(p):].tolist()
        assert_equal_or_numerical_tie(hf, p, o, ref)
    return out


@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("kind", ["model", "parallel", "self"])
def test_greedy_speculative_equals_greedy_decoding(models, baseline, kind, k):
    verifier, draft, parallel, hf = models
    model = {"model": draft, "parallel": parallel, "self": verifier}[kind]
    dec = SpeculativeDecoder(verifier, Drafter(kind, model), RuleParams("greedy"), k=k,
                             max_batch_size=8)
    result = dec.generate(prompts(), NEW_TOKENS)
    for p, got, want in zip(prompts(), result.token_ids, baseline, strict=True):
        assert len(got) == NEW_TOKENS
        assert_equal_or_numerical_tie(hf, p, got, want)
    s = result.stats
    # the drafts agree often but not always: both acceptance and rollback were exercised
    assert 0 < s.accepted_tokens < s.draft_tokens
    assert s.rollbacks > 0
    if kind == "model":  # a near copy of the verifier
        assert s.acceptance_rate > 0.3


def test_adaptive_k_stays_lossless_and_in_range(models, baseline):
    verifier, draft, _, hf = models
    dec = SpeculativeDecoder(verifier, Drafter("model", draft), RuleParams("greedy"), k=6,
                             adaptive_k=True, max_batch_size=8)
    result = dec.generate(prompts(), NEW_TOKENS)
    for p, got, want in zip(prompts(), result.token_ids, baseline, strict=True):
        assert_equal_or_numerical_tie(hf, p, got, want)
    s = result.stats
    # K moves per row: fewer draft tokens than a fixed K=6 would spend on the same steps
    assert s.draft_tokens < 6 * s.verify_steps
    assert s.drafted_per_position[0] == s.verify_steps


@pytest.mark.parametrize("kind", ["model", "parallel", "self"])
def test_speculation_disabled_by_batch_size_stays_lossless(models, baseline, kind):
    # rows finish at different rounds: while >= 4 run, rounds are plain steps (the separate
    # draft's cache falls behind), then drafting resumes and must re-feed what it missed
    verifier, draft, parallel, hf = models
    model = {"model": draft, "parallel": parallel, "self": verifier}[kind]
    lengths = [4, 8, 12, 16, 18, 20, 22, NEW_TOKENS]
    dec = SpeculativeDecoder(verifier, Drafter(kind, model), RuleParams("greedy"), k=4,
                             max_batch_size=8, disable_by_batch_size=4)
    result = dec.generate(prompts(), lengths)
    for p, got, want, n in zip(prompts(), result.token_ids, baseline, lengths, strict=True):
        assert_equal_or_numerical_tie(hf, p, got, want[:n])
    last = result.row_stats[-1]  # the longest row saw both kinds of round
    assert 0 < last.num_drafts < last.verify_steps
    with pytest.raises(ValueError, match="disable_by_batch_size must be an integer >= 1"):
        SpeculativeDecoder(verifier, Drafter(kind, model), disable_by_batch_size=0)


def distribution_distance(samples: torch.Tensor, target: torch.Tensor) -> float:
    emp = torch.bincount(samples, minlength=target.numel()).float() / samples.numel()
    return float((emp - target).abs().sum())


@pytest.mark.parametrize("draft_is_greedy", [False, True])
def test_exact_rule_preserves_the_verifier_distribution(draft_is_greedy):
    """vLLM's method: the emitted token's empirical distribution approaches the target much
    faster than it approaches random reference distributions; plus a chi-square test."""
    V, K = 8, 3
    g = torch.Generator().manual_seed(0)
    target_logits = torch.randn(K + 1, V, generator=g) * 1.5
    draft_logits = torch.randn(K, V, generator=g) * 1.5
    params = RuleParams("exact", temperature=0.9, top_p=0.95)
    p = sampling_probs(target_logits, params.temperature, params.top_p)
    q = sampling_probs(draft_logits, params.temperature, params.top_p)
    N = 60_000
    if draft_is_greedy:
        drafts = q.argmax(-1).expand(N, -1)
        q_batch = None
    else:
        drafts = torch.multinomial(q, N, replacement=True, generator=g).T
        q_batch = q.expand(N, -1, -1)
    rnd = Randoms(torch.rand(N, K, generator=g), torch.empty(N, V).exponential_(generator=g))
    n, t = correct(target_logits.expand(N, -1, -1), drafts, q_batch, params, rnd)
    first = torch.where(n > 0, drafts[:, 0], t)  # the first emitted token of every row
    # second emitted token, for rows that accepted the first draft: must follow p[1]
    second = torch.where(n > 1, drafts[:, 1], t)[n > 0]
    for samples, target in [(first, p[0]), (second, p[1])]:
        references = [torch.softmax(torch.randn(V, generator=g), -1) for _ in range(20)]
        d_target = distribution_distance(samples, target)
        d_refs = [distribution_distance(samples, r) for r in references]
        # sampling alone leaves an L1 gap of about 0.8 of this (sum of the counts' sd / n)
        noise = float((target * (1 - target) / samples.numel()).sqrt().sum())
        assert d_target < 3 * noise
        assert d_target * 5 < min(d_refs)
        support = target > 0
        counts = torch.bincount(samples, minlength=V).double()
        assert counts[~support].sum() == 0  # nothing outside the top-p set
        expected = target[support].double()
        expected = expected / expected.sum() * samples.numel()
        assert chisquare(counts[support], expected).pvalue > 1e-3


def test_exact_speculative_decoding_matches_the_verifier_joint_distribution(models):
    verifier, draft, _, _ = models
    assert_joint_distribution(verifier, Drafter("model", draft), VOCAB)


def assert_joint_distribution(verifier, drafter, vocab: int, rows: int = 256, seeds: int = 12,
                              prompt: list[int] | None = None, reference=None,
                              **decoder_kwargs) -> SpeculativeDecoder:
    """End to end through the decoder: the first two generated tokens of a fixed prompt,
    sampled with exact speculation, follow the verifier's joint distribution (chi-square).
    ``reference``: the model the target is computed with (default: the verifier; a compiled
    verifier passes its eager twin, so the target's shapes compile nothing).
    ``decoder_kwargs``: more SpeculativeDecoder options; returns the decoder (for its stats)."""
    params = RuleParams("exact", temperature=1.0)
    prompt = prompt or [5, 9, 14]
    n = len(prompt)
    dec = SpeculativeDecoder(verifier, drafter, params, k=3, max_batch_size=rows,
                             **decoder_kwargs)
    pairs = []
    for seed in range(seeds):
        out = dec.generate([prompt] * rows, 2, seed=seed).token_ids
        pairs += [o[0] * vocab + o[1] for o in out]
    samples = torch.tensor(pairs)
    # the target, computed directly from the verifier
    verifier = verifier if reference is None else reference
    dev, dtype = verifier.device, verifier.dtype
    with torch.no_grad():
        cache = new_kv_cache(verifier.config, 1, n + 13, dtype, dev)
        first, _ = verifier(torch.tensor([prompt], device=dev), torch.arange(n, device=dev)[None],
                            cache)
        p1 = torch.softmax(first[0, -1], -1)
        cache = new_kv_cache(verifier.config, vocab, n + 13, dtype, dev)
        ctx = torch.tensor([[*prompt, t] for t in range(vocab)], device=dev)
        second, _ = verifier(ctx, torch.arange(n + 1, device=dev).expand(vocab, -1), cache)
        p2 = torch.softmax(second[:, -1], -1)
    joint = (p1[:, None] * p2).flatten().cpu()
    counts = torch.bincount(samples, minlength=joint.numel()).double()
    # chi-square over outcomes with enough expected mass (rest pooled)
    expected = joint.double() / joint.double().sum() * samples.numel()
    big = expected >= 5
    assert big.sum() >= 4, "too few outcomes with enough expected mass for the test"
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    assert chisquare(obs, exp).pvalue > 1e-3
    return dec


@pytest.mark.parametrize("schedule", [{1: 4, 3: 2, 6: 0}, "auto"])
def test_draft_len_schedules_stay_lossless(models, baseline, schedule):
    # rows finish at different rounds, so the batch shrinks through every schedule entry
    verifier, draft, _, hf = models
    lengths = [4, 8, 12, 16, 18, 20, 22, NEW_TOKENS]
    dec = SpeculativeDecoder(verifier, Drafter("model", draft), RuleParams("greedy"), k=4,
                             max_batch_size=8, draft_len_schedule=schedule)
    result = dec.generate(prompts(), lengths)
    for p, got, want, n in zip(prompts(), result.token_ids, baseline, lengths, strict=True):
        assert_equal_or_numerical_tie(hf, p, got, want[:n])
    if schedule == "auto":
        costs = dec.costs  # measured by generate() before the first round
        assert len(costs.verify) == 8 and all(len(row) == 5 for row in costs.verify)
        assert all(t > 0 for row in costs.verify for t in row)
        assert all(row[0] == 0 < min(row[1:]) for row in costs.draft)
    else:
        last = result.row_stats[-1]  # alone at the end: K=4; with >= 6 rows: no drafts
        assert 0 < last.num_drafts < last.verify_steps
        assert last.draft_tokens <= 4 * last.num_drafts


@pytest.fixture(scope="module")
def half_models(pair):
    vdir, ddir, pdir, _ = pair
    return {dtype: (load_model(vdir, dtype), load_model(ddir, dtype), load_model(pdir, dtype))
            for dtype in (torch.bfloat16, torch.float16)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("kind", ["model", "parallel", "self"])
def test_half_precision_greedy_speculative_equals_greedy_plain(half_models, dtype, kind):
    """Weights and KV cache in half precision (correction in float32): speculation changes
    nothing against plain decoding in the same dtype."""
    verifier, draft, parallel = half_models[dtype]
    assert verifier.dtype == dtype
    plain = SpeculativeDecoder(verifier, None, RuleParams("greedy"), max_batch_size=8)
    want = plain.generate(prompts(), NEW_TOKENS).token_ids
    assert plain.cache.k[0].dtype == dtype
    model = {"model": draft, "parallel": parallel, "self": verifier}[kind]
    dec = SpeculativeDecoder(verifier, Drafter(kind, model), RuleParams("greedy"), k=4,
                             max_batch_size=8)
    result = dec.generate(prompts(), NEW_TOKENS)
    assert result.token_ids == want
    assert 0 < result.stats.accepted_tokens < result.stats.draft_tokens


def test_exact_rule_keeps_the_verifier_distribution_in_bfloat16(half_models):
    verifier, draft, _ = half_models[torch.bfloat16]
    assert_joint_distribution(verifier, Drafter("model", draft), VOCAB)
