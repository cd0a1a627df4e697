"""``paradraft build --backend trtllm``: a TensorRT-LLM deployment for TensorRT-LLM >= 1.3.

TensorRT-LLM removed its TensorRT engine backend in v1.3.0rc21: PyTorch is its only backend, and
HF checkpoints load directly (no ``convert_checkpoint.py``, no ``trtllm-build``). Speculation is
the LLM API's ``speculative_config``, a union discriminated by ``decoding_type``
(tensorrt_llm/llmapi/llm_args.py). This build writes, without TensorRT-LLM or a GPU:

- ``trtllm_serve.yaml``: the extra LLM API options of ``trtllm-serve MODEL --config FILE``, with
  ``speculative_config`` = ``Draft_Target`` (``--draft``), ``PARD`` (a parallel draft, with
  its ``mask_token_id``) or ``NGram`` (``--drafter ngram``), and our draft-length schedule and
  acceptance floor mapped to ``draft_len_schedule`` / ``acceptance_rate_*``;
- ``serve_trtllm.sh``: that exact ``trtllm-serve`` command line (OpenAI API on port 8000);
- ``triton_repo/tensorrt_llm``: a model of Triton's Python ``llmapi`` backend, decoupled
  (streaming): our ``config.pbtxt`` with the tensor names of TensorRT-LLM's, and ``1/model.yaml``
  (its top-level keys are the LLM() arguments, ``triton_config`` the Triton settings) with the
  same ``speculative_config``. ``1/model.py`` and ``1/helpers.py`` are TensorRT-LLM's: copied
  from a checkout of the matching release (``PARADRAFT_TRTLLM_SRC``) when the build finds one,
  else by ``serve_triton_llmapi.sh`` when the server starts. They are not part of paradraft;
- ``manifest.json``.

What TensorRT-LLM does not do, refused here by name rather than approximated: our lossy rules
(threshold, ratio, dynamic, typical) and the attention causal audit. Its acceptance is token
match, or rejection sampling (``use_rejection_sampling``, our ``exact``); it has no public hook
to change the rule (a ``User_Provided`` drafter only proposes tokens). Those rules run in
paradraft's own runtime, on a GPU over TensorRT plans with the CausalCorrection plugin
(``--backend tensorrt``). The TensorRT-LLM engine path of releases <= 1.2.1 is
``--trtllm-engine-legacy`` (build/trtllm_engine.py).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from paradraft.runtime.backends.manifest import package_versions, write_manifest
from paradraft.runtime.correction import RULES, RuleParams
from paradraft.runtime.model import load_config

from .trtllm_engine import check_heads, check_pair, plain
from .trtllm_fields import (
    LLM_ARGS_COMMIT,
    LLMAPI_INPUTS,
    LLMAPI_OUTPUTS,
    SPECULATIVE_CLASSES,
    unknown_fields,
)

# The GPU image's TensorRT-LLM release (the Dockerfile's `trtllm` stage; tag format of
# nvcr.io/nvidia/tensorrt-llm/release: the version without a leading v) and the first release
# without the TensorRT engine backend.
IMAGE = "nvcr.io/nvidia/tensorrt-llm/release:1.3.0rc24"
TRTLLM_REF = "v1.3.0rc24"
FIRST_RELEASE = "1.3.0rc21"
DEFAULT_SRC = Path(os.environ.get("PARADRAFT_TRTLLM_SRC", "/opt/tensorrt_llm_src"))
LLMAPI_MODEL_DIR = "triton_backend/all_models/llmapi/tensorrt_llm"
LLMAPI_FILES = ("model.py", "helpers.py")  # TensorRT-LLM's, copied next to model.yaml
SERVE_PORT = 8000  # trtllm-serve's OpenAI API
TRITON_PORTS = {"grpc": 8001, "http": 8000, "metrics": 8002}

# drafter -> decoding_type
DECODING_TYPES = {"model": "Draft_Target", "parallel": "PARD", "ngram": "NGram"}
LOSSY_RULES = ("threshold", "ratio", "dynamic", "typical")
DTYPES = ("auto", "float16", "bfloat16", "float32")


@dataclass(frozen=True)
class LlmApiJob:
    """One deployment: the checkpoints (paths as the server sees them), the drafter, limits."""

    verifier: Path
    out: Path
    drafter: str = "model"
    draft: Path | None = None  # the draft model (model) or the PARD draft (parallel)
    rule: str = "greedy"
    dtype: str = "auto"
    max_batch_size: int = 8
    max_k: int = 8
    max_seq_len: int = 512
    tp_size: int = 1
    ngram_max: int = 3  # NGram's max_matching_ngram_size
    # paradraft's form: {from this many running requests: K}; None: K = max_k always
    draft_len_schedule: dict[int, int] | None = None
    acceptance_floor: float | None = None
    acceptance_window: int = 32
    src: Path = DEFAULT_SRC

    @property
    def decoding_type(self) -> str:
        return DECODING_TYPES[self.drafter]


# -- checks (pure) -------------------------------------------------------------------------


def check_rule(rule: str, drafter: str) -> None:
    """Only TensorRT-LLM's own acceptance exists there; name what is refused and why."""
    if rule in LOSSY_RULES:
        raise ValueError(
            f"--rule {rule}: TensorRT-LLM has no such acceptance rule and no hook to add one; "
            f"our lossy rules ({', '.join(LOSSY_RULES)}) and the attention causal audit run "
            "only in paradraft's own runtime (on a GPU: --backend tensorrt, TensorRT plans "
            "with the CausalCorrection plugin). With --backend trtllm use --rule greedy (token "
            "match) or --rule exact (rejection sampling)")
    if rule not in RULES:
        raise ValueError(f"--rule must be one of {', '.join(RULES)}; got {rule!r}")
    if rule == "exact" and drafter == "ngram":
        raise ValueError("--rule exact with --drafter ngram: TensorRT-LLM's rejection sampling "
                         "runs on the one-model paths (Draft_Target, PARD), and an n-gram has "
                         "no draft distribution; use --rule greedy (token match)")


