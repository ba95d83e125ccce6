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


def start_ready_server(tmp_path, data, n, *extra, timeout=240, attempts=3):
    """``start_server`` on a free port, waited for until it answers ``/readyz``: (process, URL). A
    port taken between being picked and being bound (the server's Ray head binds free ports of
    its own meanwhile) is picked again; a server that exits for another reason fails with its log."""
    from hpservice.launch import free_port

    for attempt in range(attempts):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = start_server(tmp_path, data, port, n, *extra)

        def ready(proc=proc, url=url):
            if proc.poll() is not None:
                return "exited"
            return httpx.get(f"{url}/readyz", timeout=5).status_code == 200 and "ready"

        try:
            state = wait_for(ready, timeout, f"replica {n}")
        except AssertionError:  # still starting: stopped here, the caller never got it
            kill_server(proc)
            raise
        if state == "ready":
            return proc, url
        log = (tmp_path / f"serve-{n}.log").read_text()
        if "address already in use" not in log or attempt == attempts - 1:
            raise AssertionError(f"replica {n} exited before it was ready:\n{log[-3000:]}")
    raise AssertionError("unreachable")


def kill_server(proc):
    """kill -9 the server's own process group (not the Ray head's, which has its own session)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
