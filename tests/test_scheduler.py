"""In-flight batching: requests join and leave between rounds over a fixed slot pool."""

import threading
import time
from collections.abc import Callable

import pytest
import torch

from paradraft.runtime.correction import RuleParams
from paradraft.runtime.drafters import Drafter
from paradraft.runtime.model import load_model
from paradraft.runtime.scheduler import QueueFull, Request, Scheduler, ShuttingDown
from paradraft.runtime.serving.protocol import ServeConfig, build_scheduler
from paradraft.runtime.speculative import SpeculativeDecoder


@pytest.fixture(scope="module")
def models(pair):
    return load_model(pair[0]), load_model(pair[1])


def collect(scheduler, prompt, max_new, params, **kw):
    out, done = [], threading.Event()
    result = {}

    def on_done(stats, error):
        result.update(stats=stats, error=error)
        done.set()

    req = Request(prompt, max_new, params, out.extend, on_done, **kw)
    scheduler.submit(req)
    return out, done, result


def hold_scheduler(scheduler) -> Callable[[], threading.Event]:
    """Submit a greedy request whose first callback blocks the scheduler thread, and wait
    until it does; the returned function cancels that request and lets the thread go on,
    and returns the event its on_done sets."""
    started, release, cancelled, done = (threading.Event() for _ in range(4))

    def hold(tokens):
        started.set()
        release.wait(60)

    scheduler.submit(Request([7, 8], 60, RuleParams("greedy"), hold, lambda s, e: done.set(),
                             is_cancelled=cancelled.is_set))
    assert started.wait(60)

    def let_go() -> threading.Event:
        cancelled.set()
        release.set()
        return done

    return let_go


def test_many_requests_over_few_slots_each_get_their_solo_output(models):
    verifier, draft = models
    greedy = RuleParams("greedy")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 60, (int(n),), generator=g).tolist()
               for n in torch.randint(1, 20, (16,), generator=g)]
    lengths = [int(n) for n in torch.randint(1, 30, (16,), generator=g)]
    solo = SpeculativeDecoder(verifier, Drafter("model", draft), greedy, k=4, max_batch_size=1,
                              max_seq_len=64)
    want = [solo.generate([p], n).token_ids[0] for p, n in zip(prompts, lengths, strict=True)]
    dec = SpeculativeDecoder(verifier, Drafter("model", draft), greedy, k=4, max_batch_size=4,
                             max_seq_len=64)
    sched = Scheduler(dec, max_queue=16)
    try:
        runs = [collect(sched, p, n, greedy, num_draft_tokens=1 + i % 4)
                for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))]
        for _, done, result in runs:
            assert done.wait(120)
            assert result["error"] is None
        assert [r[0] for r in runs] == want
        assert all(r[2]["stats"].generated_tokens == n for r, n in zip(runs, lengths,
                                                                      strict=True))
        assert sched.stats() == {"active": 0, "queued": 0, "free_slots": 4}
    finally:
        sched.stop()


def test_a_stop_right_after_admission_still_ends_the_admitted_requests(models):
    """A stop that lands between a request's admission (it has a slot, it is not running
    yet) and the scheduler's next look at the stop flag ends that request too: without its
    final callback the server never answers it, and Triton waits for it to unload."""
    verifier, draft = models
    dec = SpeculativeDecoder(verifier, Drafter("model", draft), RuleParams("greedy"), k=2,
                             max_batch_size=2, max_seq_len=64)
    sched = Scheduler(dec, max_queue=4)
    let_go = hold_scheduler(sched)  # the thread waits inside a callback of slot 0
    admit = sched._admit

    def admit_then_stop():  # the stop arrives just after the admission
        admitted = admit()
        if admitted:
            with sched.lock:
                sched.stopping = True
        return admitted

    sched._admit = admit_then_stop
    out, done, result = collect(sched, [3, 4], 8, RuleParams("greedy"))
    held_done = let_go()
    try:
        assert done.wait(60), "the admitted request never heard it ended"
        assert isinstance(result["error"], ShuttingDown) and out == []
        assert held_done.wait(60)
        sched.thread.join(60)
        assert not sched.thread.is_alive() and sorted(sched.free) == [0, 1]
    finally:
        sched.stop()


