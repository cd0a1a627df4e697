"""Triton Inference Server deployment: the model repository, the server process, the client.

``paradraft serve`` writes a model repository from the templates in ``triton_repo/``
(preprocessing → paradraft → postprocessing, chained by an ensemble) and runs a real
``tritonserver``. On a CPU machine that is the binary bundled in the ``nvidia-pytriton`` wheel
(the Makefile unpacks it into ``.venv/pytriton``); in an NGC container it is the one on PATH.
The request parsing and the decoder set-up live here (plain Python, tested in process); the
Triton Python model in ``triton_repo/paradraft/1/model.py`` is a thin adapter around them.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from .correction import RULES, RuleParams, check_range
from .speculative import check_draft_len_schedule

TEMPLATES = Path(__file__).resolve().parent.parent / "triton_repo"
MODELS = ("preprocessing", "paradraft", "postprocessing", "ensemble")


@dataclass
class ServeConfig:
    """What the paradraft Triton model builds; written as JSON into the model repository."""

    verifier: str
    draft: str | None
    drafter: str = "model"  # model | parallel | self
    engines: str | None = None  # an engine dir (ONNX Runtime backend) instead of checkpoints
    k: int = 4
    max_slots: int = 16
    max_queue: int = 64
    max_seq_len: int = 512
    max_input_tokens: int = 384
    rule: str = "greedy"
    temperature: float = 1.0
    top_p: float = 1.0
    eos_token_id: int | None = None
    rule_defaults: dict = field(default_factory=dict)
    # rounds with at least this many running requests decode without drafts (None: never)
    disable_by_batch_size: int | None = None
    # the round's K by batch size: TensorRT-LLM's {threshold: K}, or "auto" (goodput policy,
    # calibrated when the model loads); None: K every round
    draft_len_schedule: dict[int, int] | str | None = None
    # a streamed request's first tokens go out at once, later ones once this many have
    # gathered (SGLang's --stream-interval): each response is an IPC hop through the
    # ensemble, which a busy CPU pays for in throughput
    stream_interval: int = 1
    draft_threads: int = 1  # ONNX Runtime intra-op threads of the drafting graphs
    acceptance_floor: float = 0.6  # warn when the running acceptance rate falls below

    def __post_init__(self) -> None:
        for name, low in [("k", 1), ("max_slots", 1), ("max_queue", 0), ("max_seq_len", 2),
                          ("max_input_tokens", 1), ("stream_interval", 1),
                          ("draft_threads", 1)]:
            value = getattr(self, name)
            if not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}; got {value!r}")
        check_range("acceptance_floor", self.acceptance_floor, 0.0, 1.0)
        if self.disable_by_batch_size is not None and (
                not isinstance(self.disable_by_batch_size, int) or self.disable_by_batch_size < 1):
            raise ValueError("speculative_disable_by_batch_size must be an integer >= 1 or "
                             f"unset; got {self.disable_by_batch_size!r}")
        if isinstance(self.draft_len_schedule, dict):  # JSON keys arrive as strings
            try:
                self.draft_len_schedule = {int(size): n for size, n
                                           in self.draft_len_schedule.items()}
            except ValueError:
                raise ValueError("draft_len_schedule keys must be batch sizes; got "
                                 f"{self.draft_len_schedule!r}") from None
        check_draft_len_schedule(self.draft_len_schedule, self.k)
        if self.max_input_tokens >= self.max_seq_len:
            raise ValueError(f"max_input_tokens must be in [1, {self.max_seq_len - 1}] "
                             f"(below max_seq_len); got {self.max_input_tokens}")
        if self.drafter not in ("model", "parallel", "self"):
            raise ValueError(f"drafter must be one of model, parallel, self; "
                             f"got {self.drafter!r}")
        default_params(self)  # rule, temperature, top_p and rule defaults, validated


def build_scheduler(config: ServeConfig):
    """The decoder behind the server: in-flight batching over ``max_slots`` cache slots."""
    from .model import load_model
    from .scheduler import Scheduler
    from .speculative import Drafter, SpeculativeDecoder

    if config.engines:
        from .engines import load_engines

        verifier, drafters, _, manifest = load_engines(config.engines,
                                                       draft_threads=config.draft_threads)
        if manifest["backend"] == "tensorrt":  # plan profiles are hard limits: refuse at start
            from .trt_backend import check_limits

            check_limits(manifest, config.max_slots, config.max_seq_len, config.k)
        drafter = drafters[config.drafter]
    else:
        verifier = load_model(config.verifier)
        if config.drafter == "self":
            drafter = Drafter("self", verifier)
        else:
            drafter = Drafter(config.drafter, load_model(config.draft))
    decoder = SpeculativeDecoder(
        verifier, drafter, default_params(config), k=config.k,
        max_batch_size=config.max_slots, max_seq_len=config.max_seq_len,
        disable_by_batch_size=config.disable_by_batch_size,
        draft_len_schedule=config.draft_len_schedule, acceptance_floor=config.acceptance_floor,
    )
    if config.draft_len_schedule == "auto":
        decoder.calibrate()  # before the scheduler owns the slots
    return Scheduler(decoder, max_queue=config.max_queue)


def default_params(config: ServeConfig) -> RuleParams:
    return RuleParams(config.rule, temperature=config.temperature, top_p=config.top_p,
                      **config.rule_defaults)


@dataclass
class ParsedRequest:
    prompt: list[int]
    max_new_tokens: int
    params: RuleParams
    num_draft_tokens: int
    seed: int
    eos_token_id: int | None
    stream: bool
    stop_sequences: list[list[int]]


# TensorRT-LLM ensemble inputs that change nothing at these values, which its clients send
# by default: accepted so those clients work unchanged, anything else refused by name
NEUTRAL_INPUTS = {
    "beam_width": (int, {1}, "1 (no beam search)"),
    "top_k": (int, {0, 1}, "0 (off) or 1 (greedy)"),
    "min_length": (int, {0, 1}, "0 or 1"),
    "repetition_penalty": (float, {1.0}, "1.0"),
    "presence_penalty": (float, {0.0}, "0.0"),
    "frequency_penalty": (float, {0.0}, "0.0"),
    "exclude_input_in_output": (bool, {True}, "true (text_output is the generated text only)"),
    "return_log_probs": (bool, {False}, "false"),
    "return_context_logits": (bool, {False}, "false"),
    "return_generation_logits": (bool, {False}, "false"),
}
IGNORED_INPUTS = {"pad_id": int, "length_penalty": float}  # no padding, no beams here
MAX_STOP_WORDS, MAX_STOP_WORD_TOKENS = 16, 32
# every input of the paradraft model that parse_request reads (triton_repo/paradraft)
REQUEST_INPUTS = ("input_ids", "max_tokens", "stream", "temperature", "top_p", "random_seed",
                  "num_draft_tokens", "end_id", "correction_rule", "tau", "gamma", "alpha",
                  "epsilon", "delta", "stop_words_ids", "stop_words_lengths",
                  *NEUTRAL_INPUTS, *IGNORED_INPUTS)


def scalar(inputs: dict[str, np.ndarray], name: str, kind: type):
    """One value of an optional input, or None; a wrong shape or dtype names the input."""
    if name not in inputs:
        return None
    value = np.asarray(inputs[name])
    if value.size != 1:
        raise ValueError(f"{name} must hold exactly one value; got shape {list(value.shape)}")
    item = value.reshape(-1)[0]
    if kind is str:
        return item.decode("utf-8", "replace") if isinstance(item, bytes) else str(item)
    if kind is bool:
        if value.dtype != np.bool_:
            raise ValueError(f"{name} must be BOOL; got {value.dtype}")
        return bool(item)
    if kind is int and not np.issubdtype(value.dtype, np.integer):
        raise ValueError(f"{name} must be an integer tensor; got {value.dtype}")
    if kind is float and not np.issubdtype(value.dtype, np.floating):
        raise ValueError(f"{name} must be a float tensor; got {value.dtype}")
    return kind(item)


def parse_request(inputs: dict[str, np.ndarray], config: ServeConfig) -> ParsedRequest:
    """Validate one request's tensors (TensorRT-LLM names plus ours) against the limits."""
    if "input_ids" not in inputs or "max_tokens" not in inputs:
        raise ValueError("input_ids and max_tokens are required")
    prompt = np.asarray(inputs["input_ids"]).reshape(-1).astype(np.int64).tolist()
    if not prompt:
        raise ValueError("the prompt is empty")
    max_tokens = scalar(inputs, "max_tokens", int)
    room = config.max_seq_len - len(prompt)
    if not 1 <= max_tokens <= room:
        raise ValueError(f"max_tokens must be in [1, {room}] for this prompt "
                         f"({len(prompt)} tokens, max_seq_len {config.max_seq_len}); "
                         f"got {max_tokens}")
    rule = scalar(inputs, "correction_rule", str)
    temperature = scalar(inputs, "temperature", float)
    top_p = scalar(inputs, "top_p", float)
    neutral = {name: scalar(inputs, name, kind) for name, (kind, _, _) in NEUTRAL_INPUTS.items()}
    for name, value in neutral.items():
        allowed, text = NEUTRAL_INPUTS[name][1:]
        if value is not None and value not in allowed:
            raise ValueError(f"{name} must be {text} on paradraft; got {value}")
    for name, kind in IGNORED_INPUTS.items():
        scalar(inputs, name, kind)  # the type is still checked
    if neutral["top_k"] == 1:  # TensorRT-LLM's clients ask for greedy so
        if rule not in (None, "greedy"):
            raise ValueError(f"top_k 1 asks for greedy decoding; correction_rule {rule!r} "
                             "samples (send one or the other)")
        rule = "greedy"
    if rule is None:
        # sampling parameters without a rule ask for sampling: use the lossless rule
        rule = "exact" if (temperature is not None or top_p is not None) else config.rule
    if rule not in RULES:
        raise ValueError(f"correction_rule must be one of {', '.join(RULES)}; got {rule!r}")
    overrides = {name: scalar(inputs, name, float)
                 for name in ("tau", "gamma", "alpha", "epsilon", "delta")}
    kwargs = {**config.rule_defaults, **{k: v for k, v in overrides.items() if v is not None}}
    params = RuleParams(
        rule,
        temperature=config.temperature if temperature is None else temperature,
        top_p=config.top_p if top_p is None else top_p,
        **kwargs,
    )
    k = scalar(inputs, "num_draft_tokens", int)
    k = config.k if k is None else k
    if not 1 <= k <= config.k:
        raise ValueError(f"num_draft_tokens must be in [1, {config.k}]; got {k}")
    seed = scalar(inputs, "random_seed", int)
    end_id = scalar(inputs, "end_id", int)
    stream = scalar(inputs, "stream", bool)
    return ParsedRequest(prompt, max_tokens, params, k, 0 if seed is None else seed % 2**63,
                         config.eos_token_id if end_id is None else eos_or_none(end_id),
                         bool(stream), stop_sequences(inputs))


