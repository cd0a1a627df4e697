"""A soak: a served deployment under mixed, misbehaving load for a long time, and what must
hold after it.

Clients (``concurrency`` threads, each sleeping while it waits) send OpenAI requests one
after another, each of a random kind: read to the end, streamed or not; hang up after a few
events (a cancellation); hang up before reading anything (a disconnect); end at a stop
string. They mix the drafters the server runs, and half ask for a K of their own. Every
request must end with text or a named error, none may hang (``timeout_s`` of silence) or be
lost. Every ``sample_s`` the resident memory of each server process and the output tokens/s
are sampled. At the end the server must settle with every KV slot free, and its counters must
add up: requests received = the sum of those ended, by outcome. ``check`` says what failed.
"""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

KINDS = ("stream", "complete", "cancel", "disconnect", "stop")
STOP_STRINGS = ("\n\n", "return", ":", " the", ".")
PROMPTS = ("def fibonacci(n):", "Write a haiku about the sea.", "class Stack:",
           "Explain recursion in one sentence.", "import numpy as np\n", "The capital of")
RSS_GROWTH_LIMIT = 0.05  # of the RSS at the start of the checked window
RSS_WINDOW_S = 1200.0  # the window RSS growth is checked over: the last 20 minutes


@dataclass
class SoakConfig:
    host: str  # the OpenAI API's
    port: int
    metrics_url: str  # Triton's Prometheus endpoint
    processes: dict[str, int]  # name -> pid of each server process whose memory is sampled
    duration_s: float = 1800.0
    concurrency: int = 8
    max_tokens: int = 48
    drafters: tuple[str | None, ...] = (None,)  # None: the server's own
    # half the requests ask for a K in [1, max_draft_tokens] (the server's --k): under load
    # the goodput policy would otherwise pick plain rounds nearly always, leaving the
    # speculative paths (drafts, rollbacks) unexercised
    max_draft_tokens: int = 0
    timeout_s: float = 120.0
    sample_s: float = 5.0
    seed: int = 0


@dataclass
class SoakReport:
    config: dict
    requests: dict[str, int] = field(default_factory=dict)  # "kind/outcome" -> count
    errors: dict[str, int] = field(default_factory=dict)  # error type -> count
    samples: list[dict] = field(default_factory=list)  # t, tokens_per_second, rss_mb{}
    counters: dict[str, float] = field(default_factory=dict)
    settled_s: float | None = None  # how long the server took to free every slot
    rss_growth: dict[str, float] = field(default_factory=dict)

    def check(self) -> list[str]:
        """What failed ([] when the soak passed)."""
        failures = [f"{n} requests {key}" for key, n in self.requests.items()
                    if key.endswith(("/lost", "/hung"))]
        if self.settled_s is None:
            failures.append("the server did not free every KV slot after the load")
        received = self.counters.get("requests_received", 0)
        ended = sum(v for k, v in self.counters.items() if k.startswith("ended_"))
        if received != ended:
            failures.append(f"requests received {received:g} != ended {ended:g} "
                            f"({self.counters})")
        failures += [f"{name}'s RSS grew {growth:.1%} (limit {RSS_GROWTH_LIMIT:.0%})"
                     for name, growth in self.rss_growth.items() if growth > RSS_GROWTH_LIMIT]
        return failures


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def read_metrics(url: str) -> dict[str, float]:
    """The paradraft counters and gauges this checks, summed over instances."""
    out: dict[str, float] = {}
    with urllib.request.urlopen(url, timeout=10) as r:
        for line in r.read().decode().splitlines():
            if not line.startswith("paradraft_"):
                continue
            name, value = line.rsplit(" ", 1)
            key = name.split("{")[0]
            if key == "paradraft_requests_ended_total":
                key = "ended_" + name.split('outcome="')[1].split('"')[0]
            out[key.removeprefix("paradraft_").removesuffix("_total")] = \
                out.get(key, 0.0) + float(value)
    return out


def one_request(config: SoakConfig, rng: random.Random) -> tuple[str, str, int]:
    """Send one request of a random kind; (kind, outcome, output tokens). Outcomes: text,
    error (a named error: an OpenAI error body or an error event), cancelled (we hung up),
    lost (the connection broke or the stream ended without [DONE]), hung (silent for
    ``timeout_s``)."""
    kind = rng.choice(KINDS)
    body = {"model": "paradraft", "prompt": rng.choice(PROMPTS), "temperature": 0,
            "max_tokens": rng.randint(1, config.max_tokens), "ignore_eos": rng.random() < 0.5}
    drafter = rng.choice(config.drafters)
    if drafter is not None:
        body["drafter"] = drafter
    if config.max_draft_tokens and rng.random() < 0.5:
        body["num_draft_tokens"] = rng.randint(1, config.max_draft_tokens)
    if kind == "stop":
        body["stop"] = rng.sample(STOP_STRINGS, 2)
    if kind != "complete":
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    connection = http.client.HTTPConnection(config.host, config.port, timeout=config.timeout_s)
    try:
        connection.request("POST", "/v1/completions", json.dumps(body),
                           {"Content-Type": "application/json"})
        if kind == "disconnect":
            return kind, "cancelled", 0
        response = connection.getresponse()
        if response.status != 200:
            error = json.loads(response.read())["error"]
            return kind, f"error:{error['type']}", 0
        if kind == "complete":
            return kind, "text", json.loads(response.read())["usage"]["completion_tokens"]
        return read_stream(kind, response, rng)
    except TimeoutError:
        return kind, "hung", 0
    except (OSError, http.client.HTTPException, ValueError, KeyError):
        return kind, "lost", 0
    finally:
        connection.close()