def test_bad_requests_are_refused_and_a_full_queue_says_so(models):
    verifier, draft = models
    dec = SpeculativeDecoder(verifier, Drafter("model", draft), RuleParams("greedy"), k=2,
                             max_batch_size=1, max_seq_len=64)
    sched = Scheduler(dec, max_queue=1)
    greedy = RuleParams("greedy")
    try:
        with pytest.raises(ValueError, match="max_new_tokens"):
            collect(sched, [1, 2], 0, greedy)
        with pytest.raises(ValueError, match=r"num_draft_tokens must be an integer in \[0, 2\]"):
            collect(sched, [1, 2], 4, greedy, num_draft_tokens=3)
        let_go = hold_scheduler(sched)  # keeps the only slot busy
        second = collect(sched, [3, 4], 4, greedy)  # waits in the queue
        with pytest.raises(QueueFull, match="queue full"):
            collect(sched, [5], 4, greedy)
        # the long one leaves; its slot serves the waiting one
        assert let_go().wait(60) and second[1].wait(60)
        assert second[2]["error"] is None and len(second[0]) == 4
    finally:
        sched.stop()


def test_requests_cancelled_in_the_queue_give_their_places_to_new_ones(models):
    """A full queue whose waiting requests were cancelled takes a new request: the cancelled
    ones are told they ended (no tokens) at once, not when a slot frees, and the new one runs."""
    verifier, draft = models
    dec = SpeculativeDecoder(verifier, Drafter("model", draft), RuleParams("greedy"), k=2,
                             max_batch_size=1, max_seq_len=64)
    sched = Scheduler(dec, max_queue=2)
    greedy = RuleParams("greedy")
    try:
        let_go = hold_scheduler(sched)  # keeps the only slot busy
        gave_up = threading.Event()
        waiting = [collect(sched, [3, 4], 4, greedy, is_cancelled=gave_up.is_set)
                   for _ in range(2)]
        with pytest.raises(QueueFull, match="2 waiting: max_queue 2"):
            collect(sched, [5], 4, greedy)
        gave_up.set()
        out, done, result = collect(sched, [5], 4, greedy)  # takes a cancelled one's place
        for w_out, w_done, w_result in waiting:  # ended before any slot freed
            assert w_done.is_set() and w_result == {"stats": None, "error": None}
            assert w_out == []
        assert sched.stats()["queued"] == 1
        let_go()
        assert done.wait(60) and result["error"] is None and len(out) == 4
    finally:
        sched.stop()


def test_a_raising_callback_of_a_cancelled_queued_request_stops_nothing(models):
    """The scheduler tells a request cancelled in the queue that it ended; a callback that
    raises there is logged, and the scheduler thread serves the next request."""
    verifier, draft = models
    dec = SpeculativeDecoder(verifier, Drafter("model", draft), RuleParams("greedy"), k=2,
                             max_batch_size=1, max_seq_len=64)
    sched = Scheduler(dec)
    told = threading.Event()

    def on_done(stats, error):
        told.set()
        raise RuntimeError("client went away")

    try:
        let_go = hold_scheduler(sched)
        sched.submit(Request([3, 4], 4, RuleParams("greedy"), lambda t: None, on_done,
                             is_cancelled=lambda: True))
        assert let_go().wait(60) and told.wait(60)
        out, done, result = collect(sched, [5], 4, RuleParams("greedy"))
        assert done.wait(60) and result["error"] is None and len(out) == 4
    finally:
        sched.stop()


def test_the_queue_stays_bounded_while_the_scheduler_is_busy(models):
    """While the scheduler thread is busy (here: held inside a request's callback), requests
    queue even with slots free; they count against the bound (max_queue + free slots), the
    rest are refused, and the queued ones all finish afterwards."""
    verifier, draft = models
    dec = SpeculativeDecoder(verifier, Drafter("model", draft), RuleParams("greedy"), k=2,
                             max_batch_size=3, max_seq_len=64)
    sched = Scheduler(dec, max_queue=2)
    sampled = RuleParams("exact", temperature=0.7)
    try:
        let_go = hold_scheduler(sched)
        waiting = [collect(sched, [3, 4], 4, sampled) for _ in range(2 + 2)]  # 2 + 2 free
        assert sched.stats() == {"active": 1, "queued": 4, "free_slots": 2}
        with pytest.raises(QueueFull, match=r"4 waiting: max_queue 2 \+ 2 free slots"):
            collect(sched, [5], 4, sampled)
        assert let_go().wait(60)  # the scheduler moves on; the queued requests run, none lost
        for out, done, result in waiting:
            assert done.wait(60) and result["error"] is None and len(out) == 4
    finally:
        sched.stop()


