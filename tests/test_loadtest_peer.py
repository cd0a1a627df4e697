"""``loadtest --peer llama-server`` and the chat protocol, without a model or a real
llama-server: its command lines and flag check, the comparison's ratios, the chat stream's
parsing, and the multiturn client against a stand-in server on 127.0.0.1."""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest

from paradraft.runtime.serving.client import LostRequest, ServerError
from paradraft.runtime.tools import peer_server as ps
from paradraft.runtime.tools.loadtest import (
    FOLLOWUPS,
    ChatLoad,
    LevelResult,
    cached_prompt_tokens,
    parse_variants,
    read_chat_lines,
    read_chat_requests,
    requester,
    run_chat_load,
    run_level,
    run_multiturn,
)
from paradraft.runtime.tools.peer_llamacpp import CMAKE, SERVER, TOOLS, cmake_flags

V, D = Path("/m/verifier.gguf"), Path("/m/draft.gguf")


# -- llama-server's command lines and the flag check -------------------------------------------

def argv(variant: str, draft: Path | None = D) -> list[str]:
    (v,) = ps.parse_peer_variants(variant)
    return ps.server_argv(Path("/bin/llama-server"), V, v, 2, 4, 512, 8123, draft)


def test_every_variant_runs_the_same_model_threads_slots_and_context():
    base = ["/bin/llama-server", "-m", str(V), "-t", "2", "-np", "4", "-c", "2048",
            "--host", "127.0.0.1", "--port", "8123"]
    assert argv("plain") == base
    assert argv("ngram-simple") == [*base, "--spec-type", "ngram-simple"]
    assert argv("ngram-mod") == [*base, "--spec-type", "ngram-mod"]
    assert argv("draft-simple") == [*base, "--spec-type", "draft-simple", "-md", str(D)]


def test_a_variants_k_goes_to_the_flag_that_sets_that_modes_draft_length():
    assert argv("ngram-simple:16")[-4:] == ["--spec-type", "ngram-simple",
                                             "--spec-ngram-simple-size-m", "16"]
    # n_min keeps llama.cpp's default share of n_max (48 of 64), so shorter drafts still go
    assert argv("ngram-mod:16")[-6:] == ["--spec-type", "ngram-mod", "--spec-ngram-mod-n-max",
                                          "16", "--spec-ngram-mod-n-min", "12"]
    assert argv("draft-simple:3")[-6:] == ["--spec-type", "draft-simple", "-md", str(D),
                                            "--spec-draft-n-max", "3"]


@pytest.mark.parametrize("text, message", [
    ("plain,eagle", "'eagle' is not one of plain, ngram-simple"),
    ("plain:4", "plain drafts nothing"),
    ("ngram-mod:0", r"K must be an integer in \[1, 64\]"),
    ("ngram-mod:x", r"K must be an integer in \[1, 64\]"),
    ("plain,plain", "each variant once"),
])
def test_a_bad_peer_variant_is_refused_naming_the_option(text, message):
    with pytest.raises(ValueError, match=f"peer_variants: .*{message}"):
        ps.parse_peer_variants(text)


def test_draft_simple_without_a_draft_is_refused_naming_peer_draft():
    with pytest.raises(ValueError, match="peer_draft"):
        argv("draft-simple", draft=None)


HELP = """----- common params -----
-h,    --help, --usage                  print usage and exit
-t,    --threads N                      number of CPU threads to use during generation
-c,    --ctx-size N                     size of the prompt context (default: 4096)
-np,   --parallel N                     number of server slots (default: -1)
-m,    --model FNAME                    model path to load
--spec-draft-n-max N                    number of tokens to draft for speculative decoding
-md,   --spec-draft-model, --model-draft FNAME
                                        draft model for speculative decoding
--spec-type none,draft-simple,ngram-simple,ngram-mod,ngram-cache
                                        comma-separated list of types of speculative decoding
--spec-ngram-mod-n-min N                minimum number of ngram tokens
--spec-ngram-mod-n-max N                maximum number of ngram tokens
--spec-ngram-simple-size-m N            ngram size M for ngram-simple speculative decoding
--host HOST                             ip address to listen
--port PORT                             port to listen (default: 8080)
"""


