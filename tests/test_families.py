"""Every supported family against transformers, and every config.json field that changes the
math either honoured (logits within 1e-4 in fp32) or refused by name.

The models are tiny random checkpoints written by transformers from the real checkpoints'
config.json (``conftest.FAMILY_CONFIGS``, dims shrunk). ``runtime.model.CONFIG_FIELDS`` is the
list of fields; the coverage tests at the end fail when an entry there has no case here.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from conftest import FAMILY_CONFIGS, family_config, family_model, save_hf, transformers

from paradraft.runtime.model import (
    BOUNDED,
    CONFIG_FIELDS,
    HONOURED,
    IGNORED,
    REFUSED,
    REFUSED_MODEL_TYPES,
    ROPE_TYPES,
    KVCache,
    ModelConfig,
    load_config,
    load_model,
    new_kv_cache,
)

TOL = 1e-4  # fp32 logits against transformers
# one family per model_type, for the fields every Llama-style family shares
BY_TYPE = {"llama": "llama2", "mistral": "mistral", "qwen2": "qwen2.5", "qwen3": "qwen3",
           "phi3": "phi3", "gpt2": "gpt2"}
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
YARN_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


def longrope(original: int = 128, **extra) -> dict:
    """A LongRoPE block (Phi-3-mini-128k's shape: one factor per rotary frequency)."""
    short = [1.0 + 0.25 * i for i in range(8)]  # head_dim 16: 8 frequencies
    return {"rope_type": "longrope", "short_factor": short,
            "long_factor": [4 * f for f in short], "original_max_position_embeddings": original,
            **extra}


def empty_cache(config: ModelConfig, slots: int, length: int) -> KVCache:
    """A cache ``new_kv_cache`` would refuse (past a BOUNDED field's limit)."""
    shape = (slots, length, config.n_kv_heads, config.head_dim)
    return KVCache([torch.zeros(shape) for _ in range(config.n_layers)],
                   [torch.zeros(shape) for _ in range(config.n_layers)])


def max_diffs(hf, ours, n: int, cache=new_kv_cache, seed: int = 0) -> dict[str, float]:
    """max |Δlogits| against one transformers forward over 3 rows of ``n`` tokens, for our
    prefill of n - 6 tokens, then a one-token step, then a 5-token step; and for ragged rows
    (each prefilled to its own length in a shuffled cache slot, junk past it, then a 4-token
    step at its own positions)."""
    g = torch.Generator().manual_seed(seed)
    vocab = hf.config.vocab_size
    tokens = torch.randint(0, vocab, (3, n), generator=g)
    with torch.no_grad():
        ref = hf(tokens).logits
        pos = torch.arange(n).expand(3, -1)
        kv = cache(ours.config, 3, n)
        p = n - 6
        prefill, _ = ours(tokens[:, :p], pos[:, :p], kv, kv_len=p)
        single, _ = ours(tokens[:, p:p + 1], pos[:, p:p + 1], kv, kv_len=p + 1)
        multi, _ = ours(tokens[:, p + 1:], pos[:, p + 1:], kv)
        lens = [n - 4, n - 13, n - 9]
        rows = torch.tensor([2, 0, 3])
        kv = cache(ours.config, 4, n)
        padded = torch.randint(0, vocab, (3, max(lens)), generator=g)  # junk past each length
        for b, length in enumerate(lens):
            padded[b, :length] = tokens[b, :length]
        ours(padded, pos[:, :max(lens)], kv, rows=rows)
        step = torch.stack([tokens[b, length:length + 4] for b, length in enumerate(lens)])
        step_pos = torch.tensor(lens)[:, None] + torch.arange(4)
        ragged, _ = ours(step, step_pos, kv, rows=rows)
    expected = torch.stack([ref[b, length:length + 4] for b, length in enumerate(lens)])
    return {"prefill": float((prefill - ref[:, :p]).abs().max()),
            "single": float((single - ref[:, p:p + 1]).abs().max()),
            "multi": float((multi - ref[:, p + 1:]).abs().max()),
            "ragged": float((ragged - expected).abs().max())}


def cache_of(length: int):
    return lambda config, slots, n: new_kv_cache(config, slots, length, torch.float32)


def check_case(tmp_path: Path, family: str, overrides: dict, n: int, seed: int = 0):
    """Build the case's transformers model and save it; assert ours matches it at every step,
    loaded from the config.json transformers 5 writes and from the one the case spells out (as
    a checkpoint written before transformers 5 has it: rope_scaling, a top-level rope_theta or
    original_max_position_embeddings). Returns (transformers model, our model)."""
    hf = family_model(family, seed=seed, **overrides)
    path = Path(save_hf(hf, tmp_path / "ckpt"))
    ours = load_model(path)
    diffs = max_diffs(hf, ours, n, cache=cache_of(n))
    assert max(diffs.values()) < TOL, diffs
    (path / "config.json").write_text(json.dumps({**FAMILY_CONFIGS[family], **overrides}))
    as_written = load_model(path)
    diffs = max_diffs(hf, as_written, n, cache=cache_of(n))
    assert max(diffs.values()) < TOL, ("as written", diffs)
    return hf, ours


# -- the families, as their checkpoints come ----------------------------------------------------


@pytest.mark.parametrize("family", list(FAMILY_CONFIGS))
def test_family_matches_transformers(family_checkpoints, family):
    """Prefill, one-token step, multi-token step and ragged rows out to position ~1000: past
    the wavelengths the llama3 / yarn scaling changes, so a wrong rope shows."""
    hf, path = family_checkpoints[family]
    ours = load_model(path)
    diffs = max_diffs(hf, ours, 1000, cache=cache_of(1000))
    assert max(diffs.values()) < TOL, diffs


def test_family_configs_load_as_their_checkpoints_say(family_checkpoints):
    c = {name: load_config(path) for name, (_, path) in family_checkpoints.items()}
    assert c["llama3.2"].eos_token_ids == (93, 94, 95) and c["llama3.2"].tie_embeddings
    assert c["llama3.1"].rope_scaling == {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}
    assert c["qwen3"].head_dim == 32 != c["qwen3"].dim // c["qwen3"].n_heads
    assert c["qwen3"].qk_norm and not c["qwen3"].qkv_bias and not c["qwen3"].o_bias
    assert c["qwen2.5"].qkv_bias and not c["qwen2.5"].o_bias and c["qwen2.5"].rope_theta == 1e6
    assert c["yarn"].rope_scaling["attention_factor"] == pytest.approx(0.1 * 1.3862944 + 1)
    assert c["phi3"].sliding_window == 2047
    # Qwen2.5's real config.json carries sliding_window 131072 with use_sliding_window false:
    # ignored, as transformers does (no cache bound)
    assert ModelConfig.from_hf(FAMILY_CONFIGS["qwen2.5"]).sliding_window is None
    new_kv_cache(ModelConfig.from_hf(FAMILY_CONFIGS["qwen2.5"]), 1, 200_000, torch.float32,
                 device="meta")


@pytest.mark.parametrize("family", [f for f, d in FAMILY_CONFIGS.items() if "rope_scaling" in d])
def test_older_rope_scaling_spelling_loads_identically(family_checkpoints, family, tmp_path):
    """transformers 5 writes rope_parameters (rope_theta inside); checkpoints written before
    it carry rope_scaling and a top-level rope_theta. Both load to the same config, as does
    the real config.json the fixture was made from (yarn's has the older "type" key)."""
    _, path = family_checkpoints[family]
    saved = json.loads((Path(path) / "config.json").read_text())
    assert "rope_parameters" in saved and "rope_scaling" not in saved
    older = {k: v for k, v in saved.items() if k != "rope_parameters"}
    block = dict(saved["rope_parameters"])
    older["rope_theta"] = block.pop("rope_theta")
    older["rope_scaling"] = None if block["rope_type"] == "default" else block
    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(older))
    assert load_config(tmp_path) == load_config(path)
    assert ModelConfig.from_hf(FAMILY_CONFIGS[family]) == load_config(path)


