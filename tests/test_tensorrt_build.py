"""TensorRT engines without TensorRT: the optimisation profiles against the decoder's real
calls, the backend's bookkeeping (ONNX Runtime standing in for the plans), the build flow and
manifest against a stand-in ``tensorrt`` module, the clear errors when TensorRT or a GPU is
missing, and the CLI. Nothing here runs TensorRT itself: that path is unverified here."""

from __future__ import annotations

import shutil
import sys
import types

import pytest
import torch

from paradraft.build import tensorrt as trt_build
from paradraft.build.tensorrt import build_plans
from paradraft.runtime.backends import trt_plugin
from paradraft.runtime.backends.manifest import read_manifest, sha256_file
from paradraft.runtime.backends.trt import (
    ALIGNMENT,
    TrtModel,
    check_limits,
    choose_profile,
    misfit,
    prepare,
)
from paradraft.runtime.backends.trt_plans import (
    REQUIREMENT,
    ROLE_PROFILES,
    Limits,
    Range,
    TensorRTUnavailable,
    dim_ranges,
    import_tensorrt,
    input_dims,
    make_profile,
    parse_version,
    precision_flag,
)
from paradraft.runtime.correction import RuleParams, draw_randoms, sampling_probs
from paradraft.runtime.drafters import Drafter
from paradraft.runtime.model import load_model, new_kv_cache
from paradraft.runtime.speculative import SpeculativeDecoder

LIMITS = Limits(max_batch_size=8, max_k=4, max_seq_len=512)
CONFIG = {"vocab_size": 61, "n_kv_heads": 2, "head_dim": 12}
STEP_INPUTS = ["tokens", "input_pos", "rows", "output_index", "kv_len",
               "past_k_0", "past_v_0", "past_k_1", "past_v_1"]
# the last prompt is longer than 2·max_k tokens: its prefill needs the prefill profile
PROMPTS = [[4, 8, 15], [16, 23, 42, 7, 7, 3, 1], [9], list(range(1, 21))]
MAX_NEW = [24, 9, 17, 6]


# -- profiles ------------------------------------------------------------------------------


def test_dim_ranges_follow_the_limits():
    decode, prefill = dim_ranges("decode", LIMITS, 61), dim_ranges("prefill", LIMITS, 61)
    assert decode["tokens"] == Range(1, 5, 8)  # verify K+1 tuned; parallel draft up to 2K
    assert prefill["tokens"] == Range(1, 128, 512) and prefill["outputs"] == Range(1, 1, 512)
    for r in (decode, prefill):
        assert r["batch"] == r["slots"] == Range(1, 8, 8)
        assert r["cache_len"] == Range(1, 522, 522)  # 512 + 2·4 + 2: the decoder's margin
        assert r["draft_k"].min == r["draft_vocab"].min == r["drafted_batch"].min == 0
    with pytest.raises(ValueError, match="decode or prefill"):
        dim_ranges("train", LIMITS, 61)
    with pytest.raises(ValueError, match="min <= opt <= max"):
        Range(2, 1, 3)


def test_cache_len_is_the_decoders_cache(pair):
    verifier = load_model(pair[0])
    limits = Limits(max_batch_size=3, max_k=5, max_seq_len=64)
    dec = SpeculativeDecoder(verifier, Drafter("self", verifier, num_layers=1), k=limits.max_k,
                             max_batch_size=limits.max_batch_size,
                             max_seq_len=limits.max_seq_len)
    assert dec.cache.max_seq_len == limits.cache_len
    assert dec.cache.num_slots == limits.max_batch_size


def test_make_profile_shapes_every_input():
    p = make_profile("decode", STEP_INPUTS, LIMITS, CONFIG, {"kv_len"})
    assert p["name"] == "decode"
    assert p["shapes"]["tokens"] == [[1, 1], [8, 5], [8, 8]]
    assert p["shapes"]["output_index"] == [[1, 1], [8, 5], [8, 8]]
    assert p["shapes"]["past_v_1"] == [[1, 1, 2, 12], [8, 522, 2, 12], [8, 522, 2, 12]]
    assert p["shapes"]["kv_len"] == [[], [], []]
    assert p["values"] == {"kv_len": [[1], [522], [522]]}
    c = make_profile("decode", ["draft_probs", "accept_uniforms", "sample_noise", "num_drafted"],
                     LIMITS, CONFIG)
    assert c["shapes"]["draft_probs"] == [[1, 0, 0], [8, 4, 61], [8, 4, 61]]
    assert c["shapes"]["num_drafted"] == [[0], [8], [8]]
    assert c["values"] == {}
    with pytest.raises(ValueError, match="unexpected graph input 'attention_mask'"):
        make_profile("decode", ["attention_mask"], LIMITS, CONFIG)
    with pytest.raises(ValueError, match=r"'rows'.*shape tensor"):
        make_profile("decode", STEP_INPUTS, LIMITS, CONFIG, {"rows"})
    assert input_dims("past_k_7", 2, 12) == ("slots", "cache_len", 2, 12)


