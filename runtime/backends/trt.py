"""TensorRT backend: the engine interface of ``Transformer`` over plans (``paradraft build
--backend tensorrt``).

``TrtModel`` has ``.config``, ``.dtype``, ``.device`` and ``__call__`` with the signature and
semantics of ``Transformer.forward`` (and ``verify_and_correct`` as ``OrtModel`` has it),
reading and writing the same ``KVCache``, here of torch CUDA tensors: every tensor is a
device buffer bound by address (``set_tensor_address``; shapes by ``set_input_shape``), the
plans run with ``execute_async_v3`` on the current torch CUDA stream, and the only cache
writes are this step's K/V at (rows, input_pos) — the index_put ``Transformer.forward`` does,
in place, on the same stream. The graphs are the ONNX ones, so their I/O (and the cache) are
fp32 whatever precision the plans compute in.

The name / shape bookkeeping (inputs, outputs, write-back, profile choice) is plain torch and
Python, tested on the CPU with ONNX Runtime standing in for TensorRT. The TensorRT calls
themselves (``Plan``) are unverified here: no GPU and no TensorRT on the development machine.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch
from torch import Tensor

from ..correction import Randoms, RuleParams
from ..model import KVCache, ModelConfig
from .engine_io import correction_inputs, rule_key, step_inputs, write_back
from .trt_plans import Limits, import_tensorrt, register_plugin, rule_plan

ALIGNMENT = 256  # TensorRT wants every device address 256-byte aligned
# TensorRT DataType names → torch dtypes (the I/O types a plan may declare)
TORCH_DTYPES = {"FLOAT": torch.float32, "HALF": torch.float16, "BF16": torch.bfloat16,
                "INT32": torch.int32, "INT64": torch.int64, "INT8": torch.int8,
                "UINT8": torch.uint8, "BOOL": torch.bool}


class Runner(Protocol):
    """What runs one graph: a TensorRT ``Plan`` here, ONNX Runtime's ``Graph`` in tests."""

    def run(self, inputs: dict[str, Tensor], outputs: dict[str, Tensor]) -> None: ...


# -- bookkeeping (plain Python / torch, any device) ----------------------------------------


def misfit(profile: dict, shapes: dict[str, tuple[int, ...]], values: dict[str, int]
           ) -> str | None:
    """Why these input shapes (and shape-tensor values) fall outside ``profile``, or None."""
    for name, shape in shapes.items():
        low, _, high = profile["shapes"].get(name, (None, None, None))
        if low is None:
            continue
        if len(shape) != len(low) or any(not lo <= d <= hi
                                         for d, lo, hi in zip(shape, low, high, strict=True)):
            return f"{name} shape {list(shape)} is outside [{low}, {high}]"
    for name, value in values.items():
        if name in profile["values"]:
            (lo,), _, (hi,) = profile["values"][name]
            if not lo <= value <= hi:
                return f"{name} = {value} is outside [{lo}, {hi}]"
    return None


def choose_profile(profiles: list[dict], shapes: dict[str, tuple[int, ...]],
                   values: dict[str, int], plan: str = "plan") -> int:
    """The first optimisation profile these shapes fit (decode before prefill)."""
    reasons = []
    for i, p in enumerate(profiles):
        why = misfit(p, shapes, values)
        if why is None:
            return i
        reasons.append(f"{p['name']}: {why}")
    raise ValueError(f"{plan}: no optimisation profile fits this call ({'; '.join(reasons)}); "
                     "rebuild with larger --max-batch-size / --max-k / --max-seq-len")


def check_limits(manifest: dict, slots: int, seq_len: int, k: int) -> None:
    """Refuse a decoder the plans' profiles cannot serve (they are hard limits)."""
    limits = manifest["limits"]
    for label, key, value, flag in [("KV-cache slots (batch)", "max_batch_size", slots,
                                     "--max-batch-size"),
                                    ("max_seq_len", "max_seq_len", seq_len, "--max-seq-len"),
                                    ("k", "max_k", k, "--max-k")]:
        if value > limits[key]:
            raise ValueError(f"{label} must be <= {limits[key]}, the {key} the TensorRT plans "
                             f"were built for (rebuild with {flag} {value}); got {value}")


