"""The serving protocol: the deployment config, its scheduler, and what the Triton model imports."""

import argparse
import ast
import json
from pathlib import Path

import pytest

from paradraft.runtime.serving.protocol import ServeConfig


def serve_args(**overrides) -> argparse.Namespace:
    """What `paradraft serve` parses, with its defaults (the options left unset are None)."""
    options = dict(verifier=None, draft=None, drafter="model", engines=None,
                   k=None, rule=None, max_slots=None, max_queue=64, max_seq_len=None,
                   speculative_disable_by_batch_size=None, draft_len_schedule=None,
                   stream_interval=1, draft_threads=1, acceptance_floor=0.6,
                   fused_correction="auto", device=None, dtype=None, instances=1, compile=False,
                   ngram_min=None, ngram_max=None, prefix_cache=True, cache_slots=None,
                   prefill_chunk=128)
    return argparse.Namespace(**{**options, **overrides})


def test_cache_slots_default_to_llama_cpp_sequences_and_bad_values_are_refused():
    from paradraft.cli.serve import cache_slots_arg

    assert cache_slots_arg(serve_args(), "llamacpp", 4) == 12
    assert cache_slots_arg(serve_args(), "llamacpp", 200) == 56  # llama.cpp's 256 sequences
    assert cache_slots_arg(serve_args(), "onnx", 4) == 0
    assert cache_slots_arg(serve_args(prefix_cache=False), "llamacpp", 4) == 0
    assert cache_slots_arg(serve_args(cache_slots=2), "onnx", 4) == 2
    with pytest.raises(ValueError, match=r"cache_slots must be in \[0, 252\]"):
        cache_slots_arg(serve_args(cache_slots=253), "llamacpp", 4)
    with pytest.raises(ValueError, match="cache_slots must be >= 0"):
        cache_slots_arg(serve_args(cache_slots=-1), "onnx", 4)
    with pytest.raises(ValueError, match="prefill_chunk must be >= 0"):
        cache_slots_arg(serve_args(prefill_chunk=-1), "onnx", 4)
    with pytest.raises(ValueError, match="cache_slots keep prefixes"):
        ServeConfig(verifier="v", draft=None, prefix_cache=False, cache_slots=2)
    with pytest.raises(ValueError, match="prefill_chunk must be an integer >= 1"):
        ServeConfig(verifier="v", draft=None, prefill_chunk=0)


def test_serve_config_validates_its_limits():

    for kw, message in [(dict(max_slots=0), r"max_slots must be an integer >= 1"),
                        (dict(max_queue=-1), r"max_queue must be an integer >= 0"),
                        (dict(max_input_tokens=600), r"max_input_tokens must be in \[1, 511\]"),
                        (dict(rule="best"), "rule must be one of"),
                        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
                        (dict(disable_by_batch_size=0),
                         "speculative_disable_by_batch_size must be an integer >= 1"),
                        (dict(draft_len_schedule={"4": 2}), "holds batch size 1"),
                        (dict(draft_len_schedule={"one": 2}), "keys must be batch sizes"),
                        (dict(k=2, draft_len_schedule={1: 3}), r"K in \[0, 2\]"),
                        (dict(draft_threads=0), r"draft_threads must be an integer >= 1"),
                        (dict(acceptance_floor=1.5), r"acceptance_floor must be in \[0, 1\]"),
                        (dict(compile="yes"), "compile must be true or false"),
                        (dict(compile=True, engines="engines/x"),
                         "compile compiles the torch backend's models")]:
        with pytest.raises(ValueError, match=message):
            ServeConfig("verifier", "draft", **kw)
    # the model repository carries the config as JSON, whose keys are strings
    config = ServeConfig("verifier", "draft", draft_len_schedule={"1": 4, "8": 1})
    assert config.draft_len_schedule == {1: 4, 8: 1}


