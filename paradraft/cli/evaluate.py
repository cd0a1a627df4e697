"""``paradraft eval`` and ``paradraft tune``: quality per rule against exact sampling, and a rule's
parameter sweep with its speed/quality frontier. ``eval --task humaneval``: HumanEval pass@1,
acceptance and speed per rule (``runtime/tools/task_eval.py``)."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from paradraft.runtime.backends.loader import load_engines
from paradraft.runtime.backends.manifest import engine_drafter, read_manifest
from paradraft.runtime.checkpoints import chat_stop_token_ids, format_chat, load_tokenizer
from paradraft.runtime.correction import RuleParams, check_k, check_range
from paradraft.runtime.model import load_model
from paradraft.runtime.tools import humaneval, task_eval
from paradraft.runtime.tools.calibrate import CALIBRATED, Calibration, calibrate
from paradraft.runtime.tools.evaluate import (
    compare,
    frontier,
    heldout_perplexity,
    measure,
    print_table,
    print_weights_table,
    tune_grid,
    weights_quality,
)

from .common import (
    add_draft_threads_arg,
    add_eval_args,
    add_ngram_args,
    apply_demo_defaults,
    check_engine_limits,
    check_same_tokenizer,
    device_and_dtype,
    eval_prompt_pairs,
    load_drafters,
    ngram_sizes,
)

# tune --task humaneval: how far below the lossless rule's pass@1 (percentage points) a faster
# setting may fall
TUNE_BUDGET_POINTS = 2.0
# the --task humaneval options at their defaults: another task refuses them when set
HUMANEVAL_DEFAULTS = {"row": None, "problems": "all", "samples": 1, "timeout": 10.0,
                      "memory_mb": 1024, "no_progress": False}


def add_parser(sub: argparse._SubParsersAction) -> None:
    for name, helptext in [("eval", "perplexity / diversity per rule vs exact"),
                           ("tune", "sweep a rule's parameters: speed/quality frontier")]:
        e = sub.add_parser(name, help=helptext)
        add_eval_args(e, name)
        e.add_argument("--drafters", default="model",
                       help="the drafter to evaluate with (default model; with --task humaneval "
                            "and --engines, the engine dir's first)")
        add_ngram_args(e)
        e.add_argument("--k", type=int, default=4)
        e.add_argument("--temperature", type=float, default=1.0)
        e.add_argument("--top-p", type=float, default=1.0)
        e.add_argument("--seeds", type=int, default=2)
        e.add_argument("--batch-size", type=int, default=None,
                       help="rows decoded together (default: 8; --task humaneval: 1, the "
                            "speed a single user sees)")
        e.add_argument("--budget", type=float, default=0.10,
                       help="allowed perplexity increase vs exact (0.10 = +10%%)")
        e.add_argument("--diversity-budget", type=float, default=0.10,
                       help="allowed relative distinct-2 drop vs exact: perplexity alone "
                            "rewards text collapsing into repetition")
        if name == "eval":
            e.add_argument("--engines", default=None, metavar="DIR",
                           help="with --reference-engines: this engine dir's verifier (e.g. "
                                "`build --weights int4`) against the reference's: perplexity, "
                                "greedy agreement, top-1 agreement, KL side by side")
            e.add_argument("--reference-engines", default=None, metavar="DIR",
                           help="the fp32 engine dir --engines is measured against")
        else:
            e.add_argument("--engines", default=None, metavar="DIR",
                           help="--task humaneval: answer through this engine dir")
            e.add_argument("--rule", default="dynamic",
                           choices=["dynamic", "threshold", "ratio", "typical"])
        add_humaneval_args(e, tune=name == "tune")
        e.set_defaults(run=run_tune if name == "tune" else run)


def add_humaneval_args(e: argparse.ArgumentParser, tune: bool = False) -> None:
    e.add_argument("--task", choices=("perplexity", "humaneval"), default="perplexity",
                   help=("perplexity: pick --rule's parameters by perplexity / diversity on "
                         "held-out text; humaneval: by pass@1 on HumanEval, the fastest "
                         "setting within --select-within points of the lossless rule"
                         if tune else
                         "perplexity: perplexity / diversity per rule on held-out text; "
                         "humaneval: pass@1, acceptance and speed per rule on HumanEval (with "
                         "--verifier or --engines: a chat model; --engines runs that engine "
                         "dir)"))
    # eval's own defaults (64 tokens, the model drafter) are set in run(), per task
    e.set_defaults(max_new_tokens=None, drafters=None)
    g = e.add_argument_group("--task humaneval")
    g.add_argument("--row", action="append", default=None, metavar="SPEC",
                   help="a rule to measure, as comma-separated key=value: rule, T (or "
                        "temperature), top_p, tau, gamma, alpha, top_p_membership, epsilon, "
                        "delta, k (0: no drafts), e.g. 'rule=threshold,tau=0.3,T=0.8'. "
                        "Repeat for several rows. Unset: --temperature, --top-p, --k, the "
                        "engine dir's calibrated rule defaults, the fixed ones. The lossless "
                        "reference of each temperature (greedy; exact at T > 0) is added. "
                        "Default: " + ("--rule's tune grid" if tune else "rule=greedy"))
    g.add_argument("--problems", default="all", metavar="N|all",
                   help="the first N HumanEval problems, or all 164 (default)")
    g.add_argument("--samples", type=int, default=1,
                   help="answers per problem of a sampling row: pass@1 is the unbiased "
                        "estimator over them (a greedy row answers once)")
    g.add_argument("--timeout", type=float, default=10.0, metavar="SECONDS",
                   help="wall time a problem's tests may run (default 10)")
    g.add_argument("--memory-mb", type=int, default=1024,
                   help="address-space limit of the tests' process (default 1024)")
    g.add_argument("--select-within", type=float,
                   default=TUNE_BUDGET_POINTS if tune else None, metavar="POINTS",
                   help="pick, per lossless reference, the fastest row whose pass@1 is at "
                        "most POINTS percentage points below it" +
                        (f" (default {TUNE_BUDGET_POINTS:g})" if tune else ""))
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_draft_threads_arg(g)


def run(args: argparse.Namespace, tune: bool = False) -> None:
    if getattr(args, "task", None) == "humaneval":
        return run_humaneval(args, tune)
    defaults = {**HUMANEVAL_DEFAULTS, "select_within": TUNE_BUDGET_POINTS if tune else None}
    given = [name for name, default in defaults.items() if getattr(args, name) != default]
    if given:
        raise ValueError(", ".join("--" + n.replace("_", "-") for n in given) +
                         " apply to --task humaneval only")
    if tune and args.engines:
        raise ValueError("--engines: tune answers through an engine dir with --task humaneval "
                         "only")
    if args.max_new_tokens is None:
        args.max_new_tokens = 64
    if args.batch_size is None:
        args.batch_size = 8
    args.drafters = args.drafters or "model"
    apply_demo_defaults(args)
    for name in ("prompts", "seeds", "batch_size", "max_new_tokens"):
        check_range(name, getattr(args, name), 1, 1e6)
    if getattr(args, "engines", None) or getattr(args, "reference_engines", None):
        return run_weights(args)
    check_k(args.k)
    check_range("budget", args.budget, 0.0, 100.0)
    check_range("diversity_budget", args.diversity_budget, 0.0, 1.0)
    device, dtype = device_and_dtype(args)
    verifier = load_model(args.verifier, dtype=dtype, device=device)
    drafter = load_drafters(args, verifier)[args.drafters.split(",")[0]]
    pairs = eval_prompt_pairs(args)
    prompts = [p for p, _ in pairs]
    seeds = list(range(args.seeds))
    common = dict(prompts=prompts, max_new_tokens=args.max_new_tokens, seeds=seeds,
                  batch_size=args.batch_size)
    # the seed rules at defaults calibrated to this verifier (what `build` stores in the
    # engine manifest), next to their fixed defaults
    calibration = calibrate(verifier, prompts, args.max_new_tokens, seed=args.seed)
    print(f"calibrated rule defaults ({calibration.positions} positions): "
          f"threshold tau={calibration.tau:.4f}, dynamic tau={calibration.dynamic_tau:.4f}, "
          f"ratio gamma={calibration.gamma:.4f}")
    if tune:
        settings = [dict(rule=args.rule, **kw) for kw in tune_grid(args.rule)]
    else:
        settings = [dict(rule=r, temperature=args.temperature, top_p=args.top_p)
                    for r in ("greedy", "threshold", "ratio", "dynamic", "typical")]
        settings += [dict(rule=r, temperature=args.temperature, top_p=args.top_p,
                          **calibration.params_for(r)) for r in CALIBRATED]
    # the flags set what a tune grid does not sweep (top_p for most rules)
    sampling = dict(temperature=args.temperature, top_p=args.top_p)
    measured = [(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                          for k, v in kw.items()), RuleParams(**{**sampling, **kw}))
                for kw in settings]
    # a setting is compared against exact sampling at its own temperature and top_p with the
    # same seeds: against another temperature's exact the change would be the temperature's.
    # eval has one such pair; tune's grid sweeps them
    references = list(dict.fromkeys((p.temperature, p.top_p) for _, p in measured))
    baselines, rows = [], []
    for temperature, top_p in references:
        base_params = RuleParams("exact", temperature=temperature, top_p=top_p)
        at = f" T={temperature} top_p={top_p}" if tune else ""
        baseline = measure(verifier, None, base_params, 0,
                           label="autoregressive (exact)" + at, **common)
        group = [measure(verifier, drafter, base_params, args.k, label="exact (lossless)" + at,
                         **common)]
        group += [measure(verifier, drafter, params, args.k, label=label, **common)
                  for label, params in measured
                  if (params.temperature, params.top_p) == (temperature, top_p)]
        compare([baseline, *group], group[0], baseline.tokens_per_second, args.budget,
                args.diversity_budget)
        print_table([baseline, *group],
                    f"quality vs exact at temperature={temperature} top_p={top_p} (budget: "
                    f"perplexity +{args.budget:.0%}, distinct-2 -{args.diversity_budget:.0%}; "
                    f"{len(baseline.sequence_nll)} sequences per setting)")
        low, high = baseline.ppl_change_interval
        print(f"sampling noise: the two lossless samplers differ by "
              f"{baseline.ppl_change_vs_exact:+.1%} [{low:+.1%}, {high:+.1%}] in perplexity; a "
              "Δppl inside such an interval is not resolved by this many sequences\n")
        baselines.append(baseline)
        rows += group
    heldout_ppl = heldout_perplexity(verifier, pairs, args.max_new_tokens)
    print(f"held-out text: the verifier's perplexity on the prompts' reference continuations "
          f"(cut to {args.max_new_tokens} tokens) is {heldout_ppl:.2f}: the reference point for "
          "the perplexities of the generated text above")
    result = {"heldout_text_perplexity": heldout_ppl, "rows": [asdict(r) for r in rows],
              "calibration": calibration.to_dict(),
              "budget": args.budget, "diversity_budget": args.diversity_budget}
    if tune:
        result["baselines"] = [asdict(b) for b in baselines]
        front = frontier(rows)
        ok = [r for r in rows if r.within_budget and r.rule == args.rule]
        best = max(ok, key=lambda r: r.speedup) if ok else None
        print_table(front, "speed/quality frontier (each Δ against the exact row at the "
                    "setting's own temperature and top_p)")
        print("best within budget:", best.label if best else "none")
        result["frontier"] = [r.label for r in front]
        result["best_within_budget"] = asdict(best) if best else None
    else:
        result["baseline"] = asdict(baselines[0])
        result["passing"] = [r.label for r in rows if r.within_budget]
        print("within the budget:", ", ".join(result["passing"]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "tune.json" if tune else "eval.json"
    (out / name).write_text(json.dumps(result, indent=2))
    print(f"wrote {out / name}")


def run_weights(args: argparse.Namespace) -> None:
    """`eval --engines DIR --reference-engines DIR`: the quality cost of an engine dir's
    verifier weights (``build --weights``) against the reference dir's."""
    from paradraft.runtime.backends.loader import load_engines
    from paradraft.runtime.backends.manifest import graph_precisions

    if not (args.engines and args.reference_engines):
        raise ValueError("--engines and --reference-engines go together (the engine dir and "
                         "the fp32 one it is measured against)")
    engines = {}
    for flag, path in (("--reference-engines", args.reference_engines),
                       ("--engines", args.engines)):
        verifier, _, tokenizer, manifest = load_engines(path)
        label = f"{path} ({graph_precisions(manifest)['verifier']})"
        if label in engines:
            label += f" {flag}"
        engines[label] = (verifier, tokenizer, manifest)
    (ref_label, (_, ref_tok, ref_manifest)), (_, (_, _, manifest)) = engines.items()
    if ref_manifest["models"]["verifier"]["config"] != manifest["models"]["verifier"]["config"]:
        raise ValueError(f"--engines {args.engines} and --reference-engines "
                         f"{args.reference_engines} hold different verifiers (configs differ)")
    if ref_tok is None:
        raise ValueError(f"--reference-engines {args.reference_engines}: no tokenizer.json to "
                         "tokenize the held-out prompts with")
    args.verifier = ref_tok.parent  # the prompts in the engines' own tokenizer
    pairs = eval_prompt_pairs(args)
    rows = weights_quality({k: v[0] for k, v in engines.items()}, ref_label, pairs,
                           args.max_new_tokens, args.batch_size)
    print_weights_table(rows, ref_label)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"reference": ref_label, "weights": [asdict(r) for r in rows],
              "precisions": {k: graph_precisions(v[2]) for k, v in engines.items()},
              "prompts": len(pairs), "max_new_tokens": args.max_new_tokens}
    (out / "eval.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {out / 'eval.json'}")