def test_choose_profile_prefers_decode_and_names_the_misfit():
    profiles = [make_profile(k, STEP_INPUTS, LIMITS, CONFIG, {"kv_len"})
                for k in ROLE_PROFILES["logits"]]
    past = {f"past_{kv}_{i}": (8, 522, 2, 12) for i in range(2) for kv in "kv"}

    def shapes(B, T, T_out):
        return {"tokens": (B, T), "input_pos": (B, T), "rows": (B,), "output_index": (B, T_out),
                "kv_len": (), **past}

    assert choose_profile(profiles, shapes(3, 5, 5), {"kv_len": 40}) == 0
    assert choose_profile(profiles, shapes(3, 300, 1), {"kv_len": 300}) == 1
    assert misfit(profiles[0], shapes(3, 5, 5), {"kv_len": 600}) == (
        "kv_len = 600 is outside [1, 522]")
    with pytest.raises(ValueError, match=r"tokens shape \[9, 5\].*--max-batch-size"):
        choose_profile(profiles, shapes(9, 5, 5), {"kv_len": 40})
    with pytest.raises(ValueError, match=r"prefill: tokens shape \[1, 513\]"):
        choose_profile(profiles, shapes(1, 513, 1), {"kv_len": 513})


def test_precision_flags_and_versions():
    assert parse_version("10.9.0.34") == (10, 9, 0, 34)
    assert parse_version("10.13.0rc1") == (10, 13, 0)
    assert precision_flag("fp32", "11.4.0") is None
    assert precision_flag("fp16", "10.9.0") == "FP16"
    assert precision_flag("bf16", "10.16.1") == "BF16"
    with pytest.raises(ValueError, match=r"strongly typed.*--precision fp32"):
        precision_flag("fp16", "11.0.0")
    with pytest.raises(ValueError, match="precision must be one of fp32, fp16, bf16"):
        precision_flag("int8", "10.9.0")


# -- the backend's bookkeeping, ONNX Runtime standing in for the plans --------------------


class Checked:
    """A runner that checks every call against the profiles the build would give its graph
    (input names from the exported ONNX), then runs it with ONNX Runtime."""

    def __init__(self, graph, path, kinds, limits, config, seen):
        import onnx

        names = [i.name for i in onnx.load(str(path)).graph.input]
        self.profiles = [make_profile(k, names, limits, config, {"kv_len"}) for k in kinds]
        self.graph, self.path, self.seen = graph, path, seen

    def run(self, inputs, outputs):
        shapes = {n: tuple(t.shape) for n, t in inputs.items()}
        index = choose_profile(self.profiles, shapes, {"kv_len": int(inputs["kv_len"])},
                               str(self.path))
        self.seen.add((self.path.name, self.profiles[index]["name"]))
        bound = {n: prepare(t, t.dtype, n == "kv_len", torch.device("cpu"))
                 for n, t in inputs.items()}
        self.graph.run(bound, outputs)


def stand_in_models(engine_dir, seen):
    """TrtModels over ONNX Runtime runners, built from the engine dir's manifest."""
    from paradraft.runtime.backends.loader import load_engines
    from paradraft.runtime.backends.ort import Graph
    from paradraft.runtime.model import ModelConfig

    ort_verifier, _, _, manifest = load_engines(engine_dir)
    limits = Limits(**manifest["limits"])

    def model(name):
        m = manifest["models"][name]

        def loader(role):
            g = m["graphs"][role]
            path = engine_dir / g["file"]
            return lambda: Checked(Graph(path), path, ROLE_PROFILES[role], limits,
                                   m["config"], seen)

        graphs = {None: loader("logits")}
        if "self_draft" in m["graphs"]:
            graphs[m["graphs"]["self_draft"]["num_layers"]] = loader("self_draft")
        correction = None
        if "correction" in m["graphs"]:
            path = engine_dir / m["graphs"]["correction"]["file"]

            def correction(params):
                return Checked(ort_verifier.correction_graph(params), path,
                               ROLE_PROFILES["correction"], limits, m["config"], seen)

        return TrtModel(ModelConfig(**m["config"]), graphs, correction, device="cpu")

    return model("verifier"), model("draft"), model("parallel_draft")