def check_job(job: LlmApiJob) -> None:
    for label, value, low in [("--max-batch-size", job.max_batch_size, 1),
                              ("--max-k", job.max_k, 1), ("--max-seq-len", job.max_seq_len, 2),
                              ("--tp-size", job.tp_size, 1), ("--ngram-max", job.ngram_max, 1),
                              ("--acceptance-window", job.acceptance_window, 1)]:
        if not isinstance(value, int) or value < low:
            raise ValueError(f"{label} must be an integer >= {low}; got {value!r}")
    if job.drafter not in DECODING_TYPES:
        raise ValueError(f"--drafter must be one of {', '.join(DECODING_TYPES)} with --backend "
                         f"trtllm; got {job.drafter!r}")
    if job.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {job.dtype!r}")
    if job.drafter == "ngram" and job.draft is not None:
        raise ValueError(f"--drafter ngram drafts from the prompt and output; a draft model "
                         f"({job.draft}) has no use there: leave out --draft/--parallel-draft")
    if job.drafter != "ngram" and job.draft is None:
        raise ValueError(f"--drafter {job.drafter} needs its draft checkpoint (--draft, or "
                         "--parallel-draft for parallel)")
    floor = job.acceptance_floor
    if floor is not None and not (isinstance(floor, (int, float)) and 0 <= floor <= 1):
        raise ValueError(f"--acceptance-floor must be in [0, 1]; got {floor!r}")
    check_rule(job.rule, job.drafter)
    if job.draft_len_schedule is not None:
        trtllm_schedule(job.draft_len_schedule, job.max_k, job.max_batch_size)


def trtllm_schedule(ours: dict[int, int] | str, max_k: int, max_batch_size: int
                    ) -> dict[int, int]:
    """Our draft-length schedule as TensorRT-LLM's. Ours maps the smallest batch size of a range
    to its K (1:4,4:2,8:0 = K 4 for 1-3 running requests, 2 for 4-7, none from 8); theirs
    maps the largest (4:4, 8:2 = K 4 for 1-4, 2 for 5-8, none above the largest key), and its
    smallest key's K must be max_draft_len, the largest K. An open last range ends at
    max_batch_size: no batch is larger."""
    if not isinstance(ours, dict):
        raise ValueError(f"--draft-len-schedule {ours!r}: TensorRT-LLM takes a fixed schedule "
                         "(SIZE:K,...); 'auto' runs only in paradraft's own runtime")
    sizes = sorted(ours)
    if not sizes or sizes[0] != 1 or any(s > max_batch_size for s in sizes):
        raise ValueError(f"--draft-len-schedule: batch sizes must start at 1 and stay within "
                         f"--max-batch-size {max_batch_size}; got {sorted(ours.items())}")
    ks = [ours[s] for s in sizes]
    if any(k < 0 or k > max_k for k in ks) or ks[0] != max(ks) or ks[0] == 0:
        raise ValueError(f"--draft-len-schedule: K must be in [0, --max-k {max_k}] and the K "
                         "of 1 request must be the largest and > 0 (TensorRT-LLM's "
                         f"max_draft_len); got {sorted(ours.items())}")
    bounds = [nxt - 1 for nxt in sizes[1:]] + [max_batch_size]
    return {upper: k for upper, k in zip(bounds, ks, strict=True) if k > 0}


