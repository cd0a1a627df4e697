"""Compressed verifier weights (``build --weights int8|int4``): MatMulNBits graphs, a smaller
engine dir, lossless greedy speculation with respect to the compressed verifier, the quality
report against the fp32 engines, and the refusals."""

from __future__ import annotations

import json

import pytest

from paradraft.build.onnx import build_engines
from paradraft.build.quantize import (
    ACCURACY_LEVEL,
    BLOCK_SIZES,
    check_block_size,
    matmul_nbits_nodes,
    weight_bytes,
)
from paradraft.runtime.backends.loader import load_engines
from paradraft.runtime.backends.manifest import graph_precisions
from paradraft.runtime.correction import RuleParams
from paradraft.runtime.speculative import SpeculativeDecoder
from paradraft.runtime.tools.evaluate import prefix_agreement, weights_quality

PROMPTS = [[4, 8, 15], [16, 23, 42, 7, 7, 3, 1], [9]]


def weight_matmuls(path) -> int:
    """MatMuls of the graph at ``path`` whose second input is a weight (an initializer)."""
    import onnx

    g = onnx.load(str(path), load_external_data=False).graph
    weights = {t.name for t in g.initializer}
    return sum(n.op_type == "MatMul" and n.input[1] in weights for n in g.node)


@pytest.fixture(scope="module", params=["int8", "int4"])
def compressed(request, pair, tmp_path_factory):
    """(weights, engine dir) of the ``pair`` checkpoints built with compressed weights;
    the drafting graphs follow the verifier (``draft_precision="float32"``, as the CLI)."""
    vdir, ddir, _, _ = pair
    out = tmp_path_factory.mktemp(request.param)
    build_engines(vdir, out, ddir, self_draft_layers=1, max_k=3, draft_precision="float32",
                  weights_dtype=request.param, weights_block_size=16, calibrate_rules=False)
    return request.param, out


def test_graphs_hold_matmulnbits_and_the_engine_dir_shrinks(compressed, pair_engines):
    weights, out = compressed
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["weights_dtype"] == weights and manifest["weights_block_size"] == 16
    assert graph_precisions(manifest) == {"verifier": weights, "draft": weights}
    for model in manifest["models"].values():
        for role, g in model["graphs"].items():
            assert g["precision"] == weights, role
            nodes = matmul_nbits_nodes(out / g["file"])
            assert nodes, role
            assert {(n["bits"], n["block_size"], n["accuracy_level"]) for n in nodes} == {
                ({"int8": 8, "int4": 4}[weights], 16, ACCURACY_LEVEL[weights] or None)}
    # every weight MatMul became a MatMulNBits (attention's products stay MatMuls)
    assert len(matmul_nbits_nodes(out / "verifier.onnx")) == weight_matmuls(
        pair_engines / "verifier.onnx") > 3
    for name in ("verifier.weights", "draft.weights"):
        assert (out / name).stat().st_size < 0.6 * (pair_engines / name).stat().st_size


def test_greedy_speculation_equals_greedy_plain_on_the_compressed_verifier(compressed):
    """Lossless with respect to the verifier that runs: greedy speculation with every
    drafter gives exactly the compressed verifier's own greedy tokens."""
    _, out = compressed
    verifier, drafters, _, _ = load_engines(out)
    plain = SpeculativeDecoder(verifier, None, RuleParams("greedy"), k=0, max_batch_size=3,
                               acceptance_floor=0.0).generate(PROMPTS, 16).token_ids
    for kind in ("model", "self"):
        dec = SpeculativeDecoder(verifier, drafters[kind], RuleParams("greedy"), k=3,
                                 max_batch_size=3, acceptance_floor=0.0)
        got = dec.generate(PROMPTS, 16)
        assert got.token_ids == plain, kind
        assert got.stats.draft_tokens > 0, kind


def test_weights_quality_against_the_fp32_engines(compressed, pair_engines):
    _, out = compressed
    reference, _, _, _ = load_engines(pair_engines)
    engine, _, _, _ = load_engines(out)
    pairs = [(p, [5, 6, 7, 8, 9, 10]) for p in PROMPTS]
    ref, got = weights_quality({"fp32": reference, "compressed": engine}, "fp32", pairs,
                               max_new_tokens=6, batch_size=3)
    assert (ref.top1_agreement, ref.greedy_agreement, ref.identical_sequences) == (1, 1, 1)
    assert ref.kl_from_reference == 0
    assert ref.greedy_perplexity > 0 and got.heldout_perplexity > 0
    # a compressed verifier is another function: close, not equal
    assert 0 < got.kl_from_reference < 0.5
    assert got.top1_agreement > 0.5


def test_prefix_agreement_counts_up_to_the_first_difference():
    assert prefix_agreement([[1, 2, 3, 4], [5, 6]], [[1, 2, 9, 4], [5, 6]]) == (0.75, 0.5)
    assert prefix_agreement([[1]], [[2]]) == (0.0, 0.0)
    with pytest.raises(ValueError, match="pairs sequences"):
        prefix_agreement([[1]], [])


def test_weight_bytes_follow_bits_and_blocks():
    fp32 = 576 * 1536 * 4
    int4, int8 = (weight_bytes(576, 1536, w, 32) for w in ("int4", "int8"))
    assert int4 < int8 < fp32 / 3
    assert weight_bytes(576, 1536, "int4", 16) > int4  # more blocks: more scales


@pytest.mark.parametrize("bad", [0, 8, 24, 512, True, 32.0])
def test_block_size_outside_the_range_is_refused_by_name(bad, pair, tmp_path):
    with pytest.raises(ValueError, match="weights_block_size must be one of 16, 32"):
        check_block_size(bad)
    with pytest.raises(ValueError, match="weights_block_size"):
        build_engines(pair[0], tmp_path, weights_dtype="int4", weights_block_size=bad)
    assert not (tmp_path / "verifier.weights").exists()  # refused before the export
    assert BLOCK_SIZES == (16, 32, 64, 128, 256)


def test_cli_refuses_weights_options_it_does_not_read(tmp_path, capsys):
    from paradraft.cli.main import main

    for argv, message in [
        (["--weights-block-size", "32"], "--weights-block-size: only read with --weights"),
        (["--weights", "int4", "--backend", "tensorrt"], "only --backend onnx runs MatMulNBits"),
        (["--weights", "int4", "--weights-dtype", "float16"], "give one"),
    ]:
        with pytest.raises(SystemExit):
            main(["build", "--out", str(tmp_path), *argv])
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse names the choices
        main(["build", "--out", str(tmp_path), "--weights", "int2"])
    assert "choose from 'int8', 'int4'" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_eval_refuses_engines_without_a_reference(pair_engines, tmp_path, capsys):
    from paradraft.cli.main import main

    with pytest.raises(SystemExit):
        main(["eval", "--engines", str(pair_engines), "--out", str(tmp_path)])
    assert "--engines and --reference-engines go together" in capsys.readouterr().err
