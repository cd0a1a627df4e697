"""``ENGINE_DIR/manifest.json``: the engine set a runtime loads, and nothing else.

It names every file (graphs, each model's weights file, tokenizer) with its sha256, says
which graph plays which role, and records the model configs, limits, dtype, backend, rule
defaults and the versions that built it. ``read_manifest`` refuses an engine dir whose files
are missing or changed, naming the file, so a half-copied or edited engine never runs.
"""

from __future__ import annotations

import json
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from ..drafters import DRAFTERS, MODEL_FREE_DRAFTERS
from ..gguf import sha256_file

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


def package_versions(names: tuple[str, ...] = ("paradraft", "torch", "onnx", "onnxruntime",
                                               "onnxruntime-extensions")) -> dict[str, str]:
    out = {}
    for name in names:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "not installed"
    return out


def weight_files(manifest: dict) -> list[str]:
    """The models' weights files (``<model>.weights``, which their graphs point into)."""
    return sorted({m["weights"] for m in manifest["models"].values() if m.get("weights")})


def write_manifest(engine_dir: str | Path, manifest: dict) -> dict:
    """Add the sha256 of every file the manifest names, write manifest.json, return it."""
    engine_dir = Path(engine_dir)
    files = set(weight_files(manifest))
    for model in manifest["models"].values():
        files.update(g["file"] for g in model["graphs"].values())
    if manifest.get("tokenizer"):
        files.add(manifest["tokenizer"])
    manifest = {"format_version": FORMAT_VERSION, **manifest,
                "checksums": {f: sha256_file(engine_dir / f) for f in sorted(files)}}
    (engine_dir / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def read_manifest(engine_dir: str | Path, verify: bool = True) -> dict:
    """Load manifest.json; with ``verify``, refuse missing files and checksum mismatches."""
    engine_dir = Path(engine_dir)
    path = engine_dir / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"missing {path} (build one with `paradraft build`)")
    manifest = json.loads(path.read_text(encoding="utf-8"))
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: format_version must be {FORMAT_VERSION}; "
                         f"got {manifest.get('format_version')!r}")
    if verify:
        weights = set(weight_files(manifest))
        for name, digest in manifest["checksums"].items():
            f = engine_dir / name
            what = "weights file" if name in weights else "engine file"
            if not f.is_file():
                raise FileNotFoundError(f"{what} {f} named in {path} is missing")
            if sha256_file(f) != digest:
                raise ValueError(f"{what} {f} does not match its sha256 in {path} "
                                 "(rebuild the engines)")
    return manifest


def engine_drafter(manifest: dict, engine_dir: str | Path, asked: str | None) -> str:
    """The drafter to run from an engine dir: ``asked``, refused (naming the drafters the dir
    has) when the dir was not built with it; unset, the dir's first in ``DRAFTERS`` order
    (a separate draft model before a parallel one before the self-draft). Called before
    anything starts, so a server never dies on a drafter its engines lack."""
    # a model-free drafter needs no graph: every engine dir has it (last in DRAFTERS order)
    built = [d for d in DRAFTERS if d in manifest["drafters"] or d in MODEL_FREE_DRAFTERS]
    if asked is None:
        return built[0]
    if asked not in built:
        raise ValueError(f"drafter {asked!r} was not built into {engine_dir}; it has: "
                         f"{', '.join(built)} (rebuild with `paradraft build` and the draft's "
                         "flag, or choose one of those)")
    return asked


def graph_precisions(manifest: dict) -> dict[str, str]:
    """{model: the weights precision of its step graph} ("float32", "float16", "int8",
    "int4"; ONNX engine dirs record one per graph), e.g. for reports next to the figures."""
    return {name: m["graphs"].get("logits", {}).get("precision", manifest.get("dtype", "?"))
            for name, m in manifest["models"].items()}
