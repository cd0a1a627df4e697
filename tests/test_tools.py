"""OpenAI tools in the Hermes format (runtime/serving/openai_tools.py), in process: tools and
tool_choice are validated by name; a required or named choice's grammar makes the demo
model write one call that parses and whose arguments validate against the function's schema,
greedy speculation writing what plain decoding writes; a template that renders tools gets
them, one that does not gets the Hermes text in its messages; calls are parsed out of text,
and a stream's content stops where the first call begins."""

import json
import re
from pathlib import Path

import jsonschema
import pytest

from paradraft.runtime.checkpoints import format_chat, load_tokenizer, renders_tools
from paradraft.runtime.correction import RuleParams
from paradraft.runtime.drafters import Drafter
from paradraft.runtime.grammar import Guide, RowGrammar, compile_guide
from paradraft.runtime.model import load_model
from paradraft.runtime.serving.openai_tools import (
    CallSplitter,
    ToolError,
    call_guide,
    parse_calls,
    parse_tools,
    template_messages,
)
from paradraft.runtime.speculative import SpeculativeDecoder

DEMO = Path(__file__).resolve().parent.parent / "models" / "demo"
TOKENIZER = str(DEMO / "verifier" / "tokenizer.json")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "integer", "minimum": -12, "maximum": 14}},
        "required": ["zone"], "additionalProperties": False}}}
# a template that renders tools the way Qwen2.5's does (its structure, shortened)
TOOLS_TEMPLATE = (
    "{% if tools %}<|system|>\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}"
    "{% endfor %}\n</tools>\n{% endif %}{% for m in messages %}<|{{ m.role }}|>\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>\n{\"name\": \""
    "{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}\n"
    "</tool_call>{% endfor %}{% else %}{{ m.content }}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
PLAIN_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def test_tools_and_tool_choice_are_validated_by_name():
    assert parse_tools(None, None) is None and parse_tools([WEATHER], "none") is None
    assert parse_tools([WEATHER], None).choice == "auto"
    named = parse_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}})
    assert named.named and named.choice == "get_time"
    for tools, choice, param, text in [
        (None, "required", "tool_choice", "needs tools"),
        ({"a": 1}, None, "tools", "must be a list"),
        ([{"type": "retrieval"}], None, "tools", "tools[0] must be"),
        ([{"type": "function", "function": {"name": "bad name"}}], None, "tools", "letters"),
        ([WEATHER, WEATHER], None, "tools", "unique"),
        ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], None, "tools",
         "JSON schema"),
        ([{"type": "function", "function": {"name": "f", "returns": {}}}], None, "tools",
         "'returns'"),
        ([WEATHER], "sometimes", "tool_choice", "must be"),
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice",
         "not in tools"),
    ]:
        with pytest.raises(ToolError, match=re.escape(text)) as e:
            parse_tools(tools, choice)
        assert e.value.param == param


@pytest.mark.parametrize("choice", ["required", "get_time"])
def test_a_required_or_named_call_parses_and_follows_its_schema(choice):
    verifier, draft = load_model(DEMO / "verifier"), load_model(DEMO / "draft")
    tokenizer = load_tokenizer(DEMO / "verifier")
    tools = parse_tools([WEATHER, TIME], choice if choice == "required" else {
        "type": "function", "function": {"name": choice}})
    grammar = compile_guide(Guide("lark", call_guide(tools)), TOKENIZER,
                            verifier.config.vocab_size)
    prompts = [tokenizer.encode(t).ids for t in ("What is the weather in Oslo?",
                                                 "def f(x):", "Tell me the time")]

    def run(decoder):
        matchers = [RowGrammar(grammar, TOKENIZER, verifier.config.vocab_size)
                    for _ in prompts]
        return decoder.generate(prompts, 120, grammars=matchers).token_ids

    plain = run(SpeculativeDecoder(verifier, None, RuleParams("greedy"), max_batch_size=3,
                                   max_seq_len=200))
    spec = run(SpeculativeDecoder(verifier, Drafter("model", draft), RuleParams("greedy"), k=4,
                                  max_batch_size=3, max_seq_len=200))
    assert spec == plain
    schemas = {f["function"]["name"]: f["function"]["parameters"] for f in (WEATHER, TIME)}
    for ids in spec:
        content, calls = parse_calls(tokenizer.decode(ids))
        assert content is None and len(calls) == 1, tokenizer.decode(ids)
        name = calls[0]["function"]["name"]
        assert name == choice or choice == "required"
        jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), schemas[name])


def test_templates_with_and_without_tools_render_calls_and_results(tmp_path):
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "snow"},
    ]
    tools = parse_tools([WEATHER], "auto")
    for name, template in (("with", TOOLS_TEMPLATE), ("without", PLAIN_TEMPLATE)):
        d = tmp_path / name
        d.mkdir()
        (d / "tokenizer.json").write_bytes(Path(TOKENIZER).read_bytes())
        (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
        assert renders_tools(d) == (name == "with")
        flat, definitions = template_messages(messages, tools, renders_tools(d))
        text = format_chat(d, flat, tools=definitions)
        assert '"name": "get_weather"' in text and "The weather in a city" in text
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": ' \
               '"celsius"}}\n</tool_call>' in text, text
        assert text.endswith("<|assistant|>\n")
        if name == "without":  # results in a row: one user turn
            assert "<|user|>\n<tool_response>\n-3 C\n</tool_response>\n<tool_response>\n" \
                   "snow\n</tool_response>" in text, text
            assert text.startswith("<|system|>\n# Tools")
        # no tools and no tool messages: the messages go to the template as they are
        assert template_messages(messages[:1], None, False) == (messages[:1], None)
    with pytest.raises(ToolError, match=r"messages\[1\].tool_calls\[0\].function.arguments"):
        template_messages([messages[0], {**messages[1], "tool_calls": [{
            "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}],
            None, True)


def test_calls_are_parsed_out_of_text_and_a_stream_holds_them_back():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
            '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": 1}}\n'
            '</tool_call>')
    content, calls = parse_calls(text)
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {"zone": 1})]
    assert len({c["id"] for c in calls}) == 2
    assert parse_calls("<tool_call>\n{not json}\n</tool_call>") == (
        "<tool_call>\n{not json}\n</tool_call>", [])
    assert parse_calls("no calls") == ("no calls", [])
    for cut in range(1, len(text)):  # however the stream splits it
        splitter = CallSplitter()
        sent = splitter.feed(text[:cut]) + splitter.feed(text[cut:])
        rest, streamed = splitter.finish()
        assert (sent + rest).strip() == "Let me check."
        assert [c["function"] for c in streamed] == [c["function"] for c in calls]
    splitter = CallSplitter()
    assert splitter.feed("a <tool_c") == "a " and splitter.feed("up") == "<tool_cup"
    assert splitter.finish() == ("", [])
