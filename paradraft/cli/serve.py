"""``paradraft serve``: Triton Inference Server with the speculative model, and with
``--openai-port`` an OpenAI-compatible API in front of it; the server options and process
handling that ``demo`` and ``loadtest`` share."""

from __future__ import annotations

import argparse
import shutil
import signal
import socket
import sys
import time
from pathlib import Path

from paradraft.runtime.backends.llamacpp import MAX_SEQUENCES
from paradraft.runtime.backends.manifest import engine_drafter, read_manifest
from paradraft.runtime.checkpoints import DEMO_DIR, DTYPES, chat_template, resolve_device
from paradraft.runtime.correction import RULES
from paradraft.runtime.drafters import DRAFTERS, MODEL_FREE_DRAFTERS
from paradraft.runtime.model import load_config
from paradraft.runtime.serving.openai_api import OpenAIConfig, OpenAIServer, start_openai_server
from paradraft.runtime.serving.protocol import ServeConfig
from paradraft.runtime.serving.server import (
    Server,
    instance_count,
    start_server,
    writing,
)
from paradraft.runtime.tools.calibrate import CALIBRATED, Calibration

from .common import (
    add_acceptance_floor_arg,
    add_draft_len_schedule_arg,
    add_draft_threads_arg,
    add_fused_correction_arg,
    add_ngram_args,
    check_engine_limits,
    checkpoint,
    demo_draft,
    ngram_sizes,
    no_default_draft,
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="start Triton Inference Server with the speculative model")
    add_server_args(p)
    add_openai_args(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address every listener binds (gRPC, HTTP, metrics, OpenAI API)")
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--openai-port", type=int, default=None, metavar="N",
                   help="also serve the OpenAI-compatible API (/v1/completions, "
                   "/v1/chat/completions, /v1/models) on this port")
    p.add_argument("--workdir", type=Path, default=None, help="where the repository goes")
    p.add_argument("--drain-seconds", type=float, default=30.0, metavar="S",
                   help="on SIGTERM, stop admitting (new requests: UNAVAILABLE / 503) and let "
                   "running requests finish for up to S seconds before stopping; SIGINT and "
                   "a second signal stop at once (default 30)")
    p.set_defaults(run=run)


def add_openai_args(s: argparse.ArgumentParser) -> None:
    s.add_argument("--served-model-name", default="paradraft",
                   help="the model id the OpenAI API lists and requests must name")
    s.add_argument("--chat-template", type=Path, default=None, metavar="FILE",
                   help="a Jinja chat template for /v1/chat/completions (default: the "
                   "verifier's chat_template.jinja or tokenizer_config.json)")


def add_server_args(s: argparse.ArgumentParser) -> None:
    s.add_argument("--verifier", type=checkpoint, default=None,
                   help="HF-format dir or .gguf (default, without --engines: the demo pair)")
    s.add_argument("--draft", type=checkpoint, default=None,
                   help="the draft model (the demo draft only when --verifier is not given)")
    s.add_argument("--drafter", choices=DRAFTERS, default=None,
                   help="default: model; with --engines the dir's first of model, parallel, "
                        "self, ngram (one it lacks is refused, naming the ones it has)")
    add_ngram_args(s)
    s.add_argument("--engines", default=None, help="engine dir (ONNX Runtime backend)")
    add_draft_threads_arg(s)
    add_acceptance_floor_arg(s)
    add_fused_correction_arg(s)
    s.add_argument("--device", default=None, metavar="DEVICE[,DEVICE...]",
                   help="where the model instances run: cpu, cuda or cuda:N (cuda = cuda:0); "
                   "a comma list puts --instances on each (cuda:0,cuda:1: one per GPU). "
                   "Default: cpu, or cuda for TensorRT engines")
    s.add_argument("--dtype", choices=list(DTYPES), default=None,
                   help="weights and KV cache of checkpoints; default: the checkpoint's "
                   "torch_dtype on CUDA, float32 on the CPU")
    s.add_argument("--instances", type=int, default=1, metavar="N",
                   help="model instances on each device: each is a process with its own "
                   "--max-slots slots and caches, and Triton spreads requests over them")
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
    add_draft_len_schedule_arg(
        s, None, " (default: auto; for llama.cpp engines with --drafter and --k unset too, "
        "the n-gram lookup at K 16 for one running request and none for more, measured "
        "best on the CPU: docs/serving.md)")
    s.add_argument("--compile", action="store_true",
                   help="run the torch models' draft and verify steps from torch.compile "
                        "graphs (CUDA graphs on a GPU), compiled when the model loads "
                        "(checkpoints only; refused with --engines)")
    s.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="feed every prompt whole (default: a request reuses the K/V a "
                   "finished one left for their common prompt prefix)")
    s.add_argument("--cache-slots", type=int, default=None, metavar="N",
                   help="cache slots beyond --max-slots that only keep finished requests' "
                   "prefixes, least recently used overwritten first (default: 3 x "
                   "--max-slots for llama.cpp engines, whose slots are cheap sequences; "
                   "else 0)")
    s.add_argument("--prefill-chunk", type=int, default=128, metavar="N",
                   help="while requests run, admitted prompts are fed at most N tokens a "
                   "round beside them (0: whole prompts at once)")
    s.add_argument("--stream-interval", type=int, default=1, metavar="N",
                   help="streamed responses after the first carry at least N new tokens "
                   "(fewer responses, each an IPC hop: more throughput, coarser "
                   "streaming)")


