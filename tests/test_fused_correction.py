"""Fused correction: verify and correct in one engine call (the correction graph's
``CausalCorrection`` op) gives the unfused path's tokens — logits out of the engine, then
``correct()`` — token for token, for every rule and drafter, with the same per-row random
numbers; rounds one call cannot carry fall back to the unfused path with their reason."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from conftest import VOCAB, run_cli
from test_lossless import assert_joint_distribution

from paradraft.runtime.backends.loader import load_engines
from paradraft.runtime.backends.ort import Graph
from paradraft.runtime.backends.trt import TrtModel
from paradraft.runtime.correction import RULES, RuleParams
from paradraft.runtime.model import load_model
from paradraft.runtime.speculative import AUDIT_NEEDS_LOGITS, SpeculativeDecoder
from paradraft.runtime.tools.bench import fused_comparison, plan

pytest.importorskip("onnxruntime")

PROMPTS = [[4, 8, 15], [16, 23, 42, 7, 7, 3, 1], [9]]
MAX_NEW = [24, 9, 17]  # rows finish at different rounds: later rounds run on slot subsets
K = 4


def rule_params(rule: str) -> RuleParams:
    # tau / epsilon / delta are not float32-exact: the op must apply these decimals
    return RuleParams(rule, temperature=0.8, top_p=0.9, tau=0.3, gamma=0.7, alpha=0.1,
                      top_p_membership=rule == "dynamic", epsilon=0.09, delta=0.3)


@pytest.fixture(scope="module")
def engines(pair_engines):
    verifier, drafters, _, _ = load_engines(pair_engines)
    verifier.max_correction_sessions = 2 * len(RULES)  # every test's parameter sets
    return verifier, drafters


def run(verifier, drafter, params, fused: str, **kw):
    dec = SpeculativeDecoder(verifier, drafter, params, k=K, max_batch_size=4,
                             acceptance_floor=0.0, fused_correction=fused, **kw)
    return dec, dec.generate(PROMPTS, MAX_NEW, seed=11)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("drafter", ["model", "parallel", "self"])
def test_fused_equals_unfused_token_for_token(engines, rule, drafter):
    """Every rule the op supports (``exact`` with sampled drafts: their q goes in as
    draft_probs), every drafter, ragged rows (slot subsets) and K = 0 rounds (a batch of
    >= 3 rows decodes without drafts)."""
    verifier, drafters = engines
    params = rule_params(rule)
    runs = {fused: run(verifier, drafters[drafter], params, fused, disable_by_batch_size=3)
            for fused in ("off", "on")}
    (off, want), (on, got) = runs["off"], runs["on"]
    assert got.token_ids == want.token_ids
    assert [len(t) for t in got.token_ids] == MAX_NEW
    for a, b in zip(got.row_stats, want.row_stats, strict=True):
        assert (a.verify_steps, a.accepted_tokens, a.rollbacks, a.accepted_per_position) == (
            b.verify_steps, b.accepted_tokens, b.rollbacks, b.accepted_per_position)
    assert got.stats.draft_tokens > 0
    assert on.fused_stats() == {"fused_correction": True, "fused_fallback": {},
                                "fused_rounds": max(s.verify_steps for s in got.row_stats)}
    assert off.fused_stats()["fused_rounds"] == 0 and not off.fused


def test_fused_adaptive_k_and_per_request_k(engines):
    """num_drafted (adaptive K, per-request K, K = 0 requests) goes into the op."""
    verifier, drafters = engines
    out = []
    for fused in ("off", "on"):
        dec = SpeculativeDecoder(verifier, drafters["model"], rule_params("exact"), k=K,
                                 adaptive_k=True, max_batch_size=4, acceptance_floor=0.0,
                                 fused_correction=fused)
        dec.reset()
        slots = [0, 1, 2]
        new, alive = dec.prefill(slots, PROMPTS, MAX_NEW, [None] * 3, [3, 4, 5], [K, 2, 0])
        tokens = [list(t) for t in new]
        while any(alive):
            slots = [s for s, a in zip(slots, alive, strict=True) if a]
            new, alive = dec.step(slots)
            for s, t in zip(slots, new, strict=True):
                tokens[s] += t
        out.append((tokens, [dec.slot_stats(s).draft_tokens for s in range(3)]))
    assert out[1] == out[0]
    assert out[0][1][2] == 0 and out[0][1][1] < out[0][1][0]  # per-request K held


def test_exact_joint_distribution_on_the_fused_path(engines):
    verifier, drafters = engines
    dec = assert_joint_distribution(verifier, drafters["model"], VOCAB, fused_correction="on")
    assert dec.fused_stats()["fused_rounds"] > 0 and not dec.fused_stats()["fused_fallback"]


def two_groups(dec: SpeculativeDecoder, groups: list[tuple[RuleParams, list[int]]]
               ) -> list[list[int]]:
    """The scheduler's pattern: one slot group per parameter set, each stepped in turn with
    ``decoder.params`` (and draft sampling) set for it."""
    def use(params):
        dec.params, dec.draft_sampling = params, params.rule == "exact"

    dec.reset()
    tokens: dict[int, list[int]] = {}
    alive: dict[int, bool] = {}
    for params, slots in groups:
        use(params)
        new, running = dec.prefill(slots, [PROMPTS[s] for s in slots],
                                   [MAX_NEW[s] for s in slots], [None] * len(slots), slots)
        tokens.update(zip(slots, new, strict=True))
        alive.update(zip(slots, running, strict=True))
    while any(alive.values()):
        for params, slots in groups:
            slots = [s for s in slots if alive[s]]
            if slots:
                use(params)
                new, running = dec.step(slots)
                for s, t, a in zip(slots, new, running, strict=True):
                    tokens[s] += t
                    alive[s] = a
    return [tokens[s] for s in sorted(tokens)]


def test_parameter_groups_fuse_per_set_or_fall_back_by_reason(pair_engines):
    """Two parameter groups stepped in turn: each set gets its own correction session; past
    max_correction_sessions the new set's rounds run unfused, with the reason counted."""
    verifier, drafters, _, _ = load_engines(pair_engines)
    groups = [(rule_params("exact"), [0, 2]), (rule_params("typical"), [1])]
    unfused = SpeculativeDecoder(verifier, drafters["model"], k=K, max_batch_size=4,
                                 acceptance_floor=0.0, fused_correction="off")
    want = two_groups(unfused, groups)
    for sessions in (4, 1):
        verifier._corrections.clear()
        verifier.max_correction_sessions = sessions
        # the decoder's own parameters get their session at construction
        dec = SpeculativeDecoder(verifier, drafters["model"], groups[0][0], k=K,
                                 max_batch_size=4, acceptance_floor=0.0, fused_correction="on")
        assert two_groups(dec, groups) == want
        stats = dec.fused_stats()
        if sessions == 4:
            assert stats["fused_fallback"] == {} and len(verifier._corrections) == 2
        else:  # the first set holds the one session; the second set's rounds fall back
            (reason, rounds), = stats["fused_fallback"].items()
            assert "max_correction_sessions" in reason and rounds > 0
            assert stats["fused_rounds"] > 0 and len(verifier._corrections) == 1
    # greedy requests share one session whatever their other parameters
    verifier._corrections.clear()
    verifier.max_correction_sessions = 1
    greedy = [(RuleParams("greedy"), [0, 2]), (RuleParams("greedy", temperature=0.5), [1])]
    dec = SpeculativeDecoder(verifier, drafters["model"], greedy[1][0], k=K, max_batch_size=4,
                             acceptance_floor=0.0, fused_correction="on")
    two_groups(dec, greedy)
    assert dec.fused_stats()["fused_fallback"] == {}


