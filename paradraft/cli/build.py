"""``paradraft build``: an engine dir (ONNX, TensorRT or TensorRT-LLM) from HF checkpoints."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from paradraft.build import llamacpp as llamacpp_build
from paradraft.build import onnx as onnx_build
from paradraft.build import tensorrt as tensorrt_build
from paradraft.build import trtllm as trtllm_build
from paradraft.build import trtllm_engine as trtllm_engine_build
from paradraft.build.trtllm_engine import (
    TrtllmJob,
    build_trtllm,
    check_job,
    check_world_size,
    detect_gpu_count,
    draft_logits_for_rule,
)
from paradraft.runtime.checkpoints import DEMO_DIR
from paradraft.runtime.correction import RuleParams
from paradraft.runtime.k_policy import parse_draft_len_schedule
from paradraft.runtime.model import load_config

from .common import add_rule_args, checkpoint, rule_params


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("build", help="export the verifier and drafts to an engine dir")
    p.add_argument("--verifier", default=None,
                    help="HF-format dir or .gguf (default: the demo verifier, draft and "
                         "parallel_draft); --backend llamacpp takes a .gguf as it is")
    p.add_argument("--draft", default=None,
                   help="HF-format dir (or .gguf) of the draft model")
    p.add_argument("--parallel-draft", default=None,
                   help="HF-format dir (PARD-style draft)")
    p.add_argument("--self-draft-layers", type=int, default=None,
                    help="verifier layers of the self-draft graphs, built only when given "
                         "or set in the verifier's config (self_draft_layers)")
    p.add_argument("--backend", choices=["onnx", "tensorrt", "trtllm", "llamacpp"],
                   default="onnx", help="onnx (ONNX Runtime, CPU), tensorrt, trtllm, or "
                   "llamacpp (GGUF files run by llama.cpp on the CPU: `make llamacpp`)")
    p.add_argument("--out", default="engines", help="engine dir to write")
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--max-k", type=int, default=8)
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--dtype", choices=["float32"], default="float32")
    p.add_argument("--precision", choices=["fp32", "fp16", "bf16"], default="fp32",
                    help="math inside the TensorRT plans (--backend tensorrt; I/O stays fp32)")
    p.add_argument("--draft-precision", choices=["int8", "float32"], default=None,
                    help="weights of the drafting graphs (drafts, self-draft) for --backend "
                         "onnx: int8 (default; the verifier decides, so output is unchanged) "
                         "or float32; --backend tensorrt takes float32 (use --precision)")
    add_trtllm_parallel_args(p)
    add_trtllm_deploy_args(p)
    p.add_argument("--weights-dtype", choices=["float32", "float16"], default=None,
                    help="how the ONNX graphs store their float weights (--backend onnx, "
                         "tensorrt): float32 (default) or float16, cast back to fp32 in the "
                         "graphs (half the engine dir, for TensorRT plans; I/O, KV cache and "
                         "math stay fp32)")
    add_weights_args(p)
    add_rule_args(p)  # the rule defaults the correction graph carries
    p.set_defaults(run=run)


# names and defaults of the options only --backend trtllm reads
TRTLLM_PARALLEL_DEFAULTS = {"tp_size": 1, "pp_size": 1, "draft_tp_size": 1, "gpus": None}


def add_trtllm_parallel_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallel TensorRT-LLM engines (--backend trtllm)")
    g.add_argument("--tp-size", type=int, default=1,
                   help="tensor-parallel ranks of the verifier engine (TensorRT-LLM's "
                        "convert_checkpoint.py --tp_size); must divide its attention heads")
    g.add_argument("--pp-size", type=int, default=1,
                   help="pipeline-parallel ranks of the verifier; only 1: TensorRT-LLM runs no "
                        "draft model with pipeline parallelism")
    g.add_argument("--draft-tp-size", type=int, default=1,
                   help="tensor-parallel ranks of the draft engine (default 1)")
    g.add_argument("--gpus", type=int, default=None,
                   help="GPUs of the serving machine, checked against tp × pp (default: "
                        "nvidia-smi's count; without one the check is skipped)")


# names and defaults of the TensorRT-LLM deployment options (--backend trtllm)
TRTLLM_DEPLOY_DEFAULTS = {"trtllm_engine_legacy": False, "drafter": None, "ngram_max": None,
                          "draft_len_schedule": None, "acceptance_floor": None,
                          "acceptance_window": 32}


def add_trtllm_deploy_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "TensorRT-LLM deployment (--backend trtllm): a trtllm-serve YAML and a Triton llmapi "
        f"model for TensorRT-LLM >= {trtllm_build.FIRST_RELEASE} (PyTorch backend; no "
        "TensorRT-LLM or GPU needed to write it)")
    g.add_argument("--trtllm-engine-legacy", action="store_true",
                   help="LEGACY: convert_checkpoint.py + trtllm-build engines and the "
                        "inflight_batcher_llm Triton repository, for TensorRT-LLM <= "
                        f"{trtllm_engine_build.LAST_RELEASE} only (image "
                        f"{trtllm_engine_build.IMAGE}); removed from TensorRT-LLM in "
                        f"{trtllm_build.FIRST_RELEASE}")
    g.add_argument("--drafter", choices=list(trtllm_build.DECODING_TYPES), default=None,
                   help="speculative_config: model = Draft_Target (--draft), parallel = PARD "
                        "(--parallel-draft, its config's mask_token_id), ngram = NGram (no "
                        "draft model). Default: parallel when only --parallel-draft is given, "
                        "else model")
    g.add_argument("--ngram-max", type=int, default=None, metavar="N",
                   help="--drafter ngram: longest n-gram matched (max_matching_ngram_size; "
                        "default TensorRT-LLM's, 2)")
    g.add_argument("--draft-len-schedule", type=parse_draft_len_schedule, default=None,
                   metavar="SIZE:K,...", help="K by running batch size as in `serve` "
                   "(1:4,4:2,8:0 = K 4 below 4 requests, 2 below 8, none from 8), written as "
                   "TensorRT-LLM's draft_len_schedule; the K of 1 request is max_draft_len")
    g.add_argument("--acceptance-floor", type=float, default=None, metavar="RATE",
                   help="acceptance_rate_threshold: TensorRT-LLM turns speculation OFF for good "
                        "when the rolling acceptance falls below RATE (in [0, 1]; paradraft's "
                        "own runtime only warns)")
    g.add_argument("--acceptance-window", type=int, default=32, metavar="N",
                   help="acceptance_rate_window_size: rounds in that rolling acceptance "
                        "(default 32; with --acceptance-floor)")


def add_weights_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("compressed verifier weights (--backend onnx)")
    g.add_argument("--weights", choices=list(onnx_build.quantize.WEIGHT_BITS), default=None,
                   help="block-quantize every MatMul weight (ONNX Runtime MatMulNBits; "
                        "activations, KV cache and correction stay fp32): the verifier's "
                        "outputs change (measure with `eval --reference-engines`); the drafting "
                        "graphs follow unless --draft-precision is given. Default: fp32")
    g.add_argument("--weights-block-size", type=int, default=None, metavar="N",
                   help="input features per scale of --weights (one of "
                        f"{', '.join(map(str, onnx_build.quantize.BLOCK_SIZES))}; default "
                        f"{onnx_build.quantize.DEFAULT_BLOCK_SIZE})")


def weights_options(args: argparse.Namespace) -> dict:
    """``build_engines`` options of --weights / --weights-block-size (refused where unread)."""
    weights, block = getattr(args, "weights", None), getattr(args, "weights_block_size", None)
    if weights is None:
        if block is not None:
            raise ValueError("--weights-block-size: only read with --weights int8|int4")
        return {}
    if args.backend != "onnx":
        raise ValueError(f"--weights {weights}: only --backend onnx runs MatMulNBits; got "
                         f"--backend {args.backend}")
    if args.weights_dtype is not None:
        raise ValueError(f"--weights {weights} and --weights-dtype {args.weights_dtype}: "
                         "give one")
    options = {"weights_dtype": weights}
    if block is not None:
        options["weights_block_size"] = onnx_build.quantize.check_block_size(block)
    if args.draft_precision is None:  # the drafting graphs follow the verifier's weights
        options["draft_precision"] = "float32"
    return options


# the options --backend llamacpp reads besides the models, limits and rule defaults: what it
# refuses is every other option left away from its default
LLAMACPP_UNREAD = {"parallel_draft": None, "self_draft_layers": None, "precision": "fp32",
                   "draft_precision": None, "weights_dtype": None, "weights": None,
                   "weights_block_size": None}


def run_llamacpp(args: argparse.Namespace) -> None:
    given = [k for k, v in {**LLAMACPP_UNREAD, **TRTLLM_PARALLEL_DEFAULTS,
                            **TRTLLM_DEPLOY_DEFAULTS}.items() if getattr(args, k) != v]
    if given:
        flags = ", ".join("--" + k.replace("_", "-") for k in given)
        raise ValueError(f"{flags}: not read by --backend llamacpp (the GGUF's own quantized "
                         "weights run as they are; drafters: --draft, ngram)")
    if args.verifier is None:
        raise ValueError("--backend llamacpp needs --verifier FILE.gguf (and --draft "
                         "FILE.gguf for a draft model)")
    manifest = llamacpp_build.build_engines(
        args.verifier, args.out, args.draft, rule_defaults=rule_params(args),
        max_batch_size=args.max_batch_size, max_k=args.max_k, max_seq_len=args.max_seq_len)
    print(f"wrote {Path(args.out) / 'manifest.json'} (llamacpp): "
          f"{', '.join(manifest['checksums'])}")


def run(args: argparse.Namespace) -> None:
    if args.backend == "llamacpp":
        return run_llamacpp(args)
    # the other backends read HF-format dirs: a .gguf is imported (once, into the cache)
    for name in ("verifier", "draft", "parallel_draft"):
        if getattr(args, name) is not None:
            setattr(args, name, checkpoint(getattr(args, name)))
    compressed = weights_options(args)
    if args.backend == "trtllm":
        if getattr(args, "weights_dtype", None) is not None:
            raise ValueError("--weights-dtype: the trtllm backend takes its dtype from "
                             "--precision / --dtype")
        if args.trtllm_engine_legacy:
            return run_trtllm(args)
        return run_trtllm_llmapi(args)
    given = [k for k, v in {**TRTLLM_PARALLEL_DEFAULTS, **TRTLLM_DEPLOY_DEFAULTS}.items()
             if getattr(args, k) != v]
    if given:
        flags = ", ".join("--" + k.replace("_", "-") for k in given)
        raise ValueError(f"{flags}: only --backend trtllm reads these; got "
                         f"--backend {args.backend}")
    if args.backend == "tensorrt":  # the same ONNX export, then plans built from it
        build_engines, options = tensorrt_build.build_engines, {"precision": args.precision}
    else:
        build_engines, options = onnx_build.build_engines, {}
    if args.draft_precision is not None:  # else the backend's default (onnx int8, trt fp32)
        options["draft_precision"] = args.draft_precision
    if args.weights_dtype is not None:
        options["weights_dtype"] = args.weights_dtype
    options.update(compressed)

    verifier, draft, parallel = args.verifier, args.draft, args.parallel_draft
    if verifier is None:  # no model arguments: the shipped demo set
        verifier = DEMO_DIR / "verifier"
        draft = draft or DEMO_DIR / "draft"
        parallel = parallel or DEMO_DIR / "parallel_draft"
    manifest = build_engines(
        verifier, args.out, draft, parallel, self_draft_layers=args.self_draft_layers,
        rule_defaults=rule_params(args), max_batch_size=args.max_batch_size, max_k=args.max_k,
        max_seq_len=args.max_seq_len, dtype=args.dtype, **options)
    print(f"wrote {Path(args.out) / 'manifest.json'} ({args.backend}): "
          f"{', '.join(manifest['checksums'])}")


# the CLI's --precision (the TensorRT backend's flag) names the engines' dtype here too
PRECISION_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def job_from_args(args: argparse.Namespace) -> tuple[TrtllmJob, RuleParams, Path | None]:
    """The build the CLI's `build` arguments ask for (demo pair when no models are given)."""
    if args.self_draft_layers is not None:
        raise ValueError("--self-draft-layers: the trtllm backend has no self-draft engine")
    verifier, draft = args.verifier, args.draft
    if verifier is None:  # no model arguments: the shipped demo pair
        verifier, draft = DEMO_DIR / "verifier", draft or DEMO_DIR / "draft"
    if draft is None:
        raise ValueError("--draft is required with --backend trtllm (the draft engine)")
    precision = getattr(args, "precision", None)
    dtype = PRECISION_DTYPES.get(precision, args.dtype)
    rules = rule_params(args)
    job = TrtllmJob(
        verifier=Path(verifier), draft=Path(draft), out=Path(args.out),
        verifier_type=load_config(verifier).model_type, draft_type=load_config(draft).model_type,
        dtype=dtype, max_batch_size=args.max_batch_size, max_k=args.max_k,
        max_seq_len=args.max_seq_len, use_draft_logits=draft_logits_for_rule(rules.rule),
        tp_size=args.tp_size, pp_size=args.pp_size, draft_tp_size=args.draft_tp_size)
    return job, rules, Path(args.parallel_draft) if args.parallel_draft else None


