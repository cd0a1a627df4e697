"""``paradraft generate``: speculative generation for one prompt, streamed to stdout."""

from __future__ import annotations

import argparse
import json
import sys

from paradraft.runtime.backends.loader import load_engines
from paradraft.runtime.backends.manifest import engine_drafter, read_manifest
from paradraft.runtime.checkpoints import (
    DEMO_DIR,
    chat_stop_token_ids,
    format_chat,
    load_draft,
    load_tokenizer,
)
from paradraft.runtime.compiled import compile_decoder
from paradraft.runtime.drafters import DRAFTERS, MODEL_FREE_DRAFTERS, AnyDrafter, Drafter
from paradraft.runtime.model import Transformer, load_model
from paradraft.runtime.speculative import SpeculativeDecoder

from .common import (
    add_acceptance_floor_arg,
    add_device_args,
    add_draft_len_schedule_arg,
    add_draft_threads_arg,
    add_fused_correction_arg,
    add_ngram_args,
    add_rule_args,
    check_engine_limits,
    check_same_tokenizer,
    checkpoint,
    demo_draft,
    device_and_dtype,
    ngram_sizes,
    no_default_draft,
    rule_params,
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="speculative generation for one prompt")
    add_model_args(p)
    p.add_argument("--prompt", default="def ")
    p.add_argument("--prompt-ids", default=None, help="comma-separated token ids (no tokenizer)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--chat", action="store_true",
                   help="send --prompt as a user message through the verifier tokenizer's chat "
                        "template; stop at its end-of-turn token")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--verifier", type=checkpoint, default=None,
                   help="HF-format dir or .gguf file (default, without --engines: the demo "
                        "pair)")
    p.add_argument("--draft", type=checkpoint, default=None,
                   help="HF-format dir (default only when --verifier is not given: the demo "
                        "draft for --drafter model, the demo parallel_draft for --drafter "
                        "parallel)")
    p.add_argument("--drafter", choices=DRAFTERS, default=None,
                   help="default: model; with --engines the dir's first of model, parallel, "
                        "self, ngram (one it lacks is refused, naming the ones it has)")
    p.add_argument("--self-draft-layers", type=int, default=None,
                   help="verifier layers the self-draft uses (default: config or 1)")
    add_ngram_args(p)
    p.add_argument("--engines", default=None,
                   help="engine dir from `paradraft build` (ONNX Runtime backend) instead of "
                        "--verifier/--draft")
    add_draft_threads_arg(p)
    p.add_argument("--k", type=int, default=4, help="draft tokens per round (K)")
    p.add_argument("--adaptive-k", action="store_true", help="per-row K in [1, --k]")
    add_draft_len_schedule_arg(p)
    add_rule_args(p)
    p.add_argument("--audit-epsilon", type=float, default=None,
                   help="enable the attention causal audit with this ε")
    add_acceptance_floor_arg(p)
    add_fused_correction_arg(p)
    p.add_argument("--no-speculation", action="store_true",
                   help="plain autoregressive decoding of the verifier (the baseline)")
    p.add_argument("--compile", action="store_true",
                   help="run the torch models' draft and verify steps from torch.compile "
                        "graphs (CUDA graphs on a GPU), compiled before the first request "
                        "(docs/gpu.md); not with --engines")
    add_device_args(p)
    p.add_argument("--seed", type=int, default=0)


def build_decoder(args: argparse.Namespace, max_batch_size: int, max_seq_len: int
                  ) -> tuple[SpeculativeDecoder, Transformer]:
    if args.engines and args.compile:
        raise ValueError("--compile compiles the torch backend's models (--verifier); an "
                         "engine dir (--engines) runs its own graphs")
    if args.engines and not args.no_speculation:  # checked before any engine loads
        args.drafter = engine_drafter(read_manifest(args.engines, verify=False), args.engines,
                                      args.drafter)
    args.drafter = args.drafter or "model"
    if args.engines:
        verifier, drafter, manifest = engine_models(args, max_batch_size, max_seq_len)
        return SpeculativeDecoder(
            verifier, drafter, rule_params(args, manifest.get("calibration")), k=args.k,
            adaptive_k=args.adaptive_k,
            audit_epsilon=args.audit_epsilon, max_batch_size=max_batch_size,
            max_seq_len=max_seq_len, acceptance_floor=args.acceptance_floor,
            fused_correction=args.fused_correction, draft_len_schedule=args.draft_len_schedule,
        ), verifier
    if args.fused_correction == "on":
        raise ValueError("--fused-correction on needs --engines (an engine dir whose verifier "
                         "carries the correction graph); the torch backend has none")
    device, dtype = device_and_dtype(args)
    verifier = load_model(args.verifier, dtype=dtype, device=device)
    sizes = ngram_sizes(args, [] if args.no_speculation else [args.drafter])
    drafter = None
    if not args.no_speculation:
        if args.drafter == "self":
            drafter = Drafter("self", verifier, num_layers=args.self_draft_layers)
        elif args.drafter in MODEL_FREE_DRAFTERS:
            drafter = Drafter(args.drafter, **sizes)
        else:
            draft_dir = args.draft
            if draft_dir is None and args.demo_models:
                draft_dir = demo_draft(args.drafter)
            elif draft_dir is None:
                raise no_default_draft(f"--drafter {args.drafter}", "--draft")
            draft = load_draft(draft_dir, args.verifier,
                               verifier.config.vocab_size, dtype=dtype, device=device)
            drafter = Drafter(args.drafter, draft)
    decoder = SpeculativeDecoder(
        verifier, drafter, rule_params(args), k=args.k, adaptive_k=args.adaptive_k,
        audit_epsilon=args.audit_epsilon, max_batch_size=max_batch_size,
        max_seq_len=max_seq_len, acceptance_floor=args.acceptance_floor,
        draft_len_schedule=args.draft_len_schedule,
    )
    if args.compile:  # every shape compiled (on CUDA captured) before the first round
        compile_decoder(decoder)
    return decoder, verifier


