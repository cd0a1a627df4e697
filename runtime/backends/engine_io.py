"""Engine I/O, shared by the ONNX Runtime and TensorRT backends and the engine builders.

The step graph's inputs, the write-back of a step's K/V into the ``KVCache``, the correction
graph's extra inputs, and the ``CausalCorrection`` op's name and attributes (the ONNX custom
op and the TensorRT plugin share them).
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from torch import Tensor

from ..correction import Randoms, RuleParams
from ..model import KVCache

DOMAIN = "paradraft"  # custom-op domain = TensorRT plugin namespace
OP_TYPE = "CausalCorrection"  # = TensorRT plugin name
PLUGIN_VERSION = "1"
FLOAT_PARAMS = ("temperature", "top_p", "tau", "gamma", "alpha", "epsilon", "delta")


def _attr_float(value: float) -> float:
    """ONNX float attributes are float32: recover the decimal the builder wrote (0.3, not
    0.30000001192…) so the op applies exactly the RuleParams that ``correct()`` gets."""
    return float(str(np.float32(value)))


def params_from_attributes(attrs: dict) -> RuleParams:
    return RuleParams(rule=attrs["rule"], top_p_membership=bool(attrs["top_p_membership"]),
                      **{name: _attr_float(attrs[name]) for name in FLOAT_PARAMS})


def rule_attributes(params: RuleParams) -> dict:
    """The CausalCorrection node attributes (= TensorRT plugin fields) for ``params``."""
    attrs = {"rule": params.rule, "plugin_version": PLUGIN_VERSION, "plugin_namespace": DOMAIN,
             "top_p_membership": int(params.top_p_membership)}
    attrs.update({name: float(getattr(params, name)) for name in FLOAT_PARAMS})
    return attrs


def rule_key(params: RuleParams) -> RuleParams:
    """The parameters a correction graph's attributes must match to apply ``params``:
    ``greedy`` reads none of them but the rule, so every greedy request shares one graph."""
    return RuleParams("greedy") if params.is_greedy else params


def set_rule(model, params: RuleParams) -> None:
    """Rewrite the CausalCorrection node's rule attributes in place (a ModelProto)."""
    from onnx import helper

    nodes = [n for n in model.graph.node if n.op_type == OP_TYPE and n.domain == DOMAIN]
    if len(nodes) != 1:
        raise ValueError(f"expected one {DOMAIN}::{OP_TYPE} node; found {len(nodes)}")
    node = nodes[0]
    del node.attribute[:]
    node.attribute.extend(helper.make_attribute(k, v) for k, v in
                          sorted(rule_attributes(params).items()))


def accepted_block(draft_tokens: Tensor, num_accepted: Tensor, next_token: Tensor) -> Tensor:
    """[B, K+1]: the accepted drafts, then the rule's token at index num_accepted, then -1."""
    K = draft_tokens.shape[1]
    block = torch.cat([draft_tokens, next_token[:, None]], 1)
    block.scatter_(1, num_accepted[:, None], next_token[:, None])
    return block.masked_fill(torch.arange(K + 1, device=block.device) > num_accepted[:, None], -1)