def run_tune(args: argparse.Namespace) -> None:
    run(args, tune=True)


def humaneval_out(out: str, tune: bool = False) -> Path:
    """``--out``: a .json file as it is, or a dir that gets eval_humaneval.json (tune:
    tune_humaneval.json)."""
    path = Path(out)
    name = "tune_humaneval.json" if tune else "eval_humaneval.json"
    return path if path.suffix == ".json" else path / name


def run_humaneval(args: argparse.Namespace, tune: bool = False) -> None:
    """`eval --task humaneval`: every --row (and its lossless reference) answers the problems;
    their pass@1, acceptance and speed, written as JSON with a frontier plot. `tune --task
    humaneval`: the rows are --rule's tune grid, and the pick is the fastest setting within
    --select-within points of pass@1 of the lossless rule at its temperature."""
    if tune and not args.row:
        args.row = [task_eval.row_spec(args.rule, settings) for settings in tune_grid(args.rule)]
    if getattr(args, "reference_engines", None):
        raise ValueError("--reference-engines is the weights comparison of --task perplexity")
    if args.verifier is None and not args.engines:
        raise ValueError("--task humaneval answers through a chat template: pass --verifier "
                         "(HF dir or .gguf) or --engines")
    check_same_tokenizer(args)
    max_new_tokens = 512 if args.max_new_tokens is None else args.max_new_tokens
    check_range("max_new_tokens", max_new_tokens, 1, 1e6)
    batch_size = 1 if args.batch_size is None else args.batch_size
    check_range("batch_size", batch_size, 1, 256)
    check_k(args.k)
    check_range("samples", args.samples, 1, task_eval.MAX_SAMPLES)
    check_range("timeout", args.timeout, 0.0, 3600.0, low_open=True)
    check_range("memory_mb", args.memory_mb, 64, 1 << 20)
    if args.select_within is not None:
        check_range("select_within", args.select_within, 0.0, 100.0)
    total = len(humaneval.problems())
    if args.problems != "all" and not (args.problems.isdigit()
                                       and 1 <= int(args.problems) <= total):
        raise ValueError(f"problems must be N in [1, {total}] or all; got {args.problems!r}")
    problems = humaneval.problems(None if args.problems == "all" else int(args.problems))
    for spec in args.row or []:  # refused before any model loads
        task_eval.parse_row(spec, args.temperature, args.top_p, args.k)
    model_dir = args.engines or args.verifier
    tokenizer = load_tokenizer(model_dir)
    prompts = [tokenizer.encode(format_chat(model_dir, humaneval.chat_request(p)["messages"]),
                                add_special_tokens=False).ids for p in problems]
    calibration = None
    if args.engines:
        manifest = read_manifest(args.engines, verify=False)
        name = engine_drafter(manifest, args.engines, args.drafters)
        sizes = ngram_sizes(args, [name])
        verifier, drafters, _, manifest = load_engines(
            args.engines, args.self_draft_layers, draft_threads=args.draft_threads, **sizes)
        drafter = drafters[name]
        calibration = manifest.get("calibration")
    else:
        name = args.drafters = args.drafters or "model"
        if "," in name:
            raise ValueError(f"--task humaneval runs one drafter; got {name!r}")
        sizes = ngram_sizes(args, [name])
        device, dtype = device_and_dtype(args)
        verifier = load_model(args.verifier, dtype=dtype, device=device)
        drafter = load_drafters(args, verifier)[name]
    defaults = ({rule: Calibration(**calibration).params_for(rule) for rule in CALIBRATED}
                if calibration else None)
    specs = [task_eval.parse_row(spec, args.temperature, args.top_p, args.k, defaults)
             for spec in args.row or ["rule=greedy"]]
    rows = task_eval.with_references(specs, args.k)
    if args.engines:
        check_engine_limits(manifest, batch_size, max(map(len, prompts)) + max_new_tokens,
                            max(r.k for r in rows))
    eos = tuple(dict.fromkeys((*verifier.config.eos_token_ids,
                               *chat_stop_token_ids(model_dir))))
    out = humaneval_out(args.out, tune)
    draft_checkpoint = None if args.engines else {
        "model": args.draft, "parallel": args.parallel_draft}.get(name)
    if draft_checkpoint:
        draft_checkpoint = str(Path(draft_checkpoint).resolve())
    # what an answer depends on besides its row, task and sample: a rerun with other values
    # must not reuse the log's answers
    setup = {"task": "humaneval", "instruction": humaneval.INSTRUCTION,
             "verifier": str(Path(args.verifier).resolve()) if args.verifier else None,
             "engines": str(Path(args.engines).resolve()) if args.engines else None,
             "drafter": name, "draft": draft_checkpoint,
             "ngram": sizes or None, "self_draft_layers": args.self_draft_layers,
             "device": None if args.engines else args.device,
             "dtype": None if args.engines else args.dtype,
             "max_new_tokens": max_new_tokens, "seed": args.seed,
             "timeout_s": args.timeout, "memory_mb": args.memory_mb}
    log = task_eval.AnswerLog(out.with_suffix(".jsonl"), setup)
    results, counts = task_eval.run_humaneval(
        verifier, drafter, rows, problems, prompts, eos, tokenizer.decode, log,
        samples=args.samples, max_new_tokens=max_new_tokens, seed=args.seed,
        timeout_s=args.timeout, memory_mb=args.memory_mb, k=args.k,
        progress=not args.no_progress, batch_size=batch_size)
    task_eval.print_rows(results, f"HumanEval, {len(problems)} problems, {max_new_tokens} new "
                                  f"tokens at most; {counts.decoded} answers decoded, "
                                  f"{counts.reused} reused from {log.path}")
    result = {"task": "humaneval", "setup": setup, "problems": len(problems),
              "samples": args.samples, "k": args.k,
              "interval": "95 % percentile bootstrap over problems",
              "answers_log": str(log.path), "decoded": counts.decoded, "reused": counts.reused,
              "rows": [asdict(r) for r in results]}
    if args.select_within is not None:
        picks = task_eval.select_within(results, args.select_within)
        for p in picks:
            print(f"fastest within {args.select_within:g} points of {p['reference']}: "
                  f"{p['pick']} (pass@1 {p['pass_at_1']:.1%} vs {p['reference_pass_at_1']:.1%},"
                  f" speed-up {p['speedup']:.2f}x)")
        result["selection"] = picks
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    skipped = task_eval.frontier_plot(results, out.with_suffix(".png"))
    print(f"wrote {out}" + (f"; {skipped}" if skipped else f" and {out.with_suffix('.png')}"))