def engine_models(args: argparse.Namespace, max_batch_size: int, max_seq_len: int
                  ) -> tuple[object, AnyDrafter | None, dict]:
    """The verifier engine and the requested drafter from ``--engines`` (ONNX Runtime)."""
    if args.dtype not in (None, "float32"):
        raise ValueError(f"dtype must be float32 with --engines (fp32 engines); got {args.dtype}")
    if args.device != "cpu":
        raise ValueError(f"device must be cpu with --engines: the engine's backend places it "
                         f"(ONNX Runtime on the CPU, TensorRT on its GPU); got {args.device!r}")
    if args.audit_epsilon is not None:
        raise ValueError("--audit-epsilon (the attention causal audit) is not supported with "
                         "--engines (ONNX Runtime); use --verifier/--draft (torch)")
    verifier, drafters, _, manifest = load_engines(
        args.engines, args.self_draft_layers, draft_threads=args.draft_threads,
        **ngram_sizes(args, [] if args.no_speculation else [args.drafter]))
    k = 0 if args.no_speculation else args.k
    check_engine_limits(manifest, max_batch_size, max_seq_len, k)
    if args.no_speculation:
        return verifier, None, manifest
    return verifier, drafters[args.drafter], manifest


def run(args: argparse.Namespace) -> None:
    # the toy pair only when no model is named at all
    args.demo_models = args.verifier is None and not args.engines
    if args.demo_models:
        args.verifier = str(DEMO_DIR / "verifier")
    check_same_tokenizer(args)
    tokenizer_dir = args.engines or args.verifier
    if args.system is not None and not args.chat:
        raise ValueError("--system needs --chat")
    if args.prompt_ids:
        if args.chat:
            raise ValueError("--chat formats text: pass --prompt, not --prompt-ids")
        prompt = [int(t) for t in args.prompt_ids.split(",")]
        tokenizer = None
    else:
        tokenizer = load_tokenizer(tokenizer_dir)
        if args.chat:
            prompt = chat_prompt_ids(tokenizer_dir, tokenizer, args.prompt, args.system)
        else:
            prompt = tokenizer.encode(args.prompt).ids
    decoder, verifier = build_decoder(args, 1, len(prompt) + args.max_new_tokens)
    eos = None
    if not args.ignore_eos:
        chat_ids = chat_stop_token_ids(tokenizer_dir) if args.chat else ()
        eos = tuple(dict.fromkeys((*verifier.config.eos_token_ids, *chat_ids)))
    out: list[int] = []
    row_stats: list = []
    stream = decoder.stream([prompt], args.max_new_tokens, args.seed, eos, row_stats)
    printed = ""
    for step in stream:
        out.extend(step[0])
        if not args.json and tokenizer is not None:
            text = tokenizer.decode(out)
            # print only what is stable (an incomplete multi-byte char decodes to U+FFFD)
            stable = text.rstrip("\ufffd")
            sys.stdout.write(stable[len(printed):])
            sys.stdout.flush()
            printed = stable
    text = tokenizer.decode(out) if tokenizer is not None else None
    stats = row_stats[0]
    if args.json:
        print(json.dumps({"text": text, "token_ids": out, "stats": stats.to_dict(),
                          **decoder.fused_stats()}))
        return
    if tokenizer is None:
        print(out)
    else:
        sys.stdout.write(text[len(printed):] + "\n")
    s = stats
    print(f"\n[{s.generated_tokens} tokens, {s.tokens_per_second:.1f} tok/s, "
          f"acceptance {s.acceptance_rate:.2f}, mean acceptance length "
          f"{s.mean_acceptance_length:.2f}, verify steps {s.verify_steps}]", file=sys.stderr)


def chat_prompt_ids(model_dir: str, tokenizer, user: str, system: str | None) -> list[int]:
    """The chat template's text for one user turn (and an optional system turn), encoded
    without the tokenizer's own special tokens: the template writes them (as transformers'
    ``apply_chat_template(tokenize=True)`` does)."""
    messages = ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user", "content": user}]
    return tokenizer.encode(format_chat(model_dir, messages), add_special_tokens=False).ids