def test_serve_takes_its_defaults_and_limits_from_the_engine_manifest(tmp_path):
    from paradraft.cli.serve import serve_config

    rule_defaults = dict(rule="dynamic", temperature=0.8, top_p=0.95, tau=0.2, gamma=1.0,
                         alpha=0.05, top_p_membership=False, epsilon=0.09, delta=0.3)
    (tmp_path / "manifest.json").write_text(json.dumps({
        "format_version": 1, "limits": {"max_batch_size": 6, "max_k": 3, "max_seq_len": 256},
        "rule_defaults": rule_defaults,
        "drafters": {"model": "draft"},
        "models": {"verifier": {"config": {"eos_token_ids": [0]}}}}))
    config = serve_config(serve_args(engines=str(tmp_path)))
    assert (config.max_slots, config.max_seq_len, config.max_input_tokens) == (6, 256, 255)
    assert config.k == 3  # 4 by default, but the engines hold fused drafts up to 3
    assert (config.rule, config.temperature, config.top_p) == ("dynamic", 0.8, 0.95)
    assert config.rule_defaults == dict(tau=0.2, gamma=1.0, alpha=0.05,
                                        top_p_membership=False, epsilon=0.09, delta=0.3)
    assert config.eos_token_id == (0,)
    # options win where set; the manifest's rule parameters stay
    config = serve_config(serve_args(engines=str(tmp_path), rule="threshold", max_slots=3))
    assert (config.rule, config.max_slots, config.rule_defaults["tau"]) == ("threshold", 3, 0.2)
    for overrides, message in [(dict(max_slots=8), r"max_slots must be <= 6"),
                               (dict(max_seq_len=512), r"max_seq_len must be <= 256"),
                               (dict(k=4), r"k must be <= 3"),
                               (dict(max_slots=0), r"max_slots must be an integer >= 1")]:
        with pytest.raises(ValueError, match=message):
            serve_config(serve_args(engines=str(tmp_path), **overrides))
    # checkpoints: the documented defaults
    config = serve_config(serve_args())
    assert (config.max_slots, config.max_seq_len, config.rule, config.k) == (16, 512, "greedy", 4)
    # the toy draft only with the toy verifier: a named verifier needs its own draft
    assert config.draft.endswith("draft") and config.verifier.endswith("verifier")
    with pytest.raises(ValueError, match=r"drafter 'model' needs --draft .* ngram, self"):
        serve_config(serve_args(verifier=config.verifier))
    assert serve_config(serve_args(verifier=config.verifier, drafter="ngram")).drafter == "ngram"


def engine_manifest(tmp_path, backend="onnx", graphs=("logits", "correction")) -> str:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "manifest.json").write_text(json.dumps({
        "format_version": 1, "backend": backend,
        "limits": {"max_batch_size": 4, "max_k": 4, "max_seq_len": 256},
        "rule_defaults": {"rule": "greedy"},
        "drafters": {"model": "draft"},
        "models": {"verifier": {"config": {"eos_token_ids": [0]},
                                "graphs": {g: {} for g in graphs}}}}))
    return str(tmp_path)


def test_serve_fused_correction_reaches_the_config_and_bad_values_are_refused_by_name(
        tmp_path):
    from paradraft.cli.serve import serve_config

    engines = engine_manifest(tmp_path)
    for mode in ("on", "off", "auto"):
        assert serve_config(serve_args(engines=engines, fused_correction=mode)
                            ).fused_correction == mode
    assert serve_config(serve_args()).fused_correction == "auto"
    with pytest.raises(ValueError, match="fused_correction 'on' needs engines"):
        serve_config(serve_args(fused_correction="on"))  # checkpoints carry no graph
    without = engine_manifest(tmp_path / "plain", graphs=("logits",))
    with pytest.raises(ValueError, match="fused_correction 'on' needs a verifier engine"):
        serve_config(serve_args(engines=without, fused_correction="on"))
    with pytest.raises(ValueError, match=r"fused_correction must be one of on, off, auto; "
                                         r"got 'maybe'"):
        ServeConfig("verifier", "draft", fused_correction="maybe")


