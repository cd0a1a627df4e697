"""``paradraft build --backend onnx``: our Transformer → ONNX graphs + manifest.json.

Graphs per engine dir (fp32, opset 17, dynamic batch / token count / cache length; with
``draft_precision="int8"``, the default, the drafting graphs carry int8 weights, see
``quantize_draft``):

- ``<model>.onnx`` (role ``logits``): the step graph of every model. Inputs ``tokens``
  [B, T], ``input_pos`` [B, T] (per-row positions), ``rows`` [B] (cache slots),
  ``output_index`` [B, T'], ``kv_len`` (scalar: how much of the cache to attend over) and
  ``past_k_<i>`` / ``past_v_<i>`` [slots, cache_len, kv_heads, head_dim] — the runtime's
  whole cache, bound by pointer, never copied. Outputs ``logits`` [B, T', V] and
  ``new_k_<i>`` / ``new_v_<i>`` [B, T, kv_heads, head_dim]: this step's K/V, which the
  runtime writes into the cache at (rows, input_pos), as ``Transformer.forward`` does.
- ``verifier_correction.onnx`` (role ``correction``): the verifier step graph ending in
  ``CausalCorrection`` (domain ``paradraft``; attributes plugin_version / plugin_namespace
  as the TensorRT ONNX parser passes plugin fields). Extra inputs ``draft_probs`` (empty
  when the draft is greedy), ``accept_uniforms``, ``sample_noise``, ``num_drafted`` (empty:
  all K drafted); outputs ``num_accepted``, ``next_token``, ``accepted_tokens`` instead of
  logits. The draft tokens are ``tokens[:, 1:]`` (the verify input is [newest, d_1 … d_K]).
- ``verifier_self<N>.onnx`` (role ``self_draft``): the first N layers + norm + LM head.

Weights live outside the graphs (ONNX external data), one ``<model>.weights`` file per model
(``WeightStore``): every graph of a model points into it, a tensor stored once however many
graphs use it (the logits, correction and self-draft graphs, the fused draft graphs per k,
int8 and fp32 alike). A graph file holds only its nodes and small constants, so a model past
the 2 GB protobuf limit exports, and an engine dir is about the size of its weights.
"""

from __future__ import annotations

import hashlib
import logging
import math
import shutil
import tempfile
import warnings
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from paradraft.build import quantize
from paradraft.runtime.backends.engine_io import DOMAIN, OP_TYPE, PLUGIN_VERSION, set_rule
from paradraft.runtime.backends.manifest import package_versions, write_manifest
from paradraft.runtime.backends.ort import OrtModel
from paradraft.runtime.checkpoints import load_draft
from paradraft.runtime.correction import MAX_K, RuleParams
from paradraft.runtime.model import (
    ModelConfig,
    Transformer,
    check_cache_len,
    load_model,
    new_kv_cache,
)
from paradraft.runtime.tools.calibrate import calibrate, calibration_prompts

OPSET = 17
DRAFT_PRECISIONS = ("int8", "float32")
# int8 drafting graphs against the fp32 model, in units of the logits' standard deviation:
# how far the torch logit of each token the int8 graph would draft may trail torch's max
# (twice a max abs logit error of 0.3: one for each of the two logits). The demo drafts'
# max abs error over random tokens is 0.09-0.16 (top-1 agreement 0.94-0.96); a chaotic or
# wrongly quantized draft trails by whole standard deviations
INT8_TOL = 0.6
WEIGHTS = ".weights"  # <model>.weights: the one weights file of a model's graphs
# "int8" / "int4": MatMul weights block-quantized for MatMulNBits (``quantize``)
WEIGHTS_DTYPES = ("float32", "float16", *quantize.WEIGHT_BITS)
# fp16-stored weights against the fp32 model, in standard deviations of the logits: fp16
# rounding moves them by ~1e-3 of that; a wrong export by whole standard deviations
FP16_TOL = 0.05
INLINE_BYTES = 1024  # smaller tensors (shape constants, tiny norms) stay inside the graph
# tensors of ALIGN_FROM bytes or more start at a multiple of ALIGN_BYTES (the largest
# allocation granularity, Windows'), so that ONNX Runtime may map them instead of copying
ALIGN_FROM, ALIGN_BYTES = 1 << 20, 1 << 16
CORRECTION_INPUTS = ("draft_probs", "accept_uniforms", "sample_noise", "num_drafted")
CORRECTION_OUTPUTS = ("num_accepted", "next_token", "accepted_tokens")


def input_names(num_layers: int) -> list[str]:
    kv = [f"past_{kv}_{i}" for i in range(num_layers) for kv in ("k", "v")]
    return ["tokens", "input_pos", "rows", "output_index", "kv_len", *kv]


def new_kv_names(num_layers: int) -> list[str]:
    return [f"new_{kv}_{i}" for i in range(num_layers) for kv in ("k", "v")]


def attend(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, c: ModelConfig,
           scale: float | None = None) -> Tensor:
    """Masked attention, GQA by grouping the query heads per KV head (no K/V repeat).
    ``scale``: the layer's factor on q·k (``Block.attn_scale``; default 1/sqrt(head_dim)).

    q [B, T, H, D]; keys / values [B, Hkv, L, D]; mask [B, G*T, L], the [B, T, L] mask tiled
    G times (``group_mask``) → y [B, H, T, D]. Head counts come from the config and every
    reshape takes its batch and length dims from its own input (or infers one), so the
    export folds the targets to constants (``fold_reshapes``)."""
    Hkv, D = c.n_kv_heads, c.head_dim
    G = c.n_heads // Hkv  # query head h uses KV head h // G, as repeat_interleave / enable_gqa
    q = q.reshape(*q.shape[:2], Hkv, G, D).permute(0, 2, 3, 1, 4)  # [B, Hkv, G, T, D]
    q = q.reshape(*q.shape[:2], -1, D)  # [B, Hkv, G*T, D]
    # K transposed inside the product: ONNX Runtime fuses it into the MatMul (transB)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    scores = (q @ keys.transpose(-1, -2)) * scale  # [B, Hkv, G*T, L]
    weights = scores.masked_fill(~mask[:, None], float("-inf")).softmax(-1)
    y = weights @ values  # [B, Hkv, G*T, D]
    return y.reshape(y.shape[0], c.n_heads, -1, D)  # [B, H, T, D]


