"""The drafters: their caches follow the verifier's, and each is built only from what it uses."""

import pytest
import torch

import paradraft.runtime.model as model_module
from paradraft.runtime.correction import RuleParams
from paradraft.runtime.drafters import Drafter
from paradraft.runtime.model import load_model
from paradraft.runtime.speculative import SpeculativeDecoder

PROMPTS = [[4, 8, 15], [16, 23, 42, 7, 7], [9]]


@pytest.mark.parametrize("kind", ["model", "parallel"])
def test_undrafted_rounds_are_re_fed_to_the_draft_cache(verifier, pair, kind):
    # rounds with >= 3 rows run without drafts (disable_by_batch_size=3); when slot 0 drafts
    # again, its draft cache must hold exactly what a fresh pass over its tokens gives
    draft = load_model(pair[2] if kind == "parallel" else pair[1])
    dec = SpeculativeDecoder(verifier, Drafter(kind, draft), RuleParams("greedy"), k=3,
                             max_batch_size=4, disable_by_batch_size=3)
    dec.reset()
    dec.prefill([0, 1, 2], PROMPTS, [40, 40, 40], [None] * 3, [0, 1, 2])
    for _ in range(5):
        dec.step([0, 1, 2])
    start = dec.host_lengths[0]
    assert dec.draft_valid[0] < start - 5  # 5 undrafted rounds (and a lazy prefill) behind
    dec.step([0])
    assert dec.draft_valid[0] == dec.host_lengths[0] - 1
    fresh = model_module.new_kv_cache(draft.config, 1, dec.draft_cache.max_seq_len,
                                      draft.dtype)
    tokens = dec.tokens[:1, : start + 1]
    draft(tokens, torch.arange(start + 1)[None], fresh, kv_len=start + 1)
    for layer in range(draft.config.n_layers):
        torch.testing.assert_close(dec.draft_cache.k[layer][0, : start + 1],
                                   fresh.k[layer][0, : start + 1], atol=1e-4, rtol=1e-4)


def test_each_drafter_is_built_only_from_what_it_uses(verifier, draft):
    assert [Drafter(kind, verifier).kind for kind in ("model", "self")] == ["model", "self"]
    assert Drafter("self", verifier, num_layers=2).num_layers == 2
    assert not Drafter("model", draft).shares_verifier_cache
    assert Drafter("self", verifier).shares_verifier_cache
    with pytest.raises(ValueError, match="num_layers is for the self drafter only"):
        Drafter("model", draft, num_layers=1)  # it would have cut the draft model short
    with pytest.raises(ValueError, match="mask_token_id is for the parallel drafter only"):
        Drafter("model", draft, mask_token_id=3)
    with pytest.raises(ValueError, match="drafter must be one of model, parallel, self, ngram"):
        Drafter("medusa", draft)
    with pytest.raises(ValueError, match="the 'model' drafter needs a model"):
        Drafter("model")
    assert Drafter("ngram").model is None  # model-free: no weights, no cache
    with pytest.raises(ValueError, match=r"self_draft_layers must be in \[1, 2\]"):
        Drafter("self", verifier, num_layers=3)
