"""Captured decode steps: ``compile_model`` runs a Transformer's draft and verify calls from
``torch.compile`` graphs; on CUDA in mode ``"reduce-overhead"``, i.e. CUDA graphs, captured
once per shape (at ``warm_up``) and replayed after. ``compile_decoder`` does it for the
models of a SpeculativeDecoder.

A graph has fixed shapes, and the decoder's calls do not: the batch shrinks as rows finish,
the width follows the round's K (and what an n-gram lookup found), and the attention bound
``kv_len`` grows every round. So each call is padded up to one of a few shapes (``Shapes``)
and the padding is dropped from the logits. Padding is safe by the static cache's rule (an
entry past a row's length is never read before it is overwritten):

- an extra column repeats the last column's token and position: it writes the K/V the last
  column writes, to the same entry;
- an extra row repeats the last row (its cache slot, tokens and positions): likewise;
- a larger ``kv_len`` attends over more of the cache, and the causal mask hides every entry
  past each query's own position.

What stays eager: calls wider than the widest shape (the prefill of a longer prompt), the
attention causal audit (its explicit softmax returns the weights), and a cache that was not
made by ``new_kv_cache`` (it has no one buffer to pass). Correction and rollback never enter
a graph: they are the decoder's, after the logits come out.

Compile time sets the shapes (``default_shapes``). On CUDA each role gets its own widths
(a verify pass K + 1, a draft step 1 or 2, …) at batch sizes 1, 2, 4, … up to the slots,
each shape one compile and one capture. On the CPU an inductor compile is seconds of C++
per shape, so every call pads to one shape (every slot, the widest width, the whole cache)
and the unit compiled is one decoder layer (``CompiledForward``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from .model import Block, KVCache, Transformer

COMPILE_MODES = ("auto", "default", "reduce-overhead", "max-autotune",
                 "max-autotune-no-cudagraphs")
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
COMPILE_UNITS = ("auto", "model", "layer")


@dataclass(frozen=True)
class Shapes:
    """The call shapes a compiled model runs at; a call is padded up to the next one.

    ``batch_sizes``: None for one shape, the cache's slot count. ``widths``: positions per
    row; a wider call runs eager. ``kv_block``: ``kv_len`` rounded up to a multiple of it
    (None: the whole cache, one shape)."""

    batch_sizes: tuple[int, ...] | None
    widths: tuple[int, ...]
    kv_block: int | None = None

    def __post_init__(self) -> None:
        for name in ("batch_sizes", "widths"):
            values = getattr(self, name)
            if values is not None and (not values or any(
                    not isinstance(v, int) or v < 1 for v in values)):
                raise ValueError(f"{name} must be a non-empty tuple of integers >= 1; "
                                 f"got {values!r}")
        if self.kv_block is not None and self.kv_block < 1:
            raise ValueError(f"kv_block must be an integer >= 1 or None; got {self.kv_block!r}")

    def batch(self, rows: int, slots: int) -> int | None:
        """The padded batch for ``rows`` rows of a cache with ``slots`` slots (None: none)."""
        if self.batch_sizes is None:
            return slots if rows <= slots else None
        return next((b for b in sorted(self.batch_sizes) if b >= rows), None)

    def width(self, positions: int) -> int | None:
        return next((w for w in sorted(self.widths) if w >= positions), None)

    def kv(self, kv_len: int | None, cache_len: int) -> int:
        if kv_len is None or self.kv_block is None:
            return cache_len
        return min(-(-kv_len // self.kv_block) * self.kv_block, cache_len)


def batch_buckets(max_batch_size: int) -> tuple[int, ...]:
    """1, 2, 4, … below ``max_batch_size``, then ``max_batch_size``: the batch sizes CUDA
    captures (as vLLM pads to its captured sizes)."""
    sizes, b = [], 1
    while b < max_batch_size:
        sizes.append(b)
        b *= 2
    return (*sizes, max_batch_size)


# the widths each model's calls take in a decoder with draft length K (a call pads up to the
# next): the verifier's plain step (1) and verify pass (K + 1; a lookup's shorter one pads to
# it); a separate draft's first step (2: it re-feeds the token before the newest) and the
# steps after (1); a parallel draft's one pass (K + 1 real tokens re-fed, K - 1 masks: 2K)
ROLES = ("verifier", "model", "parallel")


def role_widths(role: str, k: int) -> tuple[int, ...]:
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}; got {role!r}")
    if role == "model":
        return (1, 2)
    if role == "parallel":
        return (2 * k,)
    return (1, k + 1) if k else (1,)


def default_shapes(device: torch.device, k: int, max_batch_size: int,
                   role: str = "verifier") -> Shapes:
    """The shapes of a model in ``role`` in a decoder with draft length ``k`` and
    ``max_batch_size`` slots. CUDA: the role's widths at every ``batch_buckets`` size, each
    one capture. Elsewhere: one shape for every role, the widest call the decoder makes
    (2K + 2, its margin) at every slot, so a decoder's models of the same layer dims share
    one compile."""
    widths = role_widths(role, k)
    if device.type != "cuda":
        return Shapes(None, (2 * k + 2,))
    return Shapes(batch_buckets(max_batch_size), widths)


class CompiledForward:
    """A Transformer's forward, run from compiled graphs at ``shapes`` (installed as the
    model's ``forward`` by ``compile_model``; ``eager`` is the model's own).

    ``unit``: ``"model"`` compiles the whole forward (embedding to logits) per shape, one
    CUDA graph per step; ``"layer"`` compiles one decoder layer per shape, the graph every
    layer runs (and every model with the same layer dims), with the embedding, final norm
    and LM head eager. The layer graph compiles in a fraction of the model's time, which
    is what the CPU needs; on CUDA the model graph replays a step in one launch."""

    def __init__(self, model: Transformer, shapes: Shapes, mode: str, unit: str) -> None:
        self.model = model
        self.shapes = shapes
        self.mode = mode
        self.unit = unit
        # CUDA graphs' bookkeeping (static cache, step marks, output copies) whenever the
        # mode asks for graphs: on the CPU inductor skips the graphs, the rest runs as well
        self.graphs = mode in CUDA_GRAPH_MODES
        self.eager: Callable[..., tuple[Tensor, Tensor | None]] = model.forward
        # fullgraph: a graph break would split a step into pieces captured apart
        fn = self._model_step if unit == "model" else _layer_step
        self.compiled = torch.compile(fn, mode=mode, dynamic=False, fullgraph=True)
        self._aranges: dict[int, Tensor] = {}
        self._views: dict[int, list[Tensor]] = {}  # per cache buffer: it, its layers' views
        self._layers: list[Tensor] | None = None  # the running call's per-layer buffers
        if unit == "layer":
            for i, block in enumerate(model.layers):
                block.forward = _LayerCall(self, i, block.forward)

    def _model_step(self, tokens: Tensor, input_pos: Tensor, buffer: Tensor, kv_len: int,
                    rows: Tensor, output_index: Tensor, num_layers: int | None) -> Tensor:
        # the cache enters as its one buffer: the per-layer views are made inside the graph,
        # so the graph has one mutated input, not 2 x layers aliased ones
        layers = range(buffer.shape[0])
        cache = KVCache([buffer[i, 0] for i in layers], [buffer[i, 1] for i in layers], buffer)
        logits, _ = Transformer.forward(self.model, tokens, input_pos, cache, kv_len=kv_len,
                                        rows=rows, output_index=output_index,
                                        num_layers=num_layers)
        return logits

    def __call__(self, tokens: Tensor, input_pos: Tensor, cache: KVCache,
                 kv_len: int | None = None, rows: Tensor | None = None,
                 output_index: Tensor | None = None, num_layers: int | None = None,
                 audit: bool = False) -> tuple[Tensor, Tensor | None]:
        B, T = tokens.shape
        padded_b = self.shapes.batch(B, cache.num_slots)
        padded_t = self.shapes.width(T)
        if audit or cache.buffer is None or padded_b is None or padded_t is None:
            return self.eager(tokens, input_pos, cache, kv_len=kv_len, rows=rows,
                              output_index=output_index, num_layers=num_layers, audit=audit)
        if output_index is None:  # every position: the same graph as a drafter's call
            output_index = self._arange(T, tokens.device).expand(B, -1)
        out_t = output_index.shape[1]
        if rows is None:  # explicit slots: one graph for every call (no None variant)
            rows = self._arange(B, tokens.device)
        tokens, input_pos = pad(tokens, padded_b, padded_t), pad(input_pos, padded_b, padded_t)
        rows = pad(rows[:, None], padded_b, 1)[:, 0]
        output_index = pad(output_index, padded_b, padded_t)
        kv = self.shapes.kv(kv_len, cache.max_seq_len)
        layers = self._buffers(cache.buffer)
        if self.graphs:
            # the previous step's outputs are consumed (or cloned): its memory may be reused
            torch.compiler.cudagraph_mark_step_begin()
        if self.unit == "model":
            logits = self.compiled(tokens, input_pos, cache.buffer, kv, rows, output_index,
                                   num_layers)[:B, :out_t]
            # a CUDA graph's output lives in its pool until the next replay: keep a copy
            return (logits.clone() if self.graphs else logits), None
        self._layers = layers
        try:  # the model's own forward, each layer through _LayerCall
            logits, _ = self.eager(tokens, input_pos, cache, kv_len=kv, rows=rows,
                                   output_index=output_index, num_layers=num_layers)
        finally:
            self._layers = None
        return logits[:B, :out_t], None

    def _arange(self, n: int, device: torch.device) -> Tensor:
        if n not in self._aranges:  # made once: a steady batch builds no tensor per call
            self._aranges[n] = torch.arange(n, device=device)
        return self._aranges[n]

    def _buffers(self, buffer: Tensor) -> list[Tensor]:
        """The per-layer views [2, slots, positions, heads, head_dim] of a cache buffer,
        made once per buffer. Under CUDA graphs a mutated input must keep its address, which
        the cache does (allocated once): marked static, without a guard, so another
        decoder's cache is re-recorded, not recompiled."""
        key = id(buffer)
        if key not in self._views:
            views = [buffer[i] for i in range(buffer.shape[0])]
            if self.graphs:
                for t in (buffer, *views):
                    torch._dynamo.mark_static_address(t, guard=False)
            self._views[key] = [buffer, *views]  # the buffer too: its id stays its own
        return self._views[key][1:]

    def warm_up(self, cache: KVCache, num_layers: int | None = None,
                widths: tuple[int, ...] | None = None) -> int:
        """Compile (and with CUDA graphs capture) the shapes against ``cache`` now, rather
        than at a request's first round: every batch size, at ``widths`` (default: all of
        ``shapes``'). Writes into the cache's slots: call it before any request (a prefill
        rewrites what a row reads). Returns the shapes run."""
        dev = cache.buffer.device
        count = 0
        for b in self.shapes.batch_sizes or (cache.num_slots,):
            for t in widths or self.shapes.widths:
                if b > cache.num_slots:
                    continue
                tokens = torch.zeros(b, t, dtype=torch.long, device=dev)
                pos = torch.arange(t, device=dev).expand(b, -1)
                # CUDA graph trees run a new shape once, record it on the next call, and
                # replay from the third
                for _ in range(3 if self.graphs else 1):
                    self(tokens, pos, cache, rows=self._arange(b, dev), num_layers=num_layers)
                count += 1
        return count


