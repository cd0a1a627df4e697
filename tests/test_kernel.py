"""The fused Triton correction kernels against correction.correct (CPU tensors, run by the
Triton interpreter), the AOT kernel's compilation for a GPU target, and the TensorRT plugin's
plain parts (TensorRT itself can't be installed here)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are jitted: CPU tensors

import importlib.util
import inspect
import subprocess
import sys
import typing
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("triton", reason="triton (a dev dependency) is not installed")

from paradraft.build.onnx import CORRECTION_INPUTS, CORRECTION_OUTPUTS
from paradraft.runtime import speculative
from paradraft.runtime.backends import kernels as ck
from paradraft.runtime.backends import trt_plugin
from paradraft.runtime.backends.engine_io import accepted_block, rule_attributes
from paradraft.runtime.correction import RULES, RuleParams, correct, draw_randoms
from paradraft.runtime.drafters import Drafter
from paradraft.runtime.model import load_model
from paradraft.runtime.speculative import SpeculativeDecoder


def inputs(B: int, K: int, V: int, seed: int, with_q: bool):
    """Random logits with planted drafts, so every rule accepts a non-trivial prefix: row 0
    plants all K drafts, row 1 the first two, row 2 all but stops at num_drafted = K − 1,
    row 3 is random and drafted nothing."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, K + 1, V, generator=g) * 2
    drafts = torch.randint(0, V, (B, K), generator=g)
    for b, planted in enumerate([K, 2, K, 0][:B]):
        pos = torch.arange(min(planted, K))
        logits[b, pos, drafts[b, pos]] += 9.0
    num_drafted = torch.tensor([K, K, max(K - 1, 0), 0][:B])
    q = torch.softmax(torch.randn(B, K, V, generator=g) * 2, -1) if with_q else None
    return logits, drafts, q, draw_randoms(B, K, V, g), num_drafted


def assert_same(params: RuleParams, B: int, K: int, V: int, block_v: int, seed: int = 0,
                with_q: bool = False, drafted: bool = True) -> torch.Tensor:
    logits, drafts, q, randoms, num_drafted = inputs(B, K, V, seed, with_q)
    num_drafted = num_drafted if drafted else None
    randoms = None if params.is_greedy else randoms
    want = correct(logits, drafts, q, params, randoms, num_drafted)
    got = ck.correct_fused(logits, drafts, q, params, randoms, num_drafted, block_v=block_v)
    assert got[0].tolist() == want[0].tolist()
    assert got[1].tolist() == want[1].tolist()
    return want[0]


@pytest.mark.parametrize("rule", RULES)
def test_kernel_matches_correct_for_every_rule(rule):
    # V = 300 in tiles of 128: the last tile is partial; temperature != 1
    params = RuleParams(rule=rule, temperature=1.3)
    n = assert_same(params, B=4, K=4, V=300, block_v=128, seed=1)
    assert len(set(n.tolist())) > 1  # the planted rows accept, the others don't
    assert_same(params, B=4, K=4, V=300, block_v=128, seed=2, with_q=True, drafted=False)


@pytest.mark.parametrize("rule", RULES)
def test_kernel_top_p_and_temperature(rule):
    # the nucleus by bisection (exact's draft positions, dynamic's membership, every stop)
    params = RuleParams(rule=rule, temperature=0.7, top_p=0.8, top_p_membership=True)
    assert_same(params, B=3, K=3, V=200, block_v=128, seed=3, with_q=rule != "greedy")


@pytest.mark.parametrize("rule", ["exact", "dynamic"])
def test_kernel_top_p_keeps_or_drops_tied_tokens_together(rule):
    # integer logits: every probability is shared by a few dozen tokens, so the nucleus edge
    # always falls between tie groups, which a sort would cut wherever its order put them;
    # the kernels' bisection and correction.top_p_floor keep or drop each group whole (in
    # exact's draft positions, dynamic's membership test and every stop position)
    B, K, V = 3, 2, 120
    g = torch.Generator().manual_seed(13)
    logits = torch.randint(-3, 3, (B, K + 1, V), generator=g).float()
    drafts = torch.randint(0, V, (B, K), generator=g)
    q = torch.softmax(torch.randint(-3, 3, (B, K, V), generator=g).float(), -1)
    randoms = draw_randoms(B, K, V, g)
    for top_p in (0.4, 0.8):
        params = RuleParams(rule, top_p=top_p, top_p_membership=True, tau=0.0)
        want = correct(logits, drafts, q, params, randoms)
        got = ck.correct_fused(logits, drafts, q, params, randoms, block_v=64)
        assert (got[0].tolist(), got[1].tolist()) == (want[0].tolist(), want[1].tolist())