@pytest.mark.parametrize("drafter", ["model", "parallel", "self"])
def test_trt_model_bookkeeping_gives_torch_tokens_within_the_profiles(pair, pair_engines,
                                                                      drafter):
    seen: set = set()
    verifier, draft, parallel = stand_in_models(pair_engines, seen)
    drafters = {"model": Drafter("model", draft), "parallel": Drafter("parallel", parallel),
                "self": Drafter("self", verifier, num_layers=1)}
    tv = load_model(pair[0])
    reference = {"model": Drafter("model", load_model(pair[1])),
                 "parallel": Drafter("parallel", load_model(pair[2])),
                 "self": Drafter("self", tv, num_layers=1)}
    runs = []
    for v, d in [(tv, reference[drafter]), (verifier, drafters[drafter])]:
        dec = SpeculativeDecoder(v, d, RuleParams("greedy"), k=4, max_batch_size=4,
                                 acceptance_floor=0.0)
        runs.append(dec.generate(PROMPTS, MAX_NEW))
    assert runs[1].token_ids == runs[0].token_ids
    assert runs[1].stats.accepted_tokens == runs[0].stats.accepted_tokens > 0
    # every call fitted a profile (Checked raises otherwise); both kinds were needed
    assert {("verifier.onnx", "decode"), ("verifier.onnx", "prefill")} <= seen
    graph = {"model": "draft.onnx", "parallel": "parallel_draft.onnx",
             "self": "verifier_self1.onnx"}[drafter]
    assert (graph, "decode") in seen


def test_trt_model_verify_and_correct_equals_onnx(pair_engines):
    """The correction graph's inputs (empty tensors for absent ones), outputs and cache
    write-back, against OrtModel.verify_and_correct on the same graph."""
    from paradraft.runtime.backends.loader import load_engines

    seen: set = set()
    verifier = stand_in_models(pair_engines, seen)[0]
    ort_verifier = load_engines(pair_engines)[0]
    c = verifier.config
    g = torch.Generator().manual_seed(3)
    B, K, slots = 3, 4, torch.tensor([2, 0, 3])
    prompts = torch.randint(0, c.vocab_size, (B, 6), generator=g)
    tokens = torch.randint(0, c.vocab_size, (B, K + 1), generator=g)
    pos = 6 + torch.arange(K + 1).expand(B, -1)
    caches = [new_kv_cache(c, 4, 32, torch.float32) for _ in range(2)]
    for params, probs, drafted in [
        (RuleParams("greedy"), None, None),
        (RuleParams("exact", temperature=0.8), sampling_probs(
            torch.randn(B, K, c.vocab_size, generator=g), 1.0, 1.0), torch.tensor([4, 1, 3])),
    ]:
        randoms = None if params.is_greedy else draw_randoms(B, K, c.vocab_size, g)
        outs = []
        for m, cache in zip((ort_verifier, verifier), caches, strict=True):
            m(prompts, torch.arange(6).expand(B, -1), cache, kv_len=6, rows=slots)
            outs.append(m.verify_and_correct(tokens, pos, cache, params, randoms, probs, drafted,
                                             kv_len=12, rows=slots))
        for a, b in zip(*outs, strict=True):
            assert torch.equal(a, b)
        for a, b in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v, strict=True):
            assert torch.equal(a, b)
    assert seen == {("verifier.onnx", "decode"), ("verifier_correction.onnx", "decode")}


def test_trt_model_refuses_audit_and_unbuilt_layers(pair_engines):
    verifier = stand_in_models(pair_engines, set())[0]
    cache = new_kv_cache(verifier.config, 1, 8, torch.float32)
    tokens, pos = torch.tensor([[1, 2]]), torch.tensor([[0, 1]])
    with pytest.raises(ValueError, match="audit=True"):
        verifier(tokens, pos, cache, audit=True)
    with pytest.raises(ValueError, match=r"num_layers=2.*--self-draft-layers"):
        verifier(tokens, pos, cache, num_layers=2)
    with pytest.raises(ValueError, match="kv_len must be > max"):
        verifier(tokens, pos, cache, kv_len=1)
    with pytest.raises(ValueError, match="contiguous float32"):
        verifier(tokens, pos, new_kv_cache(verifier.config, 1, 8, torch.float64))