def test_serve_places_instances_on_the_devices_listed(tmp_path):
    """--device / --instances become the paradraft model's instance_group: one group per
    distinct device, --instances on each listing (GPU groups name their GPU)."""
    import torch

    from paradraft.cli.serve import serve_config
    from paradraft.runtime.serving.server import instance_count, instance_group

    config = serve_config(serve_args(device="cpu,cpu"))
    assert config.devices == ("cpu", "cpu")
    assert instance_group(config) == "instance_group [ { count: 2, kind: KIND_CPU } ]"
    config = ServeConfig("v", "d", devices=["cpu"], instances=3)  # as the JSON brings it
    assert config.devices == ("cpu",) and instance_count(config) == 3
    assert instance_group(config) == "instance_group [ { count: 3, kind: KIND_CPU } ]"
    # GPU layouts are generated (and checked) here without a GPU
    config = ServeConfig("v", "d", devices=("cuda:0", "cuda:1", "cuda"), instances=2)
    assert instance_count(config) == 6
    assert instance_group(config) == ("instance_group [ { count: 4, kind: KIND_GPU, gpus: "
                                      "[ 0 ] }, { count: 2, kind: KIND_GPU, gpus: [ 1 ] } ]")
    for kw, message in [(dict(devices=("gpu",)), "devices entries must be cpu, cuda or cuda:N"),
                        (dict(devices=()), "devices must list at least one device"),
                        (dict(instances=0), "instances must be an integer >= 1"),
                        (dict(dtype="int8"), "dtype must be one of float32, bfloat16, float16")]:
        with pytest.raises(ValueError, match=message):
            ServeConfig("v", "d", **kw)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device 'cuda:1': CUDA is not available"):
            serve_config(serve_args(device="cpu,cuda:1"))
    engines = engine_manifest(tmp_path)
    with pytest.raises(ValueError, match="device must be cpu with onnx engines"):
        serve_config(serve_args(engines=engines, device="cuda:0"))
    with pytest.raises(ValueError, match="leave --dtype unset with --engines"):
        serve_config(serve_args(engines=engines, dtype="bfloat16"))
    trt = engine_manifest(tmp_path / "trt", "tensorrt")
    assert serve_config(serve_args(engines=trt)).devices == ("cuda",)  # plans run on a GPU
    with pytest.raises(ValueError, match="device must be cuda or cuda:N with TensorRT"):
        serve_config(serve_args(engines=trt, device="cpu"))


def test_the_model_repository_follows_the_instances_and_keeps_no_placeholder(tmp_path):
    from paradraft.runtime.serving.server import unquoted_placeholders, write_model_repo

    config = ServeConfig("v", "d", devices=("cuda:0", "cuda:1"))
    # a workdir reused from the older layout: its extra models must not load beside ours
    for old in ("preprocessing", "paradraft"):
        (tmp_path / "model_repository" / old / "1").mkdir(parents=True)
    repo = write_model_repo(config, "tokenizer.json", tmp_path)
    # one model, which clients call by TensorRT-LLM's ensemble name: no second slot pool
    assert sorted(p.name for p in repo.iterdir()) == ["ensemble"]
    text = (repo / "ensemble" / "config.pbtxt").read_text()
    assert 'backend: "python"' in text and "decoupled: true" in text
    assert ("instance_group [ { count: 1, kind: KIND_GPU, gpus: [ 0 ] }, "
            "{ count: 1, kind: KIND_GPU, gpus: [ 1 ] } ]") in text
    assert f'string_value: "{tmp_path / "control"}"' in text
    assert "${" not in text and not unquoted_placeholders(text)
    # the JSON the model reads back gives the same config
    written = json.loads((repo / "ensemble" / "paradraft.json").read_text())
    assert ServeConfig(**written) == config


