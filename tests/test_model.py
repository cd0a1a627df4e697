import json
from pathlib import Path

import pytest
import torch

from paradraft.runtime.model import load_model, new_kv_cache

FAMILIES = ["llama", "qwen2", "gpt2"]


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers_prefill_and_cached_steps(hf_models, family):
    hf, path = hf_models[family]
    ours = load_model(path)
    torch.manual_seed(0)
    tokens = torch.randint(0, hf.config.vocab_size, (3, 14))
    with torch.no_grad():
        ref = hf(tokens).logits
    cache = new_kv_cache(ours.config, 3, 32, torch.float32)
    pos = torch.arange(14).expand(3, -1)
    prefill, _ = ours(tokens[:, :8], pos[:, :8], cache, kv_len=8)
    single, _ = ours(tokens[:, 8:9], pos[:, 8:9], cache, kv_len=9)
    multi, _ = ours(tokens[:, 9:], pos[:, 9:], cache)
    assert (prefill - ref[:, :8]).abs().max() < 1e-4
    assert (single - ref[:, 8:9]).abs().max() < 1e-4
    assert (multi - ref[:, 9:]).abs().max() < 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_rows_at_different_positions_share_one_batch(hf_models, family):
    hf, path = hf_models[family]
    ours = load_model(path)
    torch.manual_seed(1)
    lens = [3, 9, 6]
    seqs = [torch.randint(0, hf.config.vocab_size, (n + 4,)) for n in lens]
    cache = new_kv_cache(ours.config, 3, 32, torch.float32)
    # right-padded ragged prefill, then one 4-token step at each row's own position
    padded = torch.zeros(3, max(lens), dtype=torch.long)
    for b, n in enumerate(lens):
        padded[b, :n] = seqs[b][:n]
    ours(padded, torch.arange(max(lens)).expand(3, -1), cache)
    step = torch.stack([s[n:n + 4] for s, n in zip(seqs, lens, strict=True)])
    pos = torch.tensor(lens)[:, None] + torch.arange(4)
    logits, _ = ours(step, pos, cache, kv_len=20)
    for b in range(3):
        with torch.no_grad():
            ref = hf(seqs[b][None]).logits[0, lens[b]:]
        assert (logits[b] - ref).abs().max() < 1e-4


def test_rollback_is_a_length(hf_models):
    """Writing junk past a row's length and then re-running from that length gives the
    same logits as if the junk had never been written: nothing needs to be copied."""
    hf, path = hf_models["llama"]
    ours = load_model(path)
    tokens = torch.randint(0, hf.config.vocab_size, (1, 10))
    cache = new_kv_cache(ours.config, 1, 32, torch.float32)
    ours(tokens[:, :6], torch.arange(6)[None], cache)
    junk = torch.randint(0, hf.config.vocab_size, (1, 5))
    ours(junk, torch.arange(6, 11)[None], cache)  # a rejected block
    logits, _ = ours(tokens[:, 6:], torch.arange(6, 10)[None], cache)
    with torch.no_grad():
        ref = hf(tokens).logits[:, 6:]
    assert (logits - ref).abs().max() < 1e-4


def test_clear_errors_for_bad_checkpoints(tmp_path, hf_models):
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "vocab_size": 5}))
    with pytest.raises(ValueError, match="model_type 'bert' is not supported; supported: llama"):
        load_model(tmp_path)
    _, path = hf_models["llama"]
    (tmp_path / "config.json").write_text((Path(path) / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(tmp_path)
    # a rope type we do not implement, in either spelling, is refused rather than run as plain
    config = json.loads((Path(path) / "config.json").read_text())
    for key in ("rope_scaling", "rope_parameters"):
        rope = {"rope_type": "proportional", "factor": 4.0, "rope_theta": 10000.0}
        (tmp_path / "config.json").write_text(json.dumps({**config, key: rope}))
        with pytest.raises(ValueError, match=f"{key} rope_type 'proportional' is not supported"):
            load_model(tmp_path)


def test_rope_is_fp32_and_follows_the_positions_device(hf_models):
    """The rotary tables come from fp32 angles whatever the model dtype (as transformers), and
    the frequencies built on the CPU (also for a model built on the meta device) move along."""
    _, path = hf_models["llama"]
    model = load_model(path, dtype=torch.bfloat16)
    assert model.inv_freq.dtype == torch.float32 and model.inv_freq.device.type == "cpu"
    pos = torch.tensor([[0, 1000, 4000]])
    cos, _ = model.rope(pos, torch.bfloat16)
    exact = (pos[..., None].double() * model.inv_freq.double()).cos()
    assert cos.dtype == torch.bfloat16
    assert (cos[0, :, 0, : exact.shape[-1]].double() - exact[0]).abs().max() < 1e-2


def test_loaded_models_build_no_autograd_graph(hf_models):
    """Inference only: a cache written by a parameter that requires grad would chain every
    step into one autograd graph, growing memory for the whole generation."""
    ours = load_model(hf_models["llama"][1])
    assert not any(p.requires_grad for p in ours.parameters())
    cache = new_kv_cache(ours.config, 1, 16, torch.float32)
    logits, _ = ours(torch.tensor([[1, 2, 3]]), torch.arange(3)[None], cache, kv_len=3)
    assert not logits.requires_grad and not cache.k[0].requires_grad
