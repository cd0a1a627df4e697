"""One compact decoder for the Llama family (Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3, Phi-3)
and GPT-2, gpt-fast style.

Loads local HF-format checkpoints (config.json + *.safetensors). The KV cache is static and
preallocated with one slot per sequence; every forward pass takes explicit per-row positions
and writes K/V there, so rows of different lengths share one batch. A query at position p
attends to cache positions <= p, which is why rolling a row back is only a matter of the
positions the caller passes next: entries past a row's length are never read before they are
overwritten.

No config field is silently dropped: ``CONFIG_FIELDS`` lists, per model_type, every
config.json field that changes the math and how it is handled (docs/models.md).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import Tensor, nn

from .gguf import resolve_checkpoint

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gpt2")
_GEMMA_WHY = ("its decoder needs (1 + weight) RMSNorms, a sqrt(hidden_size)-scaled embedding, "
              "norms after attention and MLP, query_pre_attn_scalar, logit soft-capping and "
              "interleaved sliding-window layers, which this one decoder does not have")
REFUSED_MODEL_TYPES = {
    "gemma": _GEMMA_WHY, "gemma2": _GEMMA_WHY, "gemma3": _GEMMA_WHY, "gemma3_text": _GEMMA_WHY,
}

# hidden_act / activation_function values, each exactly as transformers' ACT2FN computes it
ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_new": partial(F.gelu, approximate="tanh"),  # GPT-2's tanh approximation
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
}

# -- config.json fields ------------------------------------------------------------------------
# Every config.json field that changes the math, per model_type, and what the decoder does with
# it (the one place; tests/test_families.py checks each entry, docs/models.md explains them):
#   HONOURED  implemented; a test compares logits with transformers at a non-default value
#   BOUNDED   implemented exactly up to a cache length, which new_kv_cache enforces by name
#   REFUSED   a value other than the default raises a ValueError naming the field and value
#   IGNORED   no effect at inference (the note says why)
# Fields a family's transformers class never reads are not listed (transformers ignores them
# as well), except the REFUSED ones in _ANY_FAMILY, which no supported family can run.
HONOURED, BOUNDED, REFUSED, IGNORED = "honoured", "bounded", "refused", "ignored"
_ANY_FAMILY = {
    "quantization_config": (REFUSED, "quantized weights are not dequantized: any value"),
    "attn_logit_softcapping": (REFUSED, "attention soft-capping is not implemented"),
    "final_logit_softcapping": (REFUSED, "logit soft-capping is not implemented"),
    "dual_chunk_attention_config": (REFUSED, "dual chunk attention is not implemented"),
    "torch_dtype": (IGNORED, "informational: load_model casts to the dtype it is asked for"),
    "dtype": (IGNORED, "informational: load_model casts to the dtype it is asked for"),
}
_DECODER = {  # the Llama-style families
    **_ANY_FAMILY,
    "hidden_size": (HONOURED, "shape"),
    "intermediate_size": (HONOURED, "shape"),
    "num_hidden_layers": (HONOURED, "shape"),
    "num_attention_heads": (HONOURED, "shape"),
    "num_key_value_heads": (HONOURED, "grouped-query attention"),
    "head_dim": (HONOURED, "may differ from hidden_size / num_attention_heads"),
    "vocab_size": (HONOURED, "shape"),
    "hidden_act": (HONOURED, "one of ACTIVATIONS; any other value is refused"),
    "rms_norm_eps": (HONOURED, ""),
    "tie_word_embeddings": (HONOURED, ""),
    "rope_theta": (HONOURED, "top level (older configs) or inside rope_parameters"),
    "rope_parameters": (HONOURED, "rope types and keys: ROPE_TYPES"),
    "rope_scaling": (HONOURED, "the older spelling of rope_parameters (wins, as in transformers)"),
    "partial_rotary_factor": (REFUSED, "a partly rotated head is not implemented (!= 1)"),
    "original_max_position_embeddings": (
        HONOURED, "top level: wins over the rope block's for llama3 / yarn / longrope"),
    "max_position_embeddings": (HONOURED, "dynamic rope's bound; yarn / longrope factor default"),
    "attention_dropout": (IGNORED, "dropout is off at inference"),
}
_QWEN_WINDOW = {
    "use_sliding_window": (HONOURED, "false: sliding_window is ignored, as transformers does"),
    "sliding_window": (BOUNDED, "max_seq_len <= sliding_window when a layer slides"),
    "max_window_layers": (HONOURED, "layers from this index slide (unless layer_types says)"),
    "layer_types": (HONOURED, "which layers slide"),
}
CONFIG_FIELDS: dict[str, dict[str, tuple[str, str]]] = {
    "llama": {
        **_DECODER,
        "attention_bias": (HONOURED, "biases on q, k, v and o projections"),
        "mlp_bias": (HONOURED, "biases on gate, up and down projections"),
        "pretraining_tp": (IGNORED, "transformers 5 does not read it; in 4.x it split each "
                                    "matmul into slices: the same math"),
    },
    "mistral": {**_DECODER, "sliding_window": (BOUNDED, "max_seq_len <= sliding_window")},
    "qwen2": {**_DECODER, **_QWEN_WINDOW},  # q/k/v biases always, no o bias (no field)
    "qwen3": {  # RMSNorm on each q and k head (no field)
        **_DECODER, **_QWEN_WINDOW,
        "attention_bias": (HONOURED, "biases on q, k, v and o projections"),
    },
    "phi3": {
        **_DECODER,
        "sliding_window": (BOUNDED, "max_seq_len <= sliding_window"),
        "resid_pdrop": (IGNORED, "dropout is off at inference"),
        "embd_pdrop": (IGNORED, "dropout is off at inference"),
    },
    "gpt2": {
        **_ANY_FAMILY,
        "n_embd": (HONOURED, "shape"),
        "n_layer": (HONOURED, "shape"),
        "n_head": (HONOURED, "shape"),
        "n_inner": (HONOURED, "MLP width (default 4 * n_embd)"),
        "vocab_size": (HONOURED, "shape"),
        "n_positions": (BOUNDED, "the learned position table: max_seq_len <= n_positions"),
        "activation_function": (HONOURED, "one of ACTIVATIONS; any other value is refused"),
        "layer_norm_epsilon": (HONOURED, ""),
        "tie_word_embeddings": (HONOURED, ""),
        "scale_attn_weights": (HONOURED, "false: no 1/sqrt(head_dim) on the scores"),
        "scale_attn_by_inverse_layer_idx": (HONOURED, "scores of layer i also / (i + 1)"),
        "reorder_and_upcast_attn": (IGNORED, "precision only (fp32 scores in eager attention); "
                                             "transformers' default sdpa path skips it too"),
        "add_cross_attention": (REFUSED, "cross-attention layers are not implemented"),
        "attn_pdrop": (IGNORED, "dropout is off at inference"),
        "embd_pdrop": (IGNORED, "dropout is off at inference"),
        "resid_pdrop": (IGNORED, "dropout is off at inference"),
    },
}
# rope_parameters / rope_scaling: the keys each rope_type reads (transformers'
# modeling_rope_utils). A key no type reads is refused; a key of another type is ignored, as
# transformers ignores it. dynamic and longrope are BOUNDED (see ``check_cache_len``).
ROPE_COMMON_KEYS = ("rope_type", "type", "rope_theta", "partial_rotary_factor")
ROPE_TYPES: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "attention_factor", "beta_fast",
             "beta_slow", "mscale", "mscale_all_dim", "truncate"),
    "longrope": ("short_factor", "long_factor", "factor", "original_max_position_embeddings",
                 "attention_factor"),
}
# keys a rope type cannot do without (the others have defaults)
ROPE_REQUIRED = {"linear": ("factor",), "dynamic": ("factor",),
                 "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
                 "longrope": ("short_factor", "long_factor")}
# what a REFUSED field may be without being refused (anything else raises)
_ALLOWED = {"partial_rotary_factor": (None, 1, 1.0), "add_cross_attention": (None, False)}


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float
    max_position_embeddings: int
    rope_theta: float = 10000.0
    qkv_bias: bool = False
    tie_embeddings: bool = False
    # generation stops at any of these (Llama 3 and Qwen chat models list several)
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    mask_token_id: int | None = None  # parallel (PARD-style) drafts only
    self_draft_layers: int | None = None  # layers trained for early exit, if any
    # None: the family's default (filled in by __post_init__, so older manifests still load)
    hidden_act: str | None = None
    o_bias: bool | None = None
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm on each q and k head before the rotary
    attn_scale: float | None = None  # None: head_dim ** -0.5
    attn_scale_by_layer: bool = False  # GPT-2 scale_attn_by_inverse_layer_idx
    # normalised rope settings: {"rope_type": ..., the parameters that type reads}; None: plain
    rope_scaling: dict[str, Any] | None = None
    sliding_window: int | None = None  # the window of the sliding layers, if any layer slides

    def __post_init__(self) -> None:
        self.eos_token_ids = token_ids("eos_token_id", self.eos_token_ids)
        if self.hidden_act is None:
            self.hidden_act = "gelu_new" if self.is_gpt2 else "silu"
        if self.o_bias is None:
            self.o_bias = self.is_gpt2
        if self.attn_scale is None:
            self.attn_scale = self.head_dim**-0.5

    @property
    def is_gpt2(self) -> bool:
        return self.model_type == "gpt2"

    @classmethod
    def from_hf(cls, hf: dict) -> ModelConfig:
        model_type = hf.get("model_type")
        if model_type in REFUSED_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not supported: "
                             f"{REFUSED_MODEL_TYPES[model_type]}; "
                             f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not supported; "
                             f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        check_fields(hf)
        common = dict(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            eos_token_ids=token_ids("eos_token_id", hf.get("eos_token_id")),
            bos_token_id=hf.get("bos_token_id"),
            mask_token_id=hf.get("mask_token_id"),
            self_draft_layers=hf.get("self_draft_layers"),
        )
        if model_type == "gpt2":
            dim, n_heads = hf["n_embd"], hf["n_head"]
            return cls(
                **common,
                dim=dim,
                n_layers=hf["n_layer"],
                n_heads=n_heads,
                n_kv_heads=n_heads,
                head_dim=dim // n_heads,
                intermediate_size=hf.get("n_inner") or 4 * dim,
                norm_eps=hf.get("layer_norm_epsilon", 1e-5),
                max_position_embeddings=hf["n_positions"],
                qkv_bias=True,
                tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
                hidden_act=_activation(hf, "activation_function", "gelu_new"),
                attn_scale=(dim // n_heads) ** -0.5 if hf.get("scale_attn_weights", True)
                else 1.0,
                attn_scale_by_layer=bool(hf.get("scale_attn_by_inverse_layer_idx", False)),
            )
        dim, n_heads = hf["hidden_size"], hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or dim // n_heads
        rope_theta, rope_scaling = _rope(hf, model_type)
        attention_bias = bool(hf.get("attention_bias", False))
        if model_type not in ("llama", "qwen3"):  # their transformers classes ignore the field
            attention_bias = False
        return cls(
            **common,
            dim=dim,
            n_layers=hf["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=hf.get("num_key_value_heads") or n_heads,
            head_dim=head_dim,
            intermediate_size=hf["intermediate_size"],
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            rope_theta=rope_theta,
            qkv_bias=model_type == "qwen2" or attention_bias,
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            hidden_act=_activation(hf, "hidden_act", "silu"),
            o_bias=attention_bias,
            mlp_bias=model_type == "llama" and bool(hf.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            rope_scaling=rope_scaling,
            sliding_window=_sliding_window(hf, model_type),
        )


def check_fields(hf: dict) -> None:
    """Refuse a config.json field ``CONFIG_FIELDS`` marks REFUSED at a non-default value."""
    for name, (how, why) in CONFIG_FIELDS[hf["model_type"]].items():
        value = hf.get(name)
        if how == REFUSED and value not in _ALLOWED.get(name, (None,)):
            raise ValueError(f"config.json {name}={value!r} is not supported: {why}")


def _activation(hf: dict, name: str, default: str) -> str:
    act = hf.get(name) or default
    if act not in ACTIVATIONS:
        raise ValueError(f"config.json {name}={act!r} is not supported; "
                         f"supported: {', '.join(ACTIVATIONS)}")
    return act


def _rope(hf: dict, model_type: str) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, normalised rope settings or None for plain rope) from either spelling:
    transformers 5 writes ``rope_parameters`` (with rope_theta inside), older checkpoints
    ``rope_scaling`` and a top-level ``rope_theta``. Precedence as in transformers: a
    rope_scaling block wins over rope_parameters, and a rope_theta inside the block wins over
    the top-level one."""
    key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    block = dict(hf.get(key) or {})
    theta = float(block.get("rope_theta") or hf.get("rope_theta") or 10000.0)
    kind = block.get("rope_type", block.get("type", "default"))
    if model_type == "phi3" and kind in ("su", "yarn"):
        kind = "longrope"  # Phi3Config's renaming
    if kind not in ROPE_TYPES or (model_type == "phi3" and kind not in ("default", "longrope")):
        raise ValueError(f"config.json {key} rope_type {kind!r} is not supported; "
                         f"supported: {', '.join(ROPE_TYPES)}")
    known = {*ROPE_COMMON_KEYS, *(k for keys in ROPE_TYPES.values() for k in keys)}
    for name, value in block.items():
        if name not in known:
            raise ValueError(f"config.json {key} key {name}={value!r} is not supported")
    partial_rotary = block.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if partial_rotary not in _ALLOWED["partial_rotary_factor"]:
        raise ValueError(f"config.json partial_rotary_factor={partial_rotary!r} is not "
                         "supported: a partly rotated head is not implemented (!= 1)")
    if kind == "default":
        return theta, None
    rope = {"rope_type": kind, **{k: block[k] for k in ROPE_TYPES[kind] if k in block}}
    if kind in ("llama3", "yarn", "longrope"):
        # transformers: a top-level original_max_position_embeddings (Phi-3) wins
        rope["original_max_position_embeddings"] = hf.get(
            "original_max_position_embeddings",
            block.get("original_max_position_embeddings", hf.get("max_position_embeddings")))
    missing = [k for k in ROPE_REQUIRED.get(kind, ()) if rope.get(k) is None]
    if missing:
        raise ValueError(f"config.json {key} rope_type {kind!r} needs {', '.join(missing)}")
    max_positions = hf.get("max_position_embeddings", 2048)
    if kind == "yarn":
        if rope.get("factor") is None:  # DeepSeek-style: the ratio of the two lengths
            rope["factor"] = max_positions / rope["original_max_position_embeddings"]
        rope["attention_factor"] = _yarn_attention_factor(rope)
    if kind == "longrope":
        rope["attention_factor"] = _longrope_attention_factor(rope, max_positions)
    return theta, rope


