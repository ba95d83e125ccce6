"""The whole service on loopback: a Ray head, `hpservice serve` as its own process, real jobs.

The Ray head and the API server are processes this test starts (each in its own session) and
stops by process group; nothing else on the machine is touched.
"""

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from hpservice.launch import free_port
from hpservice.train._hold import HOLD_FILE_ENV
from tests.api._serve import wait_for

ROOT = Path(__file__).resolve().parents[2]
# Ray's token authentication (its default for `ray start`): the API process presents the same token.
RAY_ENV = {k: v for k, v in os.environ.items() if k != "HPSERVICE_DATABASE_URL"} | {"RAY_AUTH_MODE": "token"}
TOKENS = {
    "t-alice": {"owner": "alice"},
    "t-bob": {"owner": "bob"},
    "t-burst": {"owner": "burst"},  # at a quota of 0 workers: its jobs are stored and wait, never start
    "t-ops": {"owner": "ops", "admin": True},
}
QUOTAS = {"burst": {"workers": 0}}


def _spec(tmp, name, steps, workers=1):
    """A tiny job on one CPU worker (each costs seconds to start): these tests are about the service;
    a 2-worker job under it is the CLI's (examples/tiny-cpu.yaml)."""
    return {
        "name": name,
        "model": {"name": "llama", "flavor": "tiny"},
        "data": {"kind": "synthetic", "seq_len": 32, "global_batch": max(8, workers)},
        "training": {"steps": steps},
        "optimizer": {"lr": 3.0e-3},
        "resources": {"workers": workers, "use_gpu": False},
        "metrics": {"log_every": 50},  # the server decides where the job writes: its own directory
    }


def _wait_port(port, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.3)
    raise TimeoutError(f"nothing listening on 127.0.0.1:{port}")


def _stop(proc, grace_s=15):
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # whatever of the group is left
    proc.wait(timeout=15)


class Server:
    def __init__(self, tmp, ray_address, database_url=None):
        self.tmp, self.ray_address, self.port = tmp, ray_address, free_port()
        self.database_url = database_url  # None: the default SQLite file in its data dir
        self.url = f"http://127.0.0.1:{self.port}"
        (tmp / "tokens.yaml").write_text(json.dumps(TOKENS))
        (tmp / "quotas.yaml").write_text(json.dumps(QUOTAS))
        self.proc = None

    def start(self):
        self.datasets = self.tmp / "datasets"  # the operator's data root, where a tenant can put files
        self.datasets.mkdir(exist_ok=True)
        cmd = [sys.executable, "-m", "hpservice", "serve", "--port", str(self.port), "--data-dir", str(self.tmp / "data"),
               "--ray-address", self.ray_address, "--tokens-file", str(self.tmp / "tokens.yaml"),
               "--quotas-file", str(self.tmp / "quotas.yaml"),
               "--data-root", str(self.datasets)]  # fmt: skip
        log = open(self.tmp / f"server-{time.time():.0f}.log", "w")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=self.tmp,
            env={**RAY_ENV, "PYTHONUNBUFFERED": "1", **({"HPSERVICE_DATABASE_URL": self.database_url} if self.database_url else {})},
        )  # fmt: skip
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert self.proc.poll() is None, (self.tmp / "data").exists()
            time.sleep(0.5)
        raise TimeoutError("hpservice serve did not become ready")

    def kill(self):
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=15)


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    """The module's Ray head, shared by its servers on each database: ``(address, hold file)``.
    The workers inherit the hold file's name from the head; no file, no hold
    (test_api_restart_mid_job_loses_nothing)."""
    tmp = tmp_path_factory.mktemp("ray-head")
    port = free_port()
    ray_log = open(tmp / "ray.log", "w")  # noqa: SIM115 - lives as long as the process
    head = subprocess.Popen(
        ["ray", "start", "--head", f"--port={port}", "--num-cpus=4",
         "--include-dashboard=false", "--disable-usage-stats", "--block"],
        stdout=ray_log, stderr=subprocess.STDOUT, start_new_session=True, cwd=tmp,
        env={**RAY_ENV, HOLD_FILE_ENV: str(tmp / "hold")},
    )  # fmt: skip
    try:
        _wait_port(port)
        yield f"127.0.0.1:{port}", tmp / "hold"
    finally:
        _stop(head, grace_s=2)  # `ray start --block` can take half a minute on SIGTERM: the group is killed


