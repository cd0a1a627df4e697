"""The ngram drafter (prompt lookup): what it finds, that a round without a match is a plain
step, and that decoding with it stays lossless (greedy: token for token; exact: the
verifier's distribution), on torch and on ONNX engines, alone and served."""

import threading

import pytest
import torch
from conftest import VOCAB
from scipy.stats import chisquare
from test_lossless import assert_joint_distribution

from paradraft.runtime.backends.loader import load_engines
from paradraft.runtime.correction import Randoms, RuleParams, correct, sampling_probs
from paradraft.runtime.drafters import NGRAM_LIMIT, Drafter, NgramDrafter
from paradraft.runtime.metrics import aggregate
from paradraft.runtime.model import load_model
from paradraft.runtime.scheduler import Request
from paradraft.runtime.serving.protocol import ServeConfig, build_scheduler
from paradraft.runtime.speculative import SpeculativeDecoder

NEW_TOKENS = 40
# rows of different lengths: a loop, a copy of an earlier stretch, and tokens that never repeat
PROMPTS = [[5, 6, 7, 8] * 4, [11, 12, 13, 14, 15, 16, 17, 18, 19, 11, 12, 13], [21, 22, 23],
           [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40], [44, 45, 44, 45, 44]]


def reference_lookup(row: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """The lookup, one row in plain Python: the longest suffix (n_min..n_max tokens) that
    occurred before; of its occurrences the one with the most of K tokens after it up to the
    newest, then the latest; the tokens after it."""
    newest = len(row) - 1
    for n in range(min(n_max, newest), n_min - 1, -1):
        ends = [e for e in range(n - 1, newest) if row[e - n + 1: e + 1] == row[-n:]]
        if ends:
            best = max(ends, key=lambda e: (min(k, newest - e), e))
            return row[best + 1: best + 1 + min(k, newest - best)]
    return []


@pytest.mark.parametrize("n_min,n_max", [(1, 1), (1, 3), (2, 4), (3, 3)])
def test_lookup_finds_what_the_reference_finds(n_min, n_max):
    g = torch.Generator().manual_seed(n_min * 10 + n_max)
    drafter = NgramDrafter(n_min, n_max)
    B, T, k = 64, 40, 5
    tokens = torch.randint(0, 3, (B, T), generator=g)  # 3 symbols: matches are common
    lengths = torch.randint(0, 30, (B,), generator=g)
    history = int(lengths.max()) + 1
    drafts, counts = drafter.lookup(tokens, lengths, k, history)
    assert drafts.shape == (B, k)
    seen = set()
    for b in range(B):
        row = tokens[b, : lengths[b] + 1].tolist()  # what is past the newest token is stale
        want = reference_lookup(row, k, n_min, n_max)
        assert counts[b] == len(want)
        assert drafts[b, : len(want)].tolist() == want
        seen.add(len(want))
    assert 0 in seen and k in seen and len(seen) > 2  # no match, full and partial drafts


def test_lookup_prefers_the_longest_match_then_a_full_block_then_the_latest():
    d = NgramDrafter(1, 3)
    tokens = torch.tensor([
        [1, 2, 9, 1, 2, 8, 2, 5, 1, 2, 0, 0],  # "1 2" (twice) beats "2" (thrice): the latest
        [4, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0],  # a loop: the match with K tokens after it
        [7, 3, 6, 3, 0, 0, 0, 0, 0, 0, 0, 0],  # "3" after "7 3": its one token up to newest
    ])
    drafts, counts = d.lookup(tokens, torch.tensor([9, 5, 3]), 3, 10)
    assert counts.tolist() == [3, 3, 2]
    assert drafts[0].tolist() == [8, 2, 5]
    assert drafts[1].tolist() == [4, 4, 4]
    assert drafts[2, :2].tolist() == [6, 3]


def test_batched_rounds_draft_only_from_long_matches():
    """ngram_batched_min: alone, a row drafts from its 2-token match; beside another row only
    a match of at least that many tokens counts (the reference lookup at that floor)."""
    d = NgramDrafter(2, 6, ngram_batched_min=4)
    short = [9, 1, 2, 3, 8, 7, 6, 5, 2, 3]  # "2 3" occurred before
    long = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4]  # "1 2 3 4" occurred before
    tokens = torch.tensor([[*short, 0], long])
    lengths = torch.tensor([len(short) - 1, len(long) - 1])
    k = 3
    for b, row in enumerate([short, long]):
        _, found = d.lookup(tokens[b:b + 1], lengths[b:b + 1], k, 12)
        assert int(found) == len(reference_lookup(row, k, 2, 6)) > 0
    drafts, counts = d.lookup(tokens, lengths, k, 12)
    assert counts.tolist() == [len(reference_lookup(r, k, 4, 6)) for r in (short, long)]
    assert counts.tolist() == [0, 3] and drafts[1].tolist() == [5, 6, 7]
    with pytest.raises(ValueError, match=r"ngram_batched_min must be an integer in \[2, 6\]"):
        NgramDrafter(2, 6, ngram_batched_min=7)
    assert Drafter("ngram", ngram_batched_min=3).ngram_batched_min == 3