def test_prepare_converts_places_and_realigns():
    base = torch.arange(70, dtype=torch.int64)
    view = base[1:65]  # 8 bytes past an aligned start: misaligned for TensorRT
    out = prepare(view, torch.int64, host=False, device=torch.device("cpu"))
    assert torch.equal(out, view) and out.data_ptr() != view.data_ptr()
    assert view.data_ptr() % ALIGNMENT != 0
    out = prepare(torch.tensor(7), torch.int32, host=True, device=torch.device("cpu"))
    assert out.dtype == torch.int32 and out.device.type == "cpu" and int(out) == 7
    empty = torch.empty(3, 0, 0)
    assert prepare(empty, torch.float32, False, torch.device("cpu")).shape == (3, 0, 0)


def test_check_limits_names_the_rebuild_flag():
    manifest = {"limits": {"max_batch_size": 8, "max_k": 4, "max_seq_len": 512}}
    check_limits(manifest, 8, 512, 4)
    with pytest.raises(ValueError, match="--max-batch-size 16"):
        check_limits(manifest, 16, 512, 4)
    with pytest.raises(ValueError, match="--max-seq-len 1024"):
        check_limits(manifest, 8, 1024, 4)
    with pytest.raises(ValueError, match="--max-k 6"):
        check_limits(manifest, 8, 512, 6)


def test_serve_refuses_limits_beyond_a_tensorrt_engine(monkeypatch):
    from paradraft.runtime.serving import protocol

    manifest = {"backend": "tensorrt",
                "limits": {"max_batch_size": 8, "max_k": 4, "max_seq_len": 512}}
    monkeypatch.setattr(protocol, "load_engines", lambda d, **kw: (None, {"model": None}, None,
                                                            manifest))
    config = protocol.ServeConfig(verifier="unused", draft=None, engines="trt", max_slots=16)
    with pytest.raises(ValueError, match=r"KV-cache slots.*--max-batch-size 16"):
        protocol.build_scheduler(config)


# -- the build against a stand-in tensorrt module ------------------------------------------


def fake_tensorrt(version: str = "10.9.0.34") -> types.ModuleType:
    """A stand-in for ``tensorrt``: records what the build asks of it (``trt.log``)."""
    import onnx

    trt = types.ModuleType("tensorrt")
    trt.__version__ = version
    log: list = []
    trt.log = log

    class Logger:
        WARNING = 2

        def __init__(self, severity):
            self.severity = severity

    class BuilderFlag:
        TF32 = "TF32"

    if parse_version(version) < (11,):
        BuilderFlag.FP16, BuilderFlag.BF16 = "FP16", "BF16"

    class Input:
        def __init__(self, name):
            self.name = name
            self.is_shape_tensor = name == "kv_len"  # Range(kv_len) shapes the graph

    class Network:
        def __init__(self):
            self.inputs = []

        @property
        def num_inputs(self):
            return len(self.inputs)

        def get_input(self, i):
            return self.inputs[i]

    class OnnxParser:
        num_errors = 0

        def __init__(self, network, logger):
            self.network = network

        def parse(self, data, path=None):
            # a graph with external weights must come with its path (TensorRT finds the
            # weights file from it)
            model = onnx.load_from_string(data)
            external = any(t.data_location == onnx.TensorProto.EXTERNAL
                           for t in model.graph.initializer)
            assert path is not None or not external, "external weights without a path"
            self.network.inputs = [Input(i.name) for i in model.graph.input]
            ops = {n.op_type for n in model.graph.node}
            log.append(("parse", "CausalCorrection" in ops, len(self.network.inputs)))
            return True

    class Profile:
        def __init__(self):
            self.shapes, self.values = {}, {}

        def set_shape(self, name, lo, opt, hi):
            self.shapes[name] = (lo, opt, hi)

        def set_shape_input(self, name, lo, opt, hi):
            self.values[name] = (lo, opt, hi)

    class TimingCache:
        def __init__(self, data):
            self.data = bytes(data)

        def serialize(self):
            return self.data + b"+"  # one mark per build that used it

    class Config:
        def __init__(self):
            self.flags, self.cleared, self.profiles, self.cache = set(), set(), [], None

        def set_flag(self, flag):
            self.flags.add(flag)

        def clear_flag(self, flag):
            self.cleared.add(flag)

        def add_optimization_profile(self, p):
            self.profiles.append(p)

        def create_timing_cache(self, data):
            return TimingCache(data)

        def set_timing_cache(self, cache, ignore_mismatch):
            self.cache = cache
            return True

        def get_timing_cache(self):
            return self.cache

    class Builder:
        def __init__(self, logger):
            pass

        def create_network(self, flags):
            return Network()

        def create_builder_config(self):
            return Config()

        def create_optimization_profile(self):
            return Profile()

        def build_serialized_network(self, network, config):
            log.append(("build", sorted(config.flags), sorted(config.cleared),
                        [(p.shapes, p.values) for p in config.profiles]))
            return b"plan:" + ",".join(i.name for i in network.inputs).encode()

    trt.Logger, trt.BuilderFlag, trt.OnnxParser, trt.Builder = Logger, BuilderFlag, OnnxParser, \
        Builder
    return trt


