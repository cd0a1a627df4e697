"""Each rule's arithmetic on hand-computed cases, parameter validation, and the planted-token
test (a planted wrong draft token is rejected exactly where it was planted)."""

import math

import pytest
import torch

from paradraft.runtime import correction
from paradraft.runtime.correction import (
    RULES,
    Randoms,
    RuleParams,
    check_k,
    correct,
    exponential_noise,
    sample,
    sampling_probs,
    top_p_floor,
    top_p_mask,
)


def logits_from_probs(probs) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float32).log()


def randoms(B, K, V, u=0.5):
    # constant noise: the exponential race then picks the most probable allowed token
    return Randoms(torch.full((B, K), u), torch.ones(B, V))


# one row, K = 2, V = 4. Position 0: p = [.5, .3, .15, .05]; position 1: [.25,.25,.25,.25];
# bonus position 2: [.1, .2, .3, .4]. Drafts: token 1 then token 0.
P = [[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25], [0.1, 0.2, 0.3, 0.4]]
LOGITS = logits_from_probs([P])
DRAFT = torch.tensor([[1, 0]])
H_UNIFORM = math.log(4)
H0 = -sum(p * math.log(p) for p in P[0])


def run(rule, **kw):
    n, t = correct(LOGITS, DRAFT, None, RuleParams(rule=rule, **kw), randoms(1, 2, 4))
    return int(n), int(t)


def test_greedy_accepts_while_draft_is_argmax():
    # argmax at position 0 is token 0, the draft says 1: rejected at 0, correction = 0
    assert run("greedy") == (0, 0)
    n, t = correct(LOGITS, torch.tensor([[0, 0]]), None, RuleParams("greedy"),
                   randoms(1, 2, 4))
    # position 1 is a four-way tie: argmax picks the first (token 0) -> both accepted, bonus 3
    assert (int(n), int(t)) == (2, 3)


def test_threshold_rule():
    # p(1)=.3 > τ=.25 accepted; p(0)=.25 > .25 is false -> stop at 1, sample from position 1
    assert run("threshold", tau=0.25)[0] == 1
    assert run("threshold", tau=0.2) == (2, 3)  # both pass, bonus = most probable (3)
    assert run("threshold", tau=0.35)[0] == 0


def test_ratio_rule():
    # r_0 = .3/.5 = .6 ; r_1 = .25/.25 = 1
    assert run("ratio", gamma=0.6 - 1e-6)[0] == 2
    assert run("ratio", gamma=0.61)[0] == 0
    n, _ = correct(LOGITS, torch.tensor([[0, 0]]), None, RuleParams("ratio", gamma=1.6),
                   randoms(1, 2, 4))
    assert int(n) == 1  # r_0 = .5/.3 = 1.67 >= 1.6, r_1 = 1 < 1.6


def test_dynamic_rule_entropy_threshold_and_top_p_membership():
    # τ_0 = τ_base (1 + α H0); accept token 1 (p=.3) iff .3 > τ_0
    tau_base, alpha = 0.2, 0.3
    tau0 = tau_base * (1 + alpha * H0)
    assert tau0 < 0.3
    tau1 = tau_base * (1 + alpha * H_UNIFORM)
    assert tau1 > 0.25  # flat position 1 is stricter: rejected there
    assert run("dynamic", tau=tau_base, alpha=alpha)[0] == 1
    # top-p membership: with top_p=.45 the set at position 0 is {0}: token 1 is outside
    assert run("dynamic", tau=0.0, alpha=0.0, top_p=0.45, top_p_membership=True)[0] == 0
    assert run("dynamic", tau=0.0, alpha=0.0, top_p=0.8, top_p_membership=True)[0] == 2


def test_entropy_rules_ignore_masked_tokens():
    # a token with p = 0 (logit −inf, as a masked vocabulary gives) adds nothing to the
    # entropy: the rules decide exactly as without it (0·(−inf) must not turn into NaN)
    padded = torch.cat([LOGITS, torch.full((1, 3, 1), float("-inf"))], -1)
    for rule, kw in [("dynamic", {"tau": 0.2, "alpha": 0.3}),
                     ("typical", {"epsilon": 0.28, "delta": 0.9})]:
        n, _ = correct(padded, DRAFT, None, RuleParams(rule=rule, **kw), randoms(1, 2, 5))
        assert int(n) == run(rule, **kw)[0] > 0


