"""`paradraft build --backend trtllm` (TensorRT-LLM >= 1.3) without TensorRT-LLM: the three
deployments (Draft_Target, PARD, NGram), every written field against the names pinned from
llm_args.py, the refused rules, the schedule mapping, and the Triton llmapi model reached by a
stock tritonclient gRPC stream (a stand-in model.py with the llmapi model's tensors and
model.yaml handling, on the CPU tritonserver)."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from paradraft.build import trtllm, trtllm_fields
from paradraft.cli.main import main
from paradraft.runtime.backends.manifest import read_manifest

yaml = pytest.importorskip("yaml")
ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "models" / "demo"


def build(tmp_path, name, *extra):
    out = tmp_path / name
    main(["build", "--backend", "trtllm", "--gpus", "1", "--out", str(out), *extra])
    serve = yaml.safe_load((out / "trtllm_serve.yaml").read_text())
    model = yaml.safe_load((out / "triton_repo" / "tensorrt_llm" / "1" / "model.yaml").read_text())
    return out, serve, model


def assert_known_fields(model: dict):
    triton = model.pop("triton_config")
    assert trtllm_fields.unknown_fields(model, triton) == []
    model["triton_config"] = triton


@pytest.mark.parametrize("drafter,extra,decoding_type", [
    ("model", [], "Draft_Target"),
    ("parallel", ["--parallel-draft", str(DEMO / "parallel_draft"),
                  "--verifier", str(DEMO / "verifier")], "PARD"),
    ("ngram", ["--drafter", "ngram", "--ngram-max", "4"], "NGram")])
def test_the_three_deployments(tmp_path, capsys, drafter, extra, decoding_type):
    out, serve, model = build(tmp_path, drafter, *extra)
    spec = serve["speculative_config"]
    assert spec["decoding_type"] == decoding_type and spec["max_draft_len"] == 8
    assert model["speculative_config"] == spec  # the same speculation on both servers
    assert model["model"] == str((DEMO / "verifier").resolve()) and "model" not in serve
    assert model["triton_config"] == {"max_batch_size": 0, "decoupled": True}
    assert_known_fields(model)
    if drafter == "model":
        assert spec["speculative_model"] == str((DEMO / "draft").resolve())
    if drafter == "parallel":  # from the draft's config.json
        mask = json.loads((DEMO / "parallel_draft" / "config.json").read_text())["mask_token_id"]
        assert spec["mask_token_id"] == mask
    if drafter == "ngram":
        assert spec["max_matching_ngram_size"] == 4 and "speculative_model" not in spec
    printed = json.loads(capsys.readouterr().out)
    assert printed["decoding_type"] == decoding_type
    script = (out / "serve_trtllm.sh").read_text()
    assert f"--config {out.resolve() / 'trtllm_serve.yaml'}" in script
    assert printed["trtllm_serve"].split()[:2] == ["trtllm-serve", model["model"]]
    for s in ("serve_trtllm.sh", "serve_triton_llmapi.sh"):
        subprocess.run(["bash", "-n", str(out / s)], check=True)
    m = read_manifest(out)  # the written configs verify against their checksums
    assert m["backend"] == "trtllm"
    assert m["trtllm"]["fields_commit"] == trtllm_fields.LLM_ARGS_COMMIT
    assert "not validated by TensorRT-LLM" in m["trtllm"]["validation"]


def test_pinned_field_lists_catch_unknown_names():
    ok = {"model": "m", "speculative_config": {"decoding_type": "NGram", "max_draft_len": 2,
                                               "max_matching_ngram_size": 3}}
    assert trtllm_fields.unknown_fields(ok, {"decoupled": True}) == []
    bad = {"model": "m", "max_draft": 1,
           "speculative_config": {"decoding_type": "Draft_Target", "mask_token_id": 2}}
    assert trtllm_fields.unknown_fields(bad, {"decoupled": True, "batching": 1}) == [
        "max_draft", "speculative_config.mask_token_id", "triton_config.batching"]
    assert trtllm_fields.unknown_fields({"speculative_config": {"decoding_type": "Medusa"}}) == [
        "speculative_config.decoding_type='Medusa'"]
    assert len(trtllm_fields.LLM_ARGS_COMMIT) == 40


def test_every_option_lands_in_known_fields(tmp_path):
    job = trtllm.LlmApiJob(verifier=DEMO / "verifier", out=tmp_path, drafter="parallel",
                           draft=DEMO / "parallel_draft", rule="exact",
                           draft_len_schedule={1: 4, 4: 2, 8: 0}, acceptance_floor=0.5,
                           acceptance_window=16, tp_size=2, dtype="bfloat16")
    kwargs = trtllm.llm_kwargs(job, mask_token_id=2)
    assert trtllm_fields.unknown_fields(kwargs, trtllm.triton_config(job)) == []
    spec = kwargs["speculative_config"]
    assert spec["use_rejection_sampling"] is True  # our exact = their rejection sampling
    assert (spec["acceptance_rate_window_size"], spec["acceptance_rate_threshold"]) == (16, 0.5)
    assert spec["draft_len_schedule"] == {3: 4, 7: 2} and spec["max_draft_len"] == 4
    assert "max_concurrency" not in spec  # never both with draft_len_schedule


@pytest.mark.parametrize("ours,max_batch,theirs", [
    ({1: 4, 4: 2, 8: 0}, 16, {3: 4, 7: 2}),  # none from 8: nothing above key 7
    ({1: 4, 4: 2}, 16, {3: 4, 16: 2}),  # an open last range ends at max_batch_size
    ({1: 3}, 8, {8: 3})])
def test_schedule_mapping(ours, max_batch, theirs):
    assert trtllm.trtllm_schedule(ours, 8, max_batch) == theirs
    for size in range(1, max_batch + 1):  # the same K for every batch size
        want = ours[max(s for s in ours if s <= size)]
        got = next((k for upper, k in sorted(theirs.items()) if size <= upper), 0)
        assert got == want, size


@pytest.mark.parametrize("schedule,match", [
    ({2: 4}, "start at 1"), ({1: 2, 4: 3}, "largest"), ({1: 9}, "--max-k 8"),
    ("auto", "'auto' runs only in paradraft")])
def test_schedule_refused(schedule, match):
    with pytest.raises(ValueError, match=match):
        trtllm.trtllm_schedule(schedule, 8, 16)


@pytest.mark.parametrize("rule", trtllm.LOSSY_RULES)
def test_lossy_rules_refused_by_name(tmp_path, capsys, rule):
    with pytest.raises(SystemExit) as e:
        main(["build", "--backend", "trtllm", "--rule", rule, "--out", str(tmp_path / "e")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"--rule {rule}" in err
    assert "attention causal audit" in err and "CausalCorrection" in err
    assert not (tmp_path / "e").exists()


@pytest.mark.parametrize("args,match", [
    (["--drafter", "ngram", "--rule", "exact"], "--rule exact with --drafter ngram"),
    (["--drafter", "ngram", "--draft", str(DEMO / "draft")], "--draft: --drafter ngram"),
    (["--ngram-max", "3"], "--ngram-max: only --drafter ngram"),
    (["--pp-size", "2"], "--pp-size 2"), (["--draft-tp-size", "2"], "--draft-tp-size 2"),
    (["--tp-size", "2"], "needs 2 GPU"), (["--acceptance-floor", "1.5"], r"\[0, 1\]"),
    (["--trtllm-engine-legacy", "--drafter", "ngram"], "--drafter: not available on the legacy"),
])
def test_options_refused_by_name(tmp_path, capsys, args, match):
    import re

    with pytest.raises(SystemExit):
        main(["build", "--backend", "trtllm", "--gpus", "1", "--out", str(tmp_path / "e"),
              *args])
    assert re.search(match, capsys.readouterr().err)


def test_other_backends_refuse_the_trtllm_options(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["build", "--backend", "onnx", "--drafter", "ngram", "--out", str(tmp_path)])
    assert "--drafter: only --backend trtllm" in capsys.readouterr().err


def test_llmapi_model_files_copied_from_a_checkout(tmp_path):
    src = tmp_path / "src"
    (src / trtllm.LLMAPI_MODEL_DIR / "1").mkdir(parents=True)
    for f in trtllm.LLMAPI_FILES:
        (src / trtllm.LLMAPI_MODEL_DIR / "1" / f).write_text(f"# stand-in {f}\n")
    job = trtllm.LlmApiJob(verifier=DEMO / "verifier", out=tmp_path / "o", drafter="ngram",
                           src=src)
    m = trtllm.build_trtllm(job)
    assert "copied" in m["trtllm"]["triton"]["model_py"]
    assert (tmp_path / "o/triton_repo/tensorrt_llm/1/model.py").read_text() == \
        "# stand-in model.py\n"


# A stand-in for TensorRT-LLM's llmapi model.py: the same model.yaml handling (triton_config
# sets decoupled and max_batch_size at auto-complete) and the tensors it reads and sends, so the
# generated config.pbtxt is tried in a real tritonserver by a stock client.
STUB_MODEL = """\
import os