@pytest.mark.parametrize("with_q", [True, False])
def test_kernel_exact_samples_the_residual_after_a_rejection(with_q):
    # drafts drawn from a q close to p (or from p itself for a one-hot draft): rejected rows
    # then draw from a residual that differs from p, checked to matter below (enough rows
    # that some rejected row tells the residual apart, whatever the noise stream)
    B, K, V = 32, 3, 100
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(B, K + 1, V, generator=g) * 4  # peaked: drafts often the argmax
    params = RuleParams("exact", temperature=0.9)
    p = torch.softmax(logits[:, :K] / 0.9, -1)
    q = torch.softmax(logits[:, :K] / 0.9 + torch.randn(B, K, V, generator=g), -1)
    drafts = torch.multinomial((q if with_q else p).flatten(0, 1), 1, generator=g).view(B, K)
    q = q if with_q else None
    randoms = draw_randoms(B, K, V, g)
    n, tok = correct(logits, drafts, q, params, randoms)
    for fused in (ck.correct_fused, ck.correct_block_fused):
        got = fused(logits, drafts, q, params, randoms, block_v=64)
        assert (got[0].tolist(), got[1].tolist()) == (n.tolist(), tok.tolist())
    stop_probs = torch.softmax(logits[torch.arange(B), n] / 0.9, -1)
    plain = (stop_probs / randoms.sample_noise).argmax(-1)
    assert bool(((plain != tok) & (n < K)).any())  # a p-sampling kernel would fail here


@pytest.mark.parametrize(("K", "V", "block_v"), [(1, 700, 256), (8, 700, 256), (8, 64, 64)])
def test_kernel_shapes(K, V, block_v):
    for rule, with_q in [("exact", K > 1), ("greedy", False), ("dynamic", False)]:
        assert_same(RuleParams(rule=rule), B=4, K=K, V=V, block_v=block_v, seed=K,
                    with_q=with_q)


def test_kernel_no_drafts_is_plain_sampling():
    # K = 0 (the first token after a prefill): the token comes from position 0
    for params in [RuleParams("exact", top_p=0.9, temperature=0.8), RuleParams("greedy")]:
        assert_same(params, B=3, K=0, V=150, block_v=64, seed=5)


@pytest.mark.parametrize("rule", RULES)
def test_kernel_row_kernel_matches_correct(rule):
    # the one-launch kernel the TensorRT plugin compiles, with the ONNX op's block output
    params = RuleParams(rule=rule, temperature=1.3, top_p=0.9 if rule == "exact" else 1.0)
    logits, drafts, q, randoms, num_drafted = inputs(4, 4, 300, 6, rule != "greedy")
    randoms = None if params.is_greedy else randoms
    n, tok = correct(logits, drafts, q, params, randoms, num_drafted)
    got = ck.correct_block_fused(logits, drafts, q, params, randoms, num_drafted, block_v=128)
    assert [t.tolist() for t in got] == [n.tolist(), tok.tolist(),
                                         accepted_block(drafts, n, tok).tolist()]


def test_kernel_row_kernel_without_randoms_fails_like_the_onnx_op():
    # the AOT kernel can't raise: a sampling rule given no random numbers writes -1
    B, K, V = 2, 3, 100
    logits, drafts, _, _, _ = inputs(B, K, V, 7, False)
    ck._kernels()  # jit them: the module's _row_kernel is the launchable one from here on
    empty = torch.empty(B, 0)
    outs = [torch.empty(B, dtype=torch.long), torch.empty(B, dtype=torch.long),
            torch.empty(B, K + 1, dtype=torch.long)]
    ck._row_kernel[(B,)](logits, drafts, empty, empty, empty, torch.empty(0, dtype=torch.long),
                         K + 1, K, V, 0, 0, 0, *outs,
                         **ck.kernel_constants(RuleParams("threshold"), 128))
    assert all(bool((o == -1).all()) for o in outs)


def test_kernel_errors_and_dispatch(monkeypatch):
    logits, drafts, _, _, _ = inputs(2, 2, 50, 8, False)
    with pytest.raises(ValueError, match="needs random numbers"):
        ck.correct_fused(logits, drafts, None, RuleParams("threshold"), None)
    assert ck.correct_for("cpu") is correct
    monkeypatch.setattr(ck, "_have_triton", lambda: True)
    assert ck.correct_for(torch.device("cuda")) is ck.correct_fused
    monkeypatch.setattr(ck, "_have_triton", lambda: False)
    assert ck.correct_for("cuda") is correct


