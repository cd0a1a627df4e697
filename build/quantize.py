"""Compressed verifier weights for ONNX Runtime: weight-only block quantization of MatMuls.

``paradraft build --backend onnx --weights int8|int4`` stores every MatMul weight of a model's
graphs as ``bits``-bit integers with one fp32 scale (and zero point) per ``block_size``
consecutive input features, run by ONNX Runtime's ``MatMulNBits`` (domain com.microsoft).
The KV cache, the embedding lookup, attention, norms and the correction maths stay fp32, and
so do the activations between MatMuls. Inside an int4 MatMul the product is fp32 too; an
int8 MatMul quantizes its input rows per block to int8 for the product (``ACCURACY_LEVEL``).
Why: a decode step of a real model streams all its weights from memory, so the bytes per
step set its time; int8 reads a quarter of fp32's, int4 an eighth (plus scales).

This is a different thing from ``--draft-precision int8`` (``onnx.quantize_draft``): there
ONNX Runtime's dynamic quantization also quantizes the activations per call, and only the
drafting graphs get it. Here the verifier itself changes: the lossless rules are lossless
with respect to the compressed verifier, whose distance to the fp32 one ``paradraft eval
--reference-engines`` measures.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

# bits per stored weight of each ``--weights`` setting
WEIGHT_BITS = {"int8": 8, "int4": 4}
# MatMulNBits takes power-of-two blocks of 16 … 256 input features (ONNX Runtime's CPU
# kernels); smaller blocks: closer to fp32, more scale bytes
BLOCK_SIZES = (16, 32, 64, 128, 256)
DEFAULT_BLOCK_SIZE = 32
# MatMulNBits' accuracy_level per setting (None: fp32 compute). ONNX Runtime 1.32 has no
# fp32-compute CPU kernel for 8-bit weights (it dequantizes the whole matrix every call:
# several times slower than fp32 weights), only the int8-compute one (level 4)
ACCURACY_LEVEL = {"int8": 4, "int4": None}
# a compressed graph against the fp32 torch model: max abs logit difference in units of the
# logits' standard deviation, over the build check's random tokens. Measured on
# SmolLM2-135M (block 32): int8 0.16, int4 2.7 (int4 round-to-nearest is far from fp32 on a
# model this small: `eval --reference-engines` says how far). A wrong export (a misplaced
# weight) gives unrelated logits, whose largest difference is several standard deviations
WEIGHTS_TOL = {"int8": 0.3, "int4": 4.0}


def check_block_size(block_size: int) -> int:
    """``block_size`` if MatMulNBits takes it; else a ValueError naming the range."""
    if not isinstance(block_size, int) or isinstance(block_size, bool) or (
            block_size not in BLOCK_SIZES):
        raise ValueError(f"weights_block_size must be one of {', '.join(map(str, BLOCK_SIZES))} "
                         f"(a power of two in [16, 256]); got {block_size!r}")
    return block_size


def check_weights(weights: str) -> int:
    """The bits of ``weights`` ("int8" / "int4"); else a ValueError naming the choices."""
    if weights not in WEIGHT_BITS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHT_BITS)}; got {weights!r}")
    return WEIGHT_BITS[weights]


def compress_matmuls(model, src_dir: Path, weights: str, block_size: int) -> int:
    """Replace every MatMul of ``model`` (an onnx ModelProto, changed in place) whose weight
    is a 2-D initializer by a ``MatMulNBits`` over that weight quantized to ``weights``
    (asymmetric round-to-nearest per block of ``block_size`` input features; the product's
    precision is ``ACCURACY_LEVEL[weights]``). External
    weights are read relative to ``src_dir``. Returns how many MatMuls were replaced.

    A weight several MatMuls share (each step of a fused draft graph) is quantized once per
    use to the same bytes under the same name: the duplicates are dropped, and the weights
    store keeps the bytes once across graphs either way (it is keyed by content)."""
    from onnx.external_data_helper import load_external_data_for_model
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    bits = check_weights(weights)
    check_block_size(block_size)
    load_external_data_for_model(model, str(src_dir))
    before = sum(n.op_type == "MatMul" for n in model.graph.node)
    # the quantizer logs every node at INFO (it configures the root logger on import)
    quiet = logging.getLogger().level
    logging.getLogger().setLevel(logging.ERROR)
    try:
        quantizer = MatMulNBitsQuantizer(model, bits=bits, block_size=block_size,
                                         is_symmetric=False, op_types_to_quantize=("MatMul",),
                                         accuracy_level=ACCURACY_LEVEL[weights])
        quantizer.process()
    finally:
        logging.getLogger().setLevel(quiet)
    out = quantizer.model.model
    if out is not model:
        model.CopyFrom(out)
    seen: set[str] = set()
    kept = []
    for t in model.graph.initializer:
        if t.name not in seen:
            seen.add(t.name)
            kept.append(t)
    if len(kept) != len(model.graph.initializer):
        del model.graph.initializer[:]
        model.graph.initializer.extend(kept)
    return before - sum(n.op_type == "MatMul" for n in model.graph.node)


def matmul_nbits_nodes(path: str | Path) -> list[dict]:
    """The MatMulNBits nodes of the graph at ``path``: name, bits, block_size, K, N,
    accuracy_level."""
    import onnx

    out = []
    for n in onnx.load(str(path), load_external_data=False).graph.node:
        if n.op_type == "MatMulNBits":
            attrs = {a.name: a.i for a in n.attribute}
            out.append({"name": n.name, **{k: attrs.get(k) for k in ("bits", "block_size", "K",
                                                                        "N", "accuracy_level")}})
    return out


def weight_bytes(rows: int, cols: int, weights: str, block_size: int) -> int:
    """Bytes a [rows, cols] fp32 MatMul weight takes compressed: packed integers, an fp32
    scale and a packed zero point per block (what a decode step streams for it)."""
    bits = check_weights(weights)
    blocks = -(-rows // check_block_size(block_size))
    packed = cols * blocks * block_size * bits // 8
    zero_points = cols * -(-blocks * bits // 8)
    return packed + cols * blocks * np.dtype(np.float32).itemsize + zero_points