# -- the LLM API arguments (pure) ------------------------------------------------------------


def speculative_config(job: LlmApiJob, mask_token_id: int | None = None) -> dict:
    """``speculative_config`` of the LLM API for the job (names from llm_args.py)."""
    max_draft_len = job.max_k
    spec: dict = {"decoding_type": job.decoding_type}
    if job.draft_len_schedule is not None:
        schedule = trtllm_schedule(job.draft_len_schedule, job.max_k, job.max_batch_size)
        max_draft_len = schedule[min(schedule)]
        spec["draft_len_schedule"] = schedule
    spec["max_draft_len"] = max_draft_len
    if job.drafter == "ngram":
        spec["max_matching_ngram_size"] = job.ngram_max
    else:
        spec["speculative_model"] = str(job.draft)
    if job.drafter == "parallel":
        spec["mask_token_id"] = mask_token_id
    if job.rule == "exact":  # Leviathan et al. rejection sampling on non-greedy requests
        spec["use_rejection_sampling"] = True
    if job.acceptance_floor is not None:
        # theirs turns speculation off for good below the floor; ours only warns
        spec["acceptance_rate_window_size"] = job.acceptance_window
        spec["acceptance_rate_threshold"] = float(job.acceptance_floor)
    return spec


def llm_kwargs(job: LlmApiJob, mask_token_id: int | None = None) -> dict:
    """The LLM() keyword arguments (model.yaml's top level; trtllm-serve takes ``model`` as its
    argument and the rest from its --config YAML)."""
    return {"model": str(job.verifier), "dtype": job.dtype,
            "tensor_parallel_size": job.tp_size, "max_batch_size": job.max_batch_size,
            "max_seq_len": job.max_seq_len, "max_input_len": job.max_seq_len - 1,
            # per-request acceptance in responses (Triton's acceptance_rate output,
            # trtllm-serve's perf metrics): what the acceptance-floor alert watches
            "return_perf_metrics": True,
            "speculative_config": speculative_config(job, mask_token_id)}


def triton_config(job: LlmApiJob) -> dict:
    # max_batch_size 0: the llmapi model takes one request per call (TensorRT-LLM batches
    # inside); decoupled: streamed responses
    return {"max_batch_size": 0, "decoupled": True}


def yaml_text(data: dict, indent: int = 0) -> str:
    """Block YAML of nested dicts of str / int / float / bool keys and scalars (strings as
    JSON, which YAML reads as double-quoted scalars). PyYAML is not a runtime dependency."""
    lines = []
    for key, value in data.items():
        pad = " " * indent
        if isinstance(value, dict):
            lines.append(f"{pad}{key}:")
            lines.append(yaml_text(value, indent + 2))
        else:
            text = json.dumps(value) if isinstance(value, (str, bool)) else repr(value)
            lines.append(f"{pad}{key}: {'null' if value is None else text}")
    return "\n".join(lines)


def serve_yaml(kwargs: dict) -> str:
    rest = {k: v for k, v in kwargs.items() if k != "model"}
    return ("# Generated by `paradraft build --backend trtllm`: extra LLM API options of\n"
            f"# `trtllm-serve {kwargs['model']} --config <this file>` (TensorRT-LLM >= "
            f"{FIRST_RELEASE}; field names as in llm_args.py at {LLM_ARGS_COMMIT[:12]})\n"
            + yaml_text(rest) + "\n")


def model_yaml(kwargs: dict, triton: dict) -> str:
    return ("# Generated by `paradraft build --backend trtllm`: TensorRT-LLM's Triton llmapi "
            "model.\n# Top-level keys are the tensorrt_llm.LLM() arguments; triton_config is "
            "Triton's.\n" + yaml_text({**kwargs, "triton_config": triton}) + "\n")


def serve_argv(model: str, config: Path) -> list[str]:
    return ["trtllm-serve", model, "--config", str(config), "--host", "0.0.0.0",
            "--port", str(SERVE_PORT)]


