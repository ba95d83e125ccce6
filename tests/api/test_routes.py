"""The REST layer alone (no Ray): validation, errors, auth, idempotency, pagination, OpenAPI."""

import pytest
from fastapi.testclient import TestClient

from hpservice.api import Settings, create_app
from hpservice.api.settings import Principal, load_tokens

TOKENS = {"t-alice": Principal("alice"), "t-bob": Principal("bob"), "t-admin": Principal("ops", admin=True)}
SPEC = {"name": "tiny", "model": {"name": "llama", "flavor": "tiny"}, "training": {"steps": 3}}


def _client(tmp_path, tokens=None):
    settings = Settings(data_dir=tmp_path, tokens=tokens or {})
    return TestClient(create_app(settings, connect_ray=False, supervise=False))


def _auth(token):
    return {"Authorization": f"Bearer {token}"}


def test_submit_json_and_yaml(tmp_path):
    with _client(tmp_path) as c:
        r = c.post("/v1/jobs", json=SPEC)
        assert r.status_code == 201 and r.json()["state"] == "QUEUED" and r.json()["owner"] == "local"
        yaml_body = "name: tiny\nmodel: {name: llama, flavor: tiny}\ntraining: {steps: 3}\n"
        r = c.post("/v1/jobs", content=yaml_body, headers={"Content-Type": "application/yaml"})
        assert r.status_code == 201 and r.json()["spec"]["training"]["steps"] == 3
        job = c.get(f"/v1/jobs/{r.json()['id']}").json()
        assert job["history"][0]["state"] == "QUEUED" and job["total_steps"] == 3


@pytest.mark.parametrize(
    "body,ctype,path,fragment",
    [
        ('{"name": "x", "training": {"steps": 0}}', "application/json", "training.steps", "greater than 0"),
        ('{"name": "x", "trainng": {}}', "application/json", "trainng", "unknown field"),
        ("name: x\ntraining: {steps: [1\n", "application/yaml", None, "YAML syntax error at line 3"),
        ('{"name": ', "application/json", None, "JSON syntax error at line 1"),
        ("[1, 2]", "application/json", None, "expected a mapping"),
        (
            '{"name": "x", "parallelism": {"pp": 2, "cp": 2}, "resources": {"workers": 4}}',
            "application/json",
            "parallelism.pp",
            "pp > 1 with cp > 1 is not built yet",
        ),
    ],
)
def test_bad_specs_are_422_with_the_path(tmp_path, body, ctype, path, fragment):
    with _client(tmp_path) as c:
        r = c.post("/v1/jobs", content=body, headers={"Content-Type": ctype})
        assert r.status_code == 422, r.text
        err = r.json()["error"]
        assert err["code"] == "invalid"
        if path:
            assert any(d["path"] == path and fragment in d["message"] for d in err["details"]), err
        else:
            assert fragment in err["message"]
        assert c.get("/v1/jobs").json()["items"] == []  # nothing stored half-way


def test_unsupported_type_and_unknown_routes_are_json_errors(tmp_path):
    with _client(tmp_path) as c:
        r = c.post("/v1/jobs", content="x", headers={"Content-Type": "text/csv"})
        assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
        assert c.get("/v1/nothing").json()["error"]["code"] == "not_found"
        assert c.get("/v1/jobs", params={"limit": 0}).status_code == 422
        assert c.get("/v1/jobs", params={"cursor": "???"}).json()["error"]["message"] == "invalid cursor"


def test_idempotency_key_makes_retries_safe(tmp_path):
    with _client(tmp_path) as c:
        first = c.post("/v1/jobs", json=SPEC, headers={"Idempotency-Key": "k1"})
        again = c.post("/v1/jobs", json=SPEC, headers={"Idempotency-Key": "k1"})
        other = c.post("/v1/jobs", json=SPEC, headers={"Idempotency-Key": "k2"})
        assert first.status_code == 201 and again.status_code == 200
        assert first.json()["id"] == again.json()["id"] != other.json()["id"]
        assert len(c.get("/v1/jobs").json()["items"]) == 2


def test_list_filters_and_cursor_pagination(tmp_path):
    with _client(tmp_path) as c:
        ids = [c.post("/v1/jobs", json={**SPEC, "name": f"j{i % 2}"}).json()["id"] for i in range(7)]
        seen, cursor = [], None
        while True:
            page = c.get("/v1/jobs", params={"limit": 3, **({"cursor": cursor} if cursor else {})}).json()
            seen += [j["id"] for j in page["items"]]
            cursor = page["next_cursor"]
            if cursor is None:
                break
        assert sorted(seen) == sorted(ids) and len(seen) == 7  # every job once, newest first
        assert {j["name"] for j in c.get("/v1/jobs", params={"name": "j1"}).json()["items"]} == {"j1"}
        assert len(c.get("/v1/jobs", params={"state": "QUEUED"}).json()["items"]) == 7


