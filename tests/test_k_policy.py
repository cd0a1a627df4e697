"""The round's K: schedules by batch size, the goodput policy, the analytic length."""

import pytest
import torch

from paradraft.runtime.correction import RuleParams
from paradraft.runtime.drafters import Drafter, NgramDrafter
from paradraft.runtime.k_policy import analytic_length, goodput_k, parse_draft_len_schedule
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


def test_goodput_policy_shortens_k_as_the_batch_grows(verifier, draft):
    # round times shaped like this CPU's: at batch 1 a verify pass costs about the same for
    # any K, at batch 8 each extra position costs a lot
    seconds = torch.tensor([[10.0, 11.0, 12.0, 13.0, 14.0],
                            [12.0, 18.0, 26.0, 34.0, 42.0]]) * 1e-3
    assert goodput_k(seconds[0].tolist(), 0.8) == 4
    assert goodput_k(seconds[1].tolist(), 0.8) == 1
    assert goodput_k(seconds[1].tolist(), 0.3) == 0  # poor drafts: plain steps win
    dec = SpeculativeDecoder(verifier, Drafter("model", draft), RuleParams("greedy"), k=4,
                             max_batch_size=8, draft_len_schedule="auto")
    dec.reset()
    dec.round_seconds = ([1, 8], seconds)
    dec.monitor.update(drafted=400, accepted=320, reached=400)  # α = 0.8
    assert dec.round_k([0]) == 4 and dec.round_k(list(range(8))) == 1
    # in between, the times are interpolated: batch 4 sits 3/7 of the way to batch 8
    assert dec.seconds_per_round(4) == pytest.approx(
        (seconds[0] + 3 / 7 * (seconds[1] - seconds[0])).tolist())
    # rounds without drafts fade the evidence back to the prior, so drafting resumes
    dec.monitor.update(drafted=400, accepted=40, reached=400)
    assert dec.round_k(list(range(8))) == 0
    for _ in range(400):
        dec.monitor.relax(0.97)
    assert dec.monitor.alpha == pytest.approx(0.5, abs=0.01)
    assert dec.round_k([0]) == 4


def test_goodput_policy_leaves_a_round_of_lookup_rows_its_k(verifier, draft):
    """Requests that draft with the n-gram lookup on a model-drafter server: the goodput's
    round times are the model's, so a round of lookup rows alone keeps its K; a round with a
    model row in it is still capped."""
    dec = SpeculativeDecoder(verifier, Drafter("model", draft), RuleParams("greedy"), k=4,
                             max_batch_size=4, draft_len_schedule="auto",
                             lookup=NgramDrafter())
    dec.reset()
    dec.round_seconds = ([1, 4], torch.tensor([[10.0, 15.0, 20.0, 25.0, 30.0]] * 2) * 1e-3)
    dec.monitor.update(drafted=400, accepted=40, reached=400)  # α = 0.1: plain steps win
    dec.prefill([0, 1, 2], [[4, 8, 15], [16, 23, 42], [4, 8, 16]], [8] * 3, [None] * 3,
                [0] * 3, lookup_drafts=[True, True, False])
    assert dec.round_k([0, 1]) == 4
    assert dec.round_k([2]) == 0 and dec.round_k([0, 1, 2]) == 0


def test_analytic_acceptance_length():
    assert analytic_length(0.0, 4) == 1.0
    assert analytic_length(1.0, 4) == 5.0
    assert analytic_length(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
