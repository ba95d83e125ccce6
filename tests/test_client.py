"""`hpservice.client` and the service subcommands of the CLI against a fake control plane.

The fake is a small FastAPI app implementing the routes of ``docs/api.md`` over a dict store with
canned jobs, served by uvicorn on a free loopback port in a background thread.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn
import yaml
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from hpservice import cli
from hpservice.client import Client, ClientError, _parse_sse
from hpservice.spec import SpecError, parse_job

TOKEN = "s3cret"
TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}
T0 = 1796046270.0

GOOD_YAML = "name: tiny\nmodel: {name: llama, flavor: tiny}\ntraining: {steps: 3}\ncheckpoint: {async: true}\n"
BAD_YAML = "name: tiny\ntraining: {steps: 0}\n"


def _metrics(step: int) -> dict:
    return {"step": step, "loss": 5.0 - step, "lr": 3e-4, "grad_norm": 0.5, "tokens_per_s": 1000.0 * step}


def _job(job_id: str, state: str = "RUNNING", *, step: int = 0, total: int = 3, message: str = "", **kw) -> dict:
    job = {
        "id": job_id,
        "name": job_id.rsplit("-", 1)[0],
        "owner": "alice",
        "state": state,
        "message": message,
        "step": step,
        "total_steps": total,
        "restarts": 0,
        "restart_reasons": [],
        "created_at": T0,
        "updated_at": T0,
        "history": [{"state": "QUEUED", "time": T0, "message": "queued"}],
        "checkpoints": [],
        "spec": {"name": job_id},
        "ray_dashboard_url": None,
    }
    job.update(kw)
    return job


def _run_events(final: str, message: str, steps: int = 3) -> list[tuple[str, dict]]:
    evs: list[tuple[str, dict]] = [("state", {"state": "RUNNING", "message": "2 workers", "restarts": 0, "time": T0})]
    for s in range(1, steps + 1):
        evs.append(("metrics", _metrics(s)))
        evs.append(("log", {"rank": 0, "step": s, "line": f"step {s} done"}))
    evs.append(("checkpoint", {"step": steps, "path": f"/ckpt/step-{steps}", "metrics": {"loss": 2.0}}))
    evs.append(("state", {"state": final, "message": message, "restarts": 0, "time": T0 + 9}))
    return evs


class FakeService:
    """The store behind the fake app; ``reset`` restores the canned jobs."""

    def reset(self) -> None:
        self.requests: list[tuple[str, str]] = []
        self.last_event_ids: list[tuple[str, str | None]] = []
        self.idempotency: dict[str, str] = {}
        self.jobs: dict[str, dict] = {}
        self.events: dict[str, list[tuple[str, dict]]] = {}
        self.metrics: dict[str, list[dict]] = {}
        self.logs: dict[str, list[dict]] = {}
        self.stream_modes: dict[str, list[str]] = {}  # per job: how each next /events connection misbehaves
        self.finish_on_metrics: dict[str, str] = {}  # per job: the state it reaches once its metrics are read
        ckpt = {"step": 3, "path": "/ckpt/done/step-3", "time": T0 + 5, "metrics": {"loss": 1.75}}
        history = [
            {"state": "QUEUED", "time": T0, "message": "queued"},
            {"state": "RUNNING", "time": T0 + 1, "message": "2 workers"},
            {"state": "SUCCEEDED", "time": T0 + 9, "message": "finished 3 steps"},
        ]
        canned = [
            (_job("ok-1", created_at=T0 + 6), _run_events("SUCCEEDED", "finished 3 steps")),
            (_job("bad-1", created_at=T0 + 5), _run_events("FAILED", "worker 1 died: out of memory", steps=1)),
            (_job("poll-1", created_at=T0 + 4), []),
            (_job("drop-1", created_at=T0 + 3), _run_events("SUCCEEDED", "finished 3 steps")),
            (_job("dead-1", created_at=T0 + 2), []),
            (
                _job("done-1", "SUCCEEDED", step=3, message="finished 3 steps", checkpoints=[ckpt], history=history),
                _run_events("SUCCEEDED", "finished 3 steps"),
            ),
            (_job("gone-1", "CANCELLED", step=1, message="cancelled by alice", created_at=T0 - 1), []),
        ]
        for job, evs in canned:
            self.jobs[job["id"]] = job
            self.events[job["id"]] = evs
            self.metrics[job["id"]] = [_metrics(s) for s in range(1, 4)]
            self.logs[job["id"]] = [
                {"rank": r, "step": s, "time": T0 + s, "line": f"step {s} done"} for s in (1, 2) for r in (0, 1)
            ]
        self.finish_on_metrics["poll-1"] = "SUCCEEDED"
        self.stream_modes["poll-1"] = ["500"] * 100
        self.stream_modes["dead-1"] = ["500"] * 100

    def posts(self) -> list[str]:
        return [path for method, path in self.requests if method == "POST"]


def _err(status: int, code: str, message: str, details: list | None = None) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message, "details": details or []}}, status_code=status)


def make_app(svc: FakeService) -> FastAPI:
    app = FastAPI()

    @app.middleware("http")
    async def auth(request: Request, call_next):
        svc.requests.append((request.method, request.url.path))
        if request.url.path != "/healthz" and request.headers.get("authorization") != f"Bearer {TOKEN}":
            return _err(401, "unauthorized", "missing or invalid bearer token")
        return await call_next(request)

    def missing(job_id: str) -> JSONResponse:
        return _err(404, "not_found", f"job {job_id} not found")

    @app.get("/healthz")
    def healthz():
        return {"status": "ok"}

    @app.post("/v1/jobs")
    async def submit(request: Request):
        body = await request.body()
        try:
            if request.headers.get("content-type", "").startswith("application/yaml"):
                data = yaml.safe_load(body)
            else:
                data = json.loads(body)
            spec = parse_job(data)
        except SpecError as e:
            details = [{"path": p, "message": m} for p, m in e.errors]
            return _err(422, "invalid_spec", "invalid job spec", details)
        except (yaml.YAMLError, ValueError) as e:
            return _err(422, "invalid_spec", f"cannot parse the body: {e}")
        key = request.headers.get("idempotency-key")
        if key in svc.idempotency:
            return JSONResponse(svc.jobs[svc.idempotency[key]], status_code=200)
        job_id = f"{spec.name}-{len(svc.jobs):08x}"
        job = _job(job_id, "QUEUED", total=spec.training.steps, spec=spec.model_dump(mode="json", by_alias=True))
        job["created_at"] = T0 + 100 + len(svc.jobs)
        svc.jobs[job_id] = job
        svc.events[job_id] = _run_events("SUCCEEDED", "finished", steps=spec.training.steps)
        if key:
            svc.idempotency[key] = job_id
        return JSONResponse(job, status_code=201)

    @app.get("/v1/jobs")
    def list_jobs(
        state: str | None = None, name: str | None = None, owner: str | None = None, limit: int = 50, cursor: str = "0"
    ):
        jobs = sorted(svc.jobs.values(), key=lambda j: -j["created_at"])
        jobs = [
            j
            for j in jobs
            if (state is None or j["state"] == state)
            and (name is None or j["name"] == name)
            and (owner is None or j["owner"] == owner)
        ]
        start = int(cursor)
        nxt = str(start + limit) if start + limit < len(jobs) else None
        return {"items": jobs[start : start + limit], "next_cursor": nxt}

    @app.get("/v1/jobs/{job_id}")
    def get(job_id: str):
        return svc.jobs[job_id] if job_id in svc.jobs else missing(job_id)

    @app.post("/v1/jobs/{job_id}/cancel")
    def cancel(job_id: str):
        if job_id not in svc.jobs:
            return missing(job_id)
        job = svc.jobs[job_id]
        if job["state"] not in TERMINAL:
            job["state"] = "CANCELLING"
        return JSONResponse(job, status_code=202)

    @app.delete("/v1/jobs/{job_id}")
    def delete(job_id: str):
        if job_id not in svc.jobs:
            return missing(job_id)
        if svc.jobs[job_id]["state"] not in TERMINAL:
            return _err(409, "conflict", f"job {job_id} has not ended")
        del svc.jobs[job_id]
        return Response(status_code=204)

    @app.get("/v1/jobs/{job_id}/metrics")
    def metrics(job_id: str, since_step: int = 0):
        if job_id not in svc.jobs:
            return missing(job_id)
        records = [r for r in svc.metrics[job_id] if r["step"] > since_step]
        if job_id in svc.finish_on_metrics and svc.jobs[job_id]["state"] not in TERMINAL:
            svc.jobs[job_id].update(state=svc.finish_on_metrics[job_id], step=3, message="finished 3 steps")
            svc.logs[job_id] += [{"rank": r, "step": 3, "time": T0 + 3, "line": "step 3 done"} for r in (0, 1)]
        return {"records": records, "next_since_step": records[-1]["step"] if records else since_step}

    @app.get("/v1/jobs/{job_id}/logs")
    def logs(job_id: str, rank: int | None = None, tail: int | None = None, since: int = 0):
        """As the server: every line has its event ``seq`` (the SSE id of the same line); a job with
        an event list has logged, so far, the log events up to step 2 (the stream has them all)."""
        if job_id not in svc.jobs:
            return missing(job_id)
        evs = svc.events[job_id]
        if any(kind == "log" for kind, _ in evs):
            every = [{**d, "seq": i + 1, "time": T0 + d["step"]} for i, (kind, d) in enumerate(evs) if kind == "log"]
            every = [ln for ln in every if ln["step"] <= 2]
        else:
            every = [{**ln, "seq": i + 1} for i, ln in enumerate(svc.logs[job_id])]
        after = [ln for ln in every if ln["seq"] > since]
        lines = [ln for ln in after if rank is None or ln["rank"] == rank]
        return {"lines": lines[-tail:] if tail else lines, "next_since": after[-1]["seq"] if after else since}

    @app.post("/v1/jobs/{job_id}/resubmit")
    def resubmit(job_id: str):
        if job_id not in svc.jobs:
            return missing(job_id)
        new = {**svc.jobs[job_id], "id": f"{job_id}-again", "state": "QUEUED", "step": 0}
        svc.jobs[new["id"]] = new
        return JSONResponse(new, status_code=201)

    @app.get("/v1/jobs/{job_id}/artifacts")
    def artifacts(job_id: str):
        if job_id not in svc.jobs:
            return missing(job_id)
        names = ["rank0-steps2-3.trace.json"] if job_id == "done-1" else []
        return {"artifacts": [{"name": n, "size": 19, "rank": 0, "url": f"/v1/jobs/{job_id}/artifacts/{n}"} for n in names]}

    @app.get("/v1/jobs/{job_id}/artifacts/{name}")
    def artifact(job_id: str, name: str):
        if job_id != "done-1" or name != "rank0-steps2-3.trace.json":
            return _err(404, "not_found", f"job {job_id} has no artifact {name!r}")
        return Response(b'{"traceEvents": []}', media_type="application/json")

    @app.get("/v1/jobs/{job_id}/checkpoints")
    def checkpoints(job_id: str):
        return {"checkpoints": svc.jobs[job_id]["checkpoints"]} if job_id in svc.jobs else missing(job_id)

    @app.get("/v1/jobs/{job_id}/events")
    def events(job_id: str, request: Request):
        if job_id not in svc.jobs:
            return missing(job_id)
        last = request.headers.get("last-event-id")
        svc.last_event_ids.append((job_id, last))
        modes = svc.stream_modes.get(job_id)
        mode = modes.pop(0) if modes else "ok"
        if mode == "500":
            return _err(500, "internal", "event store unavailable")
        start = int(last) if last else 0
        pending = list(enumerate(svc.events[job_id], start=1))[start:]
        job = svc.jobs[job_id]

        def stream():
            yield ": keep-alive\n\n"
            for sent, (n, (kind, data)) in enumerate(pending):
                if sent == 2 and mode == "close":
                    return  # a clean close before the terminal state: the client must resume
                if sent == 2 and mode == "abort":
                    raise ConnectionAbortedError("fake connection drop")
                yield f"id: {n}\nevent: {kind}\ndata: {json.dumps(data)}\n\n"
                if kind == "metrics":
                    job["step"] = data["step"]
                if kind == "state":
                    job.update(state=data["state"], message=data["message"])

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def server():
    svc = FakeService()
    svc.reset()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(make_app(svc), log_level="critical", lifespan="off", timeout_graceful_shutdown=1)
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 15
    while not srv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.02)
    yield svc, f"http://127.0.0.1:{port}"
    srv.should_exit = True
    thread.join(10)
    sock.close()


@pytest.fixture
def fake(server, monkeypatch):
    """(store, url, argv prefix); the CLI's clients reconnect fast and its polling is quick."""
    svc, url = server
    svc.reset()
    monkeypatch.setattr(cli.service, "_POLL_INTERVAL_S", 0.01)
    monkeypatch.setattr(cli.service, "_client", lambda args: Client(args.url, args.token, reconnect_delay=0.01))
    monkeypatch.delenv("HPSERVICE_URL", raising=False)
    monkeypatch.delenv("HPSERVICE_TOKEN", raising=False)
    return svc, url, ["--url", url, "--token", TOKEN]