def test_help_lists_the_options_and_speculation_types():
    flags, types = ps.help_options(HELP)
    assert {"-t", "-np", "-md", "--spec-type", "--spec-ngram-mod-n-min", "--port"} <= flags
    assert "-devd" not in flags
    assert types == {"none", "draft-simple", "ngram-simple", "ngram-mod", "ngram-cache"}


def test_every_variant_this_build_supports_passes_the_check():
    variants = ps.parse_peer_variants("plain,ngram-simple:16,ngram-mod:16,draft-simple:3")
    ps.check_variants(variants, D, HELP)


def test_a_variant_the_build_lacks_is_refused_by_name():
    old = HELP.replace(",ngram-mod", "")  # a build without the ngram-mod type
    with pytest.raises(ValueError, match=r"does not support 'ngram-mod:16'.*--spec-type "
                                         r"ngram-mod"):
        ps.check_variants(ps.parse_peer_variants("plain,ngram-mod:16"), D, old)
    no_size = HELP.replace("--spec-ngram-simple-size-m", "--spec-ngram-simple-size-x")
    ps.check_variants(ps.parse_peer_variants("ngram-simple"), D, no_size)  # no K: no flag
    with pytest.raises(ValueError, match=r"'ngram-simple:16'.*--spec-ngram-simple-size-m"):
        ps.check_variants(ps.parse_peer_variants("ngram-simple:16"), D, no_size)


def test_the_server_builds_with_its_target_and_no_downloaded_ui():
    flags = cmake_flags((SERVER,))
    assert "-DLLAMA_BUILD_SERVER=ON" in flags and "-DLLAMA_BUILD_SERVER=OFF" not in flags
    assert "-DLLAMA_USE_PREBUILT_UI=OFF" in flags and "-DLLAMA_CURL=OFF" in flags
    assert [f for f in flags if "AMX" in f or "STATIC" in f or "SHARED" in f] == [
        f for f in CMAKE if "AMX" in f or "STATIC" in f or "SHARED" in f]
    assert cmake_flags(TOOLS) == CMAKE


# -- our request variants ----------------------------------------------------------------------

def test_our_variants_are_request_body_fields():
    assert parse_variants("default,plain,ngram,ngram:16", max_k=16) == {
        "default": {}, "plain": {"num_draft_tokens": 0}, "ngram": {"drafter": "ngram"},
        "ngram:16": {"drafter": "ngram", "num_draft_tokens": 16}}


@pytest.mark.parametrize("text, message", [
    ("ngram:16", r"K must be an integer in \[1, 4\] \(the server's --k\)"),
    ("plain:3", "not one of default, plain, ngram, ngram:K"),
    ("fast", "not one of"),
    ("plain,plain", "each variant once"),
])
def test_a_bad_variant_is_refused_naming_the_option(text, message):
    with pytest.raises(ValueError, match=f"variants: .*{message}"):
        parse_variants(text, max_k=4)


# -- the comparison: medians over repeats, ratios to llama-server's best per concurrency ---------

def level(system, variant, c, rep, tps, ttft, cached=0, per_turn=()):
    return LevelResult(c, rep, 8, 8, 0, 0, int(tps * 10), 10.0, tps, ttft, ttft, 5.0, 5.0, 0.0,
                       0.1, [], "chat", ttft_p90_ms=ttft * 2, cached_tokens=cached,
                       system=system, variant=variant, per_turn=list(per_turn))


def test_every_row_is_compared_with_the_peers_best_variant_at_its_concurrency():
    results = [
        level("ours", "default", 1, 0, 20, 1000), level("ours", "default", 1, 1, 24, 800),
        level("ours", "default", 1, 2, 22, 900),
        level("ours", "default", 4, 0, 30, 4000),
        level("llama-server", "plain", 1, 0, 25, 500),
        level("llama-server", "ngram-simple", 1, 0, 40, 600),
        level("llama-server", "plain", 4, 0, 60, 200),
        level("llama-server", "ngram-simple", 4, 0, 50, 250),
    ]
    s = ps.summarize_systems(results)
    c1, c4 = s["levels"]["c1"], s["levels"]["c4"]
    assert c1["peer_best"] == "llama-server ngram-simple"  # per concurrency: not the same one
    assert c4["peer_best"] == "llama-server plain"
    assert c1["ours default"]["tokens_per_second"] == 22  # the median of three repeats
    assert c1["ours default"]["tokens_per_second_vs_peer_best"] == pytest.approx(22 / 40)
    assert c1["ours default"]["ttft_p50_vs_peer_best"] == pytest.approx(900 / 600)
    assert c4["ours default"]["tokens_per_second_vs_peer_best"] == pytest.approx(0.5)
    assert c4["llama-server plain"]["tokens_per_second_vs_peer_best"] == 1.0
    assert c4["ours default"]["ttft_p90_ms"] == 8000


