"""``paradraft build --backend trtllm --trtllm-engine-legacy``: the LEGACY TensorRT-LLM engine
path, for TensorRT-LLM <= 1.2.1 only. TensorRT-LLM engines for the verifier (target) and the
draft, a Triton model repository for TensorRT-LLM's C++ Triton backend, and manifest.json.

TensorRT-LLM removed this workflow in v1.3.0rc21 (``trtllm-build``, ``convert_checkpoint.py``,
``TrtLlmArgs`` and the ``inflight_batcher_llm`` Triton backend are gone; PyTorch is its only
backend): build/trtllm.py writes the deployment for current releases and is the default. This
path stays valid only in containers that ship TensorRT-LLM <= 1.2.1, such as the Dockerfile's
default stage (IMAGE below: Triton 25.12 with TensorRT-LLM 1.1.0).

The TensorRT engine workflow of TensorRT-LLM's draft-target example
(examples/draft_target_model/README.md): each HF checkpoint is converted with the model
family's ``convert_checkpoint.py``, then ``trtllm-build`` compiles it; the target is built with
``--speculative_decoding_mode draft_tokens_external --max_draft_len K`` so it verifies K
external draft tokens in one step. Serving is TensorRT-LLM's ``tensorrt_llm_bls`` model, which
runs draft → target rounds over two ``tensorrtllm``-backend models, behind an ensemble that
exposes the same public tensor names as our own deployment (triton_repo/ensemble).

Everything the build runs is assembled by pure functions (argv lists, config text, dicts) so
it is tested on machines without TensorRT-LLM; only ``run_steps`` executes anything, after
``require_tools`` has named what is missing.

What TensorRT-LLM does not offer, stated here rather than hidden:
- Only two of our correction rules exist there: token match (our ``greedy``) and logits-based
  rejection sampling (our ``exact``, ``use_draft_logits``). The build refuses the others.
- Its BLS speculative path is batch 1 per request and refuses ``stream`` (lib/decode.py:
  "streaming is not supported with speculative decoding"); concurrency comes from BLS
  instances (one per in-flight request) and in-flight batching inside the engines.
- PARD (parallel draft) exists only in the LLM API / PyTorch backend (``PARDDecodingConfig``,
  NVIDIA/TensorRT-LLM PR #11438); there is no PARD engine path, so this build refuses a
  parallel draft (the default path writes a PARD deployment).
- Parallel engines: tensor parallelism only. The verifier takes ``tp_size`` (the draft its own
  ``draft_tp_size``, default 1); ``pp_size`` > 1 is refused, because TensorRT-LLM runs no
  draft model under pipeline parallelism: its draft-target example lists Tensor Parallel as the
  only parallel mode (examples/draft_target_model/README.md, "Support Matrix"), its Triton
  launcher's --world_size reads "only support tensor parallelism now", and the LLM API's PyTorch
  executor raises "Drafting is not supported for selected executor loop. Please disable
  disagg/pipeline parallelism scheduler." (tensorrt_llm/_torch/pyexecutor/py_executor.py;
  NVIDIA/TensorRT-LLM issue #9009, still open at 1.2.0rc2).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from paradraft.runtime.backends.manifest import package_versions, write_manifest
from paradraft.runtime.correction import RuleParams
from paradraft.runtime.model import ModelConfig, load_config
from paradraft.runtime.serving.server import fill_template, unquoted_placeholders

# The Dockerfile's base image and the TensorRT-LLM release inside it (NVIDIA's Triton
# compatibility matrix: 25.12 = TensorRT-LLM 1.1.0, TensorRT 10.13.3.9, Python 3.12). The
# convert scripts and Triton model templates must come from that same release.
IMAGE = "nvcr.io/nvidia/tritonserver:25.12-trtllm-python-py3"
TRTLLM_REF = "v1.1.0"
LAST_RELEASE = "1.2.1"  # the newest TensorRT-LLM with this path (tensorrtllm_backend's pin)
DEFAULT_SRC = Path(os.environ.get("PARADRAFT_TRTLLM_SRC", "/opt/tensorrt_llm_src"))

# convert_checkpoint.py per model family (paths in the TensorRT-LLM repo since 0.19;
# mistral checkpoints go through the llama converter)
CONVERT_SCRIPTS = {
    "llama": "examples/models/core/llama/convert_checkpoint.py",
    "mistral": "examples/models/core/llama/convert_checkpoint.py",
    "qwen2": "examples/models/core/qwen/convert_checkpoint.py",
    "gpt2": "examples/models/core/gpt/convert_checkpoint.py",
}
STOCK_MODELS_DIR = "triton_backend/all_models/inflight_batcher_llm"
STOCK_MODELS = ("preprocessing", "postprocessing", "tensorrt_llm", "tensorrt_llm_bls")
# our model name -> the stock model it is made from (the draft is a second tensorrt_llm)
STOCK_COPIES = {name: name for name in STOCK_MODELS} | {"tensorrt_llm_draft": "tensorrt_llm"}
DTYPES = ("float16", "bfloat16", "float32")
# our rule -> TensorRT-LLM's acceptance: use_draft_logits False = token match, True = logits
RULE_TO_DRAFT_LOGITS = {"greedy": False, "exact": True}
# The BLS reads the target/draft configs over gRPC at localhost:8001 (tensorrt_llm_bls
# model.py: model_config_api_baseurl), so this deployment's gRPC port is fixed.
GRPC_PORT = 8001


@dataclass(frozen=True)
class TrtllmJob:
    """One build: the two checkpoints, where everything goes, and the engine limits."""

    verifier: Path
    draft: Path
    out: Path
    verifier_type: str = "llama"
    draft_type: str = "llama"
    dtype: str = "float16"
    max_batch_size: int = 8
    max_k: int = 8
    max_seq_len: int = 512
    use_draft_logits: bool = False
    src: Path = DEFAULT_SRC
    python: str = "python3"
    # tensor / pipeline parallel ranks of the verifier; the draft is small and stays on
    # draft_tp_size ranks (default 1) sharing the verifier's first GPUs
    tp_size: int = 1
    pp_size: int = 1
    draft_tp_size: int = 1

    @property
    def world_size(self) -> int:
        """Ranks of the verifier engine (one GPU each)."""
        return self.tp_size * self.pp_size

    @property
    def gpus_needed(self) -> int:
        # the draft runs on the verifier's first draft_tp_size GPUs (TensorRT-LLM's
        # draft-target guide: sharing a GPU beats a GPU of its own when memory allows)
        return max(self.world_size, self.draft_tp_size)

    def parallel(self, role: str) -> tuple[int, int]:
        """(tp, pp) of one engine."""
        return (self.tp_size, self.pp_size) if role == "verifier" else (self.draft_tp_size, 1)

    def gpu_device_ids(self, role: str) -> str:
        """The ``gpu_device_ids`` of its Triton model: one GPU per rank, from GPU 0."""
        tp, pp = self.parallel(role)
        return ",".join(str(i) for i in range(tp * pp))

    @property
    def max_input_len(self) -> int:
        return self.max_seq_len - 1  # at least one generated token

    @property
    def kv_cache_reuse(self) -> bool:
        # Draft and target see the same growing prefix every round, so KV block reuse is what
        # makes the BLS loop affordable; it needs paged context FMHA, whose kernels TensorRT-LLM
        # has for fp16/bf16 only.
        return self.dtype != "float32"

    def ckpt_dir(self, role: str) -> Path:
        return self.out / "trtllm" / "checkpoints" / role

    def engine_dir(self, role: str) -> Path:
        return self.out / "trtllm" / "engines" / role


@dataclass(frozen=True)
class Step:
    name: str
    argv: list[str] = field(default_factory=list)


# -- checks (pure) -------------------------------------------------------------------------


def draft_logits_for_rule(rule: str) -> bool:
    if rule not in RULE_TO_DRAFT_LOGITS:
        raise ValueError(f"rule {rule!r} has no TensorRT-LLM equivalent; the trtllm backend "
                         f"supports {', '.join(RULE_TO_DRAFT_LOGITS)} (token match / logits)")
    return RULE_TO_DRAFT_LOGITS[rule]


def check_job(job: TrtllmJob) -> None:
    for label, value, low in [("max_batch_size", job.max_batch_size, 1),
                              ("max_k", job.max_k, 1), ("max_seq_len", job.max_seq_len, 2),
                              ("--tp-size", job.tp_size, 1), ("--pp-size", job.pp_size, 1),
                              ("--draft-tp-size", job.draft_tp_size, 1)]:
        if not isinstance(value, int) or value < low:
            raise ValueError(f"{label} must be an integer >= {low}; got {value!r}")
    if job.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {job.dtype!r}")
    for label, model_type in [("verifier", job.verifier_type), ("draft", job.draft_type)]:
        if model_type not in CONVERT_SCRIPTS:
            raise ValueError(f"{label} model_type {model_type!r} has no TensorRT-LLM converter "
                             f"here; supported: {', '.join(CONVERT_SCRIPTS)}")
    check_pipeline(job)


def check_pair(verifier: ModelConfig, draft: ModelConfig, draft_dir: Path) -> None:
    """Draft tokens are fed to the target as ids: the vocabularies must be the same."""
    if draft.vocab_size != verifier.vocab_size:
        raise ValueError(f"draft {draft_dir}: vocab_size {draft.vocab_size} differs from the "
                         f"verifier's {verifier.vocab_size}")


def check_pipeline(job: TrtllmJob) -> None:
    """Refuse pipeline parallelism: every engine this build makes serves a draft model."""
    if job.pp_size != 1:
        raise ValueError(
            f"--pp-size {job.pp_size}: TensorRT-LLM does not run a draft model (speculative "
            "decoding) with pipeline parallelism: its draft-target path supports tensor "
            "parallelism only and the LLM API refuses drafting with pipeline_parallel_size > 1. "
            f"Valid: --pp-size 1; spread the verifier with --tp-size instead")


def check_heads(flag: str, tp: int, role: str, config: ModelConfig) -> str | None:
    """``tp`` must split the attention heads evenly; KV heads split evenly or, when tp is a
    multiple of them, are replicated (TensorRT-LLM's converters call dup_kv_weight, which
    asserts tp_size % num_kv_heads == 0). Returns a note when KV heads are replicated."""
    heads, kv = config.n_heads, config.n_kv_heads
    valid = ", ".join(str(d) for d in range(1, heads + 1)
                      if heads % d == 0 and (kv % d == 0 or d % kv == 0))
    if heads % tp:
        raise ValueError(f"{flag} {tp}: must divide the {role}'s num_attention_heads {heads}; "
                         f"valid: {valid}")
    if kv % tp == 0:
        return None
    if tp % kv == 0:
        return (f"{flag} {tp} > the {role}'s num_key_value_heads {kv}: TensorRT-LLM replicates "
                f"each KV head on {tp // kv} ranks, so the KV cache per GPU holds one head and "
                "shrinks no further")
    raise ValueError(f"{flag} {tp}: must divide the {role}'s num_key_value_heads {kv} or be a "
                     f"multiple of it (TensorRT-LLM then replicates KV heads); valid: {valid}")


def check_parallel(job: TrtllmJob, verifier: ModelConfig, draft: ModelConfig) -> list[str]:
    """The tensor-parallel sizes against the two models' heads; returns notes."""
    notes = [check_heads("--tp-size", job.tp_size, "verifier", verifier),
             check_heads("--draft-tp-size", job.draft_tp_size, "draft", draft)]
    return [n for n in notes if n]