@pytest.fixture
def client(fake):
    _, url, _ = fake
    with Client(url, TOKEN, reconnect_delay=0.01) as c:
        yield c


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the client -------------------------------------------------------------------------------------


def test_client_defaults_from_environment(monkeypatch):
    monkeypatch.setenv("HPSERVICE_URL", "http://127.0.0.1:9999/")
    monkeypatch.setenv("HPSERVICE_TOKEN", "tok")
    with Client() as c:
        assert c.url == "http://127.0.0.1:9999" and c.token == "tok"
    monkeypatch.delenv("HPSERVICE_URL")
    monkeypatch.delenv("HPSERVICE_TOKEN")
    with Client() as c:
        assert c.url == "http://127.0.0.1:8000" and c.token is None
    with Client("http://h:1", "explicit") as c:
        assert c.url == "http://h:1" and c.token == "explicit"


def test_client_jobs_roundtrip(fake, client):
    assert client.health() == {"status": "ok"}
    job = client.submit(yaml.safe_load(GOOD_YAML), idempotency_key="k1")
    assert job["state"] == "QUEUED" and job["spec"]["checkpoint"]["async"] is True
    again = client.submit(GOOD_YAML, idempotency_key="k1")  # YAML text, same key: the same job
    assert again["id"] == job["id"]
    assert client.get(job["id"])["name"] == "tiny"
    page = client.list(limit=3)
    assert len(page["items"]) == 3 and page["next_cursor"] == "3"
    assert page["items"][0]["id"] == job["id"]  # newest first
    assert [j["id"] for j in client.list_all(limit=3)] == [j["id"] for j in client.list(limit=100)["items"]]
    assert [j["id"] for j in client.list(state="SUCCEEDED")["items"]] == ["done-1"]
    assert [r["step"] for r in client.metrics("ok-1", since_step=1)["records"]] == [2, 3]
    page = client.logs("ok-1", rank=0, tail=1)
    assert [ln["step"] for ln in page["lines"]] == [2] and page["next_since"] == page["lines"][0]["seq"]
    assert client.logs("ok-1", since=page["next_since"])["lines"] == []  # nothing after the cursor yet
    assert client.checkpoints("done-1")["checkpoints"][0]["step"] == 3
    assert client.cancel("ok-1")["state"] == "CANCELLING"
    assert client.delete("done-1") is None
    with pytest.raises(ClientError) as e:
        client.get("done-1")
    assert e.value.status == 404 and e.value.code == "not_found" and "done-1" in str(e.value)