class AuditingEngine:
    """The ONNX engine with an attention audit that never fires (zero weight on later
    positions): the audit's logits path, on an engine that also has a correction graph."""

    def __init__(self, engine):
        self.engine = engine

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def __call__(self, tokens, input_pos, cache, audit=False, **kw):
        logits, _ = self.engine(tokens, input_pos, cache, **kw)
        return logits, torch.zeros(tokens.shape) if audit else None


def test_the_audit_falls_back_to_the_logits(engines):
    verifier, drafters = engines
    engine = AuditingEngine(verifier)
    params = rule_params("exact")
    want = run(verifier, drafters["model"], params, "off")[1]
    dec, got = run(engine, drafters["model"], params, "on", audit_epsilon=0.1)
    assert got.token_ids == want.token_ids
    steps = max(s.verify_steps for s in got.row_stats)  # the decoder's rounds
    assert dec.fused_stats() == {"fused_correction": True, "fused_rounds": 0,
                                 "fused_fallback": {AUDIT_NEEDS_LOGITS: steps}}


def stand_in_trt(pair_engines, ort_verifier, prebuilt):
    """A TrtModel over ONNX Runtime graphs (its bookkeeping; TensorRT needs a GPU)."""
    graphs = {None: lambda: Graph(pair_engines / "verifier.onnx"),
              1: lambda: Graph(pair_engines / "verifier_self1.onnx")}
    return TrtModel(ort_verifier.config, graphs, ort_verifier.correction_graph, device="cpu",
                    prebuilt=prebuilt)


