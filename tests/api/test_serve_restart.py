"""The default `hpservice serve` (no --ray-address) keeps running jobs across a kill -9 of the
server: its local Ray head is a process of its own, and the restarted server re-attaches."""

import signal
from pathlib import Path

import httpx
import pytest

from hpservice.actors.head import running_head, stop_head
from hpservice.launch import free_port
from hpservice.train._hold import HOLD_FILE_ENV
from tests.api._serve import kill_server, start_server, wait_for

SPEC = {
    "name": "survivor",
    "model": {"name": "llama", "flavor": "tiny"},
    "data": {"kind": "synthetic", "seq_len": 32, "global_batch": 8},
    "training": {"steps": 20},
    "optimizer": {"lr": 3.0e-3},
    "resources": {"workers": 1, "use_gpu": False},  # one: a worker costs seconds to start; the server is the point
}


@pytest.mark.databases("sqlite")  # the default server: its store is a SQLite file in its data dir
def test_kill_9_the_default_server_mid_job_and_start_it_again(tmp_path, monkeypatch):
    data, port = tmp_path / "data", free_port()
    hold = tmp_path / "hold"  # jobs train to step 5 and wait there until the test removes it
    hold.write_text("5")
    monkeypatch.setenv(HOLD_FILE_ENV, str(hold))  # inherited by the servers, their Ray head, the workers
    url = f"http://127.0.0.1:{port}"
    servers = []
    try:
        servers.append(start_server(tmp_path, data, port, 1, "--num-cpus", "3"))
        wait_for(lambda: httpx.get(f"{url}/readyz", timeout=5).status_code == 200, 240, "the server")
        head = running_head(data)
        assert head is not None, (tmp_path / "serve-1.log").read_text()[-3000:]
        cmdline = Path(f"/proc/{head['pid']}/cmdline").read_bytes().split(b"\0")
        assert b"--num-cpus=3" in cmdline  # serve --num-cpus sizes the head it starts
        job = httpx.post(f"{url}/v1/jobs", json=SPEC, timeout=30).json()
        wait_for(lambda: httpx.get(f"{url}/v1/jobs/{job['id']}", timeout=5).json()["step"] >= 5, 240, "step 5")

        kill_server(servers[-1])  # kill -9 mid-job
        assert running_head(data) == head  # the head, and the job on it, live on

        servers.append(start_server(tmp_path, data, port, 2))
        wait_for(lambda: httpx.get(f"{url}/readyz", timeout=5).status_code == 200, 240, "the restarted server")
        assert running_head(data) == head  # re-attached, not a new cluster
        hold.unlink()
        done = wait_for(
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
        assert [r["step"] for r in records] == list(range(1, 21))  # every step's metrics, none lost

        # SIGTERM (a Kubernetes rollout's stop): a graceful shutdown, no crash dump, no traceback
        servers[-1].send_signal(signal.SIGTERM)
        servers[-1].wait(timeout=60)
        log = (tmp_path / "serve-2.log").read_text()
        assert "Application shutdown complete." in log, log[-3000:]
        assert "Traceback" not in log and "SIGTERM received" not in log, log[-3000:]
    finally:
        for proc in servers:
            kill_server(proc)
        stop_head(data)
    assert running_head(data) is None
