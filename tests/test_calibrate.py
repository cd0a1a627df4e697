"""Rule defaults calibrated to the verifier's own confidence."""

import pytest
import torch

from paradraft.runtime.correction import RuleParams
from paradraft.runtime.drafters import Drafter
from paradraft.runtime.model import load_model
from paradraft.runtime.speculative import SpeculativeDecoder
from paradraft.runtime.tools.calibrate import calibrate, default_prompts, verifier_confidence


@pytest.fixture(scope="module")
def models(pair):
    return load_model(pair[0]), load_model(pair[1])


def test_calibrated_values_are_the_stated_quantiles(models):
    verifier, _ = models
    prompts = default_prompts(verifier.config.vocab_size, n=4, length=6)
    cal = calibrate(verifier, prompts, new_tokens=24, quantile=0.2)
    p1, p2, entropy = verifier_confidence(verifier, prompts, 24)
    assert cal.positions == p1.numel() == 4 * 24
    # a draft equal to the argmax passes the threshold rule at ~80 % of positions
    assert abs(float((p1 > cal.tau).float().mean()) - 0.8) < 0.03
    tau_i = cal.dynamic_tau * (1 + cal.alpha * entropy)
    assert abs(float((p1 > tau_i).float().mean()) - 0.8) < 0.03
    assert abs(float((p2 / p1 >= cal.gamma).float().mean()) - 0.5) < 0.03
    assert cal.params_for("dynamic") == {"tau": cal.dynamic_tau, "alpha": 0.1}
    assert cal.params_for("greedy") == {}
    with pytest.raises(ValueError, match=r"quantile must be in \(0, 0\.5\]"):
        calibrate(verifier, prompts, quantile=0.7)


def test_a_more_confident_verifier_gets_a_higher_tau(pair):
    prompts = default_prompts(61, n=4, length=6)
    taus = []
    for scale in (1.0, 3.0):
        verifier = load_model(pair[0])
        with torch.no_grad():
            verifier.lm_head.weight.mul_(scale)
        taus.append(calibrate(verifier, prompts, new_tokens=16).tau)
    assert taus[1] > taus[0]


def test_the_calibrated_threshold_accepts_more_than_a_fixed_tau_that_is_too_high(models):
    """Where the fixed τ sits above the verifier's usual top-1 probability, the threshold
    rule rejects even the argmax; the calibrated τ does not."""
    verifier, draft = models
    prompts = default_prompts(verifier.config.vocab_size, n=4, length=6)
    cal = calibrate(verifier, prompts, new_tokens=24)
    fixed = max(0.95, cal.tau)  # above the verifier's 80th-percentile confidence
    rates = []
    for tau in (fixed, cal.tau):
        dec = SpeculativeDecoder(verifier, Drafter("model", draft),
                                 RuleParams("threshold", tau=tau), k=4, max_batch_size=4)
        rates.append(dec.generate(prompts, 24).stats.acceptance_rate)
    assert rates[1] > rates[0]


def test_an_unset_rule_parameter_takes_the_engines_calibrated_default():
    import argparse

    from paradraft.cli.common import add_rule_args, rule_params

    p = argparse.ArgumentParser()
    add_rule_args(p)
    cal = {"tau": 0.05, "dynamic_tau": 0.03, "gamma": 0.6, "alpha": 0.1, "quantile": 0.2,
           "positions": 10}
    assert rule_params(p.parse_args(["--rule", "threshold"]), cal).tau == 0.05
    assert rule_params(p.parse_args(["--rule", "dynamic"]), cal).tau == 0.03
    assert rule_params(p.parse_args(["--rule", "ratio"]), cal).gamma == 0.6
    # an explicit flag wins; without engines (no calibration) the fixed defaults hold
    assert rule_params(p.parse_args(["--rule", "threshold", "--tau", "0.3"]), cal).tau == 0.3
    assert rule_params(p.parse_args(["--rule", "threshold"])).tau == RuleParams().tau