def config_pbtxt() -> str:
    """config.pbtxt of the llmapi model: TensorRT-LLM's tensor names and types (the ones its
    model.py reads and sends); max_batch_size and decoupled come from model.yaml
    (auto-complete), as its model.py expects."""
    def tensors(items, optional):
        return ",\n".join(f'  {{ name: "{n}", data_type: {t}, dims: [ {d} ]'
                          + (", optional: true" if optional and n != "text_input" else "") + " }"
                          for n, t, d in items)
    return (f'# Generated by `paradraft build --backend trtllm`: TensorRT-LLM {TRTLLM_REF}\'s '
            '"llmapi" Python model (its 1/model.py).\n# Clients: text_input, streaming=true, '
            'sampling_param_max_tokens; sampling_param_return_perf_metrics=true adds\n'
            '# acceptance_rate, total_accepted_draft_tokens and total_draft_tokens.\n'
            'name: "tensorrt_llm"\nbackend: "python"\n'
            "instance_group [ { count: 1, kind: KIND_CPU } ]\n"
            f"input [\n{tensors(LLMAPI_INPUTS, True)}\n]\n"
            f"output [\n{tensors(LLMAPI_OUTPUTS, False)}\n]\n")


def triton_script(repo: Path) -> str:
    model_dir = repo / "tensorrt_llm" / "1"
    src = f"${{PARADRAFT_TRTLLM_SRC:-{DEFAULT_SRC}}}/{LLMAPI_MODEL_DIR}/1"
    ports = " ".join(f"--{k}-port={v}" for k, v in TRITON_PORTS.items())
    copies = "\n".join(
        f'[ -f {shlex.quote(str(model_dir / f))} ] || cp "{src}/{f}" '
        f'{shlex.quote(str(model_dir / f))} || {{ echo "missing {f}: TensorRT-LLM '
        f"{TRTLLM_REF}'s {LLMAPI_MODEL_DIR}/1/{f} (set PARADRAFT_TRTLLM_SRC)\" >&2; exit 1; }}"
        for f in LLMAPI_FILES)
    # no --disable-auto-complete-config: the llmapi model sets decoupled from model.yaml there
    return ("#!/usr/bin/env bash\n# Generated by `paradraft build --backend trtllm`: Triton with "
            f"TensorRT-LLM's llmapi model ({IMAGE} plus tritonserver)\nset -eu\n{copies}\n"
            f'exec "${{TRITONSERVER:-tritonserver}}" --model-repository={shlex.quote(str(repo))} '
            f'{ports} "$@"\n')


def serve_script(model: str, config: Path) -> str:
    return ("#!/usr/bin/env bash\n# Generated by `paradraft build --backend trtllm`: the OpenAI "
            f"API of trtllm-serve ({IMAGE}); flags given here override the YAML\nset -eu\n"
            f'exec {shlex.join(serve_argv(model, config))} "$@"\n')


# -- TensorRT-LLM itself, where it is installed ------------------------------------------------


def validate_with_tensorrt_llm(kwargs: dict) -> str:
    """Construct the LLM API's argument objects (TorchLlmArgs, the decoding config class) from
    ``kwargs`` without loading weights, where tensorrt_llm imports; returns what was done."""
    if importlib.util.find_spec("tensorrt_llm") is None:
        return ("not validated by TensorRT-LLM (tensorrt_llm is not installed here; field "
                f"names checked against llm_args.py at {LLM_ARGS_COMMIT[:12]})")
    from tensorrt_llm.llmapi import llm_args

    spec = dict(kwargs["speculative_config"])
    cls = getattr(llm_args, SPECULATIVE_CLASSES[spec.pop("decoding_type")])
    args = llm_args.TorchLlmArgs(**{**kwargs, "speculative_config": cls(**spec)})
    return f"validated by tensorrt_llm {package_versions(('tensorrt_llm',))['tensorrt_llm']} " \
           f"({type(args).__name__}, {cls.__name__})"


# -- the build ----------------------------------------------------------------------------


def copy_llmapi_model(src: Path, model_dir: Path) -> str:
    """TensorRT-LLM's model.py + helpers.py next to model.yaml, from a checkout of the release;
    returns what happened (they are copied at server start when not found now)."""
    found = [src / LLMAPI_MODEL_DIR / "1" / f for f in LLMAPI_FILES]
    if not all(f.is_file() for f in found):
        return (f"{', '.join(LLMAPI_FILES)} not found in {src / LLMAPI_MODEL_DIR / '1'}: "
                "serve_triton_llmapi.sh copies them from PARADRAFT_TRTLLM_SRC at start")
    for f in found:
        shutil.copyfile(f, model_dir / f.name)
    return f"{', '.join(LLMAPI_FILES)} copied from {src / LLMAPI_MODEL_DIR / '1'}"


