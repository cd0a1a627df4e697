"""Prefix caching, chunked prefill and the lazy draft prefill: a request that reuses cached
K/V, or reads its prompt in chunks beside running requests, emits what a fresh decoder emits
for it alone."""

import threading

import pytest
import torch

from paradraft.runtime.correction import RuleParams
from paradraft.runtime.drafters import Drafter
from paradraft.runtime.model import load_model
from paradraft.runtime.scheduler import Request, Scheduler
from paradraft.runtime.speculative import SpeculativeDecoder

GREEDY = RuleParams("greedy")
SYSTEM = [5, 9, 12, 7, 33, 41, 8, 19, 25, 30, 11, 4, 17, 22, 6, 14]  # shared preamble


@pytest.fixture(scope="module")
def models(pair):
    return load_model(pair[0]), load_model(pair[1])


def solo(models, prompt, n, drafter="model", params=GREEDY, seed=0):
    verifier, draft = models
    dec = SpeculativeDecoder(verifier, Drafter(drafter, draft if drafter != "ngram" else None),
                             params, k=3, max_batch_size=1, max_seq_len=128)
    return dec.generate([prompt], n, seeds=[seed]).token_ids[0]


def run(sched, prompt, n, params=GREEDY, **kw):
    """Submit and wait; (tokens, stats)."""
    out, done, result = [], threading.Event(), {}

    def on_done(stats, error):
        result.update(stats=stats, error=error)
        done.set()

    sched.submit(Request(prompt, n, params, out.extend, on_done, **kw))
    assert done.wait(120)
    assert result["error"] is None
    return out, result["stats"]


def test_a_request_reuses_the_prefix_an_earlier_one_left_and_emits_its_solo_output(models):
    verifier, draft = models
    dec = SpeculativeDecoder(verifier, Drafter("model", draft), GREEDY, k=3, max_batch_size=2,
                             max_seq_len=128)
    sched = Scheduler(dec, prefill_chunk=None, spread_slots=True)
    try:
        first = [*SYSTEM, 40, 41, 42]
        out1, stats1 = run(sched, first, 12)
        assert stats1.cached_tokens == 0
        # a second turn: the first prompt, its answer, a new message
        second = first + out1 + [50, 51]
        out2, stats2 = run(sched, second, 12)
        assert stats2.cached_tokens == len(first) + len(out1) - 1  # all but the newest token
        assert out2 == solo(models, second, 12)
        # a retry of the same prompt: all but its last token come from the cache
        out3, stats3 = run(sched, second, 12)
        assert stats3.cached_tokens == len(second) - 1
        assert out3 == out2
        # a prompt sharing only the preamble with a longer conversation leaves it be: it
        # takes the empty slot, and the preamble is copied there
        third = [*SYSTEM, 58, 3, 59]
        out4, stats4 = run(sched, third, 12, num_draft_tokens=2)
        assert stats4.cached_tokens == len(SYSTEM)
        assert out4 == solo(models, third, 12)
        assert run(sched, second, 4)[1].cached_tokens == len(second) - 1  # still there
        # with no empty slot, the least recently used one is overwritten, and the preamble
        # it shares is still read from it
        fourth = [*SYSTEM, 3, 3, 3]
        out5, stats5 = run(sched, fourth, 12)
        assert stats5.cached_tokens == len(SYSTEM)
        assert out5 == solo(models, fourth, 12)
    finally:
        sched.stop()


def test_on_the_decoders_own_caches_a_miss_takes_the_lowest_free_slot(models):
    """Rounds over slots 0..B-1 read plain cache slices: with no prefix to reuse, requests
    keep to the lowest slots."""
    verifier, draft = models
    dec = SpeculativeDecoder(verifier, Drafter("model", draft), GREEDY, k=3, max_batch_size=2,
                             max_seq_len=128)
    sched = Scheduler(dec)
    try:
        assert not sched.spread_slots
        for p in ([3, 4, 5], [6, 7, 8], [9, 10, 11]):
            run(sched, p, 4)
            assert dec.host_tokens[0][:3] == p  # each in slot 0, one after the other
        assert dec.host_tokens[1] == []
    finally:
        sched.stop()


def test_prefix_cache_off_feeds_whole_prompts(models):
    verifier, draft = models
    dec = SpeculativeDecoder(verifier, Drafter("model", draft), GREEDY, k=3, max_batch_size=1,
                             max_seq_len=128)
    sched = Scheduler(dec, prefix_cache=False)
    try:
        prompt = [*SYSTEM, 40]
        run(sched, prompt, 4)
        out, stats = run(sched, prompt, 4)
        assert stats.cached_tokens == 0
        assert out == solo(models, prompt, 4)
    finally:
        sched.stop()


def test_sampling_with_a_cache_hit_samples_as_without(models):
    """The first token and every later one come from the request's own random stream:
    reading the prompt from the cache changes nothing of what it samples."""
    verifier, draft = models
    params = RuleParams("exact", temperature=0.9)
    dec = SpeculativeDecoder(verifier, Drafter("model", draft), params, k=3, max_batch_size=1,
                             max_seq_len=128)
    sched = Scheduler(dec)
    try:
        prompt = [*SYSTEM, 40, 41]
        cold, _ = run(sched, prompt, 10, params, seed=7)
        warm, stats = run(sched, prompt, 10, params, seed=7)
        assert stats.cached_tokens == len(prompt) - 1
        assert warm == cold == solo(models, prompt, 10, params=params, seed=7)
    finally:
        sched.stop()