def test_stop_cut_finds_the_earliest_stop_sequence_across_rounds():
    from paradraft.runtime.scheduler import stop_cut

    stops = [[7, 8, 9], [5]]
    assert stop_cut([], [1, 2, 3], stops) is None
    assert stop_cut([], [1, 5, 7, 8, 9], stops) == 2  # [5] ends first
    assert stop_cut([7, 8], [9, 5], stops) == 1  # started in an earlier round
    assert stop_cut([8], [9, 1], stops) is None  # [8, 9] alone is not [7, 8, 9]


def test_a_stop_sequence_ends_the_request_with_the_output_up_to_it(models):
    """Greedy with a stop sequence taken from the request's own solo output: the output is
    that output up to and including the stop sequence's first occurrence, the slot frees."""
    verifier, draft = models
    greedy = RuleParams("greedy")
    solo = SpeculativeDecoder(verifier, Drafter("model", draft), greedy, k=4, max_batch_size=1,
                              max_seq_len=64)
    prompt = [5, 6, 7, 8]
    full = solo.generate([prompt], 40).token_ids[0]
    stop = full[20:22]
    first_end = next(i + 2 for i in range(len(full) - 1) if full[i: i + 2] == stop)
    dec = SpeculativeDecoder(verifier, Drafter("model", draft), greedy, k=4, max_batch_size=2,
                             max_seq_len=64)
    sched = Scheduler(dec)
    try:
        out, done, result = collect(sched, prompt, 40, greedy, stop_sequences=[stop])
        assert done.wait(60) and result["error"] is None
        assert out == full[:first_end]
        assert sched.stats() == {"active": 0, "queued": 0, "free_slots": 2}
    finally:
        sched.stop()


def test_requests_with_different_parameters_run_side_by_side(models):
    """A sampled request does not wait for a running greedy one to drain: it finishes first,
    and each gets its solo output (the sampled one from its own seed, at its own K)."""
    verifier, draft = models
    greedy, sampled = RuleParams("greedy"), RuleParams("exact", temperature=0.8)
    long_prompt, short_prompt = [5, 6, 7, 8], [9, 10, 11]

    def solo(params, prompt, n, seed, k):
        dec = SpeculativeDecoder(verifier, Drafter("model", draft), params, k=k,
                                 max_batch_size=1, max_seq_len=64)
        return dec.generate([prompt], n, seed=seed).token_ids[0]

    dec = SpeculativeDecoder(verifier, Drafter("model", draft), greedy, k=4, max_batch_size=4,
                             max_seq_len=64)
    sched = Scheduler(dec)
    finished = []
    try:
        runs = [collect(sched, long_prompt, 50, greedy),
                collect(sched, short_prompt, 8, sampled, seed=7, num_draft_tokens=2)]
        for name, (_, done, _) in zip(("greedy", "sampled"), runs, strict=True):
            threading.Thread(target=lambda n=name, d=done: d.wait(60) and finished.append(n)
                             ).start()
        for _, done, result in runs:
            assert done.wait(60) and result["error"] is None
        time.sleep(0.1)
        assert finished == ["sampled", "greedy"]
        assert runs[0][0] == solo(greedy, long_prompt, 50, 0, 4)
        assert runs[1][0] == solo(sampled, short_prompt, 8, 7, 2)
    finally:
        sched.stop()


def test_a_failed_prefill_frees_every_slot_and_the_next_group_seeds_afresh(models):
    """One group's prefill fails while another's succeeded in the same admission: every
    request hears of it (none hangs), every slot comes back, and a later request with the
    failed group's parameters samples from its own seed, as it would alone."""
    verifier, draft = models
    greedy, sampled = RuleParams("greedy"), RuleParams("exact", temperature=0.8)
    dec = SpeculativeDecoder(verifier, Drafter("model", draft), greedy, k=2, max_batch_size=4,
                             max_seq_len=64)
    real_prefill, failed = dec.prefill, []

    def prefill(slots, *args, **kw):
        if dec.params.rule == "exact" and not failed:
            failed.append(slots)
            raise RuntimeError("prefill broke")
        return real_prefill(slots, *args, **kw)

    dec.prefill = prefill
    sched = Scheduler(dec)
    try:
        let_go = hold_scheduler(sched)  # so that the next two are admitted together
        runs = [collect(sched, [3, 4], 20, greedy), collect(sched, [5, 6], 20, sampled, seed=3)]
        let_go()
        for _, done, _ in runs:
            assert done.wait(60)
        assert failed and "prefill broke" in str(runs[1][2]["error"])
        time.sleep(0.1)
        assert sched.stats() == {"active": 0, "queued": 0, "free_slots": 4}
        out, done, result = collect(sched, [5, 6], 12, sampled, seed=3)
        assert done.wait(60) and result["error"] is None
        solo = SpeculativeDecoder(verifier, Drafter("model", draft), sampled, k=2,
                                  max_batch_size=1, max_seq_len=64)
        assert out == solo.generate([[5, 6]], 12, seed=3).token_ids[0]
    finally:
        sched.stop()