def group_mask(mask: Tensor, c: ModelConfig) -> Tensor:
    """[B, T, L] → [B, G*T, L] in ``attend``'s (group, position) row order, once per graph."""
    return mask.repeat(1, c.n_heads // c.n_kv_heads, 1)


class OnnxStep(nn.Module):
    """``Transformer.forward`` with the KV cache as explicit inputs / outputs.

    Exactly the torch semantics (write this step's K/V at (row, position), then a query at p
    attends to cache positions <= p), formulated without mutating an input: gather each
    row's window [0, kv_len) of the past cache, in the [B, Hkv, kv_len, D] layout attention
    reads (transposed once per graph, not once per draft step), scatter this step's K/V into
    that window (ScatterElements; duplicate positions carry identical K/V, as in torch),
    attend over it, and return the new K/V so the caller writes them into its cache. Only
    the window is copied (what torch's ``k_cache[rows, :kv_len]`` gathers too), never the
    whole cache. Requires max(input_pos) < kv_len, which the runtime checks.
    """

    def __init__(self, model: Transformer, num_layers: int | None = None):
        super().__init__()
        self.model = model
        self.layers = model.layers[:num_layers]

    def forward(self, tokens: Tensor, input_pos: Tensor, rows: Tensor, output_index: Tensor,
                kv_len: Tensor, *past: Tensor) -> tuple[Tensor, ...]:
        m = self.model
        windows = self._windows(rows, kv_len, past)
        x, new_kv = self._layers(tokens, input_pos, kv_len, windows)
        x = x.gather(1, output_index[:, :, None].expand(-1, -1, x.shape[-1]))
        return (m.lm_head(m.norm(x)).float(), *new_kv)

    @staticmethod
    def _windows(rows: Tensor, kv_len: Tensor, past: tuple[Tensor, ...]) -> list[Tensor]:
        """Each row's window [0, kv_len) of every past K / V: [B, Hkv, kv_len, D]."""
        L, Hkv, D = past[0].shape[1:]
        window = rows[:, None] * L + torch.arange(kv_len)[None, :]  # flat (slot, pos) index
        return [p.reshape(-1, Hkv, D)[window].transpose(1, 2) for p in past]

    def _layers(self, tokens: Tensor, input_pos: Tensor, kv_len: Tensor,
                windows: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
        """The layers over ``tokens``: their K/V go into ``windows`` (replaced in the list, so
        a later step in the same graph sees them); returns (hidden states, new K/V)."""
        m = self.model
        x, rope = m.embed_at(tokens, input_pos)
        mask = torch.arange(kv_len)[None, None, :] <= input_pos[:, :, None]  # [B, T, kv_len]
        mask = group_mask(mask, m.config)
        c = m.config
        # where this step's K/V go in a [B, Hkv, kv_len, D] window: one scatter index for
        # every layer (an index_put would re-derive its reshapes per layer)
        index = input_pos[:, None, :, None].expand(-1, c.n_kv_heads, -1, c.head_dim)
        new_kv: list[Tensor] = []
        for i, layer in enumerate(self.layers):
            q, k, v = layer.project(x, rope)
            for j, new in ((2 * i, k), (2 * i + 1, v)):
                windows[j] = windows[j].scatter(2, index, new.transpose(1, 2))
            x = layer.finish(x, attend(q, windows[2 * i], windows[2 * i + 1], mask, m.config,
                                       layer.attn_scale))
            new_kv += [k, v]
        return x, new_kv


class OnnxDraftSteps(OnnxStep):
    """``k`` greedy autoregressive draft steps in one graph (one ONNX Runtime call per round
    instead of k): step 0 runs over the fed window (its last token is the newest), each
    later step over the previous step's argmax, attending to the K/V the earlier steps wrote
    into the same windows. Inputs are ``OnnxStep``'s without ``output_index``; outputs
    ``draft_tokens`` [B, k] and ``new_k_<i>`` / ``new_v_<i>`` [B, T + k - 1, Hkv, D], the K/V
    of every fed token (the window, then drafts 1 … k-1), for the runtime to write back at
    (rows, positions) as after k single steps."""

    def __init__(self, model: Transformer, k: int, num_layers: int | None = None):
        super().__init__(model, num_layers)
        self.k = k

    def forward(self, tokens: Tensor, input_pos: Tensor, rows: Tensor, kv_len: Tensor,
                *past: Tensor) -> tuple[Tensor, ...]:
        m = self.model
        windows = self._windows(rows, kv_len, past)
        fed, pos, drafts, steps = tokens, input_pos, [], []
        for _ in range(self.k):
            x, new_kv = self._layers(fed, pos, kv_len, windows)
            fed = m.lm_head(m.norm(x[:, -1:])).float().argmax(-1)  # [B, 1]
            drafts.append(fed)
            steps.append(new_kv)
            pos = pos[:, -1:] + 1
        return (torch.cat(drafts, 1), *(torch.cat(parts, 1) for parts in zip(*steps, strict=True)))


def dummy_inputs(config: ModelConfig, num_layers: int, reach: int = 0) -> tuple[Tensor, ...]:
    """Small example inputs whose dims all differ, so no dynamic axis is traced as constant.
    ``reach``: positions written past the inputs' (a fused draft graph's later steps)."""
    B, T, S, kv_len = 2, 3, 3, 7 + reach
    L = kv_len + 2
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (B, T), generator=g)
    input_pos = torch.tensor([[1, 2, 3], [4, 5, 6]])
    shape = (S, L, config.n_kv_heads, config.head_dim)
    past = [torch.randn(shape, generator=g) for _ in range(2 * num_layers)]
    return (tokens, input_pos, torch.tensor([2, 0]), torch.tensor([[0, 2], [1, 2]]),
            torch.tensor(kv_len), *past)


# -- weights outside the graphs -------------------------------------------------------------


@dataclass
class WeightStore:
    """A model's weights file: the bytes of every large tensor of its graphs, each stored
    once. Keyed by content, not by name: the exporter names a folded weight per trace
    (``onnx::MatMul_812``), so one weight has another name in every graph, and the int8
    graphs of one model quantize a weight to the same bytes each time."""

    path: Path
    # "float16": fp32 weights are stored as fp16 and cast back to fp32 inside the graph
    # (I/O, KV cache and math stay fp32): half the bytes, for TensorRT builds
    dtype: str = "float32"
    block_size: int = quantize.DEFAULT_BLOCK_SIZE  # of "int8" / "int4" weights
    offsets: dict[bytes, int] = field(default_factory=dict)
    size: int = 0

    @classmethod
    def create(cls, path: str | Path, dtype: str = "float32",
               block_size: int = quantize.DEFAULT_BLOCK_SIZE) -> WeightStore:
        """An empty store at ``path`` (truncating what a previous build left there)."""
        if dtype not in WEIGHTS_DTYPES:
            raise ValueError(f"weights_dtype must be one of {', '.join(WEIGHTS_DTYPES)}; "
                             f"got {dtype!r}")
        path = Path(path)
        path.write_bytes(b"")
        return cls(path, dtype, quantize.check_block_size(block_size))

    def check_tol(self) -> dict:
        """``check_graph`` / ``check_draft_steps`` tolerance of a float graph stored here:
        exact up to float error, or with fp16 weights within FP16_TOL standard deviations."""
        if self.dtype in quantize.WEIGHTS_TOL:
            return {"tol": quantize.WEIGHTS_TOL[self.dtype], "relative": True}
        return {"tol": FP16_TOL, "relative": True} if self.dtype == "float16" else {}

    def add(self, data: bytes) -> int:
        """Store ``data`` (unless these bytes are already in the file); return its offset."""
        key = hashlib.blake2b(data, digest_size=32).digest()
        if key not in self.offsets:
            offset = self.size
            if len(data) >= ALIGN_FROM:
                offset = -(-offset // ALIGN_BYTES) * ALIGN_BYTES
            with open(self.path, "ab") as f:
                f.write(bytes(offset - self.size))
                f.write(data)
            self.offsets[key] = offset
            self.size = offset + len(data)
        return self.offsets[key]


def move_weights(model, src_dir: Path, store: WeightStore) -> None:
    """Point every initializer of INLINE_BYTES or more at ``store``'s file, in place: its
    bytes (inline, or external data relative to ``src_dir``) go into the store."""
    from onnx import TensorProto, numpy_helper
    from onnx.external_data_helper import (
        load_external_data_for_tensor,
        set_external_data,
        uses_external_data,
    )

    casts = []
    for t in model.graph.initializer:
        if uses_external_data(t):
            load_external_data_for_tensor(t, str(src_dir))
            t.data_location = TensorProto.DEFAULT
            del t.external_data[:]
        if not t.HasField("raw_data"):  # typed fields (float_data, …): small, or made raw
            array = numpy_helper.to_array(t)
            if array.nbytes < INLINE_BYTES:
                continue
            t.CopyFrom(numpy_helper.from_array(array, t.name))
        if len(t.raw_data) < INLINE_BYTES:
            continue
        if store.dtype == "float16" and t.data_type == TensorProto.FLOAT:
            casts.append(half_tensor(t))
        offset = store.add(t.raw_data)
        set_external_data(t, store.path.name, offset, len(t.raw_data))
        t.ClearField("raw_data")
    if casts:  # first in the graph: the nodes after them read the fp32 names as before
        nodes = [*casts, *model.graph.node]
        del model.graph.node[:]
        model.graph.node.extend(nodes)


def half_tensor(t):
    """Turn fp32 initializer ``t`` into fp16 (renamed ``<name>_fp16``), in place; return the
    Cast node that gives its consumers the fp32 tensor under the old name."""
    from onnx import TensorProto, helper, numpy_helper

    array = numpy_helper.to_array(t)
    if array.size and float(np.abs(array).max()) > np.finfo(np.float16).max:
        raise ValueError(f"weights_dtype float16: weight {t.name} holds |values| up to "
                         f"{float(np.abs(array).max()):g}, past fp16's "
                         f"{float(np.finfo(np.float16).max):g}; use float32")
    name = t.name
    t.CopyFrom(numpy_helper.from_array(array.astype(np.float16), f"{name}_fp16"))
    return helper.make_node("Cast", [t.name], [name], name=f"{name}_cast", to=TensorProto.FLOAT)


def save_graph(model, path: Path, store: WeightStore, src_dir: Path) -> Path:
    """Save ``model`` to ``path`` with its weights in ``store`` (``move_weights``); the
    graph names the weights file relative to itself, so both share a directory."""
    import onnx

    if store.path.parent.resolve() != path.parent.resolve():
        raise ValueError(f"{path}: a graph must sit next to its weights file {store.path}")
    if store.dtype in quantize.WEIGHT_BITS:  # every graph of the model, drafting ones too
        quantize.compress_matmuls(model, src_dir, store.dtype, store.block_size)
    move_weights(model, src_dir, store)
    onnx.save(model, str(path))
    return path


def copy_graph(src: Path, dst: Path, store: WeightStore) -> Path:
    """The graph at ``src`` (weights inline or external next to it) saved as ``dst`` with
    its weights in ``store``."""
    import onnx

    return save_graph(onnx.load(str(src), load_external_data=False), dst, store, src.parent)


def graph_store(path: Path, store: WeightStore | None) -> WeightStore:
    """``store``, or for a graph exported on its own a fresh ``<graph>.weights`` next to it."""
    return store if store is not None else WeightStore.create(path.with_suffix(WEIGHTS))


def _export(module: nn.Module, args: tuple[Tensor, ...], path: Path, names: list[str],
            outputs: list[str], axes: dict, store: WeightStore | None = None) -> Path:
    import onnx

    for name in names:
        if name.startswith("past_"):
            axes[name] = {0: "slots", 1: "cache_len"}
    store = graph_store(path, store)
    # the exporter writes a graph past 2 GB as one file per tensor next to it: in a
    # scratch dir, from which move_weights takes them into the store
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".{path.stem}-") as tmp:
        raw = Path(tmp) / path.name
        # the TorchScript exporter (dynamo=False): it traces this plain module as is, with
        # no extra dependency (the dynamo exporter needs onnxscript); its deprecation
        # notice is noise
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            torch.onnx.export(module, args, str(raw), dynamo=False, opset_version=OPSET,
                              input_names=names, output_names=outputs, dynamic_axes=axes,
                              do_constant_folding=True)
        model = onnx.load(str(raw), load_external_data=False)
        share_weights(model)
        fold_reshapes(model)
        tie_head(model, Path(tmp))
        return save_graph(model, path, store, Path(tmp))


def tie_head(model, src_dir: Path) -> bool:
    """Keep a tied embedding once, in place. The exporter writes it twice: the embedding's
    [V, D] table (Gather) and the LM head's MatMul weight [D, V], its transpose (113 MB extra
    for a 49152 x 576 fp32 vocabulary, on disk and in memory). The Gather then reads the
    head's columns (axis 1: [D, B, T]) and a Transpose of those few activations restores
    [B, T, D]. Returns whether it found a tied pair; the build's checks against torch run on
    the rewritten graph."""
    from onnx import helper, numpy_helper, shape_inference

    inits = {t.name: t for t in model.graph.initializer}
    inferred = shape_inference.infer_shapes(weightless(model)).graph
    ranks = {v.name: len(v.type.tensor_type.shape.dim)
             for v in [*inferred.input, *inferred.value_info]
             if v.type.tensor_type.HasField("shape")}
    gathers = [n for n in model.graph.node if n.op_type == "Gather" and n.input[0] in inits
               and len(inits[n.input[0]].dims) == 2 and n.input[1] in ranks
               and all(a.name != "axis" or a.i == 0 for a in n.attribute)]
    heads = [inits[n.input[1]] for n in model.graph.node
             if n.op_type == "MatMul" and n.input[1] in inits]
    for gather in gathers:
        table = inits[gather.input[0]]
        for head in heads:
            if list(head.dims) != list(table.dims)[::-1]:
                continue
            if not np.array_equal(numpy_helper.to_array(head, str(src_dir)),
                                  numpy_helper.to_array(table, str(src_dir)).T):
                continue
            # every lookup of the table (a fused k-step draft graph embeds k times)
            nodes = []
            for node in model.graph.node:
                nodes.append(node)
                if node in gathers and node.input[0] == table.name:
                    rank, out = ranks[node.input[1]], node.output[0]
                    node.input[0] = head.name
                    del node.attribute[:]
                    node.attribute.append(helper.make_attribute("axis", 1))
                    node.output[0] = f"{out}_columns"
                    nodes.append(helper.make_node("Transpose", [node.output[0]], [out],
                                                  name=f"{node.name}_rows",
                                                  perm=[*range(1, rank + 1), 0]))
            del model.graph.node[:]
            model.graph.node.extend(nodes)
            if not any(table.name in n.input for n in model.graph.node):
                model.graph.initializer.remove(table)
            return True
    return False


def weightless(model):
    """``model`` with each initializer of INLINE_BYTES or more reduced to its name, type and
    dims: what shape inference reads. ``infer_shapes`` serialises and parses the model it is
    given, two copies of every weight (2 GB of a build's peak for a 135 M model)."""
    from onnx import TensorProto, helper

    g = model.graph
    stubs = []
    for t in g.initializer:
        if t.data_location == t.EXTERNAL or math.prod(t.dims) * 4 >= INLINE_BYTES:
            stubs.append(TensorProto(name=t.name, data_type=t.data_type, dims=t.dims))
        else:
            stubs.append(t)
    graph = helper.make_graph(g.node, g.name, g.input, g.output, stubs,
                              value_info=g.value_info)
    return helper.make_model(graph, opset_imports=model.opset_import,
                             ir_version=model.ir_version)


def fold_reshapes(model) -> int:
    """Give every Reshape whose target shape the trace computes at run time (Shape → Gather /
    Slice → Unsqueeze → Concat of traced ``x.shape`` dims) a constant target where that is
    provably the same: a dim ONNX shape inference knows statically becomes its value, the
    Reshape input's own dim at the same place becomes 0 (copy it), and one remaining dim -1.
    The plumbing is then unused and dropped. Returns how many Reshapes were folded. Why: a
    batch-1 draft call is bound by ONNX Runtime's per-node cost, and this plumbing was a
    third of its nodes (the layer code takes each reshape's B, T from its own input for it).
    """
    from onnx import numpy_helper, shape_inference

    g = model.graph
    if any(a.type in (a.GRAPH, a.GRAPHS) for n in g.node for a in n.attribute):
        return 0  # names used inside subgraphs would look unused below
    inferred = shape_inference.infer_shapes(weightless(model)).graph
    dims: dict[str, list[int | str | None]] = {}
    for vi in [*inferred.value_info, *inferred.input, *inferred.output]:
        if vi.type.tensor_type.HasField("shape"):
            dims[vi.name] = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                             for d in vi.type.tensor_type.shape.dim]
    producer = {out: n for n in g.node for out in n.output}
    inputs = {i.name for i in g.input}  # an initializer listed as an input can be fed
    # converted when asked (shape constants only): weights may be external data not at hand
    consts = {i.name: i for i in g.initializer if i.name not in inputs
              and i.data_location != i.EXTERNAL}
    for n in g.node:
        if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value":
            consts[n.output[0]] = n.attribute[0].t

    def const(name: str) -> list[int] | None:
        if name not in consts:
            return None
        return [int(v) for v in numpy_helper.to_array(consts[name]).reshape(-1)]

    def shape_of(name: str) -> str | None:
        """The tensor whose full Shape ``name`` is, if it is one."""
        node = producer.get(name)
        ok = node is not None and node.op_type == "Shape" and not node.attribute
        return node.input[0] if ok else None

    def dim_refs(name: str) -> list[tuple[str, int] | int] | None:
        """A Concat part as constants or (tensor, dim) references; None if unrecognised."""
        if const(name) is not None:
            return const(name)
        node = producer.get(name)
        if node is not None and node.op_type == "Unsqueeze" and node.input[0] in producer:
            gather = producer[node.input[0]]
            index = const(gather.input[1]) if gather.op_type == "Gather" else None
            tensor = shape_of(gather.input[0])
            if index is not None and tensor is not None and index[0] >= 0:
                return [(tensor, index[0])]
        if node is not None and node.op_type == "Slice" and len(node.input) == 3:
            tensor = shape_of(node.input[0])
            starts, ends = const(node.input[1]), const(node.input[2])
            if (tensor is not None and tensor in dims and starts and ends
                    and 0 <= starts[0] <= ends[0]):
                return [(tensor, i) for i in range(starts[0], min(ends[0], len(dims[tensor])))]
        return None

    folded = 0
    for node in g.node:
        if node.op_type != "Reshape" or len(node.input) < 2 or any(
                a.name == "allowzero" and a.i for a in node.attribute):  # there 0 means 0
            continue
        concat, data = producer.get(node.input[1]), dims.get(node.input[0])
        if concat is None or concat.op_type != "Concat" or data is None:
            continue
        parts = [dim_refs(name) for name in concat.input]
        if any(p is None for p in parts):
            continue
        target: list[int] = []
        for ref in (r for p in parts for r in p):
            if isinstance(ref, int):
                target.append(ref)
                continue
            tensor, i = ref
            d = dims[tensor][i] if tensor in dims and i < len(dims[tensor]) else None
            same = tensor == node.input[0] and i == len(target)  # the input's own dim
            target.append(d if isinstance(d, int) and d > 0 else 0 if same else -1)
        if target.count(-1) > 1:
            continue
        name = f"{node.output[0]}_shape"
        g.initializer.append(numpy_helper.from_array(np.array(target, dtype=np.int64), name))
        node.input[1] = name
        folded += 1
    while True:  # drop what no longer has a consumer
        used = {i for n in g.node for i in n.input} | {o.name for o in g.output}
        dead = [n for n in g.node if not any(o in used for o in n.output)]
        if not dead:
            return folded
        for n in dead:
            g.node.remove(n)