import numpy as np
import triton_python_backend_utils as pb_utils
import yaml


def triton_config():
    with open(os.path.join(pb_utils.get_model_dir(), "model.yaml")) as f:
        return yaml.safe_load(f)["triton_config"]


class TritonPythonModel:
    @classmethod
    def auto_complete_config(cls, config):
        t = triton_config()
        config.set_model_transaction_policy(dict(decoupled=bool(t["decoupled"])))
        config.set_max_batch_size(int(t["max_batch_size"]))
        return config

    def execute(self, requests):
        for r in requests:
            sender = r.get_response_sender()
            n = int(pb_utils.get_input_tensor_by_name(r, "sampling_param_max_tokens")
                    .as_numpy().item())
            streaming = pb_utils.get_input_tensor_by_name(r, "streaming").as_numpy().item()
            for i in range(n if streaming else 1):
                sender.send(pb_utils.InferenceResponse(output_tensors=[
                    pb_utils.Tensor("text_output", np.array([b"t%d" % i], dtype=object)),
                    pb_utils.Tensor("acceptance_rate", np.array([0.75], dtype=np.float32)),
                    pb_utils.Tensor("total_draft_tokens", np.array([8], dtype=np.int32))]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""


def test_llmapi_repository_streams_to_a_stock_grpc_client(tmp_path):
    import queue

    import numpy as np

    from paradraft.cli.serve import free_port
    from paradraft.runtime.serving import server

    grpc = pytest.importorskip("tritonclient.grpc")
    try:
        server_bin = server.find_tritonserver()
    except FileNotFoundError:
        pytest.skip("no tritonserver (make serve-deps)")
    job = trtllm.LlmApiJob(verifier=DEMO / "verifier", out=tmp_path / "o",
                           draft=DEMO / "draft", src=tmp_path / "nowhere")
    trtllm.build_trtllm(job)
    repo = tmp_path / "o" / "triton_repo"
    (repo / "tensorrt_llm" / "1" / "model.py").write_text(STUB_MODEL)
    port = free_port()
    with open(tmp_path / "log.txt", "w") as log:
        proc = subprocess.Popen(
            [str(server_bin), f"--model-repository={repo}",
             f"--backend-directory={server.backend_dir(server_bin, tmp_path)}",
             f"--grpc-port={port}", f"--http-port={free_port()}",
             f"--metrics-port={free_port()}"],
            stdout=log, stderr=subprocess.STDOUT, env=server.server_env(server_bin))
    try:
        client = grpc.InferenceServerClient(f"127.0.0.1:{port}")
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            try:
                if client.is_model_ready("tensorrt_llm"):
                    break
            except Exception:  # not listening yet
                pass
            time.sleep(0.5)
        assert client.is_model_ready("tensorrt_llm"), (tmp_path / "log.txt").read_text()[-3000:]
        config = client.get_model_config("tensorrt_llm", as_json=True)["config"]
        assert config["model_transaction_policy"]["decoupled"] is True  # from model.yaml

        def tensor(name, value, dtype, np_dtype):
            t = grpc.InferInput(name, [1], dtype)
            t.set_data_from_numpy(np.array([value], dtype=np_dtype))
            return t

        results: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        client.async_stream_infer("tensorrt_llm", [
            tensor("text_input", b"def f(x):", "BYTES", np.object_),
            tensor("streaming", True, "BOOL", np.bool_),
            tensor("sampling_param_max_tokens", 3, "INT32", np.int32),
            tensor("sampling_param_return_perf_metrics", True, "BOOL", np.bool_)],
            enable_empty_final_response=True)
        texts, rates = [], []
        while True:
            result, error = results.get(timeout=60)
            assert error is None, error
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
            texts.append(result.as_numpy("text_output")[0].decode())
            rates.append(float(result.as_numpy("acceptance_rate")[0]))
        client.stop_stream()
        assert texts == ["t0", "t1", "t2"] and rates == [0.75] * 3
    finally:
        proc.terminate()
        proc.wait(60)
