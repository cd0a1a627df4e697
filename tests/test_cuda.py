"""The torch runtime on CUDA in bfloat16: what scripts/gpu_check.sh runs on a GPU machine
(skipped where torch sees no CUDA device)."""

import pytest
import torch
from conftest import VOCAB
from test_lossless import NEW_TOKENS, assert_joint_distribution, prompts

from paradraft.runtime.correction import RuleParams
from paradraft.runtime.drafters import Drafter
from paradraft.runtime.model import load_model
from paradraft.runtime.speculative import SpeculativeDecoder

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def cuda_models(pair):
    vdir, ddir, pdir, _ = pair
    return tuple(load_model(d, torch.bfloat16, "cuda") for d in (vdir, ddir, pdir))


@pytest.mark.parametrize("kind", ["model", "parallel", "self"])
def test_bf16_on_cuda_greedy_speculative_equals_greedy_plain(cuda_models, kind):
    verifier, draft, parallel = cuda_models
    plain = SpeculativeDecoder(verifier, None, RuleParams("greedy"), max_batch_size=8)
    want = plain.generate(prompts(), NEW_TOKENS).token_ids
    assert plain.cache.k[0].device.type == "cuda" and plain.cache.k[0].dtype == torch.bfloat16
    model = {"model": draft, "parallel": parallel, "self": verifier}[kind]
    dec = SpeculativeDecoder(verifier, Drafter(kind, model), RuleParams("greedy"), k=4,
                             max_batch_size=8)
    result = dec.generate(prompts(), NEW_TOKENS)
    assert result.token_ids == want
    assert result.stats.accepted_tokens > 0


def test_bf16_on_cuda_exact_rule_keeps_the_verifier_distribution(cuda_models):
    verifier, draft, _ = cuda_models
    assert_joint_distribution(verifier, Drafter("model", draft), VOCAB)
