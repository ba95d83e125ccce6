"""The default `hpservice serve` (no --ray-address) keeps running jobs across a kill -9 of the
server: its local Ray head is a process of its own, and the restarted server re-attaches."""

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from hpservice.actors.head import running_head, stop_head
from hpservice.launch import free_port

SPEC = {
    "name": "survivor",
    "model": {"name": "llama", "flavor": "tiny"},
    "data": {"kind": "synthetic", "seq_len": 32, "global_batch": 8},
    "training": {"steps": 120},
    "optimizer": {"lr": 3.0e-3},
    "resources": {"workers": 2, "use_gpu": False},
}


def _start(tmp_path, data, port, n, *extra):
    log = open(tmp_path / f"serve-{n}.log", "w")  # noqa: SIM115 - lives as long as the process
    return subprocess.Popen(
        [sys.executable, "-m", "hpservice", "serve", "--port", str(port), "--data-dir", str(data), *extra],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=tmp_path,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip


def _wait(predicate, timeout, what):
    deadline = time.time() + timeout
    while time.time() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            value = predicate()
            if value:
                return value
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def _kill(proc):
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # the server's own process group, not the Ray head's
    proc.wait(timeout=30)


@pytest.mark.databases("sqlite")  # the default server: its store is a SQLite file in its data dir
def test_kill_9_the_default_server_mid_job_and_start_it_again(tmp_path):
    data, port = tmp_path / "data", free_port()
    url = f"http://127.0.0.1:{port}"
    servers = []
    try:
        servers.append(_start(tmp_path, data, port, 1, "--num-cpus", "3"))
        _wait(lambda: httpx.get(f"{url}/readyz", timeout=5).status_code == 200, 240, "the server")
        head = running_head(data)
        assert head is not None, (tmp_path / "serve-1.log").read_text()[-3000:]
        cmdline = Path(f"/proc/{head['pid']}/cmdline").read_bytes().split(b"\0")
        assert b"--num-cpus=3" in cmdline  # serve --num-cpus sizes the head it starts
        job = httpx.post(f"{url}/v1/jobs", json=SPEC, timeout=30).json()
        _wait(lambda: httpx.get(f"{url}/v1/jobs/{job['id']}", timeout=5).json()["step"] >= 3, 240, "step 3")

        _kill(servers[-1])  # kill -9 mid-job
        assert running_head(data) == head  # the head, and the job on it, live on

        servers.append(_start(tmp_path, data, port, 2))
        _wait(lambda: httpx.get(f"{url}/readyz", timeout=5).status_code == 200, 240, "the restarted server")
        assert running_head(data) == head  # re-attached, not a new cluster
        done = _wait(
            lambda: (
                (j := httpx.get(f"{url}/v1/jobs/{job['id']}", timeout=5).json())["state"]
                in ("SUCCEEDED", "FAILED", "CANCELLED")
                and j
            ),
            300,
            "the job to end",
        )
        assert done["state"] == "SUCCEEDED", done
        records = httpx.get(f"{url}/v1/jobs/{job['id']}/metrics", timeout=30).json()["records"]
        assert [r["step"] for r in records] == list(range(1, 121))  # every step's metrics, none lost
    finally:
        for proc in servers:
            _kill(proc)
        stop_head(data)
    assert running_head(data) is None