@pytest.mark.parametrize("family", list(FAMILY_CONFIGS))
def test_bf16_matches_transformers_bf16(family_checkpoints, family):
    """bf16 weights and activations on both sides (ours keeps fp32 rope angles and norm
    statistics, as transformers does). bf16 keeps 8 bits of mantissa, so 1e-4 is out of reach:
    transformers' own bf16 logits sit up to ~0.13 from its fp32 ones here (logits: std 1, max
    |4.5|). Stated tolerance: ours at most 1.5x + 0.02 that far from fp32, and within 0.2 of
    transformers' bf16 logits (measured: 0.05-0.12)."""
    hf, path = family_checkpoints[family]
    hf16 = copy.deepcopy(hf).to(torch.bfloat16)
    ours = load_model(path, dtype=torch.bfloat16)
    tokens = torch.randint(0, hf.config.vocab_size, (2, 64),
                           generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref32, ref16 = hf(tokens).logits, hf16(tokens).logits.float()
        cache = new_kv_cache(ours.config, 2, 64, torch.bfloat16)
        pos = torch.arange(64).expand(2, -1)
        first, _ = ours(tokens[:, :60], pos[:, :60], cache)
        rest, _ = ours(tokens[:, 60:], pos[:, 60:], cache)
    ours16 = torch.cat([first, rest], 1)
    theirs_err = float((ref16 - ref32).abs().max())
    ours_err = float((ours16 - ref32).abs().max())
    assert ours_err <= 1.5 * theirs_err + 0.02, (ours_err, theirs_err)
    assert float((ours16 - ref16).abs().max()) < 0.2


# -- fields honoured ------------------------------------------------------------------------------


def _common_cases(model_type: str) -> list[tuple[str, dict, int]]:
    """(field, overrides, tokens) for the fields every Llama-style family shares."""
    family = BY_TYPE[model_type]
    tied = bool(FAMILY_CONFIGS[family].get("tie_word_embeddings"))
    if model_type == "phi3":  # Phi3Config takes default or longrope only
        rope = [("rope_parameters", {"rope_scaling": None, "rope_parameters": {
                    **longrope(), "rope_theta": 500.0}}, 120),
                ("rope_scaling", {"rope_scaling": longrope()}, 120),
                ("original_max_position_embeddings",
                 {"rope_scaling": longrope(original=4096), "original_max_position_embeddings": 96,
                  "max_position_embeddings": 4096}, 96),
                ("max_position_embeddings",  # longrope's factor default: max / original
                 {"rope_scaling": longrope(), "max_position_embeddings": 100_000}, 120)]
    else:
        rope = [("rope_parameters", {"rope_scaling": None, "rope_parameters": {
                    "rope_type": "linear", "factor": 4.0, "rope_theta": 500.0}}, 120),
                ("rope_scaling", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}, 120),
                ("original_max_position_embeddings",
                 {"rope_scaling": {**LLAMA3_ROPE, "original_max_position_embeddings": 8192},
                  "original_max_position_embeddings": 64}, 120),
                ("max_position_embeddings",  # dynamic rope's bound
                 {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0},
                  "max_position_embeddings": 64}, 64)]
    return [
        ("num_key_value_heads", {"num_key_value_heads": 1}, 32),
        ("head_dim", {"head_dim": 24}, 32),
        ("hidden_act", {"hidden_act": "gelu"}, 32),
        ("rms_norm_eps", {"rms_norm_eps": 0.5}, 32),
        ("tie_word_embeddings", {"tie_word_embeddings": not tied}, 32),
        ("rope_theta", {"rope_scaling": None, "rope_theta": 50.0}, 64),
        *rope,
    ]