def test_client_errors(fake, client):
    _, url, _ = fake
    with pytest.raises(ClientError) as e:
        client.submit(BAD_YAML)
    assert e.value.status == 422 and e.value.code == "invalid_spec"
    assert e.value.details == [{"path": "training.steps", "message": "Input should be greater than 0"}]
    assert "training.steps: Input should be greater than 0" in str(e.value)
    with pytest.raises(ClientError) as e:
        client.delete("ok-1")
    assert e.value.status == 409
    with Client(url, "wrong") as bad, pytest.raises(ClientError) as e:
        bad.list()
    assert e.value.status == 401 and e.value.code == "unauthorized"
    unreachable = f"http://127.0.0.1:{_free_port()}"
    with Client(unreachable, timeout=2) as c, pytest.raises(ClientError) as e:
        c.health()
    assert e.value.status == 0 and unreachable in str(e.value)


def test_client_non_json_errors():
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/healthz":
            return httpx.Response(502, text="bad gateway from proxy")
        return httpx.Response(422, json={"detail": [{"loc": ["body"], "msg": "field required"}]})

    with Client("http://fake", transport=httpx.MockTransport(handler)) as c:
        with pytest.raises(ClientError) as e:
            c.health()
        assert e.value.status == 502 and "bad gateway from proxy" in str(e.value)
        with pytest.raises(ClientError) as e:
            c.get("x")
        assert e.value.status == 422 and e.value.details[0]["msg"] == "field required"