def test_delete_only_ended_jobs(tmp_path):
    with _client(tmp_path) as c:
        job = c.post("/v1/jobs", json=SPEC).json()
        assert c.delete(f"/v1/jobs/{job['id']}").status_code == 409
        c.app.state.store.set_state(job["id"], "FAILED", "test")
        assert c.delete(f"/v1/jobs/{job['id']}").status_code == 204
        assert c.get(f"/v1/jobs/{job['id']}").status_code == 404


def test_auth_owners_and_admin(tmp_path):
    with _client(tmp_path, TOKENS) as c:
        assert c.get("/v1/jobs").status_code == 401
        assert c.post("/v1/jobs", json=SPEC, headers=_auth("wrong")).status_code == 401
        assert c.get("/healthz").status_code == 200  # health needs no token
        job = c.post("/v1/jobs", json=SPEC, headers=_auth("t-alice")).json()
        assert job["owner"] == "alice"
        assert c.get(f"/v1/jobs/{job['id']}", headers=_auth("t-bob")).status_code == 404
        assert c.post(f"/v1/jobs/{job['id']}/cancel", headers=_auth("t-bob")).status_code == 404
        assert c.get("/v1/jobs", headers=_auth("t-bob")).json()["items"] == []
        assert c.get("/v1/jobs", params={"owner": "alice"}, headers=_auth("t-bob")).json()["items"] == []
        assert len(c.get("/v1/jobs", headers=_auth("t-admin")).json()["items"]) == 1
        assert c.get(f"/v1/jobs/{job['id']}/events", params={"token": "t-bob"}).status_code == 404


def test_tokens_config_and_loopback_only_without_tokens():
    tokens = load_tokens(env="a=alice,b=ops:admin")
    assert tokens == {"a": Principal("alice"), "b": Principal("ops", True)}
    with pytest.raises(ValueError, match="expected TOKEN=owner"):
        load_tokens(env="nope")
    with pytest.raises(ValueError, match="only loopback addresses are allowed"):
        Settings(host="0.0.0.0").check_bind()
    Settings(host="127.0.0.1").check_bind()
    Settings(host="0.0.0.0", tokens=tokens).check_bind()


def test_metrics_and_events_replay(tmp_path):
    with _client(tmp_path) as c:
        job = c.post("/v1/jobs", json=SPEC).json()
        store = c.app.state.store
        store.add_metrics(job["id"], [{"step": s, "loss": 5.0 - s} for s in (1, 2, 3)])
        store.set_state(job["id"], "SUCCEEDED", "done")
        assert [
            r["step"] for r in c.get(f"/v1/jobs/{job['id']}/metrics", params={"since_step": 1}).json()["records"]
        ] == [2, 3]
        body = c.get(f"/v1/jobs/{job['id']}/events").text
        events = [block for block in body.strip().split("\n\n") if block]
        assert body.count("event: metrics") == 3
        assert events[-1].splitlines()[1] == "event: state" and '"SUCCEEDED"' in events[-1]  # the stream ended there
        resumed = c.get(f"/v1/jobs/{job['id']}/events", headers={"Last-Event-ID": "3"}).text
        assert resumed.startswith("id: 4\nevent: metrics") and "SUCCEEDED" in resumed
        assert "hpservice_jobs" in c.get("/metrics").text


def test_openapi_publishes_the_job_spec(tmp_path):
    with _client(tmp_path) as c:
        schema = c.get("/openapi.json").json()
        body = schema["paths"]["/v1/jobs"]["post"]["requestBody"]["content"]
        assert body["application/json"]["schema"]["$ref"] == "#/components/schemas/JobSpec"
        assert "TrainingSpec" in schema["components"]["schemas"]


