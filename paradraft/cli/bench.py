"""``paradraft bench``: speed-up and acceptance of every variant, side by side in one run."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

from paradraft.build.onnx import build_engines
from paradraft.runtime.backends.loader import load_engines
from paradraft.runtime.correction import MAX_K, RULES
from paradraft.runtime.drafters import AnyDrafter
from paradraft.runtime.model import load_model
from paradraft.runtime.tools.bench import (
    compare_backends,
    compare_hf,
    print_rows,
    read_prompt_file,
    run_bench,
    summary,
    write_outputs,
)

from .common import (
    NGRAM_SIZES,
    add_draft_threads_arg,
    add_eval_args,
    add_fused_correction_arg,
    add_ngram_args,
    apply_demo_defaults,
    check_same_tokenizer,
    device_and_dtype,
    eval_prompts,
    int_list,
    load_drafters,
    need_verifier,
    ngram_sizes,
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="speed-up / acceptance side by side with transformers")
    add_eval_args(p, "bench")
    p.add_argument("--drafters", default="model,parallel,self",
                   help="comma list of model, parallel, self, ngram")
    add_ngram_args(p)
    p.add_argument("--prompt-file", default=None, metavar="FILE.jsonl",
                   help='requests, one JSON object a line: {"messages": [...]} (the '
                   'verifier\'s chat template applied) or {"prompt": "..."}; every line runs, '
                   "and each request stops at the verifier's end ids (chat: end of turn). "
                   "Default: --prompts cuts of --heldout text, decoding --max-new-tokens each")
    p.add_argument("--ks", default="1,2,3,4,5,6,7,8")
    p.add_argument("--batch-sizes", default="1,4,16")
    p.add_argument("--temperature", type=float, default=1.0, help="for the sampling rows")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers peers")
    p.add_argument("--greedy-only", action="store_true",
                   help="skip the sampling rows (exact and the lossy rules)")
    p.add_argument("--repeats", type=int, default=1,
                   help="run the whole plan this many times in turn; tokens/s are medians, "
                   "ratios the medians of per-repeat ratios")
    p.add_argument("--backends", default="torch",
                   help="comma list of torch, onnx, tensorrt, llamacpp (the last two with "
                   "--engines): run our variants on each, side by side")
    p.add_argument("--engines", default=None,
                   help="engine dir for the onnx or tensorrt backend (onnx default: build "
                   "into a temp dir)")
    add_draft_threads_arg(p)
    add_fused_correction_arg(p, several=True)
    add_peer_args(p)
    p.set_defaults(run=run)


def add_peer_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("a peer runtime beside our rows (optional)")
    g.add_argument("--peer", choices=["openvino", "llamacpp"], default=None,
                   help="openvino: OpenVINO GenAI on the same checkpoints (optimum-intel "
                        "exports; its own environment); llamacpp: llama.cpp's own programs "
                        "(built once into the cache) on the GGUF files of --engines (a "
                        "llamacpp engine dir), batch 1; both on the same prompts and K, "
                        "interleaved with our rows")
    g.add_argument("--openvino-python", default=None, metavar="PYTHON",
                   help="interpreter with openvino-genai and optimum-intel (default: this one)")
    g.add_argument("--openvino-precisions", default="fp32,default,int8", metavar="LIST",
                   help="comma list of fp32 (weights, math and KV cache), default (what "
                        "optimum-cli and the CPU plugin give), int8, int4")
    g.add_argument("--openvino-cache", default=None, metavar="DIR",
                   help="where the OpenVINO exports are kept (default: OUT/openvino)")


def llamacpp_peer(args: argparse.Namespace):
    """llama.cpp's programs on the GGUF files of ``--engines`` (a llamacpp engine dir)."""
    from paradraft.runtime.backends.manifest import read_manifest
    from paradraft.runtime.checkpoints import load_tokenizer
    from paradraft.runtime.tools.peer_llamacpp import LlamaCppPeer

    if args.engines is None:
        raise ValueError("--peer llamacpp runs the GGUF files of --engines: pass a "
                         "`paradraft build --backend llamacpp` dir")
    manifest = read_manifest(args.engines, verify=False)
    if manifest["backend"] != "llamacpp":
        raise ValueError(f"--peer llamacpp needs a llamacpp engine dir; {args.engines} holds "
                         f"{manifest['backend']} engines")
    models = manifest["models"]
    draft = models.get("draft") if "model" in args.drafters.split(",") else None
    tokenizer = load_tokenizer(args.engines)
    return LlamaCppPeer(
        verifier=Path(args.engines) / models["verifier"]["weights"],
        draft=Path(args.engines) / draft["weights"] if draft else None,
        threads=len(os.sched_getaffinity(0)),
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=False))


