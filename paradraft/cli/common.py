"""Options and helpers that several subcommands share."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from paradraft.runtime.checkpoints import (
    DEMO_DIR,
    DTYPES,
    heldout_prompts,
    heldout_texts,
    load_draft,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
)
from paradraft.runtime.correction import RULES, RuleParams
from paradraft.runtime.drafters import (
    DRAFTERS,
    MODEL_FREE_DRAFTERS,
    NGRAM_LIMIT,
    SUFFIX_DEPTH_LIMIT,
    AnyDrafter,
    Drafter,
    NgramDrafter,
    SuffixDrafter,
)
from paradraft.runtime.gguf import resolve_checkpoint, sha256_file
from paradraft.runtime.k_policy import parse_draft_len_schedule
from paradraft.runtime.model import Transformer
from paradraft.runtime.tools.calibrate import Calibration


def checkpoint(text: str) -> str:
    """A checkpoint argument: an HF-format dir as it is, a .gguf file as its imported dir
    (imported once into the cache, ``paradraft.runtime.gguf``)."""
    return str(resolve_checkpoint(text))


def add_device_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu",
                   help="torch device of the checkpoints: cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--dtype", choices=list(DTYPES), default=None,
                   help="weights and KV cache (correction maths stay float32); default: the "
                        "checkpoint's torch_dtype on CUDA, float32 on the CPU")


def device_and_dtype(args: argparse.Namespace) -> tuple[torch.device, torch.dtype]:
    """The torch device and dtype of ``--device`` / ``--dtype`` for ``--verifier``."""
    device = resolve_device(args.device)
    return device, resolve_dtype(args.verifier, device, args.dtype)


def rule_params(args: argparse.Namespace, calibration: dict | None = None) -> RuleParams:
    """The rule of the flags. A rule parameter left unset takes the engine's calibrated
    default for that rule (``calibration``: the manifest's), else RuleParams' fixed one."""
    calibrated = Calibration(**calibration).params_for(args.rule) if calibration else {}
    tuned = {name: getattr(args, name) if getattr(args, name) is not None else calibrated.get(
        name, getattr(RuleParams, name)) for name in ("tau", "gamma", "alpha")}
    return RuleParams(
        rule=args.rule, temperature=args.temperature, top_p=args.top_p, **tuned,
        top_p_membership=args.top_p_membership, epsilon=args.epsilon, delta=args.delta,
    )


def add_draft_threads_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft-threads", type=int, default=None, metavar="N",
                   help="threads of the drafting engines (engine dirs). Default: 1 for ONNX "
                        "Runtime graphs (a draft call's nodes are too small to share), all "
                        "cores for llama.cpp (a draft step is a whole model's matmuls)")


def add_ngram_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ngram-min", type=int, default=None, metavar="N",
                   help="the ngram drafter's shortest suffix to look up in the prompt and "
                        f"output (default {NgramDrafter.ngram_min})")
    p.add_argument("--ngram-max", type=int, default=None, metavar="N",
                   help="the ngram drafter's longest suffix, at most "
                        f"{NGRAM_LIMIT} (default {NgramDrafter.ngram_max})")
    p.add_argument("--ngram-batched-min", type=int, default=None, metavar="N",
                   help="the shortest match the ngram drafter drafts from in a round of "
                        "several requests, --ngram-min to --ngram-max (default: --ngram-min)")
    p.add_argument("--ngram-shared", choices=("on", "off"), default=None,
                   type=str.lower,
                   help="the ngram drafter also searches the other cache slots: earlier "
                        "requests' prompts and answers (default: off)")
    p.add_argument("--suffix-depth", type=int, default=None, metavar="N",
                   help="the suffix drafter's longest suffix matched, 1 to "
                        f"{SUFFIX_DEPTH_LIMIT} (default {SuffixDrafter.suffix_depth})")
    p.add_argument("--suffix-min-prob", type=float, default=None, metavar="P",
                   help="the suffix drafter drafts while the share of earlier occurrences "
                        "agreeing with the draft is at least P, in (0, 1] (default "
                        f"{SuffixDrafter.suffix_min_prob})")
    p.add_argument("--suffix-batched-min-prob", type=float, default=None, metavar="P",
                   help="the same with several requests in the round (default "
                        f"{SuffixDrafter.suffix_batched_min_prob})")
    p.add_argument("--suffix-cached-requests", type=int, default=None, metavar="N",
                   help="ended requests (prompt and answer) the suffix drafter searches "
                        "beside the request's own tokens, oldest evicted first; 0: none "
                        f"(default {SuffixDrafter.suffix_cached_requests})")


NGRAM_SIZES = ("ngram_min", "ngram_max", "ngram_batched_min", "ngram_shared")
SUFFIX_OPTIONS = ("suffix_depth", "suffix_min_prob", "suffix_batched_min_prob",
                  "suffix_cached_requests")


def ngram_sizes(args: argparse.Namespace, drafters: list[str]) -> dict[str, int]:
    """The model-free drafters' options from --ngram-* (``Drafter``'s ngram_min, ngram_max,
    ngram_batched_min, ngram_shared) and --suffix-* (SuffixDrafter's fields); unset ones:
    the drafters' defaults. Refused, naming the flag, where that drafter does not run."""
    sizes = {name: getattr(args, name) for name in NGRAM_SIZES + SUFFIX_OPTIONS
             if getattr(args, name, None) is not None}
    if "ngram_shared" in sizes:  # on / off
        sizes["ngram_shared"] = sizes["ngram_shared"] in ("on", True)
    for name in sizes:
        owner = name.split("_")[0]
        if owner not in drafters:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} is for the {owner} drafter; the drafters here: "
                             f"{', '.join(drafters) or 'none'}")
    return sizes


