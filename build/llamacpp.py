"""``paradraft build --backend llamacpp``: an engine dir that runs GGUF files through llama.cpp.

Nothing is exported: llama.cpp reads the GGUF's own quantized blocks. The engine dir holds
each model's GGUF (a hard link where the file system allows, else a copy, so the dir stands
alone), the config and tokenizer files imported from the verifier's GGUF metadata
(``import_gguf(weights=False)``: the decoder, drafters and tokenizer read these), and a
manifest whose checksums cover the GGUFs. The draft must speak the verifier's tokenizer.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path

from paradraft.runtime.backends.manifest import package_versions, write_manifest
from paradraft.runtime.checkpoints import check_draft_vocab
from paradraft.runtime.correction import RuleParams
from paradraft.runtime.gguf import import_gguf, is_gguf
from paradraft.runtime.model import load_config

from .onnx import TOKENIZER_EXTRAS, check_limits

VERSIONS = ("paradraft", "torch", "llama-cpp-python", "gguf")


def _place(src: Path, dst: Path) -> None:
    """``dst`` becomes ``src``'s bytes: a hard link (no copy of a GB file), else a copy."""
    dst.unlink(missing_ok=True)
    try:
        os.link(src, dst)
    except OSError:  # another file system, or links not allowed
        shutil.copyfile(src, dst)


def _gguf_arg(path: str | Path | None, name: str) -> Path | None:
    if path is None:
        return None
    path = Path(path)
    if not is_gguf(path):
        raise ValueError(f"--backend llamacpp reads GGUF files; {name} {path} is not one "
                         "(convert it with llama.cpp's convert_hf_to_gguf.py, or build it "
                         "with --backend onnx)")
    return path


def build_engines(
    verifier: str | Path,
    out_dir: str | Path,
    draft: str | Path | None = None,
    rule_defaults: RuleParams | None = None,
    max_batch_size: int = 8,
    max_k: int = 8,
    max_seq_len: int = 512,
) -> dict:
    """Write the llama.cpp engine dir of GGUF ``verifier`` (and GGUF ``draft``) to
    ``out_dir``; returns its manifest."""
    verifier_gguf = _gguf_arg(verifier, "verifier")
    draft_gguf = _gguf_arg(draft, "draft")
    rule_defaults = rule_defaults or RuleParams("greedy")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    models: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as scratch:
        sources = {"verifier": verifier_gguf, "draft": draft_gguf}
        dirs = {}
        for name, gguf in sources.items():
            if gguf is None:
                continue
            dirs[name] = import_gguf(gguf, Path(scratch) / name, weights=False)
        vc = load_config(dirs["verifier"])
        check_limits(max_batch_size, max_k, max_seq_len, vc)
        if "draft" in dirs:
            dc = load_config(dirs["draft"])
            if dc.vocab_size != vc.vocab_size:
                raise ValueError(f"draft {draft_gguf}: vocab_size {dc.vocab_size} differs from "
                                 f"the verifier's {vc.vocab_size}; llama.cpp drafts must not "
                                 "be padded differently")
            check_draft_vocab(dirs["verifier"], vc.vocab_size, dirs["draft"], dc.vocab_size)
        for name, gguf in sources.items():
            if gguf is None:
                continue
            _place(gguf, out / f"{name}.gguf")
            models[name] = {"source": str(gguf.resolve()),
                            "config": asdict(load_config(dirs[name])),
                            "weights": f"{name}.gguf", "graphs": {}}
        for f in ("tokenizer.json", *TOKENIZER_EXTRAS):
            if (dirs["verifier"] / f).is_file():
                shutil.copyfile(dirs["verifier"] / f, out / f)
    manifest = {
        "backend": "llamacpp",
        "dtype": "float32",  # of the logits; the weights keep the GGUF's own types
        "vocab_size": vc.vocab_size,
        "limits": {"max_batch_size": max_batch_size, "max_k": max_k,
                   "max_seq_len": max_seq_len},
        "tokenizer": "tokenizer.json",
        "rule_defaults": asdict(rule_defaults),
        "calibration": None,
        "models": models,
        "drafters": {"model": "draft"} if "draft" in models else {},
        "versions": package_versions(VERSIONS),
    }
    return write_manifest(out, manifest)