HONOURED_CASES: list[tuple[str, str, dict, int]] = [  # (family, field, overrides, tokens)
    *((BY_TYPE[t], field, o, n) for t in ("llama", "mistral", "qwen2", "qwen3", "phi3")
      for field, o, n in _common_cases(t)),
    *(("llama2", "hidden_act", {"hidden_act": act}, 32)
      for act in ("silu", "swish", "gelu_new", "gelu_pytorch_tanh", "relu")),
    ("llama2", "attention_bias", {"attention_bias": True}, 32),
    ("llama2", "mlp_bias", {"mlp_bias": True}, 32),
    ("qwen3", "attention_bias", {"attention_bias": True}, 32),
    # the window of a sliding layer: exact up to it (BOUNDED: a longer cache is refused)
    ("mistral", "sliding_window", {"sliding_window": 40}, 40),  # Mistral-7B-v0.1 style
    ("phi3", "sliding_window", {"sliding_window": 40}, 40),
    *((f, "sliding_window", {"use_sliding_window": True, "sliding_window": 40,
                             "max_window_layers": 1}, 40) for f in ("qwen2.5", "qwen3")),
    # Qwen: sliding_window is ignored unless use_sliding_window, and then only layers from
    # max_window_layers (or those layer_types names) slide: none here, so no bound
    *((f, "use_sliding_window", {"use_sliding_window": False, "sliding_window": 16}, 48)
      for f in ("qwen2.5", "qwen3")),
    *((f, "max_window_layers", {"use_sliding_window": True, "sliding_window": 16,
                                "max_window_layers": 3}, 48) for f in ("qwen2.5", "qwen3")),
    *((f, "layer_types", {"use_sliding_window": True, "sliding_window": 16,
                          "layer_types": ["full_attention"] * 3}, 48)
      for f in ("qwen2.5", "qwen3")),
    # GPT-2
    ("gpt2", "n_inner", {"n_inner": 96}, 32),
    ("gpt2", "activation_function", {"activation_function": "gelu"}, 32),
    ("gpt2", "activation_function", {"activation_function": "relu"}, 32),
    ("gpt2", "layer_norm_epsilon", {"layer_norm_epsilon": 0.5}, 32),
    ("gpt2", "tie_word_embeddings", {"tie_word_embeddings": False}, 32),
    ("gpt2", "scale_attn_weights", {"scale_attn_weights": False}, 32),
    ("gpt2", "scale_attn_by_inverse_layer_idx", {"scale_attn_by_inverse_layer_idx": True}, 32),
    ("gpt2", "n_positions", {"n_positions": 40}, 40),
]
# rope types on Llama (and the Qwen2 / Phi-3 checkpoints that ship them): each key a type reads
# at a non-default value somewhere, positions past original_max_position_embeddings
ROPE_CASES: list[tuple[str, dict, int]] = [  # (family, rope block, tokens)
    ("llama2", {"rope_type": "linear", "factor": 4.0}, 120),
    ("llama2", {"rope_type": "dynamic", "factor": 2.0}, 64),  # max_position_embeddings 64
    ("llama2", LLAMA3_ROPE, 200),
    ("llama2", {**LLAMA3_ROPE, "factor": 16.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
                "original_max_position_embeddings": 128}, 200),
    ("llama2", YARN_ROPE, 200),
    ("qwen2.5", {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}, 200),
    # original 4096: where beta_fast 8 / beta_slow 4 move the ramp off the defaults' dims
    ("llama2", {**YARN_ROPE, "original_max_position_embeddings": 4096, "beta_fast": 8,
                "beta_slow": 4}, 200),
    ("llama2", {**YARN_ROPE, "mscale": 1.0, "mscale_all_dim": 0.5}, 200),  # DeepSeek-style
    ("llama2", {**YARN_ROPE, "attention_factor": 1.5}, 200),
    ("llama2", {**YARN_ROPE, "truncate": False}, 200),
    ("llama2", {**YARN_ROPE, "factor": None}, 200),  # max_position_embeddings / original
    ("llama2", longrope(), 128),
    ("phi3", longrope(), 128),
    ("phi3", longrope(factor=2.0), 128),
    ("phi3", longrope(attention_factor=1.25), 128),
    ("phi3", {"type": "su", **{k: v for k, v in longrope().items() if k != "rope_type"}}, 128),
]