def share_weights(model) -> None:
    """Point every use of a weight at its initializer, in place. The tracer reaches a weight
    used twice (each step of a fused draft graph) through an Identity node, and ONNX
    Runtime's quantizer only quantizes MatMuls whose weight is an initializer."""
    weights = {i.name for i in model.graph.initializer}
    alias = {n.output[0]: n.input[0] for n in model.graph.node
             if n.op_type == "Identity" and n.input[0] in weights}
    if not alias:
        return
    nodes = [n for n in model.graph.node if not (n.op_type == "Identity"
                                                   and n.output[0] in alias)]
    for node in nodes:
        node.input[:] = [alias.get(name, name) for name in node.input]
    del model.graph.node[:]
    model.graph.node.extend(nodes)


def export_step(model: Transformer, path: str | Path, num_layers: int | None = None,
                store: WeightStore | None = None) -> Path:
    """Export the step graph (all layers, or the first ``num_layers``) to ``path``, its
    weights into ``store`` (default: a fresh ``<graph>.weights`` next to it)."""
    n = model.config.n_layers if num_layers is None else num_layers
    names = input_names(n)
    outputs = ["logits", *new_kv_names(n)]
    axes = {"tokens": {0: "batch", 1: "tokens"}, "input_pos": {0: "batch", 1: "tokens"},
            "rows": {0: "batch"}, "output_index": {0: "batch", 1: "outputs"},
            "logits": {0: "batch", 1: "outputs"}}
    for name in outputs[1:]:
        axes[name] = {0: "batch", 1: "tokens"}
    step = OnnxStep(model.float().eval(), num_layers)
    return _export(step, dummy_inputs(model.config, n), Path(path), names, outputs, axes,
                   store)