def match_key(row: list[int], seq: list[int], newest: int, k: int, n_min: int, n_max: int
              ) -> list[tuple[int, int]]:
    """Every (key, end) of an occurrence in ``seq`` (its tokens up to ``newest``) of the row's
    suffix, of n_min..n_max tokens: key = match length * (k + 1) + the tokens after it (<= k).
    (A suffix longer than the row repeats its first token, as the lookup's does.)"""
    out = []
    for e in range(newest):
        run = 0
        while run < n_max and e - run >= 0 and seq[e - run] == row[max(len(row) - 1 - run, 0)]:
            run += 1
        if run >= n_min:
            out.append((run * (k + 1) + min(k, newest - e), e))
    return out


def test_shared_lookup_takes_a_longer_match_from_other_sequences():
    """ngram_shared: the best match over the row and the other sequences (longer, or as long
    with more to follow; ties stay with the row), drafting what followed it there."""
    g = torch.Generator().manual_seed(3)
    d = NgramDrafter(1, 4, ngram_shared=True)
    B, S, T, k = 24, 5, 40, 5
    tokens = torch.randint(0, 4, (B, T), generator=g)
    lengths = torch.randint(1, 30, (B,), generator=g)
    shared = torch.randint(0, 4, (S, T), generator=g)
    shared_lengths = torch.randint(0, 39, (S,), generator=g)
    history = int(max(lengths.max(), shared_lengths.max())) + 1
    drafts, counts = d.lookup(tokens, lengths, k, history, shared, shared_lengths)
    took_shared = 0
    for b in range(B):
        row = tokens[b, : lengths[b] + 1].tolist()
        own = match_key(row, row, len(row) - 1, k, 1, 4)
        others = [(key, e, s) for s in range(S) for key, e in match_key(
            row, shared[s].tolist(), int(shared_lengths[s]), k, 1, 4)]
        best_own = max((key for key, _ in own), default=-1)
        best_other = max((key for key, _, _ in others), default=-1)
        if best_other > best_own:
            took_shared += 1
            want = {tuple(shared[s, e + 1: e + 1 + min(k, int(shared_lengths[s]) - e)].tolist())
                    for key, e, s in others if key == best_other}
        else:
            want = {tuple(row[e + 1: e + 1 + min(k, len(row) - 1 - e)])
                    for key, e in own if key == best_own} or {()}
        got = tuple(drafts[b, : counts[b]].tolist())
        assert got in want, b
    assert 0 < took_shared < B
    # without shared sequences it is the row's own lookup
    alone, n = d.lookup(tokens, lengths, k, history)
    want_alone = NgramDrafter(1, 4).lookup(tokens, lengths, k, history)
    assert torch.equal(n, want_alone[1]) and torch.equal(alone, want_alone[0])