def step_inputs(tokens: Tensor, input_pos: Tensor, cache: KVCache, kv_len: int | None,
                rows: Tensor | None, output_index: Tensor | None, n: int, reach: int = 0
                ) -> dict[str, Tensor]:
    """The step graph's inputs (the ONNX export's names), on the tokens' device; kv_len
    stays a host scalar (TensorRT reads shape-tensor inputs from host memory). ``reach``:
    positions the graph writes past max(input_pos) (a fused draft graph's later steps)."""
    B, T = tokens.shape
    dev = tokens.device
    L = cache.max_seq_len
    kv_len = L if kv_len is None else min(kv_len, L)
    # the graph needs max(input_pos) + reach < kv_len; on the GPU checking it would sync
    # every step, and the decoder's host-side bound guarantees it, so only CPU tensors are
    # checked
    if dev.type == "cpu" and input_pos.numel() and int(input_pos.max()) + reach >= kv_len:
        plus = f" + {reach}" if reach else ""
        raise ValueError(f"kv_len must be > max(input_pos){plus} = "
                         f"{int(input_pos.max()) + reach} (an upper bound of the positions, "
                         f"<= {L}); got {kv_len}")
    k0 = cache.k[0]
    if k0.dtype != torch.float32 or not k0.is_contiguous() or k0.device != dev:
        raise ValueError(f"cache must be contiguous float32 on {dev} (new_kv_cache) for the "
                         f"engine backends; got {k0.dtype} on {k0.device}")
    # the defaults and kv_len are the same tensors every call (read-only), so an engine that
    # keeps its bindings (ort.Graph) binds them once
    if rows is None:
        rows = arange_on(B, dev)
    if output_index is None:
        output_index = arange_grid(B, T, dev)
    inputs = {"tokens": tokens.long().contiguous(), "input_pos": input_pos.long().contiguous(),
              "rows": rows.long().contiguous(), "output_index": output_index.long().contiguous(),
              "kv_len": host_scalar(kv_len)}
    for i in range(n):
        inputs[f"past_k_{i}"] = cache.k[i]
        inputs[f"past_v_{i}"] = cache.v[i]
    return inputs


@functools.lru_cache(maxsize=256)
def arange_on(n: int, device: torch.device) -> Tensor:
    """0..n-1 (int64), one shared tensor per (n, device): never write to it."""
    return torch.arange(n, device=device)


@functools.lru_cache(maxsize=256)
def arange_grid(rows: int, n: int, device: torch.device) -> Tensor:
    """[rows, n] of 0..n-1 (int64, contiguous), one shared tensor per shape: never write to it."""
    return torch.arange(n, device=device).expand(rows, n).contiguous()


@functools.lru_cache(maxsize=4096)
def host_scalar(value: int) -> Tensor:
    """``value`` as a 0-d int64 CPU tensor, one shared tensor per value: never write to it."""
    return torch.tensor(value)


def write_back(cache: KVCache, new_kv: dict[str, Tensor], rows: Tensor, input_pos: Tensor,
               packed: Tensor | None = None) -> None:
    """This step's K/V into the cache at (row, position), in place: Transformer.forward's
    writes (on the GPU, queued on the current stream after the plan). ``packed``: the
    memory of ``new_kv`` as [2 · layers, B, T, heads, head_dim] (k_0, v_0, k_1, …); with a
    cache ``buffer`` every layer is then written by one indexed copy instead of two each."""
    if packed is not None and cache.buffer is not None:
        n = packed.shape[0] // 2
        cache.buffer[:n, :, rows[:, None], input_pos] = packed.view(n, 2, *packed.shape[1:])
        return
    index = (rows[:, None], input_pos)
    for i in range(len(new_kv) // 2):
        cache.k[i].index_put_(index, new_kv[f"new_k_{i}"])
        cache.v[i].index_put_(index, new_kv[f"new_v_{i}"])


def correction_inputs(B: int, randoms: Randoms | None, draft_probs: Tensor | None,
                      num_drafted: Tensor | None, device: torch.device) -> dict[str, Tensor]:
    """The correction graph's extra inputs; absent (None) ones travel as empty tensors.
    ``randoms``: the round's per-row numbers (``row_randoms``), the ones the unfused path
    hands ``correct()``, so both paths give the same tokens; ``draft_probs``: the sampled
    draft's q [B, K, V] (None: a greedy, one-hot draft)."""
    if randoms is None:  # greedy: no random numbers
        randoms = Randoms(torch.empty(B, 0, device=device), torch.empty(B, 0, device=device))
    probs = torch.empty(B, 0, 0, device=device) if draft_probs is None else draft_probs
    drafted = (torch.empty(0, dtype=torch.long, device=device) if num_drafted is None
               else num_drafted)
    return {"draft_probs": probs.float().contiguous(),
            "accept_uniforms": randoms.accept_uniforms.float().contiguous(),
            "sample_noise": randoms.sample_noise.float().contiguous(),
            "num_drafted": drafted.long().contiguous()}
