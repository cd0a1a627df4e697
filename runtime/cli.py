"""The ``paradraft`` command."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from .correction import MAX_K, RULES, RuleParams
from .model import Transformer, load_model
from .speculative import DRAFTERS, Drafter, SpeculativeDecoder, parse_draft_len_schedule

DEMO_DIR = Path(__file__).resolve().parent.parent / "models" / "demo"


def load_tokenizer(model_dir: str | Path):
    from tokenizers import Tokenizer

    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"missing {path}: pass --prompt-ids or add a tokenizer.json")
    return Tokenizer.from_file(str(path))


def rule_params(args: argparse.Namespace) -> RuleParams:
    return RuleParams(
        rule=args.rule, temperature=args.temperature, top_p=args.top_p, tau=args.tau,
        gamma=args.gamma, alpha=args.alpha, top_p_membership=args.top_p_membership,
        epsilon=args.epsilon, delta=args.delta,
    )


def add_draft_threads_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft-threads", type=int, default=1, metavar="N",
                   help="ONNX Runtime intra-op threads of the drafting graphs (engine dirs; "
                        "default 1: a draft call's nodes are too small to share)")


def add_acceptance_floor_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--acceptance-floor", type=float, default=0.6, metavar="RATE",
                   help="warn when the running acceptance rate falls below RATE, in [0, 1] "
                        "(0: never; the seed's monitoring hook)")


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--verifier", default=str(DEMO_DIR / "verifier"), help="HF-format dir")
    p.add_argument("--draft", default=None,
                   help="HF-format dir (default: the demo draft for --drafter model, "
                        "the demo parallel_draft for --drafter parallel)")
    p.add_argument("--drafter", choices=DRAFTERS, default="model")
    p.add_argument("--self-draft-layers", type=int, default=None,
                   help="verifier layers the self-draft uses (default: config or 1)")
    p.add_argument("--engines", default=None,
                   help="engine dir from `paradraft build` (ONNX Runtime backend) instead of "
                        "--verifier/--draft")
    add_draft_threads_arg(p)
    p.add_argument("--k", type=int, default=4, help="draft tokens per round (K)")
    p.add_argument("--adaptive-k", action="store_true", help="per-row K in [1, --k]")
    add_rule_args(p)
    p.add_argument("--audit-epsilon", type=float, default=None,
                   help="enable the attention causal audit with this ε")
    add_acceptance_floor_arg(p)
    p.add_argument("--no-speculation", action="store_true",
                   help="plain autoregressive decoding of the verifier (the baseline)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--seed", type=int, default=0)


def add_rule_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rule", choices=RULES, default="greedy")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--tau", type=float, default=0.3, help="threshold τ / dynamic τ_base")
    p.add_argument("--gamma", type=float, default=1.0, help="ratio rule γ")
    p.add_argument("--alpha", type=float, default=0.1, help="dynamic rule α")
    p.add_argument("--top-p-membership", action="store_true", help="dynamic rule top-p test")
    p.add_argument("--epsilon", type=float, default=0.09, help="typical rule ε")
    p.add_argument("--delta", type=float, default=0.3, help="typical rule δ")


def build_decoder(args: argparse.Namespace, max_batch_size: int, max_seq_len: int
                  ) -> tuple[SpeculativeDecoder, Transformer]:
    if args.engines:
        verifier, drafter = engine_models(args, max_batch_size, max_seq_len)
        return SpeculativeDecoder(
            verifier, drafter, rule_params(args), k=args.k, adaptive_k=args.adaptive_k,
            audit_epsilon=args.audit_epsilon, max_batch_size=max_batch_size,
            max_seq_len=max_seq_len, acceptance_floor=args.acceptance_floor,
        ), verifier
    dtype = getattr(torch, args.dtype)
    verifier = load_model(args.verifier, dtype=dtype)
    drafter = None
    if not args.no_speculation:
        if args.drafter == "self":
            drafter = Drafter("self", verifier, num_layers=args.self_draft_layers)
        else:
            default = DEMO_DIR / ("parallel_draft" if args.drafter == "parallel" else "draft")
            drafter = Drafter(args.drafter, load_model(args.draft or default, dtype=dtype))
    decoder = SpeculativeDecoder(
        verifier, drafter, rule_params(args), k=args.k, adaptive_k=args.adaptive_k,
        audit_epsilon=args.audit_epsilon, max_batch_size=max_batch_size,
        max_seq_len=max_seq_len, acceptance_floor=args.acceptance_floor,
    )
    return decoder, verifier


def engine_models(args: argparse.Namespace, max_batch_size: int, max_seq_len: int
                  ) -> tuple[object, Drafter | None]:
    """The verifier engine and the requested drafter from ``--engines`` (ONNX Runtime)."""
    from .engines import load_engines

    if args.dtype != "float32":
        raise ValueError(f"dtype must be float32 with --engines (fp32 engines); got {args.dtype}")
    if args.audit_epsilon is not None:
        raise ValueError("--audit-epsilon (the attention causal audit) is not supported with "
                         "--engines (ONNX Runtime); use --verifier/--draft (torch)")
    verifier, drafters, _, manifest = load_engines(args.engines, args.self_draft_layers,
                                                   draft_threads=args.draft_threads)
    k = 0 if args.no_speculation else args.k
    check_engine_limits(manifest, max_batch_size, max_seq_len, k)
    if args.no_speculation:
        return verifier, None
    if args.drafter not in drafters:
        raise ValueError(f"drafter {args.drafter!r} was not built into {args.engines}; "
                         f"built: {', '.join(sorted(drafters))}")
    return verifier, drafters[args.drafter]


def check_engine_limits(manifest: dict, batch_size: int, seq_len: int, k: int,
                        labels: tuple[str, str, str] = (
                            "batch size", "prompt length + max_new_tokens", "k")) -> None:
    limits = manifest["limits"]
    for label, name, value in zip(labels, ("max_batch_size", "max_seq_len", "max_k"),
                                  (batch_size, seq_len, k), strict=True):
        if value > limits[name]:
            raise ValueError(f"{label} must be <= {limits[name]} (the engines' {name}); "
                             f"got {value}")


def cmd_build(args: argparse.Namespace) -> None:
    if args.backend == "trtllm":
        from paradraft.build.trtllm import cmd_build_trtllm

        return cmd_build_trtllm(args)
    if args.backend == "tensorrt":  # the same ONNX export, then plans built from it
        from paradraft.build.tensorrt import build_engines

        options = {"precision": args.precision}
    else:
        from paradraft.build.onnx import build_engines

        options = {}
    if args.draft_precision is not None:  # else the backend's default (onnx int8, trt fp32)
        options["draft_precision"] = args.draft_precision

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


def cmd_generate(args: argparse.Namespace) -> None:
    if args.prompt_ids:
        prompt = [int(t) for t in args.prompt_ids.split(",")]
        tokenizer = None
    else:
        tokenizer = load_tokenizer(args.engines or args.verifier)
        prompt = tokenizer.encode(args.prompt).ids
    decoder, verifier = build_decoder(args, 1, len(prompt) + args.max_new_tokens)
    eos = None if args.ignore_eos else verifier.config.eos_token_id
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
        print(json.dumps({"text": text, "token_ids": out, "stats": stats.to_dict()}))
        return
    if tokenizer is None:
        print(out)
    else:
        sys.stdout.write(text[len(printed):] + "\n")
    s = stats
    print(f"\n[{s.generated_tokens} tokens, {s.tokens_per_second:.1f} tok/s, "
          f"acceptance {s.acceptance_rate:.2f}, mean acceptance length "
          f"{s.mean_acceptance_length:.2f}, verify steps {s.verify_steps}]", file=sys.stderr)


def load_drafters(args: argparse.Namespace, verifier: Transformer, dtype: torch.dtype
                  ) -> dict[str, Drafter]:
    names = args.drafters.split(",")
    for n in names:
        if n not in DRAFTERS:
            raise ValueError(f"drafters must be a comma list of {', '.join(DRAFTERS)}; got {n!r}")
    drafters = {}
    for n in names:
        if n == "self":
            drafters[n] = Drafter("self", verifier, num_layers=args.self_draft_layers)
        else:
            path = args.draft if n == "model" else args.parallel_draft
            drafters[n] = Drafter(n, load_model(path, dtype=dtype))
    return drafters


def int_list(text: str, name: str, low: int, high: int) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(f"{name} must be a comma list of integers; got {text!r}") from None
    if not values or any(not low <= v <= high for v in values):
        raise ValueError(f"{name} values must be in [{low}, {high}]; got {text!r}")
    return values


def eval_prompt_pairs(args: argparse.Namespace) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, held-out reference continuation ids) pairs."""
    from .evaluate import heldout_prompts, heldout_texts

    tokenizer = load_tokenizer(args.verifier)
    texts = heldout_texts(args.heldout)
    return heldout_prompts(tokenizer, texts, args.prompts, args.prompt_tokens, args.seed)