def test_without_a_peer_there_are_no_ratios():
    s = ps.summarize_systems([level("ours", "plain", 1, 0, 20, 100)])
    assert "peer_best" not in s["levels"]["c1"]
    assert "tokens_per_second_vs_peer_best" not in s["levels"]["c1"]["ours plain"]


def test_multiturn_rows_report_each_turns_ttft_against_turn_one():
    turns = [{"turn": 1, "ttft_p50_ms": 1000.0, "cached_tokens": 0},
             {"turn": 2, "ttft_p50_ms": 200.0, "cached_tokens": 1200}]
    s = ps.summarize_systems([level("ours", "default", 4, 0, 30, 600, 1200, turns)])
    row = s["levels"]["c4"]["ours default"]
    assert row["turns"][1] == {"turn": 2, "ttft_p50_ms": 200.0, "ttft_p50_vs_turn_1": 0.2,
                               "cached_tokens": 1200}


def test_the_comparison_writes_json_and_a_plot(tmp_path, capsys):
    turns = [{"turn": 1, "ttft_p50_ms": 900.0, "cached_tokens": 0},
             {"turn": 2, "ttft_p50_ms": 100.0, "cached_tokens": 50}]
    results = [level("ours", "default", 1, 0, 20, 900, 50, turns),
               level("llama-server", "plain", 1, 0, 25, 500, 60, turns)]
    data = ps.write_comparison(results, tmp_path, {"max_tokens": 16})
    written = json.loads((tmp_path / "loadtest.json").read_text())
    assert written["summary"] == json.loads(json.dumps(data["summary"]))
    assert [r["system"] for r in written["levels"]] == ["ours", "llama-server"]
    assert (tmp_path / "loadtest.png").stat().st_size > 0
    ps.print_comparison(results, data["summary"])
    out = capsys.readouterr().out
    assert "vs llama-server plain" in out and "tok/s 0.80x" in out and "turn 2" in out


# -- the chat stream, against a stand-in server --------------------------------------------------

def sse(events: list[dict | str]) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode()
                    for e in events)


def chat_events(answer: str, prompt_tokens: int, cached: int, style: str) -> list:
    """A stream as llama-server (``timings``) or ours (``prompt_tokens_details`` and the
    ``paradraft`` stats) send it, answering two characters a chunk."""
    pieces = [answer[i:i + 2] for i in range(0, len(answer), 2)]
    events: list = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": None},
                                  "finish_reason": None}]}]
    events += [{"choices": [{"index": 0, "delta": {"content": p}, "finish_reason": None}]}
               for p in pieces]
    events.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    usage = {"completion_tokens": 2 * len(pieces), "prompt_tokens": prompt_tokens,
             "total_tokens": 2 * len(pieces) + prompt_tokens}
    if style == "ours":
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
        events.append({"choices": [], "usage": usage, "paradraft": {
            "acceptance_rate": 0.5, "accepted_draft_tokens": 3, "draft_tokens": 6}})
    else:
        events.append({"choices": [], "usage": usage, "timings": {
            "cache_n": cached, "prompt_n": prompt_tokens - cached, "draft_n": 8,
            "draft_n_accepted": 6}})
    return [*events, "[DONE]"]