def read_stream(kind: str, response, rng: random.Random) -> tuple[str, str, int]:
    hang_up_after = rng.randint(1, 4) if kind == "cancel" else None
    events = tokens = 0
    for line in response:
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        if data == b"[DONE]":
            return kind, "text", tokens
        event = json.loads(data)
        if "error" in event:
            return kind, f"error:{event['error']['type']}", tokens
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
        events += 1
        if hang_up_after is not None and events >= hang_up_after:
            return kind, "cancelled", tokens
    return kind, "lost", tokens


def run_soak(config: SoakConfig) -> SoakReport:
    report = SoakReport(asdict(config))
    lock = threading.Lock()
    tokens_done = [0]
    deadline = time.monotonic() + config.duration_s

    def client(index: int) -> None:
        rng = random.Random(config.seed * 1000 + index)
        while time.monotonic() < deadline:
            kind, outcome, tokens = one_request(config, rng)
            with lock:
                key = f"{kind}/{outcome.split(':')[0]}"
                report.requests[key] = report.requests.get(key, 0) + 1
                if outcome.startswith("error:"):
                    name = outcome.split(":", 1)[1]
                    report.errors[name] = report.errors.get(name, 0) + 1
                tokens_done[0] += tokens

    threads = [threading.Thread(target=client, args=(i,), daemon=True)
               for i in range(config.concurrency)]
    start = time.monotonic()
    for t in threads:
        t.start()
    last_tokens, last_t = 0, start
    while any(t.is_alive() for t in threads):
        time.sleep(config.sample_s)
        now = time.monotonic()
        with lock:
            done = tokens_done[0]
        report.samples.append({
            "t": round(now - start, 2),
            "tokens_per_second": (done - last_tokens) / max(now - last_t, 1e-9),
            "rss_mb": {name: rss_mb(pid) for name, pid in config.processes.items()}})
        last_tokens, last_t = done, now
    for t in threads:
        t.join(config.timeout_s)
    report.settled_s = settle(config.metrics_url)
    report.counters = read_metrics(config.metrics_url)
    report.rss_growth = rss_growth(report.samples)
    return report


def settle(metrics_url: str, timeout: float = 30.0) -> float | None:
    """Seconds until no request runs or waits, and every ended request is counted."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        m = read_metrics(metrics_url)
        ended = sum(v for k, v in m.items() if k.startswith("ended_"))
        if (m.get("active_sequences", 0) == 0 and m.get("queue_depth", 0) == 0
                and m.get("requests_received", 0) == ended):
            return time.monotonic() - t0
        time.sleep(0.2)
    return None


def rss_growth(samples: list[dict]) -> dict[str, float]:
    """Each process's RSS growth over the checked window: the last RSS_WINDOW_S seconds, or
    the last two thirds of a shorter run (the first third is the warm-up)."""
    if len(samples) < 3:
        return {}
    end = samples[-1]["t"]
    begin = max(end - RSS_WINDOW_S, end / 3)
    window = [s for s in samples if s["t"] >= begin]
    out = {}
    for name in samples[-1]["rss_mb"]:
        values = [s["rss_mb"][name] for s in window if s["rss_mb"].get(name)]
        if len(values) >= 2:
            out[name] = (values[-1] - values[0]) / values[0]
    return out


def write_report(report: SoakReport, out: Path) -> None:
    """soak.json, and soak.png: RSS per process and tokens/s over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps({**asdict(report), "failures": report.check()},
                                              indent=2))
    t = [s["t"] / 60 for s in report.samples]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for name in report.config["processes"]:
        top.plot(t, [s["rss_mb"].get(name) for s in report.samples], label=name)
    top.set_ylabel("RSS (MB)")
    top.legend(fontsize=8)
    bottom.plot(t, [s["tokens_per_second"] for s in report.samples])
    bottom.set_ylabel("output tokens/s")
    bottom.set_xlabel("minutes")
    fig.suptitle(f"soak: concurrency {report.config['concurrency']}, mixed requests")
    fig.tight_layout()
    fig.savefig(out / "soak.png", dpi=110)
    plt.close(fig)
