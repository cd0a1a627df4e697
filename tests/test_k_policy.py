"""The round's K: schedules by batch size, the goodput policy, the analytic length."""

import pytest
import torch

from paradraft.runtime.correction import RuleParams
from paradraft.runtime.drafters import Drafter, NgramDrafter
from paradraft.runtime.k_policy import (
    RoundCosts,
    analytic_length,
    parse_draft_len_schedule,
    plan_round,
)
from paradraft.runtime.speculative import SpeculativeDecoder


def test_draft_len_schedule_picks_k_by_batch_size(verifier, draft):
    dec = SpeculativeDecoder(verifier, Drafter("model", draft), RuleParams("greedy"), k=4,
                             max_batch_size=8, draft_len_schedule={1: 4, 4: 2, 8: 0})
    dec.reset()
    # TensorRT-LLM's reading: the K of the largest threshold <= the running batch size
    assert [dec.round_k(list(range(b))) for b in range(1, 9)] == [4, 4, 4, 2, 2, 2, 2, 0]
    dec.host_k[0] = 1  # a request's own num_draft_tokens still caps its round
    assert dec.round_k([0]) == 1
    for bad, match in [({2: 4}, "holds batch size 1"), ({1: 5}, r"K in \[0, 4\]"),
                       ({1: 4, 0: 1}, "batch size >= 1"), ("fast", "'auto' or")]:
        with pytest.raises(ValueError, match=match):
            SpeculativeDecoder(verifier, Drafter("model", draft), k=4, draft_len_schedule=bad)
    assert parse_draft_len_schedule("1:4,8:0") == {1: 4, 8: 0}
    with pytest.raises(ValueError, match="SIZE:K"):
        parse_draft_len_schedule("1-4")


def costs(verify: list[list[float]], draft: list[list[float]]) -> RoundCosts:
    return RoundCosts.from_calibration([1, 8], torch.tensor(verify) * 1e-3,
                                       torch.tensor(draft) * 1e-3, 8)


# round costs shaped like this CPU's: at batch 1 a verify pass costs about the same for any
# K, at batch 8 each extra position costs a lot; the draft model costs a tenth of a step
COSTS = costs([[10.0, 10.5, 11.0, 11.5, 12.0], [12.0, 18.0, 26.0, 34.0, 42.0]],
              [[0.0, 1.0, 2.0, 3.0, 4.0], [0.0, 1.2, 2.4, 3.6, 4.8]])


def plan(batch: int, alpha: float, caps: list[int] | None = None, found: list[int] = (),
         pinned: list[bool] | None = None, costs: RoundCosts = COSTS):
    caps = [4] * batch if caps is None else caps
    pinned = [False] * len(caps) if pinned is None else pinned
    return plan_round(costs.verify[batch - 1], costs.draft[batch - 1], alpha, alpha, caps,
                      pinned, list(found), [False] * len(found))


def test_goodput_policy_shortens_k_as_the_batch_grows():
    assert plan(1, 0.8).k_model == 4
    assert plan(8, 0.8).k_model == 1
    assert plan(8, 0.3).k_model == 0  # poor drafts: plain steps win
    assert plan(8, 0.3).expected_speedup == pytest.approx(1.0)
    # in between, the costs are interpolated: batch 4 sits 3/7 of the way to batch 8
    assert COSTS.verify[3] == pytest.approx([a + 3 / 7 * (b - a) for a, b in
                                             zip(COSTS.verify[0], COSTS.verify[7], strict=True)])
    # a row's own K caps what it gains: rows capped at 1 gain nothing from K = 4
    assert plan(1, 0.95, caps=[1]).k_model == 1
    # the expected speed-up is the plan's own arithmetic
    p = plan(1, 0.8)
    assert p.expected_speedup == pytest.approx(analytic_length(0.8, 4) / 0.016 * 0.010)


def test_goodput_policy_weighs_what_the_lookup_found():
    """Lookup rows are planned on what they found, and cost no draft call: where the draft
    model is too dear to pay, the lookup still drafts."""
    dear = costs([[10.0, 10.5, 11.0, 11.5, 12.0], [12.0, 18.0, 26.0, 34.0, 42.0]],
                 [[0.0, 8.0, 16.0, 24.0, 32.0], [0.0, 9.0, 18.0, 27.0, 36.0]])
    assert plan(1, 0.8, costs=dear).k_model == 0
    assert plan(1, 0.8, caps=[], found=[4], costs=dear).k_lookup == 4
    assert plan(1, 0.8, caps=[], found=[0], costs=dear).k_lookup == 0  # found nothing
    # mixed: the model row sits out (K 0) while the lookup row keeps its drafts
    mixed = plan(2, 0.8, caps=[4], found=[4], costs=dear)
    assert mixed.k_model == 0 < mixed.k_lookup
    # at batch 8 every extra position is dear: the lookup's cap shrinks as the model's K
    assert plan(8, 0.8, caps=[], found=[4] * 8).k_lookup == 1