def gpus_from_args(args: argparse.Namespace) -> tuple[int | None, str]:
    """(GPU count, where it came from): --gpus, else nvidia-smi, else unknown (None)."""
    if args.gpus is not None:
        return args.gpus, "--gpus"
    return detect_gpu_count(), "nvidia-smi"


def llmapi_job_from_args(args: argparse.Namespace) -> trtllm_build.LlmApiJob:
    """The TensorRT-LLM >= 1.3 deployment the `build` arguments ask for (the demo set when no
    models are given)."""
    if args.self_draft_layers is not None:
        raise ValueError("--self-draft-layers: TensorRT-LLM runs no self-draft; use --drafter "
                         "model, parallel or ngram")
    if args.pp_size != 1:
        raise ValueError(f"--pp-size {args.pp_size}: TensorRT-LLM refuses drafting with "
                         "pipeline_parallel_size > 1; valid: --pp-size 1 (use --tp-size)")
    if args.draft_tp_size != 1:
        raise ValueError(f"--draft-tp-size {args.draft_tp_size}: TensorRT-LLM's PyTorch backend "
                         "runs the draft with the verifier's --tp-size; valid: 1 (only the "
                         "legacy engine path takes it)")
    drafter = args.drafter or ("parallel" if args.parallel_draft and not args.draft else "model")
    options = {"model": "--draft", "parallel": "--parallel-draft"}
    given = {"--draft": args.draft, "--parallel-draft": args.parallel_draft}
    unused = [flag for flag, value in given.items()
              if value is not None and flag != options.get(drafter)]
    if unused:
        raise ValueError(f"{', '.join(unused)}: --drafter {drafter} does not use it "
                         f"({'no draft model' if drafter == 'ngram' else options[drafter]})")
    verifier, draft = args.verifier, given.get(options.get(drafter))
    if verifier is None:  # no model arguments: the shipped demo set
        verifier = DEMO_DIR / "verifier"
        if drafter != "ngram":
            draft = draft or DEMO_DIR / ("draft" if drafter == "model" else "parallel_draft")
    if args.ngram_max is not None and drafter != "ngram":
        raise ValueError(f"--ngram-max: only --drafter ngram reads it; got --drafter {drafter}")
    if args.acceptance_window != 32 and args.acceptance_floor is None:
        raise ValueError("--acceptance-window: only read with --acceptance-floor")
    extra = {"ngram_max": args.ngram_max} if args.ngram_max is not None else {}
    return trtllm_build.LlmApiJob(
        verifier=Path(verifier).resolve(), out=Path(args.out), drafter=drafter,
        draft=Path(draft).resolve() if draft is not None else None, rule=args.rule,
        dtype=PRECISION_DTYPES.get(getattr(args, "precision", None), args.dtype),
        max_batch_size=args.max_batch_size, max_k=args.max_k, max_seq_len=args.max_seq_len,
        tp_size=args.tp_size, draft_len_schedule=args.draft_len_schedule,
        acceptance_floor=args.acceptance_floor, acceptance_window=args.acceptance_window,
        **extra)


