"""Two real `hpservice serve` replicas on one PostgreSQL and one Ray head: either takes requests;
only the lease holder launches and follows jobs; a cancel sent to the other replica while a job
launches ends it; killing the leader (kill -9) mid-job loses no step's metrics and launches
nothing twice."""


import httpx
import pytest

from hpservice.actors.head import running_head, stop_head
from hpservice.train._hold import HOLD_FILE_ENV
from tests.api._serve import kill_server, start_ready_server, wait_for

SPEC = {
    "name": "replicated",
    "model": {"name": "llama", "flavor": "tiny"},
    "data": {"kind": "synthetic", "seq_len": 32, "global_batch": 8},
    "training": {"steps": 20},
    "optimizer": {"lr": 3.0e-3},
    "resources": {"workers": 1, "use_gpu": False},  # one: a worker costs seconds to start; the server is the point
}
ENDED = ("SUCCEEDED", "FAILED", "CANCELLED")


def _role(url):
    return httpx.get(f"{url}/healthz", timeout=5).json()["supervisor"]


@pytest.mark.databases("postgresql")  # replicas share a database server
def test_two_serve_replicas_one_killed_mid_job(tmp_path, monkeypatch):
    data = tmp_path / "data"
    hold = tmp_path / "hold"  # jobs train to step 5 and wait there until the test removes it
    hold.write_text("5")
    monkeypatch.setenv(HOLD_FILE_ENV, str(hold))  # inherited by the servers, their Ray head, the workers
    # each port is picked just before its server starts, and picked again if it was taken before the
    # server bound it: replica 1's Ray head binds free ports of its own meanwhile (its dashboard once
    # took the port kept for replica 2, and once the one picked for replica 1 itself)
    servers, urls = [], []
    try:
        for n, extra in ((1, ("--num-cpus", "3")), (2, ())):  # replica 2 joins replica 1's Ray head
            proc, url = start_ready_server(tmp_path, data, n, *extra, "--lease-ttl-s", "3")
            servers.append(proc)
            urls.append(url)
        roles = wait_for(lambda: sorted(r := [_role(u) for u in urls]) == ["leader", "standby"] and r, 60, "a leader")
        leader = roles.index("leader")
        standby = 1 - leader

        job = httpx.post(
            f"{urls[standby]}/v1/jobs", json=SPEC, timeout=30
        ).json()  # to the replica that does not launch
        wait_for(lambda: httpx.get(f"{urls[leader]}/v1/jobs/{job['id']}", timeout=5).json()["step"] >= 5, 240, "step 5")

        # A cancel sent to the standby just as the leader launches a job: it ends CANCELLED.
        other = httpx.post(
            f"{urls[standby]}/v1/jobs", json={**SPEC, "name": "cancelled", "resources": {"workers": 1}}, timeout=30
        ).json()
        assert httpx.post(f"{urls[standby]}/v1/jobs/{other['id']}/cancel", timeout=30).status_code == 202
        ended = wait_for(
            lambda: (j := httpx.get(f"{urls[leader]}/v1/jobs/{other['id']}", timeout=5).json())["state"] in ENDED and j,
            120,
            "the cancelled job to end",
        )
        assert ended["state"] == "CANCELLED", ended

        kill_server(servers[leader])  # kill -9 the leader mid-job: it never releases its lease
        survivor = urls[standby]
        wait_for(lambda: _role(survivor) == "leader", 120, "the survivor to take the lease")
        hold.unlink()
        done = wait_for(
            lambda: (j := httpx.get(f"{survivor}/v1/jobs/{job['id']}", timeout=5).json())["state"] in ENDED and j,
            300,
            "the job to end",
        )
        assert done["state"] == "SUCCEEDED", done
        assert done["restarts"] == 0 and [h["state"] for h in done["history"]].count("STARTING") == 1  # launched once
        records = httpx.get(f"{survivor}/v1/jobs/{job['id']}/metrics", timeout=30).json()["records"]
        assert [r["step"] for r in records] == list(range(1, 21))  # every step's metrics, none lost
    finally:
        for proc in servers:
            kill_server(proc)
        stop_head(data)
    assert running_head(data) is None