def test_artifacts_are_listed_and_downloaded_only_from_the_jobs_own_folder(tmp_path):
    """GET /v1/jobs/{id}/artifacts lists the run's profiler files; a download serves only a regular
    file directly in that folder: no traversal, no link out, no other owner's job."""
    from pathlib import Path

    with _client(tmp_path, TOKENS) as c:
        job = c.post("/v1/jobs", json=SPEC, headers=_auth("t-alice")).json()
        folder = Path(job["spec"]["metrics"]["dir"]) / job["id"] / "artifacts"
        assert c.get(f"/v1/jobs/{job['id']}/artifacts", headers=_auth("t-alice")).json() == {"artifacts": []}
        folder.mkdir(parents=True)
        (folder / "rank0-steps3-4.trace.json").write_text('{"traceEvents": []}')
        (folder / "rank1-steps3-4.trace.json").write_text('{"traceEvents": [1]}')
        secret = tmp_path / "server-secret.txt"
        secret.write_text("operator's secret")
        (folder / "link.json").symlink_to(secret)
        (folder / "sub").mkdir()
        listed = c.get(f"/v1/jobs/{job['id']}/artifacts", headers=_auth("t-alice")).json()["artifacts"]
        assert [(a["name"], a["rank"]) for a in listed] == [("rank0-steps3-4.trace.json", 0), ("rank1-steps3-4.trace.json", 1)]
        r = c.get(listed[1]["url"], headers=_auth("t-alice"))
        assert r.status_code == 200 and r.json() == {"traceEvents": [1]}
        assert "rank1-steps3-4.trace.json" in r.headers["content-disposition"]
        for name in ("link.json", "sub", "..%2F..%2Fserver-secret.txt", "%2E%2E", ".hidden", "missing.json"):
            r = c.get(f"/v1/jobs/{job['id']}/artifacts/{name}", headers=_auth("t-alice"))
            assert r.status_code == 404 and "secret" not in r.text, name
        assert c.get(listed[0]["url"], headers=_auth("t-bob")).status_code == 404  # another owner's job
        assert c.get(f"/v1/jobs/{job['id']}/artifacts", headers=_auth("t-bob")).status_code == 404
        assert c.get(listed[0]["url"]).status_code == 401


def test_job_states_come_from_the_one_vocabulary(tmp_path):
    from hpservice.jobs import ACTIVE_STATES, TERMINAL_STATES, JobState

    with _client(tmp_path, TOKENS) as c:
        body = c.get("/v1/job-states").json()  # no token: it is the protocol, not anyone's data
    assert body["states"] == [s.value for s in JobState]
    assert set(body["terminal"]) == TERMINAL_STATES and body["active"] == list(ACTIVE_STATES)
    assert all(JobState(s).is_terminal for s in body["terminal"])
    assert not any(JobState(s).is_terminal for s in body["active"])


def test_submit_refuses_a_layout_that_cannot_fill_the_workers(tmp_path):
    with _client(tmp_path) as c:
        r = c.post("/v1/jobs", json={**SPEC, "parallelism": {"tp": 3}, "resources": {"workers": 2}})
    assert r.status_code == 422
    (detail,) = r.json()["error"]["details"]
    assert detail["path"] == "parallelism" and "not divisible" in detail["message"]


def test_an_ended_job_never_moves_again(tmp_path):
    """A late status (a coordinator the server already gave up on) cannot bring a job back."""
    with _client(tmp_path) as c:
        job = c.post("/v1/jobs", json=SPEC).json()
        store = c.app.state.store
        store.set_state(job["id"], "FAILED", "coordinator lost")
        store.update_status(job["id"], {"state": "RUNNING", "message": "2 workers", "step": 5})
        after = c.get(f"/v1/jobs/{job['id']}").json()
    assert after["state"] == "FAILED" and after["message"] == "coordinator lost"


def test_resubmit_makes_a_new_job_from_the_submitted_spec_in_its_own_directory(tmp_path):
    with _client(tmp_path, TOKENS) as c:
        first = c.post("/v1/jobs", json={**SPEC, "metrics": {"dir": "out"}}, headers=_auth("t-alice")).json()
        again = c.post(f"/v1/jobs/{first['id']}/resubmit", headers=_auth("t-alice"))
        assert again.status_code == 201, again.text
        new = again.json()
        assert new["id"] != first["id"] and new["name"] == first["name"] and new["state"] == "QUEUED"
        assert new["spec"]["training"] == first["spec"]["training"]
        # admitted again for the new job: its outputs are under its own directory, not the first's
        assert new["id"] in new["spec"]["metrics"]["dir"] and first["id"] not in new["spec"]["metrics"]["dir"]
        assert c.post(f"/v1/jobs/{first['id']}/resubmit", headers=_auth("t-bob")).status_code == 404


def test_events_deliver_a_terminal_state_committed_between_two_reads(tmp_path, monkeypatch):
    """The stream reads events, finds none, then reads the job: if the job ended in between, its
    terminal state event is delivered, not dropped (seen on a loaded machine)."""
    with _client(tmp_path) as c:
        job = c.post("/v1/jobs", json=SPEC).json()
        store = c.app.state.store
        store.add_metrics(job["id"], [{"step": 1, "loss": 5.0}])
        store.set_state(job["id"], "SUCCEEDED", "done")
        last = store.events(job["id"], 0)[-1][0]
        real, calls = store.events, []

        def events(job_id, after, *args):  # the first read comes just before the commit
            calls.append(after)
            return [] if len(calls) == 1 else real(job_id, after, *args)

        monkeypatch.setattr(store, "events", events)
        body = c.get(f"/v1/jobs/{job['id']}/events", headers={"Last-Event-ID": str(last - 1)}).text
    assert f"id: {last}\nevent: state" in body and "SUCCEEDED" in body
