"""Hostile and broken input against the REST layer: never a 500, nothing stored half-way, the
server stays responsive (each attack is followed by a normal request)."""

import sqlite3
import threading

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.exc import OperationalError

from hpservice.api import Settings, create_app

SPEC = {"name": "tiny", "model": {"name": "llama", "flavor": "tiny"}, "training": {"steps": 3}}
BOMB = "\n".join(
    [
        "a: &a [x, x, x, x, x, x, x, x, x]",
        *(f"{b}: &{b} [{', '.join([f'*{a}'] * 9)}]" for a, b in zip("abcdefgh", "bcdefghi", strict=True)),
        "name: bomb",
    ]
)


@pytest.fixture
def client(tmp_path):
    with TestClient(create_app(Settings(data_dir=tmp_path), connect_ray=False, supervise=False)) as c:
        yield c


def _nothing_stored_and_alive(c):
    assert c.get("/v1/jobs").json()["items"] == []
    assert c.post("/v1/jobs", json=SPEC).status_code == 201  # still serving
    c.app.state.store.delete_job(c.get("/v1/jobs").json()["items"][0]["id"])


def _yaml(c, text):
    return c.post("/v1/jobs", content=text, headers={"Content-Type": "application/yaml"})


def test_yaml_alias_bombs_are_refused(client):
    assert len(BOMB) < 500  # a billion "x" after expansion
    r = _yaml(client, BOMB)
    assert r.status_code == 422 and "values" in r.text, r.text
    inside = BOMB.replace("name: bomb", "name: bomb\nmodel: {name: llama, overrides: {layers: *i}}")
    assert _yaml(client, inside).status_code == 422
    many = "\n".join(["a: &a 1", *(f"k{i}: *a" for i in range(200)), "name: x"])
    r = _yaml(client, many)
    assert r.status_code == 422 and "more than 100 aliases" in r.text
    _nothing_stored_and_alive(client)


def test_deep_nesting_is_refused(client):
    deep = '{"name": "x", "model": {"overrides": ' + '{"a": ' * 2000 + "{}" + "}" * 2000 + "}}"
    r = client.post("/v1/jobs", content=deep, headers={"Content-Type": "application/json"})
    assert r.status_code == 422 and "nested" in r.text
    r = client.post("/v1/jobs", content="[" * 100_000, headers={"Content-Type": "application/json"})
    assert r.status_code == 422
    assert _yaml(client, "name: x\nmodel: {overrides: " + "[" * 500 + "]" * 500 + "}").status_code == 422
    _nothing_stored_and_alive(client)


@pytest.mark.parametrize(
    ("body", "ctype", "path"),
    [
        ('{"name": "x", "training": {"steps": 100000000000000000000}}', "application/json", "training.steps"),
        ('{"name": "x", "training": {"steps": 1e20}}', "application/json", "training.steps"),
        ("name: x\noptimizer: {lr: .inf}\n", "application/yaml", "optimizer.lr"),
        ("name: x\nmodel: {overrides: {dim: .nan}}\n", "application/yaml", "model.overrides.dim"),
        ('{"name": "x", "data": {"seed": -9223372036854775809}}', "application/json", "data.seed"),
        ('{"name": "x", "model": {"overrides": {"blob": "' + "y" * 70_000 + '"}}}', "application/json", "model.overrides"),
    ],
)
def test_numbers_past_int64_non_finite_floats_and_oversized_fields_are_422(client, body, ctype, path):
    r = client.post("/v1/jobs", content=body, headers={"Content-Type": ctype})
    assert r.status_code == 422, r.text
    assert any(d["path"] == path for d in r.json()["error"]["details"]), r.json()
    _nothing_stored_and_alive(client)