def write_script(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


def build_trtllm(job: LlmApiJob, gpus: int | None = None, gpus_source: str = "--gpus") -> dict:
    """Write the deployment and manifest.json; returns the manifest. Nothing here needs
    TensorRT-LLM or a GPU; where tensorrt_llm imports, the arguments are also validated by it."""
    check_job(job)
    vc = load_config(job.verifier)
    notes = [n for n in [check_heads("--tp-size", job.tp_size, "verifier", vc)] if n]
    if gpus is not None and job.tp_size > gpus:
        raise ValueError(f"--tp-size {job.tp_size} needs {job.tp_size} GPU(s) but {gpus_source} "
                         f"gives {gpus}; valid: --tp-size <= {gpus}")
    models = {"verifier": {"source": str(job.verifier), "config": plain(vc), "graphs": {}}}
    mask_token_id = None
    if job.draft is not None:
        dc = load_config(job.draft)
        check_pair(vc, dc, job.draft)
        models["draft"] = {"source": str(job.draft), "config": plain(dc), "graphs": {}}
        if job.drafter == "parallel":
            mask_token_id = dc.mask_token_id
            if mask_token_id is None:
                raise ValueError(f"--parallel-draft {job.draft}: config.json has no "
                                 "mask_token_id (PARD's mask token)")
    kwargs = llm_kwargs(job, mask_token_id)
    triton = triton_config(job)
    bad = unknown_fields(kwargs, triton)
    if bad:  # a field we would write that TensorRT-LLM does not have: a bug here, not input
        raise AssertionError(f"fields not in llm_args.py at {LLM_ARGS_COMMIT}: {bad}")
    validated = validate_with_tensorrt_llm(kwargs)

    out = job.out
    repo = out / "triton_repo"
    model_dir = repo / "tensorrt_llm" / "1"
    model_dir.mkdir(parents=True, exist_ok=True)
    (out / "trtllm_serve.yaml").write_text(serve_yaml(kwargs))
    (repo / "tensorrt_llm" / "config.pbtxt").write_text(config_pbtxt())
    (model_dir / "model.yaml").write_text(model_yaml(kwargs, triton))
    copied = copy_llmapi_model(job.src, model_dir)
    root = out.resolve()
    write_script(out / "serve_trtllm.sh",
                 serve_script(kwargs["model"], root / "trtllm_serve.yaml"))
    write_script(out / "serve_triton_llmapi.sh", triton_script(root / "triton_repo"))
    files = {"trtllm_serve_yaml": "trtllm_serve.yaml",
             "triton_model_yaml": "triton_repo/tensorrt_llm/1/model.yaml",
             "triton_config": "triton_repo/tensorrt_llm/config.pbtxt"}
    models["verifier"]["graphs"] = {k: {"file": v} for k, v in files.items()}
    manifest = {
        "backend": "trtllm",
        "dtype": job.dtype,
        "vocab_size": vc.vocab_size,
        "limits": {"max_batch_size": job.max_batch_size, "max_k": job.max_k,
                   "max_seq_len": job.max_seq_len},
        "tokenizer": None,
        "rule_defaults": asdict(RuleParams(job.rule)),
        "models": models,
        "drafters": {job.drafter: "draft" if job.draft is not None else None},
        "trtllm": {
            "image": IMAGE, "tensorrt_llm_ref": TRTLLM_REF, "min_version": FIRST_RELEASE,
            "fields_commit": LLM_ARGS_COMMIT, "validation": validated,
            "llm_api": kwargs, "triton_config": triton,
            "serve": {"argv": serve_argv(kwargs["model"], root / "trtllm_serve.yaml"),
                      "script": "serve_trtllm.sh"},
            "triton": {"repo": "triton_repo", "script": "serve_triton_llmapi.sh",
                       "model_py": copied, "ports": TRITON_PORTS},
            "gpus": {"needed": job.tp_size, "given": gpus, "source": gpus_source},
            "notes": notes,
        },
        "versions": package_versions(("paradraft", "tensorrt_llm", "torch")),
    }
    return write_manifest(out, manifest)
