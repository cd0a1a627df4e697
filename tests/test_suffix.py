"""The suffix drafter (suffix decoding): its drafts against a brute-force reference, its memory
of ended requests (bounded, oldest evicted first), and that decoding with it stays lossless,
in process and served."""

import pytest
import torch
from test_ngram import PROMPTS, plain, serve_alone

from paradraft.runtime.correction import RuleParams
from paradraft.runtime.drafters import SUFFIX_CANDIDATES, Drafter, SuffixDrafter
from paradraft.runtime.model import load_model
from paradraft.runtime.serving.protocol import ServeConfig, build_scheduler
from paradraft.runtime.speculative import SpeculativeDecoder


def reference_draft(seqs: list[list[int]], own: bool, context: list[int], k: int,
                    depth: int, min_prob: float) -> tuple[list[int], float]:
    """Suffix decoding over ``seqs`` in plain Python: the longest suffix of ``context`` (up to
    ``depth`` tokens) that ends somewhere in them (``own``: the context itself, ending before
    its newest token); its SUFFIX_CANDIDATES most recent occurrences; the continuation whose
    agreement counts are largest position by position, then the most recent; drafted while
    the share of occurrences agreeing is >= min_prob, at most as many tokens as the match.
    Returns the draft and its score (the sum of the drafted positions' shares)."""
    occurrences = []  # (recency, match length, continuation)
    for s, seq in enumerate(seqs):
        last = len(seq) - 1  # a continuation runs up to the newest token
        for e in range(len(seq) - (1 if own else 0)):
            n = 0
            while n < depth and n <= e and n < len(context) and seq[e - n] == context[-1 - n]:
                n += 1
            if n:
                occurrences.append(((s, e), n, seq[e + 1: min(last, e + k) + 1]))
    if not occurrences:
        return [], 0.0
    longest = max(n for _, n, _ in occurrences)
    cands = sorted((o for o in occurrences if o[1] == longest), reverse=True)
    cands = cands[:SUFFIX_CANDIDATES]

    def counts(cont):
        return [sum(1 for _, _, c in cands if len(c) > j and c[: j + 1] == cont[: j + 1])
                if len(cont) > j else 0 for j in range(k)]

    _, _, path = max(cands, key=lambda c: (counts(c[2]), c[0]))
    draft, score = [], 0.0
    for j, count in enumerate(counts(path)):
        prob = count / len(cands)
        if j >= min(longest, k) or count == 0 or prob < min_prob:
            break
        draft.append(path[j])
        score += prob
    return draft, score


@pytest.mark.parametrize("depth,min_prob", [(1, 0.1), (3, 0.1), (6, 0.34), (24, 0.6)])
def test_suffix_drafts_what_the_reference_drafts(depth, min_prob):
    g = torch.Generator().manual_seed(depth)
    B, T, k = 48, 48, 5
    drafter = SuffixDrafter(suffix_depth=depth, suffix_min_prob=min_prob,
                            suffix_batched_min_prob=min_prob)
    tokens = torch.randint(0, 3, (B, T), generator=g)  # 3 symbols: matches and ties abound
    lengths = torch.randint(0, 40, (B,), generator=g)
    answers = [torch.randint(0, 3, (int(n),), generator=g).tolist() for n in (9, 1, 30, 14)]
    memory = torch.tensor([t for a in answers for t in (*a, -1)])
    history = int(lengths.max()) + 1
    lengths_seen = set()
    for mem in (None, memory):
        drafts, counts = drafter.lookup(tokens, lengths, k, history, memory=mem)
        assert drafts.shape == (B, k) and counts.shape == (B,)
        for b in range(B):
            row = tokens[b, : lengths[b] + 1].tolist()
            want, score = reference_draft([row], True, row, k, depth, min_prob)
            if mem is not None:
                want_m, score_m = reference_draft(answers, False, row, k, depth, min_prob)
                if score_m > score + 1e-9:
                    want = want_m
            assert counts[b] == len(want), (b, row)
            assert drafts[b, : len(want)].tolist() == want, (b, row)
            lengths_seen.add(len(want))
    assert 0 in lengths_seen and len(lengths_seen) > min(depth, 2)  # depth 1: 1 token at most


def test_suffix_drafts_the_most_frequent_continuation_and_stops_when_unsure():
    # after [1, 2]: 3 three times, 4 once; the match [1, 2] is 2 long, so at most 2 tokens
    row = [1, 2, 3, 9, 1, 2, 4, 9, 1, 2, 3, 9, 1, 2, 3, 8, 1, 2]
    tokens = torch.tensor([row])
    lengths = torch.tensor([len(row) - 1])
    drafts, n = SuffixDrafter(suffix_min_prob=0.5).lookup(tokens, lengths, 4, len(row))
    assert n.tolist() == [2] and drafts[0, :2].tolist() == [3, 9]  # 3: 3/4, then 9: 2/4
    drafts, n = SuffixDrafter(suffix_min_prob=0.6).lookup(tokens, lengths, 4, len(row))
    assert n.tolist() == [1] and drafts[0, :1].tolist() == [3]  # 9 after 3 is 2/4 < 0.6
    # with several rows the batched threshold holds
    two = SuffixDrafter(suffix_min_prob=0.1, suffix_batched_min_prob=0.8)
    _, n = two.lookup(tokens.repeat(2, 1), lengths.repeat(2), 4, len(row))
    assert n.tolist() == [0, 0]