def eval_prompts(args: argparse.Namespace) -> list[list[int]]:
    return [p for p, _ in eval_prompt_pairs(args)]


def add_eval_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--verifier", default=str(DEMO_DIR / "verifier"))
    p.add_argument("--draft", default=str(DEMO_DIR / "draft"))
    p.add_argument("--parallel-draft", default=str(DEMO_DIR / "parallel_draft"))
    p.add_argument("--self-draft-layers", type=int, default=None)
    p.add_argument("--heldout", default=str(DEMO_DIR), help="dir holding heldout.jsonl")
    p.add_argument("--prompts", type=int, default=8, help="held-out prompts per variant")
    p.add_argument("--prompt-tokens", type=int, default=48)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="out")


def bench_engines(args: argparse.Namespace, tmp: str, max_k: int
                  ) -> tuple[object, dict[str, Drafter], dict]:
    """The onnx backend's verifier, drafters and manifest: ``--engines`` or a build (with
    the build's defaults, and the bench's largest K as max_k: fused draft graphs for the Ks
    it runs) into ``tmp``."""
    from .engines import load_engines

    names = args.drafters.split(",")
    engine_dir = args.engines
    if engine_dir is None:
        from paradraft.build.onnx import build_engines

        engine_dir = tmp
        build_engines(args.verifier, tmp, args.draft if "model" in names else None,
                      args.parallel_draft if "parallel" in names else None,
                      self_draft_layers=args.self_draft_layers, max_k=max_k)
    verifier, drafters, _, manifest = load_engines(engine_dir, args.self_draft_layers,
                                                   draft_threads=args.draft_threads)
    missing = [n for n in names if n not in drafters]
    if missing:
        raise ValueError(f"drafters {missing} were not built into {engine_dir}; "
                         f"built: {', '.join(sorted(drafters))}")
    return verifier, {n: drafters[n] for n in names}, manifest