def detect_gpu_count() -> int | None:
    """GPUs that ``nvidia-smi -L`` lists (as TensorRT-LLM's launch_triton_server.py counts
    them); None where there is no nvidia-smi or it fails (a CPU machine). Nothing is imported:
    torch would report 0 on a CPU build machine, which is unknown rather than none."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    count = sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
    return count or None  # a driver without a GPU: nothing to check against


def check_world_size(job: TrtllmJob, gpus: int | None, source: str = "--gpus") -> str:
    """tp × pp (and the draft's tp) against the GPUs the server will have. ``gpus`` None
    (unknown: a CPU build machine, no --gpus) skips the check and says so."""
    need = job.gpus_needed
    layout = (f"--tp-size {job.tp_size} × --pp-size {job.pp_size} = {job.world_size} ranks "
              f"(--draft-tp-size {job.draft_tp_size})")
    if gpus is None:
        return (f"GPU count unknown (no --gpus, no nvidia-smi): skipped checking {layout} "
                f"against the GPUs; the server needs {need} GPU(s)")
    if not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"--gpus must be an integer >= 1; got {gpus!r}")
    if need > gpus:
        raise ValueError(f"{layout} need {need} GPU(s) but {source} gives {gpus}; valid: "
                         f"--tp-size × --pp-size <= {gpus} and --draft-tp-size <= {gpus}")
    return f"{layout}: {need} of {gpus} GPU(s) ({source})"


# -- command assembly (pure) ---------------------------------------------------------------


def convert_argv(job: TrtllmJob, role: str) -> list[str]:
    model_dir, model_type = ((job.verifier, job.verifier_type) if role == "verifier"
                             else (job.draft, job.draft_type))
    tp, pp = job.parallel(role)
    # the checkpoint carries the mapping: trtllm-build then writes one engine per rank
    return [job.python, str(job.src / CONVERT_SCRIPTS[model_type]),
            "--model_dir", str(model_dir), "--output_dir", str(job.ckpt_dir(role)),
            "--dtype", job.dtype, "--tp_size", str(tp), "--pp_size", str(pp)]


def trtllm_build_argv(job: TrtllmJob, role: str) -> list[str]:
    argv = ["trtllm-build", "--checkpoint_dir", str(job.ckpt_dir(role)),
            "--output_dir", str(job.engine_dir(role)),
            "--gemm_plugin", job.dtype,
            "--max_batch_size", str(job.max_batch_size),
            "--max_input_len", str(job.max_input_len),
            "--max_seq_len", str(job.max_seq_len)]
    if job.kv_cache_reuse:
        argv += ["--use_paged_context_fmha", "enable"]
    if role == "verifier":
        # the target scores K external draft tokens (+1) per generation step
        argv += ["--speculative_decoding_mode", "draft_tokens_external",
                 "--max_draft_len", str(job.max_k)]
    if job.use_draft_logits:
        # logits-based acceptance: the draft returns its generation logits and the target
        # compares them with its own, so both engines must keep them
        argv += ["--gather_generation_logits"]
    return argv


def build_steps(job: TrtllmJob) -> list[Step]:
    return [Step("convert verifier", convert_argv(job, "verifier")),
            Step("convert draft", convert_argv(job, "draft")),
            Step("trtllm-build verifier", trtllm_build_argv(job, "verifier")),
            Step("trtllm-build draft", trtllm_build_argv(job, "draft"))]


# -- tools and the runner --------------------------------------------------------------------


def engine_era(version_text: str) -> bool:
    """Whether a TensorRT-LLM version still has the engine backend (major.minor <= 1.2)."""
    major, minor = (int(x) for x in version_text.split(".")[:2])
    return (major, minor) <= (1, 2)


def missing_tools(job: TrtllmJob) -> list[str]:
    missing = []
    if importlib.util.find_spec("tensorrt_llm") is None:
        missing.append("the tensorrt_llm Python package")
    else:
        found = package_versions(("tensorrt_llm",))["tensorrt_llm"]
        if found != "not installed" and not engine_era(found):
            missing.append(f"TensorRT-LLM <= {LAST_RELEASE} (found {found}, which has no engine "
                           "backend: build without --trtllm-engine-legacy)")
    if shutil.which("trtllm-build") is None:
        missing.append("the trtllm-build command")
    scripts = {CONVERT_SCRIPTS[job.verifier_type], CONVERT_SCRIPTS[job.draft_type]}
    files = [rel for rel in [*sorted(scripts), *(f"{STOCK_MODELS_DIR}/{m}" for m in STOCK_MODELS)]
             if not (job.src / rel).exists()]
    if files:
        missing.append(f"{', '.join(files)} from a TensorRT-LLM {TRTLLM_REF} checkout in "
                       f"{job.src} (set PARADRAFT_TRTLLM_SRC)")
    return missing


def require_tools(job: TrtllmJob) -> None:
    missing = missing_tools(job)
    if missing:
        raise RuntimeError("paradraft build --backend trtllm needs " + "; ".join(missing)
                           + f". Run it inside {IMAGE} (docs/gpu.md); TensorRT-LLM cannot be "
                           "installed on a machine without an NVIDIA GPU stack")


def run_steps(steps: list[Step], log_dir: Path) -> None:
    """Run each step, its output in log_dir/<n>.log; stop at the first failure, naming it."""
    log_dir.mkdir(parents=True, exist_ok=True)
    for i, step in enumerate(steps):
        log = log_dir / f"{i}_{step.name.replace(' ', '_')}.log"
        with open(log, "w") as f:
            f.write(shlex.join(step.argv) + "\n")
            f.flush()
            code = subprocess.run(step.argv, stdout=f, stderr=subprocess.STDOUT).returncode
        if code != 0:
            raise RuntimeError(f"{step.name} failed (exit {code}); log {log}; command: "
                               f"{shlex.join(step.argv)}")


# -- the Triton model repository -------------------------------------------------------------

# (public name, tensorrt_llm_bls name, data type, optional) of the ensemble inputs. The names
# are our own ensemble's (triton_repo/ensemble); random_seed is TensorRT-LLM's `seed`.
# correction_rule and its parameters have no TensorRT-LLM counterpart; use_draft_logits and
# return_perf_metrics are TensorRT-LLM's own (an ensemble cannot inject constants, so the
# client sends them).
PUBLIC_INPUTS = [
    ("text_input", "text_input", "TYPE_STRING", False),
    ("max_tokens", "max_tokens", "TYPE_INT32", False),
    ("stream", "stream", "TYPE_BOOL", True),
    ("temperature", "temperature", "TYPE_FP32", True),
    ("top_p", "top_p", "TYPE_FP32", True),
    ("random_seed", "seed", "TYPE_UINT64", True),
    ("num_draft_tokens", "num_draft_tokens", "TYPE_INT32", True),
    ("end_id", "end_id", "TYPE_INT32", True),
    ("use_draft_logits", "use_draft_logits", "TYPE_BOOL", True),
    ("return_perf_metrics", "return_perf_metrics", "TYPE_BOOL", True),
]
# (name, data type, dims); the BLS's text_output is [-1] (one string per beam). Our ensemble's
# sequence_length has no BLS counterpart and is left out.
PUBLIC_OUTPUTS = [
    ("text_output", "TYPE_STRING", "-1"),
    ("acceptance_rate", "TYPE_FP32", "1"),
    ("total_accepted_draft_tokens", "TYPE_INT32", "1"),
    ("total_draft_tokens", "TYPE_INT32", "1"),
]


@dataclass(frozen=True)
class TritonRepoSpec:
    """The values the generated configs carry; paths as the server will see them."""

    target_engine: str
    draft_engine: str
    tokenizer_dir: str
    max_batch_size: int
    max_seq_len: int
    max_k: int
    kv_cache_reuse: bool = True
    # two engines share one GPU: each gets a fraction of the free memory for its KV cache
    kv_cache_free_gpu_mem_fraction: float = 0.4
    # one GPU per rank (TensorRT-LLM's gpu_device_ids: "Comma-separated list of GPU IDs")
    target_gpu_ids: str = "0"
    draft_gpu_ids: str = "0"

    @property
    def gpus(self) -> int:
        """GPUs the server uses (the models' device ids are 0..n-1)."""
        ids = {i for ids in (self.target_gpu_ids, self.draft_gpu_ids) for i in ids.split(",")}
        return len(ids)


def ensemble_config(spec: TritonRepoSpec) -> str:
    inputs = ",\n".join(
        f'  {{ name: "{name}", data_type: {dtype}, dims: [ 1 ]'
        + (", optional: true" if optional else "") + " }"
        for name, _, dtype, optional in PUBLIC_INPUTS)
    outputs = ",\n".join(f'  {{ name: "{name}", data_type: {dtype}, dims: [ {dims} ] }}'
                         for name, dtype, dims in PUBLIC_OUTPUTS)
    maps = "\n".join(f'      input_map {{ key: "{bls}" value: "{public}" }}'
                     for public, bls, _, _ in PUBLIC_INPUTS)
    maps += "\n" + "\n".join(f'      output_map {{ key: "{name}" value: "{name}" }}'
                             for name, _, _ in PUBLIC_OUTPUTS)
    return f"""\
# Generated by `paradraft build --backend trtllm`. Public names as in paradraft's own ensemble
# -> tensorrt_llm_bls (TensorRT-LLM's draft-target loop: tensorrt_llm_draft proposes up to
# num_draft_tokens <= {spec.max_k} tokens, tensorrt_llm verifies them) -> text_output.
# Send num_draft_tokens (no value = plain target decoding) and stream=false (the BLS reads it
# and refuses streaming with speculative decoding); use_draft_logits=true selects logits-based
# acceptance (our `exact`), return_perf_metrics=true asks for the acceptance counts.
name: "ensemble"
platform: "ensemble"
max_batch_size: 1
input [
{inputs}
]
output [
{outputs}
]
ensemble_scheduling {{
  step [
    {{
      model_name: "tensorrt_llm_bls"
      model_version: -1
{maps}
    }}
  ]
}}
"""


def stock_values(spec: TritonRepoSpec) -> dict[str, dict[str, str]]:
    """${placeholder} values for TensorRT-LLM's stock config templates, per model."""
    b = str(spec.max_batch_size)
    common = {"max_queue_delay_microseconds": "0", "max_queue_size": "0",
              "logits_datatype": "TYPE_FP32"}
    engine = {
        **common,
        "triton_backend": "tensorrtllm",
        "triton_max_batch_size": b,
        # the BLS calls draft and target with exec(decoupled=False) in the speculative path
        "decoupled_mode": "False",
        "max_beam_width": "1",
        "batching_strategy": "inflight_fused_batching",
        "batch_scheduler_policy": "guaranteed_no_evict",
        "max_tokens_in_paged_kv_cache": str(spec.max_batch_size * spec.max_seq_len),
        "max_attention_window_size": str(spec.max_seq_len),
        "kv_cache_free_gpu_mem_fraction": str(spec.kv_cache_free_gpu_mem_fraction),
        "enable_kv_cache_reuse": str(spec.kv_cache_reuse),
        "enable_chunked_context": "False",
        # text_output carries only the new text, as our own deployment's does (the BLS reads
        # this setting of both models to find the draft's new tokens in its output)
        "exclude_input_in_output": "True",
        "encoder_input_features_data_type": "TYPE_FP16",
        "prompt_embedding_table_data_type": "TYPE_FP16",
        "tokenizer_dir": spec.tokenizer_dir,
    }
    text = {**common, "triton_max_batch_size": b, "tokenizer_dir": spec.tokenizer_dir}
    return {
        "preprocessing": {**text, "preprocessing_instance_count": "1",
                          "add_special_tokens": "True"},
        "postprocessing": {**text, "postprocessing_instance_count": "1",
                           "skip_special_tokens": "True"},
        "tensorrt_llm": {**engine, "engine_dir": spec.target_engine,
                         "gpu_device_ids": spec.target_gpu_ids},
        "tensorrt_llm_draft": {**engine, "engine_dir": spec.draft_engine,
                               "gpu_device_ids": spec.draft_gpu_ids},
        # batch 1 per request (the speculative path refuses more); one instance per request
        # the engines can batch, so that many requests run their loops at once
        "tensorrt_llm_bls": {**common, "triton_max_batch_size": "1", "decoupled_mode": "False",
                             "bls_instance_count": b, "accumulate_tokens": "False",
                             "tensorrt_llm_model_name": "tensorrt_llm",
                             "tensorrt_llm_draft_model_name": "tensorrt_llm_draft"},
    }


def rename_model(text: str, old: str, new: str) -> str:
    line = f'name: "{old}"'
    if line not in text:
        raise ValueError(f"config has no {line!r} line to rename")
    return text.replace(line, f'name: "{new}"', 1)


def render_triton_repo(spec: TritonRepoSpec, stock_dir: Path) -> dict[str, str]:
    """{model: config.pbtxt text}: TensorRT-LLM's stock templates (same release as the
    engines) filled with our values, tensorrt_llm_draft, and our ensemble. Raises on a
    template it cannot fill, so a build finds out before it spends minutes on engines."""
    values = stock_values(spec)
    texts = {}
    for name, src in STOCK_COPIES.items():
        if not (stock_dir / src / "config.pbtxt").is_file():
            raise FileNotFoundError(f"missing {stock_dir / src / 'config.pbtxt'} (TensorRT-LLM "
                                    f"{TRTLLM_REF}'s {STOCK_MODELS_DIR})")
        text = fill_template((stock_dir / src / "config.pbtxt").read_text(), values[name])
        if name != src:
            text = rename_model(text, src, name)
        left = unquoted_placeholders(text)
        if left:
            raise ValueError(f"{stock_dir / src / 'config.pbtxt'}: no value for "
                             f"{', '.join(sorted(set(left)))} (template from another release?)")
        texts[name] = text
    texts["ensemble"] = ensemble_config(spec)
    return texts


def write_triton_repo(spec: TritonRepoSpec, stock_dir: Path, out: Path) -> Path:
    """The repository: the stock models' files (their model.py) with our filled configs."""
    texts = render_triton_repo(spec, stock_dir)
    for name, text in texts.items():
        if name in STOCK_COPIES:
            shutil.copytree(stock_dir / STOCK_COPIES[name], out / name, dirs_exist_ok=True)
        (out / name / "1").mkdir(parents=True, exist_ok=True)
        (out / name / "config.pbtxt").write_text(text)
    return out


def launch_command(repo: Path, gpus: int = 1) -> tuple[list[str], dict[str, str]]:
    """(argv, env) to serve the repository on ``gpus`` GPUs: what TensorRT-LLM's
    launch_triton_server.py --multi-model --world_size 1 runs. Two TensorRT-LLM models in one
    server need the orchestrator mode, and there mpirun starts one process whatever the
    engines' world size: launch_triton_server.py asserts "World size must be 1 when using
    multi-model without disable-spawn-processes"; the orchestrator spawns each model's tp × pp
    ranks itself on the GPUs of its gpu_device_ids."""
    if not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"gpus must be an integer >= 1; got {gpus!r}")
    # no CUDA memory pool on any GPU the spawned workers use (launch_triton_server.py adds
    # one --cuda-memory-pool-byte-size=<gpu>:0 per GPU in orchestrator mode)
    pools = [f"--cuda-memory-pool-byte-size={g}:0" for g in range(gpus)]
    argv = ["mpirun", "--allow-run-as-root", "-n", "1", "/opt/tritonserver/bin/tritonserver",
            f"--model-repository={repo}", f"--grpc-port={GRPC_PORT}", "--http-port=8000",
            "--metrics-port=8002", "--pinned-memory-pool-byte-size=0",
            "--enable-peer-access=false", *pools,
            "--disable-auto-complete-config",
            "--backend-config=python,shm-region-prefix-name=prefix0_"]
    env = {"TRTLLM_ORCHESTRATOR": "1", "TRTLLM_ORCHESTRATOR_SPAWN_PROCESSES": "1"}
    return argv, env


def launch_script(repo: Path, spec: TritonRepoSpec | None = None) -> str:
    gpus = spec.gpus if spec is not None else 1
    argv, env = launch_command(repo, gpus)
    exports = "\n".join(f"export {k}={shlex.quote(v)}" for k, v in env.items())
    layout = ""
    if spec is not None:
        layout = (f"# GPUs: tensorrt_llm (verifier) on {spec.target_gpu_ids}, "
                  f"tensorrt_llm_draft on {spec.draft_gpu_ids}; the orchestrator spawns one "
                  "worker per rank\n")
    return (f"#!/usr/bin/env bash\n# Generated by `paradraft build --backend trtllm`: serve "
            f"{repo} in {IMAGE}\n{layout}set -eu\n{exports}\nexec {shlex.join(argv)}\n")


# -- the build ----------------------------------------------------------------------------


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "config.json")


