"""Load an engine dir (``paradraft build``) from its manifest alone: the verifier engine and
the drafters it was built with. The CLI and the Triton model both start here.

Also the engine graphs' I/O, shared by the ONNX Runtime and TensorRT backends: the step
inputs, the correction inputs, and the write-back of a step's K/V into the ``KVCache``."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from .correction import Randoms
from .model import KVCache, ModelConfig
from .speculative import DRAFTERS, Drafter


def load_engines(
    engine_dir: str | Path, self_draft_layers: int | None = None, threads: int | None = None,
    draft_threads: int | None = 1,
) -> tuple[object, dict[str, Drafter], Path | None, dict]:
    """Returns (verifier engine, {drafter kind: Drafter}, tokenizer.json path or None,
    manifest). Refuses (naming the file) an engine dir whose files are missing or changed.

    ``threads``: ONNX Runtime intra-op threads of the verifier (default: torch's);
    ``draft_threads``: of every drafting graph (None: ``threads``). One by default: a draft
    call is a few hundred tiny nodes, and waking a second (non-spinning) worker for them
    costs more than it saves (measured on 2 cores: the fused 4-step draft 1.6 -> 1.24 ms,
    the parallel draft 0.61 -> 0.47 ms at batch 1, no loss at batch 8)."""
    if draft_threads is not None and (not isinstance(draft_threads, int)
                                      or isinstance(draft_threads, bool) or draft_threads < 1):
        raise ValueError(f"draft_threads must be an integer >= 1 or None; got {draft_threads!r}")
    from paradraft.build.manifest import read_manifest

    engine_dir = Path(engine_dir)
    manifest = read_manifest(engine_dir)
    if manifest["backend"] not in ("onnx", "tensorrt"):
        raise ValueError(f"{engine_dir}: backend {manifest['backend']!r} is not supported by "
                         "this runtime; supported: onnx, tensorrt")
    from .onnx_backend import OrtModel

    def engine(name: str, threads: int | None = threads) -> OrtModel:
        if manifest["backend"] == "tensorrt":  # plans next to the ONNX graphs, on the GPU
            from .trt_backend import load_trt_model

            return load_trt_model(engine_dir, manifest, name)
        m = manifest["models"][name]
        graphs = {None: engine_dir / m["graphs"]["logits"]["file"]}
        if "self_draft" in m["graphs"]:
            g = m["graphs"]["self_draft"]
            graphs[g["num_layers"]] = engine_dir / g["file"]
        correction = m["graphs"].get("correction")
        # fused k-step draft graphs (roles draft_steps<k>, self_draft_steps<k>), if built
        draft_steps = {(g.get("num_layers"), g["k"]): engine_dir / g["file"]
                       for role, g in m["graphs"].items() if role.startswith(
                           ("draft_steps", "self_draft_steps"))}
        return OrtModel(ModelConfig(**m["config"]), graphs,
                        engine_dir / correction["file"] if correction else None, threads,
                        draft_steps, draft_threads)

    verifier = engine("verifier")
    drafters: dict[str, Drafter] = {}
    built_kinds = manifest["drafters"]
    for kind in sorted(built_kinds, key=DRAFTERS.index):  # model, parallel, self
        name = built_kinds[kind]
        if kind == "self":
            built = manifest["models"]["verifier"]["graphs"]["self_draft"]["num_layers"]
            if self_draft_layers not in (None, built):
                raise ValueError(f"self_draft_layers must be {built} for the engines in "
                                 f"{engine_dir} (rebuild with --self-draft-layers); "
                                 f"got {self_draft_layers}")
            drafters[kind] = Drafter("self", verifier, num_layers=built)
        else:
            # a separate draft engine only drafts
            drafters[kind] = Drafter(kind, engine(name, draft_threads or threads))
    tokenizer = engine_dir / manifest["tokenizer"] if manifest.get("tokenizer") else None
    return verifier, drafters, tokenizer, manifest


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
    if rows is None:
        rows = torch.arange(B, device=dev)
    if output_index is None:
        output_index = torch.arange(T, device=dev).expand(B, T)
    inputs = {"tokens": tokens.long().contiguous(), "input_pos": input_pos.long().contiguous(),
              "rows": rows.long().contiguous(), "output_index": output_index.long().contiguous(),
              "kv_len": torch.tensor(kv_len)}
    for i in range(n):
        inputs[f"past_k_{i}"] = cache.k[i]
        inputs[f"past_v_{i}"] = cache.v[i]
    return inputs


def write_back(cache: KVCache, new_kv: dict[str, Tensor], rows: Tensor, input_pos: Tensor
               ) -> None:
    """This step's K/V into the cache at (row, position), in place: Transformer.forward's
    writes (on the GPU, queued on the current stream after the plan)."""
    index = (rows[:, None], input_pos)
    for i in range(len(new_kv) // 2):
        cache.k[i].index_put_(index, new_kv[f"new_k_{i}"])
        cache.v[i].index_put_(index, new_kv[f"new_v_{i}"])


def correction_inputs(B: int, randoms: Randoms | None, draft_probs: Tensor | None,
                      num_drafted: Tensor | None, device: torch.device) -> dict[str, Tensor]:
    """The correction graph's extra inputs; absent (None) ones travel as empty tensors."""
    if randoms is None:  # greedy: no random numbers
        randoms = Randoms(torch.empty(B, 0, device=device), torch.empty(B, 0, device=device))
    probs = torch.empty(B, 0, 0, device=device) if draft_probs is None else draft_probs
    drafted = (torch.empty(0, dtype=torch.long, device=device) if num_drafted is None
               else num_drafted)
    return {"draft_probs": probs.float().contiguous(),
            "accept_uniforms": randoms.accept_uniforms.float().contiguous(),
            "sample_noise": randoms.sample_noise.float().contiguous(),
            "num_drafted": drafted.long().contiguous()}
