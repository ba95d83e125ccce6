"""The store on both of its databases: SQLite (the embedded default) and a real PostgreSQL started
by the tests (``store_url`` runs each test on both). The job lifecycle, metrics and events, the
atomic launch claim and the supervisor lease, concurrent writers to one job, and the API end to end."""

import threading

from fastapi.testclient import TestClient

from hpservice.api import Settings, create_app
from hpservice.api.store import Store

SPEC = {"name": "s", "model": {"name": "llama", "flavor": "tiny"}, "training": {"steps": 10}}


def test_a_jobs_life_in_the_store(store_url):
    store = Store(store_url)
    store.create_job("j1", "s", "alice", SPEC, 10, None)
    assert store.get_job("j1").state == "QUEUED" and [j.id for j in store.jobs_in(("QUEUED",))] == ["j1"]
    store.update_status("j1", {"state": "RUNNING", "message": "go", "step": 2, "history": [{"state": "RUNNING", "time": 1.0, "message": "go"}]})
    store.add_metrics("j1", [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}])
    store.add_metrics("j1", [{"step": 2, "loss": 1.4}])  # a restart's replay replaces the step
    assert store.metrics("j1", 0) == [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.4}]
    assert store.last_metric_step("j1") == 2
    store.set_state("j1", "SUCCEEDED", "done")
    store.update_status("j1", {"state": "RUNNING", "message": "late"})  # an ended job never moves again
    job = store.get_job("j1")
    assert job.state == "SUCCEEDED" and job.message == "done"
    kinds = [kind for _, kind, _ in store.events("j1", 0)]
    assert kinds[0] == "state" and kinds.count("metrics") == 3 and kinds[-1] == "state"
    seqs = [seq for seq, _, _ in store.events("j1", 0)]
    assert seqs == list(range(1, len(seqs) + 1))
    assert store.count_by_state() == {"SUCCEEDED": 1}


def test_only_one_of_many_concurrent_claims_launches_a_job(store_url):
    stores = [Store(store_url) for _ in range(4)]  # as four replicas would, each its own engine
    stores[0].create_job("j1", "s", "alice", SPEC, 10, None)
    wins = []
    barrier = threading.Barrier(8)

    def claim(store):
        barrier.wait()
        if store.claim_launch("j1"):
            wins.append(store)

    threads = [threading.Thread(target=claim, args=(stores[i % 4],)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(wins) == 1 and stores[1].is_started("j1")
    stores[2].mark_not_started("j1")
    assert stores[3].claim_launch("j1")


def test_the_supervisor_lease_has_one_holder_until_it_expires_or_is_released(store_url):
    a, b = Store(store_url), Store(store_url)
    assert a.hold_lease("supervisor", "A", ttl_s=30)
    assert not b.hold_lease("supervisor", "B", ttl_s=30)
    assert a.hold_lease("supervisor", "A", ttl_s=0.0)  # renewed, already expired
    assert b.hold_lease("supervisor", "B", ttl_s=30)  # taken over
    assert not a.hold_lease("supervisor", "A", ttl_s=30)
    b.release_lease("supervisor", "B")
    assert a.hold_lease("supervisor", "A", ttl_s=30)


def test_the_api_end_to_end_on_each_database(store_url, tmp_path):
    settings = Settings(data_dir=tmp_path, database_url=store_url)
    with TestClient(create_app(settings, connect_ray=False, supervise=False)) as c:
        created = c.post("/v1/jobs", json=SPEC)
        assert created.status_code == 201, created.text
        job_id = created.json()["id"]
        assert [j["id"] for j in c.get("/v1/jobs").json()["items"]] == [job_id]
        assert c.post(f"/v1/jobs/{job_id}/cancel").json()["state"] == "CANCELLED"
        assert c.get(f"/v1/jobs/{job_id}/metrics").json() == {"records": [], "next_since_step": 0}
        assert c.delete(f"/v1/jobs/{job_id}").status_code == 204
        assert c.get(f"/v1/jobs/{job_id}").status_code == 404
        assert c.get("/readyz").status_code in (200, 503)  # 503 only for "not connected to Ray"


def test_concurrent_writers_to_one_job_take_turns_and_lose_nothing(store_url):
    """Two replicas (each its own store and engine) write to one job at the same moment: the
    leader its metrics and log lines, the others state changes (a cancel's, a queue reason's). The
    old store read and rewrote the job's history without a lock, and lost entries here on both
    databases (its event numbers, max + 1 unlocked, could collide too). Now every write succeeds
    and every event and history entry is kept."""
    leader, other, third = Store(store_url), Store(store_url), Store(store_url)
    leader.create_job("j1", "s", "alice", SPEC, 10**6, None)
    rounds, errors = 100, []
    barrier = threading.Barrier(4)

    def run(fn):
        try:
            barrier.wait(30)
            for i in range(rounds):
                fn(i)
        except Exception as e:  # asserted below
            errors.append(repr(e))

    writers = [
        lambda i: leader.add_metrics("j1", [{"step": i + 1, "loss": 1.0}]),
        lambda i: leader.add_logs("j1", [{"rank": 0, "step": i, "time": 1.0 + i, "line": f"l{i}", "seq": i + 1}]),
        lambda i: other.set_state("j1", "QUEUED", f"waiting: reason {i}"),
        lambda i: third.set_state("j1", "QUEUED", f"waiting: other reason {i}"),
    ]
    threads = [threading.Thread(target=run, args=(fn,)) for fn in writers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == []
    events = leader.events("j1", 0, limit=10_000)
    assert [seq for seq, _, _ in events] == list(range(1, len(events) + 1))
    kinds = [kind for _, kind, _ in events]
    assert kinds.count("metrics") == rounds and kinds.count("log") == rounds
    assert [r["step"] for r in leader.metrics("j1", 0)] == list(range(1, rounds + 1))
    messages = [h["message"] for h in leader.get_job("j1").history]
    assert [m for m in messages if m.startswith("waiting: reason")] == [f"waiting: reason {i}" for i in range(rounds)]
    assert [m for m in messages if m.startswith("waiting: other")] == [f"waiting: other reason {i}" for i in range(rounds)]


def test_one_idempotency_key_sent_to_several_replicas_at_once_makes_one_job(store_url):
    """The same submission (one idempotency key) reaches four replicas at the same moment: one
    job is stored, and every replica answers with it."""
    stores = [Store(store_url) for _ in range(4)]
    answers, errors = [], []
    barrier = threading.Barrier(4)

    def submit(i):
        try:
            barrier.wait(30)
            answers.append(stores[i].create_job(f"job-{i}", "s", "alice", SPEC, 10, "key-1", "hash-1"))
        except Exception as e:  # asserted below
            errors.append(repr(e))

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == [] and len(answers) == 4
    assert sorted(created for _, created in answers) == [False, False, False, True]
    assert len({row.id for row, _ in answers}) == 1
    assert stores[0].count_by_state() == {"QUEUED": 1}
    assert stores[1].create_job("job-x", "s", "alice", SPEC, 10, "key-1", "other-hash") == (None, False)
