"""Speculative greedy decoding of every supported family equals transformers' greedy
``generate`` on checkpoints in the families' real config formats, stopping where transformers
stops on an EOS list read from generation_config.json."""

import json
import shutil

import pytest
import torch
from conftest import FAMILY_CONFIGS, FAMILY_VOCAB, family_model, save_hf

from paradraft.runtime.correction import RuleParams
from paradraft.runtime.drafters import Drafter
from paradraft.runtime.model import load_config, load_model
from paradraft.runtime.speculative import SpeculativeDecoder

SUPPORTED = list(FAMILY_CONFIGS)
PROMPTS = [[5, 9, 14, 3], [7], [40, 41, 42, 43, 44, 45, 46], [11, 12]]
NEW_TOKENS = 20


def hf_greedy(hf, prompt: list[int], eos: list[int]) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                      eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def family_drafts(family_checkpoints, tmp_path_factory):
    """A one-layer random draft of each family (same vocabulary, other weights)."""
    out = {}
    for name in SUPPORTED:
        layers = {"n_layer": 1} if name == "gpt2" else {"num_hidden_layers": 1}
        out[name] = save_hf(family_model(name, seed=7, **layers),
                            tmp_path_factory.mktemp(f"{name.replace('.', '_')}_draft"))
    return out


@pytest.mark.parametrize("family", SUPPORTED)
def test_speculative_greedy_equals_transformers_and_stops_on_an_eos_list(
        family, family_checkpoints, family_drafts, tmp_path):
    hf, path = family_checkpoints[family]
    free = [hf_greedy(hf, p, []) for p in PROMPTS]
    # an EOS list whose first id never occurs and whose second ends the first prompt early:
    # generation must stop on the second id, as transformers does
    second = free[0][6]
    first = next(t for t in range(FAMILY_VOCAB) if all(t not in f for f in free))
    ckpt = tmp_path / "verifier"
    shutil.copytree(path, ckpt)
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [first, second]}))
    assert load_config(ckpt).eos_token_ids == (first, second)
    want = [hf_greedy(hf, p, [first, second]) for p in PROMPTS]
    assert want[0] == free[0][: free[0].index(second) + 1]

    verifier = load_model(ckpt)
    eos = verifier.config.eos_token_ids
    for drafter in (Drafter("self", verifier, num_layers=1),
                    Drafter("model", load_model(family_drafts[family]))):
        dec = SpeculativeDecoder(verifier, drafter, RuleParams("greedy"), k=4,
                                 max_batch_size=len(PROMPTS), max_seq_len=64)
        result = dec.generate(PROMPTS, NEW_TOKENS, eos_token_id=eos)
        assert result.token_ids == want, drafter.kind
        assert result.stats.draft_tokens > 0
