"""Running real `hpservice serve` processes in the tests: start one in its own process group,
wait for a condition over HTTP, kill the group by its PID."""

import contextlib
import os
import signal
import subprocess
import sys
import time

import httpx


def start_server(tmp_path, data, port, n, *extra):
    """``hpservice serve`` on ``port`` with ``--data-dir data``; its output in ``serve-<n>.log``."""
    log = open(tmp_path / f"serve-{n}.log", "w")  # noqa: SIM115 - lives as long as the process
    return subprocess.Popen(
        [sys.executable, "-m", "hpservice", "serve", "--port", str(port), "--data-dir", str(data), *extra],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=tmp_path,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip


def wait_for(predicate, timeout, what):
    """``predicate()``'s first truthy value, asked every 0.5 s (HTTP errors count as not yet)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            value = predicate()
            if value:
                return value
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def kill_server(proc):
    """kill -9 the server's own process group (not the Ray head's, which has its own session)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
