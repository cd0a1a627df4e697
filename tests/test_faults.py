"""Faults against a real `paradraft serve` (the tiny demo models, 127.0.0.1): a model
instance's stub process or tritonserver killed mid-stream, a port already taken. What must
hold: the running stream ends with a named error within a bounded time, never a hang; the
server stops answering readiness; `serve` exits non-zero saying what died; nothing is left
running; no Python traceback reaches the client."""

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from test_triton import HAVE_SERVER, MODELS, free_port, start_serve_command, tritonservers_in

from paradraft.runtime.serving import protocol
from paradraft.runtime.serving.server import start_server, stub_pids

pytestmark = pytest.mark.skipif(not HAVE_SERVER and not os.environ.get("CI"),
                                reason="tritonserver not unpacked (make serve-deps)")
BOUND_S = 15  # how long a stream may take to end once its server broke


def serve_ready(tmp_path):
    """`paradraft serve --openai-port` on the tiny models; (process, OpenAI URL, Triton's
    HTTP port, tritonserver's pid) once it says ready."""
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    openai_port, http_port = free_port(), free_port()
    proc = start_serve_command(tmp_path, "--openai-port", str(openai_port), "--http-port",
                               str(http_port), "--chat-template", str(template))
    deadline = time.monotonic() + 240
    line = ""
    while "Triton ready" not in line:
        assert time.monotonic() < deadline and (line or proc.poll() is None), line
        line = proc.stdout.readline()
    triton = [pid for pid in tritonservers_in(tmp_path) if b"tritonserver" in
              Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]]
    return proc, f"http://127.0.0.1:{openai_port}", http_port, triton[0]


def open_stream(url: str):
    """A streamed completion that runs for seconds; the response after its first event."""
    body = {"model": "paradraft", "prompt": "def long():", "max_tokens": 100,
            "ignore_eos": True, "stream": True}
    request = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                     method="POST", headers={"Content-Type": "application/json"})
    response = urllib.request.urlopen(request, timeout=60)
    assert response.readline().startswith(b"data: ")
    return response


def read_to_end(response) -> list[str]:
    return [line[6:].strip().decode() for line in response if line.startswith(b"data: ")]