class _LayerCall:
    """A decoder layer's forward under ``unit="layer"``: the compiled layer graph inside a
    padded call of its model's CompiledForward, the layer's own forward otherwise."""

    def __init__(self, owner: CompiledForward, index: int,
                 eager: Callable[..., tuple[Tensor, Tensor | None]]) -> None:
        self.owner, self.index, self.eager = owner, index, eager

    def __call__(self, x: Tensor, rope: tuple[Tensor, Tensor] | None, mask: Tensor,
                 rows: Tensor | None, input_pos: Tensor, k_cache: Tensor, v_cache: Tensor,
                 audit: bool) -> tuple[Tensor, Tensor | None]:
        layers = self.owner._layers
        if layers is None:
            return self.eager(x, rope, mask, rows, input_pos, k_cache, v_cache, audit)
        block = self.owner.model.layers[self.index]
        return self.owner.compiled(block, x, rope, mask, rows, input_pos,
                                   layers[self.index]), None


def _layer_step(block: Block, x: Tensor, rope: tuple[Tensor, Tensor] | None,
                mask: Tensor, rows: Tensor, input_pos: Tensor, layer: Tensor) -> Tensor:
    """One decoder layer against its cache ``layer`` [2, slots, ...] (K, V): one mutated
    input, where its two views would be two aliased ones. The block is an argument, so
    every layer of the same dims runs the same graph. ``Block.forward``: the instance's
    ``forward`` is the ``_LayerCall`` that called this."""
    return Block.forward(block, x, rope, mask, rows, input_pos, layer[0], layer[1], False)[0]