def test_the_served_model_declares_every_input_the_protocol_reads():
    """The config's inputs are the ones parse_request reads, plus stop (the model's own):
    an input the config lacks would be refused by Triton, one the protocol lacks ignored."""
    import re

    from paradraft.runtime.serving.protocol import REQUEST_INPUTS

    text = (Path(__file__).parent.parent / "triton_repo" / "ensemble" / "config.pbtxt")
    block = text.read_text().split("output [")[0]
    declared = set(re.findall(r'name: "(\w+)"', block)) - {"ensemble"}
    assert declared == {*REQUEST_INPUTS, "stop"}


def test_the_triton_model_imports_only_the_protocol_and_the_scheduler():
    """The decoupled Python model stays a thin adapter: none of the process launcher or the
    gRPC client comes into the Triton stub with it."""
    source = (Path(__file__).parent.parent / "triton_repo" / "ensemble" / "1" / "model.py")
    imported = set()
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("paradraft"):
            imported |= {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            imported |= {a.name for a in node.names if a.name.startswith("paradraft")}
    assert imported == {"paradraft.runtime.serving.protocol",
                        "paradraft.runtime.scheduler.QueueFull",
                        "paradraft.runtime.scheduler.Request",
                        "paradraft.runtime.scheduler.ShuttingDown"}


def test_num_draft_tokens_zero_turns_speculation_off_and_the_range_is_named():
    import numpy as np

    from paradraft.runtime.serving.protocol import parse_request

    config = ServeConfig("verifier", "draft", k=4)
    inputs = {"input_ids": np.array([[5, 6, 7]], np.int32), "max_tokens": np.array([[8]], np.int32)}
    assert parse_request({**inputs, "num_draft_tokens": np.array([[0]], np.int32)},
                         config).num_draft_tokens == 0
    with pytest.raises(ValueError, match=r"num_draft_tokens must be in \[0, 4\]"):
        parse_request({**inputs, "num_draft_tokens": np.array([[5]], np.int32)}, config)
    # unset: the server's K, which its schedule (the goodput policy by default) plans
    assert parse_request(inputs, config).num_draft_tokens is None
    # the drafter per request: the server's, or the n-gram lookup beside it
    assert not parse_request(inputs, config).lookup_drafts
    assert not parse_request({**inputs, "drafter": texts("model")}, config).lookup_drafts
    assert parse_request({**inputs, "drafter": texts("ngram")}, config).lookup_drafts
    ngram_server = ServeConfig("verifier", None, drafter="ngram", k=4)
    assert not parse_request({**inputs, "drafter": texts("ngram")}, ngram_server).lookup_drafts
    for server, asked, allowed in [(config, "parallel", "model, ngram"),
                                   (ngram_server, "model", "ngram")]:
        with pytest.raises(ValueError, match=f"drafter must be one of {allowed} on this "
                                             f"server; got '{asked}'"):
            parse_request({**inputs, "drafter": texts(asked)}, server)
    # no seed: each request draws its own (a sampled request is not every other one's twin)
    seeds = {parse_request(inputs, config).seed for _ in range(4)}
    assert len(seeds) == 4 and all(0 <= s < 2**63 for s in seeds)


def test_finish_reason_tells_length_from_stop():
    from paradraft.runtime.correction import RuleParams
    from paradraft.runtime.serving.protocol import ParsedRequest, finish_reason

    def request(eos, stops=()):
        return ParsedRequest([1], 4, RuleParams("greedy"), 4, 0, eos, True,
                             [list(s) for s in stops])

    assert finish_reason([5, 6, 7, 8], request(0)) == "length"
    assert finish_reason([5, 6, 0], request(0)) == "stop"  # ended early: an end id
    assert finish_reason([5, 6, 7, 0], request((3, 0))) == "stop"  # the end id as the last token
    assert finish_reason([5, 6, 7, 8], request(None, [(7, 8)])) == "stop"  # a stop sequence
    assert finish_reason([5, 6, 7, 8], request(None, [(6,)])) == "length"


@pytest.mark.parametrize("step", [1, 2, 3, 5])
def test_detokenizer_streams_whole_characters_without_special_tokens(step):
    """Byte-level BPE splits é, — and 日本語 across tokens: fed ``step`` tokens at a time, each
    piece is whole characters, special tokens (EOS) never show, and the pieces join up to the
    full decode; work per piece follows its new tokens (DecodeStream)."""
    from paradraft.runtime.checkpoints import DEMO_DIR, load_tokenizer
    from paradraft.runtime.serving.protocol import Detokenizer

    tok = load_tokenizer(DEMO_DIR / "verifier")
    ids = tok.encode("naïve café — 日本語 ✓ ok<|endoftext|>def f(x):<|endoftext|>").ids
    assert 0 in ids  # <|endoftext|>, a special token
    detok = Detokenizer(tok, tok.encode("# prompt\n").ids)
    pieces = [detok.add(ids[i:i + step]) for i in range(0, len(ids), step)]
    pieces.append(detok.finish())
    assert all("\ufffd" not in p and "<|endoftext|>" not in p for p in pieces), pieces
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)
    assert "".join(pieces) == "naïve café — 日本語 ✓ okdef f(x):"
    if step == 1:  # a character split across tokens is held back until it completes
        assert "" in pieces[:-1]
    # an output that ends inside a character: finish() hands the rest out as U+FFFD, as
    # decoding the whole output does
    cut = next(n for n in range(1, len(ids)) if tok.decode(ids[:n]).endswith("\ufffd"))
    detok = Detokenizer(tok)
    text = "".join(detok.add([i]) for i in ids[:cut]) + detok.finish()
    assert text == tok.decode(ids[:cut], skip_special_tokens=True)