def cmd_bench(args: argparse.Namespace) -> None:
    import tempfile

    from .bench import (
        compare_backends,
        compare_hf,
        print_rows,
        run_bench,
        summary,
        write_outputs,
    )

    backends = args.backends.split(",")
    if not backends or any(b not in ("torch", "onnx") for b in backends):
        raise ValueError(f"backends must be a comma list of torch, onnx; got {args.backends!r}")
    ks = int_list(args.ks, "ks", 1, 16)
    batch_sizes = int_list(args.batch_sizes, "batch_sizes", 1, 256)
    if args.repeats < 1:
        raise ValueError(f"repeats must be >= 1; got {args.repeats}")
    prompts = eval_prompts(args)
    rows = []
    draft_precision = None  # of the onnx engines' drafting graphs
    with tempfile.TemporaryDirectory(prefix="paradraft-engines-") as tmp:
        for i, backend in enumerate(backends):
            if backend == "torch":
                verifier = load_model(args.verifier)
                drafters = load_drafters(args, verifier, torch.float32)
            else:
                verifier, drafters, manifest = bench_engines(args, tmp, min(max(ks), MAX_K))
                draft_precision = manifest.get("draft_precision", "float32")
            # the transformers peers run once, with the first backend
            hf_dirs = None if args.no_hf or i else (args.verifier, args.draft)
            backend_rows = run_bench(verifier, drafters, prompts, args.max_new_tokens,
                                     batch_sizes, ks, hf_dirs, seed=args.seed,
                                     temperature=args.temperature, repeats=args.repeats)
            for r in backend_rows:  # the peers run transformers' own code on torch
                r.backend = backend if r.system == "ours" else "torch"
            rows += backend_rows
    compare_hf(rows)  # every backend against the transformers peers (run once)
    ratios = compare_backends(rows)
    meta = {"prompts": len(prompts), "prompt_tokens": args.prompt_tokens,
            "max_new_tokens": args.max_new_tokens, "torch_threads": torch.get_num_threads(),
            "verifier": args.verifier, "draft": args.draft,
            "parallel_draft": args.parallel_draft, "temperature": args.temperature,
            "backends": backends, "repeats": args.repeats, "vs_torch": ratios,
            "onnx_draft_precision": draft_precision}
    write_outputs(rows, Path(args.out), meta)
    print_rows(rows)
    print(json.dumps(summary(rows), indent=2))
    if ratios:
        print("tokens/s relative to the torch backend:", json.dumps(ratios, indent=2))
    print(f"wrote {Path(args.out) / 'bench.json'} and bench.png")


