"""Two real `hpservice serve` replicas on one PostgreSQL and one Ray head: either takes requests;
only the lease holder launches and follows jobs; a cancel sent to the other replica while a job
launches ends it; killing the leader (kill -9) mid-job loses no step's metrics and launches
nothing twice."""

import contextlib
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from hpservice.actors.head import running_head, stop_head
from hpservice.launch import free_port

SPEC = {
    "name": "replicated",
    "model": {"name": "llama", "flavor": "tiny"},
    "data": {"kind": "synthetic", "seq_len": 32, "global_batch": 8},
    "training": {"steps": 150},
    "optimizer": {"lr": 3.0e-3},
    "resources": {"workers": 2, "use_gpu": False},
}
ENDED = ("SUCCEEDED", "FAILED", "CANCELLED")


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


def _role(url):
    return httpx.get(f"{url}/healthz", timeout=5).json()["supervisor"]


@pytest.mark.databases("postgresql")  # replicas share a database server
def test_two_serve_replicas_one_killed_mid_job(tmp_path):
    data = tmp_path / "data"
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    servers = []
    try:
        servers.append(_start(tmp_path, data, ports[0], 1, "--num-cpus", "3", "--lease-ttl-s", "3"))
        _wait(lambda: httpx.get(f"{urls[0]}/readyz", timeout=5).status_code == 200, 240, "replica 1")
        servers.append(_start(tmp_path, data, ports[1], 2, "--lease-ttl-s", "3"))  # joins replica 1's Ray head
        _wait(lambda: httpx.get(f"{urls[1]}/readyz", timeout=5).status_code == 200, 240, "replica 2")
        roles = _wait(lambda: sorted(r := [_role(u) for u in urls]) == ["leader", "standby"] and r, 60, "a leader")
        leader = roles.index("leader")
        standby = 1 - leader

        job = httpx.post(
            f"{urls[standby]}/v1/jobs", json=SPEC, timeout=30
        ).json()  # to the replica that does not launch
        _wait(lambda: httpx.get(f"{urls[leader]}/v1/jobs/{job['id']}", timeout=5).json()["step"] >= 3, 240, "step 3")

        # A cancel sent to the standby just as the leader launches a job: it ends CANCELLED.
        other = httpx.post(
            f"{urls[standby]}/v1/jobs", json={**SPEC, "name": "cancelled", "resources": {"workers": 1}}, timeout=30
        ).json()
        assert httpx.post(f"{urls[standby]}/v1/jobs/{other['id']}/cancel", timeout=30).status_code == 202
        ended = _wait(
            lambda: (j := httpx.get(f"{urls[leader]}/v1/jobs/{other['id']}", timeout=5).json())["state"] in ENDED and j,
            120,
            "the cancelled job to end",
        )
        assert ended["state"] == "CANCELLED", ended

        _kill(servers[leader])  # kill -9 the leader mid-job: it never releases its lease
        survivor = urls[standby]
        _wait(lambda: _role(survivor) == "leader", 120, "the survivor to take the lease")
        done = _wait(
            lambda: (j := httpx.get(f"{survivor}/v1/jobs/{job['id']}", timeout=5).json())["state"] in ENDED and j,
            300,
            "the job to end",
        )
        assert done["state"] == "SUCCEEDED", done
        assert done["restarts"] == 0 and [h["state"] for h in done["history"]].count("STARTING") == 1  # launched once
        records = httpx.get(f"{survivor}/v1/jobs/{job['id']}/metrics", timeout=30).json()["records"]
        assert [r["step"] for r in records] == list(range(1, 151))  # every step's metrics, none lost
    finally:
        for proc in servers:
            _kill(proc)
        stop_head(data)
    assert running_head(data) is None