class StandIn(BaseHTTPRequestHandler):
    """/v1/chat/completions: answers ``A<n>`` where n counts the request's messages; reports
    10 prompt tokens a message, all but the last message's cached (with a response_format:
    ``{"n": <n>}``); ``fail`` in the last message is a 400, ``cut`` a stream without its end.
    Records every body and connection."""

    protocol_version = "HTTP/1.1"
    style = "llama"
    delay = 0.0
    # per test: the fixture makes a subclass with its own
    bodies: ClassVar[list[dict]] = []
    ports: ClassVar[set[int]] = set()
    in_flight = peak = 0
    lock = threading.Lock()

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        cls = type(self)
        with cls.lock:
            cls.bodies.append(body)
            cls.ports.add(self.client_address[1])
            cls.in_flight += 1
            cls.peak = max(cls.peak, cls.in_flight)
        time.sleep(cls.delay)
        last = body["messages"][-1]["content"]
        n = len(body["messages"])
        answer = json.dumps({"n": n}) if "response_format" in body else f"A{n}-answer"
        events = chat_events(answer, 10 * n, 10 * (n - 1), cls.style)
        status, data = 200, sse(events[:3] if "cut" in last else events)
        if "fail" in last:
            status, data = 400, b'{"error": {"message": "no such thing", "code": 400}}'
        with cls.lock:  # before the answer: the client's next request may come straight after
            cls.in_flight -= 1
        self.send_response(status)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def standin():
    handler = type("Handler", (StandIn,), {"bodies": [], "ports": set(), "in_flight": 0,
                                           "peak": 0, "lock": threading.Lock()})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    # a short poll: shutdown() waits for it
    thread = threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}", handler
    server.shutdown()
    server.server_close()


USER = [{"role": "user", "content": "Complete f."}]


def test_cached_tokens_come_from_usage_else_from_llama_servers_timings():
    usage = {"prompt_tokens": 50, "prompt_tokens_details": {"cached_tokens": 30}}
    assert cached_prompt_tokens(usage, {"cache_n": 7}) == 30
    assert cached_prompt_tokens({"prompt_tokens": 50}, {"cache_n": 7}) == 7
    assert cached_prompt_tokens({"prompt_tokens_details": {"cached_tokens": 0}},
                                {"cache_n": 7}) == 0
    assert cached_prompt_tokens(None, None) == 0


@pytest.mark.parametrize("style, accepted, drafted", [("llama", 6, 8), ("ours", 3, 6)])
def test_a_chat_stream_gives_text_tokens_cached_prompt_and_draft_stats(
        standin, style, accepted, drafted):
    url, handler = standin
    handler.style = style
    send, close = requester("chat", url, 10, extra={"num_draft_tokens": 0})
    r = send([*USER, {"role": "assistant", "content": "x"}, *USER], 16)
    close()
    assert r.text == "A3-answer" and r.chunks == ["A3", "-a", "ns", "we", "r"]
    assert sum(r.chunk_tokens) == 10 and len(r.chunk_times) == 5  # the role chunk: no text
    assert r.first_token_s == r.chunk_times[0] > 0
    assert (r.prompt_tokens, r.cached_tokens) == (30, 20)
    assert (r.total_accepted_draft_tokens, r.total_draft_tokens) == (accepted, drafted)
    assert r.finish_reason == "stop"
    body = handler.bodies[0]
    assert body["temperature"] == 0 and body["stream"] is True and body["max_tokens"] == 16
    assert body["stream_options"] == {"include_usage": True}
    assert body["num_draft_tokens"] == 0


def test_an_error_status_is_an_error_and_a_cut_stream_is_lost(standin):
    url, _ = standin
    send, _ = requester("chat", url, 10)
    with pytest.raises(ServerError, match="HTTP 400"):
        send([{"role": "user", "content": "fail"}], 8)
    with pytest.raises(LostRequest, match="without a final response"):
        send([{"role": "user", "content": "cut"}], 8)


def test_every_chat_request_opens_a_new_connection(standin):
    url, handler = standin
    send, _ = requester("chat", url, 10)
    for _ in range(3):
        send(USER, 8)
    assert len(handler.ports) == 3


# -- requests with a response_format -------------------------------------------------------------

def schema_format(name: str, n_type: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": {
        "type": "object", "properties": {"n": {"type": n_type}}, "required": ["n"]}}}


def test_a_lines_response_format_goes_with_its_request_and_its_answers_are_checked(
        standin, tmp_path):
    url, handler = standin
    lines = [{"messages": USER, "response_format": schema_format("int", "integer")},
             # the stand-in's {"n": 1} does not follow this one
             {"messages": USER, "response_format": schema_format("str", "string")},
             {"messages": USER, "response_format": {"type": "json_object"}},
             {"messages": USER}]
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines))
    read = read_chat_lines(path)
    assert [f for _, f in read] == [line.get("response_format") for line in lines]
    r = run_level(url, [m for m, _ in read], 2, 8, 8, protocol="chat",
                  formats=[f for _, f in read])
    assert (r.answered, r.errors, r.lost) == (8, 0, 0)
    assert (r.constrained, r.schema_valid) == (6, 4)
    sent = [b.get("response_format") for b in handler.bodies]
    assert sorted(map(json.dumps, sent)) == sorted(
        map(json.dumps, [line.get("response_format") for line in lines] * 2))
    plain = run_level(url, [m for m, _ in read], 1, 2, 8, protocol="chat")
    assert (plain.constrained, plain.schema_valid) == (0, 0)