def cmd_eval(args: argparse.Namespace, tune: bool = False) -> None:
    from dataclasses import asdict

    from .correction import check_k, check_range
    from .evaluate import (
        compare,
        frontier,
        heldout_perplexity,
        measure,
        print_table,
        tune_grid,
    )

    for name in ("prompts", "seeds", "batch_size", "max_new_tokens"):
        check_range(name, getattr(args, name), 1, 1e6)
    check_k(args.k)
    check_range("budget", args.budget, 0.0, 100.0)
    check_range("diversity_budget", args.diversity_budget, 0.0, 1.0)
    verifier = load_model(args.verifier)
    drafter = load_drafters(args, verifier, torch.float32)[args.drafters.split(",")[0]]
    pairs = eval_prompt_pairs(args)
    prompts = [p for p, _ in pairs]
    seeds = list(range(args.seeds))
    common = dict(prompts=prompts, max_new_tokens=args.max_new_tokens, seeds=seeds,
                  batch_size=args.batch_size)
    if tune:
        settings = [dict(rule=args.rule, **kw) for kw in tune_grid(args.rule)]
    else:
        settings = [dict(rule=r, temperature=args.temperature, top_p=args.top_p)
                    for r in ("greedy", "threshold", "ratio", "dynamic", "typical")]
    # the flags set what a tune grid does not sweep (top_p for most rules)
    sampling = dict(temperature=args.temperature, top_p=args.top_p)
    measured = [(" ".join(f"{k}={v}" for k, v in kw.items()), RuleParams(**{**sampling, **kw}))
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


def schedule_arg(text: str) -> dict[int, int] | str:
    try:
        return parse_draft_len_schedule(text)
    except ValueError as e:  # argparse shows this message, naming the option
        raise argparse.ArgumentTypeError(str(e)) from None


def serve_config(args: argparse.Namespace):
    """The server's settings. With ``--engines`` the manifest supplies what the options leave
    unset (slots, sequence length, rule and sampling defaults) and bounds what they set."""
    from .serve import ServeConfig

    verifier = args.verifier
    if args.engines:
        from paradraft.build.manifest import read_manifest

        manifest = read_manifest(args.engines, verify=False)  # the server process verifies
        limits, defaults = manifest["limits"], dict(manifest["rule_defaults"])
        max_slots = limits["max_batch_size"] if args.max_slots is None else args.max_slots
        max_seq_len = limits["max_seq_len"] if args.max_seq_len is None else args.max_seq_len
        k = min(4, limits["max_k"]) if args.k is None else args.k
        check_engine_limits(manifest, max_slots, max_seq_len, k,
                            ("max_slots", "max_seq_len", "k"))
        eos = manifest["models"]["verifier"]["config"]["eos_token_id"]
    else:
        defaults = {}
        max_slots = 16 if args.max_slots is None else args.max_slots
        max_seq_len = 512 if args.max_seq_len is None else args.max_seq_len
        k = 4 if args.k is None else args.k
        eos = load_model_config_eos(verifier)
    manifest_rule = defaults.pop("rule", "greedy")
    rule = args.rule or manifest_rule  # an explicit --rule keeps the manifest's parameters
    temperature, top_p = defaults.pop("temperature", 1.0), defaults.pop("top_p", 1.0)
    draft = args.draft or str(DEMO_DIR / ("parallel_draft" if args.drafter == "parallel"
                                          else "draft"))
    return ServeConfig(verifier=verifier, draft=draft, drafter=args.drafter,
                       engines=args.engines, k=k, max_slots=max_slots,
                       max_queue=args.max_queue, max_seq_len=max_seq_len,
                       max_input_tokens=max_seq_len - 1, rule=rule, temperature=temperature,
                       top_p=top_p, rule_defaults=defaults, eos_token_id=eos,
                       disable_by_batch_size=args.speculative_disable_by_batch_size,
                       draft_len_schedule=args.draft_len_schedule,
                       stream_interval=args.stream_interval, draft_threads=args.draft_threads,
                       acceptance_floor=args.acceptance_floor)


def load_model_config_eos(model_dir: str) -> int | None:
    from .model import load_config

    return load_config(model_dir).eos_token_id


def interrupt_on_sigterm() -> None:
    """SIGTERM raises KeyboardInterrupt, as SIGINT does, so the ``finally`` that stops
    tritonserver runs for both; tritonserver has its own session and never sees them."""
    import signal

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)


