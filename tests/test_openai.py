"""The OpenAI-compatible API against a real Triton server on 127.0.0.1 (one of each for the
module), queried with the official ``openai`` client and raw HTTP."""

import json
import os
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from test_tools import TIME, WEATHER
from test_triton import HAVE_SERVER, MODELS, free_port, metrics

from paradraft.runtime.checkpoints import chat_stop_token_ids, format_chat, load_tokenizer
from paradraft.runtime.correction import RuleParams
from paradraft.runtime.drafters import Drafter
from paradraft.runtime.model import load_model
from paradraft.runtime.serving import client as serving_client
from paradraft.runtime.serving import openai_api, protocol
from paradraft.runtime.serving import server as serving_server
from paradraft.runtime.speculative import SpeculativeDecoder

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytestmark = [
    pytest.mark.skipif(not (MODELS / "verifier" / "tokenizer.json").is_file(),
                       reason=f"no models with a tokenizer in {MODELS}"),
    pytest.mark.skipif(not HAVE_SERVER and not os.environ.get("CI"),
                       reason="tritonserver not unpacked (make serve-deps)"),
]
SLOTS, QUEUE, MAX_SEQ = 2, 1, 640
# a ChatML-like template whose turns end with the tokenizer's eos_token (<|endoftext|>)
TEMPLATE = ("{% for m in messages %}# {{ m['role'] }}: {{ m['content'] }}{{ eos_token }}\n"
            "{% endfor %}{% if add_generation_prompt %}# assistant:{% endif %}")
LONG = dict(max_tokens=280, extra_body={"ignore_eos": True})  # holds a slot for seconds


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    verifier = load_model(MODELS / "verifier")
    config = protocol.ServeConfig(
        verifier=str(MODELS / "verifier"), draft=str(MODELS / "draft"), k=4,
        max_slots=SLOTS, max_queue=QUEUE, max_seq_len=MAX_SEQ, max_input_tokens=MAX_SEQ - 1,
        eos_token_id=verifier.config.eos_token_ids)
    work = tmp_path_factory.mktemp("openai")
    chat = work / "chat"
    chat.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (chat / name).write_bytes((MODELS / "verifier" / name).read_bytes())
    (chat / "chat_template.jinja").write_text(TEMPLATE)
    triton = serving_server.start_server(config, str(MODELS / "verifier" / "tokenizer.json"),
                                         grpc_port=free_port(), http_port=free_port(),
                                         metrics_port=free_port(), workdir=work / "triton")
    try:
        server = openai_api.start_openai_server(openai_api.OpenAIConfig(
            grpc_url=triton.grpc_url, tokenizer_dir=str(chat), max_seq_len=MAX_SEQ,
            port=free_port(), max_choices=SLOTS + QUEUE), log=work / "openai.log")
    except BaseException:
        triton.stop()
        raise
    yield server, triton, config, chat
    assert server.stop() == 0, (work / "openai.log").read_text()[-3000:]
    assert triton.stop() == 0, triton.log_excerpt()