def test_goodput_policy_leaves_a_pinned_k_be():
    """A request that named its K drafts it; the policy prices the round at the width it
    forces, so the others draft that far too: it costs them nothing more."""
    assert plan(8, 0.3).k_model == 0
    p = plan(8, 0.3, pinned=[True] + [False] * 7)
    assert p.k_model == 4
    assert p.seconds == pytest.approx(COSTS.verify[7][4] + COSTS.draft[7][4])
    p = plan(8, 0.3, caps=[1] + [4] * 7, pinned=[True] + [False] * 7)
    assert p.k_model == 1 and p.seconds == pytest.approx(COSTS.verify[7][1] + COSTS.draft[7][1])


def test_round_costs_follow_live_rounds_keeping_the_calibrated_ratios():
    c = costs([[10.0, 11.0], [12.0, 18.0]], [[0.0, 1.0], [0.0, 2.0]])
    c.observe(8, 1, 1, 0.004, 0.028)  # this round was slower than calibrated
    assert c.verify[7][1] == pytest.approx(0.018 + 0.1 * (0.028 - 0.018))
    assert c.draft[7][1] == pytest.approx(0.002 + 0.1 * (0.004 - 0.002))
    # the K that did not run moved by the same factor; other batch sizes stayed
    assert c.verify[7][0] / c.verify[7][1] == pytest.approx(12 / 18)
    assert c.verify[0] == pytest.approx([0.010, 0.011])
    before = list(c.draft[7])
    for _ in range(50):  # plain steps, slower than calibrated: the draft model sat out
        c.observe(8, 0, 0, 0.0, 0.024)
    assert c.draft[7] == before and c.draft[7][0] == 0.0 and c.revision == 51
    # the drafting width's cost rose with them: drafting does not look cheaper than it is
    assert c.verify[7][0] == pytest.approx(0.024, rel=0.01)
    assert c.verify[7][1] / c.verify[7][0] == pytest.approx(18 / 12)


def test_auto_is_the_goodput_policy_in_the_decoder(verifier, draft):
    dec = SpeculativeDecoder(verifier, Drafter("model", draft), RuleParams("greedy"), k=4,
                             max_batch_size=8, draft_len_schedule="auto")
    dec.reset()
    dec.costs = COSTS
    dec.monitor.update(drafted=400, accepted=320, reached=400)  # α = 0.8
    assert dec.round_k(list(range(8))) == 4  # the cap; the plan picks within it
    # rounds without drafts fade the evidence back to the prior, so drafting resumes
    dec.monitor.update(drafted=400, accepted=40, reached=400)
    for _ in range(400):
        dec.monitor.relax(0.97)
    assert dec.monitor.alpha == pytest.approx(0.5, abs=0.01)


def test_a_batch_expected_below_plain_runs_plain_rounds(verifier, draft):
    """Where no K is expected to beat a plain step (α low, drafts dear), every round is a
    plain step and the draft model is never called; the metrics say so."""
    calls = []
    drafter = Drafter("model", draft)
    propose = drafter.propose
    drafter.propose = lambda *a, **kw: calls.append(a[2]) or propose(*a, **kw)
    dec = SpeculativeDecoder(verifier, drafter, RuleParams("greedy"), k=4, max_batch_size=4,
                             draft_len_schedule="auto")
    dec.costs = costs([[10.0, 15.0, 20.0, 25.0, 30.0]] * 2, [[0.0, 8.0, 16.0, 24.0, 32.0]] * 2)
    dec.costs.refresh = 0.0  # keep the planted costs: this test is about the choice
    dec.monitor.update(drafted=4000, accepted=400, reached=4000)  # α = 0.1
    result = dec.generate([[4, 8, 15], [16, 23, 42], [4, 8, 16], [1, 2]], 12)
    assert calls == [] and result.stats.draft_tokens == 0
    assert dec.rounds.by_width[0] == sum(dec.rounds.by_width) > 0
    assert dec.rounds.expected_speedup == pytest.approx(1.0)
    # the same batch with good drafts at cheap cost drafts
    dec.costs = costs([[10.0, 10.5, 11.0, 11.5, 12.0]] * 2, [[0.0, 0.1, 0.2, 0.3, 0.4]] * 2)
    dec.costs.refresh = 0.0
    dec.monitors["model"] = type(dec.monitor)(floor=0.0)
    dec.monitor.update(drafted=4000, accepted=3800, reached=4000)
    result = dec.generate([[4, 8, 15], [16, 23, 42], [4, 8, 16], [1, 2]], 12)
    assert calls and max(calls) == 4 and result.stats.draft_tokens > 0