@pytest.fixture(scope="module")
def service(tmp_path_factory, ray_head, database_kind, request):
    """One server for the module's tests on each database (conftest.py), on the module's Ray head."""
    tmp = tmp_path_factory.mktemp("service")
    database_url = request.getfixturevalue("postgres").new_database() if database_kind == "postgresql" else None
    address, hold = ray_head
    server = Server(tmp, address, database_url)
    server.hold = hold
    try:
        server.start()
        yield server
    finally:
        if server.proc is not None:
            _stop(server.proc)


def _client(server, token="t-alice"):
    return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {token}"}, timeout=30)


def _events(server, job_id, token="t-alice"):
    """Follow the SSE stream to its end; returns [(id, event, data)]."""
    out = []
    with _client(server, token) as c, c.stream("GET", f"/v1/jobs/{job_id}/events", timeout=300) as r:
        assert r.status_code == 200
        block = {}
        for line in r.iter_lines():
            if not line:
                if block:
                    out.append((int(block["id"]), block["event"], json.loads(block["data"])))
                block = {}
            elif not line.startswith(":"):
                key, _, value = line.partition(": ")
                block[key] = value
    return out


def _wait_step(c, job_id, step, timeout=180):
    """Until the job has done ``step`` steps; fails (never hangs) if it ends or stalls first."""
    deadline = time.time() + timeout
    while True:
        job = c.get(f"/v1/jobs/{job_id}").json()
        if job["step"] >= step:
            return job
        assert job["state"] not in ("FAILED", "SUCCEEDED", "CANCELLED"), job
        assert time.time() < deadline, f"no step {step} after {timeout} s: {job}"
        time.sleep(0.2)


def _wait(server, job_id, states, timeout=300, token="t-alice"):
    deadline = time.time() + timeout
    with _client(server, token) as c:
        while time.time() < deadline:
            job = c.get(f"/v1/jobs/{job_id}").json()
            if job["state"] in states:
                return job
            time.sleep(0.5)
    raise TimeoutError(f"{job_id} still {job['state']}")


def test_submit_over_http_and_stream_until_succeeded(service, tmp_path):
    with _client(service) as c:
        job = c.post("/v1/jobs", json=_spec(tmp_path, "http", steps=6)).json()
    events = _events(service, job["id"])
    assert [e[0] for e in events] == list(range(1, len(events) + 1))  # ordered, no gaps
    assert events[-1][1] == "state" and events[-1][2]["state"] == "SUCCEEDED"
    assert [d["step"] for _, kind, d in events if kind == "metrics"] == [1, 2, 3, 4, 5, 6]
    states = [d["state"] for _, kind, d in events if kind == "state"]
    assert states[0] == "QUEUED" and "RUNNING" in states
    with _client(service) as c:
        records = c.get(f"/v1/jobs/{job['id']}/metrics").json()["records"]
        assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
        resumed = _events(service, job["id"])[3:]  # a reconnecting client resumes where it left off
        with c.stream("GET", f"/v1/jobs/{job['id']}/events", headers={"Last-Event-ID": str(resumed[0][0] - 1)}) as r:
            first = next(line for line in r.iter_lines() if line.startswith("id:"))
        assert first == f"id: {resumed[0][0]}"


