"""The LEGACY engine path, `paradraft build --backend trtllm --trtllm-engine-legacy`
(TensorRT-LLM <= 1.2.1), without TensorRT-LLM: command assembly, the generated Triton repository
and manifest, the clear error when the tools are missing, the GPU check script and the GPU
Dockerfile's default stage."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from paradraft.build import trtllm_engine as trtllm
from paradraft.cli.build import job_from_args
from paradraft.runtime.backends.manifest import read_manifest
from paradraft.runtime.correction import RuleParams

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "models" / "demo"
LEGACY = ["build", "--backend", "trtllm", "--trtllm-engine-legacy"]


# -- a minimal config.pbtxt reader (enough to check what the generator wrote) ---------------


def block(text: str, section: str) -> str:
    """The text inside the top-level `section [ ... ]`."""
    m = re.search(rf"^{section} \[", text, re.M)
    assert m, f"no {section} block"
    depth, i = 0, m.end() - 1
    for j in range(i, len(text)):
        depth += {"[": 1, "]": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    raise AssertionError(f"unbalanced {section} block")


def tensor_names(text: str, section: str) -> list[str]:
    return re.findall(r'name: "([^"]+)"', block(text, section))


def model_name(text: str) -> str:
    return re.search(r'^name: "([^"]+)"', text, re.M).group(1)


def parameters(text: str) -> dict[str, str]:
    return dict(re.findall(r'key: "([^"]+)"\s*value: \{\s*string_value: "([^"]*)"', text))


def scalar(text: str, key: str) -> str:
    return re.search(rf"^{key}: (\S+)", text, re.M).group(1)


def ensemble_maps(text: str, kind: str) -> dict[str, str]:
    return {v: k for k, v in re.findall(rf'{kind} {{ key: "([^"]+)" value: "([^"]+)" }}', text)}


# -- fixtures ----------------------------------------------------------------------------------

# Stand-ins for TensorRT-LLM's stock templates: the same ${placeholders} in the same places
# (quoted string parameters and unquoted fields), a few tensors each.
PARAM = 'parameters: {{ key: "{0}" value: {{ string_value: "${{{1}}}" }} }}\n'
ENGINE_TEMPLATE = (
    'name: "tensorrt_llm"\nbackend: "${triton_backend}"\n'
    "max_batch_size: ${triton_max_batch_size}\n"
    "model_transaction_policy { decoupled: ${decoupled_mode} }\n"
    "dynamic_batching { max_queue_delay_microseconds: ${max_queue_delay_microseconds}\n"
    "  default_queue_policy: { max_queue_size: ${max_queue_size} } }\n"
    'input [\n  { name: "input_ids" data_type: TYPE_INT32 dims: [ -1 ] },\n'
    '  { name: "draft_input_ids" data_type: TYPE_INT32 dims: [ -1 ] optional: true },\n'
    '  { name: "draft_logits" data_type: ${logits_datatype} dims: [ -1, -1 ] optional: true }\n'
    ']\noutput [\n  { name: "output_ids" data_type: TYPE_INT32 dims: [ -1, -1 ] }\n]\n'
    + "".join(PARAM.format(k, v) for k, v in [
        ("gpt_model_path", "engine_dir"), ("encoder_model_path", "encoder_engine_dir"),
        ("max_tokens_in_paged_kv_cache", "max_tokens_in_paged_kv_cache"),
        ("max_attention_window_size", "max_attention_window_size"),
        ("enable_kv_cache_reuse", "enable_kv_cache_reuse"),
        ("exclude_input_in_output", "exclude_input_in_output"),
        ("gpt_model_type", "batching_strategy"), ("gpu_device_ids", "gpu_device_ids")]))
# tensorrt_llm_bls's declarations of the tensors the ensemble maps (TensorRT-LLM's stock
# config: names, types, dims, reshape), and a few it has besides
BLS_IN = [("text_input", "TYPE_STRING", ""), ("max_tokens", "TYPE_INT32", ""),
          ("stream", "TYPE_BOOL", "o"), ("temperature", "TYPE_FP32", "o"),
          ("top_p", "TYPE_FP32", "o"), ("seed", "TYPE_UINT64", "o"),
          ("num_draft_tokens", "TYPE_INT32", "o"), ("end_id", "TYPE_INT32", "o"),
          ("use_draft_logits", "TYPE_BOOL", "or"), ("return_perf_metrics", "TYPE_BOOL", "or"),
          ("return_log_probs", "TYPE_BOOL", "or"), ("top_k", "TYPE_INT32", "o")]
BLS_INPUTS = [name for name, _, _ in BLS_IN]
BLS_OUT = [("text_output", "TYPE_STRING", "-1"), ("cum_log_probs", "TYPE_FP32", "-1"),
           ("acceptance_rate", "TYPE_FP32", "1"),
           ("total_accepted_draft_tokens", "TYPE_INT32", "1"),
           ("total_draft_tokens", "TYPE_INT32", "1")]
BLS_TEMPLATE = (
    'name: "tensorrt_llm_bls"\nbackend: "python"\nmax_batch_size: ${triton_max_batch_size}\n'
    "model_transaction_policy { decoupled: ${decoupled_mode} }\n"
    "input [\n" + ",\n".join(
        f'  {{ name: "{n}" data_type: {t} dims: [ 1 ]'
        + (" reshape: { shape: [ ] }" if "r" in f else "")
        + (" optional: true" if "o" in f else "") + " }" for n, t, f in BLS_IN) + "\n]\n"
    "output [\n" + ",\n".join(f'  {{ name: "{n}" data_type: {t} dims: [ {d} ] }}'
                               for n, t, d in BLS_OUT) + "\n]\n"
    + "".join(PARAM.format(k, k) for k in ["tensorrt_llm_model_name",
                                           "tensorrt_llm_draft_model_name",
                                           "multimodal_encoders_name", "accumulate_tokens"])
    + "instance_group [ { count: ${bls_instance_count} kind: KIND_CPU } ]\n")


def text_template(name: str) -> str:
    return (f'name: "{name}"\nbackend: "python"\nmax_batch_size: ${{triton_max_batch_size}}\n'
            'input [ { name: "QUERY" } ]\noutput [ { name: "INPUT_ID" } ]\n'
            + PARAM.format("tokenizer_dir", "tokenizer_dir")
            + f"instance_group [ {{ count: ${{{name}_instance_count}} kind: KIND_CPU }} ]\n")


@pytest.fixture
def stock_src(tmp_path) -> Path:
    """A fake TensorRT-LLM checkout: the convert scripts and the stock Triton models."""
    src = tmp_path / "tensorrt_llm_src"
    for rel in set(trtllm.CONVERT_SCRIPTS.values()):
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text("# stand-in\n")
    templates = {"tensorrt_llm": ENGINE_TEMPLATE, "tensorrt_llm_bls": BLS_TEMPLATE,
                 "preprocessing": text_template("preprocessing"),
                 "postprocessing": text_template("postprocessing")}
    for name, text in templates.items():
        d = src / trtllm.STOCK_MODELS_DIR / name
        (d / "1").mkdir(parents=True)
        (d / "config.pbtxt").write_text(text)
        (d / "1" / "model.py").write_text(f"# stock {name}\n")
    return src


def job(tmp_path: Path, **kw) -> trtllm.TrtllmJob:
    base = dict(verifier=DEMO / "verifier", draft=DEMO / "draft", out=tmp_path / "out",
                src=tmp_path / "tensorrt_llm_src", max_batch_size=4, max_k=5, max_seq_len=256)
    return trtllm.TrtllmJob(**{**base, **kw})


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


# -- command assembly -------------------------------------------------------------------------


@pytest.mark.parametrize("model_type,script", [
    ("llama", "examples/models/core/llama/convert_checkpoint.py"),
    ("qwen2", "examples/models/core/qwen/convert_checkpoint.py"),
    ("gpt2", "examples/models/core/gpt/convert_checkpoint.py")])
def test_convert_argv(tmp_path, model_type, script):
    j = job(tmp_path, verifier_type=model_type, dtype="bfloat16")
    argv = trtllm.convert_argv(j, "verifier")
    assert argv[:2] == ["python3", str(j.src / script)]
    assert flag(argv, "--model_dir") == str(DEMO / "verifier")
    assert flag(argv, "--output_dir") == str(j.out / "trtllm" / "checkpoints" / "verifier")
    assert flag(argv, "--dtype") == "bfloat16"
    assert flag(trtllm.convert_argv(j, "draft"), "--model_dir") == str(DEMO / "draft")


def test_target_build_verifies_external_draft_tokens_within_the_limits(tmp_path):
    j = job(tmp_path, dtype="float16")
    argv = trtllm.trtllm_build_argv(j, "verifier")
    assert argv[0] == "trtllm-build"
    assert flag(argv, "--speculative_decoding_mode") == "draft_tokens_external"
    assert flag(argv, "--max_draft_len") == "5"
    assert flag(argv, "--max_batch_size") == "4"
    assert flag(argv, "--max_seq_len") == "256"
    assert flag(argv, "--max_input_len") == "255"
    assert flag(argv, "--checkpoint_dir") == str(j.ckpt_dir("verifier"))
    assert flag(argv, "--output_dir") == str(j.engine_dir("verifier"))
    assert flag(argv, "--use_paged_context_fmha") == "enable"  # KV reuse across rounds
    assert "--gather_generation_logits" not in argv  # token-match acceptance


def test_draft_build_and_dtype_and_logits_options(tmp_path):
    draft = trtllm.trtllm_build_argv(job(tmp_path), "draft")
    assert "--speculative_decoding_mode" not in draft and "--max_draft_len" not in draft
    fp32 = job(tmp_path, dtype="float32")
    assert not fp32.kv_cache_reuse
    assert "--use_paged_context_fmha" not in trtllm.trtllm_build_argv(fp32, "verifier")
    logits = job(tmp_path, use_draft_logits=True)
    for role in ("verifier", "draft"):
        assert "--gather_generation_logits" in trtllm.trtllm_build_argv(logits, role)


def test_steps_convert_both_before_building(tmp_path):
    names = [s.name for s in trtllm.build_steps(job(tmp_path))]
    assert names == ["convert verifier", "convert draft", "trtllm-build verifier",
                     "trtllm-build draft"]


def test_rules_and_limits_checked(tmp_path):
    assert trtllm.draft_logits_for_rule("greedy") is False
    assert trtllm.draft_logits_for_rule("exact") is True
    with pytest.raises(ValueError, match=r"dynamic.*greedy, exact"):
        trtllm.draft_logits_for_rule("dynamic")
    with pytest.raises(ValueError, match="max_k"):
        trtllm.check_job(job(tmp_path, max_k=0))
    with pytest.raises(ValueError, match="dtype"):
        trtllm.check_job(job(tmp_path, dtype="int8"))
    with pytest.raises(ValueError, match="model_type 'falcon'"):
        trtllm.check_job(job(tmp_path, draft_type="falcon"))


def test_legacy_path_refuses_pard_and_newer_tensorrt_llm(tmp_path, stock_src, monkeypatch):
    with pytest.raises(ValueError, match=r"--parallel-draft .*no PARD.*without "
                                         r"--trtllm-engine-legacy"):
        trtllm.build_trtllm(job(tmp_path), parallel_draft=DEMO / "parallel_draft",
                            runner=fake_runner([]))
    assert [trtllm.engine_era(v) for v in ("1.1.0", "1.2.1", "1.3.0rc21", "2.0.0")] == [
        True, True, False, False]
    monkeypatch.setattr(trtllm.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(trtllm, "package_versions", lambda names: {"tensorrt_llm": "1.3.0rc24"})
    assert any("found 1.3.0rc24" in m for m in trtllm.missing_tools(job(tmp_path)))


# -- parallel engines -------------------------------------------------------------------------

# Argument names of TensorRT-LLM's engine tools, pinned so that a renamed or invented flag fails
# here rather than in a GPU build. Read from NVIDIA/TensorRT-LLM (main-branch snapshots later
# than v1.1.0, the release the Dockerfile pins; every name used below is also in older
# releases' parsers): trtllm-build = tensorrt_llm/commands/build.py parse_arguments() plus the
# plugin options tensorrt_llm/plugin/plugin.py exposes (cli_plugin_args).


def dashed(names: str) -> frozenset[str]:
    return frozenset("--" + name for name in names.split())


TRTLLM_BUILD_FLAGS = dashed("""
    checkpoint_dir model_config build_config model_cls_file model_cls_name output_dir
    max_batch_size max_input_len max_seq_len max_decoder_seq_len max_beam_width max_num_tokens
    opt_num_tokens max_encoder_input_len max_prompt_embedding_table_size max_multimodal_len
    kv_cache_type paged_kv_cache input_timing_cache output_timing_cache profiling_verbosity
    strip_plan weight_sparsity weight_streaming fast_build workers log_level
    enable_debug_output visualize_network dry_run monitor_memory logits_dtype
    gather_context_logits gather_generation_logits gather_all_token_logits lora_dir
    lora_ckpt_source lora_target_modules max_lora_rank speculative_decoding_mode max_draft_len
    auto_parallel gpus_per_node cluster_key
    bert_attention_plugin gpt_attention_plugin gemm_plugin gemm_swiglu_plugin
    fp8_rowwise_gemm_plugin lora_plugin dora_plugin moe_plugin mamba_conv1d_plugin nccl_plugin
    low_latency_gemm_plugin low_latency_gemm_swiglu_plugin gemm_allreduce_plugin context_fmha
    bert_context_fmha_fp32_acc remove_input_padding tokens_per_block use_paged_context_fmha
    use_fp8_context_fmha fuse_fp4_quant multiple_profiles paged_state streamingllm
    norm_quant_fusion reduce_fusion user_buffer use_fused_mlp pp_reduce_scatter""")
# trtllm-build --speculative_decoding_mode choices (same file)
SPECULATIVE_MODES = {"draft_tokens_external", "lookahead_decoding", "medusa",
                     "explicit_draft_tokens", "eagle"}
# The options all three converters we call have in common (examples/models/core/{llama,qwen,
# gpt}/convert_checkpoint.py parse_arguments()): one argv shape serves every family.
CONVERT_FLAGS = dashed("""
    model_dir output_dir dtype tp_size pp_size workers load_model_on_cpu use_parallel_embedding
    embedding_sharding_dim use_weight_only weight_only_precision int8_kv_cache per_channel
    per_token smoothquant calib_dataset""")
CONVERT_DTYPES = {"auto", "float16", "bfloat16", "float32"}  # --dtype choices there


def flags_of(argv: list[str]) -> list[str]:
    return [a for a in argv if a.startswith("--")]


@pytest.mark.parametrize("tp,pp", [(2, 1), (4, 1)])
def test_parallel_commands_use_tensorrt_llm_flag_names(tmp_path, tp, pp):
    j = job(tmp_path, tp_size=tp, pp_size=pp, dtype="bfloat16", use_draft_logits=True)
    steps = {s.name: s.argv for s in trtllm.build_steps(j)}
    for role, draft_tp in [("verifier", tp), ("draft", 1)]:
        convert = steps[f"convert {role}"]
        assert set(flags_of(convert)) <= CONVERT_FLAGS, set(flags_of(convert)) - CONVERT_FLAGS
        assert flag(convert, "--dtype") in CONVERT_DTYPES
        # the mapping is fixed at conversion: trtllm-build then builds one engine per rank
        want = (str(tp), str(pp)) if role == "verifier" else (str(draft_tp), "1")
        assert (flag(convert, "--tp_size"), flag(convert, "--pp_size")) == want
        build = steps[f"trtllm-build {role}"]
        assert set(flags_of(build)) <= TRTLLM_BUILD_FLAGS, set(flags_of(build)) - TRTLLM_BUILD_FLAGS
        assert "--tp_size" not in build  # trtllm-build reads the mapping from the checkpoint
    verifier = steps["trtllm-build verifier"]
    assert flag(verifier, "--speculative_decoding_mode") in SPECULATIVE_MODES
    assert flag(verifier, "--use_paged_context_fmha") in {"enable", "disable"}
    assert j.gpu_device_ids("verifier") == ",".join(map(str, range(tp)))
    assert j.gpu_device_ids("draft") == "0"


def test_pipeline_parallelism_with_a_draft_is_refused_by_name(tmp_path, stock_src):
    with pytest.raises(ValueError, match=r"--pp-size 2: TensorRT-LLM does not run a draft "
                                         r"model .*pipeline parallelism.*Valid: --pp-size 1"):
        trtllm.check_job(job(tmp_path, pp_size=2))
    calls: list = []
    with pytest.raises(ValueError, match="--pp-size 4"):
        trtllm.build_trtllm(job(tmp_path, tp_size=2, pp_size=4), runner=fake_runner(calls))
    assert calls == []
    for label, kw in [("--tp-size", {"tp_size": 0}), ("--pp-size", {"pp_size": -1}),
                      ("--draft-tp-size", {"draft_tp_size": 0})]:
        with pytest.raises(ValueError, match=rf"{label} must be an integer >= 1"):
            trtllm.check_job(job(tmp_path, **kw))


def test_tensor_parallel_sizes_against_the_heads(tmp_path):
    from dataclasses import replace

    from paradraft.runtime.model import load_config

    v, d = load_config(DEMO / "verifier"), load_config(DEMO / "draft")  # 8/4 and 4/2 heads
    assert (v.n_heads, v.n_kv_heads, d.n_heads, d.n_kv_heads) == (8, 4, 4, 2)
    assert trtllm.check_parallel(job(tmp_path, tp_size=4, draft_tp_size=2), v, d) == []
    with pytest.raises(ValueError, match=r"--tp-size 3: must divide the verifier's "
                                         r"num_attention_heads 8; valid: 1, 2, 4, 8"):
        trtllm.check_parallel(job(tmp_path, tp_size=3), v, d)
    with pytest.raises(ValueError, match=r"--draft-tp-size 3: .*draft's num_attention_heads 4"):
        trtllm.check_parallel(job(tmp_path, draft_tp_size=3), v, d)
    # more ranks than KV heads: TensorRT-LLM's converters replicate them (dup_kv_weight)
    notes = trtllm.check_parallel(job(tmp_path, tp_size=8), v, d)
    assert len(notes) == 1 and "--tp-size 8" in notes[0] and "replicates" in notes[0]
    # neither a divisor nor a multiple of the KV heads: refused
    odd = replace(v, n_heads=12, n_kv_heads=4)
    with pytest.raises(ValueError, match=r"--tp-size 6: must divide the verifier's "
                                         r"num_key_value_heads 4 .*valid: 1, 2, 4, 12"):
        trtllm.check_parallel(job(tmp_path, tp_size=6), odd, d)


def test_world_size_against_the_gpus(tmp_path):
    two = job(tmp_path, tp_size=2)
    assert "skipped" in trtllm.check_world_size(two, None)
    assert "needs 2 GPU(s)" in trtllm.check_world_size(two, None)
    assert "2 of 4 GPU(s) (--gpus)" in trtllm.check_world_size(two, 4)
    with pytest.raises(ValueError, match=r"--tp-size 2 × --pp-size 1 = 2 ranks .* need 2 "
                                         r"GPU\(s\) but nvidia-smi gives 1"):
        trtllm.check_world_size(two, 1, "nvidia-smi")
    with pytest.raises(ValueError, match=r"--draft-tp-size 2\) need 2 GPU"):
        trtllm.check_world_size(job(tmp_path, draft_tp_size=2), 1)
    with pytest.raises(ValueError, match="--gpus must be an integer >= 1; got 0"):
        trtllm.check_world_size(two, 0)


def test_gpu_count_from_nvidia_smi_or_unknown(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi: a CPU machine
    assert trtllm.detect_gpu_count() is None
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-a)'\n"
                   "echo 'GPU 1: NVIDIA H200 (UUID: GPU-b)'\n")
    smi.chmod(0o755)
    assert trtllm.detect_gpu_count() == 2
    smi.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    assert trtllm.detect_gpu_count() is None
    smi.write_text("#!/bin/sh\necho 'No devices found.'\n")  # a driver, no GPU: unknown
    assert trtllm.detect_gpu_count() is None


def test_repository_and_launch_for_tensor_parallel_engines(tmp_path, stock_src):
    s = spec(target_gpu_ids="0,1,2,3", draft_gpu_ids="0")
    repo = trtllm.write_triton_repo(s, stock_src / trtllm.STOCK_MODELS_DIR, tmp_path / "repo")
    target = (repo / "tensorrt_llm" / "config.pbtxt").read_text()
    draft = (repo / "tensorrt_llm_draft" / "config.pbtxt").read_text()
    assert parameters(target)["gpu_device_ids"] == "0,1,2,3"
    assert parameters(draft)["gpu_device_ids"] == "0"
    assert s.gpus == 4
    argv, env = trtllm.launch_command(Path("/r"), s.gpus)
    # orchestrator mode: one mpirun process; the ranks are spawned per model
    assert argv[:4] == ["mpirun", "--allow-run-as-root", "-n", "1"]
    assert env["TRTLLM_ORCHESTRATOR_SPAWN_PROCESSES"] == "1"
    pools = [a for a in argv if a.startswith("--cuda-memory-pool-byte-size=")]
    assert pools == [f"--cuda-memory-pool-byte-size={g}:0" for g in range(4)]
    script = trtllm.launch_script(Path("/r"), s)
    assert "tensorrt_llm (verifier) on 0,1,2,3" in script
    with pytest.raises(ValueError, match="gpus must be an integer >= 1"):
        trtllm.launch_command(Path("/r"), 0)


def test_tensor_parallel_build(tmp_path, stock_src):
    j = job(tmp_path, tp_size=2, dtype="float16")
    m = trtllm.build_trtllm(j, runner=fake_runner([]), serve_root=Path("/engines/trtllm"),
                            gpus=2)
    assert m == read_manifest(j.out)
    assert {"trtllm/engines/verifier/rank0.engine", "trtllm/engines/verifier/rank1.engine",
            "trtllm/engines/draft/rank0.engine"} <= set(m["checksums"])
    assert "trtllm/engines/draft/rank1.engine" not in m["checksums"]
    par = m["trtllm"]["parallel"]
    assert par["verifier"] == {"tp_size": 2, "pp_size": 1, "gpu_device_ids": "0,1"}
    assert par["draft"] == {"tp_size": 1, "pp_size": 1, "gpu_device_ids": "0"}
    assert par["gpus_needed"] == 2 and "2 of 2 GPU(s)" in par["gpu_check"]
    target = (j.out / "triton_repo" / "tensorrt_llm" / "config.pbtxt").read_text()
    assert parameters(target)["gpu_device_ids"] == "0,1"
    script = (j.out / "serve_trtllm.sh").read_text()
    assert "--cuda-memory-pool-byte-size=1:0" in script
    subprocess.run(["bash", "-n", str(j.out / "serve_trtllm.sh")], check=True)
    with pytest.raises(ValueError, match="but --gpus gives 1"):
        trtllm.build_trtllm(job(tmp_path, tp_size=2, out=tmp_path / "o2"),
                            runner=fake_runner([]), gpus=1)


def test_cli_parallel_flags(tmp_path, no_trtllm, monkeypatch, capsys):
    from paradraft.cli.main import main

    j, _, _ = job_from_args(build_args(tmp_path, tp_size=2, draft_tp_size=1, precision="fp16"))
    assert (j.tp_size, j.pp_size, j.draft_tp_size, j.world_size) == (2, 1, 1, 2)
    monkeypatch.setattr(trtllm, "DEFAULT_SRC", tmp_path / "nowhere")
    with pytest.raises(SystemExit) as e:
        main([*LEGACY, "--pp-size", "2", "--out", str(tmp_path / "e")])
    assert e.value.code == 2 and "--pp-size 2" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # no nvidia-smi here: the check is skipped, and said so
        main([*LEGACY, "--tp-size", "2", "--out", str(tmp_path / "e")])
    err = capsys.readouterr().err
    assert "GPU count unknown" in err and "trtllm-build" in err  # then the missing tools
    with pytest.raises(SystemExit):
        main([*LEGACY, "--tp-size", "2", "--gpus", "1",
              "--out", str(tmp_path / "e")])
    assert "but --gpus gives 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["build", "--backend", "onnx", "--tp-size", "2", "--out", str(tmp_path / "e")])
    assert "--tp-size: only --backend trtllm" in capsys.readouterr().err


# -- missing tools ----------------------------------------------------------------------------


@pytest.fixture
def no_trtllm(monkeypatch):
    monkeypatch.setattr(trtllm.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(trtllm.shutil, "which", lambda name: None)


def test_missing_tools_named(tmp_path, no_trtllm):
    j = job(tmp_path)
    with pytest.raises(RuntimeError) as e:
        trtllm.require_tools(j)
    msg = str(e.value)
    for needle in ["tensorrt_llm", "trtllm-build", "convert_checkpoint.py",
                   trtllm.STOCK_MODELS_DIR, trtllm.IMAGE, "PARADRAFT_TRTLLM_SRC"]:
        assert needle in msg
    # the build stops before writing anything
    with pytest.raises(RuntimeError, match="trtllm-build"):
        trtllm.build_trtllm(j)
    assert not j.out.exists()


def test_only_absent_tools_are_named(tmp_path, stock_src, monkeypatch):
    monkeypatch.setattr(trtllm.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(trtllm.shutil, "which", lambda name: None)
    assert trtllm.missing_tools(job(tmp_path)) == ["the trtllm-build command"]


def test_cli_build_trtllm_exits_2_naming_the_tools(tmp_path, no_trtllm, monkeypatch, capsys):
    from paradraft.cli.main import main

    monkeypatch.setattr(trtllm, "DEFAULT_SRC", tmp_path / "nowhere")
    with pytest.raises(SystemExit) as e:
        main([*LEGACY, "--out", str(tmp_path / "e")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "tensorrt_llm" in err and "trtllm-build" in err
    with pytest.raises(SystemExit):
        main([*LEGACY, "--rule", "dynamic", "--out", str(tmp_path)])
    assert "no TensorRT-LLM equivalent" in capsys.readouterr().err


def build_args(tmp_path, **kw):
    import argparse

    base = dict(verifier=None, draft=None, parallel_draft=None, self_draft_layers=None,
                out=str(tmp_path / "e"), max_batch_size=8, max_k=4, max_seq_len=512,
                dtype="float32", precision="fp32", rule="greedy", temperature=1.0, top_p=1.0,
                tau=0.3, gamma=1.0, alpha=0.1, top_p_membership=False, epsilon=0.09, delta=0.3,
                tp_size=1, pp_size=1, draft_tp_size=1, gpus=None)
    return argparse.Namespace(**{**base, **kw})


def test_cli_arguments_to_a_job(tmp_path):
    j, rules, parallel = job_from_args(build_args(tmp_path))
    assert (j.verifier, j.draft, j.verifier_type) == (DEMO / "verifier", DEMO / "draft", "llama")
    assert (j.dtype, j.max_k, j.use_draft_logits, parallel) == ("float32", 4, False, None)
    j, rules, parallel = job_from_args(build_args(
        tmp_path, precision="bf16", rule="exact", parallel_draft=str(DEMO / "parallel_draft")))
    assert (j.dtype, j.use_draft_logits, rules.rule) == ("bfloat16", True, "exact")
    assert parallel == DEMO / "parallel_draft"
    with pytest.raises(ValueError, match="--draft is required"):
        job_from_args(build_args(tmp_path, verifier=str(DEMO / "verifier")))
    with pytest.raises(ValueError, match="self-draft"):
        job_from_args(build_args(tmp_path, self_draft_layers=1))


def test_run_steps_stops_at_the_first_failure(tmp_path):
    marker = tmp_path / "third_ran"
    steps = [trtllm.Step("ok", [sys.executable, "-c", "print('fine')"]),
             trtllm.Step("broken step", [sys.executable, "-c", "import sys; sys.exit(3)"]),
             trtllm.Step("third", [sys.executable, "-c", f"open({str(marker)!r}, 'w')"])]
    with pytest.raises(RuntimeError, match=r"broken step failed \(exit 3\)") as e:
        trtllm.run_steps(steps, tmp_path / "logs")
    assert "1_broken_step.log" in str(e.value)
    assert not marker.exists()
    assert "fine" in (tmp_path / "logs" / "0_ok.log").read_text()


# -- the Triton repository --------------------------------------------------------------------


def test_fill_template_leaves_unknown_and_finds_unquoted():
    text = 'a: ${x}\nb: "${y}"\nc: ${z}  # ${w}\n'
    filled = trtllm.fill_template(text, {"x": "1"})
    assert filled.startswith("a: 1\n") and '"${y}"' in filled
    assert trtllm.unquoted_placeholders(filled) == ["z"]


def spec(**kw) -> trtllm.TritonRepoSpec:
    base = dict(target_engine="/engines/t/target", draft_engine="/engines/t/draft",
                tokenizer_dir="/engines/t/tokenizer", max_batch_size=4, max_seq_len=256,
                max_k=5)
    return trtllm.TritonRepoSpec(**{**base, **kw})


def test_ensemble_exposes_our_public_names():
    text = trtllm.ensemble_config(spec())
    ours = (ROOT / "triton_repo" / "ensemble" / "config.pbtxt").read_text()
    shared = ["text_input", "max_tokens", "stream", "temperature", "top_p", "random_seed",
              "num_draft_tokens", "end_id"]
    assert [n for n in tensor_names(ours, "input") if n in shared] == shared
    assert tensor_names(text, "input")[:len(shared)] == shared
    outputs = ["text_output", "acceptance_rate", "total_accepted_draft_tokens",
               "total_draft_tokens"]
    assert tensor_names(text, "output") == outputs
    assert set(outputs) <= set(tensor_names(ours, "output"))
    assert model_name(text) == "ensemble" and scalar(text, "platform") == '"ensemble"'
    inputs = ensemble_maps(text, "input_map")  # public name -> BLS name
    assert inputs["random_seed"] == "seed" and inputs["num_draft_tokens"] == "num_draft_tokens"
    assert set(inputs) == set(tensor_names(text, "input"))  # every public input is consumed
    assert set(inputs.values()) <= set(BLS_INPUTS)
    assert 'model_name: "tensorrt_llm_bls"' in text
    assert "num_draft_tokens <= 5" in text  # the draft limit, stated for clients


def test_repository_from_stock_templates(tmp_path, stock_src):
    repo = trtllm.write_triton_repo(spec(), stock_src / trtllm.STOCK_MODELS_DIR,
                                    tmp_path / "repo")
    names = {p.name for p in repo.iterdir()}
    assert names == {"ensemble", "preprocessing", "postprocessing", "tensorrt_llm",
                     "tensorrt_llm_draft", "tensorrt_llm_bls"}
    configs = {n: (repo / n / "config.pbtxt").read_text() for n in names}
    for n, text in configs.items():
        assert model_name(text) == n
        assert trtllm.unquoted_placeholders(text) == [], n
    target, draft = configs["tensorrt_llm"], configs["tensorrt_llm_draft"]
    assert parameters(target)["gpt_model_path"] == "/engines/t/target"
    assert parameters(draft)["gpt_model_path"] == "/engines/t/draft"
    assert parameters(target)["gpu_device_ids"] == parameters(draft)["gpu_device_ids"] == "0"
    for text in (target, draft):
        p = parameters(text)
        assert scalar(text, "max_batch_size") == "4"
        assert p["max_attention_window_size"] == "256"
        assert p["max_tokens_in_paged_kv_cache"] == str(4 * 256)
        assert p["enable_kv_cache_reuse"] == "True"
        assert p["gpt_model_type"] == "inflight_fused_batching"
        assert p["encoder_model_path"] == "${encoder_engine_dir}"  # unset, as the stock does
        assert scalar(text, "backend") == '"tensorrtllm"'
        assert "decoupled: False" in text
    bls = configs["tensorrt_llm_bls"]
    assert parameters(bls)["tensorrt_llm_model_name"] == "tensorrt_llm"
    assert parameters(bls)["tensorrt_llm_draft_model_name"] == "tensorrt_llm_draft"
    assert scalar(bls, "max_batch_size") == "1"  # the speculative path is batch 1
    assert "count: 4 " in bls  # one BLS instance per request the engines batch
    for n in ("preprocessing", "postprocessing"):
        assert parameters(configs[n])["tokenizer_dir"] == "/engines/t/tokenizer"
    assert (repo / "tensorrt_llm_draft" / "1" / "model.py").is_file()
    bls_model = repo / "tensorrt_llm_bls" / "1" / "model.py"
    assert bls_model.read_text() == "# stock tensorrt_llm_bls\n"
    assert (repo / "ensemble" / "1").is_dir()


def test_repository_refuses_a_template_it_cannot_fill(tmp_path, stock_src):
    stock = stock_src / trtllm.STOCK_MODELS_DIR
    cfg = stock / "preprocessing" / "config.pbtxt"
    good = cfg.read_text()
    cfg.write_text(good + "dynamic_batching { preferred_batch_size: ${newer_knob} }\n")
    with pytest.raises(ValueError, match="newer_knob"):
        trtllm.write_triton_repo(spec(), stock, tmp_path / "repo")
    assert not (tmp_path / "repo").exists()  # nothing half-written
    cfg.write_text(good)
    shutil.rmtree(stock / "tensorrt_llm_bls")
    with pytest.raises(FileNotFoundError, match="tensorrt_llm_bls"):
        trtllm.write_triton_repo(spec(), stock, tmp_path / "repo")


def test_launch_command():
    argv, env = trtllm.launch_command(Path("/engines/t/triton_repo"))
    assert argv[:4] == ["mpirun", "--allow-run-as-root", "-n", "1"]
    assert "--model-repository=/engines/t/triton_repo" in argv
    assert "--grpc-port=8001" in argv  # the BLS reads model configs from localhost:8001
    assert env == {"TRTLLM_ORCHESTRATOR": "1", "TRTLLM_ORCHESTRATOR_SPAWN_PROCESSES": "1"}


# -- the whole build with a stand-in runner ------------------------------------------------------


def fake_runner(calls: list):
    """Plays convert + trtllm-build: config.json + rank<r>.engine for each of the tp × pp ranks
    the checkpoint was converted for."""

    def run(steps, log_dir):
        calls.append([s.name for s in steps])
        ranks = {}  # checkpoint dir -> tp × pp
        for s in steps:
            if s.argv[0] != "trtllm-build":
                ranks[flag(s.argv, "--output_dir")] = (int(flag(s.argv, "--tp_size"))
                                                       * int(flag(s.argv, "--pp_size")))
                continue
            out = Path(flag(s.argv, "--output_dir"))
            out.mkdir(parents=True)
            (out / "config.json").write_text('{"built_by": "fake"}')
            for r in range(ranks[flag(s.argv, "--checkpoint_dir")]):
                (out / f"rank{r}.engine").write_bytes(b"\0engine%d" % r)
    return run


def test_build_writes_repository_script_and_manifest(tmp_path, stock_src):
    calls: list = []
    j = job(tmp_path, use_draft_logits=True)
    manifest = trtllm.build_trtllm(j, RuleParams("exact"),
                                   serve_root=Path("/engines/trtllm"),
                                   runner=fake_runner(calls))
    assert calls == [["convert verifier", "convert draft", "trtllm-build verifier",
                      "trtllm-build draft"]]
    m = read_manifest(j.out)  # checksums of the engines and the tokenizer verify
    assert m == manifest and m["backend"] == "trtllm"
    assert m["limits"] == {"max_batch_size": 4, "max_k": 5, "max_seq_len": 256,
                           "max_input_len": 255}
    assert set(m["checksums"]) == {"tokenizer.json",
                                   "trtllm/engines/verifier/rank0.engine",
                                   "trtllm/engines/verifier/config.json",
                                   "trtllm/engines/draft/rank0.engine",
                                   "trtllm/engines/draft/config.json"}
    assert m["rule_defaults"]["rule"] == "exact"
    t = m["trtllm"]
    assert t["image"] == trtllm.IMAGE and t["max_draft_len"] == 5 and t["use_draft_logits"]
    target_argv = t["steps"][2]["argv"]
    assert flag(target_argv, "--speculative_decoding_mode") == "draft_tokens_external"
    assert m["models"]["draft"]["config"]["vocab_size"] == m["vocab_size"]
    # the configs point where the dir will be mounted, not where it was built
    target = (j.out / "triton_repo" / "tensorrt_llm" / "config.pbtxt").read_text()
    assert parameters(target)["gpt_model_path"] == "/engines/trtllm/trtllm/engines/verifier"
    pre = (j.out / "triton_repo" / "preprocessing" / "config.pbtxt").read_text()
    assert parameters(pre)["tokenizer_dir"] == "/engines/trtllm/tokenizer"
    assert (j.out / "tokenizer" / "tokenizer_config.json").is_file()
    script = j.out / "serve_trtllm.sh"
    assert "--model-repository=/engines/trtllm/triton_repo" in script.read_text()
    subprocess.run(["bash", "-n", str(script)], check=True)


def test_build_checks_the_templates_before_the_long_build(tmp_path, stock_src):
    cfg = stock_src / trtllm.STOCK_MODELS_DIR / "tensorrt_llm" / "config.pbtxt"
    cfg.write_text(cfg.read_text() + "optimization { knob: ${unknown_knob} }\n")
    calls: list = []
    with pytest.raises(ValueError, match="unknown_knob"):
        trtllm.build_trtllm(job(tmp_path), runner=fake_runner(calls))
    assert calls == []


def test_build_refuses_a_draft_with_another_vocabulary(tmp_path, stock_src):
    odd = tmp_path / "odd_draft"
    shutil.copytree(DEMO / "draft", odd, ignore=shutil.ignore_patterns("*.safetensors"))
    cfg = (odd / "config.json").read_text()
    (odd / "config.json").write_text(re.sub(r'"vocab_size": \d+', '"vocab_size": 100', cfg))
    with pytest.raises(ValueError, match="vocab_size 100"):
        trtllm.build_trtllm(job(tmp_path, draft=odd), runner=fake_runner([]))


STUB_BLS = """\
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            seen = {n: pb_utils.get_input_tensor_by_name(r, n)
                    for n in ("seed", "num_draft_tokens", "stream", "use_draft_logits")}
            text = repr({k: None if v is None else v.as_numpy().reshape(-1).tolist()
                         for k, v in seen.items()})
            out.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("text_output", np.array([[text.encode()]], dtype=object)),
                pb_utils.Tensor("acceptance_rate", np.array([[0.5]], dtype=np.float32)),
                pb_utils.Tensor("total_accepted_draft_tokens", np.array([[3]], dtype=np.int32)),
                pb_utils.Tensor("total_draft_tokens", np.array([[6]], dtype=np.int32))]))
        return out