def make_peer(args: argparse.Namespace):
    """The peer ``--peer`` asks for, or None (the OpenVINO options refused without it)."""
    given = [f for f, v in (("--openvino-python", args.openvino_python),
                            ("--openvino-cache", args.openvino_cache)) if v is not None]
    if args.peer != "openvino" and given:
        raise ValueError(f"{', '.join(given)}: only read with --peer openvino")
    if args.peer is None:
        return None
    if args.peer == "llamacpp":
        return llamacpp_peer(args)
    from paradraft.runtime.tools.peer_openvino import OpenVinoPeer

    if "model" in args.drafters.split(",") and args.draft is None:
        raise ValueError("--peer openvino runs the draft model: pass --draft")
    draft = Path(args.draft) if "model" in args.drafters.split(",") else None
    return OpenVinoPeer(
        python=args.openvino_python or sys.executable, verifier=Path(args.verifier), draft=draft,
        precisions=tuple(args.openvino_precisions.split(",")), threads=torch.get_num_threads(),
        cache_dir=Path(args.openvino_cache or Path(args.out) / "openvino"))


def bench_engines(args: argparse.Namespace, tmp: str, max_k: int
                  ) -> tuple[object, dict[str, AnyDrafter], dict]:
    """The onnx backend's verifier, drafters and manifest: ``--engines`` or a build (with
    the build's defaults, and the bench's largest K as max_k: fused draft graphs for the Ks
    it runs) into ``tmp``."""
    names = args.drafters.split(",")
    engine_dir = args.engines
    if engine_dir is None:
        engine_dir = tmp
        build_engines(args.verifier, tmp, args.draft if "model" in names else None,
                      args.parallel_draft if "parallel" in names else None,
                      self_draft_layers=args.self_draft_layers, max_k=max_k)
    verifier, drafters, _, manifest = load_engines(engine_dir, args.self_draft_layers,
                                                   draft_threads=args.draft_threads,
                                                   **ngram_sizes(args, names))
    # a correction session per rule the plan runs: its fused rows measure the fused path,
    # not the fallback past the default cap
    if hasattr(verifier, "max_correction_sessions"):  # engines with a correction graph
        verifier.max_correction_sessions = max(verifier.max_correction_sessions, len(RULES))
    missing = [n for n in names if n not in drafters]
    if missing:
        raise ValueError(f"drafters {missing} were not built into {engine_dir}; "
                         f"built: {', '.join(sorted(drafters))}")
    return verifier, {n: drafters[n] for n in names}, manifest


def openvino_comparison(args: argparse.Namespace, rows: list, peer, prompts: list[list[int]],
                        eos: tuple[int, ...] | None) -> dict:
    """The OpenVINO rows against ours (``peer_openvino.compare``), their greedy agreement
    measured against our fp32 torch verifier's greedy continuations."""
    from paradraft.runtime.tools.evaluate import greedy_continuations
    from paradraft.runtime.tools.peer_openvino import compare

    peer.close()
    reference = load_model(args.verifier)
    distinct = list({tuple(p): p for p in prompts}.values())
    # all prompts in one batch: the same greedy tokens up to float ties, 1/B of the steps
    continuations, _ = greedy_continuations(reference, distinct, args.max_new_tokens,
                                            len(distinct))
    if eos:  # cut where the rows stopped: at the first end id, kept
        continuations = [c[:next((i + 1 for i, t in enumerate(c) if t in eos), len(c))]
                         for c in continuations]
    out = compare(rows, peer, {tuple(p): c for p, c in zip(distinct, continuations,
                                                            strict=True)})
    out["precisions"] = list(peer.precisions)
    print("OpenVINO GenAI beside ours:", json.dumps(out, indent=2))
    return out


