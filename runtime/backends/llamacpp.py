"""llama.cpp as an engine: a GGUF model run through llama-cpp-python's C API, behind the same
interface as the ONNX Runtime engine, so the decoder, correction rules, drafters, K policy,
serving and metrics run on it unchanged.

On a CPU, decoding is bound by the bytes of weights streamed per token, and llama.cpp's
kernels read the GGUF's own 4–6-bit blocks with int8 dot products: the fastest plain step
this machine has for a quantized model. Speculation on top of it pays where llama.cpp's own
does not, because the verify pass and the correction are ours.

How the engine interface maps onto a llama.cpp context:
- a cache slot (a decoder row) is a llama.cpp sequence id; the context holds one KV stream
  per sequence (``kv_unified`` off), sized by the engine dir's limits;
- a call feeds each row's tokens at the row's own positions and asks for logits where the
  caller wants them (``output_index``), all in one ``llama_decode``;
- rollback is ``llama_memory_seq_rm``: before a row is fed from position p, its entries from
  p on are dropped (the decoder's "the new length is all the rollback there is");
- tokens after a row's last requested output (a prompt's right padding) are not fed: the
  next call for that row starts at or before them, so they would be dropped unread.

The decoder's own ``KVCache`` is not used (``owns_cache``): llama.cpp keeps the cache.
"""

from __future__ import annotations

import ctypes
import os
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ..model import ModelConfig

MISSING = ("the llama.cpp backend needs llama-cpp-python (its C library is compiled from the "
           "sdist, a few minutes on 2 cores): `make llamacpp`, or pip install "
           "'paradraft[llamacpp]' with CMAKE_ARGS='-DGGML_NATIVE=ON'")
MAX_SEQUENCES = 256  # llama.cpp's LLAMA_MAX_SEQ


def need_llama_cpp():
    try:
        import llama_cpp
    except ImportError as e:
        raise RuntimeError(MISSING) from e
    return llama_cpp


# llama.cpp 0.3.36 built for an AMX CPU (Sapphire Rapids, as with -march=native there) routes
# quantized weights to its AMX buffer type, whose matmul segfaults on the first decode
# (ggml-org/llama.cpp#20824; seen here on a 2-core Xeon VM, tiny and real models alike). Our
# builds compile with these flags (GCC and Clang let an explicit -mno-* win over
# -march=native, whatever the order), and a library that still reports AMX_INT8 gets no extra
# buffer types (no AMX, no CPU repack) instead of a crash.
NO_AMX_FLAGS = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def built_with_amx(lib) -> bool:
    return b"AMX_INT8 = 1" in lib.llama_print_system_info()


_quiet = None  # the log callback, kept alive while the library may call it


def _silence(lib) -> None:
    """llama.cpp logs every load and context to stderr; keep errors only."""
    global _quiet
    if _quiet is None:
        @lib.llama_log_callback
        def quiet(level, text, user_data):
            if level == 4:  # GGML_LOG_LEVEL_ERROR
                os.write(2, text)
        _quiet = quiet
        lib.llama_log_set(_quiet, ctypes.c_void_p(0))
        lib.llama_backend_init()