def pad(x: Tensor, rows: int, columns: int) -> Tensor:
    """``x`` [B, T] padded to [rows, columns] by repeating its last column, then its last row
    (device ops only: no host sync)."""
    B, T = x.shape
    if columns > T:
        x = torch.cat([x, x[:, -1:].expand(B, columns - T)], 1)
    if rows > B:
        x = torch.cat([x, x[-1:].expand(rows - B, -1)], 0)
    return x


def compile_model(model: Transformer, k: int = 4, max_batch_size: int = 8,
                  mode: str = "auto", unit: str = "auto", role: str = "verifier",
                  shapes: Shapes | None = None) -> Transformer:
    """Run ``model``'s decode calls from compiled graphs (in place; returns the model).

    ``mode``: torch.compile's; ``"auto"`` is ``"reduce-overhead"`` (CUDA graphs) on CUDA and
    ``"default"`` (inductor kernels) elsewhere. ``unit``: ``"model"`` or ``"layer"``
    (``CompiledForward``); ``"auto"`` is ``"model"`` on CUDA, ``"layer"`` elsewhere. ``k``,
    ``max_batch_size`` (the decoder's) and ``role`` (``ROLES``: what the model does there)
    set the default ``shapes`` (``default_shapes``). The outputs are the eager model's up to
    rounding: inductor fuses and reorders float operations."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile mode must be one of {', '.join(COMPILE_MODES)}; got {mode!r}")
    if unit not in COMPILE_UNITS:
        raise ValueError(f"compile unit must be one of {', '.join(COMPILE_UNITS)}; got {unit!r}")
    if isinstance(model.forward, CompiledForward):
        raise ValueError("the model is compiled already")
    device = model.device
    cuda = device.type == "cuda"
    if mode == "auto":
        mode = "reduce-overhead" if cuda else "default"
    if unit == "auto":
        unit = "model" if cuda else "layer"
    if model.inv_freq is not None:  # forward moves it on first use: not inside a graph
        model.inv_freq = model.inv_freq.to(device)
    shapes = shapes or default_shapes(device, k, max_batch_size, role)
    # each shape (and a self-draft's layer count) is one cache entry of the same code, for
    # every compiled model: room for this model's, past dynamo's default of 8
    config = torch._dynamo.config
    config.recompile_limit += 2 * len(shapes.batch_sizes or (1,)) * len(shapes.widths)
    model.forward = CompiledForward(model, shapes, mode, unit)
    return model


class DecoderLike(Protocol):
    """What ``compile_decoder`` and ``warm_up`` read of a SpeculativeDecoder (this module
    sits below it)."""

    verifier: Any
    drafter: Any
    cache: KVCache | None
    draft_cache: KVCache | None
    k: int
    max_batch_size: int


def compile_decoder(decoder: DecoderLike, mode: str = "auto", unit: str = "auto",
                    warm: bool = True) -> DecoderLike:
    """Compile a decoder's torch models in place (its verifier and a separate draft), at the
    shapes of its K and slots, and with ``warm`` compile / capture them all now. Returns the
    decoder. An engine (ONNX Runtime, TensorRT, llama.cpp) is refused: it is not torch."""
    drafter = decoder.drafter
    models = [(decoder.verifier, "verifier")]
    if drafter is not None and drafter.model is not None and not drafter.shares_verifier_cache:
        models.append((drafter.model, drafter.kind))
    for model, _ in models:
        if not isinstance(model, Transformer):
            raise ValueError("compile: the decoder's models must be torch models (a checkpoint "
                             f"loaded with load_model); got {type(model).__name__}")
    for model, role in models:
        compile_model(model, k=decoder.k, max_batch_size=decoder.max_batch_size, mode=mode,
                      unit=unit, role=role)
    if warm:
        warm_up(decoder)
    return decoder


def warm_up(decoder: DecoderLike) -> int:
    """Compile / capture the shapes of every compiled model a decoder runs (its verifier,
    a separate draft, the self-draft's layers at width 1) before its first request.
    Returns the shapes run."""
    drafter = decoder.drafter
    runs = [(decoder.verifier, decoder.cache, None, None)]
    if drafter is not None and drafter.model is not None:
        if drafter.shares_verifier_cache:  # the self-draft: one token per step
            runs.append((drafter.model, decoder.cache, drafter.num_layers, (1,)))
        else:
            runs.append((drafter.model, decoder.draft_cache, None, None))
    count = 0
    for model, cache, num_layers, widths in runs:
        forward = getattr(model, "forward", None)
        if isinstance(forward, CompiledForward) and cache is not None:
            count += forward.warm_up(cache, num_layers, widths)
    return count
