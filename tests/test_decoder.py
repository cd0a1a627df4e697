"""The loop: streaming, seeds, stop conditions, rollback after a planted rejection, the
attention causal audit, validation, and the CLI."""


import pytest
import torch

import paradraft.runtime.model as model_module
from paradraft.runtime.correction import RuleParams
from paradraft.runtime.drafters import Drafter
from paradraft.runtime.speculative import SpeculativeDecoder

PROMPTS = [[4, 8, 15], [16, 23, 42, 7, 7], [9]]


def test_stream_concatenates_to_generate_and_seed_reproduces(verifier, draft):
    params = RuleParams("exact", temperature=0.9, top_p=0.95)
    dec = SpeculativeDecoder(verifier, Drafter("model", draft), params, k=4, max_batch_size=4)
    chunks = list(dec.stream(PROMPTS, 20, seed=7))
    assert len(chunks) > 2  # several rounds, each yielding what each row gained
    streamed = [[t for c in chunks for t in c[b]] for b in range(len(PROMPTS))]
    again = dec.generate(PROMPTS, 20, seed=7).token_ids
    assert streamed == again
    assert dec.generate(PROMPTS, 20, seed=8).token_ids != again


def test_per_row_max_new_tokens_and_eos(verifier, draft):
    dec = SpeculativeDecoder(verifier, Drafter("model", draft), RuleParams("greedy"), k=4,
                             max_batch_size=4)
    full = dec.generate(PROMPTS, 30).token_ids
    limited = dec.generate(PROMPTS, [5, 17, 1]).token_ids
    assert [len(r) for r in limited] == [5, 17, 1]
    assert all(lim == f[: len(lim)] for lim, f in zip(limited, full, strict=True))
    # stop at EOS: pick a token that appears in row 1's continuation
    eos = full[1][6]
    stopped = dec.generate(PROMPTS, 30, eos_token_id=eos).token_ids
    for row, f in zip(stopped, full, strict=True):
        cut = f.index(eos) + 1 if eos in f else len(f)
        assert row == f[:cut]


def test_planted_rejection_rolls_back_and_discards_later_drafts(verifier, monkeypatch):
    """A drafter that proposes the verifier's own greedy continuation except a wrong token at
    j: the round accepts exactly j tokens, later drafts are discarded, and the output still
    equals plain greedy decoding."""
    K = 5
    base = SpeculativeDecoder(verifier, None, RuleParams("greedy"), max_batch_size=3)
    truth = base.generate(PROMPTS, 1 + K + 1).token_ids
    for j in range(K):
        dec = SpeculativeDecoder(verifier, Drafter("self", verifier), RuleParams("greedy"),
                                 k=K, max_batch_size=3)

        def planted(tokens, lengths, k, bound, gen, rows=None, missed=0, valid=None, j=j):
            drafts = torch.tensor([t[1: 1 + k] for t in truth])
            drafts[:, j] = (drafts[:, j] + 1) % verifier.config.vocab_size
            return drafts, None

        monkeypatch.setattr(dec, "_draft", planted)
        # one round: the first token from prefill, then j accepted + 1 correction
        result = dec.generate(PROMPTS, 1 + j + 1)
        assert result.token_ids == [t[: j + 2] for t in truth]
        s = result.stats
        assert s.verify_steps == 3 and s.accepted_tokens == 3 * j and s.rollbacks == 3
        assert s.accepted_per_position == [3] * j + [0] * (K - j)


def test_causal_audit_silent_with_correct_mask_and_catches_a_broken_one(verifier, monkeypatch):
    dec = SpeculativeDecoder(verifier, Drafter("self", verifier), RuleParams("greedy"), k=4,
                             audit_epsilon=1e-6, max_batch_size=4)
    plain = SpeculativeDecoder(verifier, None, RuleParams("greedy"), max_batch_size=4)
    result = dec.generate(PROMPTS, 16)
    assert result.stats.causal_leaks == 0
    assert result.token_ids == plain.generate(PROMPTS, 16).token_ids

    def leaky_mask(input_pos, kv_len):  # each query also sees the next position
        key_pos = torch.arange(kv_len)
        return (key_pos[None, None, :] <= input_pos[:, :, None] + 1)[:, None]

    monkeypatch.setattr(model_module, "attention_mask", leaky_mask)
    broken = dec.generate(PROMPTS, 16).stats
    # every verify block leaks at its first position: each round is cut to zero drafts
    assert broken.causal_leaks == broken.verify_steps
    assert broken.accepted_tokens == 0


def test_decoder_validates_its_inputs(verifier, draft):
    with pytest.raises(ValueError, match=r"k must be an integer in \[1, 64\]"):
        SpeculativeDecoder(verifier, Drafter("model", draft), k=0)
    with pytest.raises(ValueError, match="drafter must be one of"):
        Drafter("beam", draft)
    with pytest.raises(ValueError, match="needs mask_token_id"):
        Drafter("parallel", draft)
    with pytest.raises(ValueError, match=r"self_draft_layers must be in \[1, 2\]"):
        Drafter("self", verifier, num_layers=3)
    dec = SpeculativeDecoder(verifier, Drafter("model", draft), max_batch_size=2,
                             max_seq_len=32)
    with pytest.raises(ValueError, match=r"batch size must be in \[1, 2\]"):
        dec.generate(PROMPTS, 4)
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1"):
        dec.generate(PROMPTS[:1], 0)
    with pytest.raises(ValueError, match="max_seq_len=32"):
        dec.generate(PROMPTS[:1], 30)
    with pytest.raises(ValueError, match="prompt must contain at least one token"):
        dec.generate([[]], 3)
    with pytest.raises(ValueError, match="token ids must be in"):
        dec.generate([[10_000]], 3)