def new_kv_outputs(config: ModelConfig, B: int, T: int, n: int, device: torch.device
                   ) -> dict[str, Tensor]:
    """``new_k_<i>`` / ``new_v_<i>`` [B, T, kv_heads, head_dim]: one allocation each (views
    into one buffer would break TensorRT's 256-byte alignment)."""
    shape = (B, T, config.n_kv_heads, config.head_dim)
    return {f"new_{kv}_{i}": torch.empty(shape, device=device)
            for i in range(n) for kv in ("k", "v")}


def prepare(t: Tensor, dtype: torch.dtype, host: bool, device: torch.device) -> Tensor:
    """``t`` as TensorRT reads it: the plan's dtype, contiguous, in host memory for shape
    tensors and on the device otherwise, device addresses 256-byte aligned (copies only when
    it must: the cache is bound as it is)."""
    t = t.to("cpu" if host else device, dtype).contiguous()
    if not host and t.numel() and t.data_ptr() % ALIGNMENT:
        t = t.clone()  # a fresh block from the caching allocator is aligned
    return t


# -- TensorRT (unverified here) ---------------------------------------------------------


class Plan:
    """One deserialized TensorRT engine and one execution context per optimisation profile
    (created on first use), run with execute_async_v3 on the current torch CUDA stream.
    A Plan serves one thread, as ``OrtModel``'s graphs do."""

    def __init__(self, trt, data: bytes, profiles: list[dict], name: str,
                 device: torch.device):
        self.trt, self.profiles, self.name, self.device = trt, profiles, name, device
        self.runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.engine = self.runtime.deserialize_cuda_engine(data)
        if self.engine is None:
            raise RuntimeError(f"{name}: TensorRT could not load this plan (built by another "
                               "TensorRT version or for another GPU? rebuild it)")
        e = self.engine
        names = [e.get_tensor_name(i) for i in range(e.num_io_tensors)]
        self.inputs = [n for n in names if e.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in names if n not in self.inputs]
        self.host = {n for n in self.inputs if e.get_tensor_location(n) == trt.TensorLocation.HOST}
        self.dtypes = {n: TORCH_DTYPES[e.get_tensor_dtype(n).name] for n in names}
        self.contexts: dict[int, object] = {}
        # bound for empty tensors (draft_probs [B, 0, 0], …): TensorRT wants a real address
        self.scratch = torch.empty(ALIGNMENT, dtype=torch.uint8, device=device)

    def context(self, index: int, stream: int):
        if index not in self.contexts:
            ctx = self.engine.create_execution_context()
            ctx.set_optimization_profile_async(index, stream)
            self.contexts[index] = ctx
        return self.contexts[index]

    def address(self, t: Tensor) -> int:
        return t.data_ptr() if t.numel() else self.scratch.data_ptr()

    def run(self, inputs: dict[str, Tensor], outputs: dict[str, Tensor]) -> None:
        missing = sorted(set(self.inputs) - set(inputs)) + sorted(set(self.outputs) - set(outputs))
        if missing:
            raise ValueError(f"{self.name}: no tensor for {', '.join(missing)}")
        bound = {n: prepare(inputs[n], self.dtypes[n], n in self.host, self.device)
                 for n in self.inputs}  # kept alive until the plan is queued
        values = {n: int(bound[n]) for n in self.host if bound[n].numel() == 1}
        index = choose_profile(self.profiles, {n: tuple(t.shape) for n, t in bound.items()},
                               values, self.name)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        ctx = self.context(index, stream)
        for n, t in bound.items():
            if t.dim() and not ctx.set_input_shape(n, tuple(t.shape)):
                raise ValueError(f"{self.name}: TensorRT refused {n} shape {list(t.shape)}")
            ctx.set_tensor_address(n, self.address(t))
        for n in self.outputs:
            t = outputs[n]
            # host-side checks of the bookkeeping against the plan (no device sync)
            if t.dtype != self.dtypes[n] or tuple(ctx.get_tensor_shape(n)) != tuple(t.shape):
                raise ValueError(f"{self.name}: output {n} is {t.dtype} {list(t.shape)}; the "
                                 f"plan gives {self.dtypes[n]} {list(ctx.get_tensor_shape(n))}")
            if t.numel() and t.data_ptr() % ALIGNMENT:
                raise ValueError(f"{self.name}: output {n} is not {ALIGNMENT}-byte aligned")
            ctx.set_tensor_address(n, self.address(t))
        if not ctx.execute_async_v3(stream):
            raise RuntimeError(f"{self.name}: execute_async_v3 failed (see the TensorRT log)")


