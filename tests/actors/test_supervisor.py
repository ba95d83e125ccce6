"""The supervisor on a local Ray with stand-in coordinators: a frozen coordinator never stalls
another job's supervision, and cancel and launch are one transition."""

import contextlib
import threading
import time
import uuid

import pytest
import ray

import hpservice.api.supervisor as supervisor_module
from hpservice.actors import init_local_ray
from hpservice.actors.coordinator import coordinator_name
from hpservice.api.store import Store
from hpservice.api.supervisor import Supervisor

SPEC = {"name": "s", "model": {"name": "llama", "flavor": "tiny"}, "training": {"steps": 100}}


@pytest.fixture(scope="module")
def cluster():
    init_local_ray(num_cpus=2, dashboard=False)
    yield
    ray.shutdown()


@ray.remote(num_cpus=0, max_concurrency=8)
class FakeCoordinator:
    """Answers like a coordinator; a frozen one never answers (a SIGSTOPped process)."""

    def __init__(self, frozen: bool, steps: int | None = None, answer_s: float = 0.0):
        self.frozen, self.steps, self.step, self.stops, self.lines = frozen, steps, 0, 0, []
        self.answer_s = answer_s  # how long a log answer takes: longer than the tick's own wait for it
        self.preempted_by = None

    def poll(self, since_step, after=0):  # one record per step, so a record's arrival number is its step
        if self.frozen:
            time.sleep(3600)
        if self.preempted_by is None and self.step != self.steps:
            self.step += 1  # one step per poll; like the real one it keeps every record for late pollers
        state, message, history = "RUNNING", f"at {self.step}", []
        checkpoints = [{"step": self.step, "path": f"/ckpt/step-{self.step}"}] if self.step else []
        if self.preempted_by is not None:  # as the real one: checkpointed at the step it was on, stopped
            state, message = "PREEMPTED", f"{self.preempted_by}; stopped gracefully at step {self.step}"
        elif self.step == self.steps:
            state, message = "SUCCEEDED", "done"
        history = [{"state": state, "time": float(self.step), "message": message}] if state != "RUNNING" else []
        status = {"state": state, "message": message, "step": self.step, "restarts": 0, "history": history,
                  "checkpoints": checkpoints}  # fmt: skip
        records = [{"step": s, "loss": 1.0 / s} for s in range(max(since_step, after) + 1, self.step + 1)]
        return {"records": records, "cursor": self.step, "status": status}

    def shutdown(self):
        ray.actor.exit_actor()

    def logs(self, rank, tail, since, since_seq):
        if self.frozen:
            time.sleep(3600)
        time.sleep(self.answer_s)
        n = len(self.lines) + 1  # one more line per call; the follower's cursor says what it has
        self.lines.append({"seq": n, "rank": 0, "step": self.step, "time": time.time(), "line": f"line {n}"})
        return [line for line in self.lines if line["seq"] > since_seq]

    def stop(self, graceful, deadline_s, preempted_by=None, failed_by=None):
        self.stops += 1
        self.preempted_by = preempted_by

    def stop_requests(self):
        return self.stops


def _started_job(store, job_id, frozen, answer_s=0.0):
    store.create_job(job_id, "s", "alice", SPEC, 100, None)
    store.mark_started(job_id)
    actor = FakeCoordinator.options(name=coordinator_name(job_id), namespace="hpservice").remote(frozen, None, answer_s)
    ray.get(actor.stop_requests.remote(), timeout=60)  # registered under its name before the supervisor looks
    return actor