def test_typical_rule():
    # threshold_i = min(ε, δ·exp(−H_i))
    eps, delta = 0.28, 0.9
    t0 = min(eps, delta * math.exp(-H0))
    t1 = min(eps, delta * math.exp(-H_UNIFORM))
    assert t0 < 0.3 and t1 < 0.25  # both pass
    assert run("typical", epsilon=eps, delta=delta)[0] == 2
    assert run("typical", epsilon=0.26, delta=10.0)[0] == 1  # .25 > .26 fails at 1


def test_exact_rule_uses_ratio_and_residual():
    q = torch.tensor([[[0.1, 0.6, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]]])
    # p/q at position 0 = .3/.6 = .5: accepted iff u < .5
    accept = Randoms(torch.tensor([[0.49, 0.99]]), torch.ones(1, 4))
    n, _ = correct(LOGITS, DRAFT, q, RuleParams("exact"), accept)
    assert int(n) == 2  # position 1: p/q = 1 accepts for any u < 1
    reject = Randoms(torch.tensor([[0.51, 0.0]]), torch.tensor([[1.0, 1.0, 1.0, 1.0]]))
    n, t = correct(LOGITS, DRAFT, q, RuleParams("exact"), reject)
    # residual max(p - q, 0) = [.4, 0, 0, 0] -> the only possible correction is token 0
    assert (int(n), int(t)) == (0, 0)


def test_exact_with_one_hot_draft_excludes_the_rejected_token():
    # one-hot q on token 0 (p=.5): residual = p without token 0
    noise = torch.tensor([[1.0, 1.0, 0.1, 1.0]])  # favours token 2 in the race
    n, t = correct(LOGITS, torch.tensor([[0, 0]]), None, RuleParams("exact"),
                   Randoms(torch.tensor([[0.9, 0.0]]), noise))
    assert (int(n), int(t)) == (0, 2)


def test_num_drafted_stops_early_with_the_bonus_distribution():
    n, t = correct(LOGITS, torch.tensor([[0, 0]]), None, RuleParams("greedy"),
                   randoms(1, 2, 4), num_drafted=torch.tensor([1]))
    assert (int(n), int(t)) == (1, 0)  # stopped after one: argmax at position 1 (tie -> 0)


def test_top_p_and_sampling_probs():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    assert top_p_mask(probs, 0.5).tolist() == [True, False, False, False]
    assert top_p_mask(probs, 0.81).tolist() == [True, True, True, False]
    sp = sampling_probs(probs.log(), temperature=1.0, top_p=0.8)
    assert torch.allclose(sp, torch.tensor([0.5, 0.3, 0.0, 0.0]) / 0.8)
    hot = sampling_probs(probs.log(), temperature=0.5, top_p=1.0)
    expected = probs**2 / (probs**2).sum()
    assert torch.allclose(hot, expected)


@pytest.mark.parametrize("rule", RULES)
def test_planted_wrong_token_is_rejected_exactly_there(rule):
    """The planted-token test: a block whose drafts are the verifier's confident choices
    except a planted token at j; every rule stops at j and the correction comes from the
    verifier's distribution at j (never the planted token)."""
    B, K, V = 4096, 6, 12
    g = torch.Generator().manual_seed(0)
    best = torch.randint(0, V, (K + 1,), generator=g)
    logits = torch.full((K + 1, V), -2.0)
    logits[torch.arange(K + 1), best] = 22.0  # p(best) = 1 - 1e-10
    for j in range(K):
        planted = (best[j] + 1) % V
        logits_j = logits.clone()
        logits_j[j, planted] = -30.0  # the planted token is (numerically) impossible
        drafts = best[:K].clone()
        drafts[j] = planted
        batch_logits = logits_j.expand(B, -1, -1)
        rnd = Randoms(torch.rand(B, K, generator=g),
                      torch.empty(B, V).exponential_(generator=g))
        n, t = correct(batch_logits, drafts.expand(B, -1), None, RuleParams(rule), rnd)
        assert (n == j).all(), rule
        assert (t != planted).all()
        # the correction follows the verifier's distribution at j: almost always its best
        assert (t == best[j]).float().mean() > 0.99