def test_the_json_extraction_set_reads_as_chat_requests_each_with_a_schema():
    read = read_chat_lines(Path(__file__).parents[1] / "prompts" / "json_extraction.jsonl")
    assert len(read) == 16
    assert all(f["type"] == "json_schema" and f["json_schema"]["schema"]["type"] == "object"
               for _, f in read)


@pytest.mark.parametrize("line, message", [
    ({"messages": USER, "max_tokens": 3}, "max_tokens: a chat request carries only"),
    ({"messages": USER, "response_format": "json"}, "response_format must be an object"),
    ({"messages": USER, "response_format": {"type": "xml"}}, "response_format must be"),
    ({"messages": "hi"}, "a chat request is an object"),
])
def test_a_bad_chat_line_is_refused_naming_its_number_and_the_field(tmp_path, line, message):
    path = tmp_path / "requests.jsonl"
    path.write_text(json.dumps({"messages": USER}) + "\n" + json.dumps(line))
    with pytest.raises(ValueError, match=f"line 2: .*{message}"):
        read_chat_lines(path)


def test_followups_with_a_response_format_are_refused(tmp_path):
    path = tmp_path / "followups.jsonl"
    path.write_text(json.dumps({"messages": USER, "response_format": {"type": "json_object"}}))
    with pytest.raises(ValueError, match="request 1: response_format"):
        read_chat_requests(path)


# -- the multiturn workload ----------------------------------------------------------------------

def test_the_followups_file_holds_the_three_later_turns():
    followups = read_chat_requests(FOLLOWUPS)
    assert [m[0]["content"] for m in followups] == [
        "Add type hints to every function.",
        "Now handle the edge cases (empty input, invalid types) explicitly.",
        "Write pytest tests for it."]


def test_each_turn_resends_the_history_with_the_last_answer(standin):
    url, handler = standin
    handler.delay = 0.05
    openers = [[{"role": "user", "content": f"problem {i}"}] for i in range(3)]
    followups = read_chat_requests(FOLLOWUPS)
    r = run_multiturn(url, openers, followups, conversations=4, concurrency=2, max_tokens=8)
    assert (r.requests, r.answered, r.errors, r.lost) == (16, 16, 0, 0)
    assert r.workload == "multiturn" and handler.peak == 2  # two conversations at a time
    assert len(handler.ports) == 16
    fourth = [b["messages"] for b in handler.bodies if len(b["messages"]) == 7]
    assert len(fourth) == 4
    history = next(m for m in fourth if m[0]["content"] == "problem 1")
    assert history == [
        {"role": "user", "content": "problem 1"},
        {"role": "assistant", "content": "A1-answer"}, followups[0][0],
        {"role": "assistant", "content": "A3-answer"}, followups[1][0],
        {"role": "assistant", "content": "A5-answer"}, followups[2][0]]
    # conversation 3 opens with problem 0 again (openers wrap around)
    assert sum(m[0]["content"] == "problem 0" for m in fourth) == 2
    # the stand-in caches all but the last message: 10 tokens each
    assert [(t["turn"], t["requests"], t["cached_tokens"]) for t in r.per_turn] == [
        (1, 4, 0), (2, 4, 80), (3, 4, 160), (4, 4, 240)]
    assert r.cached_tokens == 480
    assert all(t["ttft_p50_ms"] >= 50 for t in r.per_turn)


def test_a_failed_turn_ends_its_conversation_and_its_later_turns_count_as_lost(standin):
    url, _ = standin
    openers = [[{"role": "user", "content": "ok"}], [{"role": "user", "content": "ok"}]]
    followups = [[{"role": "user", "content": "fine"}], [{"role": "user", "content": "fail"}],
                 [{"role": "user", "content": "never"}]]
    r = run_multiturn(url, openers, followups, conversations=2, concurrency=2, max_tokens=8)
    assert (r.requests, r.answered, r.errors, r.lost) == (8, 6, 2, 2)
    assert [(t["requests"], t["answered"]) for t in r.per_turn] == [
        (2, 2), (2, 2), (2, 0), (2, 0)]
    assert any("turn 4 not sent: turn 3 failed" in m for m in r.error_messages)


