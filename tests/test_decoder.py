"""The loop: streaming, seeds, stop conditions, rollback after a planted rejection, the
attention causal audit, validation, and the CLI."""

import json
import subprocess
import sys

import pytest
import torch

import paradraft.runtime.model as model_module
from paradraft.runtime.correction import RuleParams
from paradraft.runtime.model import load_model
from paradraft.runtime.speculative import (
    AcceptanceMonitor,
    Drafter,
    SpeculativeDecoder,
    goodput_k,
    parse_draft_len_schedule,
)

PROMPTS = [[4, 8, 15], [16, 23, 42, 7, 7], [9]]


@pytest.fixture(scope="module")
def verifier(pair):
    return load_model(pair[0])


@pytest.fixture(scope="module")
def draft(pair):
    return load_model(pair[1])


def test_stream_concatenates_to_generate_and_seed_reproduces(verifier, draft):
    params = RuleParams("exact", temperature=0.9, top_p=0.95)
    dec = SpeculativeDecoder(verifier, Drafter("model", draft), params, k=4, max_batch_size=4)
    chunks = list(dec.stream(PROMPTS, 20, seed=7))
    assert len(chunks) > 2  # several rounds, each yielding what each row gained
    streamed = [[t for c in chunks for t in c[b]] for b in range(len(PROMPTS))]
    again = dec.generate(PROMPTS, 20, seed=7).token_ids
    assert streamed == again
    assert dec.generate(PROMPTS, 20, seed=8).token_ids != again


def test_per_row_max_new_tokens_and_eos(verifier, draft):
    dec = SpeculativeDecoder(verifier, Drafter("model", draft), RuleParams("greedy"), k=4,
                             max_batch_size=4)
    full = dec.generate(PROMPTS, 30).token_ids
    limited = dec.generate(PROMPTS, [5, 17, 1]).token_ids
    assert [len(r) for r in limited] == [5, 17, 1]
    assert all(lim == f[: len(lim)] for lim, f in zip(limited, full, strict=True))
    # stop at EOS: pick a token that appears in row 1's continuation
    eos = full[1][6]
    stopped = dec.generate(PROMPTS, 30, eos_token_id=eos).token_ids
    for row, f in zip(stopped, full, strict=True):
        cut = f.index(eos) + 1 if eos in f else len(f)
        assert row == f[:cut]


def test_planted_rejection_rolls_back_and_discards_later_drafts(verifier, monkeypatch):
    """A drafter that proposes the verifier's own greedy continuation except a wrong token at
    j: the round accepts exactly j tokens, later drafts are discarded, and the output still
    equals plain greedy decoding."""
    K = 5
    base = SpeculativeDecoder(verifier, None, RuleParams("greedy"), max_batch_size=3)
    truth = base.generate(PROMPTS, 1 + K + 1).token_ids
    for j in range(K):
        dec = SpeculativeDecoder(verifier, Drafter("self", verifier), RuleParams("greedy"),
                                 k=K, max_batch_size=3)

        def planted(tokens, lengths, k, bound, gen, rows=None, missed=0, j=j):
            drafts = torch.tensor([t[1: 1 + k] for t in truth])
            drafts[:, j] = (drafts[:, j] + 1) % verifier.config.vocab_size
            return drafts, None

        monkeypatch.setattr(dec, "_draft", planted)
        # one round: the first token from prefill, then j accepted + 1 correction
        result = dec.generate(PROMPTS, 1 + j + 1)
        assert result.token_ids == [t[: j + 2] for t in truth]
        s = result.stats
        assert s.verify_steps == 3 and s.accepted_tokens == 3 * j and s.rollbacks == 3
        assert s.accepted_per_position == [3] * j + [0] * (K - j)


@pytest.mark.parametrize("kind", ["model", "parallel"])
def test_undrafted_rounds_are_re_fed_to_the_draft_cache(verifier, pair, kind):
    # rounds with >= 3 rows run without drafts (disable_by_batch_size=3); when slot 0 drafts
    # again, its draft cache must hold exactly what a fresh pass over its tokens gives
    draft = load_model(pair[2] if kind == "parallel" else pair[1])
    dec = SpeculativeDecoder(verifier, Drafter(kind, draft), RuleParams("greedy"), k=3,
                             max_batch_size=4, disable_by_batch_size=3)
    dec.reset()
    gen = torch.Generator().manual_seed(0)
    dec.prefill([0, 1, 2], PROMPTS, [40, 40, 40], [None] * 3, gen)
    for _ in range(5):
        dec.step([0, 1, 2], gen)
    assert dec.draft_missed[0] == 5
    start = dec.host_lengths[0]
    dec.step([0], gen)
    assert dec.draft_missed[0] == 0
    fresh = model_module.new_kv_cache(draft.config, 1, dec.draft_cache.max_seq_len,
                                      draft.dtype)
    tokens = dec.tokens[:1, : start + 1]
    draft(tokens, torch.arange(start + 1)[None], fresh, kv_len=start + 1)
    for layer in range(draft.config.n_layers):
        torch.testing.assert_close(dec.draft_cache.k[layer][0, : start + 1],
                                   fresh.k[layer][0, : start + 1], atol=1e-4, rtol=1e-4)