def test_sse_parser():
    raw = [
        b": keep-alive\r\n\r\n",
        b'id: 7\r\nevent: metrics\r\ndata: {"step":',
        ' 1}\r\n\r\nid:8\nevent:log\ndata: {"line": "a\u2028b"}\n\n'.encode(),  # a literal U+2028 is no line end
        b'data: {"a": 1,\ndata: "b": 2}\n\r',  # multi-line data, no id/event (CR-terminated blank line)
        b"\r",
        b'id: 9\nevent: state\ndata: {"state"',  # an unterminated last event is dropped
    ]
    evs = list(_parse_sse(iter(raw)))
    assert evs == [
        {"id": 7, "event": "metrics", "data": {"step": 1}},
        {"id": 8, "event": "log", "data": {"line": "a\u2028b"}},
        {"id": 8, "event": "message", "data": {"a": 1, "b": 2}},
    ]


def test_events_stream_in_order(fake, client):
    svc, _, _ = fake
    evs = list(client.events("ok-1"))
    assert [e["id"] for e in evs] == list(range(1, len(svc.events["ok-1"]) + 1))
    assert evs[1] == {"id": 2, "event": "metrics", "data": _metrics(1)}
    assert evs[-1]["event"] == "state" and evs[-1]["data"]["state"] == "SUCCEEDED"
    assert [e["id"] for e in client.events("ok-1", last_event_id=7)] == [8, 9]