def copy_tokenizer(verifier: Path, out: Path) -> str | None:
    """tokenizer.json for our manifest, plus a HF tokenizer dir for the stock pre/post models
    (they load it with transformers.AutoTokenizer)."""
    dst = out / "tokenizer"
    dst.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (verifier / name).is_file():
            shutil.copyfile(verifier / name, dst / name)
    if not (verifier / "tokenizer.json").is_file():
        return None
    shutil.copyfile(verifier / "tokenizer.json", out / "tokenizer.json")
    return "tokenizer.json"


def engine_graphs(job: TrtllmJob, role: str) -> dict:
    """trtllm-build writes config.json + rank<r>.engine for each of the tp × pp ranks."""
    rel = job.engine_dir(role).relative_to(job.out)
    tp, pp = job.parallel(role)
    ranks = {("engine" if r == 0 else f"engine_rank{r}"): {"file": str(rel / f"rank{r}.engine")}
             for r in range(tp * pp)}
    return {**ranks, "engine_config": {"file": str(rel / "config.json")}}


def parallel_manifest(job: TrtllmJob, gpu_check: str, notes: list[str]) -> dict:
    """The ranks and GPUs of each engine, and what was checked, for manifest.json."""
    roles = {}
    for role in ("verifier", "draft"):
        tp, pp = job.parallel(role)
        roles[role] = {"tp_size": tp, "pp_size": pp, "gpu_device_ids": job.gpu_device_ids(role)}
    return {**roles, "gpus_needed": job.gpus_needed, "gpu_check": gpu_check, "notes": notes}


