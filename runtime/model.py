"""One compact decoder for the Llama family (Llama, Qwen2) and GPT-2, gpt-fast style.

Loads local HF-format checkpoints (config.json + *.safetensors). The KV cache is static and
preallocated with one slot per sequence; every forward pass takes explicit per-row positions
and writes K/V there, so rows of different lengths share one batch. A query at position p
attends to cache positions <= p, which is why rolling a row back is only a matter of the
positions the caller passes next: entries past a row's length are never read before they are
overwritten.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import Tensor, nn

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral", "gpt2")


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

    def __post_init__(self) -> None:
        self.eos_token_ids = token_ids("eos_token_id", self.eos_token_ids)

    @property
    def is_gpt2(self) -> bool:
        return self.model_type == "gpt2"

    @classmethod
    def from_hf(cls, hf: dict) -> ModelConfig:
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r}; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
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
                tie_embeddings=True,
            )
        # transformers 5 writes rope settings as rope_parameters, older checkpoints as
        # rope_scaling: a scaled rope under either spelling must not load as plain rope
        for key in ("rope_scaling", "rope_parameters"):
            rope = hf.get(key) or {}
            rope_type = rope.get("rope_type", rope.get("type", "default"))
            if rope_type != "default":
                raise ValueError(f"unsupported {key} rope_type {rope_type!r}; supported: default")
        if model_type == "mistral" and hf.get("sliding_window"):
            raise ValueError("unsupported: mistral with sliding_window attention")
        rope_theta = hf.get("rope_theta") or (hf.get("rope_parameters") or {}).get(
            "rope_theta", 10000.0
        )
        dim, n_heads = hf["hidden_size"], hf["num_attention_heads"]
        return cls(
            **common,
            dim=dim,
            n_layers=hf["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=hf.get("num_key_value_heads") or n_heads,
            head_dim=hf.get("head_dim") or dim // n_heads,
            intermediate_size=hf["intermediate_size"],
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            rope_theta=float(rope_theta),
            qkv_bias=model_type == "qwen2" or bool(hf.get("attention_bias", False)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        )


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
    """Per layer K and V of shape [slots, max_seq_len, n_kv_heads, head_dim]."""

    k: list[Tensor]
    v: list[Tensor]

    @property
    def num_slots(self) -> int:
        return self.k[0].shape[0]

    @property
    def max_seq_len(self) -> int:
        return self.k[0].shape[1]


def new_kv_cache(
    config: ModelConfig, num_slots: int, max_seq_len: int, dtype: torch.dtype, device="cpu"
) -> KVCache:
    if max_seq_len > config.max_position_embeddings and config.is_gpt2:
        raise ValueError(
            f"max_seq_len must be <= {config.max_position_embeddings} (GPT-2 position table), "
            f"got {max_seq_len}"
        )
    shape = (num_slots, max_seq_len, config.n_kv_heads, config.head_dim)
    return KVCache(
        k=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layers)],
        v=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layers)],
    )


def attention_mask(input_pos: Tensor, kv_len: int) -> Tensor:
    """[B, 1, T, kv_len] boolean: a query at position p sees cache positions <= p."""
    key_pos = torch.arange(kv_len, device=input_pos.device)
    return (key_pos[None, None, :] <= input_pos[:, :, None])[:, None]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

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
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.c = c
        if c.is_gpt2:
            self.attn_norm = nn.LayerNorm(c.dim, eps=c.norm_eps)
            self.mlp_norm = nn.LayerNorm(c.dim, eps=c.norm_eps)
            self.fc = nn.Linear(c.dim, c.intermediate_size)
            self.proj = nn.Linear(c.intermediate_size, c.dim)
        else:
            self.attn_norm = RMSNorm(c.dim, c.norm_eps)
            self.mlp_norm = RMSNorm(c.dim, c.norm_eps)
            # gate and up fused into one matmul
            self.gate_up = nn.Linear(c.dim, 2 * c.intermediate_size, bias=False)
            self.down = nn.Linear(c.intermediate_size, c.dim, bias=False)
        qkv_out = (c.n_heads + 2 * c.n_kv_heads) * c.head_dim
        self.qkv = nn.Linear(c.dim, qkv_out, bias=c.qkv_bias)
        self.o = nn.Linear(c.n_heads * c.head_dim, c.dim, bias=c.is_gpt2)

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
            scores = (q @ keys.transpose(-1, -2)) / math.sqrt(c.head_dim)
            weights = scores.masked_fill(~mask, float("-inf")).softmax(-1)
            y = weights @ values
            key_pos = torch.arange(kv_len, device=x.device)
            future = key_pos[None, None, :] > input_pos[:, :, None]  # [B, T, kv_len]
            leak = (weights * future[:, None]).amax(dim=(1, 3))  # [B, T]
        else:
            y = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, enable_gqa=c.n_heads != c.n_kv_heads
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
            h = self.proj(F.gelu(self.fc(h), approximate="tanh"))
        else:
            size = self.c.intermediate_size  # a constant split in the ONNX trace
            gate, up = self.gate_up(h).split([size, size], dim=-1)
            h = self.down(F.silu(gate) * up)
        return x + h


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        c = self.config = config
        self.embed = nn.Embedding(c.vocab_size, c.dim)
        self.pos_embed = nn.Embedding(c.max_position_embeddings, c.dim) if c.is_gpt2 else None
        self.layers = nn.ModuleList(Block(c) for _ in range(c.n_layers))
        self.norm = nn.LayerNorm(c.dim, eps=c.norm_eps) if c.is_gpt2 else RMSNorm(c.dim, c.norm_eps)
        self.lm_head = nn.Linear(c.dim, c.vocab_size, bias=False)
        if c.tie_embeddings:
            self.lm_head.weight = self.embed.weight

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
        c = self.config
        # computed in fp32 every call (tiny) so a half-precision model keeps exact angles
        exponents = torch.arange(0, c.head_dim, 2, device=input_pos.device).float() / c.head_dim
        inv_freq = 1.0 / (c.rope_theta**exponents)
        freqs = input_pos[..., None].float() * inv_freq  # [B, T, head_dim/2]
        cos, sin = freqs.cos(), freqs.sin()
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
        out["lm_head.weight"] = out["embed.weight"]
        return out
    out["embed.weight"] = w["embed_tokens.weight"]
    out["norm.weight"] = w["norm.weight"]
    out["lm_head.weight"] = weights.get("lm_head.weight", out["embed.weight"])
    for i in range(c.n_layers):
        p = f"layers.{i}."
        a = p + "self_attn."
        out[p + "qkv.weight"] = torch.cat(
            [w[a + "q_proj.weight"], w[a + "k_proj.weight"], w[a + "v_proj.weight"]]
        )
        if c.qkv_bias:
            out[p + "qkv.bias"] = torch.cat(
                [w[a + "q_proj.bias"], w[a + "k_proj.bias"], w[a + "v_proj.bias"]]
            )
        out[p + "o.weight"] = w[a + "o_proj.weight"]
        out[p + "gate_up.weight"] = torch.cat(
            [w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]]
        )
        out[p + "down.weight"] = w[p + "mlp.down_proj.weight"]
        out[p + "attn_norm.weight"] = w[p + "input_layernorm.weight"]
        out[p + "mlp_norm.weight"] = w[p + "post_attention_layernorm.weight"]
    return out


def load_config(path: str | Path) -> ModelConfig:
    """config.json, with generation_config.json's eos_token_id winning where it has one (as
    transformers' ``generate`` reads them)."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"missing {config_file} (expected a HF-format checkpoint dir)")
    hf = json.loads(config_file.read_text())
    generation_file = path / "generation_config.json"
    if generation_file.is_file():
        generation = json.loads(generation_file.read_text())
        if generation.get("eos_token_id") is not None:
            hf = {**hf, "eos_token_id": generation["eos_token_id"]}
    return ModelConfig.from_hf(hf)


def load_model(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> Transformer:
    """Load a local HF-format checkpoint directory (config.json + *.safetensors)."""
    path = Path(path)
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
    if config.tie_embeddings or "lm_head.weight" not in weights:
        model.lm_head.weight = model.embed.weight
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(f"{path}: checkpoint is missing weights for {missing[:5]}")
    return model.to(device=device, dtype=dtype).eval()


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