"""


def test_ensemble_loads_in_tritonserver_and_maps_our_names(tmp_path):
    """The generated ensemble in a real (CPU) tritonserver, in front of a stub BLS that has the
    stock BLS's tensor declarations: the config is accepted and random_seed arrives as seed."""
    import time

    import numpy as np

    from paradraft.runtime.serving import server

    grpc = pytest.importorskip("tritonclient.grpc")
    try:
        server_bin = server.find_tritonserver()
    except FileNotFoundError:
        pytest.skip("no tritonserver (make serve-deps)")
    repo = tmp_path / "repo"
    s = spec()
    bls = trtllm.fill_template(BLS_TEMPLATE, trtllm.stock_values(s)["tensorrt_llm_bls"])
    (repo / "tensorrt_llm_bls" / "1").mkdir(parents=True)
    (repo / "tensorrt_llm_bls" / "config.pbtxt").write_text(bls)
    (repo / "tensorrt_llm_bls" / "1" / "model.py").write_text(STUB_BLS)
    (repo / "ensemble" / "1").mkdir(parents=True)
    (repo / "ensemble" / "config.pbtxt").write_text(trtllm.ensemble_config(s))
    from paradraft.cli.serve import free_port

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
                if client.is_model_ready("ensemble"):
                    break
            except Exception:  # not listening yet
                pass
            time.sleep(0.5)
        assert client.is_model_ready("ensemble"), (tmp_path / "log.txt").read_text()[-3000:]

        def tensor(name, value, dtype, np_dtype):
            t = grpc.InferInput(name, [1, 1], dtype)
            t.set_data_from_numpy(np.array([[value]], dtype=np_dtype))
            return t

        r = client.infer("ensemble", [
            tensor("text_input", b"def f(x):", "BYTES", np.object_),
            tensor("max_tokens", 8, "INT32", np.int32), tensor("stream", False, "BOOL", np.bool_),
            tensor("random_seed", 7, "UINT64", np.uint64),
            tensor("num_draft_tokens", 4, "INT32", np.int32),
            tensor("use_draft_logits", True, "BOOL", np.bool_)])
        seen = r.as_numpy("text_output").reshape(-1)[0].decode()
        assert seen == repr({"seed": [7], "num_draft_tokens": [4], "stream": [False],
                             "use_draft_logits": [True]})
        assert r.as_numpy("total_draft_tokens").reshape(-1)[0] == 6
    finally:
        proc.terminate()
        proc.wait(60)