def stubs_in(workdir: Path) -> list[int]:
    """pids of Triton Python backend stubs running a model of ``workdir``'s repository."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if b"triton_python_backend_stub" in cmdline and str(workdir).encode() in cmdline:
            found.append(int(proc.name))
    return found


def answers_200(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@pytest.mark.parametrize("victim", ["stub", "tritonserver"])
def test_a_killed_process_ends_the_stream_with_an_error_and_serve_exits_non_zero(tmp_path,
                                                                                  victim):
    proc, url, http_port, triton = serve_ready(tmp_path)
    try:
        assert answers_200(f"{url}/health")
        stubs = stub_pids(triton)
        assert len(stubs) == 1 and stubs_in(tmp_path) == list(stubs), stubs
        response = open_stream(url)
        os.kill(stubs[0] if victim == "stub" else triton, signal.SIGKILL)
        t0 = time.monotonic()
        events = read_to_end(response)
        ended = time.monotonic() - t0
        out = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert ended < BOUND_S, ended
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error" and error["message"], error
    assert "Traceback" not in "".join(events)
    assert proc.returncode not in (0, None), out
    said = ("a model instance's process (triton_python_backend_stub" if victim == "stub"
            else "tritonserver exited by itself (-9")
    assert said in out, out
    # nothing answers readiness; nothing is left running
    assert not answers_200(f"http://127.0.0.1:{http_port}/v2/health/ready")
    assert not answers_200(f"{url}/health")
    time.sleep(0.5)
    assert tritonservers_in(tmp_path) == []
    assert stubs_in(tmp_path) == []  # none orphaned, either


def test_a_port_already_taken_is_refused_by_name_before_anything_starts(tmp_path):
    config = protocol.ServeConfig(verifier=str(MODELS / "verifier"), draft=None, max_slots=1,
                                  max_seq_len=64, max_input_tokens=63)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(ValueError, match=rf"http_port {port} on 127\.0\.0\.1 is in use"):
            start_server(config, str(MODELS / "verifier" / "tokenizer.json"),
                         grpc_port=free_port(), http_port=port, metrics_port=free_port(),
                         workdir=tmp_path)
        assert time.monotonic() - t0 < 5
    assert tritonservers_in(tmp_path) == []


# a mount namespace of its own: the tmpfs exists only for the command it runs
UNSHARE = ("unshare", "--mount", *(() if os.geteuid() == 0 else ("--map-root-user",)))


def mount_namespaces_work() -> bool:
    """Whether this process may make a mount namespace with its own tmpfs (root, or
    unprivileged user namespaces)."""
    try:
        probe = subprocess.run([*UNSHARE, "sh", "-c", "mount -t tmpfs -o size=64k none /mnt"],
                               capture_output=True)
    except OSError:  # no unshare
        return False
    return probe.returncode == 0


def on_small_disk(workdir: Path, size: str) -> tuple[str, ...]:
    """A launcher that runs its command with ``workdir`` on a tmpfs of ``size`` (ENOSPC past
    it), in a mount namespace of its own."""
    return (*UNSHARE, "sh", "-c", f'mount -t tmpfs -o size={size} paradraft-disk "{workdir}" '
            '&& exec "$@"', "sh")


def fill(path: Path) -> int:
    """Write zeros into ``path`` until the disk is full; bytes written."""
    written = 0
    with path.open("wb", buffering=0) as f:
        block = bytes(1 << 16)
        while True:
            try:
                written += f.write(block)
            except OSError as e:
                assert e.errno == 28, e  # ENOSPC, nothing else
                return written


def post(url: str, body: dict) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.mark.skipif(not mount_namespaces_work(), reason="no mount namespace with a tmpfs here "
                    "(needs root or unprivileged user namespaces)")
def test_a_full_disk_for_the_workdir(tmp_path):
    """The workdir's disk fills up while the server runs: requests are still served, streamed
    and not (a request writes nothing there but log lines), and SIGTERM still drains and stops
    the server, exit 0 (the drain is told by empty files, which a full disk still takes).
    Started on a disk already full, `serve` refuses at once, naming the file and the cause,
    without a traceback."""
    workdir = tmp_path / "workdir"
    workdir.mkdir()
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    openai_port = free_port()
    proc = start_serve_command(workdir, "--openai-port", str(openai_port), "--chat-template",
                               str(template), launcher=on_small_disk(workdir, "16m"))
    url = f"http://127.0.0.1:{openai_port}"
    try:
        deadline = time.monotonic() + 240
        lines = [""]
        while "Triton ready" not in lines[-1]:
            assert time.monotonic() < deadline and (lines[-1] or proc.poll() is None), \
                "".join(lines)
            lines.append(proc.stdout.readline())
        # the serve process's view of the workdir: the tmpfs, not the empty folder beneath
        assert fill(Path(f"/proc/{proc.pid}/root") / str(workdir).lstrip("/") / "ballast") > 0
        for stream in (False, True):
            status, body = post(f"{url}/v1/chat/completions", {
                "model": "paradraft", "messages": [{"role": "user", "content": "def f():"}],
                "max_tokens": 12, "ignore_eos": True, "stream": stream})
            assert status == 200, body
            if stream:
                events = [e[6:] for e in body.decode().splitlines() if e.startswith("data: ")]
                assert events[-1] == "[DONE]" and '"error"' not in body.decode(), body
            else:
                assert json.loads(body)["usage"]["completion_tokens"] == 12, body
        assert answers_200(f"{url}/health")
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert "tritonserver stopped (0)" in out, out
    assert tritonservers_in(workdir) == [] and stubs_in(workdir) == []

    # started with the disk already full
    proc = start_serve_command(workdir, launcher=on_small_disk(workdir, "4k"))
    try:
        out = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode not in (0, None), out
    assert "No space left on device" in out and str(workdir) in out, out
    assert "Traceback" not in out, out
    assert tritonservers_in(workdir) == []
