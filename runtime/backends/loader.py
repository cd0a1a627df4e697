"""Load an engine dir (``paradraft build``) from its manifest alone: the verifier engine and
the drafters it was built with, and the model-free ``ngram`` drafter, which every engine dir
has (it needs nothing but the verifier's verify pass). The CLI and the Triton model both
start here."""

from __future__ import annotations

from pathlib import Path

from ..drafters import DRAFTERS, AnyDrafter, Drafter
from ..model import ModelConfig
from .llamacpp import LlamaCppModel
from .manifest import MANIFEST, read_manifest
from .ort import OrtModel
from .trt import load_trt_model


def model_config(engine_dir: Path, name: str, config: dict) -> ModelConfig:
    """Model ``name``'s ModelConfig from the manifest, or a refusal naming the manifest: an
    engine dir built by a version whose ModelConfig had other fields must be rebuilt."""
    try:
        return ModelConfig(**config)
    except TypeError as e:
        raise ValueError(f"{engine_dir / MANIFEST}: model {name!r} has a config this version "
                         f"cannot read ({e}); rebuild the engines") from None


def cache_positions(limits: dict) -> int:
    """Positions per row an engine that keeps its own cache must hold: the decoder writes a
    round's drafts and verify positions past a row's length (its margin, 2K + 2)."""
    return limits["max_seq_len"] + 2 * limits["max_k"] + 2


def load_engines(
    engine_dir: str | Path, self_draft_layers: int | None = None, threads: int | None = None,
    draft_threads: int | None = None, ngram_min: int | None = None, ngram_max: int | None = None,
    slots: int | None = None, ngram_batched_min: int | None = None,
    ngram_shared: bool | None = None, **suffix_options: int | float,
) -> tuple[object, dict[str, AnyDrafter], Path | None, dict]:
    """Returns (verifier engine, {drafter kind: Drafter}, tokenizer.json path or None,
    manifest). Refuses (naming the file) an engine dir whose files are missing or changed.

    ``threads``: ONNX Runtime intra-op threads of the verifier (default: torch's), or
    llama.cpp's threads; ``draft_threads``: of every drafting graph. Default: one for ONNX
    Runtime, where a draft call is a few hundred tiny nodes and waking a second
    (non-spinning) worker for them costs more than it saves (docs/results.md); ``threads``
    for llama.cpp, whose draft step is a whole model's matrix products. ``ngram_min`` /
    ``ngram_max`` / ``ngram_batched_min`` / ``ngram_shared``: the ngram drafter's settings
    (default: NgramDrafter's); ``suffix_options``: the suffix drafter's (SuffixDrafter's
    fields, by name). ``slots``:
    the cache slots of an engine that keeps its own cache (llama.cpp's sequences; default:
    the limits' max_batch_size), which a server's prefix cache may make more than the rows
    of a round."""
    if draft_threads is not None and (not isinstance(draft_threads, int)
                                      or isinstance(draft_threads, bool) or draft_threads < 1):
        raise ValueError(f"draft_threads must be an integer >= 1 or None; got {draft_threads!r}")
    engine_dir = Path(engine_dir)
    manifest = read_manifest(engine_dir)
    if manifest["backend"] not in ("onnx", "tensorrt", "llamacpp"):
        raise ValueError(f"{engine_dir}: backend {manifest['backend']!r} is not supported by "
                         "this runtime; supported: onnx, tensorrt, llamacpp")
    if draft_threads is None:
        draft_threads = threads if manifest["backend"] == "llamacpp" else 1

    def engine(name: str, threads: int | None = threads) -> OrtModel:
        if manifest["backend"] == "tensorrt":  # plans next to the ONNX graphs, on the GPU
            return load_trt_model(engine_dir, manifest, name)
        if manifest["backend"] == "llamacpp":  # the GGUF itself; llama.cpp keeps the cache
            m, limits = manifest["models"][name], manifest["limits"]
            return LlamaCppModel(
                engine_dir / m["weights"], model_config(engine_dir, name, m["config"]),
                slots or limits["max_batch_size"], cache_positions(limits), threads)
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
        return OrtModel(model_config(engine_dir, name, m["config"]), graphs,
                        engine_dir / correction["file"] if correction else None, threads,
                        draft_steps, draft_threads)

    verifier = engine("verifier")
    drafters: dict[str, AnyDrafter] = {}
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
            drafters[kind] = Drafter(kind, engine(name, draft_threads))
    drafters["ngram"] = Drafter("ngram", ngram_min=ngram_min, ngram_max=ngram_max,
                                ngram_batched_min=ngram_batched_min, ngram_shared=ngram_shared)
    drafters["suffix"] = Drafter("suffix", **suffix_options)
    drafters["grammar"] = Drafter("grammar")
    tokenizer = engine_dir / manifest["tokenizer"] if manifest.get("tokenizer") else None
    return verifier, drafters, tokenizer, manifest