def test_causal_audit_silent_with_correct_mask_and_catches_a_broken_one(verifier, monkeypatch):
    dec = SpeculativeDecoder(verifier, Drafter("self", verifier), RuleParams("greedy"), k=4,
                             audit_epsilon=1e-6, max_batch_size=4)
    plain = SpeculativeDecoder(verifier, None, RuleParams("greedy"), max_batch_size=4)
    result = dec.generate(PROMPTS, 16)
    assert result.stats.causal_leaks == 0
    assert result.token_ids == plain.generate(PROMPTS, 16).token_ids

    def leaky_mask(input_pos, kv_len):  # each query also sees the next position
        key_pos = torch.arange(kv_len)
        return (key_pos[None, None, :] <= input_pos[:, :, None] + 1)[:, None]

    monkeypatch.setattr(model_module, "attention_mask", leaky_mask)
    broken = dec.generate(PROMPTS, 16).stats
    # every verify block leaks at its first position: each round is cut to zero drafts
    assert broken.causal_leaks == broken.verify_steps
    assert broken.accepted_tokens == 0


def test_decoder_validates_its_inputs(verifier, draft):
    with pytest.raises(ValueError, match=r"k must be an integer in \[1, 64\]"):
        SpeculativeDecoder(verifier, Drafter("model", draft), k=0)
    with pytest.raises(ValueError, match="drafter must be one of"):
        Drafter("beam", draft)
    with pytest.raises(ValueError, match="needs mask_token_id"):
        Drafter("parallel", draft)
    with pytest.raises(ValueError, match=r"self_draft_layers must be in \[1, 2\]"):
        Drafter("self", verifier, num_layers=3)
    dec = SpeculativeDecoder(verifier, Drafter("model", draft), max_batch_size=2,
                             max_seq_len=32)
    with pytest.raises(ValueError, match=r"batch size must be in \[1, 2\]"):
        dec.generate(PROMPTS, 4)
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1"):
        dec.generate(PROMPTS[:1], 0)
    with pytest.raises(ValueError, match="max_seq_len=32"):
        dec.generate(PROMPTS[:1], 30)
    with pytest.raises(ValueError, match="prompt must contain at least one token"):
        dec.generate([[]], 3)
    with pytest.raises(ValueError, match="token ids must be in"):
        dec.generate([[10_000]], 3)


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "paradraft.runtime.cli", *args],
                          capture_output=True, text=True, timeout=300)


def test_cli_generate_json_speculative_equals_no_speculation(pair):
    vdir, ddir, _, _ = pair
    common = ["generate", "--verifier", vdir, "--prompt-ids", "4,8,15,16",
              "--max-new-tokens", "12", "--rule", "greedy", "--json", "--ignore-eos"]
    spec = run_cli(*common, "--draft", ddir, "--k", "3")
    assert spec.returncode == 0, spec.stderr
    plain = run_cli(*common, "--no-speculation")
    assert plain.returncode == 0, plain.stderr
    a, b = json.loads(spec.stdout), json.loads(plain.stdout)
    assert a["token_ids"] == b["token_ids"] and len(a["token_ids"]) == 12
    for key in ("acceptance_rate", "mean_acceptance_length", "verify_steps", "draft_tokens",
                "accepted_tokens", "tokens_per_second"):
        assert key in a["stats"]
    assert a["stats"]["draft_tokens"] > 0 and b["stats"]["draft_tokens"] == 0
    assert b["stats"]["verify_steps"] == 11  # prefill gives the first token


def test_cli_bad_parameter_is_a_clear_error(pair):
    r = run_cli("generate", "--verifier", pair[0], "--prompt-ids", "1,2", "--no-speculation",
                "--top-p", "0", "--rule", "exact")
    assert r.returncode == 2
    assert "top_p must be in (0, 1]" in r.stderr


def test_cli_acceptance_floor_warns_and_is_validated(pair):
    """``--acceptance-floor``: the monitoring hook's floor from the command line."""
    common = ["generate", "--verifier", pair[0], "--draft", pair[1], "--prompt-ids", "4,8,15",
              "--max-new-tokens", "100", "--k", "4", "--ignore-eos"]
    r = run_cli(*common, "--acceptance-floor", "0.99")
    assert r.returncode == 0, r.stderr
    assert "fell below the floor 0.990" in r.stderr
    r = run_cli(*common, "--acceptance-floor", "0")
    assert r.returncode == 0 and "fell below" not in r.stderr
    r = run_cli(*common, "--acceptance-floor", "1.5")
    assert r.returncode == 2 and "acceptance_floor must be in [0, 1]; got 1.5" in r.stderr