def test_bodies_past_the_limit_are_413_even_without_a_length(client):
    big = b'{"name": "x", "pad": "' + b"z" * (2 << 20) + b'"}'
    assert client.post("/v1/jobs", content=big, headers={"Content-Type": "application/json"}).status_code == 413

    def chunks():  # no Content-Length (chunked); the real server's early stop: test_service_e2e
        for _ in range(64):
            yield b" " * (64 << 10)

    r = client.post("/v1/jobs", content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    _nothing_stored_and_alive(client)


def test_query_and_header_integers_past_int64(client):
    job = client.post("/v1/jobs", json=SPEC).json()["id"]
    assert client.get(f"/v1/jobs/{job}/metrics", params={"since_step": 2**63}).status_code == 422
    assert client.get(f"/v1/jobs/{job}/metrics", params={"since_step": 2**63 - 1}).status_code == 200
    for bad in (str(2**63), "-1", "abc"):
        r = client.get(f"/v1/jobs/{job}/events", headers={"Last-Event-ID": bad})
        assert r.status_code == 400, (bad, r.text)


def test_nul_bytes_in_filters_ids_and_cursors_never_reach_the_database(client):
    """PostgreSQL refuses NUL in text: found by the fuzzer as a 500 for ``GET /v1/jobs?name=%00``.
    Filters are checked against what a name, owner or state can be (422), an id no job can have
    is not looked up (404), and a cursor must hold a time and a job id (400)."""
    import base64
    import json

    job = client.post("/v1/jobs", json=SPEC).json()
    for params in ({"name": "\x00"}, {"owner": "a\x00"}, {"state": "\x00"}, {"state": "RUNNNING"}):
        r = client.get("/v1/jobs", params=params)
        assert r.status_code == 422, (params, r.text)
    assert client.get("/v1/jobs/%00").status_code == 404
    assert client.get("/v1/jobs/x%0A").status_code == 404
    for cursor in ([1.0, "\x00"], [float("nan"), job["id"]], [1.0, 2]):
        encoded = base64.urlsafe_b64encode(json.dumps(cursor).encode()).decode()
        assert client.get("/v1/jobs", params={"cursor": encoded}).status_code == 400, cursor
    # and the filters that are well formed still work
    assert [j["id"] for j in client.get("/v1/jobs", params={"name": job["name"], "state": "QUEUED"}).json()["items"]] == [job["id"]]
    assert client.get(f"/v1/jobs/{job['id']}").status_code == 200


def test_an_idempotency_key_reused_with_a_different_body_is_409(client):
    key = {"Idempotency-Key": "k1"}
    first = client.post("/v1/jobs", json=SPEC, headers=key)
    again = client.post("/v1/jobs", json=SPEC, headers=key)
    assert first.status_code == 201 and again.status_code == 200 and again.json()["id"] == first.json()["id"]
    other = client.post("/v1/jobs", json={**SPEC, "training": {"steps": 4}}, headers=key)
    assert other.status_code == 409 and "different job spec" in other.json()["error"]["message"]
    assert len(client.get("/v1/jobs").json()["items"]) == 1


def test_sse_of_an_ended_job_past_its_last_event_closes_at_once(client):
    job = client.post("/v1/jobs", json=SPEC).json()["id"]
    client.app.state.store.set_state(job, "SUCCEEDED", "done")
    last = client.app.state.store.events(job, 0)[-1][0]
    done = {}

    def read(after):
        with client.stream("GET", f"/v1/jobs/{job}/events", headers={"Last-Event-ID": str(after)}) as r:
            done[after] = (r.status_code, list(r.iter_lines()))

    for after in (last, last + 100):
        t = threading.Thread(target=read, args=(after,), daemon=True)
        t.start()
        t.join(60)  # the old stream waited for events forever, sending keep-alives
        assert not t.is_alive() and done[after][0] == 200
        assert not any(line.startswith("id:") for line in done[after][1])


def test_store_failures_are_503_with_the_reason_and_readyz_follows(client, monkeypatch):
    store = client.app.state.store
    full = OperationalError("INSERT INTO jobs ...", {}, sqlite3.OperationalError("database or disk is full"))

    def broken(*args, **kwargs):
        raise full

    monkeypatch.setattr(store, "create_job", broken)
    r = client.post("/v1/jobs", json=SPEC)
    assert r.status_code == 503 and r.json()["error"]["message"] == "store unavailable: database or disk is full"
    assert r.headers["Retry-After"] == "5"
    monkeypatch.setattr(store, "ping", broken)
    ready = client.get("/readyz")
    assert ready.status_code == 503 and "database or disk is full" in ready.json()["error"]["message"]
    monkeypatch.undo()  # space is back
    assert client.get("/readyz").json()["error"]["message"] == "not connected to Ray"  # the store is fine again
    assert client.post("/v1/jobs", json=SPEC).status_code == 201