def serve_alone(scheduler, prompt: list[int], new_tokens: int) -> tuple[list[int], object]:
    """One greedy request through ``scheduler``, waited for: its tokens and its stats."""
    out, done, got = [], threading.Event(), {}
    scheduler.submit(Request(prompt, new_tokens, RuleParams("greedy"), out.extend,
                             lambda s, e: (got.update(stats=s), done.set())))
    assert done.wait(120)
    return out, got["stats"]


def test_served_shared_lookup_drafts_a_repeated_request_from_its_last_answer(pair):
    """The same prompt twice, one after the other: with ngram_shared the second request
    drafts the first one's answer from its cache slot and nearly every draft is accepted;
    both outputs equal plain decoding's."""
    prompt = [40, 41, 42, 43, 44, 45, 46]
    stats = {}
    for shared in (False, True):
        config = ServeConfig(pair[0], None, drafter="ngram", ngram_min=2, ngram_max=4, k=4,
                             max_slots=1, max_seq_len=96, max_input_tokens=64,
                             ngram_shared=shared, cache_slots=1)
        scheduler = build_scheduler(config)
        try:
            outs = [serve_alone(scheduler, prompt, 32) for _ in range(2)]
        finally:
            scheduler.stop()
        want = plain(load_model(pair[0]), [prompt], 32)[0]
        assert [o for o, _ in outs] == [want, want]
        stats[shared] = outs[1][1]
    assert stats[True].accepted_tokens > stats[False].accepted_tokens
    assert stats[True].accepted_tokens >= 0.8 * 31


def test_ngram_sizes_and_models_are_validated_by_name(verifier):
    assert Drafter("ngram").kind == "ngram" and Drafter("ngram").model is None
    assert (Drafter("ngram", ngram_min=1, ngram_max=NGRAM_LIMIT).ngram_max == NGRAM_LIMIT)
    with pytest.raises(ValueError, match=r"ngram_min must be an integer in \[1, 16\]; got 0"):
        Drafter("ngram", ngram_min=0)
    with pytest.raises(ValueError, match=r"ngram_max must be an integer in \[3, 16\]"):
        Drafter("ngram", ngram_min=3, ngram_max=2)
    with pytest.raises(ValueError, match="ngram_max must be an integer in"):
        Drafter("ngram", ngram_max=17)
    with pytest.raises(ValueError, match="the ngram drafter is model-free"):
        Drafter("ngram", verifier)
    with pytest.raises(ValueError, match="ngram_min is for the ngram drafter only"):
        Drafter("model", verifier, ngram_min=2)
    with pytest.raises(ValueError, match="ngram_max must be an integer in"):
        ServeConfig("v", None, drafter="ngram", ngram_max=40)
    # beside a draft model they size the lookup a request may choose: validated all the same
    assert ServeConfig("v", "d", drafter="model", ngram_min=1).ngram_min == 1
    with pytest.raises(ValueError, match="ngram_max must be an integer in"):
        ServeConfig("v", "d", drafter="model", ngram_max=40)


def plain(verifier, prompts, new_tokens=NEW_TOKENS):
    dec = SpeculativeDecoder(verifier, None, RuleParams("greedy"), max_batch_size=len(prompts))
    return dec.generate(prompts, new_tokens).token_ids


def assert_lossless_with_mixed_rows(verifier, drafter, k, **kwargs):
    want = plain(verifier, PROMPTS)
    dec = SpeculativeDecoder(verifier, drafter, RuleParams("greedy"), k=k,
                             max_batch_size=len(PROMPTS), **kwargs)
    result = dec.generate(PROMPTS, NEW_TOKENS)
    assert result.token_ids == want
    rows = result.row_stats
    # every row ran rounds without a match; some rows found drafts, and those were partly
    # accepted (the lookup guesses right and wrong); some rows drafted fewer than K tokens
    assert all(s.num_drafts < s.verify_steps for s in rows)
    assert any(s.num_drafts > 0 for s in rows)
    total = result.stats
    assert 0 < total.accepted_tokens < total.draft_tokens
    if k > 1:
        assert total.drafted_per_position[-1] < total.drafted_per_position[0]
    return result


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_with_ngram_equals_plain_decoding(verifier, k):
    assert_lossless_with_mixed_rows(verifier, Drafter("ngram", ngram_min=1, ngram_max=3), k)


