"""`paradraft soak` for seconds on the tiny demo models (`make soak` runs it for 30 minutes on
`make demo`'s engines): mixed requests with cancellations, disconnects, stop strings and two
drafters end with text or a named error, none lost or hung; the server frees every slot and its
counters add up (requests received = ended, by outcome); the report and its plot are written."""

import json
import os

import pytest
from conftest import run_cli_process
from test_triton import HAVE_SERVER, MODELS

from paradraft.runtime.tools.soak import SoakReport, rss_growth

pytestmark = pytest.mark.skipif(not HAVE_SERVER and not os.environ.get("CI"),
                                reason="tritonserver not unpacked (make serve-deps)")


def test_a_short_soak_loses_nothing_and_its_counters_add_up(tmp_path):
    r = run_cli_process("soak", "--verifier", str(MODELS / "verifier"), "--draft",
                        str(MODELS / "draft"), "--max-slots", "2", "--max-seq-len", "128",
                        "--duration", "10", "--concurrency", "4", "--max-tokens", "24",
                        "--sample-seconds", "1", "--out", str(tmp_path), timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads((tmp_path / "soak.json").read_text())
    assert report["failures"] == []
    assert (tmp_path / "soak.png").stat().st_size > 0
    outcomes = {key.split("/")[1] for key in report["requests"]}
    assert outcomes <= {"text", "error", "cancelled"}, report["requests"]
    assert {"text", "cancelled"} <= outcomes
    counters = report["counters"]
    ended = {k: v for k, v in counters.items() if k.startswith("ended_")}
    assert counters["requests_received"] == sum(ended.values()) > 0, counters
    assert ended["ended_finished"] > 0 and ended["ended_cancelled"] > 0, counters
    assert counters["active_sequences"] == counters["queue_depth"] == 0
    assert counters["draft_tokens"] > 0 and counters["rollbacks"] > 0  # speculation ran
    assert {"tritonserver", "openai_api", "stub0"} <= set(report["rss_growth"])


def test_the_checks_name_what_failed():
    report = SoakReport({}, requests={"stream/text": 5, "cancel/hung": 1}, settled_s=None,
                        counters={"requests_received": 6, "ended_finished": 5},
                        rss_growth={"stub0": 0.2})
    failures = report.check()
    assert failures[0] == "1 requests cancel/hung"
    assert any("did not free every KV slot" in f for f in failures)
    assert any("received 6 != ended 5" in f for f in failures)
    assert any("stub0's RSS grew 20.0%" in f for f in failures)
    samples = [{"t": t, "rss_mb": {"a": 100 + t}} for t in range(0, 3000, 100)]
    # the last 20 minutes: from t=1700 (1800) to t=2900 (3000)
    assert rss_growth(samples)["a"] == pytest.approx((3000 - 1800) / 1800)
