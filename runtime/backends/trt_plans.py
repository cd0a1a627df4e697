"""TensorRT plans: version checks, optimisation profiles, and the plan builder.

``paradraft build --backend tensorrt`` builds every plan with these; the runtime builds a
correction plan on first use when a request asks for rule parameters other than the ones the
engine dir was built with (a plugin's fields are fixed inside a plan). Profiles are plain
Python, tested here; the calls into TensorRT run only on a GPU machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from . import trt_plugin
from .engine_io import set_rule

REQUIREMENT = "tensorrt>=10.9"
MIN_VERSION = (10, 9)
PRECISIONS = ("fp32", "fp16", "bf16")
PREFILL_OPT = 128  # prompt length TensorRT tunes the prefill profile's tactics for
# decode: verify, drafts and the correction graph (a few tokens); prefill: whole prompts
ROLE_PROFILES = {"logits": ("decode", "prefill"), "self_draft": ("decode",),
                 "correction": ("decode",)}
SHAPE_TENSORS = ("kv_len",)  # the only input whose value shapes the graph (Range(kv_len))


class TensorRTUnavailable(RuntimeError):
    """TensorRT, or the NVIDIA GPU it needs, is missing (the message says what to install)."""


def parse_version(text: str) -> tuple[int, ...]:
    """(10, 9, 0, 34) for "10.9.0.34"; a pre-release tag ends it ("10.13.0rc1" → 10, 13, 0)."""
    parts = []
    for p in text.split("."):
        digits = len(p) - len(p.lstrip("0123456789"))
        if not digits:
            break
        parts.append(int(p[:digits]))
        if digits < len(p):
            break
    return tuple(parts)


def import_tensorrt():
    """``import tensorrt``, or a clear error naming the package and the GPU it needs."""
    try:
        import tensorrt as trt
    except ImportError as e:
        raise TensorRTUnavailable(
            f"the tensorrt backend needs the TensorRT Python package ({REQUIREMENT}) and an "
            f"NVIDIA GPU with its CUDA driver: `pip install '{REQUIREMENT}'` on a GPU machine "
            f"(import failed: {e})") from e
    version = getattr(trt, "__version__", "0")
    if parse_version(version) < MIN_VERSION:
        raise TensorRTUnavailable(f"the tensorrt backend needs {REQUIREMENT}; found {version}")
    return trt


def precision_flag(precision: str, version: str) -> str | None:
    """The BuilderFlag for ``precision`` (None: fp32 math), refused where it no longer exists.

    TensorRT 10 builds the exported fp32 graph with fp16 / bf16 kernels allowed (weak
    typing, deprecated since 10.12). TensorRT 11 removed those flags: networks are strongly
    typed, so half precision needs a half-precision ONNX graph, which this project does not
    export yet."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}; got {precision!r}")
    if precision == "fp32":
        return None
    if parse_version(version)[:1] >= (11,):
        raise ValueError(f"precision {precision} needs TensorRT 10 (BuilderFlag."
                         f"{precision.upper()}); TensorRT {version} builds strongly typed "
                         "networks only and the exported graphs are fp32: use --precision fp32")
    return precision.upper()


# -- optimisation profiles (plain Python) -----------------------------------------------


@dataclass(frozen=True)
class Limits:
    """The engine dir's limits (manifest ``limits``), as the decoder uses them."""

    max_batch_size: int
    max_k: int
    max_seq_len: int

    @property
    def cache_len(self) -> int:
        # SpeculativeDecoder allocates max_seq_len + 2K + 2 positions per slot (its margin
        # for a round's draft and verify writes past the length), and kv_len stays below it
        return self.max_seq_len + 2 * self.max_k + 2


@dataclass(frozen=True)
class Range:
    """One dynamic dimension (or shape-tensor value): min / opt / max of a profile."""

    min: int
    opt: int
    max: int

    def __post_init__(self) -> None:
        if not 0 <= self.min <= self.opt <= self.max:
            raise ValueError(f"need 0 <= min <= opt <= max; got {self}")


def dim_ranges(kind: str, limits: Limits, vocab: int) -> dict[str, Range]:
    """The ranges of the graphs' named dims (``export_step`` / ``add_correction`` axes)."""
    B, K, L = limits.max_batch_size, limits.max_k, limits.cache_len
    if kind == "decode":
        # verify: [newest, d_1 … d_K]; parallel draft: K_max real tokens + K − 1 masks;
        # autoregressive drafts: 1–2 tokens. Tuned for the verify pass (K + 1).
        tokens = outputs = Range(1, K + 1, 2 * K)
    elif kind == "prefill":
        # right-padded prompts; logits at each prompt's last position only
        tokens = Range(1, min(PREFILL_OPT, limits.max_seq_len), limits.max_seq_len)
        outputs = Range(1, 1, limits.max_seq_len)
    else:
        raise ValueError(f"profile kind must be decode or prefill; got {kind!r}")
    return {
        "batch": Range(1, B, B),
        "tokens": tokens,
        "outputs": outputs,
        "slots": Range(1, B, B),  # the decoder's cache has one slot per batch row
        "cache_len": Range(1, L, L),
        # correction inputs travel empty (0) when absent: greedy draws no randoms, a
        # greedy draft has no probabilities, all rows drafting K need no num_drafted
        "draft_k": Range(0, K, K),
        "draft_vocab": Range(0, vocab, vocab),
        "drafted_batch": Range(0, B, B),
    }