def test_cache_slots_keep_prefixes_and_the_least_recently_used_goes_first(models):
    verifier, draft = models
    # 1 request at a time, 3 slots of cache: the 4th distinct prompt evicts the oldest
    dec = SpeculativeDecoder(verifier, Drafter("model", draft), GREEDY, k=3, max_batch_size=3,
                             max_running=1, max_seq_len=128)
    sched = Scheduler(dec)
    try:
        prompts = [[p] * 3 + SYSTEM[:8] for p in (44, 45, 46, 47)]
        for p in prompts[:3]:
            run(sched, p, 4)
        assert run(sched, prompts[0], 4)[1].cached_tokens == len(prompts[0]) - 1  # kept
        run(sched, prompts[3], 4)  # overwrites the least recently used: prompts[1]'s slot
        assert run(sched, prompts[2], 4)[1].cached_tokens == len(prompts[2]) - 1
        out, stats = run(sched, prompts[1], 4)
        assert stats.cached_tokens == 0
        assert out == solo(models, prompts[1], 4)
        assert sched.stats() == {"active": 0, "queued": 0, "free_slots": 1}
    finally:
        sched.stop()
    with pytest.raises(ValueError, match=r"max_running must be an integer in \[1, 3\]"):
        SpeculativeDecoder(verifier, Drafter("model", draft), max_batch_size=3, max_running=4)


def test_a_long_prompt_is_read_in_chunks_beside_a_running_request(models):
    verifier, draft = models
    dec = SpeculativeDecoder(verifier, Drafter("model", draft), GREEDY, k=3, max_batch_size=2,
                             max_seq_len=128)
    calls = []
    feed = dec.feed_prompt
    dec.feed_prompt = lambda *a: calls.append(a[3]) or feed(*a)  # each chunk's ends
    sched = Scheduler(dec, prefill_chunk=8)
    try:
        short, long = [3, 4, 5], (SYSTEM * 3)[:45]
        started = threading.Event()
        out_short, done_short, res = [], threading.Event(), {}
        sched.submit(Request(short, 60, GREEDY, lambda t: (out_short.extend(t), started.set()),
                             lambda s, e: (res.update(e=e), done_short.set())))
        assert started.wait(60)
        out_long, stats = run(sched, long, 10)
        assert done_short.wait(60) and res["e"] is None
        assert out_long == solo(models, long, 10)
        assert out_short == solo(models, short, 60)
        # read 8 tokens a round while the short one ran (unless it ended first)
        assert calls and all(ends[0] % 8 == 0 for ends in calls)
        assert stats.cached_tokens == 0  # its own chunks are not counted as cached
    finally:
        sched.stop()
    with pytest.raises(ValueError, match="prefill_chunk must be an integer >= 1"):
        Scheduler(dec, prefill_chunk=0)


@pytest.mark.parametrize("kind", ["model", "parallel"])
def test_the_draft_prefill_is_lazy_and_catches_up_in_one_call(pair, models, kind):
    verifier = models[0]
    draft = load_model(pair[2] if kind == "parallel" else pair[1])
    calls = []
    hook = draft.register_forward_pre_hook(lambda m, a: calls.append(a[0].shape[1]))
    try:
        dec = SpeculativeDecoder(verifier, Drafter(kind, draft), GREEDY, k=3,
                                 max_batch_size=2, max_seq_len=128)
        dec.reset()
        prompt = [*SYSTEM, 40, 41]
        dec.prefill([0], [prompt], [20], [None], [0], [0])  # a request that never drafts
        for _ in range(3):
            dec.step([0])
        assert not calls  # no prefill, no draft pass
        dec.prefill([1], [prompt], [20], [None], [0])
        dec.step([0, 1])  # both rows catch up in this round's first draft call
        assert calls[0] >= dec.host_lengths[0] - 5
        assert dec.draft_valid[:2] == [dec.host_lengths[0] - 1, dec.host_lengths[1] - 1]
    finally:
        hook.remove()
    want = solo((verifier, draft), prompt, 20, drafter=kind)
    dec = SpeculativeDecoder(verifier, Drafter(kind, draft), GREEDY, k=3, max_batch_size=1,
                             max_seq_len=128)
    assert dec.generate([prompt], 20).token_ids[0] == want


def test_cached_beyond_the_slots_prefix_is_refused(models):
    verifier, draft = models
    dec = SpeculativeDecoder(verifier, Drafter("model", draft), GREEDY, k=3, max_batch_size=1,
                             max_seq_len=128)
    dec.reset()
    with pytest.raises(ValueError, match=r"cached must be in \[0, 0\] for slot 0"):
        dec.prefill([0], [[4, 5, 6]], [4], [None], [0], cached=[2])
    dec.prefill([0], [[4, 5, 6]], [4], [None], [0])
    assert dec.cached_prefix(0, [4, 5, 9, 9]) == 2
    dec.forget([0])
    assert dec.cached_prefix(0, [4, 5, 9, 9]) == 0
    assert torch.equal(dec.tokens[0, :3], torch.tensor([4, 5, 6]))