def test_openai_stop_strings_hold_back_what_could_still_become_one():
    from paradraft.runtime.serving.openai_api import StopMatcher

    m = StopMatcher(["\n\n", "END"])
    assert m.feed("abc E", False) == ("abc ", False)  # "E" may start "END"
    assert m.feed("Nx", False) == ("ENx", False)
    assert m.feed("y\n", False) == ("y", False)
    assert m.feed("\nmore", False) == ("", True)  # "\n\n": cut before it
    m = StopMatcher(["END"])
    assert m.feed("xE", True) == ("xE", False)  # the final piece holds nothing back
    assert StopMatcher([]).feed("abc", False) == ("abc", False)


def test_openai_requests_are_validated_field_by_field():
    from paradraft.runtime.checkpoints import DEMO_DIR, load_tokenizer
    from paradraft.runtime.serving.openai_api import ApiError, OpenAIConfig, parse_job

    tok = load_tokenizer(DEMO_DIR / "verifier")
    config = OpenAIConfig("127.0.0.1:1", str(DEMO_DIR / "verifier"), max_seq_len=64)

    def job(**body):
        return parse_job({"model": "paradraft", "prompt": "def f(x):", **body}, "completions",
                         tok, config, ())

    j = job(temperature=0, seed=-1, stop="\n", stream=True,
            stream_options={"include_usage": True}, num_draft_tokens=0, user="me")
    assert j.inputs["correction_rule"] == ("BYTES", [b"greedy"]) and "temperature" not in j.inputs
    assert j.inputs["random_seed"] == ("UINT64", [2**64 - 1])
    assert j.inputs["num_draft_tokens"] == ("INT32", [0])
    assert job(drafter="ngram").inputs["drafter"] == ("BYTES", [b"ngram"])
    assert (j.stop, j.include_usage, j.max_tokens) == (["\n"], True, 16)  # OpenAI's default
    assert job(temperature=0.7, top_p=0.9).inputs["temperature"] == ("FP32", [0.7])
    assert job(ignore_eos=True).inputs["end_id"] == ("INT32", [-1])
    for body, param, message in [
        (dict(n=17), "n", r"n must be an integer in \[1, 16\]"),
        (dict(max_tokens=0), "max_tokens", r"max_tokens must be in \[1, 59\]"),
        (dict(max_tokens=True), "max_tokens", "max_tokens must be an integer"),
        (dict(stream_options={"include_usage": True}), "stream_options", "only with stream"),
        (dict(stop=[1]), "stop", "stop must be a string or a list of strings"),
        (dict(prompt=["a", "b"]), "prompt", "one prompt per request"),
        (dict(prompt=[9999]), "prompt", r"token ids must be in \[0, 8191\]"),
        (dict(top_k=5), "top_k", "top_k is not supported"),
        (dict(frequency_penalty=1), "frequency_penalty", "frequency_penalty is not supported"),
        (dict(suffix="x"), "suffix", "suffix is not supported"),
        (dict(tools=[]), "tools", "unsupported field 'tools'"),  # chat only
        (dict(temperature=0, correction_rule="exact"), "correction_rule", "contradict"),
        (dict(drafter=1), "drafter", "drafter must be a string"),
    ]:
        with pytest.raises(ApiError, match=message) as e:
            job(**body)
        assert (e.value.status, e.value.param) == (400, param), body
    with pytest.raises(ApiError) as e:
        job(model="other")
    assert e.value.status == 404
    # chat without a template: a 400 that says so
    with pytest.raises(ApiError, match="no chat template") as e:
        parse_job({"model": "paradraft", "messages": [{"role": "user", "content": "hi"}]},
                  "chat", tok, config, ())
    assert e.value.param == "messages"