def run(args: argparse.Namespace) -> None:
    apply_demo_defaults(args)
    check_same_tokenizer(args)
    backends = args.backends.split(",")
    if not backends or any(b not in ("torch", "onnx", "tensorrt", "llamacpp")
                           for b in backends):
        raise ValueError("backends must be a comma list of torch, onnx, tensorrt, llamacpp; "
                         f"got {args.backends!r}")
    for built in ("tensorrt", "llamacpp"):
        if built not in backends:
            continue
        # one --engines dir per run, built beforehand (`paradraft build --backend ...`)
        if args.engines is None:
            raise ValueError(f"backends: {built} needs --engines (a paradraft build --backend "
                             f"{built} dir)")
        others = sorted(set(backends) - {"torch", built})
        if others:
            raise ValueError(f"backends: {built} cannot run beside {', '.join(others)} (one "
                             "--engines dir per run; bench each backend on its own)")
    ks = int_list(args.ks, "ks", 1, 16)
    batch_sizes = int_list(args.batch_sizes, "batch_sizes", 1, 256)
    if args.repeats < 1:
        raise ValueError(f"repeats must be >= 1; got {args.repeats}")
    fused_modes = tuple(dict.fromkeys(args.fused_correction.split(",")))
    if any(m not in ("on", "off", "auto") for m in fused_modes):
        raise ValueError("fused_correction must be a comma list of on, off, auto; got "
                         f"{args.fused_correction!r}")
    chat_ids: tuple[int, ...] = ()
    guides = tokenizer_json = None
    if args.prompt_file:
        # the engine dir carries the tokenizer and chat template its engines were built with
        source = args.engines or args.verifier
        prompts, chat_ids, guides = read_prompt_file(args.prompt_file, source)
        guides = guides if any(g is not None for g in guides) else None
        tokenizer_json = str(Path(source) / "tokenizer.json")
    else:
        prompts = eval_prompts(args)
    peer = make_peer(args)  # checked before anything is built
    rows = []
    draft_precision = None  # of the onnx engines' drafting graphs
    with tempfile.TemporaryDirectory(prefix="paradraft-engines-") as tmp:
        for i, backend in enumerate(backends):
            if backend == "torch":
                need_verifier(args, "--backends torch")
                device, dtype = device_and_dtype(args)
                verifier = load_model(args.verifier, dtype=dtype, device=device)
                drafters = load_drafters(args, verifier)
            else:
                verifier, drafters, manifest = bench_engines(args, tmp, min(max(ks), MAX_K))
                if manifest["backend"] != backend:
                    raise ValueError(f"--engines {args.engines} holds {manifest['backend']} "
                                     f"engines, not {backend}")
                draft_precision = manifest.get("draft_precision", "float32")
            # the transformers peers run once, with the first backend
            hf_dirs = None if args.no_hf or i or args.verifier is None else (
                args.verifier, args.draft)
            # a prompt file's requests end where a user's would: at an end id
            eos = tuple(dict.fromkeys((*verifier.config.eos_token_ids, *chat_ids))
                        ) if args.prompt_file else None
            backend_rows = run_bench(verifier, drafters, prompts, args.max_new_tokens,
                                     batch_sizes, ks, hf_dirs, seed=args.seed,
                                     temperature=args.temperature, repeats=args.repeats,
                                     # torch verifies in torch, llama.cpp returns logits:
                                     # nothing to fuse
                                     fused_modes=fused_modes if backend not in (
                                         "torch", "llamacpp") else ("off",),
                                     eos_token_id=eos, sampling_rows=not args.greedy_only,
                                     peer=peer if i == 0 else None, guides=guides,
                                     tokenizer_json=tokenizer_json)
            for r in backend_rows:  # the peers run transformers' own code on torch
                r.backend = backend if r.system == "ours" else "torch"
                if r.system == "openvino":
                    r.backend = "openvino"
            rows += backend_rows
    compare_hf(rows)  # every backend against the transformers peers (run once)
    ratios = compare_backends(rows)
    meta = {"prompts": len(prompts), "prompt_file": args.prompt_file,
            "prompt_tokens": args.prompt_tokens if not args.prompt_file else None,
            "ngram": {name: getattr(d, name) for d in drafters.values() if d.kind == "ngram"
                      for name in NGRAM_SIZES} or None,
            "max_new_tokens": args.max_new_tokens, "torch_threads": torch.get_num_threads(),
            "verifier": args.verifier, "draft": args.draft,
            "parallel_draft": args.parallel_draft, "temperature": args.temperature,
            "backends": backends, "repeats": args.repeats, "vs_torch": ratios,
            "fused_correction": list(fused_modes),
            "onnx_draft_precision": draft_precision,
            # what the rows' bound fields mean (docs/results.md, "Distance to the bound")
            "definitions": {
                "alpha": "i.i.d. acceptance with sum_{i=1..K} alpha^i = mean accepted drafts "
                         "per round",
                "cost_ratio": "draft seconds per round / K / the plain baseline's seconds per "
                              "step, same batch size",
                "bound": "(1 - alpha^(K+1)) / ((1 - alpha) (K cost_ratio + 1)), K = mean_k",
                "efficiency": "speedup_vs_baseline / bound",
                "phase_share": "draft, verify, correct, prefill, other (= wall clock - the "
                               "four) over the wall clock"}}
    if args.peer == "openvino":
        meta["openvino"] = openvino_comparison(args, rows, peer, prompts, eos)
    elif args.peer == "llamacpp":
        from paradraft.runtime.tools.peer_llamacpp import compare

        meta["llamacpp"] = compare(rows)
        print("llama.cpp beside ours:", json.dumps(meta["llamacpp"], indent=2))
    write_outputs(rows, Path(args.out), meta)
    print_rows(rows)
    print(json.dumps(summary(rows), indent=2))
    if ratios:
        print("tokens/s relative to the torch backend:", json.dumps(ratios, indent=2))
    print(f"wrote {Path(args.out) / 'bench.json'} and bench.png")