# -- the GPU check script and the GPU image ---------------------------------------------------


def test_gpu_check_script_is_valid_bash():
    script = ROOT / "scripts" / "gpu_check.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    if shutil.which("shellcheck"):
        subprocess.run(["shellcheck", str(script)], check=True)


def test_dockerfile_base_is_a_pinned_trtllm_tritonserver_tag():
    text = (ROOT / "Dockerfile").read_text()
    froms = re.findall(r"^FROM\s+(\S+)\s+AS\s+(\S+)", text, re.M)
    assert [stage for _, stage in froms] == ["trtllm", "default"]  # default: the last stage
    from paradraft.build import trtllm as llmapi

    assert froms[0][0] == llmapi.IMAGE  # TensorRT-LLM >= 1.3 for `build --backend trtllm`
    assert f"ARG TRTLLM_LLMAPI_REF={llmapi.TRTLLM_REF}" in text
    image = froms[1][0]  # the legacy engine path's image
    m = re.fullmatch(r"nvcr\.io/nvidia/tritonserver:(\d{2})\.(\d{2})-trtllm-python-py3", image)
    assert m, f"{image} is not a pinned nvcr.io tritonserver trtllm tag"
    assert "latest" not in image
    assert image == trtllm.IMAGE  # the build records the image its engines belong to
    assert f"ARG TRTLLM_REF={trtllm.TRTLLM_REF}" in text
    assert 'CMD ["paradraft", "serve", "--engines", "/engines", "--host", "0.0.0.0"]' in text
