"""`bench --prompt-file`: JSONL requests (chat messages or plain prompts), the shipped held-out
prompt files, and the ngram rows beside transformers' prompt lookup."""

import json
import shutil
from pathlib import Path

import pytest
from conftest import run_cli
from tokenizers import Tokenizer

from paradraft.runtime.checkpoints import DEMO_DIR, format_chat
from paradraft.runtime.drafters import Drafter
from paradraft.runtime.model import load_model
from paradraft.runtime.tools.bench import plan, read_prompt_file, run_bench

PROMPTS = Path(__file__).resolve().parents[1] / "prompts"
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture
def chat_dir(tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(DEMO_DIR / "verifier" / name, tmp_path / name)
    (tmp_path / "chat_template.jinja").write_text(TEMPLATE)
    return tmp_path


def write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_requests_are_chat_messages_or_plain_prompts(chat_dir, tmp_path):
    messages = [{"role": "user", "content": "def add(a, b):"}]
    path = write_lines(tmp_path / "p.jsonl", [json.dumps({"messages": messages}), "",
                                              json.dumps({"prompt": "import os"})])
    prompts, stop, guides = read_prompt_file(path, chat_dir)
    assert guides == [None] * len(prompts)
    tok = Tokenizer.from_file(str(chat_dir / "tokenizer.json"))
    assert prompts == [tok.encode(format_chat(chat_dir, messages), add_special_tokens=False).ids,
                       tok.encode("import os").ids]
    assert stop  # chat requests stop at the end of the turn (the tokenizer's eos_token here)
    _, stop, _ = read_prompt_file(write_lines(tmp_path / "q.jsonl", ['{"prompt": "x = 1"}']),
                               chat_dir)
    assert stop == ()


@pytest.mark.parametrize("line,message", [
    ("{not json", r"line 2: not JSON"),
    ('{"messages": []}', r"line 2: 'messages' must be a non-empty list"),
    ('{"messages": [{"role": "user"}]}', r"line 2: messages\[0\] must be an object"),
    ('{"prompt": 3}', r"line 2: 'prompt' must be a non-empty string"),
    ('{"prompt": "a", "messages": []}', r"line 2: a request is an object with exactly one"),
    ('{"text": "a"}', r"line 2: .*got \['text'\]"),
    ("[1, 2]", r"line 2: a request is an object .*got list"),
    ('{"prompt": "a", "response_format": {"type": "xml"}}', r"line 2: 'response_format' must"),
    ('{"prompt": "a", "response_format": {"type": "json_schema", "json_schema": {}}}',
     r"line 2: 'response_format' must"),
])
def test_a_bad_line_is_refused_naming_its_number_and_field(chat_dir, tmp_path, line, message):
    path = write_lines(tmp_path / "p.jsonl", ['{"prompt": "fine"}', line])
    with pytest.raises(ValueError, match=message):
        read_prompt_file(path, chat_dir)


def test_the_shipped_prompt_files_are_two_held_out_kinds_of_chat(chat_dir):
    texts = {}
    for kind in ("open_ended", "grounded"):
        path = PROMPTS / f"{kind}.jsonl"
        requests = [json.loads(line) for line in path.read_text().splitlines()]
        assert len(requests) == 24
        assert all([m["role"] for m in r["messages"]] == ["user"] for r in requests)
        texts[kind] = {r["messages"][0]["content"] for r in requests}
        assert len(texts[kind]) == 24
        prompts, _, _ = read_prompt_file(path, chat_dir)
        assert len(prompts) == 24
    assert not texts["open_ended"] & texts["grounded"]
    # an input-grounded task carries the input its answer copies
    mean = {kind: sum(map(len, t)) / len(t) for kind, t in texts.items()}
    assert mean["grounded"] > 2 * mean["open_ended"]


def test_json_extraction_requests_follow_their_schemas_in_every_variant(chat_dir):
    """The shipped JSON-extraction set: 16 chat requests, each with a JSON schema. Bench's
    rows of ours follow them (greedy: every variant emits the same tokens, the grammar's
    own proposals among them, accepted), the outputs that ended parse and validate, and
    transformers' peers, which cannot follow a grammar, are refused."""
    import jsonschema

    from paradraft.runtime.correction import RuleParams
    from paradraft.runtime.tools.bench import BenchRow, run_ours

    path = PROMPTS / "json_extraction.jsonl"
    requests = [json.loads(line) for line in path.read_text().splitlines()]
    prompts, stop, guides = read_prompt_file(path, chat_dir)
    assert len(prompts) == len(guides) == 16 and all(g.kind == "json_schema" for g in guides)
    verifier = load_model(DEMO_DIR / "verifier")
    tokenizer_json = str(chat_dir / "tokenizer.json")
    drafters = {"ngram": Drafter("ngram"), "grammar": Drafter("grammar")}
    rows = run_bench(verifier, drafters, prompts[:3], 48, [1], [4], None, eos_token_id=stop,
                     sampling_rows=False, guides=guides[:3], tokenizer_json=tokenizer_json)
    fixed = {r.variant: r for r in rows if r.schedule == "fixed"}
    assert fixed["grammar"].tokens == fixed["ngram"].tokens == fixed["baseline"].tokens
    assert fixed["grammar"].acceptance_rate > 0.9  # a forced token always passes
    outputs: list[list[int]] = []
    run_ours(verifier, None, RuleParams("greedy"), 0, prompts, 96, 4, 0,
             BenchRow("ours", "baseline", "greedy", 0, 4, False), outputs, stop, guides,
             tokenizer_json)
    tok = Tokenizer.from_file(tokenizer_json)
    # a complete grammar ends the request (no end token needed); the toy model may instead
    # run to the limit inside a string
    ended = [(r, ids) for r, ids in zip(requests, outputs, strict=True) if len(ids) < 96]
    assert ended  # (the Qwen pair's outputs all end: tests/test_real_pair.py)
    for request, ids in ended:
        schema = request["response_format"]["json_schema"]["schema"]
        jsonschema.validate(json.loads(tok.decode(ids, skip_special_tokens=True)), schema)
    with pytest.raises(ValueError, match="--no-hf"):
        run_bench(verifier, drafters, prompts[:1], 8, [1], [2], (DEMO_DIR / "verifier",
                  DEMO_DIR / "draft"), guides=guides[:1], tokenizer_json=tokenizer_json)


def test_bench_runs_ngram_beside_transformers_prompt_lookup(pair):
    vdir, ddir, _, _ = pair
    verifier = load_model(vdir)
    drafters = {"ngram": Drafter("ngram", ngram_min=1, ngram_max=3)}
    prompts = [[5, 6, 7, 8] * 3, [11, 12, 13, 14, 15, 11, 12]]  # lengths differ
    rows = run_bench(verifier, drafters, prompts, max_new_tokens=12, batch_sizes=[1, 2],
                     ks=[2], hf_dirs=(vdir, ddir), seed=0, eos_token_id=0)
    kinds = {(r.system, r.variant, r.k, r.batch_size) for r in rows}
    assert {("hf", "prompt_lookup", 2, 1), ("hf", "generate", 0, 2),
            ("ours", "ngram", 2, 1)} <= kinds
    assert not any(r.schedule == "auto" for r in rows)  # no goodput policy for a lookup
    assert not any(r.variant == "assisted" for r in rows)  # no draft model asked for
    by = {(r.system, r.variant, r.rule, r.batch_size): r for r in rows if r.schedule == "fixed"}
    ngram, peer = by["ours", "ngram", "greedy", 1], by["hf", "prompt_lookup", "greedy", 1]
    base = by["ours", "baseline", "greedy", 1]
    # greedy: every variant emits the same tokens (stopping at the same end ids)
    assert ngram.tokens == base.tokens == peer.tokens == by["hf", "generate", "greedy", 1].tokens
    assert ngram.mean_k > 0
    assert ngram.speedup_vs_hf_assisted == pytest.approx(
        ngram.tokens_per_second / peer.tokens_per_second)
    assert by["ours", "ngram", "greedy", 2].tokens == by["ours", "baseline", "greedy", 2].tokens




def test_cli_generate_with_ngram_equals_no_speculation_and_sizes_are_checked(pair):
    common = ["generate", "--verifier", pair[0], "--prompt-ids", "5,6,7,8,5,6,7,8,5,6",
              "--max-new-tokens", "16", "--json", "--ignore-eos"]
    spec = run_cli(*common, "--drafter", "ngram", "--ngram-min", "1", "--k", "3")
    plain = run_cli(*common, "--no-speculation")
    assert spec.returncode == 0 and plain.returncode == 0, spec.stderr + plain.stderr
    a, b = json.loads(spec.stdout), json.loads(plain.stdout)
    assert a["token_ids"] == b["token_ids"] and a["stats"]["draft_tokens"] > 0
    r = run_cli(*common, "--drafter", "ngram", "--ngram-min", "0")
    assert r.returncode == 2 and "ngram_min must be an integer in [1, 16]; got 0" in r.stderr
    r = run_cli(*common, "--drafter", "self", "--ngram-max", "3")
    assert r.returncode == 2 and "--ngram-max is for the ngram drafter" in r.stderr
    # a named verifier never meets the toy draft: a model drafter needs --draft
    for drafter in ("model", "parallel"):
        r = run_cli(*common, "--drafter", drafter)
        assert r.returncode == 2 and f"--drafter {drafter} needs --draft" in r.stderr
        assert "ngram, self" in r.stderr


def test_cli_refuses_a_verifier_whose_tokenizer_is_not_the_engines(chat_dir, tmp_path):
    """--engines with --verifier: the ids mean the engine dir's tokens, so a verifier with
    another tokenizer.json is refused, naming it, before anything is loaded."""
    engines = tmp_path / "engines"
    engines.mkdir()
    other = json.loads((chat_dir / "tokenizer.json").read_text())
    added = {"id": 10**6, "content": "<x>", "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False, "special": True}
    other["added_tokens"] = [*other.get("added_tokens", []), added]
    (engines / "tokenizer.json").write_text(json.dumps(other))
    verifier = str(DEMO_DIR / "verifier")
    for command in (["generate", "--prompt", "hi"], ["bench", "--backends", "onnx"]):
        r = run_cli(*command, "--engines", str(engines), "--verifier", verifier)
        assert r.returncode == 2, r.stderr
        assert f"--verifier {verifier}: its tokenizer.json differs" in r.stderr


def test_greedy_only_plans_no_sampling_rows():
    rows = plan([1, 2], [2, 4], ["ngram"], with_hf=True, sampling_rows=False)
    assert rows and not any(r.sampling for r in rows)
    assert any(r.sampling for r in plan([1], [2], ["ngram"], with_hf=False))
    assert {r.variant for r in rows if r.system == "hf"} == {"generate", "prompt_lookup"}