def serve_config(args: argparse.Namespace) -> ServeConfig:
    """The server's settings. With ``--engines`` the manifest supplies what the options leave
    unset (slots, sequence length, rule and sampling defaults) and bounds what they set."""
    demo = args.verifier is None  # the toy pair only when no model is named
    verifier = args.verifier = args.verifier or str(DEMO_DIR / "verifier")
    if args.engines:
        manifest = read_manifest(args.engines, verify=False)  # the server process verifies
        limits, defaults = manifest["limits"], dict(manifest["rule_defaults"])
        max_slots = limits["max_batch_size"] if args.max_slots is None else args.max_slots
        max_seq_len = limits["max_seq_len"] if args.max_seq_len is None else args.max_seq_len
        k = min(4, limits["max_k"]) if args.k is None else args.k
        check_engine_limits(manifest, max_slots, max_seq_len, k,
                            ("max_slots", "max_seq_len", "k"))
        check_engine_placement(manifest, args)
        drafter = engine_drafter(manifest, args.engines, args.drafter)
        if backend_default(manifest, args):
            drafter, k = "suffix", min(LLAMACPP_LOOKUP_K, limits["max_k"])
            args.draft_len_schedule = {1: k}
        eos = tuple(manifest["models"]["verifier"]["config"]["eos_token_ids"])
        backend = manifest.get("backend")
        calibrated = calibrated_params(manifest.get("calibration"))
    else:
        defaults, calibrated = {}, {}
        max_slots = 16 if args.max_slots is None else args.max_slots
        max_seq_len = 512 if args.max_seq_len is None else args.max_seq_len
        k = 4 if args.k is None else args.k
        eos = load_model_config_eos(verifier)
        backend = None
        drafter = args.drafter or "model"
    manifest_rule = defaults.pop("rule", "greedy")
    rule = args.rule or manifest_rule  # an explicit --rule keeps the manifest's parameters
    temperature, top_p = defaults.pop("temperature", 1.0), defaults.pop("top_p", 1.0)
    draft = args.draft
    if draft is None and demo:
        draft = demo_draft(drafter)
    elif draft is None and not args.engines and drafter in ("model", "parallel"):
        raise no_default_draft(f"drafter {drafter!r}", "--draft")
    return ServeConfig(verifier=verifier, draft=draft, drafter=drafter,
                       engines=args.engines, k=k, max_slots=max_slots,
                       max_queue=args.max_queue, max_seq_len=max_seq_len,
                       max_input_tokens=max_seq_len - 1, rule=rule, temperature=temperature,
                       top_p=top_p, rule_defaults=defaults, calibrated=calibrated,
                       eos_token_id=eos,
                       disable_by_batch_size=args.speculative_disable_by_batch_size,
                       draft_len_schedule=args.draft_len_schedule or "auto",
                       stream_interval=args.stream_interval, draft_threads=args.draft_threads,
                       acceptance_floor=args.acceptance_floor,
                       fused_correction=args.fused_correction, dtype=args.dtype,
                       compile=args.compile,
                       devices=devices_arg(args.device, backend), instances=args.instances,
                       prefix_cache=args.prefix_cache,
                       cache_slots=cache_slots_arg(args, backend, max_slots),
                       prefill_chunk=args.prefill_chunk or None,
                       # a server with a draft model can draft a request with the n-gram
                       # lookup (its drafter "ngram"), so its sizes apply there too
                       **ngram_sizes(args, [drafter] if drafter in MODEL_FREE_DRAFTERS
                                     else [drafter, "ngram"]))


