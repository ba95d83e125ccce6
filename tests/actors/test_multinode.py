"""Jobs on a simulated multi-node cluster: several raylets on this machine (ray.cluster_utils.Cluster),
each a node with its own resources. Placement keeps shard groups inside a node; the coordinator
runs on the head; a lost node is replaced without spending a restart, or the job fails naming it;
a job whose coordinator's node is lost is requeued by the supervisor and resumes.

The module's tests share one head (Cluster; its shutdown ends the processes it started). Each test
adds the nodes it needs and, at its end, what it left is cleared: its actors and placement groups,
then its nodes, removed (and marked dead) before the next test adds its own. Nodes are killed
mid-test with Cluster.remove_node, which kills the processes of that node it started. Health
checks are faster than Ray's defaults, so a killed node is marked dead in seconds rather than
~30, with enough slack that a raylet slowed by a loaded machine is not.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import pytest
import ray
from ray._raylet import PlacementGroupID
from ray.cluster_utils import Cluster
from ray.util.placement_group import PlacementGroup

from hpservice.actors import COORDINATOR_RESOURCE_ENV, JobHandle, start_job
from hpservice.actors.placement import infeasible, plan_placement
from hpservice.spec import CheckpointSpec, MetricsSpec
from hpservice.train import Trainer
from hpservice.train._hold import HOLD_FILE_ENV
from tests._jobs import ray_job as _spec

FAST_HEALTH_CHECKS = {  # a killed node is marked dead in ~5-10 s; a raylet slowed by a loaded machine is not
    "health_check_initial_delay_ms": 1000,
    "health_check_period_ms": 1000,
    "health_check_timeout_ms": 2000,
    "health_check_failure_threshold": 5,
}


@pytest.fixture(scope="module")
def head():
    """A 0-CPU head (the Kubernetes layout: nothing trains there), this process connected to it,
    shared by the module's tests (``simulated_cluster``)."""
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "include_dashboard": False, "_system_config": FAST_HEALTH_CHECKS},
    )
    try:
        ray.init(address=cluster.address, namespace="hpservice", log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


@contextlib.contextmanager
def simulated_cluster(head, *nodes: dict):
    """``head``'s cluster with one raylet per ``nodes`` entry (``{"num_cpus": 2, "resources":
    {...}}``). A raylet and its workers inherit this process's environment when it is added (the
    hold file, ``_hold``). At the end every actor and placement group left is removed (a detached
    coordinator on the head, a group rescheduling after its node died), then every worker node."""
    try:
        for node in nodes:
            head.add_node(**node)
        head.wait_for_nodes()
        yield head
    finally:
        for actor in ray._private.state.actors().values():
            if actor["State"] == "ALIVE" and actor["Name"]:
                with contextlib.suppress(ValueError):  # gone meanwhile
                    ray.kill(ray.get_actor(actor["Name"], namespace=actor["RayNamespace"]))
        for group_id, group in ray.util.placement_group_table().items():
            if group["state"] != "REMOVED":
                ray.util.remove_placement_group(PlacementGroup(PlacementGroupID(bytes.fromhex(group_id))))
        for node in list(head.worker_nodes):
            head.remove_node(node)
        head.wait_for_nodes()


def _wait(predicate, what: str, timeout: float = 180, poll_s: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"not {what} after {timeout} s"
        time.sleep(poll_s)


def _hold(tmp_path: Path, monkeypatch, step: int) -> Path:
    """Every run of the test's cluster trains to ``step``, then waits (``hpservice.train._hold``)
    until the returned file is rewritten with a later step or removed: the fault lands between
    two known steps, and the job need not run hundreds of steps to be surely mid-way. Set before
    the cluster starts: its raylets, and so the workers, inherit it."""
    hold = tmp_path / "hold"
    hold.write_text(str(step))
    monkeypatch.setenv(HOLD_FILE_ENV, str(hold))
    return hold


def _node_of(cluster, node_id: str):
    return next(n for n in cluster.list_all_nodes() if n.node_id == node_id)


def _torchrun_losses(spec):
    return [r["loss"] for r in Trainer(spec, log_to_stdout=False).train()]


def test_placement_plans_and_reasons_without_a_cluster(tmp_path):
    hsdp = _spec(tmp_path, "hsdp", resources={"workers": 4}, parallelism={"dp_replicate": 2})
    plan = plan_placement(hsdp, gpus=0)
    assert plan.bundles == ({"CPU": 2.0}, {"CPU": 2.0}) and plan.bundle_of_rank == (0, 0, 1, 1)
    assert plan.strategy == "PACK" and plan.group_size == 2
    assert infeasible(plan, [{"CPU": 3}, {"CPU": 2}], hsdp) is None
    # 3 + 1: four CPUs, but the second group of two fits in no node
    why = infeasible(plan, [{"CPU": 3}, {"CPU": 1}], hsdp)
    assert "each shard group (dp_shard x tp = 2 workers, 2 CPU) must fit in one node" in why
    assert "--set resources.placement=pack" in why
    fsdp = _spec(tmp_path, "fsdp", resources={"workers": 4})
    why = infeasible(plan_placement(fsdp, 0), [{"CPU": 2}, {"CPU": 2}], fsdp)
    assert "shard groups of at most 2 workers (set parallelism.dp_replicate" in why
    packed = _spec(tmp_path, "pack", resources={"workers": 4, "placement": "pack"})
    plan = plan_placement(packed, 0)
    assert plan.bundles == ({"CPU": 1.0},) * 4 and plan.strategy == "PACK" and plan.group_size == 1
    assert infeasible(plan, [{"CPU": 2}, {"CPU": 2}], packed) is None
    tp = _spec(tmp_path, "tp", resources={"workers": 4}, parallelism={"tp": 2, "dp_replicate": 2})
    assert plan_placement(tp, 1).bundles == ({"CPU": 2.0, "GPU": 2},) * 2
    strict = _spec(tmp_path, "strict", resources={"workers": 4, "placement": "strict_pack"})
    assert "puts all 4 workers on one node; the largest holds 2" in infeasible(
        plan_placement(strict, 0), [{"CPU": 2}, {"CPU": 2}], strict
    )


def test_uneven_nodes_keep_each_shard_group_in_one_node_and_the_coordinator_on_the_head(head, tmp_path):
    """3 + 2 CPUs: Ray's PACK of four 1-CPU bundles puts ranks 0-2 on the 3-CPU node and splits
    the second shard group; one bundle per group cannot split."""
    spec = _spec(tmp_path, "hsdp", resources={"workers": 4}, parallelism={"dp_replicate": 2})
    with simulated_cluster(head, {"num_cpus": 3}, {"num_cpus": 2}):
        handle = start_job(spec)
        status = handle.wait(timeout=300)
        assert status["state"] == "SUCCEEDED", status
        node = {p["rank"]: p["node_id"] for p in status["placement"]}
        assert node[0] == node[1] and node[2] == node[3] and node[0] != node[2], status["placement"]
        assert "4 workers on 2 node(s)" in " ".join(h["message"] for h in status["history"])
        head_id = next(n["NodeID"] for n in ray.nodes() if "node:__internal_head__" in n["Resources"])
        assert status["coordinator_node"] == head_id
        handle.shutdown()


def test_a_lost_node_fails_the_job_naming_it_when_no_capacity_comes_back(head, tmp_path):
    spec = _spec(
        tmp_path,
        "lost",
        training={"steps": 100000},
        checkpoint={"interval": 5},
        failure={"max_restarts": 3, "capacity_wait_s": 5},
    )
    with simulated_cluster(head, {"num_cpus": 2}) as cluster:
        handle = start_job(spec)
        status = _wait(lambda: (s := handle.status())["step"] >= 6 and s, "at step 6")
        node_id = status["placement"][0]["node_id"]
        cluster.remove_node(_node_of(cluster, node_id), allow_graceful=False)
        status = handle.wait(timeout=180)
        assert status["state"] == "FAILED", status
        assert f"node {node_id[:8]}" in status["message"] and "lost; no room for 2 workers" in status["message"]
        assert "within 5 s" in status["message"] and status["restarts"] == 0, status
        messages = [h["message"] for h in status["history"]]
        assert any(m.startswith("waiting for capacity: node ") for m in messages), messages
        handle.shutdown()


def test_a_deployment_shaped_job_survives_a_worker_pod_restart_and_exports_from_the_shared_volume(
    head, ranks, tmp_path, monkeypatch
):
    """The compose/KubeRay layout on this machine: the API's own directory (``api-data``, its
    store) apart from the shared volume (``shared``, standing in for the claim every pod mounts
    at one path), where ``--jobs-dir`` puts job directories. A job admitted as the API admits it
    runs on the worker node; that node (the worker pod) dies and a new one joins; the job resumes
    from its checkpoint on the shared volume without spending a restart (max_restarts 0), with
    the losses of an undisturbed run, and the API exports its checkpoint from there."""
    from fastapi.testclient import TestClient

    from hpservice.api import Settings, create_app
    from hpservice.api.admission import admit
    from hpservice.api.settings import Principal
    from hpservice.api.store import Store
    from hpservice.api.supervisor import Supervisor

    steps = 40
    hold = _hold(tmp_path, monkeypatch, 7)  # the worker pod dies at step 7, after the checkpoint of step 5
    shared = tmp_path / "shared"
    settings = Settings(data_dir=tmp_path / "api-data", jobs_dir=shared / "jobs", tokens={"t-alice": Principal("alice")})
    job_id = "pod-restart-0001"
    submitted = _spec(
        tmp_path / "ignored",  # the API decides where a job writes: under --jobs-dir
        "replaced",
        training={"steps": steps},
        checkpoint={"interval": 5, "keep": 1},
        failure={"max_restarts": 0, "capacity_wait_s": 240},
    ).model_copy(update={"metrics": MetricsSpec(), "checkpoint": CheckpointSpec(interval=5, keep=1)})
    spec = admit(submitted, Principal("alice"), job_id, settings)
    home = shared / "jobs" / "alice" / job_id
    assert spec.checkpoint.dir.startswith(str(home.resolve())), spec.checkpoint.dir
    store = Store(settings.db_url)
    with simulated_cluster(head, {"num_cpus": 2}) as cluster:
        supervisor = Supervisor(store, poll_interval_s=0.2)
        store.create_job(job_id, spec.name, "alice", spec.model_dump(mode="json", by_alias=True), steps, None)
        supervisor.start()
        try:
            _wait(lambda: (j := store.get_job(job_id)).checkpoints and j.step >= 7, "held at step 7")
            node_id = JobHandle.attach(job_id).status()["placement"][0]["node_id"]
            cluster.remove_node(_node_of(cluster, node_id), allow_graceful=False)  # the worker pod dies
            _wait(lambda: store.get_job(job_id).message.startswith("waiting for capacity"), "waiting for capacity")
            hold.unlink()
            cluster.add_node(num_cpus=2)  # its replacement joins
            final = _wait(lambda: (j := store.get_job(job_id)).state in ("SUCCEEDED", "FAILED") and j, "ended", timeout=300)
        finally:
            supervisor.stop()
    assert final.state == "SUCCEEDED" and final.restarts == 0, final
    assert "lacks the metrics" not in final.message, final
    assert [c["step"] for c in final.checkpoints] == [steps]
    assert final.checkpoints[0]["path"].startswith(str(home.resolve()))
    with TestClient(create_app(settings, connect_ray=False, supervise=False)) as api:
        r = api.post(f"/v1/jobs/{job_id}/checkpoints/{steps}/export", headers={"Authorization": "Bearer t-alice"})
        assert r.status_code == 200, r.text
        assert r.json()["path"].startswith(str(home.resolve())) and (Path(r.json()["path"]) / "config.json").is_file()
    losses = [r["loss"] for r in store.metrics(job_id, 0)]
    assert len(losses) == steps
    expected = ranks(2).run(_torchrun_losses, _spec(tmp_path / "ref", "replaced", training={"steps": steps}))[0]
    assert losses == expected


def test_a_job_whose_coordinators_node_is_lost_twice_is_relaunched_and_loses_nothing(head, ranks, tmp_path, monkeypatch):
    """Coordinators run on the nodes with resource ``coord`` (1-CPU nodes, too small for the job's
    2-worker shard group, which runs on a node of its own). The node with the job's coordinator
    dies, mid-job, twice; each time the server requeues the job from its latest checkpoint and a
    new coordinator finishes it. Every step's metrics are stored exactly once, the loss curve is
    bitwise an undisturbed run's, the relaunched attempts' log lines and checkpoints reach the
    store, and its checkpoint list is complete (a relaunch's empty list used to replace it)."""
    from hpservice.api.store import Store
    from hpservice.api.supervisor import Supervisor

    monkeypatch.setenv(COORDINATOR_RESOURCE_ENV, "coord")
    steps = 40
    hold = _hold(tmp_path, monkeypatch, 12)  # the first kill at step 12, the second at 22
    job = _spec(tmp_path, "requeued", training={"steps": steps}, checkpoint={"interval": 5, "keep": 2})
    coordinator_node = {"num_cpus": 1, "resources": {"coord": 1}}
    with simulated_cluster(head, coordinator_node, coordinator_node, {"num_cpus": 2}) as cluster:
        store = Store(f"sqlite:///{tmp_path / 'jobs.db'}")
        supervisor = Supervisor(store, poll_interval_s=0.2)
        job_id = "requeued-0001"
        store.create_job(job_id, job.name, "alice", job.model_dump(mode="json", by_alias=True), steps, None)
        supervisor.start()
        try:
            lost_at = []
            for kill, at in enumerate((12, 22)):
                # this attempt (after the kill before: its workers gone, their node's CPUs free)
                # running, then held at step `at`, past a checkpoint of its own
                _wait(lambda k=kill: _requeues(store.get_job(job_id)) == k, f"attempt {kill + 1} launched")
                hold.write_text(str(at))
                _wait(
                    lambda a=at: (j := store.get_job(job_id)).state == "RUNNING"
                    and j.step >= a
                    and any(c["step"] == a - 2 for c in j.checkpoints),
                    f"held at step {at} in attempt {kill + 1}",
                )
                status = JobHandle.attach(job_id).status()
                lost_at.append(status["step"])
                cluster.remove_node(_node_of(cluster, status["coordinator_node"]), allow_graceful=False)
                cluster.add_node(**coordinator_node)  # room for the next coordinator
            _wait(lambda: _requeues(store.get_job(job_id)) == 2, "attempt 3 launched")
            hold.unlink()
            final = _wait(lambda: (j := store.get_job(job_id)).state in ("SUCCEEDED", "FAILED") and j, "", timeout=300)
        except AssertionError:
            job_now = store.get_job(job_id)
            history = [(h["state"], h["message"]) for h in job_now.history][-6:]
            raise AssertionError(f"not ended: {job_now['state']} at step {job_now['step']}; {history}") from None
        finally:
            supervisor.stop()
    assert final.state == "SUCCEEDED", final
    assert "lacks the metrics" not in final.message, final.message
    messages = [h["message"] for h in final.history]
    requeued = [m for m in messages if m.startswith("requeued: its coordinator died")]
    assert len(requeued) == 2 and all("resumes from its checkpoint of step" in m for m in requeued), messages
    assert final.step == steps
    assert [c["step"] for c in final.checkpoints] == [steps - 5, steps]  # keep: 2, across attempts
    records = store.metrics(job_id, 0)
    assert [r["step"] for r in records] == list(range(1, steps + 1))  # every step, once
    lines, _ = store.logs(job_id, None, None)
    assert any(line["step"] > lost_at[-1] for line in lines), "no log line of the last attempt was stored"
    expected = ranks(2).run(_torchrun_losses, _spec(tmp_path / "ref", "requeued", training={"steps": steps}))[0]
    assert [r["loss"] for r in records] == expected  # bitwise


def _requeues(job) -> int:
    """Attempts a job has had relaunched (after its coordinator's node was lost) that are running."""
    history = [(h["state"], h["message"]) for h in job.history]
    requeued = sum(1 for state, message in history if message.startswith("requeued: its coordinator died"))
    return requeued if history[-1][0] == "RUNNING" else -1


def test_elastic_job_shrinks_when_a_node_is_lost_and_grows_back_with_the_same_losses(head, ranks, tmp_path, monkeypatch):
    """4 workers (dp_replicate 2 x dp_shard 2, one shard group per 1-CPU node), min_workers 2. A
    node dies (the job held at step 12) and none comes back within capacity_wait_s: the job goes
    on with 2 workers from its latest checkpoint (gradient accumulation 2 keeps the global batch).
    A node joins: at a checkpoint after the coordinator sees room it grows back to 4. Every step's
    loss equals the undisturbed 4-worker run's to fp32 reduction-order tolerance, and no restart
    is spent."""
    steps = 40
    hold = _hold(tmp_path, monkeypatch, 12)
    sections = {
        "training": {"steps": steps},
        "parallelism": {"dp_replicate": 2},
        "resources": {"workers": 4, "cpus_per_worker": 0.5},
    }
    spec = _spec(
        tmp_path,
        "elastic",
        **{**sections, "resources": {**sections["resources"], "min_workers": 2}},
        checkpoint={"interval": 5, "keep": 2},
        failure={"max_restarts": 0, "capacity_wait_s": 3},
    )
    with simulated_cluster(head, {"num_cpus": 1}, {"num_cpus": 1}) as cluster:
        handle = start_job(spec)
        status = _wait(lambda: (s := handle.status())["step"] >= 12 and s["checkpoints"] and s, "held at step 12")
        lost = next(p["node_id"] for p in status["placement"] if p["rank"] == 2)
        cluster.remove_node(_node_of(cluster, lost), allow_graceful=False)
        _wait(lambda: handle.status()["workers"] == 2, "shrunk to 2 workers")
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        gate = 12
        while handle.status()["workers"] < 4:  # one checkpoint at a time until the coordinator has seen room
            assert gate + 5 < steps, f"not grown back by step {gate}: {handle.status()['history'][-3:]}"
            time.sleep(2.5)  # at least one of the coordinator's looks for room (every 2 s)
            gate += 5
            hold.write_text(str(gate))
            _wait(lambda g=gate: (s := handle.status())["step"] >= g or s["workers"] == 4, f"at step {gate}")
        hold.unlink()
        status = handle.wait(timeout=300)
        assert status["state"] == "SUCCEEDED", status
        records = handle.poll(since_step=0)["records"]
        handle.shutdown()
    assert status["restarts"] == 0 and status["workers"] == 4, status
    assert [(r["from"], r["to"]) for r in status["resizes"]] == [(4, 2), (2, 4)], status["resizes"]
    assert status["resizes"][0]["grad_accum"] == 2 and status["resizes"][1]["grad_accum"] == 1
    resized = [h for h in status["history"] if "resize" in h]
    assert [h["message"].split(":")[0] for h in resized] == ["resized 4 -> 2 workers", "resized 2 -> 4 workers"]
    assert f"node {lost[:8]}" in resized[0]["message"]
    expected = ranks(4).run(_torchrun_losses, _spec(tmp_path / "ref", "elastic", **sections))[0]
    by_step = {r["step"]: r["loss"] for r in records}  # a resumed attempt's record of a step replaces the first
    assert sorted(by_step) == list(range(1, steps + 1))
    diff = max(abs(by_step[s] - expected[s - 1]) for s in range(1, steps + 1))
    assert diff < 1e-5, diff


def test_a_higher_priority_job_preempts_a_running_one_which_resumes_with_an_undisturbed_runs_losses(
    head, ranks, tmp_path, monkeypatch
):
    """One 2-CPU node, SQLite (on both databases with stand-in coordinators: test_supervisor.py). alice's priority-0 job runs; bob submits a priority-10 job that needs the
    whole node: alice's is asked to checkpoint and stop, goes back to the queue PREEMPTED, bob's
    runs, then alice's resumes from its checkpoint. Its loss at every step is bitwise the
    undisturbed run's."""
    from hpservice.api.store import Store
    from hpservice.api.supervisor import Supervisor

    steps = 40
    hold = _hold(tmp_path, monkeypatch, 8)  # alice's job is at step 8 when bob's arrives
    low = _spec(tmp_path / "low", "low", training={"steps": steps}, checkpoint={"interval": 10, "keep": 2})
    high = _spec(tmp_path / "high", "high", training={"steps": 10}, scheduling={"priority": 10})
    with simulated_cluster(head, {"num_cpus": 2}):
        store = Store(f"sqlite:///{tmp_path / 'jobs.db'}")
        supervisor = Supervisor(store, poll_interval_s=0.2)
        store.create_job("low-0001", "low", "alice", low.model_dump(mode="json", by_alias=True), steps, None)
        supervisor.start()
        try:
            _wait(lambda: (j := store.get_job("low-0001")).state == "RUNNING" and j.step >= 8, "low held at step 8")
            store.create_job("high-0001", "high", "bob", high.model_dump(mode="json", by_alias=True), 10, None)
            _wait(lambda: store.get_job("low-0001").state == "PREEMPTED", "low preempted")
            hold.unlink()
            ended = ("SUCCEEDED", "FAILED", "CANCELLED")
            final = _wait(
                lambda: all(store.get_job(i).state in ended for i in ("low-0001", "high-0001")),
                "both ended",
                timeout=300,
            )
        finally:
            supervisor.stop()
        assert final
        low_job, high_job = store.get_job("low-0001"), store.get_job("high-0001")
        records = store.metrics("low-0001", 0)
    assert low_job.state == "SUCCEEDED" and high_job.state == "SUCCEEDED", (low_job, high_job)
    low_history = [(h["state"], h["message"]) for h in low_job.history]
    assert (
        "CANCELLING",
        "preempted by job high-0001 (priority 10 > 0): finishing the current step and checkpointing",
    ) in low_history
    preempted = [m for s, m in low_history if s == "PREEMPTED"]
    assert preempted and preempted[0].startswith(
        "preempted by job high-0001 (priority 10 > 0); stopped gracefully at step"
    )
    assert any(
        h["message"] == "waiting for low-0001 to checkpoint and stop (preempted for it)" for h in high_job.history
    )
    ends = {j.id: next(h["time"] for h in j.history if h["state"] == "SUCCEEDED") for j in (low_job, high_job)}
    assert ends["high-0001"] < ends["low-0001"]
    expected = ranks(2).run(_torchrun_losses, _spec(tmp_path / "ref", "low", training={"steps": steps}))[0]
    by_step = {r["step"]: r["loss"] for r in records}
    assert sorted(by_step) == list(range(1, steps + 1))
    assert [by_step[s] for s in range(1, steps + 1)] == expected


def test_the_queue_with_real_jobs_fair_share_backfill_and_quota(head, tmp_path, postgres):
    """Real jobs on one 2-CPU node, the store on PostgreSQL (on both databases with stand-in
    coordinators: test_supervisor.py); alice may use 2 workers at once.
    Long jobs run until the test cancels them, so each decision happens at a moment the test
    chooses: when a CPU frees, yvonne's job starts before alice's older one (fair share: alice
    already uses a worker) and before bob's older 2-worker job, which does not fit yet
    (backfill); a job of alice's at her quota waits, saying so, and starts when one of hers
    ends; bob's job starts once the node is free. Every job ends as it should."""
    from hpservice.api.scheduler import Quota, Quotas
    from hpservice.api.store import Store
    from hpservice.api.supervisor import Supervisor

    def job(name, workers=1, steps=6):
        return _spec(tmp_path / name, name, training={"steps": steps}, resources={"workers": workers})

    def submit(store, name, owner, **kwargs):
        spec = job(name, **kwargs)
        store.create_job(name, name, owner, spec.model_dump(mode="json", by_alias=True), spec.training.steps, None)

    def state(name):
        return store.get_job(name).state

    def started_at(name):
        return next(h["time"] for h in store.get_job(name).history if h["state"] == "STARTING")

    long = {"steps": 1_000_000}
    with simulated_cluster(head, {"num_cpus": 2}):
        store = Store(postgres.new_database())
        supervisor = Supervisor(store, poll_interval_s=0.2, quotas=Quotas({"alice": Quota(workers=2)}))
        supervisor.start()
        try:
            submit(store, "a1", "alice", **long)
            submit(store, "z1", "zed", **long)
            _wait(lambda: state("a1") == state("z1") == "RUNNING", "a1 and z1 running")
            submit(store, "a2", "alice", **long)
            submit(store, "b1", "bob", workers=2)
            submit(store, "y1", "yvonne")
            _wait(lambda: store.get_job("b1").message.startswith("waiting for resources: needs 2 x"), "b1 waiting")
            store.request_cancel("z1")  # a CPU frees: y1 goes ahead of a2 (fair share) and of b1 (backfill)
            _wait(lambda: state("y1") == "SUCCEEDED", "y1 done", timeout=240)
            _wait(lambda: state("a2") == "RUNNING", "a2 running")  # then alice's, bob's still not fitting
            submit(store, "a3", "alice")
            quota = "waiting: owner alice at quota 2/2 workers (this job needs 1)"
            _wait(lambda: store.get_job("a3").message == quota, "a3 at its owner's quota")
            store.request_cancel("a1")  # one of alice's ends: a3 may start (b1 still does not fit)
            _wait(lambda: state("a3") == "SUCCEEDED", "a3 done", timeout=240)
            store.request_cancel("a2")
            _wait(lambda: state("b1") in ("SUCCEEDED", "FAILED"), "b1 ended", timeout=240)
        finally:
            supervisor.stop()
        jobs = {name: store.get_job(name) for name in ("a1", "z1", "a2", "b1", "y1", "a3")}
    assert {n: j.state for n, j in jobs.items()} == {
        "a1": "CANCELLED", "z1": "CANCELLED", "a2": "CANCELLED", "b1": "SUCCEEDED", "y1": "SUCCEEDED", "a3": "SUCCEEDED",
    }  # fmt: skip
    assert started_at("y1") < started_at("a2") < started_at("b1")  # fair share, then backfill ahead of b1
    assert started_at("a3") < started_at("b1")  # backfilled too
    cancelled_a1 = next(h["time"] for h in jobs["a1"].history if h["state"] == "CANCELLED")
    assert started_at("a3") > cancelled_a1  # held at the quota until one of alice's ended
    b1_reasons = [h["message"] for h in jobs["b1"].history if h["message"].startswith("waiting")]
    assert b1_reasons[0].startswith("waiting for resources: needs 2 x 1 CPU"), b1_reasons
    assert quota in [h["message"] for h in jobs["a3"].history]