class TrtModel:
    """Plans (their runners by layer count) behind the Transformer interface.

    graphs: {None: full step graph, N: first-N-layers graph} → a loader of its runner;
    correction: RuleParams → a runner of the verifier + CausalCorrection graph with those
    rule fields (a plan's plugin fields are fixed). Runners are loaded on first use.
    prebuilt: the rule fields of the correction plan on disk; a runner for others is a
    TensorRT build, which the decoder does not start in the middle of a round (``fused_reason``;
    ``prepare_correction`` builds one ahead). None: every parameter set loads cheaply (the
    tests' ONNX Runtime stand-ins).
    """

    # not measured on a GPU yet: SpeculativeDecoder(fused_correction="auto") stays unfused
    fused_by_default = False

    def __init__(self, config: ModelConfig, graphs: dict[int | None, Callable[[], Runner]],
                 correction: Callable[[RuleParams], Runner] | None = None,
                 device: torch.device | str = "cuda", prebuilt: RuleParams | None = None):
        self.config = config
        self.dtype = torch.float32  # the graphs' I/O, and so the KV cache
        self.device = torch.device(device)
        self.graphs = dict(graphs)
        self.correction = correction
        self.prebuilt = None if prebuilt is None else rule_key(prebuilt)
        self._runners: dict[int | None, Runner] = {}
        self._corrections: dict[RuleParams, Runner] = {}

    @property
    def has_correction(self) -> bool:
        """Whether this engine can verify and correct in one call (``verify_and_correct``)."""
        return self.correction is not None

    def fused_reason(self, params: RuleParams) -> str | None:
        """Why ``verify_and_correct`` cannot run ``params`` now (None: it can). Host-side
        bookkeeping only: the decoder asks every round."""
        if self.correction is None:
            return "no correction plan: this engine was built without one"
        key = rule_key(params)
        if self.prebuilt is not None and key != self.prebuilt and key not in self._corrections:
            return (f"rule parameters: the correction plan was built for rule "
                    f"{self.prebuilt.rule!r} with other fields; these need a TensorRT build "
                    "(TrtModel.prepare_correction)")
        return None

    def prepare_correction(self, params: RuleParams) -> None:
        """Load (or build, for rule fields other than the plan's) the correction runner for
        ``params`` now, so that rounds with them can run fused."""
        if self.correction is None:
            raise ValueError("this engine has no correction plan (only the verifier has one)")
        key = rule_key(params)
        if key not in self._corrections:
            self._corrections[key] = self.correction(key)

    def _graph(self, num_layers: int | None) -> Runner:
        if num_layers not in self._runners:
            if num_layers not in self.graphs:
                built = sorted(n for n in self.graphs if n is not None)
                raise ValueError(f"num_layers={num_layers}: no plan for it in this engine "
                                 f"(self-draft plans built for num_layers in {built}; "
                                 "rebuild with --self-draft-layers)")
            self._runners[num_layers] = self.graphs[num_layers]()
        return self._runners[num_layers]

    def __call__(
        self,
        tokens: Tensor,
        input_pos: Tensor,
        cache: KVCache,
        kv_len: int | None = None,
        rows: Tensor | None = None,
        output_index: Tensor | None = None,
        num_layers: int | None = None,
        audit: bool = False,
    ) -> tuple[Tensor, None]:
        """As ``Transformer.forward``: returns (logits [B, T or T', V] fp32, None)."""
        if audit:
            raise ValueError("audit=True (the attention causal audit, --audit-epsilon) is not "
                             "supported on the TensorRT backend; use the torch backend")
        c = self.config
        n = c.n_layers if num_layers is None else min(num_layers, c.n_layers)
        runner = self._graph(None if n == c.n_layers else n)
        inputs = step_inputs(tokens, input_pos, cache, kv_len, rows, output_index, n)
        B, T = tokens.shape
        logits = torch.empty(B, inputs["output_index"].shape[1], c.vocab_size,
                             device=tokens.device)
        new_kv = new_kv_outputs(c, B, T, n, tokens.device)
        runner.run(inputs, {"logits": logits, **new_kv})
        write_back(cache, new_kv, inputs["rows"], inputs["input_pos"])
        return logits, None

    def verify_and_correct(
        self,
        tokens: Tensor,
        input_pos: Tensor,
        cache: KVCache,
        params: RuleParams,
        randoms: Randoms | None,
        draft_probs: Tensor | None = None,
        num_drafted: Tensor | None = None,
        kv_len: int | None = None,
        rows: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """One verify pass over [newest, d_1 … d_K] that returns only (num_accepted [B],
        next_token [B], accepted_tokens [B, K+1]) — the logits stay on the GPU."""
        self.prepare_correction(params)
        c = self.config
        inputs = step_inputs(tokens, input_pos, cache, kv_len, rows, None, c.n_layers)
        B, T = tokens.shape
        dev = tokens.device
        inputs.update(correction_inputs(B, randoms, draft_probs, num_drafted, dev))
        num_accepted = torch.empty(B, dtype=torch.long, device=dev)
        next_token = torch.empty(B, dtype=torch.long, device=dev)
        accepted = torch.empty(B, T, dtype=torch.long, device=dev)
        new_kv = new_kv_outputs(c, B, T, c.n_layers, dev)
        outputs = {"num_accepted": num_accepted, "next_token": next_token,
                   "accepted_tokens": accepted, **new_kv}
        self._corrections[rule_key(params)].run(inputs, outputs)
        write_back(cache, new_kv, inputs["rows"], inputs["input_pos"])
        return num_accepted, next_token, accepted


def cuda_device() -> torch.device:
    if not torch.cuda.is_available():
        raise RuntimeError("the tensorrt backend runs on an NVIDIA GPU through torch CUDA "
                           "tensors; torch.cuda.is_available() is False here (no GPU, or a "
                           "CPU-only torch build)")
    return torch.device("cuda", torch.cuda.current_device())


def load_trt_model(engine_dir: str | Path, manifest: dict, name: str) -> TrtModel:
    """The TrtModel of manifest model ``name`` (plans deserialized on first use)."""
    trt = import_tensorrt()
    device = cuda_device()
    engine_dir = Path(engine_dir)
    m = manifest["models"][name]

    def loader(graph: dict) -> Callable[[], Runner]:
        return lambda: Plan(trt, (engine_dir / graph["plan"]).read_bytes(), graph["profiles"],
                            graph["plan"], device)

    graphs = {None: loader(m["graphs"]["logits"])}
    if "self_draft" in m["graphs"]:
        g = m["graphs"]["self_draft"]
        graphs[g["num_layers"]] = loader(g)
    correction = built = None
    if "correction" in m["graphs"]:
        g = m["graphs"]["correction"]
        built = rule_key(RuleParams(**manifest["rule_defaults"]))
        info = manifest["tensorrt"]
        cache = engine_dir / info["timing_cache"] if info.get("timing_cache") else None

        def correction(params: RuleParams) -> Runner:  # params: a rule_key
            register_plugin()  # CausalCorrection's creator must exist to deserialize the plan
            if params == built:
                data, profiles = (engine_dir / g["plan"]).read_bytes(), g["profiles"]
            else:  # other rule fields: a plan of their own, built in memory on first use
                data, profiles = rule_plan(
                    trt, engine_dir / g["file"], params, Limits(**manifest["limits"]),
                    m["config"], info["precision"],
                    cache.read_bytes() if cache is not None and cache.is_file() else b"")
            return Plan(trt, data, profiles, f"{g['plan']} ({params.rule})", device)

    return TrtModel(ModelConfig(**m["config"]), graphs, correction, device, prebuilt=built)