def drafter_options(sizes: dict, kind: str) -> dict:
    """The options of ``sizes`` (``ngram_sizes``) that belong to the drafter ``kind``."""
    return {name: v for name, v in sizes.items() if name.startswith(kind + "_")}


def add_acceptance_floor_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--acceptance-floor", type=float, default=0.6, metavar="RATE",
                   help="warn when the running acceptance rate falls below RATE, in [0, 1] "
                        "(0: never; the acceptance-floor alert)")


def add_draft_len_schedule_arg(p: argparse.ArgumentParser, default: str | None = "auto",
                                more: str = "") -> None:
    p.add_argument("--draft-len-schedule", type=schedule_arg, default=default,
                   metavar="auto|SIZE:K,...", help=f"K per round{more}. 'auto': the "
                   "goodput policy: per round and per drafter, the K of most expected "
                   "tokens/s from that drafter's running acceptance and round costs measured "
                   "at start and refreshed by every round (K = 0, a plain step, when no K "
                   "beats it). Or fixed by running batch size, as TensorRT-LLM's "
                   "draft_len_schedule (1:4,4:2,8:0 = K 4 below 4 requests, 2 below 8, none "
                   "from 8; 1:4 = always 4)")


def schedule_arg(text: str) -> dict[int, int] | str:
    try:
        return parse_draft_len_schedule(text)
    except ValueError as e:  # argparse shows this message, naming the option
        raise argparse.ArgumentTypeError(str(e)) from None


def add_fused_correction_arg(p: argparse.ArgumentParser, several: bool = False) -> None:
    """``--fused-correction``: verify and correct in one engine call (engine dirs whose
    verifier carries the correction graph). ``several``: a comma list, run side by side."""
    what = ("verify and correct in one engine call (the correction graph's CausalCorrection "
            "op): only accepted counts and next tokens leave the engine, not the logits")
    if several:
        p.add_argument("--fused-correction", default="on,off", metavar="MODES",
                       help=f"{what}. A comma list of on, off, auto, each run as its own rows "
                            "for the ONNX Runtime and TensorRT backends (torch and llamacpp "
                            "rows: off, as they have no correction graph); default on,off")
    else:
        p.add_argument("--fused-correction", choices=("on", "off", "auto"), default="auto",
                       help=f"{what}. auto: on where measured faster (docs/engines.md); "
                            "engine dirs only")


def add_rule_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rule", choices=RULES, default="greedy")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    # unset: the engine dir's calibrated default for the rule, else the fixed one
    p.add_argument("--tau", type=float, default=None,
                   help="threshold τ / dynamic τ_base (default: calibrated with --engines, "
                        "else 0.3)")
    p.add_argument("--gamma", type=float, default=None,
                   help="ratio rule γ (default: calibrated with --engines, else 1.0)")
    p.add_argument("--alpha", type=float, default=None, help="dynamic rule α (default 0.1)")
    p.add_argument("--top-p-membership", action="store_true", help="dynamic rule top-p test")
    p.add_argument("--epsilon", type=float, default=0.09, help="typical rule ε")
    p.add_argument("--delta", type=float, default=0.3, help="typical rule δ")


def check_engine_limits(manifest: dict, batch_size: int, seq_len: int, k: int,
                        labels: tuple[str, str, str] = (
                            "batch size", "prompt length + max_new_tokens", "k")) -> None:
    limits = manifest["limits"]
    for label, name, value in zip(labels, ("max_batch_size", "max_seq_len", "max_k"),
                                  (batch_size, seq_len, k), strict=True):
        if value > limits[name]:
            raise ValueError(f"{label} must be <= {limits[name]} (the engines' {name}); "
                             f"got {value}")