def _yarn_attention_factor(rope: dict[str, Any]) -> float:
    """YaRN's scale on cos / sin ("mscale"): 0.1 * m * ln(factor) + 1, or the ratio of two of
    them when the config gives both mscale and mscale_all_dim (DeepSeek)."""
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])

    def mscale(m: float) -> float:
        return 1.0 if rope["factor"] <= 1 else 0.1 * m * math.log(rope["factor"]) + 1.0

    if rope.get("mscale") and rope.get("mscale_all_dim"):
        return float(mscale(rope["mscale"]) / mscale(rope["mscale_all_dim"]))
    return mscale(1.0)


def _longrope_attention_factor(rope: dict[str, Any], max_positions: int) -> float:
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    original = rope["original_max_position_embeddings"]
    factor = rope.get("factor") or max_positions / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def _sliding_window(hf: dict, model_type: str) -> int | None:
    """The window of the layers that slide, or None when none does (as transformers decides:
    Mistral / Phi-3 slide every layer when sliding_window is set; Qwen2 / Qwen3 only with
    use_sliding_window, and then the layers layer_types or max_window_layers names)."""
    window = hf.get("sliding_window")
    if window is None or model_type == "llama":
        return None
    if model_type in ("qwen2", "qwen3"):
        if not hf.get("use_sliding_window", False):
            return None
        n = hf["num_hidden_layers"]
        first = hf.get("max_window_layers", 28)
        kinds = hf.get("layer_types") or [
            "sliding_attention" if i >= first else "full_attention" for i in range(n)]
        if "sliding_attention" not in kinds:
            return None
    return int(window)


