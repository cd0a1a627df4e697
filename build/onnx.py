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
"""

from __future__ import annotations

import json
import math
import shutil
import warnings
from dataclasses import asdict
from pathlib import Path

import torch
from torch import Tensor, nn

from paradraft.runtime.correction import MAX_K, RuleParams
from paradraft.runtime.model import ModelConfig, Transformer, load_model
from paradraft.runtime.onnx_backend import DOMAIN, OP_TYPE, PLUGIN_VERSION, set_rule

from .manifest import package_versions, write_manifest

OPSET = 17
DRAFT_PRECISIONS = ("int8", "float32")
# int8 drafting graphs against the fp32 model: max abs logit difference in units of the
# logits' standard deviation. Measured on the demo drafts over random tokens: 0.09-0.16
# (top-1 agreement 0.94-0.96); a wrong export differs by whole standard deviations
INT8_TOL = 0.3
CORRECTION_INPUTS = ("draft_probs", "accept_uniforms", "sample_noise", "num_drafted")
CORRECTION_OUTPUTS = ("num_accepted", "next_token", "accepted_tokens")


def input_names(num_layers: int) -> list[str]:
    kv = [f"past_{kv}_{i}" for i in range(num_layers) for kv in ("k", "v")]
    return ["tokens", "input_pos", "rows", "output_index", "kv_len", *kv]


def new_kv_names(num_layers: int) -> list[str]:
    return [f"new_{kv}_{i}" for i in range(num_layers) for kv in ("k", "v")]


def attend(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, c: ModelConfig) -> Tensor:
    """Masked attention, GQA by grouping the query heads per KV head (no K/V repeat).

    q [B, T, H, D]; keys / values [B, L, Hkv, D]; mask [B, T, L] → y [B, H, T, D].
    Head counts come from the config so the trace keeps them as constants."""
    B, T, L = mask.shape
    Hkv, D = c.n_kv_heads, c.head_dim
    G = c.n_heads // Hkv  # query head h uses KV head h // G, as repeat_interleave / enable_gqa
    q = q.reshape(B, T, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * T, D)
    scores = (q @ keys.permute(0, 2, 3, 1)) * (1.0 / math.sqrt(D))  # [B, Hkv, G*T, L]
    scores = scores.reshape(B, Hkv, G, T, L).masked_fill(~mask[:, None, None], float("-inf"))
    weights = scores.softmax(-1).reshape(B, Hkv, G * T, L)
    y = weights @ values.permute(0, 2, 1, 3)  # [B, Hkv, G*T, D]
    return y.reshape(B, Hkv * G, T, D)


class OnnxStep(nn.Module):
    """``Transformer.forward`` with the KV cache as explicit inputs / outputs.

    Exactly the torch semantics (write this step's K/V at (row, position), then a query at p
    attends to cache positions <= p), formulated without mutating an input: gather each
    row's window [0, kv_len) of the past cache, scatter this step's K/V into that window
    (ScatterND; duplicate positions carry identical K/V, as in torch), attend over it, and
    return the new K/V so the caller writes them into its cache. Only the window is copied
    (what torch's ``k_cache[rows, :kv_len]`` gathers too), never the whole cache. Requires
    max(input_pos) < kv_len, which the runtime checks.
    """

    def __init__(self, model: Transformer, num_layers: int | None = None):
        super().__init__()
        self.model = model
        self.layers = model.layers[:num_layers]

    def forward(self, tokens: Tensor, input_pos: Tensor, rows: Tensor, output_index: Tensor,
                kv_len: Tensor, *past: Tensor) -> tuple[Tensor, ...]:
        m = self.model
        B = tokens.shape[0]
        x, rope = m.embed_at(tokens, input_pos)
        key_pos = torch.arange(kv_len)
        mask = key_pos[None, None, :] <= input_pos[:, :, None]  # [B, T, kv_len]
        cache_len = past[0].shape[1]
        window = rows[:, None] * cache_len + key_pos[None, :]  # flat (slot, pos) index
        writes = (torch.arange(B)[:, None] * kv_len + input_pos).reshape(-1)  # into window
        new_kv: list[Tensor] = []
        for i, layer in enumerate(self.layers):
            q, k, v = layer.project(x, rope)
            keys = self._window(past[2 * i], window, writes, k)
            values = self._window(past[2 * i + 1], window, writes, v)
            x = layer.finish(x, attend(q, keys, values, mask, m.config))
            new_kv += [k, v]
        x = x.gather(1, output_index[:, :, None].expand(-1, -1, x.shape[-1]))
        return (m.lm_head(m.norm(x)).float(), *new_kv)

    @staticmethod
    def _window(past: Tensor, window: Tensor, writes: Tensor, new: Tensor) -> Tensor:
        S, L, Hkv, D = past.shape
        B, W = window.shape
        win = past.reshape(S * L, Hkv, D)[window].reshape(B * W, Hkv, D)
        win = win.index_put((writes,), new.reshape(-1, Hkv, D))
        return win.reshape(B, W, Hkv, D)


def dummy_inputs(config: ModelConfig, num_layers: int) -> tuple[Tensor, ...]:
    """Small example inputs whose dims all differ, so no dynamic axis is traced as constant."""
    B, T, S, L, kv_len = 2, 3, 3, 9, 7
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (B, T), generator=g)
    input_pos = torch.tensor([[1, 2, 3], [4, 5, 6]])
    shape = (S, L, config.n_kv_heads, config.head_dim)
    past = [torch.randn(shape, generator=g) for _ in range(2 * num_layers)]
    return (tokens, input_pos, torch.tensor([2, 0]), torch.tensor([[0, 2], [1, 2]]),
            torch.tensor(kv_len), *past)


def export_step(model: Transformer, path: str | Path, num_layers: int | None = None) -> Path:
    """Export the step graph (all layers, or the first ``num_layers``) to ``path``."""
    path = Path(path)
    n = model.config.n_layers if num_layers is None else num_layers
    names = input_names(n)
    outputs = ["logits", *new_kv_names(n)]
    axes = {"tokens": {0: "batch", 1: "tokens"}, "input_pos": {0: "batch", 1: "tokens"},
            "rows": {0: "batch"}, "output_index": {0: "batch", 1: "outputs"},
            "logits": {0: "batch", 1: "outputs"}}
    for name in names[5:]:
        axes[name] = {0: "slots", 1: "cache_len"}
    for name in outputs[1:]:
        axes[name] = {0: "batch", 1: "tokens"}
    step = OnnxStep(model.float().eval(), num_layers)
    # the TorchScript exporter (dynamo=False): it traces this plain module as is, with no
    # extra dependency (the dynamo exporter needs onnxscript); its deprecation notice is noise
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(step, dummy_inputs(model.config, n), str(path), dynamo=False,
                          opset_version=OPSET, input_names=names, output_names=outputs,
                          dynamic_axes=axes, do_constant_folding=True)
    return path


def add_correction(logits_path: str | Path, out_path: str | Path, params: RuleParams) -> Path:
    """The correction variant: the step graph with CausalCorrection on its logits."""
    import onnx
    from onnx import TensorProto, helper

    model = onnx.load(str(logits_path))
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
    onnx.checker.check_model(model)
    onnx.save(model, str(out_path))
    return Path(out_path)


def quantize_draft(path: Path) -> None:
    """Int8 weights for a drafting graph, in place (ONNX Runtime's dynamic quantization:
    int8 MatMul weights, activations quantized per call; the embedding stays fp32).

    Why: a draft call at batch 1 is bound by reading its weights (the demo draft's 16 MB of
    fp32 do not stay in cache next to the verifier's 54 MB), and the self-draft's LM head is
    the verifier's. The draft only proposes tokens: the verifier's logits decide, so the
    lossless rules stay lossless (the exact rule uses the q the int8 draft sampled from);
    only acceptance can move. The verifier graphs stay fp32."""
    import logging

    from onnxruntime.quantization import QuantType, quantize_dynamic

    tmp = path.with_suffix(".int8.onnx")
    quiet = logging.getLogger().level
    logging.getLogger().setLevel(logging.ERROR)  # "consider pre-processing": not for us
    try:
        # per tensor: ORT's per-channel variant came out 2-4x further from fp32 on the demo
        quantize_dynamic(path, tmp, op_types_to_quantize=["MatMul"], per_channel=False,
                         weight_type=QuantType.QInt8)
    finally:
        logging.getLogger().setLevel(quiet)
    tmp.replace(path)


# -- build-time checks ------------------------------------------------------------------


def _tokenizer_vocab(model_dir: Path) -> dict | None:
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return None
    t = json.loads(path.read_text())
    return {"model.vocab": (t.get("model") or {}).get("vocab"),
            "added_tokens": [(a.get("id"), a.get("content")) for a in t.get("added_tokens", [])]}


def check_draft(verifier_dir: Path, verifier: ModelConfig, draft_dir: Path,
                draft: ModelConfig, name: str) -> None:
    """Refuse a draft that does not speak the verifier's vocabulary (naming what differs)."""
    if draft.vocab_size != verifier.vocab_size:
        raise ValueError(f"{name} {draft_dir}: vocab_size {draft.vocab_size} differs from the "
                         f"verifier's {verifier.vocab_size} ({verifier_dir})")
    ours, theirs = _tokenizer_vocab(verifier_dir), _tokenizer_vocab(draft_dir)
    if ours is not None and theirs is not None:
        for key in ours:
            if ours[key] != theirs[key]:
                raise ValueError(f"{name} {draft_dir}: tokenizer.json {key} differs from the "
                                 f"verifier's ({verifier_dir / 'tokenizer.json'})")


def check_graph(model: Transformer, path: Path, num_layers: int | None = None,
                tol: float = 1e-3, relative: bool = False) -> float:
    """Run the exported graph and the torch model on the same ragged step; return the max
    abs logit difference (raise above ``tol``, in units of the torch logits' standard
    deviation if ``relative``) — the build refuses a wrong export."""
    from paradraft.runtime.model import new_kv_cache
    from paradraft.runtime.onnx_backend import OrtModel

    c = model.config
    ort_model = OrtModel(c, {num_layers: path} if num_layers else {None: path})
    g = torch.Generator().manual_seed(0)
    # every dim distinct (batch 2, prompt 5, step 3, slots 4, cache 16) so a dim the export
    # wrongly froze or mixed up shows; rows are a slot subset out of order
    tokens = torch.randint(0, c.vocab_size, (2, 5), generator=g)
    caches = [new_kv_cache(c, 4, 16, torch.float32) for _ in range(2)]
    rows = torch.tensor([3, 1])
    pos = torch.arange(5).expand(2, -1)
    step_pos = torch.tensor([[5, 6, 7], [3, 4, 5]])  # row 1 rolled back: overwrites 3, 4
    step_tokens = tokens[:, :3]
    outs = []
    for m, cache in zip((model, ort_model), caches, strict=True):
        with torch.no_grad():
            m(tokens, pos, cache, kv_len=5, rows=rows, num_layers=num_layers)
            logits, _ = m(step_tokens, step_pos, cache, kv_len=9, rows=rows,
                          num_layers=num_layers)
        outs.append(logits)
    diff = float((outs[0] - outs[1]).abs().max())
    if relative:
        tol *= float(outs[0].std())
    if not diff <= tol:
        raise RuntimeError(f"{path}: ONNX logits differ from torch by {diff:g} (> {tol:g})")
    return diff


# -- the build ----------------------------------------------------------------------------


def export_drafting(model: Transformer, path: Path, precision: str,
                    num_layers: int | None = None) -> None:
    """Export a drafting graph, check it against torch, and quantize it if asked (then check
    it again, within ``INT8_TOL``)."""
    export_step(model, path, num_layers)
    check_graph(model, path, num_layers)
    if precision == "int8":
        quantize_draft(path)
        check_graph(model, path, num_layers, tol=INT8_TOL, relative=True)


def check_limits(max_batch_size: int, max_k: int, max_seq_len: int, config: ModelConfig
                 ) -> None:
    if not isinstance(max_batch_size, int) or max_batch_size < 1:
        raise ValueError(f"max_batch_size must be an integer >= 1; got {max_batch_size!r}")
    if not isinstance(max_k, int) or not 1 <= max_k <= MAX_K:
        raise ValueError(f"max_k must be an integer in [1, {MAX_K}]; got {max_k!r}")
    high = config.max_position_embeddings if config.is_gpt2 else 1 << 20
    if not isinstance(max_seq_len, int) or not 1 <= max_seq_len <= high:
        raise ValueError(f"max_seq_len must be an integer in [1, {high}]; got {max_seq_len!r}")


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
) -> dict:
    """Export the verifier (+ correction and self-draft variants) and the drafts to
    ``out_dir`` and write its manifest.json. Returns the manifest.
    ``draft_precision``: weights of the drafting graphs (drafts and self-draft), int8 or
    float32; the verifier graphs are float32 either way."""
    if dtype != "float32":
        raise ValueError(f"dtype must be float32 for the onnx backend (CPU); got {dtype!r}")
    if draft_precision not in DRAFT_PRECISIONS:
        raise ValueError(f"draft_precision must be one of {', '.join(DRAFT_PRECISIONS)}; "
                         f"got {draft_precision!r}")
    rule_defaults = rule_defaults or RuleParams("greedy")
    verifier_dir = Path(verifier_dir)
    verifier = load_model(verifier_dir)
    vc = verifier.config
    check_limits(max_batch_size, max_k, max_seq_len, vc)
    n_self = self_draft_layers or vc.self_draft_layers or 1
    if not 1 <= n_self < vc.n_layers:
        raise ValueError(f"self_draft_layers must be in [1, {vc.n_layers - 1}]; got {n_self}")
    sources = {"draft": draft_dir, "parallel_draft": parallel_draft_dir}
    drafts = {}
    for name, d in sources.items():
        if d is None:
            continue
        d = Path(d)
        draft = load_model(d)
        check_draft(verifier_dir, vc, d, draft.config, name)
        if name == "parallel_draft" and draft.config.mask_token_id is None:
            raise ValueError(f"parallel_draft {d}: config.json has no mask_token_id")
        drafts[name] = (d, draft)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    models: dict[str, dict] = {}
    graphs = {"logits": {"file": "verifier.onnx"},
              "correction": {"file": "verifier_correction.onnx"},
              "self_draft": {"file": f"verifier_self{n_self}.onnx", "num_layers": n_self}}
    export_step(verifier, out / graphs["logits"]["file"])
    check_graph(verifier, out / graphs["logits"]["file"])
    add_correction(out / graphs["logits"]["file"], out / graphs["correction"]["file"],
                   rule_defaults)
    export_drafting(verifier, out / graphs["self_draft"]["file"], draft_precision, n_self)
    graphs["self_draft"]["precision"] = draft_precision
    models["verifier"] = {"source": str(verifier_dir), "config": asdict(vc), "graphs": graphs}
    for name, (d, draft) in drafts.items():
        f = f"{name}.onnx"
        export_drafting(draft, out / f, draft_precision)
        models[name] = {"source": str(d), "config": asdict(draft.config),
                        "graphs": {"logits": {"file": f, "precision": draft_precision}}}

    tokenizer = None
    if (verifier_dir / "tokenizer.json").is_file():
        tokenizer = "tokenizer.json"
        shutil.copyfile(verifier_dir / "tokenizer.json", out / tokenizer)
    drafters = {"self": "verifier"}
    if "draft" in drafts:
        drafters["model"] = "draft"
    if "parallel_draft" in drafts:
        drafters["parallel"] = "parallel_draft"
    manifest = {
        "backend": "onnx",
        "dtype": dtype,
        "draft_precision": draft_precision,
        "opset": OPSET,
        "vocab_size": vc.vocab_size,
        "limits": {"max_batch_size": max_batch_size, "max_k": max_k,
                   "max_seq_len": max_seq_len},
        "tokenizer": tokenizer,
        "rule_defaults": asdict(rule_defaults),
        "custom_ops": {OP_TYPE: {"domain": DOMAIN, "plugin_version": PLUGIN_VERSION,
                                 "plugin_namespace": DOMAIN}},
        "models": models,
        "drafters": drafters,
        "versions": package_versions(),
    }
    return write_manifest(out, manifest)