def test_goodput_k_with_ngram_and_beside_a_model_stays_lossless(pair, verifier):
    """The goodput policy (the default where a drafter runs) over the lookup alone and over
    lookup rows beside model rows: greedy output is plain decoding's, whatever K it picks."""
    dec = SpeculativeDecoder(verifier, Drafter("ngram", ngram_min=1, ngram_max=3),
                             RuleParams("greedy"), k=4, max_batch_size=len(PROMPTS),
                             draft_len_schedule="auto")
    assert dec.generate(PROMPTS, NEW_TOKENS).token_ids == plain(verifier, PROMPTS)
    assert dec.costs is not None and sum(dec.rounds.by_width) > 0
    mixed = SpeculativeDecoder(verifier, Drafter("model", load_model(pair[1])),
                               RuleParams("greedy"), k=4, max_batch_size=len(PROMPTS),
                               lookup=NgramDrafter(1, 3), draft_len_schedule="auto")
    mixed.calibrate(passes=1, rounds=1)
    uses = [i % 2 == 0 for i in range(len(PROMPTS))]
    assert run_slots(mixed, PROMPTS, NEW_TOKENS, list(range(len(PROMPTS))), uses) == plain(
        verifier, PROMPTS)


def test_adaptive_k_and_per_request_k_with_ngram_stay_lossless(verifier):
    result = assert_lossless_with_mixed_rows(verifier, Drafter("ngram", ngram_min=1), 5,
                                             adaptive_k=True)
    assert result.stats.draft_tokens > 0
    # a request with num_draft_tokens 0 beside ones with K: only they draft
    dec = SpeculativeDecoder(verifier, Drafter("ngram", ngram_min=1), RuleParams("greedy"),
                             k=4, max_batch_size=2)
    dec.reset()
    prompts = [PROMPTS[0], PROMPTS[0]]
    new, running = dec.prefill([0, 1], prompts, [20, 20], [None, None], [0, 1], [0, 4])
    out = [list(t) for t in new]
    while any(running):
        slots = [s for s, r in zip([0, 1], running, strict=True) if r]
        new, alive = dec.step(slots)
        for s, t, a in zip(slots, new, alive, strict=True):
            out[s] += t
            running[s] = a
    assert out[0] == out[1] == plain(verifier, prompts[:1], 20)[0]
    assert dec.slot_stats(0).draft_tokens == 0 < dec.slot_stats(1).draft_tokens


def test_a_round_where_no_row_matches_is_a_plain_step(verifier):
    widths: list[int] = []
    hook = verifier.register_forward_pre_hook(lambda m, args: widths.append(args[0].shape[1]))
    try:
        never = Drafter("ngram", ngram_min=NGRAM_LIMIT, ngram_max=NGRAM_LIMIT)  # no repeats
        dec = SpeculativeDecoder(verifier, never, RuleParams("greedy"), k=4, max_batch_size=3)
        result = dec.generate(PROMPTS[1:4], 12)
    finally:
        hook.remove()
    assert result.token_ids == plain(verifier, PROMPTS[1:4], 12)
    assert widths[1:] == [1] * 11  # after the prefill: one position per round, as plain
    assert result.stats.draft_tokens == 0 and result.stats.verify_steps == 3 * 11


@pytest.mark.parametrize("fused", ["on", "off"])
def test_greedy_with_ngram_on_onnx_engines_equals_plain_decoding(pair_engines, fused):
    verifier, drafters, _, _ = load_engines(pair_engines, ngram_min=1, ngram_max=3)
    assert drafters["ngram"] == NgramDrafter(1, 3)  # every engine dir has it: it is model-free
    assert_lossless_with_mixed_rows(verifier, drafters["ngram"], 4, fused_correction=fused)


