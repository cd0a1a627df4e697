"""Quality metrics on hand-made cases, and bench / eval / tune end to end on a tiny setting
with the shipped demo models."""

import json
import math
import re
from pathlib import Path

import pytest
import torch
from conftest import run_cli

from paradraft.runtime.model import load_model
from paradraft.runtime.tools.evaluate import (
    QualityRow,
    bootstrap_ppl_change,
    compare,
    continuation_logprobs,
    distinct_n,
    frontier,
    heldout_perplexity,
    perplexity_from_logprobs,
)

DEMO = Path(__file__).resolve().parent.parent / "models" / "demo"


def test_perplexity_by_hand():
    # probabilities 1/2, 1/4, 1/8: mean NLL = (1+2+3)/3 · ln 2 = 2 ln 2 -> perplexity 4
    logprobs = [math.log(0.5), math.log(0.25), math.log(0.125)]
    assert perplexity_from_logprobs(logprobs) == pytest.approx(4.0)
    with pytest.raises(ValueError, match="at least one token"):
        perplexity_from_logprobs([])


def test_continuation_logprobs_match_a_manual_softmax(pair):
    model = load_model(pair[0])
    prompt, cont = [3, 5, 7], [11, 13]
    got = continuation_logprobs(model, prompt, cont)
    from paradraft.runtime.model import new_kv_cache

    cache = new_kv_cache(model.config, 1, 8, torch.float32)
    with torch.no_grad():
        logits, _ = model(torch.tensor([prompt + cont]), torch.arange(5)[None], cache)
    p = torch.softmax(logits[0], -1)
    want = [math.log(p[2, 11]), math.log(p[3, 13])]
    assert got == pytest.approx(want, abs=1e-5)


def test_heldout_perplexity_scores_the_references_cut_to_the_generated_length(pair):
    model = load_model(pair[0])
    pairs = [([3, 5, 7], [11, 13, 17, 19]), ([4, 6], [8, 10, 12])]
    first, second = (continuation_logprobs(model, p, c) for p, c in pairs)
    # cut to 2 tokens: only the first two scores of each reference count
    want = math.exp(-(first[0] + first[1] + second[0] + second[1]) / 4)
    assert heldout_perplexity(model, pairs, max_new_tokens=2) == pytest.approx(want)
    assert heldout_perplexity(model, pairs, max_new_tokens=2) != pytest.approx(
        heldout_perplexity(model, pairs, max_new_tokens=4))


def test_distinct_n_by_hand():
    seqs = [[1, 2, 1, 2], [1, 2, 3]]
    # unigrams: 7 total, {1,2,3} distinct; bigrams: (1,2),(2,1),(1,2),(1,2),(2,3) -> 3 / 5
    assert distinct_n(seqs, 1) == pytest.approx(3 / 7)
    assert distinct_n(seqs, 2) == pytest.approx(3 / 5)
    assert distinct_n([[1]], 2) == 0.0


def test_frontier_keeps_only_undominated_settings_by_perplexity_change():
    def row(label, speed, ppl, change):
        r = QualityRow(label, "dynamic", {}, ppl, 0, 0, 0, 0, 0, 0, speedup=speed)
        r.ppl_change_vs_exact = change
        return r

    rows = [row("a", 2.0, 10.0, 0.05), row("b", 1.5, 9.0, 0.01), row("c", 1.4, 9.5, 0.02),
            row("d", 2.0, 11.0, 0.08),
            # the lowest perplexity, from a lower temperature, but the largest change
            row("cold", 1.45, 5.0, 0.30)]
    assert [r.label for r in frontier(rows)] == ["a", "b"]


def quality_row(rule, nll, tokens, distinct_2=0.8):
    ppl = math.exp(sum(nll) / sum(tokens))
    return QualityRow(rule, rule, {}, ppl, 0.5, distinct_2, 0.9, 0.5, 2.0, 100.0,
                      sequence_nll=list(nll), sequence_tokens=list(tokens))