@pytest.fixture
def fake_trt(monkeypatch):
    trt = fake_tensorrt()
    monkeypatch.setattr(trt_plugin, "register_plugin", lambda: trt.log.append(("register",)))
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    return trt


@pytest.fixture
def onnx_dir(pair_engines, tmp_path):
    out = tmp_path / "engines"
    shutil.copytree(pair_engines, out)
    return out


def test_build_plans_records_plans_in_the_manifest(fake_trt, onnx_dir):
    (onnx_dir / "timing.cache").write_bytes(b"seed")
    manifest = build_plans(onnx_dir, precision="fp32")
    assert manifest == read_manifest(onnx_dir)  # and every checksum verifies
    assert manifest["backend"] == "tensorrt" and manifest["dtype"] == "float32"
    info = manifest["tensorrt"]
    assert (info["version"], info["precision"], info["requirement"]) == (
        "10.9.0.34", "fp32", REQUIREMENT)
    assert info["timing_cache"] == "timing.cache" and manifest["versions"]["tensorrt"] == (
        "10.9.0.34")
    graphs = [(name, role, g) for name, m in manifest["models"].items()
              for role, g in m["graphs"].items() if role in ROLE_PROFILES]
    assert len(graphs) == 5  # verifier: logits, correction, self_draft; draft; parallel
    fused = [g for m in manifest["models"].values() for role, g in m["graphs"].items()
             if role not in ROLE_PROFILES]  # the fused draft graphs: ONNX Runtime only
    assert fused and all("plan" not in g and g["file"] in manifest["checksums"] for g in fused)
    for _name, role, g in graphs:
        assert g["plan"] == g["file"].replace(".onnx", ".plan")
        assert (onnx_dir / g["plan"]).read_bytes().startswith(b"plan:")
        assert manifest["checksums"][g["plan"]] == sha256_file(onnx_dir / g["plan"])
        assert g["file"] in manifest["checksums"]  # the ONNX graphs stay (rule rebuilds)
        assert [p["name"] for p in g["profiles"]] == list(ROLE_PROFILES[role])
    assert (onnx_dir / "timing.cache").read_bytes() == b"seed" + b"+" * 5
    # the plugin is registered once, before the correction graph is parsed
    events = [e for e in fake_trt.log if e[0] in ("register", "parse")]
    first = events.index(("register",))
    assert [e for e in events if e[0] == "register"] == [("register",)]
    assert events[first + 1][:2] == ("parse", True)
    assert not any(e[1] for e in events[:first])
    # what TensorRT was asked for: fp32 math, the recorded profiles, kv_len as values
    builds = [e for e in fake_trt.log if e[0] == "build"]
    assert all(flags == [] and cleared == ["TF32"] for _, flags, cleared, _ in builds)
    verifier = manifest["models"]["verifier"]["graphs"]["logits"]
    shapes, values = builds[0][3][1]  # the first plan built, its prefill profile
    assert values == {"kv_len": tuple(verifier["profiles"][1]["values"]["kv_len"])}
    assert shapes["tokens"] == tuple(verifier["profiles"][1]["shapes"]["tokens"])
    assert "kv_len" not in shapes
    # a changed plan is refused like any engine file
    (onnx_dir / verifier["plan"]).write_bytes(b"other")
    with pytest.raises(ValueError, match=r"verifier\.plan does not match its sha256"):
        read_manifest(onnx_dir)