def test_each_drafter_keeps_its_own_acceptance(verifier, draft):
    """Model rows and lookup rows: one drafter's acceptance does not move the other's α,
    and a mixed batch whose model rows are all at K = 0 does not call the draft model."""
    calls = []
    drafter = Drafter("model", draft)
    propose = drafter.propose
    drafter.propose = lambda *a, **kw: calls.append(a[2]) or propose(*a, **kw)
    dec = SpeculativeDecoder(verifier, drafter, RuleParams("greedy"), k=4, max_batch_size=4,
                             draft_len_schedule="auto", lookup=NgramDrafter())
    dec.costs = costs([[10.0, 10.5, 11.0, 11.5, 12.0]] * 2, [[0.0, 8.0, 16.0, 24.0, 32.0]] * 2)
    dec.costs.refresh = 0.0
    dec.monitors["model"].update(drafted=4000, accepted=400, reached=4000)  # α = 0.1
    model_alpha = dec.monitors["model"].alpha
    dec.reset()
    # repetitive prompts: the lookup finds its drafts
    prompts = [[5, 6, 7, 8] * 6, [9, 10, 11, 12] * 6, [4, 8, 15, 16]]
    _, alive = dec.prefill([0, 1, 2], prompts, [16] * 3, [None] * 3, [0] * 3,
                             lookup_drafts=[True, True, False])
    while any(alive):
        slots = [s for s, a in zip([0, 1, 2], alive, strict=True) if a]
        _, alive_now = dec.step(slots)
        alive = [a and alive_now[slots.index(s)] if s in slots else False
                 for s, a in zip([0, 1, 2], alive, strict=True)]
    assert calls == []  # the model rows sat out every round
    assert dec.monitors["ngram"].reached > 0  # the lookup rows drafted and were judged
    assert dec.monitors["model"].alpha == pytest.approx(model_alpha, abs=0.02)
    assert dec.slot_stats(0).draft_tokens > 0 and dec.slot_stats(2).draft_tokens == 0



def test_analytic_acceptance_length():
    assert analytic_length(0.0, 4) == 1.0
    assert analytic_length(1.0, 4) == 5.0
    assert analytic_length(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def test_a_drafter_whose_rounds_fall_short_of_the_plan_loses_the_policys_trust(verifier,
                                                                                  draft):
    """The policy's model of a round can be wrong in ways α and the costs do not show (the
    draft cache's catch-up after plain rounds): each drafter learns realized over expected
    on the rounds it drafted in, and its plans are discounted by it. Planted costs far below
    the real ones make every drafting round fall short: the model soon sits out, while its α
    alone would still have it draft; the n-gram lookup's trust is untouched."""
    dec = SpeculativeDecoder(verifier, Drafter("model", draft), RuleParams("greedy"), k=4,
                             max_batch_size=4, draft_len_schedule="auto")
    dec.costs = costs([[0.01, 0.0105, 0.011, 0.0115, 0.012]] * 2,
                      [[0.0, 0.001, 0.002, 0.003, 0.004]] * 2)
    dec.costs.refresh = 0.0  # keep the planted costs: only the trust can learn
    dec.monitor.update(drafted=4000, accepted=3800, reached=4000)  # α = 0.95
    dec.generate([[4, 8, 15], [16, 23, 42], [4, 8, 16], [1, 2]], 100)
    model = dec.monitors["model"]
    assert model.trust < 0.5 and dec.monitors["ngram"].trust == 1.0
    drafted_rounds = sum(dec.rounds.by_width[1:])
    assert 0 < drafted_rounds < sum(dec.rounds.by_width) / 2
    size = 3  # batch 4
    assert plan_round(dec.costs.verify[size], dec.costs.draft[size], model.alpha, 0.5,
                      [4] * 4, [False] * 4, [], []).k_model > 0  # α alone: it would draft
    assert plan_round(dec.costs.verify[size], dec.costs.draft[size], model.alpha, 0.5,
                      [4] * 4, [False] * 4, [], [], trust_model=model.trust).k_model == 0


def test_trust_follows_the_rounds_and_fades_back_when_the_drafter_sits_out():
    from paradraft.runtime.metrics import TRUST_MAX, AcceptanceMonitor

    m = AcceptanceMonitor()
    m.judge(0.5)
    assert m.trust == pytest.approx(0.95)
    m.judge(9.0)  # one lucky round counts as TRUST_MAX at most
    assert m.trust == pytest.approx(0.95 + 0.1 * (TRUST_MAX - 0.95))
    m.trust = 0.4
    for _ in range(300):
        m.relax(0.99)
    assert m.trust == pytest.approx(1.0, abs=0.04)
    # a plan is weighed by the trust of the drafters it uses, only those
    assert plan(1, 0.8).k_model == 4
    assert plan_round(COSTS.verify[0], COSTS.draft[0], 0.8, 0.8, [4], [False], [], [],
                      trust_model=0.5).k_model == 0
    assert plan_round(COSTS.verify[0], COSTS.draft[0], 0.8, 0.8, [4], [False], [], [],
                      trust_lookup=0.5).k_model == 4
