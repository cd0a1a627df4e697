"""``paradraft build --backend tensorrt``: the ONNX engine dir → TensorRT plans + manifest.

The plans are built from the graphs ``paradraft.build.onnx`` exports (same names, same I/O,
same semantics), one ``<graph>.plan`` next to each ``<graph>.onnx``, with the TensorRT Python
API: ``OnnxParser`` → builder config (optimisation profiles from the manifest limits,
precision, timing cache) → ``build_serialized_network``. The correction graph's
``CausalCorrection`` node becomes the TensorRT plugin of the same name, registered by
``paradraft.runtime.backends.trt_plugin.register_plugin()`` before that graph is parsed.

The manifest keeps the ONNX graphs (a correction plan for other rule parameters is built from
them on first use) and adds, per graph, ``plan`` and its ``profiles``; the plans' sha256 join
the checksums; ``backend`` becomes ``tensorrt``; ``tensorrt`` records the version, precision
and GPU that built them. The graphs' inputs and outputs stay fp32 (so does the KV cache):
``precision`` only sets the math inside the plans.

Unverified here: no GPU and no TensorRT on the development machine. The profile and manifest
logic are plain Python and tested; the calls into TensorRT are tested against a stand-in only.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from paradraft.runtime.backends.manifest import MANIFEST, read_manifest, sha256_file, write_manifest
from paradraft.runtime.backends.trt_plans import (
    REQUIREMENT,
    ROLE_PROFILES,
    Limits,
    build_plan,
    import_tensorrt,
    precision_flag,
)

from .onnx import build_engines as build_onnx

TIMING_CACHE = "timing.cache"

def plan_file(onnx_file: str) -> str:
    return str(Path(onnx_file).with_suffix(".plan"))


def plan_files(manifest: dict) -> list[str]:
    return sorted(g["plan"] for m in manifest["models"].values()
                  for g in m["graphs"].values() if "plan" in g)


def tensorrt_manifest(manifest: dict, precision: str, version: str,
                      timing_cache: str | None, device: str | None) -> dict:
    """The ONNX manifest (its graphs carrying ``plan`` / ``profiles``) as a TensorRT one."""
    return {**manifest, "backend": "tensorrt",
            "tensorrt": {"version": version, "precision": precision, "requirement": REQUIREMENT,
                         "device": device, "timing_cache": timing_cache},
            "versions": {**manifest.get("versions", {}), "tensorrt": version}}


def write_tensorrt_manifest(engine_dir: str | Path, manifest: dict) -> dict:
    """write_manifest (ONNX graphs + tokenizer), plus the plans' sha256 in ``checksums``."""
    engine_dir = Path(engine_dir)
    manifest = write_manifest(engine_dir, manifest)
    checksums = {**manifest["checksums"],
                 **{f: sha256_file(engine_dir / f) for f in plan_files(manifest)}}
    manifest["checksums"] = dict(sorted(checksums.items()))
    (engine_dir / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


# -- the build (TensorRT) -----------------------------------------------------------------


def gpu_name() -> str | None:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def source_manifest(engine_dir: Path) -> dict:
    """The manifest of the ONNX engine dir plans are built from; refuses another backend and
    int8 drafting graphs (ONNX Runtime's dynamic quantization ops; TensorRT's precision is
    ``--precision``)."""
    manifest = read_manifest(engine_dir)
    if manifest["backend"] != "onnx":
        raise ValueError(f"{engine_dir}: plans are built from an onnx engine dir; its backend "
                         f"is {manifest['backend']!r}")
    if manifest.get("draft_precision", "float32") != "float32":
        raise ValueError(f"{engine_dir}: draft_precision must be float32 to build TensorRT "
                         f"plans; got {manifest['draft_precision']!r} (rebuild with "
                         "--draft-precision float32)")
    return manifest


def build_plans(engine_dir: str | Path, precision: str = "fp32",
                timing_cache: str | Path | None = None) -> dict:
    """Build a plan for every graph of an ONNX engine dir (in place) and rewrite its manifest
    as a TensorRT one. ``timing_cache``: reused and updated (default: in the engine dir)."""
    engine_dir = Path(engine_dir)
    manifest = source_manifest(engine_dir)
    trt = import_tensorrt()
    precision_flag(precision, trt.__version__)  # refuse before the first (slow) build
    limits = Limits(**manifest["limits"])
    cache_path = Path(timing_cache) if timing_cache else engine_dir / TIMING_CACHE
    cache = cache_path.read_bytes() if cache_path.is_file() else b""
    for model in manifest["models"].values():
        for role, graph in model["graphs"].items():
            if role not in ROLE_PROFILES:  # fused draft graphs: ONNX Runtime only
                continue
            plan, profiles, cache = build_plan(
                trt, (engine_dir / graph["file"]).read_bytes(), ROLE_PROFILES[role], limits,
                model["config"], precision, cache, plugin=role == "correction",
                name=graph["file"], path=engine_dir / graph["file"])
            graph["plan"] = plan_file(graph["file"])
            graph["profiles"] = profiles
            (engine_dir / graph["plan"]).write_bytes(plan)
            cache_path.write_bytes(cache)  # per plan: an interrupted build keeps its timings
    inside = cache_path.resolve().parent == engine_dir.resolve()
    manifest = tensorrt_manifest(manifest, precision, trt.__version__,
                                 cache_path.name if inside else str(cache_path), gpu_name())
    return write_tensorrt_manifest(engine_dir, manifest)


def build_engines(verifier_dir: str | Path, out_dir: str | Path, *args, precision: str = "fp32",
                  timing_cache: str | Path | None = None, **kwargs) -> dict:
    """``paradraft.build.onnx.build_engines`` (same arguments), then the plans. Refuses a
    missing TensorRT, int8 drafting graphs or an unusable precision before the ONNX export."""
    kwargs.setdefault("fused_drafts", False)  # ONNX Runtime graphs: no plan uses them
    if kwargs.setdefault("draft_precision", "float32") != "float32":
        raise ValueError("draft_precision must be float32 for TensorRT plans (their math is "
                         f"precision={precision!r}); got {kwargs['draft_precision']!r}")
    trt = import_tensorrt()
    precision_flag(precision, trt.__version__)
    build_onnx(verifier_dir, out_dir, *args, **kwargs)
    return build_plans(out_dir, precision, timing_cache)