def test_kernel_decoder_with_the_fused_correction_equals_torch(pair, monkeypatch):
    # the wiring in speculative.py: the same seeds give the same text with either correction
    verifier, draft = load_model(pair[0]), load_model(pair[1])
    params = RuleParams("exact", temperature=0.9, top_p=0.95)
    prompts = [[4, 8, 15], [16, 23, 42, 7, 7], [9]]

    def generate():
        dec = SpeculativeDecoder(verifier, Drafter("model", draft), params, k=3,
                                 max_batch_size=3)
        return dec.generate(prompts, 8, seed=3)

    want = generate()
    monkeypatch.setattr(speculative, "correct_for", lambda device: ck.correct_fused)
    got = generate()
    assert got.token_ids == want.token_ids
    assert got.stats.accepted_tokens == want.stats.accepted_tokens > 0


def run_python(code: str) -> subprocess.CompletedProcess:
    """A fresh interpreter with compiled (not interpreted) triton."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(OMP_NUM_THREADS="1", TRITON_DEFAULT_FP_FUSION="1")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=300)


def test_kernel_modules_import_without_triton_or_tensorrt():
    code = """
import sys
sys.modules["triton"] = None  # as if not installed
from paradraft.runtime.backends import kernels as ck
from paradraft.runtime.backends import trt_plugin
from paradraft.runtime.correction import RuleParams, correct
assert ck.correct_for("cuda") is correct
try:
    ck.correct_fused(None, None, None, RuleParams(), None)
except ImportError as e:
    assert "'triton'" in str(e), e
else:
    raise AssertionError("no ImportError")
"""
    r = run_python(code)
    assert r.returncode == 0, r.stderr
    if importlib.util.find_spec("tensorrt") is None:
        with pytest.raises(ImportError, match=r"tensorrt>=10\.9"):
            trt_plugin.register_plugin()


def fake_tensorrt():
    """Stand-ins for tensorrt / tensorrt.plugin that record what define_plugin registers."""
    registered = {}

    def keep(kind):
        def decorator_for(plugin_id):
            def decorator(fn):
                registered[kind] = (plugin_id, fn)
                return fn
            return decorator
        return decorator_for

    trtp = SimpleNamespace(
        register=keep("register"), impl=keep("impl"), aot_impl=keep("aot_impl"),
        TensorDesc=type("TensorDesc", (), {}), Tensor=type("Tensor", (), {}),
        KernelLaunchParams=SimpleNamespace, SymIntExprs=SimpleNamespace(from_tuple=list),
        SymInt32=lambda e: e, from_shape_expr=lambda shape, dtype: (tuple(shape), dtype))
    return SimpleNamespace(int64="int64"), trtp, registered


def test_kernel_plugin_shapes():
    # the plugin's names are the ONNX node's (build/onnx.py), in the node's order
    assert trt_plugin.PLUGIN_ID == "paradraft::CausalCorrection"
    assert ("logits", "draft_tokens", *CORRECTION_INPUTS) == trt_plugin.INPUTS
    assert trt_plugin.OUTPUTS == CORRECTION_OUTPUTS
    attrs = rule_attributes(RuleParams())
    assert attrs["plugin_namespace"] == "paradraft" and attrs["plugin_version"] == "1"
    assert set(trt_plugin.ATTRIBUTES) == set(attrs) - {"plugin_version", "plugin_namespace"}
    assert trt_plugin.output_shapes((4, 6, 300), (4, 5)) == ((4,), (4,), (4, 6))

    # fields as TensorRT's ONNX parser hands them over: NUL-terminated, float32, int32
    params = RuleParams("dynamic", temperature=0.7, top_p=0.9, tau=0.3, alpha=0.1,
                        top_p_membership=True)
    floats = {k: float(np.float32(getattr(params, k))) for k in ("temperature", "top_p", "tau",
                                                                  "gamma", "alpha", "epsilon",
                                                                  "delta")}
    assert trt_plugin.rule_params("dynamic\0", int(np.int32(1)), **floats) == params
    with pytest.raises(ValueError, match="rule must be one of"):
        trt_plugin.rule_params("nope\0", 0, **floats)

    # the registered functions' schemas (tensorrt.plugin checks these names and order);
    # one implementation per process: AOT by default, or the JIT impl
    schema = trt_plugin.INPUTS + trt_plugin.ATTRIBUTES
    tails = {"register": (), "impl": ("outputs", "stream"), "aot_impl": ("outputs", "tactic")}
    for jit, kinds in [(False, {"register", "aot_impl"}), (True, {"register", "impl"})]:
        trt, trtp, registered = fake_tensorrt()
        trt_plugin.define_plugin(trt, trtp, jit=jit)
        assert set(registered) == kinds
        for kind, (plugin_id, fn) in registered.items():
            assert plugin_id == trt_plugin.PLUGIN_ID
            assert tuple(inspect.signature(fn).parameters) == schema + tails[kind]
    desc_fn = registered["register"][1]
    assert len(typing.get_args(inspect.signature(desc_fn).return_annotation)) == 3
    descs = [SimpleNamespace(shape_expr=s) for s in
             [(4, 6, 300), (4, 5), (4, 5, 300), (4, 5), (4, 300), (4,)]]
    assert desc_fn(*descs, "exact", 0, *[1.0] * 7) == (((4,), "int64"), ((4,), "int64"),
                                                        ((4, 6), "int64"))


def test_kernel_plugin_tensors():
    # empty tensors stand for None; the accepted block the plugin returns
    e2, e3, e1 = torch.empty(2, 0), torch.empty(2, 0, 0), torch.empty(0, dtype=torch.long)
    assert trt_plugin.optional_inputs(e3, e2, e2, e1) == (None, None, None)
    q, u, noise, nd = torch.rand(2, 3, 5), torch.rand(2, 3), torch.rand(2, 5), torch.tensor([3, 1])
    probs, randoms, drafted = trt_plugin.optional_inputs(q, u, noise, nd)
    assert probs is q and drafted is nd and randoms.accept_uniforms is u
    drafts = torch.tensor([[5, 6, 7], [8, 9, 10]])
    n, tok = torch.tensor([3, 1]), torch.tensor([11, 12])
    assert accepted_block(drafts, n, tok).tolist() == [[5, 6, 7, 11], [8, 12, -1, -1]]
    assert trt_plugin.triton_type("HALF") == "fp16"
    with pytest.raises(ValueError, match="logits must be"):
        trt_plugin.triton_type("INT8")
    # the AOT kernel's int32 arguments, in its signature's order
    names = [k for k, v in ck.row_kernel_signature().items() if v == "i32"]
    shapes = [("B", "T", "V"), ("B", "K"), ("PB", "PK", "q_width"), ("B", "noise_width"),
              ("nd_len",)]
    assert ck.row_kernel_scalars(*shapes) == names


def test_kernel_aot_compiles_for_a_gpu_target():
    # compiled triton (not the interpreter) down to PTX for sm_90, through the plugin's
    # aot_impl with stand-ins for tensorrt: the kernel TensorRT would embed
    code = """