def stop_sequences(inputs: dict[str, np.ndarray]) -> list[list[int]]:
    """The stop words' token ids, as preprocessing sends them: all ids in one flat tensor
    (``stop_words_ids``) and each word's length (``stop_words_lengths``)."""
    ids = np.asarray(inputs.get("stop_words_ids", [])).reshape(-1).tolist()
    lengths = np.asarray(inputs.get("stop_words_lengths", [])).reshape(-1).tolist()
    if len(lengths) > MAX_STOP_WORDS:
        raise ValueError(f"stop_words must hold at most {MAX_STOP_WORDS} words; "
                         f"got {len(lengths)}")
    if any(not 1 <= n <= MAX_STOP_WORD_TOKENS for n in lengths) or sum(lengths) != len(ids):
        raise ValueError(f"stop_words: each word must be 1..{MAX_STOP_WORD_TOKENS} tokens "
                         f"(stop_words_lengths {lengths} for {len(ids)} stop_words_ids)")
    starts = np.cumsum([0, *lengths]).tolist()
    return [ids[a:b] for a, b in itertools.pairwise(starts)]


def eos_or_none(end_id: int) -> int | None:
    """end_id as TensorRT-LLM reads it: -1 means "no end token" (stop at max_tokens only)."""
    if end_id < -1:
        raise ValueError(f"end_id must be -1 (none) or a token id >= 0; got {end_id}")
    return None if end_id == -1 else end_id