def test_build_plans_sets_the_precision_flag(fake_trt, onnx_dir):
    build_plans(onnx_dir, precision="fp16")
    builds = [e for e in fake_trt.log if e[0] == "build"]
    assert builds and all(flags == ["FP16"] and cleared == [] for _, flags, cleared, _ in builds)
    assert read_manifest(onnx_dir)["tensorrt"]["precision"] == "fp16"
    with pytest.raises(ValueError, match="plans are built from an onnx engine dir"):
        build_plans(onnx_dir)


def test_half_precision_is_refused_on_tensorrt_11_before_building(monkeypatch, onnx_dir):
    trt = fake_tensorrt("11.4.0.106")
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    with pytest.raises(ValueError, match="strongly typed"):
        build_plans(onnx_dir, precision="bf16")
    assert trt.log == [] and read_manifest(onnx_dir)["backend"] == "onnx"


def test_missing_tensorrt_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # import tensorrt → ImportError
    with pytest.raises(TensorRTUnavailable, match=r"tensorrt>=10\.9.*NVIDIA GPU"):
        import_tensorrt()
    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt("10.8.0"))
    with pytest.raises(TensorRTUnavailable, match=r"needs tensorrt>=10\.9; found 10\.8\.0"):
        import_tensorrt()


def test_loading_tensorrt_engines_names_what_is_missing(fake_trt, onnx_dir, monkeypatch):
    from paradraft.runtime.backends.loader import load_engines

    build_plans(onnx_dir)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"NVIDIA GPU.*torch.cuda.is_available"):
        load_engines(onnx_dir)
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    with pytest.raises(TensorRTUnavailable, match=r"tensorrt>=10\.9"):
        load_engines(onnx_dir)


# -- the CLI ---------------------------------------------------------------------------------


def run_cli(argv, capsys) -> tuple[int, str]:
    from paradraft.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    return e.value.code, capsys.readouterr().err


def test_cli_build_tensorrt_without_tensorrt_fails_before_exporting(pair, tmp_path, capsys,
                                                                     monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    out = tmp_path / "engines"
    code, err = run_cli(["build", "--backend", "tensorrt", "--verifier", pair[0],
                         "--out", str(out)], capsys)
    assert code == 2 and "tensorrt>=10.9" in err and "NVIDIA GPU" in err
    assert not out.exists() or not any(out.iterdir())


def test_cli_build_tensorrt_arguments(pair, tmp_path, capsys, monkeypatch, fake_trt):
    code, err = run_cli(["build", "--backend", "tensorrt", "--precision", "fp64"], capsys)
    assert code == 2 and "invalid choice: 'fp64'" in err
    monkeypatch.setattr(trt_build, "import_tensorrt", lambda: fake_tensorrt("11.0.0"))
    code, err = run_cli(["build", "--backend", "tensorrt", "--precision", "bf16", "--verifier",
                         pair[0], "--out", str(tmp_path / "refused")], capsys)
    assert code == 2 and "--precision fp32" in err
    assert not (tmp_path / "refused").exists()


def test_cli_build_tensorrt_writes_a_tensorrt_engine_dir(pair, tmp_path, capsys, fake_trt):
    from paradraft.cli.main import main

    out = tmp_path / "engines"
    main(["build", "--backend", "tensorrt", "--verifier", pair[0], "--draft", pair[1],
          "--out", str(out), "--max-batch-size", "4", "--max-k", "3", "--max-seq-len", "64",
          "--self-draft-layers", "1"])
    assert "(tensorrt)" in capsys.readouterr().out
    manifest = read_manifest(out)
    assert manifest["backend"] == "tensorrt" and manifest["tensorrt"]["precision"] == "fp32"
    assert manifest["limits"] == {"max_batch_size": 4, "max_k": 3, "max_seq_len": 64}
    assert sorted(p for p in manifest["checksums"] if p.endswith(".plan")) == [
        "draft.plan", "verifier.plan", "verifier_correction.plan", "verifier_self1.plan"]
    profile = manifest["models"]["draft"]["graphs"]["logits"]["profiles"][0]
    assert profile["shapes"]["tokens"] == [[1, 1], [4, 4], [4, 6]]