# llama.cpp engines served on the CPU: a verify pass over n positions costs close to n plain
# steps for small n (its kernels are compute-bound on few cores), so neither the draft model
# nor short, unsure drafts pay; the suffix drafter drafts long where its matches are long and
# its continuations agree, each row verifying only its own drafts (docs/results.md, "Served
# on the CPU against llama-server")
LLAMACPP_LOOKUP_K = 16
# how often `serve` checks that tritonserver, its model instances and the API still run
WATCH_INTERVAL_S = 0.5


def backend_default(manifest: dict, args: argparse.Namespace) -> bool:
    """Whether the llama.cpp default applies: a llamacpp engine dir, and none of --drafter,
    --k and --draft-len-schedule given."""
    return manifest.get("backend") == "llamacpp" and (
        args.drafter, args.k, args.draft_len_schedule) == (None, None, None)


def cache_slots_arg(args: argparse.Namespace, backend: str | None, max_slots: int) -> int:
    """``--cache-slots``: default 3 x max_slots where slots are llama.cpp sequences (K/V
    only, no per-row copy), within llama.cpp's 256 sequences; 0 elsewhere and without the
    prefix cache."""
    if args.prefill_chunk < 0:
        raise ValueError(f"prefill_chunk must be >= 0 (0: whole prompts); got "
                         f"{args.prefill_chunk}")
    if args.cache_slots is not None:
        if args.cache_slots < 0:
            raise ValueError(f"cache_slots must be >= 0; got {args.cache_slots}")
        if backend == "llamacpp" and max_slots + args.cache_slots > MAX_SEQUENCES:
            raise ValueError(f"cache_slots must be in [0, {MAX_SEQUENCES - max_slots}] with "
                             f"llama.cpp engines (at most {MAX_SEQUENCES} sequences with the "
                             f"{max_slots} slots); got {args.cache_slots}")
        return args.cache_slots
    if backend != "llamacpp" or not args.prefix_cache:
        return 0
    return min(3 * max_slots, MAX_SEQUENCES - max_slots)


def calibrated_params(calibration: dict | None) -> dict[str, dict[str, float]]:
    """Per rule with calibrated defaults (threshold, ratio, dynamic), the manifest's
    calibrated parameters as ``generate`` takes them (``Calibration.params_for``); none for
    engines built without a calibration."""
    if not calibration:
        return {}
    values = Calibration(**calibration)
    return {rule: values.params_for(rule) for rule in CALIBRATED}


def devices_arg(text: str | None, backend: str | None = None) -> tuple[str, ...]:
    """``--device``: a comma list of devices, each checked on this machine (``cuda`` where
    CUDA is missing is refused by name). Unset: cpu, or cuda for TensorRT engines."""
    if text is None:
        return ("cuda",) if backend == "tensorrt" else ("cpu",)
    names = tuple(name.strip() for name in text.split(","))
    for name in names:
        resolve_device(name)
    return names


