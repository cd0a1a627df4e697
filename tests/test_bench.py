"""bench's distance to Leviathan's bound (the arithmetic by hand) and its phase breakdown, on
the tiny random pair (the pipeline function, not the CLI)."""

from __future__ import annotations

import json
import math

import pytest

from paradraft.runtime.drafters import Drafter
from paradraft.runtime.k_policy import analytic_length
from paradraft.runtime.model import load_model
from paradraft.runtime.tools.bench import (
    PHASES,
    alpha_from_mean_accepted,
    leviathan_bound,
    print_rows,
    run_bench,
    write_outputs,
)


def test_leviathan_bound_by_hand():
    # (1 − 0.8^5) / (0.2 · (4 · 0.1 + 1)) = 0.67232 / 0.28
    assert leviathan_bound(0.8, 4, 0.1) == pytest.approx(0.67232 / 0.28)
    assert leviathan_bound(0.8, 4, 0.1) == pytest.approx(2.4011, abs=1e-4)
    # α = 0: only the verifier's own token per round, the drafts still paid for
    assert leviathan_bound(0.0, 4, 0.1) == pytest.approx(1 / 1.4)
    assert leviathan_bound(0.0, 3, 0.0) == 1.0
    # α = 1 exactly: the limit (K+1)/(Kc+1), no division by zero
    assert leviathan_bound(1.0, 4, 0.1) == pytest.approx(5 / 1.4)
    assert leviathan_bound(1.0 - 1e-9, 4, 0.1) == pytest.approx(5 / 1.4, rel=1e-6)
    # K = 0 is plain decoding
    assert leviathan_bound(0.7, 0, 0.3) == 1.0
    # a real K (the goodput policy's mean K) sits between its integer neighbours
    assert leviathan_bound(0.8, 3, 0.1) < leviathan_bound(0.8, 3.5, 0.1) < leviathan_bound(
        0.8, 4, 0.1)
    for bad in [(-0.1, 4, 0.1), (1.1, 4, 0.1), (0.5, -1, 0.1), (0.5, 4, -0.1)]:
        with pytest.raises(ValueError):
            leviathan_bound(*bad)


def test_leviathan_bound_shape():
    alphas = [0.0, 0.3, 0.6, 0.9, 1.0]
    for k in (1, 4, 8):
        # free drafts: never slower than plain decoding
        assert all(leviathan_bound(a, k, 0.0) >= 1.0 for a in alphas)
        # better acceptance helps, dearer drafts hurt
        values = [leviathan_bound(a, k, 0.1) for a in alphas]
        assert values == sorted(values)
        costs = [leviathan_bound(0.8, k, c) for c in (0.0, 0.05, 0.2, 1.0)]
        assert costs == sorted(costs, reverse=True)


def test_alpha_from_mean_accepted_inverts_the_expected_length():
    # 0.8 + 0.64 + 0.512 + 0.4096 accepted drafts per round at K=4
    assert alpha_from_mean_accepted(2.3616, 4) == pytest.approx(0.8, abs=1e-12)
    for k in (1, 2, 4, 7, 2.5):
        for alpha in (0.05, 0.3, 0.5, 0.9, 0.99):
            mean = analytic_length(alpha, k) - 1.0
            assert alpha_from_mean_accepted(mean, k) == pytest.approx(alpha, abs=1e-9)
    # K = 1: the mean accepted is α itself
    assert alpha_from_mean_accepted(0.37, 1) == pytest.approx(0.37)
    # the ends: nothing accepted, everything accepted (or more, by rounding), no drafts
    assert alpha_from_mean_accepted(0.0, 4) == 0.0
    assert alpha_from_mean_accepted(4.0, 4) == 1.0
    assert alpha_from_mean_accepted(4.0 + 1e-12, 4) == 1.0
    assert alpha_from_mean_accepted(0.0, 0) == 0.0


@pytest.fixture(scope="module")
def bench_rows(pair):
    vdir, ddir, pdir, _ = pair
    verifier = load_model(vdir)
    drafters = {"model": Drafter("model", load_model(ddir)),
                "parallel": Drafter("parallel", load_model(pdir))}
    prompts = [[3, 14, 15, 9, 26, 5, 35, 8]]
    return run_bench(verifier, drafters, prompts, max_new_tokens=8, batch_sizes=[1, 2],
                     ks=[2], hf_dirs=None, seed=0)


