"""ONNX Runtime backend: the engine interface of ``Transformer`` over exported graphs.

``OrtModel`` has ``.config``, ``.dtype``, ``.device`` and ``__call__`` with the signature and
semantics of ``Transformer.forward``, reading and writing the same ``KVCache`` of torch CPU
tensors, so ``SpeculativeDecoder`` runs on it unchanged. Every tensor crosses into ONNX
Runtime by pointer (IO binding of the torch tensors' memory): the cache is bound as it is,
outputs land in torch tensors allocated per call at their exact (small) size, and the only
cache writes are this step's K/V at (rows, input_pos) — the same index_put torch does.

``CausalCorrection`` (domain ``paradraft``) runs here as an onnxruntime-extensions Python op
that calls ``correction.correct``: the one implementation of the rules. ``verify_and_correct``
runs the verifier and the op in one call (``SpeculativeDecoder(fused_correction=...)``); the
op's rule parameters are node attributes, so each parameter set gets a session of its own.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ..correction import Randoms, RuleParams, correct
from ..model import KVCache, ModelConfig
from .engine_io import (
    DOMAIN,
    FLOAT_PARAMS,
    OP_TYPE,
    accepted_block,
    arange_on,
    correction_inputs,
    params_from_attributes,
    rule_key,
    set_rule,
    step_inputs,
    write_back,
)

_NP_TYPES = {torch.float32: np.float32, torch.int64: np.int64}
# correction sessions per OrtModel, one per rule parameter set: each prepacks its own copy of
# the verifier's weights, so a server whose requests bring ever new parameters must not make
# one each (those rounds run unfused instead, ``fused_reason``)
MAX_CORRECTION_SESSIONS = 4
# K/V output buffers reused across calls (OrtModel._new_kv): decoding shapes only, at most
# this many (B, T, layers) shapes at a time
SCRATCH_MAX_T, MAX_SCRATCH = 80, 32
_op_registered = False
last_op_error: str | None = None  # the CausalCorrection kernel's last failure


def causal_correction(logits: np.ndarray, draft_tokens: np.ndarray, draft_probs: np.ndarray,
                      accept_uniforms: np.ndarray, sample_noise: np.ndarray,
                      num_drafted: np.ndarray, **attrs) -> tuple[np.ndarray, ...]:
    """The CausalCorrection kernel. Empty tensors stand for ``correct()``'s ``None``: an empty
    ``draft_probs`` is a greedy (one-hot) draft, an empty ``num_drafted`` means every row
    drafted all K tokens, and empty ``accept_uniforms`` / ``sample_noise`` mean no random
    numbers (enough for ``greedy``; the sampling rules refuse it).

    A Python exception escaping a PyOp aborts the whole process (onnxruntime-extensions
    0.15), so errors are caught here: the outputs are filled with -1 and the message is kept
    in ``last_op_error`` for the caller (``OrtModel.verify_and_correct``) to raise."""
    global last_op_error
    B, K = draft_tokens.shape
    try:
        params = params_from_attributes(attrs)
        # the extension hands over arrays it owns (copies of ORT's inputs): wrap, don't copy
        t = torch.from_numpy
        drafts = t(draft_tokens)
        probs = t(draft_probs) if draft_probs.size else None
        drafted = t(num_drafted) if num_drafted.size else None
        randoms = None
        if accept_uniforms.size or sample_noise.size:
            randoms = Randoms(t(accept_uniforms), t(sample_noise))
        num_accepted, next_token = correct(t(logits), drafts, probs, params, randoms, drafted)
        block = accepted_block(drafts, num_accepted, next_token)
        last_op_error = None
        return num_accepted.numpy(), next_token.numpy(), block.numpy()
    except Exception as e:  # see the docstring: never let it reach C++
        last_op_error = f"{type(e).__name__}: {e}"
        failed = np.full(B, -1, dtype=np.int64)
        return failed, failed.copy(), np.full((B, K + 1), -1, dtype=np.int64)


def register_correction_op() -> str:
    """Register CausalCorrection with onnxruntime-extensions (once); return the custom-op
    library path to pass to ``SessionOptions.register_custom_ops_library``."""
    global _op_registered
    from onnxruntime_extensions import PyOp, get_library_path, onnx_op

    if not _op_registered:
        f, i64, s = PyOp.dt_float, PyOp.dt_int64, PyOp.dt_string
        attrs = {"rule": s, "top_p_membership": i64, "plugin_version": s,
                 "plugin_namespace": s, **dict.fromkeys(FLOAT_PARAMS, f)}
        # "domain::op" registers the op under our own domain (not ai.onnx.contrib)
        onnx_op(op_type=f"{DOMAIN}::{OP_TYPE}", inputs=[f, i64, f, f, f, i64],
                outputs=[i64, i64, i64], attrs=attrs)(causal_correction)
        _op_registered = True
    return get_library_path()


def session_options(threads: int | None = None, custom_ops: bool = False):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    # match torch's thread count: the decoder's torch ops and ORT take turns on the cores
    so.intra_op_num_threads = threads or torch.get_num_threads()
    so.inter_op_num_threads = 1
    # workers spin-wait between the nodes of a run (a blocked worker's wake-up costs more
    # than a small node; measured on 2 cores: the verifier 2.25 -> 1.75 ms per call) but
    # stop when the run ends: the decoder's torch ops and the other graphs run between ORT
    # calls, and workers spinning there took their cores (2.5x fewer speculative tok/s)
    so.add_session_config_entry("session.intra_op.allow_spinning", "1")
    so.add_session_config_entry("session.force_spinning_stop", "1")
    if custom_ops:
        so.register_custom_ops_library(register_correction_op())
    return so


class Graph:
    """One ORT session run with IO binding over torch CPU tensors. ``path``: the graph file
    (its external weights resolve next to it), or the graph's bytes with ``weights_dir``,
    where its weights files are."""

    def __init__(self, path: str | Path | bytes, threads: int | None = None,
                 custom_ops: bool = False, weights_dir: str | Path | None = None):
        import onnxruntime as ort

        so = session_options(threads, custom_ops)
        if weights_dir is not None:
            so.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                        str(weights_dir))
        model = path if isinstance(path, bytes) else str(path)
        self.session = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
        # one binding, kept between calls: a Graph (and so an OrtModel) serves one thread
        self.binding = self.session.io_binding()
        # name -> (memory, shape, dtype) bound now, and the tensor, kept alive while bound
        self._bound: dict[str, tuple[tuple, Tensor]] = {}

    def run(self, inputs: dict[str, Tensor], outputs: dict[str, Tensor]) -> None:
        """Bind every tensor's memory (no copies) and run; outputs are written in place.
        A name whose tensor has the memory, shape and dtype it was bound with last time (the
        KV cache, reused scratch buffers) keeps its binding: a bind costs more than the check."""
        b = self.binding
        for names, bind in ((inputs, b.bind_input), (outputs, b.bind_output)):
            for name, t in names.items():
                key = (t.data_ptr(), t.shape, t.dtype)
                if self._bound.get(name, (None,))[0] != key:
                    bind(name, "cpu", 0, _NP_TYPES[t.dtype], tuple(t.shape), key[0])
                    self._bound[name] = (key, t)
        self.session.run_with_iobinding(b)


class OrtModel:
    """An exported model (its step graphs by layer count) behind the Transformer interface.

    graphs: {None: full step graph, N: first-N-layers graph, ...}; correction: the verifier
    graph ending in CausalCorrection (optional); draft_steps: {(num_layers or None, k): fused
    k-step greedy draft graph} (optional, ``greedy_drafts``). Sessions are created on first
    use. ``threads``: ONNX Runtime intra-op threads of the full graph (default: torch's);
    ``draft_threads``: of the drafting graphs (first-N-layers, fused draft steps; default:
    ``threads``). ``max_correction_sessions``: rule parameter sets with a correction session
    of their own (each holds the verifier's weights once more).
    """

    # SpeculativeDecoder(fused_correction="auto") fuses where this is True. verify_and_correct
    # measured slower on the CPU than the logits graph + correct(): the Python op's call costs
    # more than keeping the logits in the graph saves (docs/engines.md)
    fused_by_default = False

    def __init__(self, config: ModelConfig, graphs: dict[int | None, str | Path],
                 correction: str | Path | None = None, threads: int | None = None,
                 draft_steps: dict[tuple[int | None, int], str | Path] | None = None,
                 draft_threads: int | None = None,
                 max_correction_sessions: int = MAX_CORRECTION_SESSIONS):
        if not isinstance(max_correction_sessions, int) or max_correction_sessions < 1:
            raise ValueError("max_correction_sessions must be an integer >= 1; got "
                             f"{max_correction_sessions!r}")
        self.config = config
        self.dtype = torch.float32
        self.device = torch.device("cpu")
        self.graph_paths = dict(graphs)
        self.correction_path = correction
        # resolved now, not when a session is first made: the decoder runs its own torch
        # ops on one thread (speculative.glue_threads), inside which sessions get created
        self.threads = threads or torch.get_num_threads()
        self.draft_threads = self.threads if draft_threads is None else draft_threads
        self.draft_step_paths = dict(draft_steps or {})
        self._graphs: dict[int | None, Graph] = {}
        self.max_correction_sessions = max_correction_sessions
        self._corrections: dict[RuleParams, Graph] = {}
        self._draft_steps: dict[tuple[int | None, int], Graph] = {}
        self._scratch: dict[tuple[int, int, int], tuple[Tensor, dict[str, Tensor]]] = {}

    def single_step(self) -> OrtModel:
        """This engine without its fused draft graphs: k single-step calls per block, the
        reference the fused graphs are tested and benchmarked against."""
        return OrtModel(self.config, self.graph_paths, self.correction_path, self.threads,
                        draft_threads=self.draft_threads,
                        max_correction_sessions=self.max_correction_sessions)

    def _graph(self, num_layers: int | None) -> Graph:
        if num_layers not in self._graphs:
            if num_layers not in self.graph_paths:
                built = sorted(n for n in self.graph_paths if n is not None)
                raise ValueError(f"num_layers={num_layers}: no graph for it in this engine "
                                 f"(self-draft graphs built for num_layers in {built}; "
                                 "rebuild with --self-draft-layers)")
            threads = self.threads if num_layers is None else self.draft_threads
            self._graphs[num_layers] = Graph(self.graph_paths[num_layers], threads)
        return self._graphs[num_layers]

    def _new_kv(self, B: int, T: int, n: int) -> tuple[Tensor, dict[str, Tensor]]:
        """The step's K/V outputs: one buffer [2n, B, T, heads, head_dim] (``write_back``'s
        ``packed``) and its per-layer views by output name. Decoding shapes (T up to
        ``SCRATCH_MAX_T``) reuse their buffer: it is copied into the cache before the call
        returns, and the graph keeps it bound."""
        key = (B, T, n)
        if key in self._scratch:
            return self._scratch[key]
        c = self.config
        buf = torch.empty(2 * n, B, T, c.n_kv_heads, c.head_dim)
        out = buf, {f"new_{kv}_{i}": buf[2 * i + j] for i in range(n)
                    for j, kv in enumerate(("k", "v"))}
        if T <= SCRATCH_MAX_T:  # not prompts: each length would keep a buffer
            if len(self._scratch) >= MAX_SCRATCH:
                self._scratch.clear()
            self._scratch[key] = out
        return out

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
                             "supported on the ONNX Runtime backend; use the torch backend")
        c = self.config
        n = c.n_layers if num_layers is None else min(num_layers, c.n_layers)
        graph = self._graph(None if n == c.n_layers else n)
        inputs = step_inputs(tokens, input_pos, cache, kv_len, rows, output_index, n)
        B = tokens.shape[0]
        logits = torch.empty(B, inputs["output_index"].shape[1], c.vocab_size)
        packed, new_kv = self._new_kv(B, tokens.shape[1], n)
        graph.run(inputs, {"logits": logits, **new_kv})
        write_back(cache, new_kv, inputs["rows"], inputs["input_pos"], packed)
        return logits, None

    def greedy_drafts(self, tokens: Tensor, input_pos: Tensor, cache: KVCache, k: int,
                      kv_len: int | None = None, rows: Tensor | None = None,
                      num_layers: int | None = None) -> Tensor | None:
        """``k`` greedy draft steps in one call of the fused graph: step 0 over ``tokens``
        (the window ending in the newest token), each later one over the previous draft at
        the next position. Writes the K/V of every fed token into ``cache``, as k calls
        would, and returns the drafts [B, k]; None when the engine has no fused graph for
        (num_layers, k)."""
        c = self.config
        n = c.n_layers if num_layers is None else min(num_layers, c.n_layers)
        key = (None if n == c.n_layers else n, k)
        if key not in self.draft_step_paths:
            return None
        if key not in self._draft_steps:
            self._draft_steps[key] = Graph(self.draft_step_paths[key], self.draft_threads)
        inputs = step_inputs(tokens, input_pos, cache, kv_len, rows, None, n, reach=k - 1)
        del inputs["output_index"]
        B, T = tokens.shape
        drafts = torch.empty(B, k, dtype=torch.int64)
        packed, new_kv = self._new_kv(B, T + k - 1, n)
        self._draft_steps[key].run(inputs, {"draft_tokens": drafts, **new_kv})
        fed_pos = torch.cat([inputs["input_pos"], inputs["input_pos"][:, -1:] + 1
                             + arange_on(k - 1, tokens.device)], 1)
        write_back(cache, new_kv, inputs["rows"], fed_pos, packed)
        return drafts

    # -- the verifier + CausalCorrection graph ---------------------------------------------

    @property
    def has_correction(self) -> bool:
        """Whether this engine can verify and correct in one call (``verify_and_correct``)."""
        return self.correction_path is not None

    def fused_reason(self, params: RuleParams) -> str | None:
        """Why ``verify_and_correct`` cannot run ``params`` now (None: it can). Host-side
        bookkeeping only: the decoder asks every round."""
        if self.correction_path is None:
            return "no correction graph: this engine was built without one"
        if (rule_key(params) not in self._corrections
                and len(self._corrections) >= self.max_correction_sessions):
            return (f"rule parameters: {len(self._corrections)} parameter sets have a "
                    "correction session already (max_correction_sessions)")
        return None

    def prepare_correction(self, params: RuleParams) -> None:
        """Make the correction session for ``params`` now (a session takes a while to make:
        better before the first round than inside it)."""
        self.correction_graph(params)

    def correction_graph(self, params: RuleParams) -> Graph:
        """The correction graph with ``params`` as its node attributes (one session each, made
        on first use; greedy parameter sets share one: the rule reads none of them)."""
        if self.correction_path is None:
            raise ValueError("this engine has no correction graph (only the verifier has one)")
        params = rule_key(params)
        if params not in self._corrections:
            import onnx

            # the graph alone (its weights stay in the engine dir's weights file): a rewrite
            # of a few attributes, and a graph past 2 GB could not be serialized with them
            path = Path(self.correction_path)
            model = onnx.load(str(path), load_external_data=False)
            set_rule(model, params)
            self._corrections[params] = Graph(model.SerializeToString(), self.threads,
                                              custom_ops=True, weights_dir=path.parent)
        return self._corrections[params]

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
        next_token [B], accepted_tokens [B, K+1]) — the logits stay inside the graph. The
        other arguments are ``correct()``'s and ``Transformer.forward``'s."""
        c = self.config
        graph = self.correction_graph(params)
        inputs = step_inputs(tokens, input_pos, cache, kv_len, rows, None, c.n_layers)
        B, T = tokens.shape
        inputs.update(correction_inputs(B, randoms, draft_probs, num_drafted, tokens.device))
        num_accepted = torch.empty(B, dtype=torch.int64)
        next_token = torch.empty(B, dtype=torch.int64)
        accepted = torch.empty(B, T, dtype=torch.int64)
        packed, new_kv = self._new_kv(B, T, c.n_layers)
        graph.run(inputs, {"num_accepted": num_accepted, "next_token": next_token,
                           "accepted_tokens": accepted, **new_kv})
        if last_op_error is not None and bool((num_accepted < 0).any()):
            raise ValueError(f"{OP_TYPE} failed: {last_op_error}")
        write_back(cache, new_kv, inputs["rows"], inputs["input_pos"], packed)
        return num_accepted, next_token, accepted