@pytest.mark.parametrize("family, field, overrides, n", HONOURED_CASES,
                         ids=[f"{f}-{field}-{i}" for i, (f, field, _, _) in
                              enumerate(HONOURED_CASES)])
def test_honoured_field_matches_transformers(tmp_path, family, field, overrides, n):
    assert field in overrides
    check_case(tmp_path, family, overrides, n)


@pytest.mark.parametrize("family, rope, n", ROPE_CASES,
                         ids=[f"{f}-{r.get('rope_type', r.get('type'))}-{i}"
                              for i, (f, r, _) in enumerate(ROPE_CASES)])
def test_rope_type_matches_transformers(tmp_path, family, rope, n):
    overrides = {"rope_scaling": rope}
    if rope.get("rope_type") == "dynamic":
        overrides["max_position_embeddings"] = n
    if rope.get("original_max_position_embeddings") and family == "phi3":
        overrides["original_max_position_embeddings"] = rope["original_max_position_embeddings"]
    if rope.get("rope_type", rope.get("type")) in ("longrope", "su"):
        overrides["max_position_embeddings"] = 4 * n
    hf, _ = check_case(tmp_path, family, overrides, n)
    # the scaling shows: the same weights with plain rope give other logits
    plain = family_model(family, rope_scaling=None,
                         **{k: v for k, v in overrides.items() if k != "rope_scaling"})
    plain.load_state_dict(hf.state_dict())
    tokens = torch.randint(0, hf.config.vocab_size, (1, n))
    with torch.no_grad():
        moved = (hf(tokens).logits - plain(tokens).logits).abs().max()
    if rope.get("rope_type") != "dynamic":  # dynamic is plain rope up to its bound
        assert moved > 100 * TOL