@pytest.mark.databases("sqlite")  # the CLI's path; streaming from PostgreSQL: the test above
def test_submit_with_the_cli_and_follow_its_logs_while_it_runs(service, tmp_path):
    env = {**os.environ, "HPSERVICE_URL": service.url, "HPSERVICE_TOKEN": "t-alice"}
    hp = [sys.executable, "-m", "hpservice"]
    cmd = [*hp, "submit", str(ROOT / "examples" / "tiny-cpu.yaml"), "--set", "training.steps=12", "--set", "metrics.log_every=1"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    job_id = re.search(r"submitted job (\S+)", out.stdout).group(1)
    # followed from its start to its end: every line once, though the job logs while it is followed
    follow = subprocess.run([*hp, "logs", job_id, "-f"], capture_output=True, text=True, timeout=300, env=env)
    assert follow.returncode == 0, follow.stderr[-2000:]
    lines = follow.stdout.splitlines()
    assert len(lines) == len(set(lines)), [line for line in lines if lines.count(line) > 1]
    assert any("step    12/12" in line for line in lines), lines[-5:]
    watched = subprocess.run([*hp, "watch", job_id], capture_output=True, text=True, timeout=300, env=env)
    assert watched.returncode == 0, watched.stdout[-2000:] + watched.stderr[-2000:]
    listed = subprocess.run([*hp, "list", "--json"], capture_output=True, text=True, env=env, timeout=60)
    (job,) = [j for j in json.loads(listed.stdout)["items"] if j["id"] == job_id]
    assert job["state"] == "SUCCEEDED"
    logs = subprocess.run([*hp, "logs", job_id, "--rank", "1"], capture_output=True, text=True, env=env, timeout=60)
    # every rank has lines of its own, not only rank 0
    assert logs.returncode == 0 and "[rank 1 step" in logs.stdout and "rank 1 step" in logs.stdout, logs.stdout


@pytest.mark.databases("sqlite")  # on PostgreSQL: test_replicas.py kills a replica mid-job
def test_api_restart_mid_job_loses_nothing(service, tmp_path):
    hold = service.hold  # the job trains to step 20 and waits there until the server is back
    hold.write_text("20")
    try:
        with _client(service) as c:
            job = c.post("/v1/jobs", json=_spec(tmp_path, "restart", steps=40)).json()
            _wait_step(c, job["id"], 20)
        service.kill()  # the API dies; the detached coordinator and workers go on
        time.sleep(2)
        service.start()
    finally:
        hold.unlink()
    done = _wait(service, job["id"], ("SUCCEEDED", "FAILED"))
    assert done["state"] == "SUCCEEDED", done
    with _client(service) as c:
        steps = [r["step"] for r in c.get(f"/v1/jobs/{job['id']}/metrics").json()["records"]]
    assert steps == list(range(1, 41))  # back-filled: no gap


def test_cancel_and_auth(service, tmp_path):
    with _client(service) as c:
        job = c.post("/v1/jobs", json=_spec(tmp_path, "cancel", steps=100000)).json()
        assert httpx.get(f"{service.url}/v1/jobs/{job['id']}").status_code == 401
        with _client(service, "t-bob") as bob:
            assert bob.get(f"/v1/jobs/{job['id']}").status_code == 404
            assert bob.post(f"/v1/jobs/{job['id']}/cancel").status_code == 404
        _wait_step(c, job["id"], 2)
        assert c.post(f"/v1/jobs/{job['id']}/cancel").status_code == 202
    done = _wait(service, job["id"], ("CANCELLED", "FAILED", "SUCCEEDED"), timeout=120)
    assert done["state"] == "CANCELLED", done
    # EventSource clients pass the token in the query string: it never reaches the server's log.
    with httpx.stream("GET", f"{service.url}/v1/jobs/{job['id']}/events?token=t-alice", timeout=30) as r:
        assert r.status_code == 200 and any(line.startswith("id:") for line in r.iter_lines())
    deadline = time.time() + 60  # the access log line is written as the response starts
    logged = ""
    while "/events?token=<redacted>" not in logged and time.time() < deadline:
        time.sleep(0.2)
        logged = "".join(p.read_text() for p in service.tmp.glob("server-*.log"))
    assert "/events?token=<redacted>" in logged and "token=t-alice" not in logged


def test_a_job_that_can_never_fit_is_refused_at_submit_with_the_fix(service, tmp_path):
    with _client(service) as c:
        r = c.post("/v1/jobs", json=_spec(tmp_path, "huge", steps=3, workers=64))
    assert r.status_code == 422, r.text
    (detail,) = r.json()["error"]["details"]
    assert detail["path"] == "resources" and "job needs 64 workers x (1 CPU)" in detail["message"]
    assert "to fit it:" in detail["message"]


def test_fifty_concurrent_submissions_are_all_stored(service, tmp_path):
    """Fifty submissions at once, from an owner whose quota is 0 workers: every one is stored and
    queued (none starts, so the test costs no worker processes), and every one can be cancelled."""
    results, errors = [], []

    def submit(i):
        try:
            with _client(service, "t-burst") as c:
                r = c.post(
                    "/v1/jobs", json=_spec(tmp_path, "burst", steps=2, workers=1), headers={"Idempotency-Key": f"b{i}"}
                )
                results.append((r.status_code, r.json()["id"]))
        except Exception as e:  # recorded, asserted below
            errors.append(repr(e))

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and len(results) == 50 and {s for s, _ in results} == {201}
    ids = {job_id for _, job_id in results}
    assert len(ids) == 50
    with _client(service, "t-ops") as ops:
        stored = {
            j["id"]: j["state"] for j in ops.get("/v1/jobs", params={"name": "burst", "limit": 100}).json()["items"]
        }
        assert set(stored) == ids  # none lost
        assert set(stored.values()) == {"QUEUED"}
        quota = "waiting: owner burst at quota 0/0 workers (this job needs 1)"
        wait_for(
            lambda: all(ops.get(f"/v1/jobs/{i}").json()["message"] == quota for i in ids),
            120,
            "every burst job waiting at its owner's quota",
        )
        for job_id in ids:
            r = ops.post(f"/v1/jobs/{job_id}/cancel")
            assert r.status_code < 300, r.text
    for job_id in ids:
        done = _wait(service, job_id, ("CANCELLED", "SUCCEEDED", "FAILED"), timeout=120, token="t-ops")
        assert done["state"] == "CANCELLED", done


@pytest.mark.databases("sqlite")  # refused before the store
def test_an_endless_body_is_refused_at_the_limit_without_reading_it_all(service):
    """A chunked body that never ends: the server answers 413 once the limit is passed (it used
    to read the whole body first, so this request got no answer at all)."""
    host, port = "127.0.0.1", service.port
    with socket.create_connection((host, port), timeout=60) as s:
        s.sendall(
            b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer t-alice\r\n"
            b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        chunk = b" " * (64 << 10)
        try:
            for _ in range(40):  # 2.5 MiB, past the 1 MiB limit; the terminating chunk never comes
                s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server may close as soon as it has answered
        head = s.recv(4096)
    assert head.startswith(b"HTTP/1.1 413"), head[:200]


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.databases("sqlite")  # about the workers, not the store
def test_a_crafted_checkpoint_under_a_data_root_never_runs_code_on_a_worker(service, tmp_path):
    """A tenant who can write under the data root plants a checkpoint whose DCP metadata is a
    pickle that runs a command, and submits a job resuming from it: the job fails, naming the
    refusal, and the command never runs."""
    import pickle

    marker = tmp_path / "pwned"
    crafted = service.datasets / f"shared-ckpt-{time.time_ns()}" / "step-00000002"
    crafted.mkdir(parents=True)
    payload = pickle.dumps(_Evil(marker))
    (crafted / ".metadata").write_bytes(payload)
    files = [{"name": ".metadata", "size": len(payload), "sha256": None, "rank": 0}]
    (crafted / "manifest.json").write_text(json.dumps({"format": 1, "step": 2, "time": 0, "world_size": 2, "files": files}))
    spec = _spec(tmp_path, "crafted", 20)
    spec["checkpoint"] = {"resume_from": str(crafted), "interval": 10}
    with _client(service) as c:
        r = c.post("/v1/jobs", json=spec)
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]
        deadline = time.time() + 180
        while (job := c.get(f"/v1/jobs/{job_id}").json())["state"] not in ("FAILED", "SUCCEEDED", "CANCELLED"):
            assert time.time() < deadline, job
            time.sleep(1)
    assert job["state"] == "FAILED", job
    assert "refusing to load posix.system" in job["message"], job["message"]
    assert job["restarts"] == 0  # the same files would be refused again: no restart is spent
    assert not marker.exists()
    assert sorted(p.name for p in crafted.iterdir()) == [".metadata", "manifest.json"]  # an input: never written