def export_draft_steps(model: Transformer, path: str | Path, k: int,
                       num_layers: int | None = None, store: WeightStore | None = None
                       ) -> Path:
    """Export the fused ``k``-step greedy draft graph (``OnnxDraftSteps``) to ``path``, its
    weights into ``store`` (default: a fresh ``<graph>.weights`` next to it)."""
    n = model.config.n_layers if num_layers is None else num_layers
    names = [name for name in input_names(n) if name != "output_index"]
    outputs = ["draft_tokens", *new_kv_names(n)]
    axes = {"tokens": {0: "batch", 1: "tokens"}, "input_pos": {0: "batch", 1: "tokens"},
            "rows": {0: "batch"}, "draft_tokens": {0: "batch"}}
    for name in outputs[1:]:
        axes[name] = {0: "batch", 1: "fed"}
    args = dummy_inputs(model.config, n, reach=k)
    steps = OnnxDraftSteps(model.float().eval(), k, num_layers)
    return _export(steps, args[:3] + args[4:], Path(path), names, outputs, axes, store)


def add_correction(logits_path: str | Path, out_path: str | Path, params: RuleParams) -> Path:
    """The correction variant: the step graph with CausalCorrection on its logits. It points
    at the step graph's weights file, so ``out_path`` goes next to ``logits_path``."""
    import onnx
    from onnx import TensorProto, helper

    logits_path, out_path = Path(logits_path), Path(out_path)
    if logits_path.parent.resolve() != out_path.parent.resolve():
        raise ValueError(f"out_path {out_path} must be in the directory of {logits_path} "
                         "(the graphs share its weights file)")
    model = onnx.load(str(logits_path), load_external_data=False)
    g = model.graph
    g.initializer.extend([helper.make_tensor("draft_start", TensorProto.INT64, [1], [1]),
                          helper.make_tensor("draft_end", TensorProto.INT64, [1], [2**62]),
                          helper.make_tensor("draft_axis", TensorProto.INT64, [1], [1])])
    g.node.extend([
        helper.make_node("Slice", ["tokens", "draft_start", "draft_end", "draft_axis"],
                         ["draft_tokens"], name="draft_tokens"),
        helper.make_node(OP_TYPE, ["logits", "draft_tokens", *CORRECTION_INPUTS],
                         list(CORRECTION_OUTPUTS), name=OP_TYPE, domain=DOMAIN),
    ])
    set_rule(model, params)
    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    g.input.extend([
        helper.make_tensor_value_info("draft_probs", f32, ["probs_batch", "probs_k", "probs_v"]),
        helper.make_tensor_value_info("accept_uniforms", f32, ["batch", "k"]),
        helper.make_tensor_value_info("sample_noise", f32, ["batch", "vocab"]),
        helper.make_tensor_value_info("num_drafted", i64, ["num_drafted_batch"]),
    ])
    kept = [o for o in g.output if o.name != "logits"]
    del g.output[:]
    g.output.extend([helper.make_tensor_value_info("num_accepted", i64, ["batch"]),
                     helper.make_tensor_value_info("next_token", i64, ["batch"]),
                     helper.make_tensor_value_info("accepted_tokens", i64, ["batch", "tokens"]),
                     *kept])
    model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    onnx.save(model, str(out_path))
    onnx.checker.check_model(str(out_path))  # by path: it reads the external weights too
    return out_path