class LlamaCppModel:
    """A GGUF file in a llama.cpp context with ``max_batch_size`` sequences of
    ``max_positions`` positions each. ``threads``: llama.cpp's threads (default: the cores)."""

    fused_by_default = False
    has_correction = False  # no CausalCorrection graph: logits out, correct() in torch
    owns_cache = True
    feeds_ragged = True  # __call__ takes num_tokens: rows feed only their own drafts

    def __init__(self, path: str | Path, config: ModelConfig, max_batch_size: int,
                 max_positions: int, threads: int | None = None, n_ubatch: int = 512,
                 repack: bool | None = None):
        lib = need_llama_cpp()
        _silence(lib)
        if not 1 <= max_batch_size <= MAX_SEQUENCES:
            raise ValueError(f"max_batch_size must be in [1, {MAX_SEQUENCES}] for llama.cpp; "
                             f"got {max_batch_size}")
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no GGUF file at {path}")
        self.lib, self.config, self.path = lib, config, path
        self.dtype, self.device = torch.float32, torch.device("cpu")
        self.max_batch_size, self.max_positions = max_batch_size, max_positions
        self.threads = threads or len(os.sched_getaffinity(0))
        mp = lib.llama_model_default_params()
        mp.n_gpu_layers = 0
        if repack is None:
            repack = not built_with_amx(lib)
            if not repack:
                warnings.warn("llama.cpp was built with AMX, whose matmul crashes (llama.cpp "
                              "#20824): weights are not repacked. Rebuild it with `make "
                              "llamacpp` (compiled without AMX) for the repacked kernels",
                              stacklevel=2)
        elif repack and built_with_amx(lib):
            raise ValueError("repack=True: this llama.cpp was built with AMX, whose matmul "
                             "crashes (llama.cpp #20824); rebuild it with `make llamacpp`")
        mp.use_extra_bufts = repack
        self._model = lib.llama_model_load_from_file(str(path).encode(), mp)
        if not self._model:
            raise ValueError(f"llama.cpp could not load {path}")
        vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self._model))
        if vocab != config.vocab_size:
            raise ValueError(f"{path}: llama.cpp reads a vocabulary of {vocab}, the config "
                             f"says {config.vocab_size}")
        cp = lib.llama_context_default_params()
        cp.n_seq_max = max_batch_size
        cp.n_ctx = max_batch_size * max_positions
        # one decode may carry every row's whole prompt (a batched prefill)
        cp.n_batch = cp.n_ctx
        cp.n_ubatch = min(n_ubatch, cp.n_ctx)
        cp.n_outputs_max = 0  # = n_batch: a verify pass wants logits at every position
        cp.n_outputs_max_per_seq = 0
        cp.n_threads = cp.n_threads_batch = self.threads
        cp.kv_unified = False  # a KV stream per sequence: a row attends to its own cells only
        cp.no_perf = True
        self._ctx = lib.llama_init_from_model(self._model, cp)
        if not self._ctx:
            raise ValueError(f"llama.cpp could not make a context for {path} "
                             f"({max_batch_size} sequences x {max_positions} positions)")
        self._memory = lib.llama_get_memory(self._ctx)
        # the batch arrays, reused by every call; token i belongs to sequence seq[i]
        # (llama_batch.seq_id[i] points at seq[i]: one id per token)
        n = cp.n_batch
        self._token = np.zeros(n, np.int32)
        self._pos = np.zeros(n, np.int32)
        self._n_seq = np.ones(n, np.int32)
        self._seq = np.zeros(n, np.int32)
        self._wants = np.zeros(n, np.int8)
        self._seq_ptrs = (self._seq.ctypes.data + 4 * np.arange(n, dtype=np.uint64)).astype(
            np.uint64)
        ptr = lambda a, t: a.ctypes.data_as(ctypes.POINTER(t))  # noqa: E731
        self._batch = lib.llama_batch()
        self._batch.token = ptr(self._token, ctypes.c_int32)
        self._batch.pos = ptr(self._pos, ctypes.c_int32)
        self._batch.n_seq_id = ptr(self._n_seq, ctypes.c_int32)
        self._batch.seq_id = ptr(self._seq_ptrs, ctypes.POINTER(ctypes.c_int32))
        self._batch.logits = ptr(self._wants, ctypes.c_int8)
        self._batch.embd = ctypes.POINTER(ctypes.c_float)()
        self._stored = np.zeros(max_batch_size, np.int64)  # positions each sequence holds

    def __del__(self) -> None:
        lib = getattr(self, "lib", None)
        if lib is None:
            return
        if getattr(self, "_ctx", None):
            lib.llama_free(self._ctx)
            self._ctx = None
        if getattr(self, "_model", None):
            lib.llama_model_free(self._model)
            self._model = None

    def set_threads(self, threads: int) -> None:
        self.threads = threads
        self.lib.llama_set_n_threads(self._ctx, threads, threads)

    def reset(self) -> None:
        """Drop every sequence's cache."""
        self.lib.llama_memory_clear(self._memory, True)
        self._stored[:] = 0

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Make sequence ``dst`` hold sequence ``src``'s first ``n`` positions. Across KV
        streams llama.cpp copies only whole streams (the data at its next decode): the copy,
        then ``dst``'s tail dropped."""
        self.lib.llama_memory_seq_rm(self._memory, dst, -1, -1)
        self.lib.llama_memory_seq_cp(self._memory, src, dst, -1, -1)
        self.lib.llama_memory_seq_rm(self._memory, dst, n, -1)
        self._stored[dst] = min(n, self._stored[src])

    def __call__(
        self,
        tokens: Tensor,
        input_pos: Tensor,
        cache: object = None,
        kv_len: int | None = None,
        rows: Tensor | None = None,
        output_index: Tensor | None = None,
        num_layers: int | None = None,
        audit: bool = False,
        num_tokens: Tensor | None = None,
    ) -> tuple[Tensor, None]:
        """As ``Transformer.forward``: logits [B, T or T', V] fp32. ``cache`` and ``kv_len``
        are the decoder's and unused (llama.cpp keeps the cache). ``num_tokens`` [B]: row b
        feeds only its first ``num_tokens[b]`` tokens (a verify pass whose rows drafted
        different counts: on a CPU every fed token costs, and a padding token is thrown
        away); its later positions get a copy of its last logits, which no one reads."""
        if audit:
            raise ValueError("audit=True (the attention causal audit) needs the torch "
                             "backend; llama.cpp does not return attention weights")
        if num_layers is not None and num_layers < self.config.n_layers:
            raise ValueError("num_layers (a self-draft) is not supported by the llama.cpp "
                             "backend: draft with a draft model or ngram")
        B, T = tokens.shape
        seqs = np.arange(B) if rows is None else rows.numpy()
        pos = input_pos.numpy()
        tok = tokens.numpy()
        if output_index is None:
            out_idx = np.broadcast_to(np.arange(T), (B, T))
        else:
            out_idx = output_index.numpy()
        # a row feeds its tokens up to its last output; where positions repeat (a window
        # clamped at 0) the last copy stands for them
        keep = np.arange(T)[None, :] <= out_idx.max(1, keepdims=True)
        keep[:, :-1] &= pos[:, :-1] < pos[:, 1:]
        wants = np.zeros((B, T), bool)
        np.put_along_axis(wants, out_idx, True, axis=1)
        ragged = None
        if num_tokens is not None:
            if output_index is not None:
                raise ValueError("llama.cpp backend: num_tokens and output_index are exclusive")
            fed = num_tokens.numpy()
            if fed.shape != (B,) or (fed < 1).any() or (fed > T).any():
                raise ValueError(f"num_tokens must be [{B}] integers in [1, {T}]")
            keep &= np.arange(T)[None, :] < fed[:, None]
            wants &= keep
            # output row of (b, t): the row's outputs are numbered from its offset, and a
            # position past its last fed one repeats that one's logits
            offsets = np.cumsum(fed) - fed
            ragged = torch.from_numpy(
                offsets[:, None] + np.minimum(np.arange(T)[None, :], fed[:, None] - 1))
        if (wants & ~keep).any():
            raise ValueError("llama.cpp backend: an output_index points at a repeated "
                             "position; ask for the last copy")
        first = np.where(keep, pos, np.iinfo(np.int64).max).min(1)
        self._roll_back(seqs, first)
        n = int(keep.sum())
        if n > len(self._token):
            raise ValueError(f"llama.cpp backend: {n} tokens in one call; the context takes "
                             f"{len(self._token)}")
        self._token[:n] = tok[keep]
        self._pos[:n] = pos[keep]
        self._seq[:n] = np.broadcast_to(seqs[:, None], (B, T))[keep]
        self._wants[:n] = wants[keep]
        self._batch.n_tokens = n
        code = self.lib.llama_decode(self._ctx, self._batch)
        if code != 0:
            raise RuntimeError(f"llama_decode returned {code} for {n} tokens over {B} rows "
                               f"(positions up to {int(pos.max())}; max {self.max_positions})")
        self._stored[seqs] = np.where(keep, pos + 1, 0).max(1)
        # outputs come back in batch order: row by row, positions ascending
        V = self.config.vocab_size
        logits = np.ctypeslib.as_array(self.lib.llama_get_logits(self._ctx),
                                       shape=(int(wants.sum()), V))
        if ragged is not None:
            return torch.from_numpy(logits)[ragged], None
        out = torch.empty(B, out_idx.shape[1], V)
        out.view(-1, V).numpy()[:] = logits
        return out, None

    def _roll_back(self, seqs: np.ndarray, first: np.ndarray) -> None:
        """Drop each sequence's entries from the position it is fed from; refuse a gap."""
        stored = self._stored[seqs]
        gap = first > stored
        if gap.any():
            s = int(seqs[gap][0])
            raise ValueError(f"llama.cpp backend: row {s} is fed from position "
                             f"{int(first[gap][0])} but its cache holds positions < "
                             f"{int(self._stored[s])}")
        # one C call per row that rolls back (llama.cpp's API is per sequence)
        for s, p in zip(seqs[first < stored].tolist(), first[first < stored].tolist(),
                        strict=True):
            self.lib.llama_memory_seq_rm(self._memory, s, p, -1)
        self._stored[seqs] = np.minimum(stored, first)