def input_dims(name: str, n_kv_heads: int, head_dim: int) -> tuple[str | int, ...]:
    """Named (dynamic) or fixed dims of one graph input."""
    named: dict[str, tuple[str, ...]] = {
        "tokens": ("batch", "tokens"), "input_pos": ("batch", "tokens"), "rows": ("batch",),
        "output_index": ("batch", "outputs"), "kv_len": (),
        "draft_probs": ("batch", "draft_k", "draft_vocab"),
        "accept_uniforms": ("batch", "draft_k"), "sample_noise": ("batch", "draft_vocab"),
        "num_drafted": ("drafted_batch",),
    }
    if name in named:
        return named[name]
    if name.startswith(("past_k_", "past_v_")):
        return ("slots", "cache_len", n_kv_heads, head_dim)
    raise ValueError(f"unexpected graph input {name!r} (not one paradraft.build.onnx exports)")


def make_profile(kind: str, names: list[str], limits: Limits, config: dict,
                 shape_inputs: set[str] | frozenset[str] = frozenset()) -> dict:
    """One optimisation profile as JSON-able data: {"name", "shapes": {input: [min, opt,
    max] shapes}, "values": {shape-tensor input: [min, opt, max] values}}."""
    ranges = dim_ranges(kind, limits, config["vocab_size"])
    shapes = {}
    for name in names:
        dims = input_dims(name, config["n_kv_heads"], config["head_dim"])
        shapes[name] = [[d if isinstance(d, int) else getattr(ranges[d], which) for d in dims]
                        for which in ("min", "opt", "max")]
    values = {}
    for name in sorted(shape_inputs):
        if name not in SHAPE_TENSORS:
            raise ValueError(f"TensorRT treats graph input {name!r} as a shape tensor; only "
                             f"{', '.join(SHAPE_TENSORS)} is expected to be one")
        r = Range(1, limits.cache_len, limits.cache_len)  # kv_len <= the cache length
        values[name] = [[r.min], [r.opt], [r.max]]
    return {"name": kind, "shapes": shapes, "values": values}


def register_plugin() -> None:
    """CausalCorrection's TensorRT plugin into the registry (before parsing or loading)."""
    trt_plugin.register_plugin()


def build_plan(trt, onnx_model: bytes, kinds: tuple[str, ...], limits: Limits, config: dict,
               precision: str, timing_cache: bytes = b"", plugin: bool = False,
               name: str = "graph", path: str | Path | None = None
               ) -> tuple[bytes, list[dict], bytes]:
    """Parse one ONNX graph and build its plan. Returns (plan, profiles, timing cache).
    ``path``: where the graph lives; its weights are external data next to it (the
    engine dir's shared ``<model>.weights``), which the parser resolves from that path."""
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # explicit batch: the only mode since TensorRT 10
    if plugin:
        register_plugin()
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(onnx_model, path=None if path is None else str(path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT could not parse {name}: {errors}")
    inputs = [network.get_input(i) for i in range(network.num_inputs)]
    names = [t.name for t in inputs]
    shape_inputs = {t.name for t in inputs if t.is_shape_tensor}
    profiles = [make_profile(kind, names, limits, config, shape_inputs) for kind in kinds]
    bc = builder.create_builder_config()
    for p in profiles:
        op = builder.create_optimization_profile()
        for n in names:
            if n in p["values"]:  # a shape tensor: its values, not its (static) shape
                op.set_shape_input(n, *p["values"][n])
            else:
                op.set_shape(n, *p["shapes"][n])
        bc.add_optimization_profile(op)
    flag = precision_flag(precision, trt.__version__)
    if flag is not None:
        bc.set_flag(getattr(trt.BuilderFlag, flag))
    elif hasattr(trt.BuilderFlag, "TF32"):
        # fp32 means fp32 math: greedy tokens then match the torch and onnx backends
        bc.clear_flag(trt.BuilderFlag.TF32)
    cache = bc.create_timing_cache(timing_cache)
    if not bc.set_timing_cache(cache, False):  # from another GPU or TensorRT: start afresh
        bc.set_timing_cache(bc.create_timing_cache(b""), False)
    plan = builder.build_serialized_network(network, bc)
    if plan is None:
        raise RuntimeError(f"TensorRT could not build {name} (its log above says why)")
    return bytes(plan), profiles, bytes(bc.get_timing_cache().serialize())


def rule_plan(trt, onnx_path: str | Path, params, limits: Limits, config: dict,
              precision: str, timing_cache: bytes = b"") -> tuple[bytes, list[dict]]:
    """A correction plan whose CausalCorrection fields are ``params`` (RuleParams): the
    plugin fields are fixed in a plan, so other rule parameters need a build of their own."""
    import onnx

    # the graph alone: its weights stay external, found by the parser from onnx_path
    model = onnx.load(str(onnx_path), load_external_data=False)
    set_rule(model, params)
    plan, profiles, _ = build_plan(trt, model.SerializeToString(), ROLE_PROFILES["correction"],
                                   limits, config, precision, timing_cache, plugin=True,
                                   name=f"{onnx_path} ({params.rule})", path=onnx_path)
    return plan, profiles