def quantize_draft(src: Path, dst: Path) -> Path:
    """``dst``: the drafting graph ``src`` with int8 weights (ONNX Runtime's dynamic
    quantization: int8 MatMul weights, activations quantized per call; the embedding stays
    fp32), its weights in ``<dst>.data`` next to it.

    Why: a draft call at batch 1 is bound by reading its weights (the demo draft's 16 MB of
    fp32 do not stay in cache next to the verifier's 54 MB), and the self-draft's LM head is
    the verifier's. The draft only proposes tokens: the verifier's logits decide, so the
    lossless rules stay lossless (the exact rule uses the q the int8 draft sampled from);
    only acceptance can move. The verifier graphs stay fp32."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quiet = logging.getLogger().level
    logging.getLogger().setLevel(logging.ERROR)  # "consider pre-processing": not for us
    try:
        # per tensor: ORT's per-channel variant came out 2-4x further from fp32 on the demo.
        # External data: a self-draft of a large verifier (embedding + LM head) passes 2 GB
        quantize_dynamic(src, dst, op_types_to_quantize=["MatMul"], per_channel=False,
                         weight_type=QuantType.QInt8, use_external_data_format=True)
    finally:
        logging.getLogger().setLevel(quiet)
    model = onnx.load(str(dst), load_external_data=False)
    if gather_before_dequantize(model):
        onnx.save(model, str(dst))  # the weights stay where they are: only nodes moved
    return dst


def gather_before_dequantize(model) -> int:
    """Look up rows of an int8 table, then dequantize those rows: in place, for every
    DequantizeLinear of a per-tensor quantized initializer whose consumers are all Gathers.
    Returns how many lookups it rewrote.

    Why: a tied embedding is the LM head's MatMul weight (``tie_head``). Quantizing that
    weight leaves the embedding lookup reading it through one DequantizeLinear of the whole
    [D, V] table, run on every call (ONNX Runtime does not fold it): for a 49152 x 256 draft
    that was 9 ms of each draft step, more than the rest of the step. With one scale and one
    zero point the dequantize is elementwise, so it commutes with the lookup and the values
    are the same to the bit."""
    from onnx import helper

    inits = {t.name: t for t in model.graph.initializer}
    consumers: dict[str, list] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    moved = {}
    for node in model.graph.node:
        if node.op_type != "DequantizeLinear" or node.input[0] not in inits:
            continue
        params = [inits.get(name) for name in node.input[1:]]
        users = consumers.get(node.output[0], [])
        if (any(p is None or len(p.dims) != 0 for p in params) or not users
                or any(u.op_type != "Gather" or u.input[0] != node.output[0] for u in users)):
            continue
        moved[node.output[0]] = node
    if not moved:
        return 0
    nodes, rewritten = [], 0
    for node in model.graph.node:
        if node.op_type == "DequantizeLinear" and node.output[0] in moved:
            continue
        nodes.append(node)
        dequantize = moved.get(node.input[0]) if node.op_type == "Gather" else None
        if dequantize is not None:
            out = node.output[0]
            node.input[0] = dequantize.input[0]
            node.output[0] = f"{out}_int8"
            nodes.append(helper.make_node("DequantizeLinear",
                                          [node.output[0], *dequantize.input[1:]], [out],
                                          name=f"{node.name}_dequantize"))
            rewritten += 1
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return rewritten


# -- build-time checks ------------------------------------------------------------------


class GraphMismatch(RuntimeError):
    """An exported graph does not compute what the torch model does: ``detail`` says by how
    much, ``path`` names the graph."""

    def __init__(self, path: Path, detail: str):
        super().__init__(f"{path}: {detail}")
        self.path, self.detail = path, detail


class DraftPrecisionWarning(UserWarning):
    """An int8 drafting graph drifted past its tolerance and was built in float32."""


def logit_gap(a: Tensor, b: Tensor) -> float:
    """Max abs difference of two logit tensors; equal infinities (a padded vocabulary's −inf,
    ``pad_vocab``) count as no difference, any other mismatch of infinities as infinite."""
    same = (a == b) | (a.isinf() & b.isinf() & (a.sign() == b.sign()))
    return float(torch.where(same, 0.0, (a - b).abs()).max())


def argmax_gap(reference: Tensor, chosen: Tensor) -> float:
    """How far the ``reference`` logit of each ``chosen`` token trails the reference max, at
    worst: 0 when every choice is the reference's argmax (or ties it)."""
    picked = reference.gather(-1, chosen[..., None])[..., 0]
    return float((reference.amax(-1) - picked).max())


