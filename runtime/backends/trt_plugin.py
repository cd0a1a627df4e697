"""CausalCorrection as a TensorRT plugin, through ``tensorrt.plugin`` (TensorRT >= 10.9).

UNVERIFIED ON A GPU: no TensorRT and no GPU on the development machines. The code follows the
tensorrt.plugin API of TensorRT 10.9+ (its samples/python/quickly_deployable_plugins and the
API's own validation rules). What runs without TensorRT is kept in plain functions and tested
in tests/test_kernel.py: output shapes, plugin fields → RuleParams, the empty-input
convention, the accepted block, the AOT kernel's argument layout, and the AOT kernel's
compilation to PTX for sm_90 by triton. The registered functions' schemas were also run once
through tensorrt.plugin's own validation code (its _validate.py, with stand-in types).

The plugin is the one the ONNX node written by build/onnx.py names: op type CausalCorrection,
plugin_namespace "paradraft", plugin_version "1" (the version every tensorrt.plugin plugin
gets); inputs, outputs and attributes in the node's order and names. TensorRT's ONNX parser
hands attributes over as fields: floats as float32 (``params_from_attributes`` recovers the
decimals the builder wrote), ints as int32 and strings with their C terminator.

Two implementations, one registered per process (``register_plugin(jit=...)``): with both,
TensorRT needs ``NetworkDefinitionCreationFlag.PREFER_AOT_PYTHON_PLUGINS`` (or ``PREFER_JIT``)
or a bool ``aot`` attribute on the ONNX node, and neither build/tensorrt.py nor build/onnx.py
sets one.

- ``aot_impl`` (default): ``correction_kernel._row_kernel`` (a whole row in one launch, as a
  plugin's single kernel must) compiled to PTX by ``triton.compile`` at build time with the
  rule's attributes baked in as constants; the plan then runs without Python.
- ``impl`` (JIT): Python at run time: torch views of TensorRT's buffers, ``correct_fused``
  (the Triton kernels) on TensorRT's stream, then the accepted block.
"""

# no ``from __future__ import annotations``: tensorrt.plugin checks the annotations of the
# functions it registers as objects (TensorDesc subclasses, tuple[...]), not strings
import torch
from torch import Tensor

from ..correction import Randoms, RuleParams
from .engine_io import (
    DOMAIN,
    FLOAT_PARAMS,
    OP_TYPE,
    accepted_block,
    params_from_attributes,
)
from .kernels import compile_row_kernel, correct_fused, row_kernel_scalars

PLUGIN_ID = f"{DOMAIN}::{OP_TYPE}"  # "paradraft::CausalCorrection"
INPUTS = ("logits", "draft_tokens", "draft_probs", "accept_uniforms", "sample_noise",
          "num_drafted")
OUTPUTS = ("num_accepted", "next_token", "accepted_tokens")
ATTRIBUTES = ("rule", "top_p_membership", *FLOAT_PARAMS)
MIN_TENSORRT = (10, 9)
_TRITON_TYPES = {"FLOAT": "fp32", "HALF": "fp16", "BF16": "bf16"}  # trt.DataType names
_registered: str | None = None  # the implementation registered: "aot" or "jit"


def output_shapes(logits_shape, draft_tokens_shape) -> tuple[tuple, tuple, tuple]:
    """(num_accepted [B], next_token [B], accepted_tokens [B, K+1]) from the input shapes:
    ints here, TensorRT shape expressions inside the plugin."""
    batch, k = logits_shape[0], draft_tokens_shape[1]
    return (batch,), (batch,), (batch, k + 1)


def rule_params(rule: str, top_p_membership: int, **floats: float) -> RuleParams:
    """The plugin's attributes as RuleParams (raises ValueError for invalid ones)."""
    return params_from_attributes({"rule": rule.rstrip("\0"),
                                   "top_p_membership": top_p_membership, **floats})


def optional_inputs(draft_probs: Tensor, accept_uniforms: Tensor, sample_noise: Tensor,
                    num_drafted: Tensor) -> tuple[Tensor | None, Randoms | None, Tensor | None]:
    """Empty tensors stand for ``correct()``'s None, as in the ONNX Runtime op."""
    probs = draft_probs if draft_probs.numel() else None
    randoms = None
    if accept_uniforms.numel() or sample_noise.numel():
        randoms = Randoms(accept_uniforms, sample_noise)
    return probs, randoms, num_drafted if num_drafted.numel() else None


def triton_type(trt_dtype_name: str) -> str:
    """The Triton pointer element type for the logits' TensorRT data type."""
    if trt_dtype_name not in _TRITON_TYPES:
        raise ValueError(f"{PLUGIN_ID}: logits must be FLOAT, HALF or BF16; got {trt_dtype_name}")
    return _TRITON_TYPES[trt_dtype_name]


def check_aot_kernel(metadata) -> None:
    """TensorRT launches an AOT kernel with exactly its inputs, extra scalars and outputs.
    Triton 3.x kernels end in two hidden pointer parameters (global and profile scratch)
    that TensorRT does not pass: harmless only while the kernel never uses them (size 0)."""
    for name in ("global_scratch_size", "profile_scratch_size"):
        if getattr(metadata, name, 0):
            raise ValueError(f"{PLUGIN_ID}: the compiled kernel needs {name} = "
                             f"{getattr(metadata, name)}, which a TensorRT AOT plugin can't pass")