def test_a_chat_run_labels_every_level_and_variant_and_rotates_multiturn_openers(standin):
    url, handler = standin
    openers = [[{"role": "user", "content": f"problem {i}"}] for i in range(4)]
    load = ChatLoad(openers, levels=[1, 2], max_tokens=8, conversations=2,
                    followups=[[{"role": "user", "content": "more"}]], workload="multiturn")
    results = run_chat_load(url, "ours", parse_variants("default,plain"), load)
    assert [(r.concurrency, r.variant, r.system) for r in results] == [
        (1, "default", "ours"), (1, "plain", "ours"), (2, "default", "ours"),
        (2, "plain", "ours")]
    firsts = [b["messages"][0]["content"] for b in handler.bodies[1:]
              if len(b["messages"]) == 1]  # after the warm-up
    # each run opens with the next two problems: four runs, each problem twice
    assert sorted(firsts) == sorted([f"problem {i}" for i in range(4)] * 2)
    plain = [b for b in handler.bodies if b.get("num_draft_tokens") == 0]
    assert len(plain) == 2 * 2 * 2  # two levels, two conversations, two turns


# -- llama-server's process: started, waited for, stopped ------------------------------------

FAKE = '''
import http.server, sys, time
port = int(sys.argv[sys.argv.index("--port") + 1])
if "--exit" in sys.argv:
    print("error: unknown model"); sys.exit(3)
start = time.monotonic()
class H(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def do_GET(self):
        self.send_response(200 if time.monotonic() - start > 0.3 else 503)
        self.end_headers()
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
'''


def test_the_server_is_waited_for_on_health_and_stopped(tmp_path):
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE)
    port = ps.free_port()
    server = ps.start_server([sys.executable, str(script), "--port", str(port)],
                             tmp_path / "log", "127.0.0.1", port, timeout=20)
    assert ps.healthy("127.0.0.1", port) and server.url == f"127.0.0.1:{port}"
    server.stop()
    assert server.process.poll() is not None and not ps.healthy("127.0.0.1", port)


def test_a_server_that_exits_is_refused_with_its_log(tmp_path):
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE)
    port = ps.free_port()
    with pytest.raises(ps.PeerError, match=r"exited \(3\).*unknown model"):
        ps.start_server([sys.executable, str(script), "--port", str(port), "--exit"],
                        tmp_path / "log", "127.0.0.1", port, timeout=20)


# -- the CLI's checks ----------------------------------------------------------------------------

def test_peer_options_need_the_chat_protocol():
    from paradraft.cli.loadtest import chat_mode

    args = argparse.Namespace(peer="llama-server", variants=None, workload="single",
                              protocol="grpc")
    with pytest.raises(ValueError, match=r"protocol: .*--protocol chat"):
        chat_mode(args)
    args.protocol = None
    assert chat_mode(args)
    assert not chat_mode(argparse.Namespace(peer=None, variants=None, workload="single",
                                            protocol=None))


def test_a_peer_option_out_of_range_is_refused_naming_it_and_its_range():
    from paradraft.cli.loadtest import check_range

    with pytest.raises(ValueError, match=r"peer_threads must be in \[1, 256\]; got 0"):
        check_range(argparse.Namespace(peer_threads=0), "peer_threads", 1, 256)


def test_the_peer_gguf_files_default_to_a_llamacpp_engine_dirs(tmp_path):
    from paradraft.cli.loadtest import engine_ggufs

    def manifest(backend: str, models: dict) -> None:
        (tmp_path / "manifest.json").write_text(json.dumps(
            {"format_version": 1, "backend": backend, "models": models}))

    manifest("llamacpp", {"verifier": {"weights": "verifier.gguf"},
                          "draft": {"weights": "draft.gguf"}})
    assert engine_ggufs(str(tmp_path)) == (tmp_path / "verifier.gguf", tmp_path / "draft.gguf")
    manifest("llamacpp", {"verifier": {"weights": "verifier.gguf"}})
    assert engine_ggufs(str(tmp_path)) == (tmp_path / "verifier.gguf", None)
    manifest("onnx", {})
    assert engine_ggufs(str(tmp_path)) == (None, None)