def test_invalid_parameters_name_the_parameter_and_range():
    cases = {
        "temperature": dict(temperature=0.0),
        "top_p": dict(top_p=1.5),
        "tau": dict(tau=-0.1),
        "gamma": dict(gamma=0.0),
        "alpha": dict(alpha=-1.0),
        "epsilon": dict(epsilon=2.0),
        "delta": dict(delta=float("nan")),
    }
    for name, kw in cases.items():
        with pytest.raises(ValueError, match=rf"{name} must be in [\[(]"):
            RuleParams(**kw)
    with pytest.raises(ValueError, match="rule must be one of"):
        RuleParams(rule="best")
    for bad in (0, -1, 65, 2.5, True):
        with pytest.raises(ValueError, match=r"k must be an integer in \[1, 64\]"):
            check_k(bad)


def test_rules_are_vectorised_over_batch_and_positions():
    """Rows are independent: a batch gives the same result as each row alone."""
    g = torch.Generator().manual_seed(3)
    B, K, V = 5, 4, 9
    logits = torch.randn(B, K + 1, V, generator=g) * 3
    drafts = torch.randint(0, V, (B, K), generator=g)
    q = torch.softmax(torch.randn(B, K, V, generator=g), -1)
    rnd = Randoms(torch.rand(B, K, generator=g), torch.empty(B, V).exponential_(generator=g))
    for rule in RULES:
        params = RuleParams(rule, temperature=0.8, top_p=0.9, tau=0.2)
        n, t = correct(logits, drafts, q, params, rnd)
        for b in range(B):
            one = Randoms(rnd.accept_uniforms[b:b + 1], rnd.sample_noise[b:b + 1])
            nb, tb = correct(logits[b:b + 1], drafts[b:b + 1], q[b:b + 1], params, one)
            assert (int(nb), int(tb)) == (int(n[b]), int(t[b])), rule


def test_sampling_rules_refuse_missing_random_numbers():
    for rule in ("exact", "threshold"):
        with pytest.raises(ValueError, match="needs random numbers"):
            correct(LOGITS, DRAFT, None, RuleParams(rule), None)
    assert run("greedy") == (0, 0)  # greedy draws nothing


def test_exponential_noise_is_exp1_finite_positive_and_seeded():
    n = 200_000
    x = exponential_noise((n,), torch.Generator().manual_seed(0))
    assert bool(torch.isfinite(x).all()) and float(x.min()) > 0.0
    # Kolmogorov–Smirnov distance to the Exp(1) CDF; the 0.1 % critical value is 1.95 / √n
    xs = x.double().sort().values
    cdf = 1 - torch.exp(-xs)
    i = torch.arange(1, n + 1, dtype=torch.float64)
    ks = float(torch.maximum(i / n - cdf, cdf - (i - 1) / n).max())
    assert ks < 1.95 / math.sqrt(n)
    # a uniform of exactly 0 (2^-24 per draw) is clamped, not turned into inf, which would
    # give its token no chance: force one
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "rand", lambda shape, **kw: torch.zeros(shape))
        zero_u = exponential_noise((4, 8), None)
    assert bool(torch.isfinite(zero_u).all()) and float(zero_u.min()) > 0.0
    again = exponential_noise((n,), torch.Generator().manual_seed(0))
    assert torch.equal(x, again)


def test_exponential_race_with_the_noise_samples_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 100_000
    noise = exponential_noise((n, 4), torch.Generator().manual_seed(1))
    freq = torch.bincount(sample(probs.expand(n, -1), noise), minlength=4).double() / n
    # 4 standard errors of a binomial proportion
    assert torch.all((freq - probs.double()).abs() < 4 * (probs * (1 - probs) / n).sqrt())