@pytest.mark.parametrize("case", [
    # (family, overrides, the field new_kv_cache names, its value, cache length to refuse)
    ("mistral", {"sliding_window": 4096}, "sliding_window", 4096, 4097),  # Mistral-7B-v0.1
    ("phi3", {}, "sliding_window", 2047, 2048),  # Phi-3-mini-4k
    ("qwen2.5", {"use_sliding_window": True, "sliding_window": 40, "max_window_layers": 1},
     "sliding_window", 40, 41),
    ("llama2", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0},
                "max_position_embeddings": 48}, "max_position_embeddings", 48, 49),
    ("phi3", {"rope_scaling": longrope(original=48), "original_max_position_embeddings": 48,
              "max_position_embeddings": 4096}, "original_max_position_embeddings", 48, 49),
    ("gpt2", {"n_positions": 48}, "n_positions", 48, 49),
], ids=lambda case: f"{case[0]}-{case[2]}")
def test_bounded_field_refuses_a_longer_cache_by_name(case):
    family, overrides, field, value, length = case
    config = ModelConfig.from_hf(family_config(family, **overrides).to_dict())
    new_kv_cache(config, 1, length - 1, torch.float32, device="meta")
    with pytest.raises(ValueError, match=rf"max_seq_len {length} exceeds {field}={value}\b"):
        new_kv_cache(config, 1, length, torch.float32, device="meta")


@pytest.mark.parametrize("family, overrides, bound", [
    ("mistral", {"sliding_window": 24}, 24),
    ("llama2", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0},
                "max_position_embeddings": 24}, 24),
    ("phi3", {"rope_scaling": longrope(original=24), "original_max_position_embeddings": 24,
              "max_position_embeddings": 4096}, 24),
], ids=["sliding_window", "dynamic", "longrope"])
def test_bounds_are_where_transformers_changes_the_math(tmp_path, family, overrides, bound):
    """Why the bounds: up to them we match transformers; past them transformers' logits move
    (keys drop out of the window, the rope frequencies switch with the sequence length) and
    ours, run on a cache the bound would refuse, no longer match."""
    _, ours = check_case(tmp_path, family, overrides, bound)
    hf = family_model(family, **overrides)  # fresh: transformers' dynamic rope keeps state
    diffs = max_diffs(hf, ours, bound + 16, cache=empty_cache)
    assert diffs["prefill"] > 100 * TOL


# -- fields ignored, as transformers ignores them -----------------------------------------------

IGNORED_VALUES = {
    "pretraining_tp": 2, "attention_dropout": 0.5, "resid_pdrop": 0.5, "embd_pdrop": 0.5,
    "attn_pdrop": 0.5, "reorder_and_upcast_attn": True, "torch_dtype": "float16",
    "dtype": "bfloat16",
}


@pytest.mark.parametrize("model_type, field", [
    (t, f) for t, fields in CONFIG_FIELDS.items() for f, (how, _) in fields.items()
    if how == IGNORED and f not in ("torch_dtype", "dtype")] + [("llama", "torch_dtype")])
def test_ignored_field_leaves_the_logits_as_transformers(tmp_path, model_type, field):
    """Ignored fields change nothing at inference in transformers either: with the field set,
    our fp32 logits still match (dropout is off in eval mode)."""
    check_case(tmp_path, BY_TYPE[model_type], {field: IGNORED_VALUES[field]}, 32)


# -- fields and families refused ----------------------------------------------------------------

REFUSED_VALUES = {
    "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128},
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
    "dual_chunk_attention_config": {"chunk_size": 262144, "local_size": 8192,
                                    "original_max_position_embeddings": 262144},
    "partial_rotary_factor": 0.75,  # Phi-4-mini
    "add_cross_attention": True,
}


@pytest.mark.parametrize("model_type, field", [
    (t, f) for t, fields in CONFIG_FIELDS.items() for f, (how, _) in fields.items()
    if how == REFUSED])
def test_refused_field_is_named_with_its_value(model_type, field):
    value = REFUSED_VALUES[field]
    hf = {**FAMILY_CONFIGS[BY_TYPE[model_type]], field: value}
    with pytest.raises(ValueError, match=re.escape(f"{field}={value!r}")):
        ModelConfig.from_hf(hf)