def check_graph(model: Transformer, path: Path, num_layers: int | None = None,
                tol: float = 1e-3, relative: bool = False, drafts_only: bool = False
                ) -> float:
    """Run the exported graph and the torch model on the same ragged step; return the max
    abs logit difference (raise above ``tol``, in units of the torch logits' standard
    deviation if ``relative``) — the build refuses a wrong export. ``drafts_only``: judge
    only what a greedy draft takes from the logits, ``argmax_gap`` of the graph's argmax
    (an int8 draft: its far tail of logits moves, and no draft token depends on it)."""
    c = model.config
    ort_model = OrtModel(c, {num_layers: path} if num_layers else {None: path})
    g = torch.Generator().manual_seed(0)
    # every dim distinct, and unlike the export's dummy inputs (batch 3, prompt 5, step 3
    # for slots 4, cache 16), so a dim the export wrongly froze or mixed up shows; rows are
    # a slot subset out of order
    tokens = torch.randint(0, c.vocab_size, (3, 5), generator=g)
    caches = [new_kv_cache(c, 4, 16, torch.float32) for _ in range(2)]
    rows = torch.tensor([3, 1, 0])
    pos = torch.arange(5).expand(3, -1)
    step_pos = torch.tensor([[5, 6, 7], [3, 4, 5], [4, 5, 6]])  # rows 1, 2 rolled back
    step_tokens = tokens[:, :3]
    outs = []
    for m, cache in zip((model, ort_model), caches, strict=True):
        with torch.no_grad():
            m(tokens, pos, cache, kv_len=5, rows=rows, num_layers=num_layers)
            logits, _ = m(step_tokens, step_pos, cache, kv_len=9, rows=rows,
                          num_layers=num_layers)
        outs.append(logits)
    if relative:
        tol *= float(outs[0][outs[0].isfinite()].std())
    if drafts_only:
        gap = argmax_gap(outs[0], outs[1].argmax(-1))
        if not gap <= tol:
            raise GraphMismatch(path, f"ONNX's argmax trails torch's by {gap:g} (> {tol:g})")
        return gap
    diff = logit_gap(outs[0], outs[1])
    if not diff <= tol:
        raise GraphMismatch(path, f"ONNX logits differ from torch by {diff:g} (> {tol:g})")
    return diff