def cmd_serve(args: argparse.Namespace) -> None:
    import time

    from .serve import start_server

    config = serve_config(args)
    tokenizer = str(Path(args.engines or args.verifier) / "tokenizer.json")
    if not Path(tokenizer).is_file():
        raise FileNotFoundError(f"missing {tokenizer}")
    interrupt_on_sigterm()
    try:  # start_server stops the process itself if interrupted before it is ready
        server = start_server(config, tokenizer, host=args.host, grpc_port=args.grpc_port,
                              http_port=args.http_port, metrics_port=args.metrics_port,
                              workdir=args.workdir)
    except KeyboardInterrupt:
        print("paradraft: interrupted before tritonserver was ready; stopped it", flush=True)
        return
    try:  # the ready line is inside: a signal that lands while it prints still stops the server
        print(f"paradraft: Triton ready — gRPC {args.host}:{args.grpc_port}, HTTP "
              f"{args.host}:{args.http_port}, metrics http://{args.host}:{args.metrics_port}"
              f"/metrics (log {server.log})", flush=True)
        while server.process.poll() is None:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        code = server.stop()
    print(f"paradraft: tritonserver stopped ({code})", flush=True)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def own_server(args: argparse.Namespace, config):
    """Start a server with ``config`` (``serve_config(args)``) on free local ports for demo /
    loadtest (stopped by the caller)."""
    from .serve import start_server

    tokenizer = str(Path(args.engines or args.verifier) / "tokenizer.json")
    interrupt_on_sigterm()  # the caller's `finally` stops the server
    print("paradraft: starting tritonserver ...", file=sys.stderr, flush=True)
    return start_server(config, tokenizer, grpc_port=free_port(), http_port=free_port(),
                        metrics_port=free_port())