def _tensorrt():
    message = (f"the {OP_TYPE} TensorRT plugin needs tensorrt>=10.9 (the tensorrt.plugin "
               "API; pip install 'tensorrt>=10.9')")
    try:
        import tensorrt as trt
        import tensorrt.plugin as trtp
    except ImportError as e:
        raise ImportError(message) from e
    version = tuple(int(p) for p in trt.__version__.split(".")[:2])
    if version < MIN_TENSORRT:
        raise ImportError(f"{message}; found tensorrt {trt.__version__}")
    return trt, trtp


def register_plugin(jit: bool = False) -> str:
    """Register paradraft::CausalCorrection with TensorRT (once per process) and return that
    name; call it before parsing the ONNX graph or deserialising a plan. One implementation
    is registered: a plugin with both needs a PREFER_*_PYTHON_PLUGINS network flag, which
    build/tensorrt.py does not set. AOT by default (the plan then runs without Python:
    trtexec, Triton's TensorRT backend); ``jit=True`` for the torch + Triton impl."""
    global _registered
    trt, trtp = _tensorrt()
    kind = "jit" if jit else "aot"
    if _registered is None:
        define_plugin(trt, trtp, jit)
        _registered = kind
    elif _registered != kind:
        raise ValueError(f"{PLUGIN_ID} is already registered with its {_registered} "
                         f"implementation in this process; asked for {kind}")
    return PLUGIN_ID


def define_plugin(trt, trtp, jit: bool = False) -> None:
    """The tensorrt.plugin definitions: the shapes, then the JIT or the AOT implementation.
    tensorrt.plugin checks their parameters: the inputs, then the attributes in registration
    order, then outputs and stream (impl) or tactic (aot_impl)."""

    @trtp.register(PLUGIN_ID)
    def causal_correction(
        logits: trtp.TensorDesc, draft_tokens: trtp.TensorDesc, draft_probs: trtp.TensorDesc,
        accept_uniforms: trtp.TensorDesc, sample_noise: trtp.TensorDesc,
        num_drafted: trtp.TensorDesc, rule: str, top_p_membership: int, temperature: float,
        top_p: float, tau: float, gamma: float, alpha: float, epsilon: float, delta: float,
    ) -> tuple[trtp.TensorDesc, trtp.TensorDesc, trtp.TensorDesc]:
        shapes = output_shapes(logits.shape_expr, draft_tokens.shape_expr)
        return tuple(trtp.from_shape_expr(s, dtype=trt.int64) for s in shapes)

    (_define_jit if jit else _define_aot)(trtp)


def _define_jit(trtp) -> None:
    @trtp.impl(PLUGIN_ID)
    def causal_correction_impl(
        logits: trtp.Tensor, draft_tokens: trtp.Tensor, draft_probs: trtp.Tensor,
        accept_uniforms: trtp.Tensor, sample_noise: trtp.Tensor, num_drafted: trtp.Tensor,
        rule: str, top_p_membership: int, temperature: float, top_p: float, tau: float,
        gamma: float, alpha: float, epsilon: float, delta: float,
        outputs: tuple[trtp.Tensor, trtp.Tensor, trtp.Tensor], stream: int,
    ) -> None:
        params = rule_params(rule, top_p_membership, temperature=temperature, top_p=top_p,
                             tau=tau, gamma=gamma, alpha=alpha, epsilon=epsilon, delta=delta)
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            views = [torch.as_tensor(t, device="cuda") for t in
                     (logits, draft_tokens, draft_probs, accept_uniforms, sample_noise,
                      num_drafted)]
            probs, randoms, drafted = optional_inputs(*views[2:])
            num_accepted, next_token = correct_fused(views[0], views[1], probs, params,
                                                     randoms, drafted)
            block = accepted_block(views[1], num_accepted, next_token)
            for out, value in zip(outputs, (num_accepted, next_token, block), strict=True):
                torch.as_tensor(out, device="cuda").copy_(value)


def _define_aot(trtp) -> None:
    @trtp.aot_impl(PLUGIN_ID)
    def causal_correction_aot(
        logits: trtp.TensorDesc, draft_tokens: trtp.TensorDesc, draft_probs: trtp.TensorDesc,
        accept_uniforms: trtp.TensorDesc, sample_noise: trtp.TensorDesc,
        num_drafted: trtp.TensorDesc, rule: str, top_p_membership: int, temperature: float,
        top_p: float, tau: float, gamma: float, alpha: float, epsilon: float, delta: float,
        outputs: tuple[trtp.TensorDesc, trtp.TensorDesc, trtp.TensorDesc], tactic: int,
    ) -> tuple[str | bytes, str | bytes, trtp.KernelLaunchParams, trtp.SymIntExprs]:
        params = rule_params(rule, top_p_membership, temperature=temperature, top_p=top_p,
                             tau=tau, gamma=gamma, alpha=alpha, epsilon=epsilon, delta=delta)
        kernel = compile_row_kernel(params, triton_type(logits.dtype.name))
        check_aot_kernel(kernel.metadata)
        launch = trtp.KernelLaunchParams()
        launch.grid_x = logits.shape_expr[0]  # one program per row
        launch.block_x = kernel.metadata.num_warps * 32
        launch.shared_mem = kernel.metadata.shared
        # the kernel's int32 arguments, between the input and the output pointers
        scalars = row_kernel_scalars(logits.shape_expr, draft_tokens.shape_expr,
                                     draft_probs.shape_expr, sample_noise.shape_expr,
                                     num_drafted.shape_expr)
        extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(e) for e in scalars])
        return kernel.metadata.name, kernel.asm["ptx"], launch, extra
