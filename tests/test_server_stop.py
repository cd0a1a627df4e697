"""Server.stop() against a stand-in tritonserver (a real process that follows the control dir
and logs like tritonserver): which hang it ends, and which it reports as a failed stop."""

import subprocess
import sys
import textwrap
import time

import pytest

from paradraft.runtime.serving import server as serving_server

# how the stand-in behaves once SIGINT arrives (and whether its instance ever reports that its
# requests ended)
FAKE = textwrap.dedent("""
    import signal, sys, time
    from pathlib import Path

    log, control, behaviour = open(sys.argv[1], "a", buffering=1), Path(sys.argv[2]), sys.argv[3]

    def on_sigint(*_):
        log.write('I1207 server.cc:336] "All models are stopped, unloading models"\\n')
        if behaviour in ("unloads", "finalize_hangs"):
            log.write('I1207 model.py:626] "paradraft: ensemble_0_0 unloading"\\n')
        if behaviour == "unloads":
            sys.exit(0)
        while True:  # held by Triton, or stuck in the model's finalize()
            time.sleep(1)

    signal.signal(signal.SIGINT, on_sigint)
    while True:
        asked = next((m for m in ("stop", "drain") if (control / m).exists()), "")
        if asked and behaviour != "request_never_ends":
            (control / f"ensemble_0_0.{asked}").touch()
        time.sleep(0.02)
""")


def fake_server(tmp_path, behaviour: str) -> serving_server.Server:
    log = tmp_path / "tritonserver.log"
    log.write_text("")
    control = tmp_path / "control"
    control.mkdir()
    process = subprocess.Popen([sys.executable, "-c", FAKE, str(log), str(control), behaviour],
                               start_new_session=True)
    return serving_server.Server(process, "127.0.0.1", 1, 2, 3, tmp_path, log, instances=1,
                                 ready=True)


@pytest.fixture
def short_waits(monkeypatch):
    monkeypatch.setattr(serving_server, "UNLOAD_WAIT_S", 1.0)
    monkeypatch.setattr(serving_server, "STOP_WAIT_S", 1.0)


def test_a_server_that_unloads_stops_with_its_own_exit_code(tmp_path, short_waits):
    srv = fake_server(tmp_path, "unloads")
    assert srv.stop(timeout=10) == 0
    assert not srv.held_by_triton


def test_a_model_held_after_every_request_ended_is_ended_and_reported(tmp_path, short_waits,
                                                                      capsys):
    srv = fake_server(tmp_path, "held")
    began = time.monotonic()
    assert srv.stop(timeout=30) == 0
    assert time.monotonic() - began < 10, "waited for Triton's exit timeout"
    assert srv.held_by_triton and srv.process.returncode == -9
    assert "held the model" in capsys.readouterr().err


@pytest.mark.parametrize("behaviour", ["finalize_hangs", "request_never_ends"])
def test_a_hung_finalize_or_an_open_request_is_a_failed_stop(tmp_path, short_waits, behaviour):
    """Our own hangs are not Triton's: the model's finalize() began, or an instance never
    reported its requests ended. stop() waits its whole timeout and reports the kill."""
    srv = fake_server(tmp_path, behaviour)
    began = time.monotonic()
    assert srv.stop(timeout=3) != 0
    assert time.monotonic() - began >= 3
    assert not srv.held_by_triton