def token_ids(name: str, value: int | list[int] | tuple[int, ...] | None) -> tuple[int, ...]:
    """An id field that HF writes as an int, a list of ints or null, as a tuple."""
    if value is None:
        return ()
    ids = (value,) if isinstance(value, int) else tuple(value)
    if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
        raise ValueError(f"{name} must be a token id >= 0 or a list of them; got {value!r}")
    return ids


@dataclass
class KVCache:
    """Per layer K and V of shape [slots, max_seq_len, n_kv_heads, head_dim]. ``buffer``
    (optional, ``new_kv_cache`` makes one): [layers, 2, slots, max_seq_len, n_kv_heads,
    head_dim], the memory k[i] = buffer[i, 0] and v[i] = buffer[i, 1] are views of, so an
    engine step's K/V for every layer land in the cache with one indexed write."""

    k: list[Tensor]
    v: list[Tensor]
    buffer: Tensor | None = None

    @property
    def num_slots(self) -> int:
        return self.k[0].shape[0]

    @property
    def max_seq_len(self) -> int:
        return self.k[0].shape[1]


def check_cache_len(config: ModelConfig, max_seq_len: int) -> None:
    """Refuse a cache longer than this decoder's math is exact for, naming the config field
    that sets the limit (the BOUNDED fields of ``CONFIG_FIELDS``)."""
    c = config
    limits: list[tuple[str, int, str]] = []
    if c.is_gpt2:
        limits.append(("n_positions", c.max_position_embeddings,
                       "GPT-2's learned position table ends there"))
    if c.sliding_window is not None:
        limits.append(("sliding_window", c.sliding_window,
                       "sliding-window attention is not implemented, and past the window "
                       "transformers masks keys this decoder would attend to"))
    kind = (c.rope_scaling or {}).get("rope_type")
    if kind == "dynamic":
        # transformers (dynamic_rope_update) recomputes inv_freq in a forward call whose
        # largest position + 1 passes the longest length seen so far (at first
        # max_position_embeddings), and goes back to plain rope when a call stays under
        # max_position_embeddings: past it the frequencies depend on the call history and
        # the keys in a cache were rotated at other lengths, which neither a static cache nor
        # speculative blocks reproduce. Up to it, dynamic rope is plain rope, exactly.
        limits.append(("max_position_embeddings", c.max_position_embeddings,
                       "rope_type 'dynamic' rescales its frequencies with the sequence length "
                       "past it"))
    if kind == "longrope":
        limits.append(("original_max_position_embeddings",
                       c.rope_scaling["original_max_position_embeddings"],
                       "rope_type 'longrope' switches from short_factor to long_factor past it"))
    for name, limit, why in limits:
        if max_seq_len > limit:
            raise ValueError(f"max_seq_len {max_seq_len} exceeds {name}={limit}: {why}; "
                             f"use max_seq_len <= {limit}")