# -- the model repository and the server -----------------------------------------------


def site_packages() -> str:
    return sysconfig.get_paths()["purelib"]


def find_tritonserver() -> Path:
    """The tritonserver binary: $PARADRAFT_TRITONSERVER, the one unpacked into the venv from
    the nvidia-pytriton wheel, or tritonserver on PATH (NGC containers)."""
    candidates = [os.environ.get("PARADRAFT_TRITONSERVER"),
                  Path(sys.prefix) / "pytriton/pytriton/tritonserver/bin/tritonserver",
                  shutil.which("tritonserver")]
    for c in candidates:
        if c and Path(c).is_file():
            return Path(c)
    raise FileNotFoundError(
        "tritonserver not found: run `make serve-deps` (unpacks the binary from the "
        "nvidia-pytriton wheel into .venv/pytriton), set PARADRAFT_TRITONSERVER, or use an NGC "
        "tritonserver container")


def backend_dir(tritonserver: Path, out: Path) -> Path:
    """A backends/python folder with the stub built for the running Python next to
    libtriton_python.so (the wheel ships one stub per Python version)."""
    root = tritonserver.parent.parent
    src = root / "backends" / "python"
    stub = root / "python_backend_stubs" / f"{sys.version_info.major}.{sys.version_info.minor}"
    dst = out / "backends" / "python"
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file():
            shutil.copy2(f, dst / f.name)
    if stub.is_dir():
        for f in stub.iterdir():
            shutil.copy2(f, dst / f.name)
    return out / "backends"