def test_tensorrt_bookkeeping_fuses_and_falls_back_without_a_build(pair_engines, engines):
    """TrtModel's fused path (ONNX Runtime standing in for the plans) gives the unfused
    tokens; rule parameters other than the plan's would need a TensorRT build mid-round, so
    their rounds fall back, with the reason."""
    ort_verifier, drafters = engines
    draft = drafters["model"]
    for rule in ("greedy", "exact"):
        params = rule_params(rule)
        want = run(ort_verifier, draft, params, "off")[1].token_ids
        trt = stand_in_trt(pair_engines, ort_verifier, prebuilt=RuleParams("greedy"))
        dec, got = run(trt, draft, params, "on")
        assert got.token_ids == want
        stats = dec.fused_stats()
        if rule == "greedy":  # the plan's own rule
            assert stats["fused_fallback"] == {} and stats["fused_rounds"] > 0
        else:
            assert stats["fused_rounds"] == 0
            (reason, rounds), = stats["fused_fallback"].items()
            assert "TensorRT build" in reason
            assert rounds == max(s.verify_steps for s in got.row_stats)
            trt.prepare_correction(params)  # built ahead: those rounds fuse
            dec, got = run(trt, draft, params, "on")
            assert got.token_ids == want and dec.fused_stats()["fused_fallback"] == {}


def test_fused_correction_option_is_checked(pair, engines):
    verifier, drafters = engines
    torch_verifier = load_model(pair[0])
    with pytest.raises(ValueError, match="fused_correction must be one of on, off, auto"):
        SpeculativeDecoder(verifier, drafters["model"], fused_correction="yes")
    with pytest.raises(ValueError, match="fused_correction='on' needs a verifier engine"):
        SpeculativeDecoder(torch_verifier, None, fused_correction="on")
    assert not SpeculativeDecoder(torch_verifier, None, fused_correction="auto").fused
    auto = SpeculativeDecoder(verifier, drafters["model"], fused_correction="auto")
    assert auto.fused == type(verifier).fused_by_default




def test_cli_generate_fused_correction(pair, pair_engines):
    common = ["generate", "--engines", str(pair_engines), "--prompt-ids", "4,8,15,16",
              "--max-new-tokens", "12", "--rule", "exact", "--temperature", "0.8", "--json",
              "--ignore-eos", "--seed", "7"]
    runs = {}
    for mode in ("on", "off", "auto"):
        r = run_cli(*common, "--fused-correction", mode)
        assert r.returncode == 0, r.stderr
        runs[mode] = json.loads(r.stdout)
    assert runs["on"]["token_ids"] == runs["off"]["token_ids"] == runs["auto"]["token_ids"]
    assert runs["on"]["fused_correction"] and runs["on"]["fused_rounds"] > 0
    assert runs["on"]["fused_fallback"] == {} and runs["off"]["fused_rounds"] == 0
    r = run_cli("generate", "--verifier", pair[0], "--prompt-ids", "1,2", "--no-speculation",
                "--fused-correction", "on")
    assert r.returncode == 2 and "--fused-correction on needs --engines" in r.stderr


def test_bench_runs_fused_twins_beside_their_rows():
    rows = plan([1, 8], [2, 4], ["model"], with_hf=False, fused_modes=("off", "on"))
    twins = [(a, b) for a, b in itertools.pairwise(rows) if b.fused_correction == "on"]
    assert twins and all(a.fused_correction == "off" and (a.variant, a.rule, a.k, a.batch_size)
                         == (b.variant, b.rule, b.k, b.batch_size) for a, b in twins)
    # K = 0 and the default K, fixed schedule: the K sweep and the goodput policy run once
    assert {(b.k, b.batch_size) for _, b in twins} == {(0, 1), (4, 1), (0, 8), (4, 8)}
    assert all(r.schedule == "fixed" for _, r in twins)
    assert len(plan([1, 8], [2, 4], ["model"], with_hf=False)) == len(rows) - len(twins)


def test_bench_summary_sets_the_modes_side_by_side():
    rows = plan([1], [4], ["model"], with_hf=False, fused_modes=("off", "on"))
    for r in rows:
        r.backend = "onnx"
        r.repeat_tokens_per_second = [100.0, 200.0] if r.fused_correction == "off" else [
            90.0, 220.0]
    rows[1].fused_fallback = {"audit": 3}
    cells = fused_comparison(rows)["onnx"]["batch_1"]
    assert set(cells) == {f"{r.variant} {r.rule} K={r.k}" for r in rows
                          if r.fused_correction == "on"}
    cell = cells["baseline greedy K=0"]
    assert cell["off"] == 150.0 and cell["on"] == 155.0
    assert cell["on_over_off"] == pytest.approx((0.9 + 1.1) / 2)
    assert cell["fused_fallback"] == {"on": {"audit": 3}}