from types import SimpleNamespace
from triton.backends.compiler import GPUTarget
import paradraft.runtime.backends.kernels as ck
from paradraft.runtime.backends import trt_plugin
sys_target = GPUTarget("cuda", 90, 32)
original = ck.compile_row_kernel
ck.compile_row_kernel = lambda p, t: original(p, t, target=sys_target)
trt_plugin.compile_row_kernel = ck.compile_row_kernel
registered = {}
def keep(kind):
    return lambda plugin_id: (lambda fn: registered.setdefault(kind, fn))
trtp = SimpleNamespace(register=keep("r"), impl=keep("i"), aot_impl=keep("a"),
    TensorDesc=object, Tensor=object, KernelLaunchParams=SimpleNamespace,
    SymIntExprs=SimpleNamespace(from_tuple=list), SymInt32=lambda e: e)
trt_plugin.define_plugin(SimpleNamespace(int64=None), trtp)
desc = lambda *shape, dtype="FLOAT": SimpleNamespace(shape_expr=shape,
                                                     dtype=SimpleNamespace(name=dtype))
ins = [desc("B", "T", "V", dtype="BF16"), desc("B", "K"), desc("PB", "PK", "PV"),
       desc("B", "UK"), desc("B", "NV"), desc("ND")]
for rule, top_p in [("exact", 0.9), ("greedy", 1.0)]:
    name, ptx, launch, extra = registered["a"](*ins, rule, 0, 0.8, top_p, 0.3, 1.0, 0.1, 0.09,
                                               0.3, (), 0)
    assert name == "_row_kernel" and ".entry _row_kernel(" in ptx, name
    assert launch.grid_x == "B" and launch.block_x == 128, vars(launch)
    assert extra == ["T", "K", "V", "PV", "ND", "NV"], extra
print("ok")
"""
    r = run_python(code)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]