def _in_thread(fn, timeout=60):
    """Run ``fn``; fail if it blocks (the old supervisor waited on a frozen coordinator forever)."""
    box = {}
    t = threading.Thread(target=lambda: box.update(result=fn()), daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"{fn} blocked"
    return box.get("result")


def test_a_frozen_coordinator_never_stalls_another_job(cluster, tmp_path):
    store = Store(f"sqlite:///{tmp_path / 'db.sqlite'}")
    frozen_actor = _started_job(store, "frozen-1", frozen=True)  # kept: an actor without handles ends
    # its answers come after the tick that asked stopped waiting: the next tick stores them, then
    # asks again from there (a cursor read before it stored them asked for the same lines twice)
    healthy = _started_job(store, "healthy-1", frozen=False, answer_s=0.3)
    sup = Supervisor(store, poll_interval_s=0.05, poll_timeout_s=1.0)
    deadline = time.monotonic() + 60
    while store.get_job("healthy-1").step < 5 and time.monotonic() < deadline:
        _in_thread(sup.tick)
        time.sleep(0.4)  # the poll interval: the answers in flight arrive meanwhile
    assert store.get_job("healthy-1").step >= 5  # followed tick after tick
    steps = [r["step"] for r in store.metrics("healthy-1", 0)]
    assert steps == list(range(1, len(steps) + 1))
    lines, cursor = store.logs("healthy-1", None, None)
    assert cursor == lines[-1]["seq"] and store.logs("healthy-1", None, None, since=cursor) == ([], cursor)
    assert [line["line"] for line in lines] == [f"line {i}" for i in range(1, len(lines) + 1)]  # each line once
    while "unhealthy" not in store.get_job("frozen-1").message and time.monotonic() < deadline:
        _in_thread(sup.tick)
        time.sleep(0.05)
    frozen = store.get_job("frozen-1")
    assert frozen.state == "QUEUED", frozen  # nothing decided about it: it may wake up
    assert "unhealthy: its coordinator has not answered for 1 s" in frozen.message
    _in_thread(lambda: sup.cancel(store.get_job("frozen-1")))  # the route returns at once
    _in_thread(lambda: sup.cancel(store.get_job("healthy-1")))
    _in_thread(sup.tick)  # the stored cancels: each coordinator is asked to stop, frozen or not
    # The stop request is sent without waiting: it reaches the (threaded) actor soon, not at once.
    deadline = time.monotonic() + 60
    while ray.get(healthy.stop_requests.remote(), timeout=30) == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.get(healthy.stop_requests.remote(), timeout=30) == 1
    for actor in (frozen_actor, healthy):
        ray.kill(actor)


class _Recorder:
    def __init__(self):
        self.stops = 0

    def stop(self, graceful=True, deadline_s=60.0, wait=True):
        self.stops += 1


def _fake_start(launches, hold_cpus=False):
    """A ``start_job`` that starts a stand-in coordinator under the job's name (holding the CPUs
    of the job's workers, with ``hold_cpus``, and ending after the job's steps, one per poll)."""
    from hpservice.actors import JobHandle

    def start_job(spec, job_id, continuation=None):
        cpus = spec.resources.workers * spec.resources.cpus_per_worker if hold_cpus else 0
        actor = FakeCoordinator.options(name=coordinator_name(job_id), namespace="hpservice", num_cpus=cpus).remote(
            False, spec.training.steps if hold_cpus else None
        )  # ValueError while the name is still held (a coordinator that is exiting): the supervisor retries
        ray.get(actor.stop_requests.remote(), timeout=60)
        launches.append((job_id, spec))
        return JobHandle(job_id, actor)

    return start_job


def test_a_cancel_on_another_replica_during_the_launch_is_one_transition(cluster, store_url, monkeypatch):
    """A cancel taken by a second replica (its own store and supervisor: they share only the
    database) while the leader launches the job returns at once; the launched job's coordinator
    is then asked to stop, once, however many ticks follow. A cancel that wins the race means
    the job is never launched."""
    tag = uuid.uuid4().hex[:6]
    store = Store(store_url)
    leader, other = Supervisor(store), Supervisor(Store(store_url))
    launches = []
    fake_start = _fake_start(launches)

    def start_job(spec, job_id, continuation=None):  # the launch, with the other replica's cancel in the middle of it
        _in_thread(lambda: other.cancel(store.get_job(job_id)), timeout=30)
        return fake_start(spec, job_id)

    monkeypatch.setattr(supervisor_module, "start_job", start_job)
    store.create_job(f"race-{tag}", "s", "alice", SPEC, 100, None)
    for _ in range(4):
        _in_thread(leader.tick)
    handle = leader._handles[f"race-{tag}"]
    assert [job_id for job_id, _ in launches] == [f"race-{tag}"] and store.is_started(f"race-{tag}")
    deadline = time.monotonic() + 60
    while ray.get(handle.coordinator.stop_requests.remote(), timeout=30) == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    for _ in range(3):
        _in_thread(leader.tick)
    assert ray.get(handle.coordinator.stop_requests.remote(), timeout=30) == 1  # asked once
    assert store.get_job(f"race-{tag}").state != "CANCELLED"  # the coordinator reports the cancel itself

    store.create_job(f"first-{tag}", "s", "alice", SPEC, 100, None)
    other.cancel(store.get_job(f"first-{tag}"))  # the cancel first: never launched
    _in_thread(leader.tick)
    assert store.get_job(f"first-{tag}").state == "CANCELLED" and not store.is_started(f"first-{tag}")
    assert [job_id for job_id, _ in launches] == [f"race-{tag}"]
    ray.kill(handle.coordinator)


def test_a_cancel_while_a_preempted_job_stops_ends_it_cancelled(store_url):
    """The coordinator has stopped for a preemption but the job is still marked launched when the
    cancel comes: it is CANCELLED, not queued again."""
    store = Store(store_url)
    store.create_job("p-1", "s", "alice", SPEC, 100, None)
    assert store.claim_launch("p-1")
    store.update_status("p-1", {"state": "PREEMPTED", "message": "preempted by job x", "history": []})
    assert store.request_cancel("p-1") == "requested"
    store.mark_not_started("p-1")
    job = store.get_job("p-1")
    assert job.state == "CANCELLED" and not store.claim_launch("p-1")


def test_a_job_whose_cluster_is_gone_resumes_from_its_checkpoint(cluster, tmp_path, monkeypatch):
    """The coordinator is gone (the cluster was lost): a job with a checkpoint is requeued and
    launched again resuming from its latest one; a job without one fails with the reason."""
    store = Store(f"sqlite:///{tmp_path / 'db.sqlite'}")
    for job_id in ("kept-1", "lost-1"):
        store.create_job(job_id, "s", "alice", SPEC, 100, None)
        store.mark_started(job_id)
    store.update_status("kept-1", {"state": "RUNNING", "checkpoints": [{"step": 40, "path": "/ckpt/step-40"}]})
    launched = []
    monkeypatch.setattr(
        supervisor_module, "start_job", lambda spec, job_id, continuation=None: launched.append((job_id, spec)) or _Recorder()
    )
    sup = Supervisor(store)
    _in_thread(sup.tick)
    kept, lost = store.get_job("kept-1"), store.get_job("lost-1")
    assert lost.state == "FAILED" and "coordinator lost" in lost.message
    assert kept.state == "QUEUED" and "resumes from its checkpoint of step 40" in kept.message
    assert not store.is_started("kept-1")
    # launched once the cluster has room: an earlier test's actors may still be releasing theirs
    deadline = time.monotonic() + 120
    while not launched and time.monotonic() < deadline:
        sup._last_launch = 0.0
        _in_thread(sup.tick)
        if not launched:
            time.sleep(0.5)
    assert [job_id for job_id, _ in launched] == ["kept-1"], store.get_job("kept-1").message
    assert launched[0][1].checkpoint.resume_from == "latest" and store.is_started("kept-1")


def test_the_queue_starts_by_priority_and_fair_share_within_quotas_and_says_why_others_wait(
    cluster, store_url, monkeypatch
):
    """On the 2-CPU local Ray, with alice's quota at 1 worker: carol's priority-10 job starts
    first; dave's older 2-worker job does not fit in the CPU left, so alice's oldest starts ahead
    of it (backfill); alice's second waits at her quota, bob's for resources. Every reason is in
    the job's history once, however many ticks repeat it."""
    from hpservice.api.scheduler import Quota, Quotas

    store = Store(store_url)
    sup = Supervisor(store, quotas=Quotas({"alice": Quota(workers=1)}))
    launched = []
    monkeypatch.setattr(supervisor_module, "start_job", lambda spec, job_id, continuation=None: launched.append(job_id) or object())
    one = {**SPEC, "resources": {"workers": 1, "use_gpu": False}}
    store.create_job("d1", "s", "dave", {**SPEC, "resources": {"workers": 2, "use_gpu": False}}, 100, None)
    for job_id, owner, priority in (
        ("a1", "alice", None),
        ("a2", "alice", None),
        ("b1", "bob", None),
        ("u", "carol", 10),
    ):
        store.create_job(job_id, "s", owner, {**one, "scheduling": {"priority": priority}}, 100, None)
        time.sleep(0.01)  # distinct submission times
    sup._schedule(store.jobs_in(("QUEUED",)))
    assert launched == ["u", "a1"]
    assert store.get_job("a2").message == "waiting: owner alice at quota 1/1 workers (this job needs 1)"
    assert store.get_job("b1").message.startswith("waiting for resources: needs 1 x 1 CPU")
    assert store.get_job("d1").message == (
        "waiting for resources: needs 2 x 1 CPU (smaller jobs may start ahead of it until it has waited 600 s)"
    )
    history = len(store.get_job("b1").history)
    for _ in range(3):
        sup._schedule(store.jobs_in(("QUEUED",)))
    assert launched == ["u", "a1"] and len(store.get_job("b1").history) == history


def test_two_replicas_launch_a_job_once_and_the_survivor_takes_over_without_a_metric_gap(
    cluster, store_url, monkeypatch
):
    """Two supervisors (two server replicas) on one database, SQLite and PostgreSQL: one holds the
    lease and launches the job, once; when it is killed (it never releases the lease) the other
    takes over after the lease's ttl, re-attaches to the coordinator by name and stores every step."""
    url = store_url
    launches = []
    monkeypatch.setattr(supervisor_module, "start_job", _fake_start(launches))
    store = Store(url)
    store.create_job("two-1", "s", "alice", {**SPEC, "resources": {"workers": 1, "use_gpu": False}}, 100, None)
    # a ttl with slack for a loaded machine: a slow tick must not lose the lease
    replicas = [Supervisor(Store(url), poll_interval_s=0.1, lease_ttl_s=5.0) for _ in range(2)]
    for r in replicas:
        r.start()
    try:
        deadline = time.monotonic() + 60
        while (
            store.get_job("two-1").step < 5 or not any(r.is_leader for r in replicas)
        ) and time.monotonic() < deadline:
            time.sleep(0.1)
        leader, other = sorted(replicas, key=lambda r: not r.is_leader)
        assert leader.is_leader and not other.is_leader and [j for j, _ in launches] == ["two-1"]
        monkeypatch.setattr(leader.store, "release_lease", lambda *a: None)  # killed: it hands nothing over
        leader.stop()
        step = store.get_job("two-1").step
        while (not other.is_leader or store.get_job("two-1").step < step + 5) and time.monotonic() < deadline + 60:
            time.sleep(0.1)
        assert other.is_leader and store.get_job("two-1").step >= step + 5
    finally:
        for r in replicas:
            r.stop()
    assert [j for j, _ in launches] == ["two-1"]  # never twice
    steps = [r["step"] for r in store.metrics("two-1", 0)]
    assert steps == list(range(1, len(steps) + 1))  # no gap at the hand-over


def test_a_higher_priority_job_preempts_and_the_preempted_one_resumes_from_its_checkpoint(cluster, store_url, monkeypatch):
    """On the 2-CPU local Ray, with stand-in coordinators that hold their workers' CPUs: alice's
    priority-0 job runs on both; bob's priority-10 job cannot fit, so alice's is asked to
    checkpoint and stop, comes back PREEMPTED and waits, bob's starts, and when it ends
    alice's is launched again, resuming from its latest checkpoint. (The real jobs' version,
    with the loss curve, is test_multinode.py's.)"""
    tag = uuid.uuid4().hex[:6]
    low, high = f"low-{tag}", f"high-{tag}"
    store = Store(store_url)
    sup = Supervisor(store, poll_interval_s=0.1)
    launches = []
    monkeypatch.setattr(supervisor_module, "start_job", _fake_start(launches, hold_cpus=True))
    two = {**SPEC, "resources": {"workers": 2, "use_gpu": False}}
    store.create_job(low, "s", "alice", {**two, "training": {"steps": 1000}}, 1000, None)
    sup.start()
    try:
        deadline = time.monotonic() + 120
        while store.get_job(low).step < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        store.create_job(high, "s", "bob", {**two, "training": {"steps": 5}, "scheduling": {"priority": 10}}, 5, None)
        while store.get_job(high).state != "SUCCEEDED" and time.monotonic() < deadline:
            time.sleep(0.1)
        while not (len(launches) == 3 and store.is_started(low)) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        sup.stop()
    assert [job_id for job_id, _ in launches] == [low, high, low], launches
    assert launches[0][1].checkpoint.resume_from is None and launches[2][1].checkpoint.resume_from == "latest"
    history = [(h["state"], h["message"]) for h in store.get_job(low).history]
    preempted = [m for state, m in history if state == "PREEMPTED"]
    assert preempted and preempted[0].startswith(f"preempted by job {high} (priority 10 > 0); stopped gracefully at step")
    waits = [h["message"] for h in store.get_job(high).history]
    assert f"waiting for {low} to checkpoint and stop (preempted for it)" in waits
    assert store.is_started(low) and store.get_job(low).state in ("PREEMPTED", "RUNNING")
    with contextlib.suppress(ValueError):
        ray.kill(ray.get_actor(coordinator_name(low), namespace="hpservice"))