def check_engine_placement(manifest: dict, args: argparse.Namespace) -> None:
    """Engines fix their precision and where they run: ONNX Runtime engines on the CPU,
    TensorRT plans on a GPU; a fused correction needs the verifier's correction graph."""
    if args.dtype is not None:
        raise ValueError(f"dtype: the engines' precision was fixed by `paradraft build`; "
                         f"leave --dtype unset with --engines (got {args.dtype})")
    backend = manifest.get("backend")
    devices = [] if args.device is None else [d.strip() for d in args.device.split(",")]
    for device in devices:
        on_gpu = device.startswith("cuda")
        if backend == "tensorrt" and not on_gpu:
            raise ValueError(f"device must be cuda or cuda:N with TensorRT engines; got "
                             f"{device!r}")
        if backend != "tensorrt" and on_gpu:
            raise ValueError(f"device must be cpu with {backend} engines (ONNX Runtime runs "
                             f"them on the CPU); got {device!r}")
    graphs = manifest["models"]["verifier"].get("graphs", {})
    if args.fused_correction == "on" and "correction" not in graphs:
        raise ValueError(f"fused_correction 'on' needs a verifier engine with a correction "
                         f"graph; {args.engines} has none (use auto or off)")


def load_model_config_eos(model_dir: str) -> tuple[int, ...]:
    return load_config(model_dir).eos_token_ids


class Terminated(KeyboardInterrupt):
    """SIGTERM: an orchestrator's stop, which ``serve`` answers with a drain."""