def plain(config: ModelConfig) -> dict:
    """A model config as manifest.json stores it (tuples become lists), so the manifest this
    build returns equals the one read back."""
    return json.loads(json.dumps(asdict(config)))


def build_trtllm(job: TrtllmJob, rule_defaults: RuleParams | None = None,
                 parallel_draft: Path | None = None, serve_root: Path | None = None,
                 runner: Callable[[list[Step], Path], None] | None = None,
                 gpus: int | None = None, gpus_source: str = "--gpus") -> dict:
    """Convert + build both engines, write the Triton repository and manifest.json; returns
    the manifest. ``serve_root``: where ``job.out`` will be mounted when served (default: its
    absolute path here). ``runner``: replaces ``run_steps`` (tests); without it the tools
    must be present. ``gpus``: GPUs of the serving machine, checked against the ranks (None:
    unknown, the check is skipped and the manifest says so)."""
    rule_defaults = rule_defaults or RuleParams("greedy")
    check_job(job)
    vc, dc = load_config(job.verifier), load_config(job.draft)
    check_pair(vc, dc, job.draft)
    notes = check_parallel(job, vc, dc)
    gpu_check = check_world_size(job, gpus, gpus_source)
    if parallel_draft is not None:
        raise ValueError(f"--parallel-draft {parallel_draft}: the legacy engine path has no PARD "
                         "(TensorRT-LLM has it in the PyTorch backend only); build without "
                         "--trtllm-engine-legacy for a PARD deployment")
    steps = build_steps(job)
    root = Path(serve_root) if serve_root is not None else job.out.resolve()
    spec = TritonRepoSpec(
        target_engine=str(root / job.engine_dir("verifier").relative_to(job.out)),
        draft_engine=str(root / job.engine_dir("draft").relative_to(job.out)),
        tokenizer_dir=str(root / "tokenizer"), max_batch_size=job.max_batch_size,
        max_seq_len=job.max_seq_len, max_k=job.max_k, kv_cache_reuse=job.kv_cache_reuse,
        target_gpu_ids=job.gpu_device_ids("verifier"), draft_gpu_ids=job.gpu_device_ids("draft"))
    if runner is None:
        require_tools(job)
        runner = run_steps
    render_triton_repo(spec, job.src / STOCK_MODELS_DIR)  # fail before the long build
    job.out.mkdir(parents=True, exist_ok=True)
    runner(steps, job.out / "trtllm" / "logs")

    tokenizer = copy_tokenizer(job.verifier, job.out)
    write_triton_repo(spec, job.src / STOCK_MODELS_DIR, job.out / "triton_repo")
    (job.out / "serve_trtllm.sh").write_text(launch_script(root / "triton_repo", spec))
    (job.out / "serve_trtllm.sh").chmod(0o755)

    manifest = {
        "backend": "trtllm",
        "dtype": job.dtype,
        "vocab_size": vc.vocab_size,
        "limits": {"max_batch_size": job.max_batch_size, "max_k": job.max_k,
                   "max_seq_len": job.max_seq_len, "max_input_len": job.max_input_len},
        "tokenizer": tokenizer,
        "rule_defaults": asdict(rule_defaults),
        "models": {
            "verifier": {"source": str(job.verifier), "config": plain(vc),
                         "graphs": engine_graphs(job, "verifier")},
            "draft": {"source": str(job.draft), "config": plain(dc),
                      "graphs": engine_graphs(job, "draft")},
        },
        "drafters": {"model": "draft"},
        "trtllm": {
            "image": IMAGE,
            "tensorrt_llm_ref": TRTLLM_REF,
            "speculative_decoding_mode": "draft_tokens_external",
            "max_draft_len": job.max_k,
            "use_draft_logits": job.use_draft_logits,
            "kv_cache_reuse": job.kv_cache_reuse,
            "parallel": parallel_manifest(job, gpu_check, notes),
            "steps": [asdict(s) for s in steps],
            "triton_repo": "triton_repo",
            "launch": "serve_trtllm.sh",
            "serve_root": str(root),
        },
        "versions": package_versions(("paradraft", "tensorrt_llm", "tensorrt", "torch")),
    }
    return write_manifest(job.out, manifest)
