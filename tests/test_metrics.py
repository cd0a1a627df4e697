"""The acceptance-floor alert."""



from paradraft.runtime.correction import RuleParams
from paradraft.runtime.drafters import Drafter
from paradraft.runtime.metrics import AcceptanceMonitor
from paradraft.runtime.model import load_model
from paradraft.runtime.speculative import SpeculativeDecoder

PROMPTS = [[4, 8, 15], [16, 23, 42, 7, 7], [9]]


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