@pytest.fixture(scope="module")
def client(api):
    return openai.OpenAI(base_url=api[0].url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def local(api):
    """In-process greedy decoding with the server's settings: the reference outputs."""
    _, _, config, chat = api
    dec = SpeculativeDecoder(load_model(config.verifier),
                             Drafter("model", load_model(config.draft)), RuleParams("greedy"),
                             k=config.k, max_batch_size=1, max_seq_len=MAX_SEQ)
    tok = load_tokenizer(config.verifier)

    def run(ids, max_tokens, eos=config.eos_token_id):
        out = dec.generate([ids], max_tokens, eos_token_id=eos).token_ids[0]
        return tok.decode(out, skip_special_tokens=True), out

    return run, tok, chat


def raw_sse(url, path, body, read_events=None, timeout=60):
    """POST and return the server-sent event lines (all, or the first ``read_events`` and
    then hang up)."""
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    response = urllib.request.urlopen(req, timeout=timeout)
    events = []
    for line in response:
        if line.startswith(b"data: "):
            events.append(line[6:].strip().decode())
            if read_events is not None and len(events) >= read_events:
                response.close()  # the client goes away mid-stream
                break
    return events


def test_models_and_greedy_completion_equal_the_in_process_decoder(api, client, local):
    run, tok, _ = local
    assert [m.id for m in client.models.list().data] == ["paradraft"]
    assert urllib.request.urlopen(api[0].url.removesuffix("/v1") + "/health").status == 200
    for prompt in ["def fibonacci(n):", "import os\nimport sys\n\n"]:
        want, ids = run(tok.encode(prompt).ids, 40)
        done = client.completions.create(model="paradraft", prompt=prompt, max_tokens=40,
                                         temperature=0)
        assert done.choices[0].text == want
        assert done.choices[0].finish_reason == ("length" if len(ids) == 40 else "stop")
        assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (
            len(tok.encode(prompt).ids), len(ids))
        stats = done.model_extra["paradraft"]
        assert stats["draft_tokens"] > 0 and 0 <= stats["acceptance_rate"] <= 1
        chunks = list(client.completions.create(
            model="paradraft", prompt=prompt, max_tokens=40, temperature=0, stream=True,
            stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want
        assert len([c for c in chunks if c.choices]) > 2  # streamed as rounds complete
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ids)
        assert chunks[-2].choices[0].finish_reason == done.choices[0].finish_reason
    # token ids as the prompt
    ids = tok.encode("class Parser:").ids
    assert client.completions.create(model="paradraft", prompt=ids, max_tokens=12,
                                     temperature=0).choices[0].text == run(ids, 12)[0]


def test_chat_uses_the_template_and_stops_at_the_end_of_turn(api, client, local):
    run, tok, chat = local
    messages = [{"role": "system", "content": "You write Python."},
                {"role": "user", "content": "def add(a, b):"}]
    ids = tok.encode(format_chat(chat, messages), add_special_tokens=False).ids
    stop_ids = chat_stop_token_ids(chat)
    assert stop_ids == (0,)  # the template's end of turn is the eos token here
    want, out = run(ids, 48, eos=stop_ids)
    done = client.chat.completions.create(model="paradraft", messages=messages, max_tokens=48,
                                          temperature=0)
    assert done.choices[0].message.role == "assistant"
    assert done.choices[0].message.content == want
    assert done.usage.prompt_tokens == len(ids)
    chunks = list(client.chat.completions.create(
        model="paradraft", messages=messages, max_completion_tokens=48, temperature=0,
        stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == len(out)
    # content parts, as newer clients send them
    parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in messages]
    assert client.chat.completions.create(model="paradraft", messages=parts, max_tokens=48,
                                          temperature=0).choices[0].message.content == want


def test_streams_end_with_done_and_carry_usage_and_stats_as_aiperf_reads_them(api):
    server = api[0]
    events = raw_sse(server.url, "/chat/completions", {
        "model": "paradraft", "messages": [{"role": "user", "content": "def f(x):"}],
        "max_tokens": 16, "stream": True, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert all("usage" in c for c in chunks)  # null until the last chunk
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 16
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert set(chunks[-1]["paradraft"]) == {"acceptance_rate", "accepted_draft_tokens",
                                            "draft_tokens"}


def test_stop_strings_cut_the_output_before_them(client, local):
    run, tok, _ = local
    want, _ = run(tok.encode("def fibonacci(n):").ids, 48)
    word = next(w for w in want.split() if want.index(w) > 5)
    for stream in (False, True):
        if stream:
            chunks = list(client.completions.create(
                model="paradraft", prompt="def fibonacci(n):", max_tokens=48, temperature=0,
                stop=[word, "@@never@@"], stream=True))
            text = "".join(c.choices[0].text for c in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            done = client.completions.create(model="paradraft", prompt="def fibonacci(n):",
                                             max_tokens=48, temperature=0, stop=word)
            text, reason = done.choices[0].text, done.choices[0].finish_reason
        assert (text, reason) == (want[: want.index(word)], "stop"), stream


def test_seed_makes_sampling_repeatable(client):
    def sample(seed):
        return client.completions.create(model="paradraft", prompt="def f(x):", max_tokens=24,
                                         temperature=1.5, seed=seed).choices[0].text

    assert sample(7) == sample(7)
    assert len({sample(s) for s in (1, 2, 3)}) > 1


def test_speculation_can_be_turned_off_per_request(client, local):
    run, tok, _ = local
    want, _ = run(tok.encode("for i in range(").ids, 32)
    done = client.completions.create(model="paradraft", prompt="for i in range(",
                                     max_tokens=32, temperature=0,
                                     extra_body={"num_draft_tokens": 0})
    assert done.choices[0].text == want
    assert done.model_extra["paradraft"]["draft_tokens"] == 0


def test_a_request_can_name_its_drafter(client, local):
    """drafter "ngram" (the lookup) beside the server's draft model: the same text; a
    drafter the server lacks is a 400 with the server's message."""
    run, tok, _ = local
    prompt = "x = [1, 2, 3, 1, 2, 3, 1, 2"  # repeats itself: the lookup finds drafts
    want, _ = run(tok.encode(prompt).ids, 32)
    done = client.completions.create(model="paradraft", prompt=prompt, max_tokens=32,
                                     temperature=0, extra_body={"drafter": "ngram"})
    assert done.choices[0].text == want
    assert done.model_extra["paradraft"]["draft_tokens"] > 0
    with pytest.raises(openai.BadRequestError, match="drafter must be one of model, ngram"):
        client.completions.create(model="paradraft", prompt="x", max_tokens=4,
                                  extra_body={"drafter": "parallel"})


@pytest.mark.parametrize("kwargs, param", [
    (dict(n=17), "n"),
    (dict(n=0), "n"),
    (dict(max_tokens=-1), "max_tokens"),
    (dict(max_tokens=10_000), "max_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(logprobs=21), "logprobs"),
    (dict(presence_penalty=0.5), "presence_penalty"),
    (dict(logit_bias={"5": 1}), "logit_bias"),
    (dict(best_of=2), "best_of"),
    (dict(echo=True), "echo"),
    (dict(extra_body={"guided_json": {}}), "guided_json"),
    (dict(extra_body={"num_draft_tokens": -1}), "num_draft_tokens"),
    (dict(extra_body={"drafter": ["ngram"]}), "drafter"),
])
def test_unsupported_or_invalid_fields_get_a_400_naming_them(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="paradraft", prompt="def f():", **kwargs)
    assert e.value.body["param"] == param
    assert param in e.value.body["message"]


def test_chat_refusals_name_the_field(client):
    for kwargs, param in [(dict(tools=[{"type": "function", "function": {"name": "a b"}}]),
                           "tools"),
                          (dict(response_format={"type": "xml"}), "response_format"),
                          (dict(messages=[]), "messages")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**{"model": "paradraft", "messages": [
                {"role": "user", "content": "hi"}], **kwargs})
        assert e.value.body["param"] == param
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x")
    # the server's own checks come back as 400s too, with its message
    with pytest.raises(openai.BadRequestError, match="num_draft_tokens must be in"):
        client.completions.create(model="paradraft", prompt="x",
                                  extra_body={"num_draft_tokens": 99})


def test_logprobs_equal_plain_decodings_streamed_or_not(client):
    """logprobs / top_logprobs with the official client: greedy speculation reports what the
    same request without drafts reports (within 1e-4); the tokens spell the text; streamed
    chunks carry the same entries; completions' text_offset counts the text."""
    chat = dict(model="paradraft", max_tokens=32, temperature=0, logprobs=True, top_logprobs=3,
                messages=[{"role": "user", "content": "Write a function that adds numbers."}])
    spec = client.chat.completions.create(**chat)
    plain = client.chat.completions.create(**chat, extra_body={"num_draft_tokens": 0})
    assert spec.model_extra["paradraft"]["accepted_draft_tokens"] > 0
    got, want = spec.choices[0].logprobs.content, plain.choices[0].logprobs.content
    assert spec.choices[0].message.content == plain.choices[0].message.content
    assert b"".join(bytes(t.bytes) for t in got).decode() == spec.choices[0].message.content
    assert len(got) == len(want) > 0
    for a, b in zip(got, want, strict=True):
        assert a.token == b.token and abs(a.logprob - b.logprob) <= 1e-4
        assert len(a.top_logprobs) == 3 and a.top_logprobs[0].token == a.token  # greedy
        assert [t.logprob for t in a.top_logprobs] == pytest.approx(
            [t.logprob for t in b.top_logprobs], abs=1e-4)
    chunks = list(client.chat.completions.create(**chat, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in got]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in got], abs=1e-4)
    none = client.chat.completions.create(**{**chat, "logprobs": None, "top_logprobs": None})
    assert none.choices[0].logprobs is None
    # the completions API: logprobs is the number of likeliest tokens
    kw = dict(model="paradraft", prompt="def fibonacci(n):", max_tokens=24, temperature=0,
              logprobs=2)
    done = client.completions.create(**kw)
    lp = done.choices[0].logprobs
    assert "".join(lp.tokens) == done.choices[0].text and len(lp.tokens) == 24
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(24)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 2 and max(top.values()) == pytest.approx(logprob, abs=1e-6)
        assert top[token] == pytest.approx(logprob, abs=1e-6)
    chunks = list(client.completions.create(**kw, stream=True))
    parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for p in parts for t in p.tokens] == lp.tokens
    assert [o for p in parts for o in p.text_offset] == lp.text_offset
    for kwargs, param in [(dict(logprobs=True, top_logprobs=21), "top_logprobs"),
                          (dict(top_logprobs=2), "top_logprobs"),
                          (dict(logprobs=3), "logprobs")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**{**chat, **kwargs, "logprobs": kwargs.get(
                "logprobs")})
        assert e.value.body["param"] == param, e.value.body


def test_tools_named_required_streamed_and_an_agent_loop(client):
    """tools / tool_choice with the official client: a named or required choice returns one
    call whose arguments validate against the function's schema, streamed as the same call;
    an agent loop (the call, its result, a final answer) runs on the real server."""
    import jsonschema

    ask = [{"role": "user", "content": "What is the weather in Oslo?"}]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in (named, "required"):
        kw = dict(model="paradraft", messages=ask, tools=[WEATHER, TIME], tool_choice=choice,
                  temperature=0, max_tokens=120)
        done = client.chat.completions.create(**kw)
        assert done.choices[0].finish_reason == "tool_calls"
        (call,) = done.choices[0].message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        assert choice == "required" or call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        chunks = list(client.chat.completions.create(**kw, stream=True))
        deltas = [d for c in chunks if c.choices and c.choices[0].delta.tool_calls
                  for d in c.choices[0].delta.tool_calls]
        assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == [
            (0, call.function.name, call.function.arguments)]
        assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # the loop: the call and its result go back; the answer is text
    turn = client.chat.completions.create(model="paradraft", messages=ask, tools=[WEATHER],
                                          tool_choice=named, temperature=0, max_tokens=120)
    call = turn.choices[0].message.tool_calls[0]
    history = [*ask, turn.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "-3 C and snowing"}]
    final = client.chat.completions.create(model="paradraft", messages=history,
                                           tools=[WEATHER], temperature=0, max_tokens=24)
    assert final.usage.prompt_tokens > turn.usage.prompt_tokens + len(call.function.arguments) / 8
    answer = final.choices[0]
    assert answer.finish_reason in ("stop", "length", "tool_calls")
    assert answer.message.content or answer.message.tool_calls
    for kwargs, param in [
        (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "x"}}),
         "tool_choice"),
        (dict(tool_choice="required"), "tool_choice"),
        (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}),
         "tool_choice"),
        (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": "string", "pattern": "(a"}}}}}],
              tool_choice="required"), "tools"),
        (dict(messages=[*ask, {"role": "assistant", "tool_calls": [{
            "id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]),
         "messages"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**{"model": "paradraft", "messages": ask,
                                              "max_tokens": 8, **kwargs})
        assert e.value.body["param"] == param, e.value.body


def wait_for(srv, check, timeout=60):
    """Poll the metrics until ``check(metrics)`` holds."""
    deadline = time.monotonic() + timeout
    while not check(m := metrics(srv)):
        assert time.monotonic() < deadline, m
        time.sleep(0.05)


def test_n_choices_each_sample_with_their_own_seed_and_stream_interleaved(api, client):
    """n > 1: one served request per choice, rows of the same batches. With a seed, choice i
    samples with seed + i: it is exactly what an n = 1 request with that seed gets.
    Streamed, each chunk names its choice, each choice ends once, the texts are the same;
    usage counts the prompt once and sums the completions. Greedy choices are all the greedy
    answer. When the server has no room for all n, the request is a 503 and the choices it
    had started are cancelled (their slots free)."""
    _, triton, _, _ = api
    kw = dict(model="paradraft", prompt="def parse(", max_tokens=16, temperature=1.0, seed=7)
    done = client.completions.create(n=3, **kw)
    assert [c.index for c in done.choices] == [0, 1, 2]
    texts = [c.text for c in done.choices]
    solos = [client.completions.create(**{**kw, "seed": 7 + i}) for i in range(3)]
    assert texts == [s.choices[0].text for s in solos]
    assert len(set(texts)) > 1  # their own random numbers
    assert done.usage.prompt_tokens == solos[0].usage.prompt_tokens
    assert done.usage.completion_tokens == sum(s.usage.completion_tokens for s in solos)
    chunks = list(client.completions.create(n=3, stream=True,
                                            stream_options={"include_usage": True}, **kw))
    streamed, ends = ["", "", ""], [0, 0, 0]
    for c in chunks[:-1]:
        streamed[c.choices[0].index] += c.choices[0].text
        ends[c.choices[0].index] += c.choices[0].finish_reason is not None
    assert streamed == texts and ends == [1, 1, 1]
    assert chunks[-1].usage.completion_tokens == done.usage.completion_tokens

    messages = [{"role": "user", "content": "def add(a, b):"}]
    greedy = client.chat.completions.create(model="paradraft", messages=messages, n=2,
                                            max_tokens=12, temperature=0)
    one = client.chat.completions.create(model="paradraft", messages=messages, max_tokens=12,
                                         temperature=0).choices[0].message.content
    assert [c.message.content for c in greedy.choices] == [one, one]
    chat_chunks = list(client.chat.completions.create(
        model="paradraft", messages=messages, n=2, max_tokens=12, temperature=0, stream=True))
    roles = [c.choices[0].index for c in chat_chunks if c.choices[0].delta.role]
    assert roles == [0, 1]
    for index in (0, 1):
        assert "".join(c.choices[0].delta.content or "" for c in chat_chunks
                       if c.choices[0].index == index) == one

    # n past what the server holds (2 slots and a queue place) could never be served
    with pytest.raises(openai.BadRequestError, match=r"n must be an integer in \[1, 3\]"):
        client.completions.create(n=4, **kw)
    # with one slot taken, 3 long choices fit 2: all or nothing
    busy = threading.Thread(target=lambda: client.completions.create(
        model="paradraft", prompt="def busy():", **LONG))
    busy.start()
    wait_for(triton, lambda m: m.get("paradraft_active_sequences") == 1)
    def ended(m):
        return [total(m, f'paradraft_requests_ended_total{{instance="ensemble_0_0",'
                         f'model="ensemble",outcome="{outcome}"') for outcome in
                ("refused", "cancelled")]

    before = metrics(triton, labelled=True)
    received = total(before, "paradraft_requests_received_total")
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model="paradraft", prompt="def long():", n=3, **LONG)
    assert e.value.status_code == 503
    busy.join(60)
    # the three choices reached the model and every request has ended (the gauges alone can
    # be a flush behind; a request cancelled as it arrived can reach the model late)
    deadline = time.monotonic() + 30
    while not (settled(m := metrics(triton, labelled=True))
               and total(m, "paradraft_requests_received_total") == received + 3):
        assert time.monotonic() < deadline, m
        time.sleep(0.05)
    # one refused, the two it had started cancelled: none ran to its end
    assert [b + d for b, d in zip(ended(before), (1, 2), strict=True)] == ended(m)


def total(labelled: dict[str, float], prefix: str) -> float:
    """The sum of the labelled series whose name and labels start with ``prefix``."""
    return sum(v for k, v in labelled.items() if k.startswith(prefix))


def settled(labelled: dict[str, float]) -> bool:
    """Every request the model received has ended (finished, cancelled, refused or failed),
    and no slot or queue place is taken."""
    return (total(labelled, "paradraft_requests_received_total{")
            == total(labelled, "paradraft_requests_ended_total{")
            and total(labelled, "paradraft_active_sequences{") == 0
            and total(labelled, "paradraft_queue_depth{") == 0)


def test_response_format_json_schema_and_json_object_follow_their_grammar(api, client,
                                                                           local):
    """response_format, served: the chat reply with a JSON schema is what the in-process
    decoder gives under the same grammar, streamed or not, and validates; the official
    client's ``parse`` with a pydantic model gets its object; json_object replies are JSON
    objects (completions too); a schema that does not compile is a 400 naming
    response_format with the reason."""
    from typing import Literal

    import jsonschema
    from pydantic import BaseModel

    from paradraft.runtime.grammar import Guide, RowGrammar, compile_guide

    _, _, config, chat = api
    _, tok, _ = local
    schema = {"type": "object", "properties": {
        "label": {"enum": ["bug", "feature", "question"]}, "urgent": {"type": "boolean"},
        "score": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["label", "urgent", "score"], "additionalProperties": False}
    messages = [{"role": "user", "content": "Classify: the parser crashes on empty input."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "ticket", "schema": schema}}
    done = client.chat.completions.create(model="paradraft", messages=messages, max_tokens=48,
                                          temperature=0, response_format=fmt)
    text = done.choices[0].message.content
    jsonschema.validate(json.loads(text), schema)
    assert done.choices[0].finish_reason == "stop"
    # the same grammar in process
    tokenizer = str(Path(config.verifier) / "tokenizer.json")
    vocab = load_model(config.verifier).config.vocab_size
    grammar = RowGrammar(compile_guide(Guide("json_schema", json.dumps(schema)), tokenizer,
                                       vocab), tokenizer, vocab)
    ids = tok.encode(format_chat(chat, messages), add_special_tokens=False).ids
    dec = SpeculativeDecoder(load_model(config.verifier),
                             Drafter("model", load_model(config.draft)), RuleParams("greedy"),
                             k=config.k, max_batch_size=1, max_seq_len=MAX_SEQ)
    out = dec.generate([ids], 48, eos_token_id=config.eos_token_id,
                       grammars=[grammar]).token_ids[0]
    assert text == tok.decode(out, skip_special_tokens=True)
    chunks = list(client.chat.completions.create(model="paradraft", messages=messages,
                                                 max_tokens=48, temperature=0,
                                                 response_format=fmt, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text

    class Ticket(BaseModel):
        label: Literal["bug", "feature", "question"]
        urgent: bool

    parsed = client.chat.completions.parse(model="paradraft", messages=messages,
                                           max_tokens=48, temperature=0,
                                           response_format=Ticket)
    assert isinstance(parsed.choices[0].message.parsed, Ticket)
    for reply in (client.chat.completions.create(
            model="paradraft", messages=messages, max_tokens=64, temperature=0,
            response_format={"type": "json_object"}).choices[0].message.content,
                  client.completions.create(
            model="paradraft", prompt="config = ", max_tokens=64, temperature=0,
            extra_body={"response_format": {"type": "json_object"}}).choices[0].text):
        assert reply.startswith("{")
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/defs/missing"}}}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="paradraft", messages=messages, max_tokens=8,
                                       response_format=bad)
    assert e.value.body["param"] == "response_format"
    assert "does not exist" in e.value.body["message"]


def test_a_full_queue_answers_503_with_retry_after_and_the_server_keeps_serving(api, client):
    server, triton, _, _ = api
    before = metrics(triton).get("paradraft_requests_total", 0)
    threads = [threading.Thread(target=lambda: client.completions.create(
        model="paradraft", prompt="def long():", **LONG)) for _ in range(SLOTS + QUEUE)]
    for t in threads:
        t.start()
    wait_for(triton, lambda m: (m.get("paradraft_active_sequences"),
                                m.get("paradraft_queue_depth")) == (SLOTS, QUEUE))
    req = urllib.request.Request(server.url + "/completions", method="POST",
                                 data=json.dumps({"model": "paradraft", "prompt": "x"}).encode())
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=60)
    assert e.value.code == 503 and e.value.headers["Retry-After"] == "1"
    assert "queue full" in json.loads(e.value.read())["error"]["message"]
    with pytest.raises(openai.InternalServerError):  # streamed requests too, before any event
        client.completions.create(model="paradraft", prompt="x", stream=True)
    # the model over gRPC: UNAVAILABLE (retry later); Triton 2.51's HTTP generate endpoint
    # answers every error with 400, the message says what it was
    with pytest.raises(serving_client.ServerError, match="queue full") as e:
        serving_client.complete(triton.grpc_url, "x", 4)
    assert e.value.code == "UNAVAILABLE"
    req = urllib.request.Request(
        f"http://{triton.host}:{triton.http_port}/v2/models/ensemble/generate", method="POST",
        data=json.dumps({"text_input": "x", "max_tokens": 4}).encode())
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=60)
    reply = e.value.read().decode()
    assert e.value.code == 400 and "queue full" in reply and "retry later" in reply
    for t in threads:
        t.join(120)
    assert metrics(triton)["paradraft_requests_total"] == before + SLOTS + QUEUE
    assert client.completions.create(model="paradraft", prompt="x", max_tokens=4).choices


def test_a_client_that_hangs_up_mid_stream_frees_its_slot(api, client):
    """Closing the HTTP stream cancels the API's gRPC stream to the served model, which
    sees it: the slot frees long before 280 tokens are done."""
    server, triton, _, _ = api
    before = metrics(triton).get("paradraft_requests_total", 0)
    body = {"model": "paradraft", "prompt": "def long():", "max_tokens": 280,
            "ignore_eos": True, "stream": True}
    threads = [threading.Thread(target=raw_sse, args=(server.url, "/completions", body, 3))
               for _ in range(SLOTS)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    wait_for(triton, lambda m: m.get("paradraft_active_sequences") == 0, timeout=10)
    freed = time.monotonic() - t0
    # they left by cancellation, not by finishing their 280 tokens
    assert metrics(triton).get("paradraft_requests_total", 0) == before, freed
    done = client.completions.create(model="paradraft", prompt="x", max_tokens=4)
    assert done.usage.completion_tokens == 4


def test_a_client_that_stops_reading_does_not_hold_its_slot(api):
    """Back-pressure: a client that never reads its stream (a 1 KB receive buffer, so the
    server's writes block) costs no slot beyond its generation: the request finishes and
    frees its slot while the connection is still open, and the server serves others."""
    import socket

    server, triton, _, _ = api
    before = metrics(triton).get("paradraft_requests_total", 0)
    body = json.dumps({"model": "paradraft", "prompt": "def long():", "max_tokens": 280,
                       "ignore_eos": True, "stream": True})
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    sock.connect((server.config.host, server.config.port))
    try:
        sock.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                      f"application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}"
                      ).encode())
        wait_for(triton, lambda m: m.get("paradraft_requests_total", 0) == before + 1)
        wait_for(triton, lambda m: m.get("paradraft_active_sequences") == 0)
        done = serving_client.complete(triton.grpc_url, "x", 4)  # others are served meanwhile
        assert done.text
    finally:
        sock.close()


def test_loadtest_over_the_openai_api_reuses_its_connections(api):
    """Each client thread sends its requests over one keep-alive connection."""
    from paradraft.runtime.tools.loadtest import run_level

    server = api[0]
    r = run_level(f"{server.config.host}:{server.config.port}", ["def f(x):", "class A:"], 2,
                  6, 8, protocol="openai")
    assert (r.answered, r.errors, r.lost, r.output_tokens) == (6, 0, 0, 48), r.error_messages
    assert 0 < r.acceptance_rate <= 1


def test_a_later_turn_reads_the_earlier_turns_from_the_prefix_cache(api, client, local):
    """The second turn of a chat resends the first and its answer: those tokens come from
    the prefix cache (usage.prompt_tokens_details.cached_tokens, and the Prometheus
    counters), and the answer is what an in-process decoder gives with no cache."""
    run, tok, chat = local
    triton = api[1]
    messages = [{"role": "system", "content": "You write short Python."},
                {"role": "user", "content": "def square(x):"}]
    first = client.chat.completions.create(model="paradraft", messages=messages,
                                           max_tokens=24, temperature=0)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "Now add a docstring."}]
    ids = tok.encode(format_chat(chat, messages), add_special_tokens=False).ids
    want, _ = run(ids, 24, eos=chat_stop_token_ids(chat))
    chunks = list(client.chat.completions.create(
        model="paradraft", messages=messages, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    cached = chunks[-1].usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens <= cached < len(ids)
    url = f"http://{triton.host}:{triton.metrics_port}/metrics"
    text = urllib.request.urlopen(url).read().decode()
    hits = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("paradraft_prefix_cache_hit_tokens_total{"))
    prompts = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith("paradraft_prompt_tokens_total{"))
    assert cached <= hits < prompts