def cmd_demo(args: argparse.Namespace) -> None:
    from .serve import complete

    server = own_server(args, serve_config(args))
    try:
        print(f"paradraft: Triton ready on {server.grpc_url}; streaming one completion over "
              f"gRPC\n", file=sys.stderr, flush=True)
        sys.stdout.write(args.prompt)

        def show(text: str) -> None:
            sys.stdout.write(text)
            sys.stdout.flush()

        r = complete(server.grpc_url, args.prompt, args.max_tokens, stream=True, on_text=show)
        tokens = sum(r.chunk_tokens)
        print(f"\n\n[{tokens} tokens in {len(r.chunks)} streamed responses; acceptance rate "
              f"{r.acceptance_rate:.2f} ({r.total_accepted_draft_tokens}/"
              f"{r.total_draft_tokens} draft tokens); first response after "
              f"{r.first_token_s * 1e3:.0f} ms; {tokens / r.chunk_times[-1]:.1f} tok/s]",
              flush=True)
    finally:
        server.stop()
        print("paradraft: tritonserver stopped", file=sys.stderr)


def cmd_loadtest(args: argparse.Namespace) -> None:
    from .evaluate import heldout_texts
    from .loadtest import print_results, run_loadtest, write_outputs

    levels = int_list(args.concurrency, "concurrency", 1, 256)
    if args.requests < 1:
        raise ValueError(f"requests must be >= 1; got {args.requests}")
    if args.repeats < 1:
        raise ValueError(f"repeats must be >= 1; got {args.repeats}")
    prompts = [t[:200] for t in heldout_texts(args.heldout)]
    # the settings of the server this run starts; a server at --url has its own
    config = None if args.url else serve_config(args)
    server = None if args.url else own_server(args, config)
    try:  # straight after the start: a signal from here on still stops the server
        url = args.url or server.grpc_url
        results = run_loadtest(url, prompts, levels, args.requests, args.max_tokens,
                               args.repeats)
    finally:
        if server is not None:
            server.stop()
    data = write_outputs(results, Path(args.out), {
        "url": url, "requests_per_level": args.requests, "repeats": args.repeats,
        "max_tokens": args.max_tokens, "engines": args.engines,
        "max_slots": config and config.max_slots, "k": config and config.k,
        "drafter": args.drafter,
        "speculative_disable_by_batch_size": args.speculative_disable_by_batch_size,
        "draft_len_schedule": args.draft_len_schedule, "stream_interval": args.stream_interval})
    print_results(results)
    print(json.dumps(data["summary"], indent=2))
    print(f"wrote {Path(args.out) / 'loadtest.json'} and loadtest.png")