def check_draft_steps(model: Transformer, path: Path, k: int, num_layers: int | None = None,
                      tol: float = 1e-3, relative: bool = False, drafts_only: bool = False
                      ) -> float:
    """Run a fused draft graph on a ragged round (rows out of order, one rolled back), then
    the torch model teacher-forced over the same window and the graph's drafts. Each draft
    must be torch's argmax up to ``tol`` (its torch logit at most ``tol`` below the max) and
    the K/V written back must match torch's within ``tol`` (both in units of the torch
    values' standard deviation if ``relative``); raise otherwise. Returns the largest gap.
    ``drafts_only``: judge the drafts alone (an int8 draft: its K/V carry int8 rounding,
    and what that rounding does to later drafts shows in their gaps)."""
    c = model.config
    ort_model = OrtModel(c, {}, draft_steps={(num_layers, k): path})
    g = torch.Generator().manual_seed(0)
    # batch 3: unlike the export's dummy batch 2, so a frozen batch dim shows
    tokens = torch.randint(0, c.vocab_size, (3, 5), generator=g)
    caches = [new_kv_cache(c, 4, 32, torch.float32) for _ in range(2)]
    rows = torch.tensor([3, 1, 0])
    window, window_pos = tokens[:, 1:3], torch.tensor([[5, 6], [3, 4], [4, 5]])
    kv_len = 7 + k
    with torch.no_grad():
        for cache in caches:
            model(tokens, torch.arange(5).expand(3, -1), cache, kv_len=5, rows=rows,
                  num_layers=num_layers)
        drafts = ort_model.greedy_drafts(window, window_pos, caches[1], k, kv_len=kv_len,
                                         rows=rows, num_layers=num_layers)
        fed = torch.cat([window, drafts[:, :-1]], 1)
        fed_pos = torch.cat([window_pos, window_pos[:, -1:] + torch.arange(1, k)], 1)
        logits, _ = model(fed, fed_pos, caches[0], kv_len=kv_len, rows=rows,
                          num_layers=num_layers)
    steps = logits[:, window.shape[1] - 1:]  # the logits each draft was chosen from
    gap = argmax_gap(steps, drafts)
    layers = len(model.layers[:num_layers])
    kv = [(t[rows], o[rows]) for t, o in zip(caches[0].k[:layers] + caches[0].v[:layers],
                                              caches[1].k[:layers] + caches[1].v[:layers],
                                              strict=True)]
    kv_diff = max(float((t - o).abs().max()) for t, o in kv)
    gap_tol, kv_tol = tol, tol
    if relative:
        gap_tol *= float(steps[steps.isfinite()].std())
        kv_tol *= max(float(t.std()) for t, _ in kv)
    if drafts_only:
        kv_tol = float("inf")
    # name only the checks that failed (drafts_only has no K/V bound)
    failed = ([f"fused drafts trail torch's argmax by {gap:g} (> {gap_tol:g})"]
              if not gap <= gap_tol else [])
    if not kv_diff <= kv_tol:
        failed.append(f"their K/V differ from torch's by {kv_diff:g} (> {kv_tol:g})")
    if failed:
        raise GraphMismatch(path, "; ".join(failed))
    return gap


TOKENIZER_EXTRAS = ("tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                    "generation_config.json")


# -- the build ----------------------------------------------------------------------------


def export_drafting(model: Transformer, path: Path, precision: str, store: WeightStore,
                    num_layers: int | None = None, k: int | None = None) -> str:
    """Export a drafting graph (the step graph, or with ``k`` the fused k-step greedy draft
    graph) to ``path``, its weights into ``store``, checked against torch; returns the
    precision it got: "int8", or the store's float dtype. With ``precision="int8"`` the fp32
    export is checked as strictly as a float one (a wrong export), quantized, and the int8
    graph judged by the drafts it would choose: their torch logits may trail torch's max by
    ``INT8_TOL`` (``drafts_only``).

    An int8 graph past that tolerance is built as a float graph instead, with a
    ``DraftPrecisionWarning`` naming it: a draft's precision never changes the output (the
    verifier decides every token), so a valid checkpoint is never refused for it. Only the
    float check refuses: it catches a wrong export."""
    if k is None:
        export = partial(export_step, model, num_layers=num_layers)
        check = partial(check_graph, model, num_layers=num_layers)
    else:
        export = partial(export_draft_steps, model, k=k, num_layers=num_layers)
        check = partial(check_draft_steps, model, k=k, num_layers=num_layers)
    if precision == "float32":
        check(path=export(path=path, store=store), **store.check_tol())
        return store.dtype
    # both versions in a scratch dir, checked there: only the one kept reaches the store
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".{path.stem}-") as tmp:
        fp32 = export(path=Path(tmp) / path.name)
        check(path=fp32)
        int8 = quantize_draft(fp32, Path(tmp) / f"{path.stem}.int8.onnx")
        try:
            check(path=int8, tol=INT8_TOL, relative=True, drafts_only=True)
            kept, precision = int8, "int8"
        except GraphMismatch as e:
            warnings.warn(DraftPrecisionWarning(
                f"{path.name}: int8 weights drift past the build's tolerance ({e.detail}); "
                f"built in {store.dtype} instead (a draft's precision never changes the "
                "output, only its acceptance and speed)"), stacklevel=2)
            kept, precision = fp32, store.dtype
        copy_graph(kept, path, store)
    if precision == "float16":  # halved on the way into the store: checked as stored
        check(path=path, **store.check_tol())
    return precision


def check_limits(max_batch_size: int, max_k: int, max_seq_len: int, config: ModelConfig
                 ) -> None:
    if not isinstance(max_batch_size, int) or max_batch_size < 1:
        raise ValueError(f"max_batch_size must be an integer >= 1; got {max_batch_size!r}")
    if not isinstance(max_k, int) or not 1 <= max_k <= MAX_K:
        raise ValueError(f"max_k must be an integer in [1, {MAX_K}]; got {max_k!r}")
    high = config.max_position_embeddings if config.is_gpt2 else 1 << 20
    if not isinstance(max_seq_len, int) or not 1 <= max_seq_len <= high:
        raise ValueError(f"max_seq_len must be an integer in [1, {high}]; got {max_seq_len!r}")
    check_cache_len(config, max_seq_len)  # the runtime's caches must be allowed too (by name)