def test_exact_rule_with_deterministic_drafts_and_missing_ones_keeps_p():
    """A lookup's drafts are deterministic (q one-hot, ``draft_probs=None``) and a row may have
    fewer than K: each emitted token still follows the verifier (p(d) acceptance, residual
    norm(max(p − onehot, 0)), drafts past a row's count rejected)."""
    V, K, N = 8, 3, 100_000
    g = torch.Generator().manual_seed(3)
    target_logits = torch.randn(K + 1, V, generator=g) * 1.5
    params = RuleParams("exact", temperature=0.8)
    p = sampling_probs(target_logits, params.temperature, params.top_p)
    drafts = p[:K].argmax(-1).expand(N, -1)  # deterministic: the same in every row
    num_drafted = torch.randint(0, K + 1, (N,), generator=g)
    rnd = Randoms(torch.rand(N, K, generator=g), torch.empty(N, V).exponential_(generator=g))
    n, t = correct(target_logits.expand(N, -1, -1), drafts, None, params, rnd, num_drafted)
    assert (n <= num_drafted).all()
    first = torch.where(n > 0, drafts[:, 0], t)
    second = torch.where(n > 1, drafts[:, 1], t)[n > 0]
    for samples, target in [(first, p[0]), (second, p[1])]:
        support = target > 0
        counts = torch.bincount(samples, minlength=V).double()
        assert counts[~support].sum() == 0
        expected = target[support].double()
        expected = expected / expected.sum() * samples.numel()
        assert chisquare(counts[support], expected).pvalue > 1e-3


def test_exact_with_ngram_matches_the_verifier_joint_distribution(pair):
    verifier = load_model(pair[0])
    with torch.no_grad():  # peaked distributions: sampled tokens follow the greedy loop often
        verifier.lm_head.weight.mul_(3.0)
    # the prompt ends in the verifier's own greedy loop: most rows find a lookup match, and
    # their drafts are accepted or rejected
    prompt = [5, 9, 14] + plain(verifier, [[5, 9, 14]], 12)[0]
    dec = assert_joint_distribution(verifier, Drafter("ngram", ngram_min=1), VOCAB,
                                    prompt=prompt)
    s = aggregate([dec.slot_stats(row) for row in range(dec.max_batch_size)])
    assert s.num_drafts > s.verify_steps // 2
    assert s.accepted_tokens > 0 and s.rollbacks > 0


def test_served_ngram_requests_get_their_solo_output(pair):
    config = ServeConfig(pair[0], None, drafter="ngram", ngram_min=1, ngram_max=3, k=4,
                         max_slots=3, max_seq_len=96, max_input_tokens=64)
    scheduler = build_scheduler(config)
    assert scheduler.decoder.drafter == NgramDrafter(1, 3)
    try:
        results = []
        for i, prompt in enumerate(PROMPTS):
            out, done = [], threading.Event()
            req = Request(prompt, 24, RuleParams("greedy"), out.extend,
                          lambda s, e, done=done: done.set(), num_draft_tokens=i % 2 * 4)
            scheduler.submit(req)
            results.append((out, done))
        for _, done in results:
            assert done.wait(120)
    finally:
        scheduler.stop()
    want = plain(load_model(pair[0]), PROMPTS, 24)
    assert [out for out, _ in results] == want


def run_slots(dec, prompts, new_tokens, seeds, lookup_drafts=None):
    """Prefill ``prompts`` into slots 0..B-1 and step them to the end: each row's tokens."""
    dec.reset()
    slots = list(range(len(prompts)))
    new, running = dec.prefill(slots, prompts, [new_tokens] * len(prompts),
                               [None] * len(prompts), seeds, lookup_drafts=lookup_drafts)
    out = [list(t) for t in new]
    while any(running):
        live = [s for s in slots if running[s]]
        new, alive = dec.step(live)
        for s, t, a in zip(live, new, alive, strict=True):
            out[s] += t
            running[s] = a
    return out