def cmd_query(args: argparse.Namespace) -> None:
    from .serve import complete

    def show(text: str) -> None:
        if args.stream and not args.json:
            sys.stdout.write(text)
            sys.stdout.flush()

    optional = dict(temperature=args.temperature, top_p=args.top_p, random_seed=args.seed,
                    num_draft_tokens=args.num_draft_tokens, correction_rule=args.rule,
                    stop_words=args.stop_words)
    result = complete(args.url, args.prompt, args.max_tokens, stream=args.stream,
                      on_text=show, **optional)
    stats = {"acceptance_rate": result.acceptance_rate,
             "total_accepted_draft_tokens": result.total_accepted_draft_tokens,
             "total_draft_tokens": result.total_draft_tokens,
             "responses": len(result.chunks), "first_response_s": result.first_token_s}
    if args.json:
        print(json.dumps({"text": result.text, "stats": stats}))
    else:
        if not args.stream:
            sys.stdout.write(result.text)
        print(f"\n[{stats}]", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="paradraft", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="speculative generation for one prompt")
    add_model_args(g)
    g.add_argument("--prompt", default="def ")
    g.add_argument("--prompt-ids", default=None, help="comma-separated token ids (no tokenizer)")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    b = sub.add_parser("bench", help="speed-up / acceptance side by side with transformers")
    add_eval_args(b)
    b.add_argument("--drafters", default="model,parallel,self")
    b.add_argument("--ks", default="1,2,3,4,5,6,7,8")
    b.add_argument("--batch-sizes", default="1,4,16")
    b.add_argument("--temperature", type=float, default=1.0, help="for the sampling rows")
    b.add_argument("--no-hf", action="store_true", help="skip the transformers peers")
    b.add_argument("--repeats", type=int, default=1,
                   help="run the whole plan this many times in turn; tokens/s are medians, "
                   "ratios the medians of per-repeat ratios")
    b.add_argument("--backends", default="torch",
                   help="comma list of torch, onnx: run our variants on each, side by side")
    b.add_argument("--engines", default=None,
                   help="engine dir for the onnx backend (default: build into a temp dir)")
    add_draft_threads_arg(b)
    bd = sub.add_parser("build", help="export the verifier and drafts to an engine dir")
    bd.add_argument("--verifier", default=None,
                    help="HF-format dir (default: the demo verifier, draft and parallel_draft)")
    bd.add_argument("--draft", default=None, help="HF-format dir of the draft model")
    bd.add_argument("--parallel-draft", default=None, help="HF-format dir (PARD-style draft)")
    bd.add_argument("--self-draft-layers", type=int, default=None,
                    help="verifier layers of the self-draft graph (default: config or 1)")
    bd.add_argument("--backend", choices=["onnx", "tensorrt", "trtllm"], default="onnx")
    bd.add_argument("--out", default="engines", help="engine dir to write")
    bd.add_argument("--max-batch-size", type=int, default=8)
    bd.add_argument("--max-k", type=int, default=8)
    bd.add_argument("--max-seq-len", type=int, default=512)
    bd.add_argument("--dtype", choices=["float32"], default="float32")
    bd.add_argument("--precision", choices=["fp32", "fp16", "bf16"], default="fp32",
                    help="math inside the TensorRT plans (--backend tensorrt; I/O stays fp32)")
    bd.add_argument("--draft-precision", choices=["int8", "float32"], default=None,
                    help="weights of the drafting graphs (drafts, self-draft) for --backend "
                         "onnx: int8 (default; the verifier decides, so output is unchanged) "
                         "or float32; --backend tensorrt takes float32 (use --precision)")
    add_rule_args(bd)  # the rule defaults the correction graph carries
    for name, helptext in [("eval", "perplexity / diversity per rule vs exact"),
                           ("tune", "sweep a rule's parameters: speed/quality frontier")]:
        e = sub.add_parser(name, help=helptext)
        add_eval_args(e)
        e.add_argument("--drafters", default="model", help="the drafter to evaluate with")
        e.add_argument("--k", type=int, default=4)
        e.add_argument("--temperature", type=float, default=1.0)
        e.add_argument("--top-p", type=float, default=1.0)
        e.add_argument("--seeds", type=int, default=2)
        e.add_argument("--batch-size", type=int, default=8)
        e.add_argument("--budget", type=float, default=0.10,
                       help="allowed perplexity increase vs exact (0.10 = +10%%)")
        e.add_argument("--diversity-budget", type=float, default=0.10,
                       help="allowed relative distinct-2 drop vs exact: perplexity alone "
                            "rewards text collapsing into repetition")
        if name == "tune":
            e.add_argument("--rule", default="dynamic",
                           choices=["dynamic", "threshold", "ratio", "typical"])
    def add_server_args(s: argparse.ArgumentParser) -> None:
        s.add_argument("--verifier", default=str(DEMO_DIR / "verifier"))
        s.add_argument("--draft", default=None)
        s.add_argument("--drafter", choices=DRAFTERS, default="model")
        s.add_argument("--engines", default=None, help="engine dir (ONNX Runtime backend)")
        add_draft_threads_arg(s)
        add_acceptance_floor_arg(s)
        s.add_argument("--k", type=int, default=None,
                       help="draft tokens per round (default: 4, at most the engines' max_k)")
        s.add_argument("--rule", choices=RULES, default=None,
                       help="default rule (default: the engines' manifest, else greedy)")
        s.add_argument("--max-slots", type=int, default=None,
                       help="KV-cache slots, the batch (default: the engines' max_batch_size, "
                       "else 16)")
        s.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot")
        s.add_argument("--max-seq-len", type=int, default=None,
                       help="default: the engines' max_seq_len, else 512")
        s.add_argument("--speculative-disable-by-batch-size", type=int, default=None,
                       metavar="N", help="rounds with >= N running requests decode without "
                       "drafts (a saturated device gains nothing from speculation)")
        s.add_argument("--draft-len-schedule", type=schedule_arg, default=None,
                       metavar="auto|SIZE:K,...", help="K by running batch size, as "
                       "TensorRT-LLM's draft_len_schedule (1:4,4:2,8:0 = K 4 below 4 requests, "
                       "2 below 8, none from 8), or 'auto': per round the K of most expected "
                       "tokens/s from the running acceptance and round times measured at start")
        s.add_argument("--stream-interval", type=int, default=1, metavar="N",
                       help="streamed responses after the first carry at least N new tokens "
                       "(fewer responses through the ensemble: more throughput, coarser "
                       "streaming)")

    s = sub.add_parser("serve", help="start Triton Inference Server with the speculative model")
    add_server_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--grpc-port", type=int, default=8001)
    s.add_argument("--http-port", type=int, default=8000)
    s.add_argument("--metrics-port", type=int, default=8002)
    s.add_argument("--workdir", type=Path, default=None, help="where the repository goes")
    d = sub.add_parser("demo", help="the whole pipeline: start Triton, stream one completion "
                                    "over gRPC, print the stats, stop the server")
    add_server_args(d)
    d.add_argument("--prompt", default="def fibonacci(n):")
    d.add_argument("--max-tokens", type=int, default=64)
    lt = sub.add_parser("loadtest", help="bounded-concurrency gRPC streaming load test")
    add_server_args(lt)
    lt.add_argument("--url", default=None, help="a running server (default: start one)")
    lt.add_argument("--concurrency", default="1,4,8,16")
    lt.add_argument("--requests", type=int, default=32, help="requests per level")
    lt.add_argument("--repeats", type=int, default=3,
                    help="run the levels in turn this many times; ratios are medians")
    lt.add_argument("--max-tokens", type=int, default=64)
    lt.add_argument("--heldout", default=str(DEMO_DIR), help="dir holding heldout.jsonl")
    lt.add_argument("--out", default="out")
    q = sub.add_parser("query", help="stream a completion from a paradraft Triton server")
    q.add_argument("--url", default="127.0.0.1:8001", help="gRPC HOST:PORT")
    q.add_argument("--prompt", required=True)
    q.add_argument("--max-tokens", type=int, default=64)
    q.add_argument("--stream", action="store_true")
    q.add_argument("--json", action="store_true")
    q.add_argument("--rule", choices=RULES, default=None)
    q.add_argument("--temperature", type=float, default=None)
    q.add_argument("--top-p", type=float, default=None)
    q.add_argument("--seed", type=int, default=None)
    q.add_argument("--num-draft-tokens", type=int, default=None)
    q.add_argument("--stop-word", action="append", default=None, dest="stop_words",
                   help="end the completion once its tokens contain this word's (repeatable)")
    args = parser.parse_args(argv)
    commands = {
        "generate": cmd_generate, "build": cmd_build, "bench": cmd_bench,
        "eval": cmd_eval, "tune": lambda a: cmd_eval(a, tune=True), "serve": cmd_serve,
        "query": cmd_query, "demo": cmd_demo, "loadtest": cmd_loadtest,
    }
    try:
        commands[args.command](args)
    except (ValueError, FileNotFoundError, RuntimeError, TimeoutError) as e:
        parser.exit(2, f"paradraft: error: {e}\n")


if __name__ == "__main__":
    main()