@pytest.mark.parametrize("mode", ["close", "abort"])
def test_events_reconnect_with_last_event_id(fake, client, mode):
    svc, _, _ = fake
    svc.stream_modes["drop-1"] = [mode, mode]
    evs = list(client.events("drop-1"))
    assert [e["id"] for e in evs] == list(range(1, len(svc.events["drop-1"]) + 1))  # no gap, no duplicate
    assert svc.last_event_ids == [("drop-1", None), ("drop-1", "2"), ("drop-1", "4")]


def test_events_give_up_after_reconnects(fake, client):
    svc, _, _ = fake
    with pytest.raises(ClientError) as e:
        list(client.events("dead-1"))
    assert e.value.status == 500 and "gave up" in str(e.value)
    assert len(svc.last_event_ids) == client.max_reconnects + 1
    with pytest.raises(ClientError) as e:  # a 404 is final: no retries
        list(client.events("nope"))
    assert e.value.status == 404


# -- the CLI ----------------------------------------------------------------------------------------


def test_cli_submit_bad_spec_sends_nothing(fake, tmp_path, capsys):
    svc, _, opts = fake
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD_YAML)
    assert cli.main(["submit", str(bad), *opts]) == 2
    assert "training.steps" in capsys.readouterr().err
    good = tmp_path / "good.yaml"
    good.write_text(GOOD_YAML)
    assert cli.main(["submit", str(good), "--set", "training.steps=-1", *opts]) == 2
    assert svc.requests == []


def test_cli_submit(fake, tmp_path, capsys):
    svc, _, opts = fake
    good = tmp_path / "good.yaml"
    good.write_text(GOOD_YAML)
    assert cli.main(["submit", str(good), "--set", "training.steps=5", *opts]) == 0
    (job_id,) = [j for j in svc.jobs if j.startswith("tiny-")]
    out = capsys.readouterr().out
    assert job_id in out and "QUEUED" in out
    assert svc.jobs[job_id]["spec"]["training"]["steps"] == 5
    assert cli.main(["submit", str(good), "--json", "--idempotency-key", "abc", *opts]) == 0
    first = json.loads(capsys.readouterr().out)
    assert cli.main(["submit", str(good), "--json", "--idempotency-key", "abc", *opts]) == 0
    assert json.loads(capsys.readouterr().out)["id"] == first["id"]