def test_measure_draws_fresh_randoms_for_every_batch(pair):
    # the same prompt in two batches under one seed: two independent samples, not one twice
    from paradraft.runtime.correction import RuleParams
    from paradraft.runtime.tools.evaluate import measure

    verifier = load_model(pair[0])
    row = measure(verifier, None, RuleParams("exact"), 0, prompts=[[3, 5, 7], [3, 5, 7]],
                  max_new_tokens=16, seeds=[0], batch_size=1, label="ar")
    assert len(row.sequence_nll) == 2 and row.sequence_nll[0] != row.sequence_nll[1]


def test_bootstrap_interval_by_hand():
    exact = quality_row("exact", [10.0, 20.0, 15.0, 30.0], [10, 10, 10, 20])
    assert bootstrap_ppl_change(exact, exact) == (0.0, 0.0)
    # every sequence ln 2 nats per token worse: perplexity exactly doubles in every resample
    doubled = quality_row("greedy", [n + t * math.log(2) for n, t in
                                     zip(exact.sequence_nll, exact.sequence_tokens, strict=True)],
                          exact.sequence_tokens)
    assert bootstrap_ppl_change(doubled, exact) == pytest.approx((1.0, 1.0))
    # a noisy row: the interval holds the point estimate and has width
    noisy = quality_row("ratio", [8.0, 26.0, 12.0, 35.0], exact.sequence_tokens)
    low, high = bootstrap_ppl_change(noisy, exact)
    assert low < noisy.perplexity / exact.perplexity - 1 < high and high - low > 0.05
    with pytest.raises(ValueError, match="same, non-zero number"):
        bootstrap_ppl_change(quality_row("ratio", [1.0], [3]), exact)


def test_compare_fails_perplexity_and_collapse_but_not_lossless_noise():
    tokens = [10, 10, 10, 10]
    exact = quality_row("exact", [10.0] * 4, tokens, distinct_2=0.8)
    autoregressive = quality_row("exact", [13.0] * 4, tokens, distinct_2=0.8)  # noise
    worse = quality_row("dynamic", [13.0] * 4, tokens, distinct_2=0.8)  # ppl +35 %
    collapsed = quality_row("greedy", [2.0] * 4, tokens, distinct_2=0.2)  # low ppl, loops
    fine = quality_row("threshold", [10.5] * 4, tokens, distinct_2=0.75)
    rows = [autoregressive, exact, worse, collapsed, fine]
    compare(rows, exact, baseline_tps=50.0, budget=0.10, diversity_budget=0.10)
    assert [r.failed for r in rows] == [[], [], ["perplexity"], ["diversity"], []]
    assert [r.within_budget for r in rows] == [True, True, False, False, True]
    assert worse.ppl_change_vs_exact == pytest.approx(math.exp(0.3) - 1)
    assert collapsed.distinct_2_change_vs_exact == pytest.approx(-0.75)
    assert fine.speedup == pytest.approx(2.0)
    with pytest.raises(ValueError, match=r"diversity_budget must be in \[0, 1\]"):
        compare(rows, exact, 50.0, 0.10, diversity_budget=1.5)
    assert {r.reference for r in rows} == {"exact"}


def test_compare_refuses_an_exact_row_at_another_temperature():
    tokens = [10, 10]
    exact = quality_row("exact", [10.0] * 2, tokens)
    exact.params = {"temperature": 1.0, "top_p": 0.8}
    hotter = quality_row("dynamic", [12.0] * 2, tokens)
    hotter.params = {"temperature": 1.2, "top_p": 0.8}
    with pytest.raises(ValueError, match="another temperature or top_p"):
        compare([hotter], exact, 50.0, 0.10)


needs_demo = pytest.mark.skipif(
    not all((DEMO / m / "config.json").is_file() for m in ("verifier", "draft", "parallel_draft")),
    reason="demo models not present")