def build_engines(
    verifier_dir: str | Path,
    out_dir: str | Path,
    draft_dir: str | Path | None = None,
    parallel_draft_dir: str | Path | None = None,
    self_draft_layers: int | None = None,
    rule_defaults: RuleParams | None = None,
    max_batch_size: int = 8,
    max_k: int = 8,
    max_seq_len: int = 512,
    dtype: str = "float32",
    draft_precision: str = "int8",
    fused_drafts: bool = True,
    weights_dtype: str = "float32",
    calibrate_rules: bool = True,
    weights_block_size: int = quantize.DEFAULT_BLOCK_SIZE,
) -> dict:
    """Export the verifier (+ correction and self-draft variants) and the drafts to
    ``out_dir`` and write its manifest.json. Returns the manifest.
    ``draft_precision``: weights of the drafting graphs (drafts and self-draft), int8 or
    float32; the verifier graphs are float32 either way. An int8 drafting graph that drifts
    past its tolerance is built in float32 with a ``DraftPrecisionWarning``; each graph's
    ``precision`` in the manifest says what it got. Each model's graphs share one
    ``<model>.weights`` file (manifest: the model's ``weights``). ``weights_dtype``
    "float16" stores the float weights in fp16, cast back to fp32 inside the graphs (half the
    engine dir, for TensorRT plans; I/O, KV cache and math stay fp32); each float graph's
    ``precision`` is then "float16". ``weights_dtype`` "int8" / "int4" block-quantizes every
    MatMul weight of every graph (``quantize``; ``weights_block_size`` input features per
    scale): each graph built from the float export gets that ``precision``; the int8 drafting
    graphs of ``draft_precision="int8"`` keep their dynamic int8. ``fused_drafts``: also the fused
    k-step greedy draft graphs (k = 2 … max_k) of the autoregressive drafters, the draft
    model and the self-draft (roles ``draft_steps<k>`` / ``self_draft_steps<k>``): one ONNX
    Runtime call drafts a whole block, where k single steps cost k calls. TensorRT plans
    are built from the step graphs only. ``calibrate_rules``: measure the verifier's confidence
    and store rule defaults calibrated to it (``runtime.tools.calibrate``) as the manifest's
    ``calibration``."""
    if dtype != "float32":
        raise ValueError(f"dtype must be float32 for the onnx backend (CPU); got {dtype!r}")
    if draft_precision not in DRAFT_PRECISIONS:
        raise ValueError(f"draft_precision must be one of {', '.join(DRAFT_PRECISIONS)}; "
                         f"got {draft_precision!r}")
    if weights_dtype not in WEIGHTS_DTYPES:
        raise ValueError(f"weights_dtype must be one of {', '.join(WEIGHTS_DTYPES)}; "
                         f"got {weights_dtype!r}")
    quantize.check_block_size(weights_block_size)  # before the long export
    rule_defaults = rule_defaults or RuleParams("greedy")
    verifier_dir = Path(verifier_dir)
    verifier = load_model(verifier_dir)
    vc = verifier.config
    check_limits(max_batch_size, max_k, max_seq_len, vc)
    # the self-draft's graphs only where asked for (the flag, or the verifier's config): a
    # deployment builds the graphs it runs, and a self-draft of a large verifier is 8 graphs
    n_self = self_draft_layers or vc.self_draft_layers
    if n_self is not None and not 1 <= n_self < vc.n_layers:
        raise ValueError(f"self_draft_layers must be in [1, {vc.n_layers - 1}]; got {n_self}")
    sources = {"draft": draft_dir, "parallel_draft": parallel_draft_dir}
    drafts = {}
    for name, d in sources.items():
        if d is None:
            continue
        d = Path(d)
        # checked against the verifier's tokenizer; widened where padded to another size
        draft = load_draft(d, verifier_dir, vc.vocab_size, name=name)
        if name == "parallel_draft" and draft.config.mask_token_id is None:
            raise ValueError(f"parallel_draft {d}: config.json has no mask_token_id")
        drafts[name] = (d, draft)

    calibration = calibrate(verifier, calibration_prompts(verifier_dir, vc.vocab_size)
                            ).to_dict() if calibrate_rules else None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    models: dict[str, dict] = {}
    graphs = {"logits": {"file": "verifier.onnx", "precision": weights_dtype},
              "correction": {"file": "verifier_correction.onnx", "precision": weights_dtype}}
    store = WeightStore.create(out / f"verifier{WEIGHTS}", weights_dtype, weights_block_size)
    check_graph(verifier, export_step(verifier, out / graphs["logits"]["file"], store=store),
                **store.check_tol())
    add_correction(out / graphs["logits"]["file"], out / graphs["correction"]["file"],
                   rule_defaults)
    fused_ks = range(2, max_k + 1) if fused_drafts else range(0)
    if n_self is not None:
        f = f"verifier_self{n_self}.onnx"
        graphs["self_draft"] = {"file": f, "num_layers": n_self, "precision": export_drafting(
            verifier, out / f, draft_precision, store, n_self)}
    for k in fused_ks if n_self is not None else ():
        f = f"verifier_self{n_self}_steps{k}.onnx"
        graphs[f"self_draft_steps{k}"] = {
            "file": f, "num_layers": n_self, "k": k,
            "precision": export_drafting(verifier, out / f, draft_precision, store, n_self, k)}
    models["verifier"] = {"source": str(verifier_dir), "config": asdict(vc),
                          "weights": store.path.name, "graphs": graphs}
    for name, (d, draft) in drafts.items():
        store = WeightStore.create(out / f"{name}{WEIGHTS}", weights_dtype, weights_block_size)
        f = f"{name}.onnx"
        models[name] = {"source": str(d), "config": asdict(draft.config),
                        "weights": store.path.name, "graphs": {"logits": {
                            "file": f,
                            "precision": export_drafting(draft, out / f, draft_precision, store)}}}
        if name == "draft":  # the parallel draft proposes its block in one pass already
            for k in fused_ks:
                f = f"{name}_steps{k}.onnx"
                models[name]["graphs"][f"draft_steps{k}"] = {
                    "file": f, "k": k,
                    "precision": export_drafting(draft, out / f, draft_precision, store, k=k)}

    tokenizer = None
    if (verifier_dir / "tokenizer.json").is_file():
        tokenizer = "tokenizer.json"
        # with the files the chat template and its special tokens live in
        for name in ("tokenizer.json", *TOKENIZER_EXTRAS):
            if (verifier_dir / name).is_file():
                shutil.copyfile(verifier_dir / name, out / name)
    drafters = {"self": "verifier"} if n_self is not None else {}
    if "draft" in drafts:
        drafters["model"] = "draft"
    if "parallel_draft" in drafts:
        drafters["parallel"] = "parallel_draft"
    manifest = {
        "backend": "onnx",
        "dtype": dtype,
        "draft_precision": draft_precision,
        "weights_dtype": weights_dtype,
        **({"weights_block_size": weights_block_size,
            "weights_accuracy_level": quantize.ACCURACY_LEVEL[weights_dtype]}
           if weights_dtype in quantize.WEIGHT_BITS else {}),
        "opset": OPSET,
        "vocab_size": vc.vocab_size,
        "limits": {"max_batch_size": max_batch_size, "max_k": max_k,
                   "max_seq_len": max_seq_len},
        "tokenizer": tokenizer,
        "rule_defaults": asdict(rule_defaults),
        "calibration": calibration,
        "custom_ops": {OP_TYPE: {"domain": DOMAIN, "plugin_version": PLUGIN_VERSION,
                                 "plugin_namespace": DOMAIN}},
        "models": models,
        "drafters": drafters,
        "versions": package_versions(),
    }
    return write_manifest(out, manifest)