def nucleus_by_definition(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask, mass strictly above each token) straight from the definition, in float64: a
    token is in iff the strictly more probable tokens hold < top_p."""
    p = probs.double()
    above = (p[..., None, :] * (probs[..., None, :] > probs[..., :, None])).sum(-1)
    return above < top_p, above


def test_top_p_without_a_sort_is_the_nucleus_by_definition():
    # ties (integer logits), masked tokens (p = 0), flat and peaked rows, any top_p: the radix
    # select keeps exactly the tokens the definition keeps, and reports their mass. Only a
    # token whose mass above lies within float32 rounding of top_p may go either way
    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        V = int(torch.randint(2, 400, (1,), generator=g))
        x = torch.randn(6, V, generator=g) * float(torch.rand(1, generator=g) * 8)
        if trial % 3 == 0:
            x = x.round()
        if trial % 5 == 0:
            x[:, : V // 3] = float("-inf")
        probs = torch.softmax(x, -1)
        top_p = float(torch.rand(1, generator=g)) * 0.99 + 0.005
        want, above = nucleus_by_definition(probs, top_p)
        got = top_p_mask(probs, top_p)
        assert ((got == want) | ((above - top_p).abs() < 1e-6)).all(), trial
        floor, mass = top_p_floor(probs, top_p)
        assert torch.equal(got, probs.view(torch.int32) > floor)
        assert torch.allclose(mass[:, 0].double(), (probs.double() * got).sum(-1), atol=1e-6)
        assert got.any(-1).all()  # never empty: the top token's mass above is 0


def test_top_p_ties_are_all_in_or_all_out():
    probs = torch.tensor([0.4, 0.2, 0.2, 0.2])
    # the three tokens at 0.2 each have 0.4 above them: all in for top_p > 0.4 (a sort would
    # have kept the one its order put first, and the set would depend on that order) ...
    assert top_p_mask(probs, 0.45).tolist() == [True, True, True, True]
    # ... and all out for top_p < 0.4, where the top token alone reaches it
    assert top_p_mask(probs, 0.35).tolist() == [True, False, False, False]
    sp = sampling_probs(probs.log(), temperature=1.0, top_p=0.45)
    assert torch.allclose(sp, probs)
    # any leading dims; without ties the smallest set of most probable tokens reaching top_p
    p = torch.tensor([[[0.05, 0.3, 0.15, 0.5]]])
    assert top_p_mask(p, 0.85).tolist() == [[[False, True, True, True]]]
    assert top_p_mask(p, 0.75).tolist() == [[[False, True, False, True]]]


def test_greedy_computes_no_probabilities(monkeypatch):
    """A greedy round is an argmax and a compare (plain greedy: one argmax)."""
    def forbidden(*args, **kwargs):
        raise AssertionError("greedy computed probabilities")

    for name in ("softmax", "log_softmax", "logsumexp", "exp"):
        monkeypatch.setattr(torch, name, forbidden)
    monkeypatch.setattr(torch.Tensor, "softmax", forbidden)
    assert run("greedy") == (0, 0)
    n, t = correct(LOGITS[:, :1], DRAFT[:, :0], None, RuleParams("greedy"), None)
    assert (int(n), int(t)) == (0, 0)


@pytest.mark.parametrize("rule", RULES)
def test_row_blocks_give_the_same_result(rule, monkeypatch):
    # on the CPU rows go through correct() in blocks that keep temporaries small: blocks of
    # one and of two rows give what one block of all rows gives
    g = torch.Generator().manual_seed(5)
    B, K, V = 7, 3, 64
    logits = torch.randn(B, K + 1, V, generator=g) * 3
    q = torch.softmax(torch.randn(B, K, V, generator=g), -1)
    drafts = torch.multinomial(q.flatten(0, 1), 1, generator=g).view(B, K)
    rnd = Randoms(torch.rand(B, K, generator=g), exponential_noise((B, V), g))
    num_drafted = torch.tensor([3, 2, 3, 0, 1, 3, 3])
    for kw in ({"temperature": 0.7, "top_p": 0.8, "top_p_membership": True}, {}):
        params = RuleParams(rule, tau=0.05, **kw)
        want = correct(logits, drafts, q, params, rnd, num_drafted)
        for rows in (1, 2):
            monkeypatch.setattr(correction, "BLOCK_ELEMENTS", rows * (K + 1) * V)
            got = correct(logits, drafts, q, params, rnd, num_drafted)
            assert [t.tolist() for t in got] == [t.tolist() for t in want]
            assert len(correction.row_blocks(B, (K + 1) * V, logits.device)) == -(-B // rows)
        monkeypatch.undo()


def test_a_top_p_below_float_resolution_keeps_the_likeliest_token():
    """top_p far below float32's resolution near 1 (5e-324 arrives as 2^-149): the nucleus is
    the likeliest token, not empty (an empty one made NaN probabilities, and a grammar's
    masked-out token 0 was sampled)."""
    from paradraft.runtime.correction import top_p_mask

    probs = torch.zeros(2, 50)
    probs[0, 7] = 1.0  # a grammar that allows one token
    probs[1, :3] = torch.tensor([0.5, 0.3, 0.2])
    for top_p in (2.0**-149, 1e-30, 1e-7):
        mask = top_p_mask(probs, top_p)
        assert mask[0].nonzero().flatten().tolist() == [7], top_p
        assert mask[1].nonzero().flatten().tolist() == [0], top_p