def test_bench_rows_carry_the_bound_and_the_phase_breakdown(bench_rows, tmp_path, capsys):
    write_outputs(bench_rows, tmp_path, {"test": True})
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert {r["batch_size"] for r in rows} == {1, 2}
    # the rows that drafted (the goodput policy may choose K=0 for every round on a tiny pair)
    spec = [r for r in rows if r["variant"] != "baseline" and r["mean_k"]]
    assert {r["variant"] for r in spec if r["schedule"] == "fixed"} == {"model", "parallel"}
    for r in rows:
        # the phases cover the wall clock: shares sum to 1, ms per round to the row's seconds
        assert set(r["phase_share"]) == set(PHASES)
        assert sum(r["phase_share"].values()) == pytest.approx(1.0, abs=1e-9)
        assert all(v >= -1e-9 for v in r["phase_share"].values())
        assert r["rounds"] > 0
        assert sum(r["phase_ms_per_round"].values()) * r["rounds"] / 1e3 == pytest.approx(
            r["seconds"], rel=1e-6)
        assert r["phase_share"]["verify"] > 0 and r["phase_share"]["prefill"] > 0
    for r in spec:
        assert 0.0 <= r["alpha"] <= 1.0 and 0.0 <= r["alpha_per_position"] <= 1.0
        assert r["cost_ratio"] > 0 and r["verify_vs_plain_step"] > 0
        assert r["phase_share"]["draft"] > 0
        # α is chosen so that Leviathan's tokens per round are the measured ones
        k = r["mean_k"]
        assert r["bound"] * (k * r["cost_ratio"] + 1) == pytest.approx(
            r["mean_acceptance_length"], rel=1e-6)
        assert r["bound"] == pytest.approx(leviathan_bound(r["alpha"], k, r["cost_ratio"]))
        # drafts that cost less than the tokens they win put the bound above plain decoding
        assert (r["bound"] >= 1.0) == (k * r["cost_ratio"] <= r["mean_acceptance_length"] - 1)
        # the bound counts decoding rounds: efficiency takes the speed-up without the
        # prefill, in both runs (the end-to-end one is kept beside it)
        assert r["efficiency"] == pytest.approx(r["decode_speedup"] / r["bound"])
        assert r["efficiency_end_to_end"] == pytest.approx(
            r["speedup_vs_baseline"] / r["bound"])
        assert math.isfinite(r["efficiency"]) and r["efficiency"] > 0
        # the verify pass at its measured cost: a round costs K·c + v plain steps, not K·c + 1
        assert r["bound_at_verify_cost"] * (k * r["cost_ratio"] + r["verify_vs_plain_step"]) \
            == pytest.approx(r["mean_acceptance_length"], rel=1e-6)
        assert r["loop_efficiency"] == pytest.approx(
            r["decode_speedup"] / r["bound_at_verify_cost"])
        assert 0.0 < r["occupancy"] <= 1.0
    # the pair's drafts agree with the verifier often under greedy decoding
    assert max(r["alpha"] for r in spec if r["rule"] == "greedy") > 0.3
    for r in rows:
        # decoding is everything after each row's first token (the prefill's); one repeat
        prompts = 1 if r["batch_size"] == 1 else 2  # the one prompt, repeated to fill a batch
        assert r["decode_tokens"] == r["tokens"] - prompts
        assert r["decode_speedup"] > 0 and len(r["repeat_decode_tokens_per_second"]) == 1
        if r["variant"] == "baseline":
            assert r["alpha"] is None and r["bound"] is None and r["efficiency"] is None
            assert r["occupancy"] == 1.0 and r["decode_speedup"] == 1.0
        elif not r["mean_k"]:  # no drafts, no bound to be measured against
            assert r["bound"] is None and r["efficiency"] is None
    print_rows(bench_rows)
    out = capsys.readouterr().out
    assert "bound" in out and "eff" in out and "where a round's time goes" in out
    assert "decode" in out and "loop" in out
    assert all(p in out for p in PHASES)
