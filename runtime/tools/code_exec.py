"""Run untrusted generated code in a child process and say whether it passed.

``run_program`` writes the source to a file in a fresh scratch directory and runs it with
``python -I`` (isolated: no user site, no PYTHON* variables, no cwd on sys.path) in a new
session, with a wall-time limit, an address-space limit (RLIMIT_AS), no core files and a cap on
the size of files it writes. The limits are set by a small runner inside the child, not by
``preexec_fn``: the evaluating process runs torch's thread pools, and ``preexec_fn`` is unsafe
in a process with threads (the child can deadlock before exec).

A program passes only when it exits with status 0 *and* the runner's end marker, printed after
the program returned, is on stdout: a program that calls ``sys.exit(0)`` or ``os._exit(0)``
before its checks ran has not passed. Everything else is a failure with a reason; nothing the
child does raises here.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

# reasons (ExecResult.reason)
PASSED, FAILED, TIMEOUT, CRASHED, MEMORY, EXITED = (
    "passed", "failed", "timeout", "crashed", "memory", "exited")

# Runs in the child: limits first, then the program as __main__, then the end marker. argv:
# program path, address-space bytes, file-size bytes, marker. The marker leaves argv before
# the program starts, so it cannot print it by accident.
RUNNER = """\
import resource, runpy, sys
path, mem, fsize, marker = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
sys.argv = [path]
runpy.run_path(path, run_name="__main__")
sys.stdout.flush()
sys.stdout.write("\\n" + marker + "\\n")
sys.stdout.flush()
"""

OUTPUT_LIMIT = 4 << 20  # bytes a child may write to any file (its stdout and stderr included)


@dataclass(frozen=True)
class ExecResult:
    passed: bool
    reason: str  # passed | failed | timeout | crashed | memory | exited
    detail: str  # the exception line, the signal, the exit status, or the time limit
    seconds: float


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip()[:300] if lines else ""


def _classify(status: int, marker_seen: bool, stderr: str) -> tuple[str, str]:
    last = _last_line(stderr)
    if status == 0:
        return (PASSED, "") if marker_seen else (EXITED, "exit status 0 before the end")
    if status < 0:
        try:
            name = signal.Signals(-status).name
        except ValueError:
            name = f"signal {-status}"
        return CRASHED, name
    # an allocation refused by RLIMIT_AS surfaces as MemoryError (or, from C code, a failed
    # malloc reported on stderr)
    if "MemoryError" in last or "Cannot allocate memory" in stderr:
        return MEMORY, last
    if "Traceback (most recent call last)" in stderr:
        return FAILED, last
    # sys.exit(n) and os._exit(n) leave no traceback
    return EXITED, f"exit status {status}" + (f": {last}" if last else "")

def run_program(source: str, timeout_s: float = 10.0, memory_mb: int = 1024) -> ExecResult:
    """Run ``source`` as a Python program in a child process (see the module docstring) and
    return whether it passed and, if not, why."""
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0; got {timeout_s}")
    if memory_mb < 64:  # below this the interpreter itself does not start
        raise ValueError(f"memory_mb must be >= 64; got {memory_mb}")
    marker = "paradraft-end-" + secrets.token_hex(8)
    with tempfile.TemporaryDirectory(prefix="paradraft-exec-") as scratch:
        work = Path(scratch)
        program = work / "program.py"
        program.write_text(source, encoding="utf-8")
        out_path, err_path = work / "stdout.txt", work / "stderr.txt"
        # a small environment: nothing of ours (tokens, paths) is handed to generated code
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": scratch,
               "TMPDIR": scratch, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
        cmd = [sys.executable, "-I", "-c", RUNNER, str(program), str(memory_mb << 20),
               str(OUTPUT_LIMIT), marker]
        t0 = time.perf_counter()
        # output to files, not pipes: a program that prints without end neither fills the
        # parent's memory nor blocks on a full pipe; RLIMIT_FSIZE caps the files
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            child = subprocess.Popen(cmd, cwd=scratch, env=env, stdin=subprocess.DEVNULL,
                                     stdout=out, stderr=err, start_new_session=True)
            try:
                status = child.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                status = None
            finally:
                # the whole session: whatever the program forked goes with it
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(child.pid, signal.SIGKILL)
                child.wait()
        seconds = time.perf_counter() - t0
        if status is None:
            return ExecResult(False, TIMEOUT, f"no exit within {timeout_s:g} s", seconds)
        stdout = out_path.read_text(encoding="utf-8", errors="replace")
        stderr = err_path.read_text(encoding="utf-8", errors="replace")
    reason, detail = _classify(status, marker in stdout.splitlines(), stderr)
    return ExecResult(reason == PASSED, reason, detail, seconds)
