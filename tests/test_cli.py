"""The `paradraft` command, run as a user runs it (its main(), in this process: see run_cli)."""

import json

from conftest import run_cli, run_cli_process


def test_cli_generate_json_speculative_equals_no_speculation(pair):
    vdir, ddir, _, _ = pair
    common = ["generate", "--verifier", vdir, "--prompt-ids", "4,8,15,16",
              "--max-new-tokens", "12", "--rule", "greedy", "--json", "--ignore-eos"]
    # K pinned: the goodput policy (the default) may rightly draft nothing on this pair
    spec = run_cli(*common, "--draft", ddir, "--k", "3", "--draft-len-schedule", "1:3")
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
              "--max-new-tokens", "100", "--k", "4", "--ignore-eos", "--draft-len-schedule", "1:4"]
    r = run_cli_process(*common, "--acceptance-floor", "0.99")
    assert r.returncode == 0, r.stderr
    assert "fell below the floor 0.990" in r.stderr
    r = run_cli_process(*common, "--acceptance-floor", "0")
    assert r.returncode == 0 and "fell below" not in r.stderr
    r = run_cli(*common, "--acceptance-floor", "1.5")
    assert r.returncode == 2 and "acceptance_floor must be in [0, 1]; got 1.5" in r.stderr


def test_cli_bfloat16_speculative_equals_plain_and_device_errors_name_the_device(pair):
    vdir, ddir, _, _ = pair
    common = ["generate", "--verifier", vdir, "--prompt-ids", "4,8,15,16",
              "--max-new-tokens", "10", "--json", "--ignore-eos", "--dtype", "bfloat16"]
    spec = run_cli(*common, "--draft", ddir, "--k", "3")
    plain = run_cli(*common, "--no-speculation")
    assert spec.returncode == 0 and plain.returncode == 0, spec.stderr + plain.stderr
    assert json.loads(spec.stdout)["token_ids"] == json.loads(plain.stdout)["token_ids"]
    import torch

    if not torch.cuda.is_available():
        r = run_cli(*common, "--no-speculation", "--device", "cuda:1")
        assert r.returncode == 2 and "device 'cuda:1': CUDA is not available" in r.stderr
    r = run_cli(*common, "--no-speculation", "--device", "tpu")
    assert r.returncode == 2 and "device must be cpu, cuda or cuda:N; got 'tpu'" in r.stderr


def test_cli_chat_needs_a_template():
    # the demo verifier (the default) is a base model: a tokenizer, no chat template
    r = run_cli("generate", "--prompt", "hi", "--chat", "--no-speculation")
    assert r.returncode == 2 and "has no chat template" in r.stderr
    r = run_cli("generate", "--prompt", "hi", "--system", "be brief", "--no-speculation")
    assert r.returncode == 2 and "--system needs --chat" in r.stderr


def test_cli_bench_tensorrt_needs_its_engines_and_names_them(pair, tmp_path):
    """bench's tensorrt rows run on a TensorRT engine dir given with --engines; without one,
    or with another backend's engines, it refuses by name instead of benchmarking ONNX."""
    r = run_cli("bench", "--verifier", pair[0], "--backends", "tensorrt", "--no-hf")
    assert r.returncode == 2 and "tensorrt needs --engines" in r.stderr
    r = run_cli("bench", "--verifier", pair[0], "--backends", "tensorrt,onnx", "--engines",
                str(tmp_path))
    assert r.returncode == 2 and "cannot run beside onnx" in r.stderr
    r = run_cli("bench", "--verifier", pair[0], "--backends", "onnx,jax")
    assert r.returncode == 2 and "torch, onnx, tensorrt" in r.stderr


def test_cli_serve_refuses_bad_placement_fused_correction_and_drain_by_name():
    """`serve` checks its options before it starts anything (no tritonserver needed)."""
    import torch

    r = run_cli("serve", "--fused-correction", "maybe")
    assert r.returncode == 2 and "--fused-correction: invalid choice: 'maybe'" in r.stderr
    r = run_cli("serve", "--fused-correction", "on")  # the demo checkpoints, no engines
    assert r.returncode == 2 and "fused_correction 'on' needs engines" in r.stderr
    r = run_cli("serve", "--drain-seconds", "-1")
    assert r.returncode == 2 and "drain_seconds must be >= 0; got -1.0" in r.stderr
    r = run_cli("serve", "--instances", "0")
    assert r.returncode == 2 and "instances must be an integer >= 1; got 0" in r.stderr
    r = run_cli("serve", "--device", "cpu,tpu")
    assert r.returncode == 2 and "device must be cpu, cuda or cuda:N; got 'tpu'" in r.stderr
    if not torch.cuda.is_available():
        r = run_cli("serve", "--device", "cuda")
        assert r.returncode == 2 and "device 'cuda': CUDA is not available" in r.stderr
