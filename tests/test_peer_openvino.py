"""``bench --peer openvino``: the plan and the comparison with the peer's rows, and the
refusals (OpenVINO itself is an optional extra in an environment of its own, not run here)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from paradraft.runtime.tools.bench import BenchRow
from paradraft.runtime.tools.peer_openvino import OpenVinoPeer, PeerError, compare, label


def fake_peer(monkeypatch, draft: bool = True) -> OpenVinoPeer:
    monkeypatch.setattr(OpenVinoPeer, "__post_init__", lambda self: None)
    return OpenVinoPeer(python="python", verifier=Path("v"), draft=Path("d") if draft else None,
                        precisions=("fp32", "int8"), cache_dir=Path("c"), threads=2)


def test_missing_openvino_is_refused_naming_the_packages():
    try:
        import openvino_genai  # noqa: F401
        pytest.skip("openvino_genai is installed here")
    except ImportError:
        pass
    with pytest.raises(PeerError, match=r"pip install openvino==.*openvino-genai==.*optimum"):
        OpenVinoPeer(python=sys.executable, verifier=Path("v"), draft=None,
                     precisions=("fp32",), cache_dir=Path("c"), threads=1)
    with pytest.raises(ValueError, match="openvino precisions must be"):
        OpenVinoPeer(python=sys.executable, verifier=Path("v"), draft=None,
                     precisions=("fp8",), cache_dir=Path("c"), threads=1)


def test_plan_has_plain_and_speculative_rows_per_precision(monkeypatch):
    rows = fake_peer(monkeypatch).plan([1, 8], [2, 4, 6])
    got = {(r.variant, r.k, r.batch_size) for r in rows}
    for p in ("fp32", "int8"):
        assert {(f"generate-{p}", 0, 1), (f"generate-{p}", 0, 8)} <= got
        assert {(f"speculative-{p}", k, 1) for k in (2, 4, 6)} <= got
        assert (f"speculative-{p}", 6, 8) not in got  # K <= 4 at larger batches, as ours
    assert all(r.system == "openvino" and r.rule == "greedy" for r in rows)
    assert {r.variant for r in fake_peer(monkeypatch, draft=False).plan([1], [4])} == {
        "generate-fp32", "generate-int8"}


def test_compare_takes_each_sides_fastest_row_and_checks_agreement(monkeypatch):
    peer = fake_peer(monkeypatch)
    ours = [BenchRow("ours", "baseline", "greedy", 0, 1, False),
            BenchRow("ours", "model", "greedy", 4, 1, False)]
    theirs = [BenchRow("openvino", "generate-int8", "greedy", 0, 1, False),
              BenchRow("openvino", "speculative-int8", "greedy", 4, 1, False)]
    for r, tps in zip(ours + theirs, ([10, 12], [30, 36], [20, 20], [15, 15]), strict=True):
        r.repeat_tokens_per_second = tps
    prompts = [[1, 2], [3]]
    peer.outputs[label(theirs[0])] = (prompts, [[5, 6, 7], [8, 9, 9]])
    peer.outputs[label(theirs[1])] = (prompts, [[5, 6, 0], [8, 9, 9]])
    reference = {(1, 2): [5, 6, 7], (3,): [8, 9, 9]}
    out = compare(ours + theirs, peer, reference)
    assert out["batch_1"]["openvino"] == label(theirs[0])
    assert out["batch_1"]["ratio"] == pytest.approx((30 / 20 + 36 / 20) / 2)
    assert out["rows"][label(theirs[0])]["identical_sequences"] == 1.0
    assert out["rows"][label(theirs[1])]["greedy_agreement"] == pytest.approx((2 / 3 + 1) / 2)


def test_cli_refuses_peer_options_without_the_peer(tmp_path, capsys):
    from paradraft.cli.main import main

    with pytest.raises(SystemExit):
        main(["bench", "--openvino-python", sys.executable, "--out", str(tmp_path)])
    assert "--openvino-python: only read with --peer openvino" in capsys.readouterr().err