@pytest.mark.parametrize("rule", ["greedy", "exact"])
def test_per_request_lookup_rows_beside_model_rows_get_their_solo_output(pair, verifier, rule):
    """A request may draft with the n-gram lookup on a server whose drafter is a model:
    each row, lookup or model, gets what it gets alone in a decoder of its own drafter
    (tokens and draft counts), greedy and sampled (the exact rule, per-row seeds)."""
    params = RuleParams(rule, temperature=0.9) if rule == "exact" else RuleParams(rule)
    draft_model = Drafter("model", load_model(pair[1]))
    lookup = NgramDrafter(1, 3)
    uses = [i % 2 == 0 for i in range(len(PROMPTS))]
    seeds = list(range(100, 100 + len(PROMPTS)))
    mixed = SpeculativeDecoder(verifier, draft_model, params, k=4,
                               max_batch_size=len(PROMPTS), lookup=lookup)
    got = run_slots(mixed, PROMPTS, NEW_TOKENS, seeds, uses)
    if rule == "greedy":
        assert got == plain(verifier, PROMPTS)
    alone = {True: SpeculativeDecoder(verifier, lookup, params, k=4, max_batch_size=1),
             False: SpeculativeDecoder(verifier, draft_model, params, k=4, max_batch_size=1)}
    for row, (prompt, use) in enumerate(zip(PROMPTS, uses, strict=True)):
        solo = alone[use]
        assert run_slots(solo, [prompt], NEW_TOKENS, [seeds[row]]) == [got[row]], row
        for field in ("draft_tokens", "accepted_tokens", "num_drafts", "verify_steps"):
            assert getattr(mixed.slot_stats(row), field) == getattr(solo.slot_stats(0),
                                                                    field), (row, field)
    stats = [mixed.slot_stats(row) for row in range(len(PROMPTS))]
    # the lookup rows drafted only where they matched; the model rows in every round
    assert any(s.num_drafts < s.verify_steps for s, use in zip(stats, uses, strict=True) if use)
    assert all(s.num_drafts == s.verify_steps for s, use in zip(stats, uses, strict=True)
               if not use)


def test_rounds_of_lookup_rows_alone_leave_the_draft_model_out(pair, verifier):
    """Rounds where only lookup rows run do not call the draft model, not even for a
    prefill (it is lazy: paid by the first round that drafts with the model)."""
    draft_model = Drafter("model", load_model(pair[1]))
    calls: list[int] = []
    hook = draft_model.model.register_forward_pre_hook(lambda m, a: calls.append(1))
    try:
        dec = SpeculativeDecoder(verifier, draft_model, RuleParams("greedy"), k=4,
                                 max_batch_size=2, lookup=NgramDrafter(1, 3))
        assert run_slots(dec, PROMPTS[:2], 20, [0, 1], [True, True]) == plain(
            verifier, PROMPTS[:2], 20)
        assert not calls  # lazy: no prefill either
        assert dec.draft_valid[:2] == [0, 0]
    finally:
        hook.remove()


def test_lookup_beside_a_drafter_is_validated(pair, verifier):
    with pytest.raises(ValueError, match="lookup is the per-request alternative"):
        SpeculativeDecoder(verifier, NgramDrafter(), lookup=NgramDrafter())
    dec = SpeculativeDecoder(verifier, Drafter("model", load_model(pair[1])), k=4,
                             max_batch_size=1)
    dec.reset()
    with pytest.raises(ValueError, match="lookup_drafts: this decoder has no n-gram lookup"):
        dec.prefill([0], [PROMPTS[0]], [4], [None], [0], lookup_drafts=[True])


def test_per_request_lookup_beside_the_draft_engine_equals_plain_decoding(pair_engines,
                                                                          verifier):
    engine, drafters, _, _ = load_engines(pair_engines, ngram_min=1, ngram_max=3)
    dec = SpeculativeDecoder(engine, drafters["model"], RuleParams("greedy"), k=4,
                             max_batch_size=len(PROMPTS), lookup=drafters["ngram"])
    uses = [i % 2 == 1 for i in range(len(PROMPTS))]
    assert run_slots(dec, PROMPTS, NEW_TOKENS, [0] * len(PROMPTS), uses) == plain(verifier,
                                                                                  PROMPTS)
    stats = [dec.slot_stats(row) for row in range(len(PROMPTS))]
    assert all(s.draft_tokens > 0 for s in stats)