def test_a_long_match_in_memory_beats_a_short_one_in_the_row():
    """A repeated request: its prompt ends as an earlier request's did, whose answer is in
    memory; the memory's long match drafts K tokens of that answer."""
    earlier = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]
    row = [5, 7, 8, 9, 10, 11]
    tokens = torch.tensor([row])
    lengths = torch.tensor([len(row) - 1])
    memory = torch.tensor([3, 3, -1, *earlier, -1])
    drafts, n = SuffixDrafter().lookup(tokens, lengths, 4, len(row), memory=memory)
    assert n.tolist() == [4] and drafts[0].tolist() == [12, 13, 14, 15]
    # the separator ends a continuation: no draft crosses into the next request
    memory = torch.tensor([*earlier[:7], -1, 99, 98])
    drafts, n = SuffixDrafter().lookup(tokens, lengths, 4, len(row), memory=memory)
    assert n.tolist() == [2] and drafts[0, :2].tolist() == [12, 13]


def test_suffix_options_are_validated_by_name(verifier):
    assert Drafter("suffix").kind == "suffix" and Drafter("suffix").model is None
    assert Drafter("suffix", suffix_depth=64).suffix_depth == 64
    for kwargs, match in ((dict(suffix_depth=0), r"suffix_depth must be an integer in \[1, 64\]"),
                          (dict(suffix_min_prob=0), r"suffix_min_prob must be a number in"),
                          (dict(suffix_batched_min_prob=1.5), "suffix_batched_min_prob"),
                          (dict(suffix_cached_requests=-1), "suffix_cached_requests"),
                          (dict(suffix_depth=True), "suffix_depth")):
        with pytest.raises(ValueError, match=match):
            Drafter("suffix", **kwargs)
    with pytest.raises(ValueError, match="the suffix drafter is model-free"):
        Drafter("suffix", verifier)
    with pytest.raises(ValueError, match="suffix_depth is for the suffix drafter only"):
        Drafter("ngram", suffix_depth=4)
    with pytest.raises(ValueError, match="unknown drafter option 'suffix_dept'"):
        Drafter("suffix", suffix_dept=4)


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_with_suffix_equals_plain_decoding(verifier, k):
    want = plain(verifier, PROMPTS)
    drafter = Drafter("suffix", suffix_min_prob=0.1, suffix_batched_min_prob=0.1)
    dec = SpeculativeDecoder(verifier, drafter, RuleParams("greedy"), k=k,
                             max_batch_size=len(PROMPTS))
    result = dec.generate(PROMPTS, 40)
    assert result.token_ids == want
    assert 0 < result.stats.accepted_tokens < result.stats.draft_tokens


def test_memory_keeps_the_last_requests_and_a_retry_drafts_its_last_answer(pair):
    """Served one after another: a repeated prompt drafts the earlier answer from memory
    (nearly all accepted), outputs equal plain decoding's, and the memory holds at most
    ``suffix_cached_requests`` requests, the newest."""
    prompts = [[40, 41, 42, 43, 44, 45, 46], [50, 51, 52], [30, 31, 32, 33]]
    config = ServeConfig(pair[0], None, drafter="suffix", k=4, max_slots=1, max_seq_len=96,
                         max_input_tokens=64, suffix_cached_requests=2)
    scheduler = build_scheduler(config)
    decoder = scheduler.decoder
    try:
        outs = []
        for prompt in (*prompts, prompts[0], prompts[0]):
            outs.append(serve_alone(scheduler, prompt, 32))
            assert len(decoder.answers) <= 2
        held = [a[: len(prompts[0])] for a in decoder.answers]
    finally:
        scheduler.stop()
    verifier = load_model(pair[0])
    want = plain(verifier, [*prompts, prompts[0]], 32)
    assert [o for o, _ in outs] == [*want, want[-1]]
    assert held == [prompts[0], prompts[0]]  # the two newest; the others evicted
    assert decoder.memory_tokens == 2 * (len(prompts[0]) + 32)
    # the first repeat came after two others: evicted, so drafted from its own tokens only;
    # the second repeat found the first in memory
    repeat, first = outs[4][1], outs[3][1]
    assert repeat.accepted_tokens >= 0.8 * repeat.draft_tokens
    assert repeat.verify_steps <= 8 < first.verify_steps  # 31 tokens at K 4: 7 rounds at best