def write_model_repo(config: ServeConfig, tokenizer_path: str, out: Path) -> Path:
    """Fill the templates for this deployment; returns the repository path."""
    repo = out / "model_repository"
    values = {
        "tokenizer_path": tokenizer_path,
        "max_input_tokens": str(config.max_input_tokens),
        "site_packages": site_packages(),
        "preprocessing_instances": "2",
        # one instance: responses of a stream must leave postprocessing in the order they came
        "postprocessing_instances": "1",
        "model_config": str(repo / "paradraft" / "paradraft.json"),
    }
    for name in MODELS:
        src, dst = TEMPLATES / name, repo / name
        (dst / "1").mkdir(parents=True, exist_ok=True)
        text = (src / "config.pbtxt").read_text()
        for key, value in values.items():
            text = text.replace("${" + key + "}", value)
        (dst / "config.pbtxt").write_text(text)
        if (src / "1" / "model.py").is_file():
            shutil.copy2(src / "1" / "model.py", dst / "1" / "model.py")
    (repo / "paradraft" / "paradraft.json").write_text(json.dumps(asdict(config), indent=2))
    return repo


def server_env(tritonserver: Path) -> dict:
    """The Python backend stub links the system libpython; point it at the running
    interpreter's library dir, and put the venv's bin first on PATH. The wheel's bundled
    libraries (nvidia_pytriton.libs) are found from the stub's copy through the path too."""
    env = dict(os.environ)
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    bundled = tritonserver.parents[3] / "nvidia_pytriton.libs"
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        str(p) for p in [libdir, bundled if bundled.is_dir() else "",
                         env.get("LD_LIBRARY_PATH", "")] if p)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