def test_greedy_requests_share_a_group_and_groups_share_the_round_k(models):
    """Greedy at two temperatures is one group (temperature means nothing to argmax); with a
    sampled group beside it, disable_by_batch_size counts every running request."""
    verifier, draft = models
    dec = SpeculativeDecoder(verifier, Drafter("model", draft), RuleParams("greedy"), k=2,
                             max_batch_size=4, max_seq_len=64, disable_by_batch_size=3)
    steps, real_step = [], dec.step

    def step(slots, k=None):
        steps.append((dec.params.rule, len(slots), k))
        return real_step(slots, k)

    dec.step = step
    sched = Scheduler(dec)
    try:
        let_go = hold_scheduler(sched)  # so that the next three start together
        runs = [collect(sched, [1, 2], 30, RuleParams("greedy", temperature=0.5)),
                collect(sched, [3, 4], 30, RuleParams("greedy", temperature=1.3)),
                collect(sched, [5, 6], 30, RuleParams("exact", temperature=0.8))]
        let_go()
        for _, done, result in runs:
            assert done.wait(60) and result["error"] is None
    finally:
        sched.stop()
    assert ("greedy", 2, 0) in steps  # both greedy requests in one step; 3 running: K 0
    assert ("exact", 1, 0) in steps


def test_server_scheduler_calibrates_the_auto_schedule_before_serving(pair):

    config = ServeConfig(pair[0], pair[1], k=2, max_slots=2, max_seq_len=64,
                         max_input_tokens=32, draft_len_schedule="auto")
    scheduler = build_scheduler(config)
    try:
        costs = scheduler.decoder.costs
        assert len(costs.verify) == 2 and all(len(row) == 3 for row in costs.verify)
        # the calibration left every slot free and the decoder ready
        out, done, result = collect(scheduler, [5, 6, 7], 8, RuleParams("greedy"))
        assert done.wait(60) and result["error"] is None and len(out) == 8
    finally:
        scheduler.stop()


@pytest.mark.parametrize("kind", ["model", "parallel"])
def test_a_seeded_request_samples_the_same_alone_and_amid_others(pair, kind):
    """A sampled request's tokens depend on its own inputs and seed only: alone, and started
    together with 7 others (some with its parameters and other seeds, some with other rules,
    one with drafting off), it gives the same tokens."""
    verifier = load_model(pair[0])
    drafter = Drafter(kind, load_model(pair[1] if kind == "model" else pair[2]))
    params = RuleParams("exact", temperature=0.9)
    prompt, n = [5, 9, 14, 3], 24

    def serve(requests: list[tuple[list[int], RuleParams, int, int | None]]) -> list[list[int]]:
        dec = SpeculativeDecoder(verifier, drafter, RuleParams("greedy"), k=4,
                                 max_batch_size=8, max_seq_len=64)
        sched = Scheduler(dec)
        try:
            let_go = hold_scheduler(sched)  # so that all of them start in one admission
            runs = [collect(sched, p, n, rp, seed=seed, num_draft_tokens=k)
                    for p, rp, seed, k in requests]
            let_go()
            for _, done, result in runs:
                assert done.wait(120) and result["error"] is None
            return [out for out, _, _ in runs]
        finally:
            sched.stop()

    alone = serve([(prompt, params, 42, None)])[0]
    others = [([7, 1, 2], params, 1, None), ([7, 1, 2], params, 2, 2),
              ([3, 3], RuleParams("exact", temperature=1.2), 42, None),
              ([8, 9, 10, 11], RuleParams("greedy"), 0, None),
              ([4], RuleParams("typical", temperature=0.7), 5, None),
              ([6, 2], params, 3, 0), ([9, 9, 9], RuleParams("exact", top_p=0.9), 7, 3)]
    amid = serve([*others[:3], (prompt, params, 42, None), *others[3:]])
    assert amid[3] == alone
    # not vacuous: other seeds give other tokens for the same prompt and parameters
    assert serve([(prompt, params, 43, None)])[0] != alone