def run_trtllm_llmapi(args: argparse.Namespace) -> None:
    """`paradraft build --backend trtllm` (TensorRT-LLM >= 1.3)."""
    job = llmapi_job_from_args(args)
    gpus, source = gpus_from_args(args)
    manifest = trtllm_build.build_trtllm(job, gpus, source)
    t = manifest["trtllm"]
    print(f"paradraft: {t['validation']}", file=sys.stderr, flush=True)
    print(json.dumps({"manifest": str(job.out / "manifest.json"),
                      "decoding_type": job.decoding_type,
                      "trtllm_serve": shlex.join(t["serve"]["argv"]),
                      "triton_repo": str(job.out / "triton_repo"),
                      "serve_triton": str(job.out / t["triton"]["script"]),
                      "llmapi_model_py": t["triton"]["model_py"]}, indent=2))


def run_trtllm(args: argparse.Namespace) -> None:
    """`paradraft build --backend trtllm --trtllm-engine-legacy` (TensorRT-LLM <= 1.2.1)."""
    given = [k for k, v in TRTLLM_DEPLOY_DEFAULTS.items()
             if k != "trtllm_engine_legacy" and getattr(args, k, v) != v]
    if given:
        raise ValueError(f"{', '.join('--' + k.replace('_', '-') for k in given)}: not "
                         "available on the legacy engine path (drop --trtllm-engine-legacy)")
    job, rules, parallel = job_from_args(args)
    check_job(job)
    gpus, source = gpus_from_args(args)
    # said before the long build: a skipped check must not go unnoticed
    print(f"paradraft: {check_world_size(job, gpus, source)}", file=sys.stderr, flush=True)
    manifest = build_trtllm(job, rules, parallel, gpus=gpus, gpus_source=source)
    print(json.dumps({"manifest": str(job.out / "manifest.json"),
                      "triton_repo": str(job.out / "triton_repo"),
                      "serve": str(job.out / "serve_trtllm.sh"),
                      "files": list(manifest["checksums"])}, indent=2))