def test_detokenizer_work_follows_the_new_tokens_not_the_output_so_far():
    """Streaming 8x the tokens one at a time takes about 8x as long (DecodeStream), not 64x
    (decoding the output so far for every response, as a stateless detokeniser must)."""
    import time

    from paradraft.runtime.checkpoints import DEMO_DIR, load_tokenizer
    from paradraft.runtime.serving.protocol import Detokenizer

    tok = load_tokenizer(DEMO_DIR / "verifier")
    ids = tok.encode("def f(x):\n    return [x * 2 for x in range(10)]  # naïve\n" * 200).ids

    def seconds(n):
        best = float("inf")
        for _ in range(3):
            detok = Detokenizer(tok)
            t0 = time.perf_counter()
            for i in ids[:n]:
                detok.add([i])
            best = min(best, time.perf_counter() - t0)
        return best

    n = len(ids) // 8
    assert seconds(8 * n) / seconds(n) < 24


def texts(*values: str | bytes):
    """A BYTES tensor as Triton hands it over: [1, n] of bytes."""
    import numpy as np

    return np.array([[v.encode() if isinstance(v, str) else v for v in values]], dtype=object)


def test_text_input_is_tokenised_with_every_check_and_equals_sending_its_ids():
    """The served model takes the prompt as text_input (tokenised in process, as the old
    preprocessing model did) or as input_ids: the same request either way."""
    import numpy as np

    from paradraft.runtime.checkpoints import DEMO_DIR, load_tokenizer
    from paradraft.runtime.serving.protocol import parse_request

    tok = load_tokenizer(DEMO_DIR / "verifier")
    config = ServeConfig("verifier", "draft", max_seq_len=64, max_input_tokens=16)
    max_tokens = {"max_tokens": np.array([[8]], np.int32)}
    ids = tok.encode("def f(x):").ids
    by_text = parse_request({"text_input": texts("def f(x):"), **max_tokens,
                             "random_seed": np.array([[1]], np.uint64)}, config, tok)
    by_ids = parse_request({"input_ids": np.array([ids], np.int32),
                            "input_lengths": np.array([[len(ids)]], np.int32), **max_tokens,
                            "random_seed": np.array([[1]], np.uint64)}, config, tok)
    assert by_text == by_ids and by_text.prompt == ids
    for inputs, message in [
        ({}, "send exactly one of text_input .* and input_ids .*; got neither"),
        ({"text_input": texts("x"), "input_ids": np.array([[1]], np.int32)},
         "send exactly one of text_input .* and input_ids .*; got text_input and input_ids"),
        ({"text_input": texts("a", "b")}, "text_input must hold exactly one prompt; got 2"),
        ({"text_input": texts(b"def \xff(x):")}, "text_input is not valid UTF-8"),
        ({"text_input": texts("")}, "text_input is empty"),
        ({"text_input": texts("x" * (64 * 16 + 1))},  # refused before tokenising
         "text_input is 1025 bytes; the limit is 16 tokens"),
        ({"text_input": texts("x = 1\n" * 20)}, r"text_input is \d+ tokens; allowed 1..16"),
        ({"input_ids": np.zeros((1, 0), np.int32)}, r"input_ids is 0 tokens; allowed 1..16"),
        ({"input_ids": np.array([[1.0]], np.float32)}, "input_ids must be an integer tensor"),
        ({"input_ids": np.array([[1, 9000]], np.int32)},
         r"input_ids must be token ids in \[0, 8191\]; got 9000"),
        ({"input_ids": np.array([[1, 2]], np.int32), "input_lengths": np.array([[3]], np.int32)},
         r"input_lengths must be 2 \(the number of input_ids\); got 3"),
        ({"text_input": texts("def f():"), "bad_words": texts("import")},
         "bad_words: not supported by paradraft"),
        ({"text_input": texts("def f():"), "stop_words": texts(*[f"w{i}" for i in range(17)])},
         "stop_words must hold at most 16 words; got 17"),
        ({"text_input": texts("def f():"), "stop_words": texts("x = 1\n" * 10)},
         r"stop_words: each word must be 1..32 tokens; 'x = 1\\nx = 1.*' is \d+"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_request({**max_tokens, **inputs}, config, tok)
    with pytest.raises(ValueError, match="max_tokens is required"):
        parse_request({"input_ids": np.array([[1]], np.int32)}, config, tok)
    with pytest.raises(ValueError, match="text_input: this server has no tokenizer"):
        parse_request({"text_input": texts("x"), **max_tokens}, config)


def test_stop_words_are_tokenised_alone_and_join_the_ids_sent():
    """TensorRT-LLM's stop_words: each word tokenised without special tokens; empty strings
    (its clients' default) and empty bad_words mean none; stop_words_ids add to them, within
    the 16-word limit."""
    import numpy as np

    from paradraft.runtime.checkpoints import DEMO_DIR, load_tokenizer
    from paradraft.runtime.serving.protocol import parse_request

    tok = load_tokenizer(DEMO_DIR / "verifier")
    config = ServeConfig("verifier", "draft", max_seq_len=64, max_input_tokens=32)
    base = {"text_input": texts("def f():"), "max_tokens": np.array([[8]], np.int32),
            "bad_words": texts("")}
    got = parse_request({**base, "stop_words": texts("return", "", "\n\n")}, config, tok)
    assert got.stop_sequences == [tok.encode("return", add_special_tokens=False).ids,
                                  tok.encode("\n\n", add_special_tokens=False).ids]
    got = parse_request({**base, "stop_words": texts("return"),
                         "stop_words_ids": np.array([[7, 8, 9]], np.int32),
                         "stop_words_lengths": np.array([[1, 2]], np.int32)}, config, tok)
    assert got.stop_sequences == [[7], [8, 9], tok.encode("return").ids]
    with pytest.raises(ValueError, match=r"at most 16 words \(stop_words and stop_words_ids "
                                         r"together\); got 17"):
        parse_request({**base, "stop_words": texts(*[f"w{i}" for i in range(9)]),
                       "stop_words_ids": np.array([list(range(8))], np.int32),
                       "stop_words_lengths": np.array([[1] * 8], np.int32)}, config, tok)


CALIBRATION = dict(tau=0.11, dynamic_tau=0.07, gamma=0.42, alpha=0.2, quantile=0.2,
                   positions=256)


def test_requests_of_a_calibrated_rule_get_its_calibrated_parameters(tmp_path):
    """Engines built with a calibration: a threshold / ratio / dynamic request that leaves
    tau / gamma unset gets the calibrated value for its rule (as `generate --engines` does);
    a request's own value wins; other rules and parameters keep the fixed defaults."""
    import numpy as np

    from paradraft.cli.serve import serve_config
    from paradraft.runtime.serving.protocol import default_params, parse_request

    (tmp_path / "manifest.json").write_text(json.dumps({
        "format_version": 1, "limits": {"max_batch_size": 4, "max_k": 4, "max_seq_len": 256},
        "rule_defaults": dict(rule="greedy", temperature=1.0, top_p=1.0, tau=0.3, gamma=1.0,
                              alpha=0.1, top_p_membership=False, epsilon=0.09, delta=0.3),
        "calibration": CALIBRATION,
        "drafters": {"model": "draft"},
        "models": {"verifier": {"config": {"eos_token_ids": [0]}}}}))
    config = serve_config(serve_args(engines=str(tmp_path)))
    assert config.calibrated == {"threshold": {"tau": 0.11}, "ratio": {"gamma": 0.42},
                                 "dynamic": {"tau": 0.07, "alpha": 0.2}}
    ids = {"input_ids": np.array([[5, 6]], np.int32), "max_tokens": np.array([[4]], np.int32)}

    def params(**inputs):
        tensors = {name: np.array([[value.encode()]], object) if isinstance(value, str)
                   else np.array([[value]], np.float32) for name, value in inputs.items()}
        return parse_request({**ids, **tensors}, config).params

    p = params(correction_rule="threshold")
    assert (p.tau, p.gamma, p.alpha) == (0.11, 1.0, 0.1)
    assert params(correction_rule="ratio").gamma == pytest.approx(0.42)
    p = params(correction_rule="dynamic")
    assert (p.tau, p.alpha) == (pytest.approx(0.07), pytest.approx(0.2))
    # the request's own values win, one parameter at a time
    assert params(correction_rule="threshold", tau=0.5).tau == 0.5
    p = params(correction_rule="dynamic", alpha=0.0)
    assert (p.tau, p.alpha) == (pytest.approx(0.07), 0.0)
    assert params(correction_rule="ratio", gamma=2.0).gamma == 2.0
    # rules without a calibration keep the fixed defaults
    p = params(correction_rule="typical")
    assert (p.tau, p.epsilon) == (0.3, pytest.approx(0.09))
    # the server's default rule (--rule) is calibrated too, for requests and the decoder
    config = serve_config(serve_args(engines=str(tmp_path), rule="threshold"))
    assert parse_request(ids, config).params.tau == 0.11
    assert default_params(config).tau == 0.11
    # engines without a calibration: the fixed defaults
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    (tmp_path / "manifest.json").write_text(json.dumps({**manifest, "calibration": None}))
    config = serve_config(serve_args(engines=str(tmp_path), rule="threshold"))
    assert config.calibrated == {} and parse_request(ids, config).params.tau == 0.3


def test_a_calibration_out_of_range_is_refused_naming_the_rule():
    with pytest.raises(ValueError, match=r"calibrated\['threshold'\]: tau must be in \[0, 1\]"):
        ServeConfig("v", "d", calibrated={"threshold": {"tau": 1.5}})
    with pytest.raises(ValueError, match="calibrated: rule must be one of"):
        ServeConfig("v", "d", calibrated={"best": {"tau": 0.2}})
    with pytest.raises(ValueError, match=r"calibrated\['ratio'\]: parameters must be among "
                                         r"tau, gamma, alpha; got 'delta'"):
        ServeConfig("v", "d", calibrated={"ratio": {"delta": 0.2}})


def test_llama_cpp_engines_default_to_long_lookups_for_one_request():
    from paradraft.cli.serve import backend_default

    llamacpp, onnx = {"backend": "llamacpp"}, {"backend": "onnx"}
    assert backend_default(llamacpp, serve_args(drafter=None))
    assert not backend_default(onnx, serve_args(drafter=None))
    for given in ({"drafter": "model"}, {"k": 3}, {"draft_len_schedule": "auto"}):
        assert not backend_default(llamacpp, serve_args(**given))  # the user's choice stands