@needs_demo
def test_bench_end_to_end_writes_well_formed_json(tmp_path):
    # transformers' peers: test_onnx's bench test runs them (CI's budget)
    r = run_cli("bench", "--prompts", "2", "--max-new-tokens", "8", "--ks", "2",
            "--batch-sizes", "1,2", "--repeats", "2", "--no-hf", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    data = json.loads((tmp_path / "bench.json").read_text())
    assert (tmp_path / "bench.png").stat().st_size > 0
    variants = {(row["system"], row["variant"]) for row in data["rows"]}
    assert {("ours", "baseline"), ("ours", "model"), ("ours", "parallel"),
            ("ours", "self")} <= variants and all(system == "ours" for system, _ in variants)
    assert data["meta"]["repeats"] == 2
    for row in data["rows"]:
        assert row["tokens"] > 0 and row["tokens_per_second"] > 0
        per_repeat = row["repeat_tokens_per_second"]
        assert len(per_repeat) == 2 and row["tokens_per_second"] == pytest.approx(
            sum(per_repeat) / 2)  # the median of two
        # each ratio within one repeat, then their median
        base = next(b for b in data["rows"] if b["variant"] == "baseline" and b["system"] ==
                    "ours" and b["batch_size"] == row["batch_size"]
                    and b["sampling"] == row["sampling"])
        ratios = [a / b for a, b in zip(per_repeat, base["repeat_tokens_per_second"],
                                        strict=True)]
        assert row["speedup_vs_baseline"] == pytest.approx(sum(ratios) / 2)
        if row["system"] == "ours" and row["variant"] != "baseline":
            assert 0.0 <= row["acceptance_rate"] <= 1.0
            assert 1.0 <= row["mean_acceptance_length"] <= row["k"] + 1
            assert len(row["per_position_acceptance"]) == row["k"]
            assert 0.0 <= row["mean_k"] <= row["k"]
    # sampling: every drafter with every sampling rule at the first batch size, K=2 here
    sampled = {(r["variant"], r["rule"]) for r in data["rows"] if r["sampling"]
               and r["variant"] != "baseline"}
    assert sampled == {(d, rule) for d in ("model", "parallel", "self")
                       for rule in ("exact", "threshold", "ratio", "dynamic", "typical")}
    # the goodput policy runs once per drafter and batch size, next to the fixed-K rows
    auto = [(r["variant"], r["batch_size"]) for r in data["rows"] if r["schedule"] == "auto"]
    assert sorted(auto) == sorted((d, b) for d in ("model", "parallel", "self") for b in (1, 2))
    assert set(data["summary"]) == {"batch_1", "batch_2"}


@needs_demo
def test_eval_end_to_end_reports_every_rule(tmp_path):
    r = run_cli("eval", "--prompts", "2", "--max-new-tokens", "8", "--seeds", "1",
            "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    data = json.loads((tmp_path / "eval.json").read_text())
    rules = [row["rule"] for row in data["rows"]]
    assert rules == ["exact", "greedy", "threshold", "ratio", "dynamic", "typical",
                     "threshold", "dynamic", "ratio"]  # the last three at calibrated defaults
    cal = data["calibration"]
    assert 0 < cal["tau"] < 1 and 0 < cal["dynamic_tau"] <= cal["tau"] and cal["gamma"] > 0
    assert f"tau={cal['tau']:.4g}" in data["rows"][6]["label"]
    exact = data["rows"][0]
    assert exact["ppl_change_vs_exact"] == 0.0
    assert {row["reference"] for row in data["rows"]} == {exact["label"]}
    heldout = data["heldout_text_perplexity"]
    assert isinstance(heldout, float) and math.isfinite(heldout) and heldout > 1.0
    for row in data["rows"]:
        assert row["perplexity"] > 1.0 and 0 < row["distinct_1"] <= 1
        low, high = row["ppl_change_interval"]
        assert low <= high
        assert len(row["sequence_nll"]) == len(row["sequence_tokens"]) == 2
        lossy_fail = (row["ppl_change_vs_exact"] > 0.10
                      or row["distinct_2_change_vs_exact"] < -0.10) and row["rule"] != "exact"
        assert row["within_budget"] == (not lossy_fail)


@needs_demo
def test_tune_end_to_end_compares_each_setting_at_its_own_temperature(tmp_path):
    r = run_cli("tune", "--rule", "dynamic", "--prompts", "2", "--max-new-tokens", "8",
            "--seeds", "1", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    data = json.loads((tmp_path / "tune.json").read_text())
    by_label = {row["label"]: row for row in data["rows"]}
    assert len(by_label) == len(data["rows"])  # labels name rows unambiguously

    def sampling(row):
        return row["params"]["temperature"], row["params"]["top_p"]

    tuned = [row for row in data["rows"] if row["rule"] == "dynamic"]
    assert len(tuned) == 16
    # the grid sweeps temperature × top_p: one exact reference per pair, run with the same seeds
    grid = {sampling(row) for row in tuned}
    assert grid == {(t, p) for t in (0.8, 1.2) for p in (0.8, 0.95)}
    exact_rows = [row for row in data["rows"] if row["rule"] == "exact"]
    assert sorted(map(sampling, exact_rows)) == sorted(grid)
    for row in tuned + data["baselines"]:
        ref = by_label[row["reference"]]
        assert ref["rule"] == "exact" and ref["reference"] == ref["label"]
        assert sampling(ref) == sampling(row)
        assert len(ref["sequence_nll"]) == len(row["sequence_nll"]) == 2
        assert row["ppl_change_vs_exact"] == pytest.approx(
            row["perplexity"] / ref["perplexity"] - 1)
    assert sorted(map(sampling, data["baselines"])) == sorted(grid)
    assert set(data["frontier"]) <= set(by_label)
    best = data["best_within_budget"]
    assert best is None or (best["rule"] == "dynamic" and best["within_budget"])
    heldout = data["heldout_text_perplexity"]
    assert math.isfinite(heldout) and heldout > 1.0


@needs_demo
@pytest.mark.parametrize("flag, value, message", [
    ("--seeds", "0", r"seeds must be in \[1,"),
    ("--budget", "-0.5", r"budget must be in \[0, 100\]"),
    ("--diversity-budget", "2", r"diversity_budget must be in \[0, 1\]"),
    ("--k", "0", r"k must be an integer in \[1,"),
])
def test_eval_rejects_bad_settings_naming_them(tmp_path, flag, value, message):
    r = run_cli("eval", flag, value, "--out", str(tmp_path))
    assert r.returncode == 2
    assert re.search(message, r.stderr), r.stderr[-500:]


@needs_demo
@pytest.mark.parametrize("name", ["verifier", "draft", "parallel_draft"])
def test_shipped_models_match_transformers(name):
    from transformers import AutoModelForCausalLM

    path = DEMO / name
    ours = load_model(path)
    theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens = torch.randint(3, ours.config.vocab_size, (2, 24), generator=torch.Generator()
                           .manual_seed(0))
    from paradraft.runtime.model import new_kv_cache

    cache = new_kv_cache(ours.config, 2, 24, torch.float32)
    logits, _ = ours(tokens, torch.arange(24).expand(2, -1), cache)
    with torch.no_grad():
        ref = theirs(tokens).logits
    assert (logits - ref).abs().max() < 1e-4


def test_loadtest_summary_is_the_median_of_per_repeat_ratios():
    from paradraft.runtime.tools.loadtest import LevelResult, summarize

    def level(c, rep, tps):
        return LevelResult(c, rep, 4, 4, 0, 0, int(tps), 1.0, tps, 0, 0, 0, 0, 0.5, 0.1, [])

    # repeat 2 is a slow spell for both levels: the ratio survives it, a mean of tok/s would not
    results = [level(1, 0, 100), level(8, 0, 320), level(1, 1, 50), level(8, 1, 140),
               level(1, 2, 100), level(8, 2, 290)]
    s = summarize(results)
    assert s["c8_vs_c1_per_repeat"] == pytest.approx([3.2, 2.8, 2.9])
    assert s["c8_vs_c1"] == pytest.approx(2.9)
    assert s["tokens_per_second_median"] == {"c1": 100, "c8": 290}
    assert (s["errors"], s["lost"]) == (0, 0)