def test_cli_submit_watch(fake, tmp_path, capsys):
    _, _, opts = fake
    good = tmp_path / "good.yaml"
    good.write_text(GOOD_YAML)
    assert cli.main(["submit", str(good), "--watch", *opts]) == 0
    out = capsys.readouterr().out
    assert "submitted job tiny-" in out and "SUCCEEDED" in out and "step 3/3" in out


def test_cli_list(fake, capsys):
    _, _, opts = fake
    assert cli.main(["list", "--json", *opts]) == 0
    page = json.loads(capsys.readouterr().out)
    assert [j["id"] for j in page["items"]] == ["ok-1", "bad-1", "poll-1", "drop-1", "dead-1", "done-1", "gone-1"]
    assert cli.main(["list", "--state", "SUCCEEDED", *opts]) == 0
    out = capsys.readouterr().out
    assert "done-1" in out and "3/3" in out and "ok-1" not in out
    assert cli.main(["list", "--limit", "2", *opts]) == 0
    captured = capsys.readouterr()
    assert "ok-1" in captured.out and "bad-1" in captured.out and "--cursor 2" in captured.err


def test_cli_status(fake, capsys):
    _, _, opts = fake
    assert cli.main(["status", "done-1", *opts]) == 0
    out = capsys.readouterr().out
    for text in ("SUCCEEDED: finished 3 steps", "3/3", "1 (latest: step 3", "history", "RUNNING"):
        assert text in out
    assert cli.main(["status", "done-1", "--json", *opts]) == 0
    assert json.loads(capsys.readouterr().out)["checkpoints"][0]["path"] == "/ckpt/done/step-3"


def test_cli_watch_succeeded(fake, capsys):
    _, _, opts = fake
    assert cli.main(["watch", "ok-1", *opts]) == 0
    out = capsys.readouterr().out
    assert "SUCCEEDED: finished 3 steps" in out and "final loss 2.0000" in out and "checkpoint at step 3" in out


def test_cli_watch_failed(fake, capsys):
    _, _, opts = fake
    assert cli.main(["watch", "bad-1", *opts]) == 1
    assert "FAILED: worker 1 died: out of memory" in capsys.readouterr().out


def test_cli_watch_json_and_ended_jobs(fake, capsys):
    _, _, opts = fake
    assert cli.main(["watch", "ok-1", "--json", *opts]) == 0
    lines = [json.loads(ln) for ln in capsys.readouterr().out.splitlines()]
    assert lines[1]["event"] == "metrics" and lines[-2]["data"]["state"] == "SUCCEEDED"
    assert lines[-1]["event"] == "job" and lines[-1]["data"]["id"] == "ok-1"
    assert cli.main(["watch", "gone-1", *opts]) == 130  # already CANCELLED
    assert "CANCELLED" in capsys.readouterr().out


def test_cli_watch_falls_back_to_polling(fake, capsys):
    svc, _, opts = fake
    assert cli.main(["watch", "poll-1", *opts]) == 0
    captured = capsys.readouterr()
    assert "polling" in captured.err and "SUCCEEDED" in captured.out and "final loss 2.0000" in captured.out
    assert ("GET", "/v1/jobs/poll-1/metrics") in svc.requests


def test_cli_logs(fake, capsys):
    _, _, opts = fake
    assert cli.main(["logs", "ok-1", "--rank", "0", *opts]) == 0
    assert capsys.readouterr().out.splitlines() == ["[rank 0 step 1] step 1 done", "[rank 0 step 2] step 2 done"]
    assert cli.main(["logs", "ok-1", "--tail", "1", "--json", *opts]) == 0
    assert json.loads(capsys.readouterr().out) == {"rank": 0, "step": 2, "time": T0 + 2, "line": "step 2 done", "seq": 5}
    # -f: the tail, then only the log events after it (the stream replays history first).
    assert cli.main(["logs", "ok-1", "-f", "--rank", "0", *opts]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "[rank 0 step 1] step 1 done",
        "[rank 0 step 2] step 2 done",
        "[rank 0 step 3] step 3 done",
    ]