def new_kv_cache(
    config: ModelConfig, num_slots: int, max_seq_len: int, dtype: torch.dtype, device="cpu"
) -> KVCache:
    check_cache_len(config, max_seq_len)
    buffer = torch.zeros(config.n_layers, 2, num_slots, max_seq_len, config.n_kv_heads,
                         config.head_dim, dtype=dtype, device=device)
    # detached views: each layer's K and V is its own tensor to autograd (as separate
    # allocations were), while their memory is the one buffer an engine step writes at once
    layers = range(config.n_layers)
    return KVCache(k=[buffer[i, 0].detach() for i in layers],
                   v=[buffer[i, 1].detach() for i in layers], buffer=buffer)


def attention_mask(input_pos: Tensor, kv_len: int) -> Tensor:
    """[B, 1, T, kv_len] boolean: a query at position p sees cache positions <= p."""
    key_pos = torch.arange(kv_len, device=input_pos.device)
    return (key_pos[None, None, :] <= input_pos[:, :, None])[:, None]


def rope_frequencies(c: ModelConfig) -> tuple[Tensor, float]:
    """(inv_freq [head_dim / 2] in fp32 on the CPU, the factor cos and sin are scaled by) for
    ``c.rope_scaling``. The formulas of transformers' modeling_rope_utils, with the same fp32
    operations in the same order: at position p an inv_freq one ulp off turns the angle by
    p ulps, which far positions would show in the logits."""
    rope = c.rope_scaling or {"rope_type": "default"}
    kind, dim, theta = rope["rope_type"], c.head_dim, c.rope_theta
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    if kind == "longrope":  # bounded to original_max_position_embeddings: short_factor only
        short = torch.tensor(rope["short_factor"], dtype=torch.float32, device="cpu")
        return 1.0 / (short * theta**exponents), rope["attention_factor"]
    inv_freq = 1.0 / (theta**exponents)
    if kind in ("default", "dynamic"):  # dynamic: plain rope up to max_position_embeddings
        return inv_freq, 1.0
    factor = rope["factor"]
    if kind == "linear":  # positions / factor, i.e. every frequency / factor
        return inv_freq / factor, 1.0
    original = rope["original_max_position_embeddings"]
    if kind == "llama3":
        # wavelengths below original / high_freq_factor keep their frequency, those above
        # original / low_freq_factor are slowed by factor, the band between blends the two
        low, high = rope["low_freq_factor"], rope["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        slowed = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - low) / (high - low)
        blended = (1 - smooth) * slowed / factor + smooth * slowed
        between = (wavelen >= original / high) & (wavelen <= original / low)
        return torch.where(between, blended, slowed), 1.0
    # yarn: dims that rotate more than beta_fast times over the original context keep their
    # frequency, those under beta_slow times are interpolated (/ factor), a linear ramp between
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def dim_at(rotations: float) -> float:  # the dim that turns `rotations` times in original
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = dim_at(beta_fast), dim_at(beta_slow)
    if rope.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001  # as transformers: no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - lo) / (hi - lo))
    keep = 1 - ramp.clamp(0, 1)  # 1: keep the frequency, 0: interpolate it
    pos_freqs = theta**exponents
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    return inv_freq, rope["attention_factor"]


class RMSNorm(nn.Module):
    """RMSNorm over the last dim; ``shape`` is the weight's (a tuple for per-head weights)."""

    def __init__(self, shape: int | tuple[int, ...], eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(shape))

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def apply_rope(x: Tensor, cos: Tensor, signed_sin: Tensor, half: int) -> Tensor:
    """Rotary embedding: x·cos + rotate_half(x)·sin, with rotate_half's minus sign folded
    into ``signed_sin`` = [-sin, sin] (exactly the same floats, one node fewer in the ONNX
    graph). ``half`` (head_dim // 2) from the config, not x.shape: the trace keeps it
    constant."""
    x1, x2 = x.split([half, half], dim=-1)
    return x * cos + torch.cat((x2, x1), dim=-1) * signed_sin


class Block(nn.Module):
    def __init__(self, c: ModelConfig, index: int = 0):
        super().__init__()
        self.c = c
        self.act = ACTIVATIONS[c.hidden_act]
        # the scale on q·k (GPT-2 can drop it or divide it by the layer number)
        self.attn_scale = c.attn_scale / (index + 1 if c.attn_scale_by_layer else 1)
        self.qk_norm = None
        if c.is_gpt2:
            self.attn_norm = nn.LayerNorm(c.dim, eps=c.norm_eps)
            self.mlp_norm = nn.LayerNorm(c.dim, eps=c.norm_eps)
            self.fc = nn.Linear(c.dim, c.intermediate_size)
            self.proj = nn.Linear(c.intermediate_size, c.dim)
        else:
            self.attn_norm = RMSNorm(c.dim, c.norm_eps)
            self.mlp_norm = RMSNorm(c.dim, c.norm_eps)
            # gate and up fused into one matmul
            self.gate_up = nn.Linear(c.dim, 2 * c.intermediate_size, bias=c.mlp_bias)
            self.down = nn.Linear(c.intermediate_size, c.dim, bias=c.mlp_bias)
            if c.qk_norm:  # q and k heads normed together: one weight row per head
                self.qk_norm = RMSNorm((c.n_heads + c.n_kv_heads, c.head_dim), c.norm_eps)
        qkv_out = (c.n_heads + 2 * c.n_kv_heads) * c.head_dim
        self.qkv = nn.Linear(c.dim, qkv_out, bias=c.qkv_bias)
        self.o = nn.Linear(c.n_heads * c.head_dim, c.dim, bias=c.o_bias)

    def forward(
        self,
        x: Tensor,
        rope: tuple[Tensor, Tensor] | None,
        mask: Tensor,
        rows: Tensor | None,
        input_pos: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        audit: bool,
    ) -> tuple[Tensor, Tensor | None]:
        c = self.c
        B = x.shape[0]
        q, k, v = self.project(x, rope)
        # write this step's K/V at each row's own positions, then attend over the cache
        kv_len = mask.shape[-1]
        if rows is None:  # rows are slots 0..B-1: plain slices, no gather copy
            write_rows = torch.arange(B, device=x.device)[:, None]
            k_cache[write_rows, input_pos] = k.to(k_cache.dtype)
            v_cache[write_rows, input_pos] = v.to(v_cache.dtype)
            keys, values = k_cache[:B, :kv_len], v_cache[:B, :kv_len]
        else:
            k_cache[rows[:, None], input_pos] = k.to(k_cache.dtype)
            v_cache[rows[:, None], input_pos] = v.to(v_cache.dtype)
            keys, values = k_cache[rows, :kv_len], v_cache[rows, :kv_len]
        keys = keys.transpose(1, 2).to(q.dtype)
        values = values.transpose(1, 2).to(q.dtype)
        q = q.transpose(1, 2)
        leak = None
        if audit:
            # explicit softmax so the weights can be inspected (the attention causal audit)
            groups = c.n_heads // c.n_kv_heads
            keys = keys.repeat_interleave(groups, dim=1)
            values = values.repeat_interleave(groups, dim=1)
            scores = (q @ keys.transpose(-1, -2)) * self.attn_scale
            weights = scores.masked_fill(~mask, float("-inf")).softmax(-1)
            y = weights @ values
            key_pos = torch.arange(kv_len, device=x.device)
            future = key_pos[None, None, :] > input_pos[:, :, None]  # [B, T, kv_len]
            leak = (weights * future[:, None]).amax(dim=(1, 3))  # [B, T]
        else:
            y = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, scale=self.attn_scale,
                enable_gqa=c.n_heads != c.n_kv_heads,
            )
        return self.finish(x, y), leak

    # project / finish are the layer's math around the cache; the ONNX export
    # (paradraft.build.onnx) reuses them with its own cache I/O
    def project(self, x: Tensor, rope: tuple[Tensor, Tensor] | None
                ) -> tuple[Tensor, Tensor, Tensor]:
        """q [B, T, n_heads, head_dim], k and v [B, T, n_kv_heads, head_dim] (rotary applied)."""
        c = self.c
        qk, v = self.qkv(self.attn_norm(x)).split(
            [(c.n_heads + c.n_kv_heads) * c.head_dim, c.n_kv_heads * c.head_dim], -1
        )
        # each view takes B, T from its own input: the ONNX export then folds the target
        # shape to a constant (paradraft.build.onnx.fold_reshapes)
        qk = qk.view(*qk.shape[:2], c.n_heads + c.n_kv_heads, c.head_dim)
        v = v.view(*v.shape[:2], c.n_kv_heads, c.head_dim)
        if self.qk_norm is not None:  # Qwen3: each head RMS-normed before the rotary
            qk = self.qk_norm(qk)
        if rope is not None:  # q and k heads rotated together: one set of rotary nodes
            qk = apply_rope(qk, *rope, c.head_dim // 2)
        q, k = qk.split([c.n_heads, c.n_kv_heads], dim=2)
        return q, k, v

    def finish(self, x: Tensor, y: Tensor) -> Tensor:
        """Attention output y [B, n_heads, T, head_dim] → output projection, residual, MLP."""
        y = y.transpose(1, 2)  # [B, T, n_heads, head_dim]
        x = x + self.o(y.reshape(*y.shape[:2], -1))
        h = self.mlp_norm(x)
        if self.c.is_gpt2:
            h = self.proj(self.act(self.fc(h)))
        else:
            size = self.c.intermediate_size  # a constant split in the ONNX trace
            gate, up = self.gate_up(h).split([size, size], dim=-1)
            h = self.down(self.act(gate) * up)
        return x + h


def embedding(num: int, dim: int) -> nn.Embedding:
    """An embedding table. Built on the meta device (``load_model``, whose weights replace
    it), it skips its own random init: ``normal_``'s meta kernel imports torch._dynamo,
    seconds of every process's start."""
    if torch.empty(0).is_meta:
        return nn.Embedding(num, dim, _weight=torch.empty(num, dim))
    return nn.Embedding(num, dim)


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        c = self.config = config
        self.embed = embedding(c.vocab_size, c.dim)
        self.pos_embed = embedding(c.max_position_embeddings, c.dim) if c.is_gpt2 else None
        self.layers = nn.ModuleList(Block(c, i) for i in range(c.n_layers))
        self.norm = nn.LayerNorm(c.dim, eps=c.norm_eps) if c.is_gpt2 else RMSNorm(c.dim, c.norm_eps)
        self.lm_head = nn.Linear(c.dim, c.vocab_size, bias=False)
        if c.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        # a plain attribute, not a buffer: computed here on the CPU (also when the model is
        # built on the meta device), moved to the positions' device on first use
        self.inv_freq, self.rope_attention_factor = (
            (None, 1.0) if c.is_gpt2 else rope_frequencies(c))

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def embed_at(self, tokens: Tensor, input_pos: Tensor
                 ) -> tuple[Tensor, tuple[Tensor, Tensor] | None]:
        """Token embeddings at their positions: GPT-2 adds learned position embeddings, the
        Llama family returns the rotary (cos, sin) for the attention layers instead."""
        x = self.embed(tokens)
        if self.pos_embed is not None:
            return x + self.pos_embed(input_pos), None
        return x, self.rope(input_pos, x.dtype)

    def rope(self, input_pos: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        if self.inv_freq.device != input_pos.device:
            self.inv_freq = self.inv_freq.to(input_pos.device)
        # angles in fp32 so a half-precision model keeps exact angles (as transformers)
        freqs = input_pos[..., None].float() * self.inv_freq  # [B, T, head_dim/2]
        cos, sin = freqs.cos(), freqs.sin()
        if self.rope_attention_factor != 1.0:  # YaRN / LongRoPE scale cos and sin
            cos, sin = cos * self.rope_attention_factor, sin * self.rope_attention_factor
        # [B, T, 1, head_dim]: broadcast over heads; the sine signed for apply_rope
        return (torch.cat((cos, cos), dim=-1)[:, :, None, :].to(dtype),
                torch.cat((-sin, sin), dim=-1)[:, :, None, :].to(dtype))

    def forward(
        self,
        tokens: Tensor,
        input_pos: Tensor,
        cache: KVCache,
        kv_len: int | None = None,
        rows: Tensor | None = None,
        output_index: Tensor | None = None,
        num_layers: int | None = None,
        audit: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """Run ``tokens`` [B, T] at positions ``input_pos`` [B, T] against ``cache``.

        rows: cache slot of each batch row (default 0..B-1). kv_len: how much of the cache to
        attend over, a host-side upper bound of max(input_pos)+1 (default: the whole cache).
        output_index [B, T']: only compute logits at these time steps. num_layers: run the
        first N layers only, then the final norm and LM head (self-draft / early exit).
        audit: also return [B, T] the largest attention weight any query gives to a later
        position, over all layers and heads (0 with a correct causal mask).
        Returns (logits [B, T or T', V] in fp32, leak or None).
        """
        kv_len = cache.max_seq_len if kv_len is None else min(kv_len, cache.max_seq_len)
        mask = attention_mask(input_pos, kv_len)
        x, rope = self.embed_at(tokens, input_pos)
        leak = None
        for i, layer in enumerate(self.layers[:num_layers]):
            x, layer_leak = layer(x, rope, mask, rows, input_pos, cache.k[i], cache.v[i], audit)
            if layer_leak is not None:
                leak = layer_leak if leak is None else torch.maximum(leak, layer_leak)
        if output_index is not None:
            x = x.gather(1, output_index[:, :, None].expand(-1, -1, x.shape[-1]))
        return self.lm_head(self.norm(x)).float(), leak


def _hf_state_dict(c: ModelConfig, weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """Map HF tensor names onto ours (fusing q/k/v and gate/up)."""
    w = {k.removeprefix("model.").removeprefix("transformer."): v for k, v in weights.items()}
    out: dict[str, Tensor] = {}
    if not c.tie_embeddings:  # untied: the checkpoint must have its own LM head
        out["lm_head.weight"] = weights["lm_head.weight"]
    if c.is_gpt2:
        out["embed.weight"] = w["wte.weight"]
        out["pos_embed.weight"] = w["wpe.weight"]
        out["norm.weight"], out["norm.bias"] = w["ln_f.weight"], w["ln_f.bias"]
        for i in range(c.n_layers):
            p = f"h.{i}."
            # GPT-2 Conv1D stores weights as [in, out]
            for ours, theirs in [("qkv", "attn.c_attn"), ("o", "attn.c_proj"),
                                 ("fc", "mlp.c_fc"), ("proj", "mlp.c_proj")]:
                out[f"layers.{i}.{ours}.weight"] = w[f"{p}{theirs}.weight"].t()
                out[f"layers.{i}.{ours}.bias"] = w[f"{p}{theirs}.bias"]
            for ours, theirs in [("attn_norm", "ln_1"), ("mlp_norm", "ln_2")]:
                out[f"layers.{i}.{ours}.weight"] = w[f"{p}{theirs}.weight"]
                out[f"layers.{i}.{ours}.bias"] = w[f"{p}{theirs}.bias"]
        return out
    out["embed.weight"] = w["embed_tokens.weight"]
    out["norm.weight"] = w["norm.weight"]

    def cat(prefix: str, names: list[str], kind: str) -> Tensor:
        return torch.cat([w[f"{prefix}{name}.{kind}"] for name in names])

    for i in range(c.n_layers):
        p = f"layers.{i}."
        a = p + "self_attn."
        qkv, gate_up = ["q_proj", "k_proj", "v_proj"], ["gate_proj", "up_proj"]
        if c.model_type == "phi3":  # stored fused already, in our order
            qkv, gate_up = ["qkv_proj"], ["gate_up_proj"]
        out[p + "qkv.weight"] = cat(a, qkv, "weight")
        out[p + "gate_up.weight"] = cat(p + "mlp.", gate_up, "weight")
        out[p + "o.weight"] = w[a + "o_proj.weight"]
        out[p + "down.weight"] = w[p + "mlp.down_proj.weight"]
        if c.qkv_bias:
            out[p + "qkv.bias"] = cat(a, qkv, "bias")
        if c.o_bias:
            out[p + "o.bias"] = w[a + "o_proj.bias"]
        if c.mlp_bias:
            out[p + "gate_up.bias"] = cat(p + "mlp.", gate_up, "bias")
            out[p + "down.bias"] = w[p + "mlp.down_proj.bias"]
        if c.qk_norm:  # one weight row per q head, then per k head
            out[p + "qk_norm.weight"] = torch.cat([w[a + "q_norm.weight"].expand(c.n_heads, -1),
                                                   w[a + "k_norm.weight"].expand(c.n_kv_heads, -1)])
        out[p + "attn_norm.weight"] = w[p + "input_layernorm.weight"]
        out[p + "mlp_norm.weight"] = w[p + "post_attention_layernorm.weight"]
    return out


def load_config(path: str | Path) -> ModelConfig:
    """config.json, with generation_config.json's eos_token_id winning where it has one (as
    transformers' ``generate`` reads them). ``path``: a dir, or a .gguf file (imported once)."""
    path = resolve_checkpoint(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"missing {config_file} (expected a HF-format checkpoint dir)")
    hf = json.loads(config_file.read_text(encoding="utf-8"))
    generation_file = path / "generation_config.json"
    if generation_file.is_file():
        generation = json.loads(generation_file.read_text(encoding="utf-8"))
        if generation.get("eos_token_id") is not None:
            hf = {**hf, "eos_token_id": generation["eos_token_id"]}
    return ModelConfig.from_hf(hf)


def load_model(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> Transformer:
    """Load a local HF-format checkpoint directory (config.json + *.safetensors), or a .gguf
    file (imported once into a cached dir: ``runtime.gguf``)."""
    path = resolve_checkpoint(path)
    config = load_config(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    weights: dict[str, Tensor] = {}
    for f in files:
        weights.update(load_file(f))
    try:
        state = _hf_state_dict(config, weights)
    except KeyError as e:
        raise ValueError(f"{path}: checkpoint is missing tensor {e.args[0]!r}") from None
    with torch.device("meta"):
        model = Transformer(config)
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(f"{path}: checkpoint is missing weights for {missing[:5]}")
    # inference only: a parameter that requires grad would chain every step's cache writes
    # into one autograd graph that grows for the whole generation
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


def pad_vocab(model: Transformer, vocab_size: int, real_vocab: int) -> Transformer:
    """Widen a draft's vocabulary to the verifier's ``vocab_size`` (checkpoints padded to
    different sizes, as Qwen2.5-7B's 152064 against 0.5B's 151936). Ids from ``real_vocab``
    on get logit −inf through an LM-head bias, so they are never proposed: the draft
    distribution lives on the shared real range, and every backend (torch, ONNX, TensorRT)
    sees one vocabulary size. Padded ids embed as zeros (the verifier may still emit one)."""
    c = model.config
    if not c.vocab_size <= vocab_size or not 0 < real_vocab <= c.vocab_size:
        raise ValueError(f"pad_vocab: need real_vocab {real_vocab} <= draft vocab_size "
                         f"{c.vocab_size} <= vocab_size {vocab_size}")
    extra = vocab_size - c.vocab_size
    weight = model.embed.weight.detach()
    embed = torch.cat([weight, weight.new_zeros(extra, c.dim)])
    head = model.lm_head.weight.detach()
    head = embed if c.tie_embeddings else torch.cat([head, head.new_zeros(extra, c.dim)])
    model.embed = nn.Embedding.from_pretrained(embed, freeze=True)
    model.lm_head = nn.Linear(c.dim, vocab_size, bias=True, device=weight.device,
                              dtype=weight.dtype)
    with torch.no_grad():
        model.lm_head.weight = model.embed.weight if c.tie_embeddings else nn.Parameter(
            head, requires_grad=False)
        model.lm_head.bias.copy_(torch.where(
            torch.arange(vocab_size, device=weight.device) < real_vocab, 0.0, float("-inf")))
    model.config = replace(c, vocab_size=vocab_size)
    for layer in model.layers:
        layer.c = model.config
    return model