def interrupt_on_sigterm() -> None:
    """SIGTERM raises Terminated, a KeyboardInterrupt as SIGINT's, so the ``finally`` that
    stops tritonserver runs for both; tritonserver has its own session and never sees them."""
    def interrupt(signum, frame):
        raise Terminated(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def own_server(args: argparse.Namespace, config: ServeConfig) -> Server:
    """Start a server with ``config`` (``serve_config(args)``) on free local ports for demo /
    loadtest (stopped by the caller)."""
    tokenizer = str(Path(args.engines or args.verifier) / "tokenizer.json")
    interrupt_on_sigterm()  # the caller's `finally` stops the server
    print("paradraft: starting tritonserver ...", file=sys.stderr, flush=True)
    return start_server(config, tokenizer, grpc_port=free_port(), http_port=free_port(),
                        metrics_port=free_port())


def has_chat_template(path: Path) -> bool:
    try:
        chat_template(path)
    except ValueError:
        return False
    return True


def chat_dir(args: argparse.Namespace, workdir: Path) -> Path:
    """The dir the OpenAI API reads its tokenizer and chat template from: the engine dir, or
    (when the build did not copy tokenizer_config.json / chat_template.jinja there) the
    verifier checkpoint the manifest names; with ``--chat-template`` a dir assembled in
    ``workdir`` from the tokenizer files and that template."""
    base = Path(args.engines or args.verifier)
    found = base
    if args.engines and not has_chat_template(base):
        source = read_manifest(args.engines, verify=False)["models"]["verifier"].get("source")
        if source and (Path(source) / "tokenizer.json").is_file() and has_chat_template(
                Path(source)):
            found = Path(source)
    if args.chat_template is None:
        return found
    if not args.chat_template.is_file():
        raise FileNotFoundError(f"chat_template: no file {args.chat_template}")
    out = workdir / "chat"
    with writing(workdir):
        out.mkdir(parents=True, exist_ok=True)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if (found / name).is_file():
                shutil.copyfile(found / name, out / name)
        shutil.copyfile(args.chat_template, out / "chat_template.jinja")
    return out


def openai_config(args: argparse.Namespace, config: ServeConfig, server: Server, port: int
                  ) -> OpenAIConfig:
    # the API reaches Triton on the loopback when Triton listens on every address
    grpc_host = "127.0.0.1" if server.host in ("0.0.0.0", "::") else server.host
    return OpenAIConfig(grpc_url=f"{grpc_host}:{server.grpc_port}",
                        tokenizer_dir=str(chat_dir(args, server.workdir)),
                        max_seq_len=config.max_seq_len,
                        served_model_name=args.served_model_name, host=server.host, port=port,
                        max_choices=instance_count(config) * (config.max_slots + config.max_queue))


def own_openai_server(args: argparse.Namespace, config: ServeConfig, server: Server
                      ) -> OpenAIServer:
    """The OpenAI API in front of ``server`` on a free local port (stopped by the caller)."""
    print("paradraft: starting the OpenAI API ...", file=sys.stderr, flush=True)
    return start_openai_server(openai_config(args, config, server, free_port()),
                               log=server.workdir / "openai.log")


def run(args: argparse.Namespace) -> None:
    config = serve_config(args)
    tokenizer = str(Path(args.engines or args.verifier) / "tokenizer.json")
    if not Path(tokenizer).is_file():
        raise FileNotFoundError(f"missing {tokenizer}")
    if args.openai_port is not None and not 1 <= args.openai_port <= 65535:
        raise ValueError(f"openai_port must be in [1, 65535]; got {args.openai_port}")
    if not args.drain_seconds >= 0:
        raise ValueError(f"drain_seconds must be >= 0; got {args.drain_seconds}")
    interrupt_on_sigterm()
    try:  # start_server stops the process itself if interrupted before it is ready
        server = start_server(config, tokenizer, host=args.host, grpc_port=args.grpc_port,
                              http_port=args.http_port, metrics_port=args.metrics_port,
                              workdir=args.workdir)
    except KeyboardInterrupt:
        print("paradraft: interrupted before tritonserver was ready; stopped it", flush=True)
        return
    api = None
    drain = 0.0
    failure = None
    try:  # the ready line is inside: a signal that lands while it prints still stops the server
        if args.openai_port is not None:
            api = start_openai_server(openai_config(args, config, server, args.openai_port),
                                      log=server.workdir / "openai.log")
        openai = f", OpenAI API {api.url}" if api is not None else ""
        print(f"paradraft: Triton ready — gRPC {args.host}:{args.grpc_port}, HTTP "
              f"{args.host}:{args.http_port}, metrics http://{args.host}:{args.metrics_port}"
              f"/metrics{openai} (log {server.log})", flush=True)
        failure = watch(server, api)
        print(f"paradraft: {failure}; stopping", file=sys.stderr, flush=True)
        # the running requests end now (UNAVAILABLE; the API sends an error event) instead of
        # waiting for a model instance that is gone, and readiness fails with the server
        server.kill_group()
    except Terminated:
        drain = args.drain_seconds
    except KeyboardInterrupt:
        pass
    finally:
        code = shut_down(server, api, drain)
    print(f"paradraft: tritonserver stopped ({code})", flush=True)
    if failure is not None:  # non-zero: an orchestrator restarts the server
        raise RuntimeError(failure)


def watch(server: Server, api: OpenAIServer | None) -> str:
    """Wait while the deployment is whole; what broke it."""
    while True:
        if server.process.poll() is not None:
            return f"tritonserver exited by itself ({server.process.returncode}; log " \
                   f"{server.log})"
        if api is not None and api.process.poll() is not None:
            return f"the OpenAI API exited ({api.process.returncode}; log " \
                   f"{server.workdir / 'openai.log'})"
        dead = server.dead_stubs()
        if dead:
            return (f"a model instance's process (triton_python_backend_stub, pid {dead[0]}) "
                    "died: its requests cannot finish and Triton does not notice")
        time.sleep(WATCH_INTERVAL_S)


def shut_down(server: Server, api: OpenAIServer | None, drain_seconds: float) -> int:
    """Stop the OpenAI API and tritonserver. With ``drain_seconds`` the model instances first
    refuse new requests (UNAVAILABLE; the API answers 503) while the running ones finish, for
    up to that long; the API stays up meanwhile, for its own running streams. A signal
    during the drain ends it; whatever still runs then ends as UNAVAILABLE."""
    try:
        if drain_seconds > 0 and server.process.poll() is None:
            print(f"paradraft: draining: new requests are refused; waiting up to "
                  f"{drain_seconds:g} s for the running ones", flush=True)
            drained = server.drain(drain_seconds)
            print("paradraft: drained" if drained else "paradraft: drain deadline passed; "
                  "ending the requests still running", flush=True)
    except KeyboardInterrupt:
        print("paradraft: interrupted; stopping now", flush=True)
    finally:
        if api is not None:
            api.stop()
        code = server.stop()
    return code
