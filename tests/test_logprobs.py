"""Log-probabilities of emitted tokens (runtime/logprobs.py, the decoder and the scheduler),
on the demo pair: greedy speculation reports what plain greedy decoding reports (within
1e-4), for the draft model and the n-gram lookup; each entry is the verifier's own
log-softmax at that position (a full forward over prompt and output, the reference), under
the exact rule too; the scheduler hands a request one entry per token, cut where a stop
sequence cuts the tokens; bad top_logprobs are refused by name."""

import threading
from pathlib import Path

import pytest
import torch

from paradraft.runtime.correction import RuleParams
from paradraft.runtime.drafters import Drafter
from paradraft.runtime.model import load_model, new_kv_cache
from paradraft.runtime.scheduler import Request, Scheduler
from paradraft.runtime.speculative import SpeculativeDecoder

DEMO = Path(__file__).resolve().parent.parent / "models" / "demo"
PROMPTS = [[5, 17, 42, 9, 3], [11, 2, 7, 7, 7, 7, 30], [8, 8, 1]]
TOP = 5


@pytest.fixture(scope="module")
def pair():
    return load_model(DEMO / "verifier"), load_model(DEMO / "draft")


def reference(verifier, prompt: list[int], output: list[int]) -> torch.Tensor:
    """The verifier's log-softmax at each output position [len(output), V]."""
    ids = prompt + output
    with torch.no_grad():
        logits, _ = verifier(torch.tensor([ids]), torch.arange(len(ids))[None],
                             new_kv_cache(verifier.config, 1, len(ids), torch.float32))
    return torch.log_softmax(logits[0, len(prompt) - 1: len(ids) - 1].double(), -1)


def check_against_reference(verifier, prompt, output, entries, top=TOP):
    assert len(entries) == len(output)
    want = reference(verifier, prompt, output)
    for j, (token, (logprob, best)) in enumerate(zip(output, entries, strict=True)):
        assert logprob == pytest.approx(want[j, token].item(), abs=1e-4)
        assert len(best) == top
        values = [v for _, v in best]
        assert values == sorted(values, reverse=True)
        ref_top = want[j].topk(top).values.tolist()
        assert values == pytest.approx(ref_top, abs=1e-4)
        for i, v in best:
            assert v == pytest.approx(want[j, i].item(), abs=1e-4)


@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_greedy_speculation_reports_plain_decodings_logprobs(pair, drafter):
    verifier, draft = pair
    plain = SpeculativeDecoder(verifier, None, RuleParams("greedy"), max_batch_size=3,
                               max_seq_len=96).generate(PROMPTS, 40, logprobs=TOP)
    spec_drafter = Drafter("model", draft) if drafter == "model" else Drafter("ngram")
    spec = SpeculativeDecoder(verifier, spec_drafter, RuleParams("greedy"), k=4,
                              max_batch_size=3, max_seq_len=96).generate(
        PROMPTS, 40, logprobs=TOP)
    assert spec.stats.accepted_tokens > 0  # drafts were kept, so verify passes gave them
    assert spec.token_ids == plain.token_ids
    for prompt, out, got, want in zip(PROMPTS, spec.token_ids, spec.logprobs, plain.logprobs,
                                      strict=True):
        assert len(got) == len(want) == len(out)
        for (lp, best), (lp0, best0), token in zip(got, want, out, strict=True):
            assert abs(lp - lp0) <= 1e-4
            assert best[0][0] == token  # greedy: the token is the likeliest
            assert [v for _, v in best] == pytest.approx([v for _, v in best0], abs=1e-4)
        check_against_reference(verifier, prompt, out, got)


def test_sampled_tokens_get_the_verifiers_logprobs_and_only_asked_rows_get_any(pair):
    verifier, draft = pair
    dec = SpeculativeDecoder(verifier, Drafter("model", draft), RuleParams("exact", 1.0),
                             k=3, max_batch_size=3, max_seq_len=96)
    result = dec.generate(PROMPTS, 24, seed=3, logprobs=0)
    for prompt, out, entries in zip(PROMPTS, result.token_ids, result.logprobs, strict=True):
        check_against_reference(verifier, prompt, out, entries, top=0)
    # rows that asked for none get none, and their rounds run as before
    dec.reset()
    new, _ = dec.prefill([0, 1], PROMPTS[:2], [8, 8], [None, None], [1, 2],
                         logprobs=[None, 2])
    assert dec.take_logprobs(0) == [] and len(dec.take_logprobs(1)) == 1
    new, _ = dec.step([0, 1])
    assert dec.take_logprobs(0) == []
    entries = dec.take_logprobs(1)
    assert len(entries) == len(new[1]) and all(len(best) == 2 for _, best in entries)
    for top in (-1, 21, 1.5, True):
        with pytest.raises(ValueError, match="top_logprobs must be an integer in"):
            dec.prefill([2], PROMPTS[2:], [4], [None], [0], logprobs=[top])


def test_the_scheduler_hands_one_entry_per_token_cut_by_stop_sequences(pair):
    verifier, _ = pair
    dec = SpeculativeDecoder(verifier, Drafter("ngram"), RuleParams("greedy"), k=4,
                             max_batch_size=2, max_seq_len=96)
    want = dec.generate(PROMPTS[1:2], 30, logprobs=1)
    stop = want.token_ids[0][10:12]  # ends the output after its 12th token
    scheduler = Scheduler(dec)
    try:
        got_tokens, got_entries, done = [], [], threading.Event()
        scheduler.submit(Request(PROMPTS[1], 30, RuleParams("greedy"), got_tokens.extend,
                                 lambda stats, error: done.set(), stop_sequences=[stop],
                                 logprobs=1, on_logprobs=got_entries.extend))
        assert done.wait(60)
    finally:
        scheduler.stop()
    n = next(i + 2 for i in range(len(want.token_ids[0])) if want.token_ids[0][i:i + 2] == stop)
    assert got_tokens == want.token_ids[0][:n]
    assert len(got_entries) == n
    assert [lp for lp, _ in got_entries] == pytest.approx(
        [lp for lp, _ in want.logprobs[0][:n]], abs=1e-4)