def test_cli_logs_follow_falls_back_to_polling(fake, capsys):
    _, _, opts = fake
    assert cli.main(["logs", "poll-1", "-f", "--tail", "2", *opts]) == 0
    captured = capsys.readouterr()
    assert "polling" in captured.err
    assert captured.out.splitlines() == [
        "[rank 0 step 2] step 2 done",
        "[rank 1 step 2] step 2 done",
        "[rank 0 step 3] step 3 done",
        "[rank 1 step 3] step 3 done",
    ]


def test_cli_cancel_checkpoints_delete(fake, capsys):
    svc, _, opts = fake
    assert cli.main(["cancel", "ok-1", *opts]) == 0
    assert "cancel requested for job ok-1 (CANCELLING)" in capsys.readouterr().out
    assert cli.main(["cancel", "done-1", *opts]) == 0  # not an error, and not "cancel requested" either
    assert capsys.readouterr().out.strip() == "job done-1 had already ended (SUCCEEDED): nothing to cancel"
    assert cli.main(["checkpoints", "done-1", *opts]) == 0
    out = capsys.readouterr().out
    assert "/ckpt/done/step-3" in out and "loss=1.75" in out
    assert cli.main(["checkpoints", "done-1", "--json", *opts]) == 0
    assert json.loads(capsys.readouterr().out)["checkpoints"][0]["step"] == 3
    assert cli.main(["delete", "bad-1", *opts]) == 2  # 409: not ended
    assert "409" in capsys.readouterr().err
    assert cli.main(["delete", "done-1", *opts]) == 0
    assert "done-1" not in svc.jobs


def test_cli_resubmit(fake, capsys):
    svc, _, opts = fake
    assert cli.main(["resubmit", "done-1", *opts]) == 0
    assert capsys.readouterr().out.strip() == "submitted job done-1-again (QUEUED) from done-1's spec"
    assert "done-1-again" in svc.jobs
    assert cli.main(["resubmit", "nope", *opts]) == 3


def test_cli_artifacts_list_and_download(fake, tmp_path, capsys):
    _, _, opts = fake
    assert cli.main(["logs", "done-1", *opts]) == 0
    assert "artifacts: rank0-steps2-3.trace.json" in capsys.readouterr().err  # stdout stays the log
    assert cli.main(["artifacts", "done-1", *opts]) == 0
    assert capsys.readouterr().out.strip() == "rank0-steps2-3.trace.json  19 bytes"
    assert cli.main(["artifacts", "done-1", "--download", "all", "-o", str(tmp_path / "got"), *opts]) == 0
    assert json.loads((tmp_path / "got" / "rank0-steps2-3.trace.json").read_text()) == {"traceEvents": []}
    assert cli.main(["artifacts", "done-1", "--download", "nope.json", "-o", str(tmp_path), *opts]) == 3
    assert "no artifact 'nope.json'" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.part"))
    assert cli.main(["artifacts", "ok-1", *opts]) == 0
    assert capsys.readouterr().out.strip() == "job ok-1 has no artifacts (a job with metrics.profile writes its traces there)"


def test_cli_exit_codes_for_errors(fake, capsys):
    _, url, opts = fake
    assert cli.main(["status", "nope", *opts]) == 3
    assert "job nope not found" in capsys.readouterr().err
    assert cli.main(["watch", "nope", *opts]) == 3
    assert cli.main(["list", "--url", url, "--token", "wrong"]) == 4
    assert "401" in capsys.readouterr().err
    assert cli.main(["list", "--url", url]) == 4  # no token at all
    unreachable = f"http://127.0.0.1:{_free_port()}"
    assert cli.main(["list", "--url", unreachable]) == 5
    assert unreachable in capsys.readouterr().err
    assert cli.main(["list", "--url", "localhost:8000"]) == 2  # no scheme: a usage error
    assert "invalid service URL" in capsys.readouterr().err


def test_cli_url_and_token_from_environment(fake, monkeypatch, capsys):
    _, url, _ = fake
    monkeypatch.setenv("HPSERVICE_URL", url)
    monkeypatch.setenv("HPSERVICE_TOKEN", TOKEN)
    assert cli.main(["status", "ok-1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["id"] == "ok-1"