@dataclass
class Server:
    process: subprocess.Popen
    host: str
    grpc_port: int
    http_port: int
    metrics_port: int
    workdir: Path
    log: Path

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    def stop(self, timeout: float = 30) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)  # tritonserver drains and exits on SIGINT
            try:
                self.process.wait(timeout)
            except BaseException:  # slow, or a second Ctrl-C / SIGTERM: never leave it up
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def start_server(config: ServeConfig, tokenizer_path: str, host: str = "127.0.0.1",
                 grpc_port: int = 8001, http_port: int = 8000, metrics_port: int = 8002,
                 workdir: Path | None = None, ready_timeout: float = 240) -> Server:
    """Write the repository, start tritonserver and wait until it is ready."""
    for name, port in [("grpc_port", grpc_port), ("http_port", http_port),
                       ("metrics_port", metrics_port)]:
        if not 1 <= port <= 65535:
            raise ValueError(f"{name} must be in [1, 65535]; got {port}")
    binary = find_tritonserver()
    workdir = Path(workdir or tempfile.mkdtemp(prefix="paradraft-serve-"))
    repo = write_model_repo(config, tokenizer_path, workdir)
    backends = backend_dir(binary, workdir)
    log = workdir / "tritonserver.log"
    cmd = [str(binary), f"--model-repository={repo}", f"--backend-directory={backends}",
           "--model-control-mode=none", "--exit-on-error=true", "--strict-readiness=true",
           f"--grpc-address={host}", f"--grpc-port={grpc_port}",
           f"--http-address={host}", f"--http-port={http_port}",
           "--allow-metrics=true", f"--metrics-address={host}",
           f"--metrics-port={metrics_port}", "--log-info=true"]
    process = subprocess.Popen(cmd, env=server_env(binary), stdout=log.open("w"),
                               stderr=subprocess.STDOUT, start_new_session=True)
    server = Server(process, host, grpc_port, http_port, metrics_port, workdir, log)
    url = f"http://{host}:{http_port}/v2/health/ready"
    try:
        deadline = time.monotonic() + ready_timeout
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"tritonserver exited with {process.returncode}; log "
                                   f"{log}:\n" + log.read_text()[-4000:])
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        return server
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"tritonserver not ready after {ready_timeout}s; log {log}")
    except BaseException:  # a timeout, or Ctrl-C / SIGTERM while waiting: no orphan server
        server.stop()
        raise


# -- the client ------------------------------------------------------------------------


@dataclass
class Completion:
    text: str
    chunks: list[str]
    acceptance_rate: float
    total_accepted_draft_tokens: int
    total_draft_tokens: int
    first_token_s: float
    chunk_times: list[float]
    chunk_tokens: list[int]  # tokens each response carried (from sequence_length)


def stop_request(url: str, request_id: str, timeout: float = 60) -> None:
    """End the running or queued request ``request_id`` (TensorRT-LLM's ``stop`` input: the
    same id, through the ensemble); raises RuntimeError with the server's message if none."""
    import queue

    import tritonclient.grpc as grpcclient

    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    inputs = request_inputs(" ", 1, False)  # the ensemble's required inputs; unused
    stop = grpcclient.InferInput("stop", [1, 1], "BOOL")
    stop.set_data_from_numpy(np.array([[True]]))
    try:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        client.async_stream_infer("ensemble", [*inputs, stop], request_id=request_id,
                                  enable_empty_final_response=True)
        while True:
            result, error = results.get(timeout=timeout)
            if error is not None:
                raise RuntimeError(str(error))
            final = result.get_response().parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                return
    finally:
        client.stop_stream()
        client.close()