def load_drafters(args: argparse.Namespace, verifier: Transformer) -> dict[str, AnyDrafter]:
    """The drafters of ``--drafters``, on the verifier's device and in its dtype."""
    names = args.drafters.split(",")
    for n in names:
        if n not in DRAFTERS:
            raise ValueError(f"drafters must be a comma list of {', '.join(DRAFTERS)}; got {n!r}")
    drafters = {}
    for n in names:
        if n == "self":
            drafters[n] = Drafter("self", verifier, num_layers=args.self_draft_layers)
        elif n in MODEL_FREE_DRAFTERS:
            drafters[n] = Drafter(n, **drafter_options(ngram_sizes(args, names), n))
        else:
            path = need_checkpoint(args, n)
            drafters[n] = Drafter(n, load_draft(path, args.verifier, verifier.config.vocab_size,
                                                dtype=verifier.dtype, device=verifier.device))
    return drafters


def int_list(text: str, name: str, low: int, high: int) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(f"{name} must be a comma list of integers; got {text!r}") from None
    if not values or any(not low <= v <= high for v in values):
        raise ValueError(f"{name} values must be in [{low}, {high}]; got {text!r}")
    return values


def no_default_draft(what: str, flag: str) -> ValueError:
    """The refusal of a model drafter given no checkpoint: with a named verifier (or engines)
    the toy draft is never the default."""
    return ValueError(f"{what} needs {flag} (with --verifier or --engines given there is no "
                      "default draft); the drafters that need no checkpoint: ngram, self")


def demo_draft(drafter: str) -> str:
    """The toy pair's checkpoint for a model drafter (the default when no model is named)."""
    return str(DEMO_DIR / ("parallel_draft" if drafter == "parallel" else "draft"))


def apply_demo_defaults(args: argparse.Namespace) -> None:
    """The toy pair in models/demo is the default only when no model is named at all (the
    fast first try): with --verifier or --engines given, --draft / --parallel-draft have no
    default, so a real verifier never meets the toy draft. Where --engines is given and
    --verifier is not, the verifier stays unset (the engine dir speaks for itself)."""
    if getattr(args, "verifier", None) is not None or getattr(args, "engines", None):
        return
    args.verifier = str(DEMO_DIR / "verifier")
    for name, drafter in (("draft", "model"), ("parallel_draft", "parallel")):
        if hasattr(args, name) and getattr(args, name) is None:
            setattr(args, name, demo_draft(drafter))


def need_checkpoint(args: argparse.Namespace, drafter: str) -> str:
    """The checkpoint of a model drafter (``model`` → --draft, ``parallel`` →
    --parallel-draft), refused by name where none was given."""
    name = "draft" if drafter == "model" else "parallel_draft"
    path = getattr(args, name, None)
    if path is None:
        raise no_default_draft(f"drafter {drafter!r}", "--" + name.replace("_", "-"))
    return path


def check_same_tokenizer(args: argparse.Namespace) -> None:
    """With both --engines and --verifier, refuse a verifier whose tokenizer.json differs
    from the engine dir's (by sha256), naming both: its ids would mean other tokens."""
    engines, verifier = getattr(args, "engines", None), getattr(args, "verifier", None)
    if not engines or not verifier:
        return
    ours, theirs = Path(engines) / "tokenizer.json", Path(verifier) / "tokenizer.json"
    if ours.is_file() and theirs.is_file() and sha256_file(ours) != sha256_file(theirs):
        raise ValueError(f"--verifier {verifier}: its tokenizer.json differs from the engine "
                         f"dir's ({ours}); give the checkpoint the engines were built from")


def need_verifier(args: argparse.Namespace, what: str) -> str:
    if args.verifier is None:
        raise ValueError(f"{what} runs the checkpoint: pass --verifier (HF dir or .gguf)")
    return args.verifier


def add_eval_args(p: argparse.ArgumentParser, name: str) -> None:
    p.add_argument("--verifier", type=checkpoint, default=None,
                   help="HF-format dir or .gguf (default, with no --engines either: the "
                        "demo pair's verifier, draft and parallel draft)")
    p.add_argument("--draft", type=checkpoint, default=None,
                   help="the draft model (no default once --verifier or --engines is given)")
    p.add_argument("--parallel-draft", type=checkpoint, default=None)
    p.add_argument("--self-draft-layers", type=int, default=None)
    p.add_argument("--heldout", default=str(DEMO_DIR), help="dir holding heldout.jsonl")
    p.add_argument("--prompts", type=int, default=8, help="held-out prompts per variant")
    p.add_argument("--prompt-tokens", type=int, default=48)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    add_device_args(p)
    p.add_argument("--out", default=f"results/{name}", help="where the JSON (and plots) go")


def eval_prompt_pairs(args: argparse.Namespace) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, held-out reference continuation ids) pairs, in the engine dir's tokenizer
    where one is given."""
    tokenizer = load_tokenizer(getattr(args, "engines", None) or args.verifier)
    texts = heldout_texts(args.heldout)
    return heldout_prompts(tokenizer, texts, args.prompts, args.prompt_tokens, args.seed)


def eval_prompts(args: argparse.Namespace) -> list[list[int]]:
    return [p for p, _ in eval_prompt_pairs(args)]
