"""Shared fixtures: tiny random-initialised HF checkpoints written to a temp dir."""

from __future__ import annotations

import pytest
import torch

from paradraft.runtime.model import load_model

transformers = pytest.importorskip("transformers")

VOCAB = 61


def save_hf(model, path) -> str:
    model.save_pretrained(path)
    return str(path)


def tiny_config(family: str, layers: int = 3, vocab: int = VOCAB, **extra):
    if family == "gpt2":
        return transformers.GPT2Config(vocab_size=vocab, n_embd=48, n_layer=layers, n_head=4,
                                       n_positions=256, bos_token_id=0, eos_token_id=0, **extra)
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[family]
    return cls(vocab_size=vocab, hidden_size=48, intermediate_size=80, num_hidden_layers=layers,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
               bos_token_id=0, eos_token_id=0, **extra)


def sharpen(model, scale: float = 4.0):
    """Scale the LM head so random models have peaked distributions (drafts can agree)."""
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    return model


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory):
    """{family: (hf_model, dir)} for each supported family."""
    out = {}
    for i, family in enumerate(["llama", "qwen2", "gpt2"]):
        torch.manual_seed(i)
        m = transformers.AutoModelForCausalLM.from_config(tiny_config(family)).eval()
        out[family] = (m, save_hf(m, tmp_path_factory.mktemp(family)))
    return out


@pytest.fixture(scope="session")
def pair(tmp_path_factory):
    """(verifier_dir, draft_dir, parallel_dir, hf_verifier): a verifier and drafts that agree
    with it often, so blocks are partly accepted and rollbacks happen at every position."""
    torch.manual_seed(0)
    cfg = tiny_config("llama", layers=3, tie_word_embeddings=False)
    verifier = sharpen(transformers.AutoModelForCausalLM.from_config(cfg).eval())
    vdir = save_hf(verifier, tmp_path_factory.mktemp("verifier"))
    # draft: a noisy copy of the verifier (agrees on most but not all argmaxes)
    draft = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    draft.load_state_dict(verifier.state_dict())
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.004)
    ddir = save_hf(draft, tmp_path_factory.mktemp("draft"))
    pcfg = tiny_config("llama", layers=3, tie_word_embeddings=False, mask_token_id=VOCAB - 1)
    parallel = transformers.AutoModelForCausalLM.from_config(pcfg).eval()
    parallel.load_state_dict(draft.state_dict())
    pdir = save_hf(parallel, tmp_path_factory.mktemp("parallel"))
    return vdir, ddir, pdir, verifier


@pytest.fixture(scope="session")
def pair_engines(pair, tmp_path_factory):
    """The ``pair`` checkpoints built into an ONNX engine dir (verifier, draft, parallel draft,
    self-draft with 1 layer); built once per session. Float32 drafting graphs: the
    conformance suite asserts the torch backend's acceptance counts exactly (the int8 default
    is tested on its own in test_onnx.py)."""
    pytest.importorskip("onnxruntime")
    from paradraft.build.onnx import build_engines

    vdir, ddir, pdir, _ = pair
    out = tmp_path_factory.mktemp("engines")
    # max_k 5: the suites run K <= 5, and each K adds a fused draft graph per drafter
    build_engines(vdir, out, ddir, pdir, self_draft_layers=1, draft_precision="float32",
                  max_k=5)
    return out


@pytest.fixture(scope="module")
def verifier(pair):
    return load_model(pair[0])


@pytest.fixture(scope="module")
def draft(pair):
    return load_model(pair[1])