def request_inputs(prompt: str, max_tokens: int, stream: bool, **optional):
    """tritonclient.grpc InferInput list for the ensemble (shapes with the batch dim 1)."""
    import tritonclient.grpc as grpcclient

    def tensor(name, value, dtype, np_dtype):
        t = grpcclient.InferInput(name, [1, 1], dtype)
        t.set_data_from_numpy(np.array([[value]], dtype=np_dtype))
        return t

    inputs = [tensor("text_input", prompt.encode() if isinstance(prompt, str) else prompt,
                     "BYTES", np.object_),
              tensor("max_tokens", max_tokens, "INT32", np.int32),
              tensor("stream", stream, "BOOL", np.bool_)]
    kinds = {"temperature": ("FP32", np.float32), "top_p": ("FP32", np.float32),
             "random_seed": ("UINT64", np.uint64), "num_draft_tokens": ("INT32", np.int32),
             "end_id": ("INT32", np.int32), "correction_rule": ("BYTES", np.object_),
             "tau": ("FP32", np.float32), "gamma": ("FP32", np.float32),
             "alpha": ("FP32", np.float32), "epsilon": ("FP32", np.float32),
             "delta": ("FP32", np.float32)}
    for name, value in optional.items():
        if value is None:
            continue
        if name == "stop_words":  # a list of strings: TensorRT-LLM's [1, words] tensor
            words = grpcclient.InferInput(name, [1, len(value)], "BYTES")
            words.set_data_from_numpy(np.array([[w.encode() for w in value]], dtype=np.object_))
            inputs.append(words)
            continue
        if name not in kinds:
            raise ValueError(f"unknown request parameter {name!r}")
        dtype, np_dtype = kinds[name]
        if dtype == "BYTES":
            value = str(value).encode()
        inputs.append(tensor(name, value, dtype, np_dtype))
    return inputs


def complete(url: str, prompt: str, max_tokens: int, stream: bool = True,
             on_text=None, timeout: float = 300, request_id: str = "", client=None,
             **optional) -> Completion:
    """One completion over gRPC streaming (the API decoupled models need). ``request_id``
    names it for ``stop_request``. ``client``: a ``tritonclient.grpc`` client to reuse (one
    stream at a time; the caller closes it), as a load generator keeps one per worker
    instead of a new channel per request."""
    import queue

    import tritonclient.grpc as grpcclient

    results: queue.Queue = queue.Queue()
    own_client = client is None
    if own_client:
        client = grpcclient.InferenceServerClient(url)
    chunks, times, counts = [], [], []
    stats = (0.0, 0, 0)
    t0 = time.perf_counter()
    try:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        client.async_stream_infer("ensemble", request_inputs(prompt, max_tokens, stream,
                                                             **optional),
                                  request_id=request_id, enable_empty_final_response=True)
        while True:
            result, error = results.get(timeout=timeout)
            if error is not None:
                raise RuntimeError(str(error))
            response = result.get_response()
            final = response.parameters.get("triton_final_response")
            if result.as_numpy("text_output") is not None:
                text = result.as_numpy("text_output").reshape(-1)[0].decode()
                chunks.append(text)
                times.append(time.perf_counter() - t0)
                length = int(result.as_numpy("sequence_length").reshape(-1)[0])
                counts.append(length - sum(counts))
                stats = (float(result.as_numpy("acceptance_rate").reshape(-1)[0]),
                         int(result.as_numpy("total_accepted_draft_tokens").reshape(-1)[0]),
                         int(result.as_numpy("total_draft_tokens").reshape(-1)[0]))
                if on_text is not None:
                    on_text(text)
            if final is not None and final.bool_param:
                break
    finally:
        client.stop_stream()
        if own_client:
            client.close()
    return Completion("".join(chunks), chunks, *stats,
                      first_token_s=times[0] if times else 0.0, chunk_times=times,
                      chunk_tokens=counts)
