"""ONNX engines: the step graph against the torch model (slot subsets, duplicate positions),
the manifest's refusals, build-time draft checks, and the CLI build + generate --engines."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import VOCAB, run_cli, run_cli_process, save_hf, tiny_config, transformers

from paradraft.build.onnx import build_engines
from paradraft.runtime.backends.loader import load_engines
from paradraft.runtime.correction import RuleParams
from paradraft.runtime.drafters import Drafter
from paradraft.runtime.model import load_model, new_kv_cache
from paradraft.runtime.speculative import SpeculativeDecoder


@pytest.fixture(scope="module")
def engines(pair_engines):
    return load_engines(pair_engines)


def test_step_graph_equals_torch_on_slot_subsets_and_duplicate_positions(pair, engines):
    """Write-then-attend semantics: ragged prefill into slots 3 and 1, then a parallel-draft
    style step whose clamped positions repeat 0, then a rolled-back step that overwrites."""
    torch_model, engine = load_model(pair[0]), engines[0]
    caches = [new_kv_cache(torch_model.config, 4, 24, torch.float32) for _ in range(2)]
    rows = torch.tensor([3, 1])
    g = torch.Generator().manual_seed(0)
    steps = [  # (tokens, positions, kv_len)
        (torch.randint(0, VOCAB, (2, 5), generator=g), torch.arange(5).expand(2, -1), 5),
        (torch.tensor([[7, 7, 7, 9], [5, 6, 2, 2]]), torch.tensor([[0, 0, 0, 1], [4, 5, 6, 7]]),
         10),
        (torch.randint(0, VOCAB, (2, 3), generator=g), torch.tensor([[1, 2, 3], [5, 6, 7]]), 10),
    ]
    for tokens, pos, kv_len in steps:
        outs = [m(tokens, pos, cache, kv_len=kv_len, rows=rows)[0]
                for m, cache in zip((torch_model, engine), caches, strict=True)]
        assert (outs[0] - outs[1]).abs().max() < 1e-4
    for a, b in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v, strict=True):
        assert (a - b).abs().max() < 1e-5
    # output_index and the self-draft graph (first layer only)
    tokens, pos = torch.tensor([[3, 4], [5, 6]]), torch.tensor([[4, 5], [8, 9]])
    idx = torch.tensor([[1], [0]])
    outs = [m(tokens, pos, cache, kv_len=12, rows=rows, output_index=idx, num_layers=1)[0]
            for m, cache in zip((torch_model, engine), caches, strict=True)]
    assert outs[1].shape == (2, 1, VOCAB) and (outs[0] - outs[1]).abs().max() < 1e-4


def test_engine_errors_name_the_parameter(engines):
    engine = engines[0]
    cache = new_kv_cache(engine.config, 1, 8, torch.float32)
    tokens, pos = torch.tensor([[1, 2]]), torch.tensor([[0, 1]])
    with pytest.raises(ValueError, match="audit=True"):
        engine(tokens, pos, cache, audit=True)
    with pytest.raises(ValueError, match=r"kv_len must be > max\(input_pos\) = 1"):
        engine(tokens, pos, cache, kv_len=1)
    with pytest.raises(ValueError, match="num_layers=2: no graph"):
        engine(tokens, pos, cache, num_layers=2)
    # the correction op: a sampling rule without random numbers is refused by correct()
    step = torch.tensor([[1, 2, 3]]), torch.tensor([[0, 1, 2]])
    with pytest.raises(ValueError, match=r"CausalCorrection failed: .*needs random numbers"):
        engine.verify_and_correct(*step, cache, RuleParams("threshold"), None)
    dec = SpeculativeDecoder(engine, None, RuleParams("greedy"), audit_epsilon=0.1,
                             max_batch_size=1)
    with pytest.raises(ValueError, match="not supported on the ONNX Runtime backend"):
        dec.generate([[1, 2]], 3)


def test_manifest_records_the_engine_set(pair_engines):
    m = json.loads((pair_engines / "manifest.json").read_text())
    assert m["backend"] == "onnx" and m["dtype"] == "float32" and m["opset"] >= 17
    assert m["vocab_size"] == VOCAB
    assert set(m["drafters"]) == {"model", "parallel", "self"}
    v = m["models"]["verifier"]["graphs"]
    fused_ks = range(2, m["limits"]["max_k"] + 1)  # the fused k-step greedy draft graphs
    assert set(v) == {"logits", "correction", "self_draft",
                      *(f"self_draft_steps{k}" for k in fused_ks)}
    assert v["self_draft"]["num_layers"] == 1
    assert all(v[f"self_draft_steps{k}"]["num_layers"] == 1 for k in fused_ks)
    assert set(m["models"]["draft"]["graphs"]) == {"logits", *(f"draft_steps{k}"
                                                               for k in fused_ks)}
    assert set(m["models"]["parallel_draft"]["graphs"]) == {"logits"}  # one pass already
    assert set(m["checksums"]) == {
        "verifier.onnx", "verifier_correction.onnx", "verifier_self1.onnx", "draft.onnx",
        "parallel_draft.onnx", *(f"draft_steps{k}.onnx" for k in fused_ks),
        *(f"verifier_self1_steps{k}.onnx" for k in fused_ks),
        "verifier.weights", "draft.weights", "parallel_draft.weights"}
    for name, model in m["models"].items():  # one weights file per model, a precision per graph
        assert model["weights"] == f"{name}.weights"
        assert {g["precision"] for g in model["graphs"].values()} == {"float32"}
    assert {"paradraft", "torch", "onnx", "onnxruntime"} <= set(m["versions"])
    op = m["custom_ops"]["CausalCorrection"]
    assert op == {"domain": "paradraft", "plugin_version": "1", "plugin_namespace": "paradraft"}
    import onnx

    graph = onnx.load(str(pair_engines / "verifier_correction.onnx")).graph
    node = next(n for n in graph.node if n.op_type == "CausalCorrection")
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert node.domain == "paradraft" and attrs["plugin_version"] == b"1"
    assert attrs["plugin_namespace"] == b"paradraft" and attrs["rule"] == b"greedy"
    assert [o.name for o in graph.output][:3] == ["num_accepted", "next_token", "accepted_tokens"]


def external_ranges(path: Path) -> set[tuple[str, int, int]]:
    """(file, offset, length) of every external tensor of a graph."""
    import onnx

    ranges = set()
    for t in onnx.load(str(path), load_external_data=False).graph.initializer:
        if t.data_location == t.EXTERNAL:
            info = {e.key: e.value for e in t.external_data}
            ranges.add((info["location"], int(info.get("offset", 0)), int(info["length"])))
    return ranges


def weight_bytes(path: Path) -> int:
    """The bytes of the weights a graph holds (inline or external, each range once)."""
    import onnx

    inline = sum(len(t.raw_data) for t in onnx.load(str(path), load_external_data=False)
                 .graph.initializer if t.data_location != t.EXTERNAL)
    return inline + sum(length for *_, length in external_ranges(path))


def fp32_weight_bytes(model_dir) -> int:
    """A checkpoint's weights in fp32, a tied LM head counted apart from the embedding (the
    graph holds it transposed)."""
    model = load_model(model_dir)
    return 4 * sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))


def graph_ops_list(path: Path) -> list[str]:
    import onnx

    return [n.op_type for n in onnx.load(str(path)).graph.node]


def graph_ops(path: Path) -> set[str]:
    return set(graph_ops_list(path))


def test_int8_drafting_graphs_keep_the_output_and_shrink_the_drafts(pair, pair_engines,
                                                                    tmp_path):
    """The default build quantizes the drafting graphs (drafts, self-draft) and nothing else:
    greedy speculation still gives the verifier's own greedy tokens with every drafter, and
    the int8 drafts still get drafts accepted."""
    vdir, ddir, pdir, _ = pair
    out = tmp_path / "int8"
    m = build_engines(vdir, out, ddir, pdir, self_draft_layers=1, max_k=4)
    assert m["draft_precision"] == "int8"
    assert m["models"]["draft"]["graphs"]["logits"]["precision"] == "int8"
    assert m["models"]["verifier"]["graphs"]["self_draft"]["precision"] == "int8"
    for name in ("draft.onnx", "parallel_draft.onnx", "verifier_self1.onnx",
                 "draft_steps4.onnx", "verifier_self1_steps4.onnx"):
        assert "MatMulInteger" in graph_ops(out / name)
        # every weight quantized, in every step of a fused graph: only attention stays fp32
        assert sum(op == "MatMul" for op in graph_ops_list(out / name)) == sum(
            op == "MatMul" for op in graph_ops_list(pair_engines / name)) - sum(
            op == "MatMulInteger" for op in graph_ops_list(out / name))
        assert "MatMulInteger" not in graph_ops(pair_engines / name)
    assert all(g["precision"] == "int8" for name, model in m["models"].items()
               for role, g in model["graphs"].items() if (name, role) not in (
                   ("verifier", "logits"), ("verifier", "correction")))
    for name in ("draft.onnx", "parallel_draft.onnx", "verifier_self1.onnx"):
        assert weight_bytes(out / name) < weight_bytes(pair_engines / name) / 2
    # a draft model's int8 graphs share one file, which holds no fp32 copy of its matrices
    ranges = set().union(*(external_ranges(out / g["file"])
                           for g in m["models"]["draft"]["graphs"].values()))
    assert {f for f, *_ in ranges} == {"draft.weights"}
    assert sum(n for *_, n in ranges) == (out / "draft.weights").stat().st_size
    assert (out / "draft.weights").stat().st_size < fp32_weight_bytes(ddir) / 2
    for name in ("verifier.onnx", "verifier_correction.onnx"):  # the verifier decides: fp32
        assert "MatMulInteger" not in graph_ops(out / name)
    verifier, drafters, _, _ = load_engines(out)
    prompts, max_new = [[4, 8, 15], [16, 23, 42, 7, 7, 3, 1], [9]], 20
    truth = SpeculativeDecoder(load_model(vdir), None, RuleParams("greedy"),
                               max_batch_size=3).generate(prompts, max_new).token_ids
    for kind, drafter in drafters.items():
        dec = SpeculativeDecoder(verifier, drafter, RuleParams("greedy"), k=4, max_batch_size=3,
                                 acceptance_floor=0.0)
        got = dec.generate(prompts, max_new)
        assert got.token_ids == truth, kind
        # (the grammar's own proposals need a grammar: unconstrained, it drafts nothing)
        assert got.stats.accepted_tokens > 0 or kind == "grammar", kind


@pytest.mark.parametrize("kind", ["model", "self"])
def test_fused_draft_graphs_draft_what_single_steps_draft(pair, engines, kind):
    """One fused call per block proposes exactly the drafts of k single-step calls, so every
    verify step accepts the same tokens (greedy, fp32 graphs): same output, same acceptance
    per position, for several K, ragged prompts and rows that finish early."""
    verifier, drafters, _, _ = engines
    fused = drafters[kind]
    loop_model = fused.model.single_step()
    loop = Drafter(kind, loop_model, num_layers=fused.num_layers)
    prompts, max_new = [[4, 8, 15], [16, 23, 42, 7, 7, 3, 1], [9], [5, 5]], [24, 9, 24, 17]
    for k in (2, 3, 5):
        runs = []
        for d in (fused, loop):
            dec = SpeculativeDecoder(verifier, d, RuleParams("greedy"), k=k, max_batch_size=4,
                                     acceptance_floor=0.0)
            runs.append(dec.generate(prompts, max_new))
        got, want = runs
        assert got.token_ids == want.token_ids
        assert got.stats.accepted_per_position == want.stats.accepted_per_position
        assert got.stats.accepted_tokens > 0
        assert (fused.num_layers if kind == "self" else None, k) in fused.model._draft_steps
        assert not loop_model._draft_steps  # the reference really took single steps
    truth = SpeculativeDecoder(load_model(pair[0]), None, RuleParams("greedy"),
                               max_batch_size=4).generate(prompts, max_new).token_ids
    assert got.token_ids == truth


def test_drafting_graphs_run_on_their_own_thread_count(pair_engines, monkeypatch):
    """The verifier's graph gets ``threads``, every drafting graph (draft model, parallel
    draft, self-draft layers, fused steps) ``draft_threads``: one by default (None), else
    as given. A bad count is refused by name. Workers spin only within a run. The decoder
    runs its own torch ops on one thread unless top-p sorts the vocabulary; the sessions
    keep their counts."""
    from paradraft.runtime.backends.ort import Graph

    def intra_op(graph) -> int:
        return graph.session.get_session_options().intra_op_num_threads

    seen = []  # torch's thread count whenever a graph runs inside the decoder
    run = Graph.run
    monkeypatch.setattr(Graph, "run", lambda self, inputs, outputs: (
        seen.append(torch.get_num_threads()), run(self, inputs, outputs)))
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(2)  # so that one glue thread is a change (CI may have one core)
    try:
        for draft_threads, want in ((None, 1), (2, 2)):
            verifier, drafters, _, _ = load_engines(pair_engines, threads=2,
                                                    draft_threads=draft_threads)
            dec = SpeculativeDecoder(verifier, drafters["self"], RuleParams("greedy"), k=3,
                                     max_batch_size=1)
            dec.generate([[4, 8, 15]], 6)
            # K=1 drafts through the first-N-layers graph itself (no fused graph for one step)
            SpeculativeDecoder(verifier, drafters["self"], RuleParams("greedy"), k=1,
                               max_batch_size=1).generate([[4, 8, 15]], 4)
            for kind in ("model", "parallel"):
                SpeculativeDecoder(verifier, drafters[kind], RuleParams("greedy"), k=3,
                                   max_batch_size=1).generate([[4, 8, 15]], 6)
            assert seen and set(seen) == {1}  # the decoder's torch ops on one thread...
            assert torch.get_num_threads() == 2  # ...only inside the decoder
            options = verifier._graphs[None].session.get_session_options()
            assert options.intra_op_num_threads == 2  # made inside it, still 2 threads
            # workers spin between a run's nodes and stop when it ends (a worker left
            # spinning takes a core from the decoder between calls)
            assert options.get_session_config_entry("session.intra_op.allow_spinning") == "1"
            assert options.get_session_config_entry("session.force_spinning_stop") == "1"
            drafting = [verifier._graphs[1], *verifier._draft_steps.values(),
                        *drafters["model"].model._graphs.values(),
                        *drafters["model"].model._draft_steps.values(),
                        *drafters["parallel"].model._graphs.values()]
            # the draft model's single-step graph is never loaded: its prefill is lazy and
            # reads the prompt in the fused K-step graph's first step
            assert not drafters["model"].model._graphs
            assert len(drafting) == 4
            assert [intra_op(g) for g in drafting] == [want] * 4
        # the default (torch's count) is taken at load time, not inside the decoder
        verifier, drafters, _, _ = load_engines(pair_engines)
        SpeculativeDecoder(verifier, drafters["model"], RuleParams("greedy"), k=3,
                           max_batch_size=1).generate([[4, 8, 15]], 6)
        assert intra_op(verifier._graphs[None]) == 2
        # sampling, with top-p too, on one thread: the top-p set takes a few histogram
        # passes (top_p_floor), not a sort over the vocabulary
        for top_p in (1.0, 0.9):
            seen.clear()
            SpeculativeDecoder(verifier, drafters["model"], RuleParams("exact", top_p=top_p),
                               k=3, max_batch_size=1).generate([[4, 8, 15]], 6)
            assert seen and set(seen) == {1}
    finally:
        torch.set_num_threads(torch_threads)
    with pytest.raises(ValueError, match="draft_threads must be an integer >= 1"):
        load_engines(pair_engines, draft_threads=0)


def test_fused_draft_check_refuses_another_models_graph(pair, tmp_path):
    """The build's check of a fused draft graph fails when the graph is not the model's."""
    from paradraft.build.onnx import check_draft_steps, export_draft_steps

    model = load_model(pair[1])
    path = export_draft_steps(model, tmp_path / "draft_steps3.onnx", 3)
    assert check_draft_steps(model, path, 3) < 1e-3
    other = load_model(pair[1])
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(1.5)
    with pytest.raises(RuntimeError, match="fused drafts trail torch's argmax"):
        check_draft_steps(other, path, 3)


def test_build_refuses_unknown_draft_precision_and_trt_plans_of_int8_drafts(pair, tmp_path):
    vdir, ddir, _, _ = pair
    with pytest.raises(ValueError, match="draft_precision must be one of int8, float32; "
                                         "got 'fp16'"):
        build_engines(vdir, tmp_path / "a", ddir, draft_precision="fp16")
    from paradraft.build.tensorrt import build_plans

    build_engines(vdir, tmp_path / "b", ddir, max_k=2)
    # refused from the manifest, before TensorRT is even imported (so also on this CPU)
    with pytest.raises(ValueError, match="draft_precision must be float32 to build TensorRT"):
        build_plans(tmp_path / "b")


@pytest.mark.parametrize("damage", ["missing", "changed"])
@pytest.mark.parametrize("victim", ["engine file draft.onnx", "weights file verifier.weights",
                                    "weights file draft.weights"])
def test_manifest_refuses_missing_or_changed_files(pair_engines, tmp_path, damage, victim):
    engine_dir = tmp_path / "engines"
    shutil.copytree(pair_engines, engine_dir)
    what, name = victim.rsplit(" ", 1)
    path = engine_dir / name
    if damage == "missing":
        path.unlink()
        with pytest.raises(FileNotFoundError, match=rf"{what} \S*{name} .*is missing"):
            load_engines(engine_dir)
    else:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 1
        path.write_bytes(bytes(data))
        with pytest.raises(ValueError, match=rf"{what} \S*{name} does not match its sha256"):
            load_engines(engine_dir)


def test_loader_refuses_a_config_it_cannot_read(pair_engines, tmp_path):
    """An engine dir whose manifest config has fields this ModelConfig lacks (built by
    another version) is refused by name, not with a TypeError."""
    engine_dir = tmp_path / "engines"
    shutil.copytree(pair_engines, engine_dir)
    path = engine_dir / "manifest.json"
    m = json.loads(path.read_text())
    m["models"]["verifier"]["config"]["eos_token_id"] = 0  # an older field name
    path.write_text(json.dumps(m))
    with pytest.raises(ValueError, match=r"manifest\.json: model 'verifier' has a config this "
                                         r"version cannot read .*rebuild the engines"):
        load_engines(engine_dir)


def test_graphs_of_a_model_share_one_weights_file(pair, pair_engines, tmp_path):
    """Every graph keeps its weights outside (ONNX external data) in its model's one
    ``<model>.weights`` file, each tensor once: the engine dir is about the size of the
    models' fp32 weights, not of its twenty graphs. A copy of the dir elsewhere loads (the
    graphs name their weights file relative to themselves) and answers like torch."""
    import onnx

    from paradraft.build.onnx import INLINE_BYTES

    m = json.loads((pair_engines / "manifest.json").read_text())
    fp32 = {"verifier": fp32_weight_bytes(pair[0]), "draft": fp32_weight_bytes(pair[1]),
            "parallel_draft": fp32_weight_bytes(pair[2])}
    for name, model in m["models"].items():
        weights = pair_engines / model["weights"]
        assert weights.stat().st_size <= 1.3 * fp32[name], name
        # every byte of it is used, each by whichever graphs need it (no padding: these
        # tiny models have no tensor of ALIGN_FROM bytes, the ones aligned)
        ranges = set().union(*(external_ranges(pair_engines / g["file"])
                               for g in model["graphs"].values()))
        assert sum(n for *_, n in ranges) == weights.stat().st_size, name
        for g in model["graphs"].values():
            graph = onnx.load(str(pair_engines / g["file"]), load_external_data=False).graph
            for t in graph.initializer:
                if t.data_location == t.EXTERNAL:
                    assert {e.key: e.value for e in t.external_data}["location"] == weights.name
                else:
                    assert len(t.raw_data) < INLINE_BYTES, (g["file"], t.name)
            # the graph file itself: nodes and shape constants only
            assert (pair_engines / g["file"]).stat().st_size < 256 * 1024, g["file"]
    files = list(pair_engines.iterdir())
    graphs = sum(f.stat().st_size for f in files if f.suffix == ".onnx")
    assert graphs < 3 * 1024 * 1024  # 20 graphs of the 3-layer models
    total = sum(f.stat().st_size for f in files)
    assert total <= 1.3 * sum(fp32.values()) + graphs + 64 * 1024  # + manifest
    assert {f.name for f in files if f.suffix == ".weights"} == {
        "verifier.weights", "draft.weights", "parallel_draft.weights"}
    # moved elsewhere, the dir still loads and answers like torch
    moved = tmp_path / "moved"
    shutil.copytree(pair_engines, moved)
    verifier, drafters, _, _ = load_engines(moved)
    tokens, pos = torch.tensor([[4, 8, 15, 16]]), torch.tensor([[0, 1, 2, 3]])
    for engine, model_dir, layers in ((verifier, pair[0], None), (verifier, pair[0], 1),
                                      (drafters["model"].model, pair[1], None)):
        want = load_model(model_dir)(tokens, pos, new_kv_cache(engine.config, 1, 8,
                                                               torch.float32),
                                     num_layers=layers)[0]
        got = engine(tokens, pos, new_kv_cache(engine.config, 1, 8, torch.float32),
                     num_layers=layers)[0]
        assert (want - got).abs().max() < 1e-4


def test_float16_weights_halve_the_weights_files_and_stay_close_to_torch(pair, pair_engines,
                                                                        tmp_path):
    """``weights_dtype="float16"`` (``build --weights-dtype float16``, for TensorRT plans):
    the weights files hold fp16, cast back to fp32 inside the graphs, so the engine I/O and
    the KV cache stay fp32 and the ORT backend still runs them, within fp16 rounding."""
    import onnx

    from paradraft.build.onnx import FP16_TOL

    vdir, ddir, _, _ = pair
    out = tmp_path / "fp16"
    m = build_engines(vdir, out, ddir, self_draft_layers=1, draft_precision="float32",
                      max_k=2, weights_dtype="float16")
    assert m["weights_dtype"] == "float16"
    assert {g["precision"] for model in m["models"].values()
            for g in model["graphs"].values()} == {"float16"}
    for name in ("verifier.weights", "draft.weights"):
        assert (out / name).stat().st_size <= 0.55 * (pair_engines / name).stat().st_size
    graph = onnx.load(str(out / "verifier.onnx"), load_external_data=False).graph
    assert [i.type.tensor_type.elem_type for i in graph.input if i.name.startswith("past_")
            ] == [onnx.TensorProto.FLOAT] * 6  # the KV cache stays fp32
    assert any(t.data_type == onnx.TensorProto.FLOAT16 for t in graph.initializer)
    verifier, drafters, _, _ = load_engines(out)
    tokens, pos = torch.tensor([[4, 8, 15, 16]]), torch.tensor([[0, 1, 2, 3]])
    for engine, model_dir in ((verifier, vdir), (drafters["model"].model, ddir)):
        want = load_model(model_dir)(tokens, pos, new_kv_cache(engine.config, 1, 8,
                                                               torch.float32))[0]
        got = engine(tokens, pos, new_kv_cache(engine.config, 1, 8, torch.float32))[0]
        assert 0 < (want - got).abs().max() < FP16_TOL * want.std()
    with pytest.raises(ValueError, match="weights_dtype must be one of float32, float16, "
                                         "int8, int4; "
                                         "got 'bfloat16'"):
        build_engines(vdir, tmp_path / "bad", weights_dtype="bfloat16")


def drifting_draft(tmp_path) -> str:
    """A valid random llama draft whose int8 weights drift: large random weights (std 2,
    twice transformers' largest initializer_range) make a chaotic network in which int8
    rounding grows through the layers until it changes the argmax, past the build's
    tolerance (asserted by the caller)."""
    torch.manual_seed(0)
    cfg = tiny_config("llama", layers=3, tie_word_embeddings=False, initializer_range=1.0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if weight.dim() == 2 and "embed" not in name:
                weight.mul_(2.0)
    return save_hf(model, tmp_path / "drifting_draft")


def test_default_build_builds_a_drifting_int8_draft_in_float32(pair, tmp_path):
    """``build`` with default flags never refuses a valid checkpoint for its draft's
    precision: an int8 drafting graph past its tolerance is built in float32, the CLI warns
    naming the graph, and the manifest records the precision per graph. Output unchanged."""
    from paradraft.build.onnx import (
        INT8_TOL,
        GraphMismatch,
        check_graph,
        export_step,
        quantize_draft,
    )

    vdir = pair[0]
    ddir = drifting_draft(tmp_path)
    # the precondition: this draft's int8 step graph really drifts past INT8_TOL (while
    # its fp32 export is exact), so the build below cannot pass vacuously
    draft = load_model(ddir)
    probe = tmp_path / "probe"
    probe.mkdir()
    fp32 = export_step(draft, probe / "draft.onnx")
    assert check_graph(draft, fp32) < 1e-3
    int8 = quantize_draft(fp32, probe / "draft.int8.onnx")
    with pytest.raises(GraphMismatch, match="ONNX's argmax trails torch's"):
        check_graph(draft, int8, tol=INT8_TOL, relative=True, drafts_only=True)

    out = tmp_path / "engines"
    r = run_cli_process("build", "--verifier", vdir, "--draft", ddir, "--backend", "onnx",
                "--out", str(out), "--max-k", "2", "--self-draft-layers", "1")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "DraftPrecisionWarning: draft.onnx: int8 weights drift" in r.stderr
    assert "built in float32 instead" in r.stderr
    m = json.loads((out / "manifest.json").read_text())
    assert m["draft_precision"] == "int8"  # what was asked; each graph says what it got
    graphs = m["models"]["draft"]["graphs"]
    assert graphs["logits"]["precision"] == "float32"
    for role, g in {**graphs, **m["models"]["verifier"]["graphs"]}.items():
        warned = f"DraftPrecisionWarning: {g['file']}:" in r.stderr
        assert g["precision"] == ("float32" if warned or role in ("logits", "correction")
                                  else "int8"), (role, g)
    assert "MatMulInteger" not in graph_ops(out / "draft.onnx")
    assert m["models"]["verifier"]["graphs"]["self_draft"]["precision"] == "int8"
    # the fp32 draft graph drafts; the verifier decides: its own greedy output
    verifier, drafters, _, _ = load_engines(out)
    prompts = [[4, 8, 15], [16, 23, 42, 7]]
    truth = SpeculativeDecoder(load_model(vdir), None, RuleParams("greedy"),
                               max_batch_size=2).generate(prompts, 12).token_ids
    dec = SpeculativeDecoder(verifier, drafters["model"], RuleParams("greedy"), k=2,
                             max_batch_size=2, acceptance_floor=0.0)
    assert dec.generate(prompts, 12).token_ids == truth


def test_build_refuses_a_draft_with_another_vocabulary(pair, tmp_path):
    torch.manual_seed(0)
    other = transformers.AutoModelForCausalLM.from_config(tiny_config("llama", vocab=67))
    ddir = save_hf(other, tmp_path / "draft67")
    with pytest.raises(ValueError, match=r"vocab_size 67 differs from the verifier's 61"):
        build_engines(pair[0], tmp_path / "out", ddir)


def test_build_refuses_a_draft_with_another_tokenizer(pair, tmp_path):
    from tokenizers import Tokenizer, models

    dirs = []
    for name, words in [("verifier", ["a", "b"]), ("draft", ["a", "c"])]:
        d = tmp_path / name
        shutil.copytree(pair[0 if name == "verifier" else 1], d)
        vocab = {w: i for i, w in enumerate(["<unk>", *words])}
        Tokenizer(models.WordLevel(vocab, unk_token="<unk>")).save(str(d / "tokenizer.json"))
        dirs.append(d)
    with pytest.raises(ValueError, match=r"draft .*tokenizer.json model.vocab differs"):
        build_engines(dirs[0], tmp_path / "out", dirs[1])




def test_cli_build_then_generate_with_engines_equals_torch(pair, tmp_path):
    vdir, ddir, pdir, _ = pair
    out = tmp_path / "engines"
    r = run_cli("build", "--verifier", vdir, "--draft", ddir, "--parallel-draft", pdir,
                "--backend", "onnx", "--out", str(out), "--rule", "dynamic", "--tau", "0.25",
                "--draft-precision", "float32",  # exact acceptance counts: fp32 drafts
                "--max-k", "3")
    assert r.returncode == 0, r.stderr[-2000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["rule_defaults"]["rule"] == "dynamic"
    assert manifest["rule_defaults"]["tau"] == 0.25
    # K pinned: the torch run below drafts K=3 every round (the goodput policy may not)
    common = ["generate", "--prompt-ids", "4,8,15,16", "--max-new-tokens", "14", "--k", "3",
              "--rule", "greedy", "--json", "--ignore-eos", "--drafter", "parallel",
              "--draft-len-schedule", "1:3"]
    r = run_cli(*common, "--engines", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout)
    # the torch path, in process (same decoder code, torch models)
    dec = SpeculativeDecoder(load_model(vdir), Drafter("parallel", load_model(pdir)),
                             RuleParams("greedy"), k=3, max_batch_size=1)
    want = dec.generate([[4, 8, 15, 16]], 14)
    assert got["token_ids"] == want.token_ids[0] and len(got["token_ids"]) == 14
    assert got["stats"]["accepted_tokens"] == want.stats.accepted_tokens
    # limits from the manifest are enforced with a clear message
    r = run_cli(*common, "--engines", str(out), "--k", "4")
    assert r.returncode == 2 and "k must be <= 3 (the engines' max_k); got 4" in r.stderr
    # two draft threads: the same tokens; zero: refused by name
    r = run_cli(*common, "--engines", str(out), "--draft-threads", "2")
    assert r.returncode == 0 and json.loads(r.stdout)["token_ids"] == got["token_ids"]
    r = run_cli(*common, "--engines", str(out), "--draft-threads", "0")
    assert r.returncode == 2 and "draft_threads must be an integer >= 1" in r.stderr


DEMO = Path(__file__).resolve().parent.parent / "models" / "demo"


@pytest.mark.skipif(not (DEMO / "parallel_draft" / "config.json").is_file(),
                    reason="demo models not present")
def test_cli_bench_runs_both_backends_side_by_side(tmp_path):
    r = run_cli("bench", "--backends", "torch,onnx", "--prompts", "1", "--max-new-tokens", "6",
                "--ks", "2", "--batch-sizes", "1", "--drafters", "model,self",
                "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    data = json.loads((tmp_path / "bench.json").read_text())
    # the peers run transformers on torch once, whichever backends our rows ran on
    peers = [row for row in data["rows"] if row["system"] == "hf"]
    assert sorted(row["variant"] for row in peers) == ["assisted", "generate"]
    assert {row["backend"] for row in peers} == {"torch"}
    backends = {(row["backend"], row["variant"]) for row in data["rows"]}
    assert {("torch", "model"), ("onnx", "model"), ("onnx", "self")} <= backends
    onnx_rows = [row for row in data["rows"] if row["backend"] == "onnx"]
    assert all(row["speedup_vs_torch"] > 0 for row in onnx_rows)
    assert "geomean_speculative" in data["meta"]["vs_torch"]["onnx"]["batch_1"]
    assert data["meta"]["onnx_draft_precision"] == "int8"  # the build's default
    # the best config per backend, each with its own ratio over its own baseline
    for backend in ("torch", "onnx"):
        best = data["summary"]["backends"][backend]["batch_1"]
        rows = [row for row in data["rows"] if row["backend"] == backend
                and row["variant"] != "baseline" and not row["sampling"]]
        assert best["speedup_vs_baseline"] == max(row["speedup_vs_baseline"] for row in rows)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
def test_export_matches_torch_for_every_family(hf_models, family, tmp_path):
    from paradraft.build.onnx import check_graph, export_step

    model = load_model(hf_models[family][1])
    path = export_step(model, tmp_path / f"{family}.onnx")
    assert check_graph(model, path) < 1e-4
    path = export_step(model, tmp_path / f"{family}_self1.onnx", num_layers=1)
    assert check_graph(model, path, num_layers=1) < 1e-4


def test_fold_reshapes_folds_only_provable_targets():
    """A Reshape to its input's own traced dims becomes a constant target (0 = copy, one -1);
    a Reshape to another tensor's dims stays computed; the outputs are unchanged for inputs
    of other sizes, and plumbing nobody reads any more is gone."""
    np = pytest.importorskip("numpy")
    ort = pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper, numpy_helper

    from paradraft.build.onnx import fold_reshapes

    def const(name, values):
        return numpy_helper.from_array(np.array(values, dtype=np.int64), name)

    nodes = [helper.make_node("Shape", ["x"], ["x_shape"])]
    for i in (0, 1):
        nodes += [helper.make_node("Gather", ["x_shape", f"i{i}"], [f"x_dim{i}"]),
                  helper.make_node("Unsqueeze", [f"x_dim{i}", "axis0"], [f"x_d{i}"])]
    nodes += [
        helper.make_node("Concat", ["x_d0", "x_d1", "two_three"], ["own"], axis=0),
        helper.make_node("Reshape", ["x", "own"], ["a"]),  # [b, t, 2, 3]: folds to 0, 0, 2, 3
        helper.make_node("Concat", ["x_d0", "minus_one"], ["flat"], axis=0),
        helper.make_node("Reshape", ["x", "flat"], ["c"]),  # [b, t*6]: folds to 0, -1
        helper.make_node("Concat", ["x_d1", "x_d0", "six"], ["other"], axis=0),
        helper.make_node("Reshape", ["y", "other"], ["b"]),  # y by x's dims: must stay
        helper.make_node("Reshape", ["x", "own"], ["d"], allowzero=1),  # 0 would mean 0
        # x's own dims, swapped: not a copy of the same place, must stay computed
        helper.make_node("Concat", ["x_d1", "x_d0", "six"], ["swapped"], axis=0),
        helper.make_node("Reshape", ["x", "swapped"], ["e"]),
        # z [t, b, 6] to x's [b, t, 6]: same places, another tensor's dims: must stay
        helper.make_node("Concat", ["x_d0", "x_d1", "six"], ["x_dims"], axis=0),
        helper.make_node("Reshape", ["z", "x_dims"], ["f"]),
        # a slice of x's shape, as the exporter's flatten / unflatten write it: folds
        helper.make_node("Slice", ["x_shape", "zero", "two"], ["head"]),
        helper.make_node("Concat", ["head", "two_three"], ["sliced"], axis=0),
        helper.make_node("Reshape", ["x", "sliced"], ["h"]),
    ]
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "t", 6]),
         helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 6]),
         helper.make_tensor_value_info("z", TensorProto.FLOAT, ["t2", "b2", 6])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in "abcdefh"],
        [const("i0", 0), const("i1", 1), const("axis0", [0]), const("two_three", [2, 3]),
         const("minus_one", [-1]), const("six", [6]), const("zero", [0]),
         const("two", [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    before = model.SerializeToString()
    assert fold_reshapes(model) == 3
    targets = {i.name: numpy_helper.to_array(i).tolist() for i in model.graph.initializer}
    reshapes = {n.output[0]: n.input[1] for n in model.graph.node if n.op_type == "Reshape"}
    assert targets[reshapes["a"]] == [0, 0, 2, 3]
    assert targets[reshapes["c"]] == [0, -1]
    assert reshapes["b"] == "other"  # still computed from x's shape
    assert reshapes["d"] == "own"
    assert (reshapes["e"], reshapes["f"]) == ("swapped", "x_dims")
    assert targets[reshapes["h"]] == [0, 0, 2, 3]
    assert "flat" not in {o for n in model.graph.node for o in n.output}  # plumbing dropped
    runs = [ort.InferenceSession(m, providers=["CPUExecutionProvider"])
            for m in (before, model.SerializeToString())]
    for b, t in ((2, 3), (4, 5)):
        feed = {"x": np.random.rand(b, t, 6).astype(np.float32),
                "y": np.random.rand(b * t, 6).astype(np.float32),
                "z": np.random.rand(t, b, 6).astype(np.float32)}
        want, got = (s.run(None, feed) for s in runs)
        assert [w.shape for w in want] == [(b, t, 2, 3), (t, b, 6), (b, t * 6), (b, t, 2, 3),
                                           (t, b, 6), (b, t, 6), (b, t, 2, 3)]
        for w, g in zip(want, got, strict=True):
            np.testing.assert_array_equal(w, g)


def test_step_graph_has_no_runtime_computed_reshape_for_the_layers(pair, tmp_path):
    """The exported layer code reshapes only to constant targets (fold_reshapes + each
    reshape taking its B, T from its own input); only the K/V scatter keeps computed ones."""
    import onnx

    from paradraft.build.onnx import export_step

    path = export_step(load_model(pair[0]), tmp_path / "verifier.onnx")
    model = onnx.load(str(path))
    constant = {i.name for i in model.graph.initializer}
    producer = {o: n for n in model.graph.node for o in n.output}
    computed = [n for n in model.graph.node if n.op_type == "Reshape"
                and n.input[1] not in constant
                and producer.get(n.input[1], n).op_type != "Constant"]
    # none left: each layer's new K and V go into its window by ScatterElements, whose
    # shared index needs no reshape
    assert computed == [], [n.name for n in computed]


def test_build_makes_only_the_graphs_asked_and_refuses_a_missing_drafter(pair, tmp_path):
    """No self-draft graphs unless asked (--self-draft-layers or the verifier's config); a
    drafter the dir lacks is refused by generate and serve before anything loads, naming
    the drafters the dir has; unset, serve takes the dir's first (here the draft model)."""
    vdir, ddir, _, _ = pair
    out = tmp_path / "engines"
    build_engines(vdir, out, ddir, max_k=2, draft_precision="float32")
    m = json.loads((out / "manifest.json").read_text())
    assert set(m["drafters"]) == {"model"}
    assert not any(role.startswith("self_draft") for role in m["models"]["verifier"]["graphs"])
    assert not list(out.glob("verifier_self*"))
    # one copy of each weight: the weights file is no larger than the checkpoint's tensors
    verifier = load_model(vdir)
    assert (out / "verifier.weights").stat().st_size <= sum(
        p.numel() * 4 for p in verifier.parameters()) + (1 << 16)
    for command in (["generate", "--prompt-ids", "4,8", "--max-new-tokens", "2"],
                    ["serve", "--grpc-port", "1"]):
        r = run_cli(*command, "--engines", str(out), "--drafter", "self")
        assert r.returncode == 2, r.stderr[-2000:]
        assert f"drafter 'self' was not built into {out}; it has: model, ngram" in r.stderr
        assert "Traceback" not in r.stderr and "starting tritonserver" not in r.stderr
    from paradraft.cli import serve

    parser = argparse.ArgumentParser()
    serve.add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--engines", str(out)])
    assert serve.serve_config(args).drafter == "model"


def test_a_tied_embedding_is_stored_once_in_every_graph(tmp_path):
    """The exporter writes a tied embedding twice (the [V, D] table and the head's [D, V]
    MatMul weight); tie_head keeps one, also in a fused k-step graph that embeds k times,
    and the graphs still compute what torch does."""
    import onnx

    from paradraft.build.onnx import (
        check_draft_steps,
        check_graph,
        export_draft_steps,
        export_step,
    )

    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(
        tiny_config("llama", layers=2, vocab=1000, tie_word_embeddings=True)).eval()
    model = load_model(save_hf(hf, tmp_path / "tied"))
    assert model.config.tie_embeddings
    for path, check in [
        (export_step(model, tmp_path / "step.onnx"), lambda p: check_graph(model, p)),
        (export_draft_steps(model, tmp_path / "steps3.onnx", 3),
         lambda p: check_draft_steps(model, p, 3)),
    ]:
        graph = onnx.load(str(path), load_external_data=False).graph
        vocab_sized = [t.name for t in graph.initializer if 1000 in t.dims]
        assert len(vocab_sized) == 1, vocab_sized
        assert check(path) < 1e-3


def test_an_int8_tied_draft_dequantizes_only_the_rows_it_looks_up(tmp_path):
    """With a tied embedding the lookup reads the int8 LM head (``tie_head``). ONNX Runtime's
    quantizer gives the lookups that follow the head (a fused k-step graph's later steps) a
    DequantizeLinear of the whole table, run on every call; ``quantize_draft`` moves the
    dequantize after the lookup. The drafts and K/V are the same to the bit as the
    quantizer's own graph."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from paradraft.build.onnx import export_draft_steps, export_step, quantize_draft
    from paradraft.runtime.backends.ort import OrtModel

    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(
        tiny_config("llama", layers=2, vocab=1000, tie_word_embeddings=True)).eval()
    model = load_model(save_hf(hf, tmp_path / "tied"))
    c = model.config
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, c.vocab_size, (2, 4), generator=g)
    pos = torch.tensor([[0, 1, 2, 3], [2, 3, 4, 5]])

    def run(path: Path, k: int | None) -> list[torch.Tensor]:
        engine = (OrtModel(c, {None: path}) if k is None
                  else OrtModel(c, {}, draft_steps={(None, k): path}))
        cache = new_kv_cache(c, 2, 16, torch.float32)
        out = (engine(tokens, pos, cache, kv_len=6)[0] if k is None
               else engine.greedy_drafts(tokens, pos, cache, k, kv_len=6 + k))
        return [out, cache.buffer]

    for k, fp32 in [(None, export_step(model, tmp_path / "step.onnx")),
                    (3, export_draft_steps(model, tmp_path / "steps3.onnx", 3))]:
        ours = quantize_draft(fp32, tmp_path / f"ours{k}.onnx")
        theirs = tmp_path / f"theirs{k}.onnx"
        quantize_dynamic(fp32, theirs, op_types_to_quantize=["MatMul"], per_channel=False,
                         weight_type=QuantType.QInt8, use_external_data_format=True)
        graphs = {p: onnx.load(str(p), load_external_data=False).graph for p in (ours, theirs)}
        tables = {p: [n for n in g.node if n.op_type == "DequantizeLinear"
                      and n.input[0] in {t.name for t in g.initializer}]
                  for p, g in graphs.items()}
        assert tables[ours] == []
        if k is not None:  # the lookups after the head's quantized MatMul in node order
            assert tables[theirs], "precondition: the quantizer dequantizes the whole table"
            assert any(n.op_type == "Gather" and n.input[0].endswith("_quantized")
                       for n in graphs[ours].node)
        for a, b in zip(run(ours, k), run(theirs, k), strict=True):
            assert torch.equal(a, b)
