"""Load an engine dir (``paradraft build``) from its manifest alone: the verifier engine and
the drafters it was built with. The CLI and the Triton model both start here."""

from __future__ import annotations

from pathlib import Path

from .model import ModelConfig
from .speculative import DRAFTERS, Drafter


def load_engines(
    engine_dir: str | Path, self_draft_layers: int | None = None, threads: int | None = None
) -> tuple[object, dict[str, Drafter], Path | None, dict]:
    """Returns (verifier engine, {drafter kind: Drafter}, tokenizer.json path or None,
    manifest). Refuses (naming the file) an engine dir whose files are missing or changed."""
    from paradraft.build.manifest import read_manifest

    engine_dir = Path(engine_dir)
    manifest = read_manifest(engine_dir)
    if manifest["backend"] not in ("onnx", "tensorrt"):
        raise ValueError(f"{engine_dir}: backend {manifest['backend']!r} is not supported by "
                         "this runtime; supported: onnx, tensorrt")
    from .onnx_backend import OrtModel

    def engine(name: str) -> OrtModel:
        if manifest["backend"] == "tensorrt":  # plans next to the ONNX graphs, on the GPU
            from .trt_backend import load_trt_model

            return load_trt_model(engine_dir, manifest, name)
        m = manifest["models"][name]
        graphs = {None: engine_dir / m["graphs"]["logits"]["file"]}
        if "self_draft" in m["graphs"]:
            g = m["graphs"]["self_draft"]
            graphs[g["num_layers"]] = engine_dir / g["file"]
        correction = m["graphs"].get("correction")
        return OrtModel(ModelConfig(**m["config"]), graphs,
                        engine_dir / correction["file"] if correction else None, threads)

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
            drafters[kind] = Drafter(kind, engine(name))
    tokenizer = engine_dir / manifest["tokenizer"] if manifest.get("tokenizer") else None
    return verifier, drafters, tokenizer, manifest