def test_acceptance_alert_fires_below_the_floor(verifier, pair, caplog):
    bad = load_model(pair[2])  # parallel draft used autoregressively: rarely agrees past 1
    dec = SpeculativeDecoder(verifier, Drafter("parallel", bad), RuleParams("greedy"), k=8,
                             max_batch_size=3, acceptance_floor=0.95)
    with caplog.at_level("WARNING", logger="paradraft"):
        result = dec.generate(PROMPTS, 40)
    assert result.stats.acceptance_rate < 0.95
    assert dec.monitor.alerts >= 1
    assert "fell below the floor 0.950" in caplog.text
    quiet = SpeculativeDecoder(verifier, Drafter("parallel", bad), RuleParams("greedy"), k=8,
                               max_batch_size=3, acceptance_floor=0.0)
    quiet.generate(PROMPTS, 40)
    assert quiet.monitor.alerts == 0


def test_acceptance_alert_rearms_only_after_recovering_past_the_hysteresis():
    """A rate hovering at the floor warns once, not on every crossing; a real recovery
    (floor + hysteresis) re-arms the alert."""
    monitor = AcceptanceMonitor(floor=0.6, window=100, min_drafted=10, hysteresis=0.05)
    for accepted in [5, 7, 5, 7, 5, 7, 5, 7]:  # 10 drafted a round: the rate around 0.6
        monitor.update(drafted=10, accepted=accepted)
    assert monitor.alerts == 1
    for _ in range(40):  # well above 0.65: recovered
        monitor.update(drafted=10, accepted=9)
    assert not monitor.alerting
    for _ in range(40):
        monitor.update(drafted=10, accepted=2)
    assert monitor.alerts == 2
    # a floor within the hysteresis of 1 re-arms at a perfect rate
    high = AcceptanceMonitor(floor=0.99, window=100, min_drafted=10)
    high.update(drafted=10, accepted=5)
    for _ in range(100):
        high.update(drafted=10, accepted=10)
    assert high.alerts == 1 and not high.alerting


def test_draft_len_schedule_picks_k_by_batch_size(verifier, draft):
    dec = SpeculativeDecoder(verifier, Drafter("model", draft), RuleParams("greedy"), k=4,
                             max_batch_size=8, draft_len_schedule={1: 4, 4: 2, 8: 0})
    dec.reset()
    # TensorRT-LLM's reading: the K of the largest threshold <= the running batch size
    assert [dec.round_k(list(range(b))) for b in range(1, 9)] == [4, 4, 4, 2, 2, 2, 2, 0]
    dec.host_k[0] = 1  # a request's own num_draft_tokens still caps its round
    assert dec.round_k([0]) == 1
    for bad, match in [({2: 4}, "holds batch size 1"), ({1: 5}, r"K in \[0, 4\]"),
                       ({1: 4, 0: 1}, "batch size >= 1"), ("fast", "'auto' or")]:
        with pytest.raises(ValueError, match=match):
            SpeculativeDecoder(verifier, Drafter("model", draft), k=4, draft_len_schedule=bad)
    assert parse_draft_len_schedule("1:4,8:0") == {1: 4, 8: 0}
    with pytest.raises(ValueError, match="SIZE:K"):
        parse_draft_len_schedule("1-4")


def test_goodput_policy_shortens_k_as_the_batch_grows(verifier, draft):
    # round times shaped like this CPU's: at batch 1 a verify pass costs about the same for
    # any K, at batch 8 each extra position costs a lot
    seconds = torch.tensor([[10.0, 11.0, 12.0, 13.0, 14.0],
                            [12.0, 18.0, 26.0, 34.0, 42.0]]) * 1e-3
    assert goodput_k(seconds[0].tolist(), 0.8) == 4
    assert goodput_k(seconds[1].tolist(), 0.8) == 1
    assert goodput_k(seconds[1].tolist(), 0.3) == 0  # poor drafts: plain steps win
    dec = SpeculativeDecoder(verifier, Drafter("model", draft), RuleParams("greedy"), k=4,
                             max_batch_size=8, draft_len_schedule="auto")
    dec.reset()
    dec.round_seconds = ([1, 8], seconds)
    dec.monitor.update(drafted=400, accepted=320, reached=400)  # α = 0.8
    assert dec.round_k([0]) == 4 and dec.round_k(list(range(8))) == 1
    # in between, the times are interpolated: batch 4 sits 3/7 of the way to batch 8
    assert dec.seconds_per_round(4) == pytest.approx(
        (seconds[0] + 3 / 7 * (seconds[1] - seconds[0])).tolist())
    # rounds without drafts fade the evidence back to the prior, so drafting resumes
    dec.monitor.update(drafted=400, accepted=40, reached=400)
    assert dec.round_k(list(range(8))) == 0
    for _ in range(400):
        dec.monitor.relax(0.97)
    assert dec.monitor.alpha == pytest.approx(0.5, abs=0.01)
    assert dec.round_k([0]) == 4