@pytest.mark.parametrize("family, overrides, named", [
    # partial_rotary_factor inside the rope block (where transformers 5 writes it)
    ("phi3", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                  "partial_rotary_factor": 0.75}}, "partial_rotary_factor=0.75"),
    ("llama2", {"hidden_act": "gelu_10"}, "hidden_act='gelu_10'"),
    ("gpt2", {"activation_function": "relu6"}, "activation_function='relu6'"),
    ("llama2", {"rope_scaling": {"rope_type": "proportional", "factor": 2.0}},
     "rope_scaling rope_type 'proportional'"),
    ("qwen3", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                                   "mrope_section": [2, 3, 3]}},
     "rope_parameters key mrope_section=[2, 3, 3]"),
    ("llama2", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
     "rope_scaling rope_type 'llama3' needs low_freq_factor, high_freq_factor"),
])
def test_refused_values_are_named(family, overrides, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        ModelConfig.from_hf({**FAMILY_CONFIGS[family], **overrides})


@pytest.mark.parametrize("config", ["Gemma2Config", "Gemma3TextConfig", "GemmaConfig"])
def test_gemma_is_refused_by_name_with_the_reason(config):
    hf = getattr(transformers, config)(vocab_size=96, hidden_size=64, intermediate_size=128,
                                       num_hidden_layers=2, num_attention_heads=4).to_dict()
    with pytest.raises(ValueError, match=rf"model_type '{hf['model_type']}' is not supported: "
                                         r"its decoder needs .*soft-capping.*; supported: llama"):
        ModelConfig.from_hf(hf)


def test_untied_checkpoint_without_its_lm_head_is_refused(family_checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    _, path = family_checkpoints["llama3.1"]
    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["lm_head.weight"]
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing tensor 'lm_head\.weight'"):
        load_model(tmp_path)


# -- the ONNX export follows the new math ---------------------------------------------------------


@pytest.mark.parametrize("family, overrides", [
    ("qwen3", {"attention_bias": True}),  # q/k norm, o bias, head_dim != hidden / heads
    ("yarn", {}),  # yarn's scaled cos / sin
    ("llama2", {"rope_scaling": LLAMA3_ROPE, "attention_bias": True, "mlp_bias": True,
                "hidden_act": "gelu"}),
    ("gpt2", {"scale_attn_by_inverse_layer_idx": True, "activation_function": "relu"}),
], ids=["qwen3", "yarn", "llama-biases", "gpt2-scales"])
def test_onnx_export_follows_the_family_math(tmp_path, family, overrides):
    pytest.importorskip("onnxruntime")
    from paradraft.build.onnx import check_graph, export_step

    model = load_model(save_hf(family_model(family, **overrides), tmp_path / "ckpt"))
    assert check_graph(model, export_step(model, tmp_path / "step.onnx")) < 1e-4


# -- CONFIG_FIELDS and the cases above cover each other ------------------------------------------


def test_every_honoured_or_bounded_field_has_a_transformers_case():
    """Each HONOURED / BOUNDED entry of CONFIG_FIELDS has a logits case for its model_type,
    except the fields that only size weights (note "shape"): every parity test covers them."""
    covered = {(ModelConfig.from_hf(FAMILY_CONFIGS[f]).model_type, field)
               for f, field, _, _ in HONOURED_CASES}
    wanted = {(t, f) for t, fields in CONFIG_FIELDS.items() for f, (how, note) in fields.items()
              if how in (HONOURED, BOUNDED) and note != "shape"}
    assert wanted - covered == set()
    assert covered - wanted == set()  # and no case tests a field the table does not list


def test_every_rope_key_has_a_transformers_case():
    seen = {(r.get("rope_type", r.get("type")), k) for _, r, _ in ROPE_CASES for k in r}
    seen = {("longrope" if t == "su" else t, k) for t, k in seen}
    wanted = {(t, k) for t, keys in ROPE_TYPES.items() for k in keys}
    assert wanted - seen == set()
    assert {t for t, _ in seen} | {"default"} == set(ROPE_TYPES)


def test_refused_model_types_are_not_supported_ones():
    from paradraft.runtime.model import SUPPORTED_MODEL_TYPES

    assert not set(REFUSED_MODEL_TYPES) & set(SUPPORTED_MODEL_TYPES)
    assert set(CONFIG_FIELDS) == set(SUPPORTED_MODEL_TYPES)
