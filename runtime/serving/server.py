"""Triton Inference Server deployment: the model repository and the server process.

``paradraft serve`` writes a model repository from the template in ``triton_repo/`` (one
decoupled Python model, ``ensemble``, that tokenises, decodes and detokenises) and runs a
real ``tritonserver``. On a CPU machine that is the binary bundled in the ``nvidia-pytriton`` wheel
(the Makefile unpacks it into ``.venv/pytriton``); in an NGC container it is the one on PATH.
``fill_template`` is the one template filler: our repository and the TensorRT-LLM one
(``paradraft.build.trtllm_engine``) both use it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from .client import MODEL, answers
from .protocol import ServeConfig, gpu_index

TEMPLATES = Path(__file__).resolve().parent.parent.parent / "triton_repo"
# the repository's one model: a second would bring a second slot pool, or (an ensemble in
# front) a hop that a client's cancellation does not pass on Triton 2.51
MODELS = (MODEL,)
# how long stop() lets the model instances end their requests before tritonserver exits
STOP_WAIT_S = 10.0
# how long a tritonserver stopped before it was ready (abandon) may take to exit on SIGINT
ABANDON_WAIT_S = 2.0
# tritonserver's log line, once a second while it waits to exit
EXIT_COUNTDOWN = re.compile(r'"Timeout \d+: Found \d+ ')
# once every request has had its final response, tritonserver only unloads the model (its
# finalize() starts within about a second). Triton 2.51 can hold a model for good after some
# client-cancelled streams: it never calls finalize(), waits out its 30 s exit timeout and
# exits 1. Past this wait with finalize() not begun, stop() ends tritonserver itself.
UNLOAD_WAIT_S = 10.0
# tritonserver's log line once it has stopped taking requests and unloads the models; the
# model's own line once its finalize() begins
UNLOAD_BEGUN = '"All models are stopped, unloading models"'
FINALIZE_BEGUN = re.compile(r"paradraft: \S+ unloading")


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


PLACEHOLDER = re.compile(r"\$\{(\w+)\}")


def fill_template(text: str, values: dict[str, str]) -> str:
    """Replace ${key} for the keys given and leave the rest (TensorRT-LLM's fill_template.py
    does the same; its models treat a string parameter still reading "${...}" as unset)."""
    return PLACEHOLDER.sub(lambda m: values.get(m.group(1), m.group(0)), text)


def unquoted_placeholders(text: str) -> list[str]:
    """Placeholders outside "..." — tritonserver cannot parse a config that keeps one."""
    found = []
    for line in text.splitlines():
        found += PLACEHOLDER.findall(re.sub(r'"[^"]*"', '""', line.split("#", 1)[0]))
    return found



def instance_group(config: ServeConfig) -> str:
    """The served model's ``instance_group``: ``config.instances`` per ``config.devices``
    entry, one group per distinct device (KIND_CPU, or KIND_GPU on that one GPU: Triton
    runs ``count`` instances on each GPU a group lists)."""
    counts: dict[int | None, int] = {}
    for device in config.devices:
        gpu = gpu_index(device)
        counts[gpu] = counts.get(gpu, 0) + config.instances
    groups = [f"{{ count: {n}, kind: KIND_CPU }}" if gpu is None
              else f"{{ count: {n}, kind: KIND_GPU, gpus: [ {gpu} ] }}"
              for gpu, n in counts.items()]
    return "instance_group [ " + ", ".join(groups) + " ]"


def instance_count(config: ServeConfig) -> int:
    return config.instances * len(config.devices)


def write_model_repo(config: ServeConfig, tokenizer_path: str, out: Path) -> Path:
    """Fill the templates for this deployment; returns the repository path. The model
    instances follow ``out/control`` (``Server.drain``, ``Server.stop``)."""
    repo = out / "model_repository"
    shutil.rmtree(out / "control", ignore_errors=True)  # a reused workdir's last shutdown
    # a reused workdir's other models (an older layout's preprocessing and paradraft) would
    # load beside this one: tritonserver loads every model in the repository
    for old in repo.iterdir() if repo.is_dir() else ():
        if old.name not in MODELS and old.is_dir():
            shutil.rmtree(old)
    values = {
        "tokenizer_path": tokenizer_path,
        "site_packages": site_packages(),
        "model_config": str(repo / MODEL / "paradraft.json"),
        "control_dir": str(out / "control"),
        "instance_group": instance_group(config),
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
    (repo / MODEL / "paradraft.json").write_text(json.dumps(asdict(config), indent=2))
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
    instances: int = 1  # model instances, each reporting to the control dir
    ready: bool = False  # the models loaded: their instances follow the control dir
    held_by_triton: bool = False  # stop() ended a tritonserver that held the model (see there)
    stubs: tuple[int, ...] = ()  # the model instances' stub processes, found once ready

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def control(self) -> Path:
        return self.workdir / "control"

    def drain(self, seconds: float) -> bool:
        """Stop admitting (each model instance refuses new requests as UNAVAILABLE) and
        wait up to ``seconds`` for the running and queued ones to finish; True if all did.
        Triton stays up meanwhile, so the running streams keep flowing."""
        return self.tell_instances("drain", seconds)

    def tell_instances(self, mode: str, seconds: float) -> bool:
        """Tell every model instance ``mode`` (``drain``: refuse new requests; ``stop``: also
        end the running and queued ones as UNAVAILABLE) and wait up to ``seconds`` until each
        reports that its last request has had its final response."""
        if not self.ready or self.process.poll() is not None:
            return False
        self.control.mkdir(parents=True, exist_ok=True)
        # the mode is an empty file's name, not a file's text: on a full disk an empty file
        # can still be made (it takes no data block), so a drain or stop still reaches them
        (self.control / mode).touch()
        deadline = time.monotonic() + seconds
        while len(list(self.control.glob(f"*.{mode}"))) < self.instances:
            if time.monotonic() >= deadline or self.process.poll() is not None:
                return False
            time.sleep(0.05)
        return True

    def stop(self, timeout: float = 30) -> int:
        """End every request (as UNAVAILABLE), then tritonserver; its exit code. Sets
        ``held_by_triton`` and returns 0 when every request had ended but tritonserver held
        the model past ``UNLOAD_WAIT_S`` without unloading it (see there): nothing was left to
        lose, so the process group is killed instead of waiting out Triton's exit timeout."""
        if self.process.poll() is not None:  # it died: its stubs may outlive it
            self.kill_group()
        else:
            try:
                # the instances end what still runs first: told to exit with a decoupled
                # stream in flight, tritonserver 2.51 crashed (SIGSEGV) instead of draining
                ended = self.tell_instances("stop", min(timeout, STOP_WAIT_S))
                self.process.send_signal(signal.SIGINT)  # tritonserver unloads and exits
                began, unload_wait = time.monotonic(), min(timeout, UNLOAD_WAIT_S)
                if ended and self.wait_or_held(unload_wait):
                    self.held_by_triton = True
                    print(f"paradraft: warning: tritonserver held the model {unload_wait:g} s "
                          "after every request had ended, without unloading it (Triton 2.51 "
                          "keeps a reference after some cancelled streams); ended it. Log: "
                          f"{self.log}", file=sys.stderr, flush=True)
                    self.kill_group()
                    return 0
                self.process.wait(max(0.0, timeout - (time.monotonic() - began)))
            except BaseException as e:  # slow, or a second Ctrl-C / SIGTERM: never leave it up
                if isinstance(e, subprocess.TimeoutExpired):
                    self.log_stub_stacks()
                self.kill_group()
        return self.process.returncode

    def dead_stubs(self) -> list[int]:
        """The model instances' stub processes that have died. Triton 2.51 does not notice
        one: its requests never end and readiness stays 200 (``serve`` watches for it)."""
        return [pid for pid in self.stubs if not alive(pid)]

    def wait_or_held(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for tritonserver to exit; True if it is still up then,
        unloading the models, and the model's finalize() has not begun."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(seconds)
            return False
        log = self.log.read_text(errors="replace")
        unloading = log.rfind(UNLOAD_BEGUN)
        return unloading >= 0 and not FINALIZE_BEGUN.search(log, unloading)

    def abandon(self, grace: float = ABANDON_WAIT_S) -> int:
        """Stop a tritonserver that never became ready (nothing was served, nothing can be
        lost): SIGINT, then its process group killed after ``grace`` seconds. A graceful
        stop would wait for the model to finish loading and then Triton's exit timeout (30 s
        for Ctrl-C during start-up)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(grace)
        self.kill_group()  # the stubs too, which may outlive it
        return self.process.returncode

    def kill_group(self) -> None:
        """SIGKILL tritonserver and the model's stub processes (its process group)."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except OSError:  # not a group leader (started elsewhere), or gone already
            with contextlib.suppress(OSError):
                self.process.kill()
        self.process.wait()

    def log_stub_stacks(self, wait: float = 1.0) -> None:
        """Have each model instance's stub process print its threads' stacks to the log
        (the model registers SIGUSR1 for it): where an unload hung."""
        stubs = child_pids(self.process.pid)
        for pid in stubs:
            with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
                os.kill(pid, signal.SIGUSR1)
        if stubs:
            time.sleep(wait)

    def log_excerpt(self, chars: int = 6000) -> str:
        """The log's end without tritonserver's once-a-second exit countdown, for error
        messages: a hung exit fills the end of the log with it."""
        lines = self.log.read_text(errors="replace").splitlines()
        kept = [line for line in lines if not EXIT_COUNTDOWN.search(line)]
        return f"({len(lines) - len(kept)} countdown lines left out)\n" + \
            "\n".join(kept)[-chars:]


def child_pids(pid: int) -> list[int]:
    """The processes ``pid`` started (Linux; none elsewhere)."""
    children = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return children


# Triton's line when a model fails to load; the Python stub appends "\n\nAt:" and a stack
LOAD_FAILED = re.compile(r"failed to load '[^']+' version \d+: (?:\w+: )?(.*?)(?:\\n\\nAt:|\"$)",
                         re.MULTILINE)


def load_failure(log_text: str) -> str | None:
    """Why the model failed to load, from tritonserver's log (the first reason given)."""
    found = LOAD_FAILED.search(log_text)
    if found is None:
        return None
    cause = found.group(1).replace("\\n", " ").strip()
    return re.sub(r"^\w+(?:Error|Exception): ", "", cause)  # the message, not Python's class


def port_taken(host: str, port: int) -> bool:
    """Whether something already listens on ``host``:``port`` (binding it fails)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is no owner
        try:
            probe.bind((host, port))
        except OSError:
            return True
    return False


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (Linux: a zombie, exited but not yet reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def stub_pids(pid: int) -> tuple[int, ...]:
    """The Python backend's stub processes (one per model instance) that tritonserver
    ``pid`` started."""
    found = []
    for child in child_pids(pid):
        try:
            command = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"triton_python_backend_stub" in command:
            found.append(child)
    return tuple(found)


@contextlib.contextmanager
def writing(workdir: Path) -> Iterator[None]:
    """Name the workdir and the cause when writing it fails (a full disk, no permission):
    shutil's own errors name neither."""
    try:
        yield
    except OSError as e:
        where = f" ({e.filename})" if e.filename else ""
        raise OSError(e.errno, f"cannot write the serving workdir {workdir}{where}: "
                      f"{e.strerror or e}; free space there or choose another with --workdir"
                      ) from e


def start_server(config: ServeConfig, tokenizer_path: str, host: str = "127.0.0.1",
                 grpc_port: int = 8001, http_port: int = 8000, metrics_port: int = 8002,
                 workdir: Path | None = None, ready_timeout: float = 240) -> Server:
    """Write the repository, start tritonserver and wait until it is ready."""
    for name, port in [("grpc_port", grpc_port), ("http_port", http_port),
                       ("metrics_port", metrics_port)]:
        if not 1 <= port <= 65535:
            raise ValueError(f"{name} must be in [1, 65535]; got {port}")
        if port_taken(host, port):  # tritonserver would start, load the models, then fail
            raise ValueError(f"{name} {port} on {host} is in use (another server?): choose "
                             f"another with --{name.replace('_', '-')}")
    binary = find_tritonserver()
    workdir = Path(workdir or tempfile.mkdtemp(prefix="paradraft-serve-"))
    with writing(workdir):
        repo = write_model_repo(config, tokenizer_path, workdir)
        backends = backend_dir(binary, workdir)
        log = workdir / "tritonserver.log"
        log_file = log.open("w")
    cmd = [str(binary), f"--model-repository={repo}", f"--backend-directory={backends}",
           "--model-control-mode=none", "--exit-on-error=true", "--strict-readiness=true",
           f"--grpc-address={host}", f"--grpc-port={grpc_port}",
           f"--http-address={host}", f"--http-port={http_port}",
           "--allow-metrics=true", f"--metrics-address={host}",
           f"--metrics-port={metrics_port}", "--log-info=true"]
    process = subprocess.Popen(cmd, env=server_env(binary), stdout=log_file,
                               stderr=subprocess.STDOUT, start_new_session=True)
    log_file.close()  # tritonserver holds its own
    server = Server(process, host, grpc_port, http_port, metrics_port, workdir, log,
                    instances=instance_count(config))
    # ready once the models are and the metrics endpoint answers too: under load, Triton
    # reported ready before its metrics port listened
    urls = [f"http://{host}:{http_port}/v2/health/ready", f"http://{host}:{metrics_port}/metrics"]
    try:
        deadline = time.monotonic() + ready_timeout
        while time.monotonic() < deadline:
            if process.poll() is not None:
                text = log.read_text(errors="replace")
                cause = load_failure(text)
                if cause is not None:  # the model's own error, without Triton's stack dump
                    raise RuntimeError(f"tritonserver could not load the model: {cause} (log "
                                       f"{log})")
                raise RuntimeError(f"tritonserver exited with {process.returncode}; log "
                                   f"{log}:\n" + text[-4000:])
            if all(answers(url) for url in urls):
                server.ready = True
                server.stubs = stub_pids(process.pid)
                return server
            time.sleep(0.5)
        raise TimeoutError(f"tritonserver not ready after {ready_timeout}s; log {log}")
    except BaseException:  # a timeout, or Ctrl-C / SIGTERM while waiting: no orphan server
        server.abandon()
        raise
