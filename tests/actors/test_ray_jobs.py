"""Jobs on a real local Ray cluster: success, worker loss, hangs, infeasible jobs, cancel, metrics."""

import os
import re
import signal
import time

import pytest
import ray
import torch.nn as nn

from hpservice.actors import NAMESPACE, JobHandle, init_local_ray, start_job, worker_name
from hpservice.actors._drill import DRILL_ENV
from hpservice.train import Trainer
from tests._jobs import ray_job as _spec


@pytest.fixture(scope="module")
def drill(tmp_path_factory):
    """The coordinator drill file (actors/_drill.py) every coordinator of this module's cluster
    reads: absent unless a test writes it."""
    return tmp_path_factory.mktemp("drill") / "drill"


@pytest.fixture(scope="module")
def cluster(drill):
    # No dashboard: nothing here reads it (the leftovers come from the GCS's own tables), and its
    # processes cost the module ~7 CPU s more (10.5 CPU s with it, 3.9 for the agent without).
    saved = os.environ.get(DRILL_ENV)
    os.environ[DRILL_ENV] = str(drill)  # inherited by the raylet, so by every coordinator
    init_local_ray(num_cpus=4, dashboard=False)
    yield
    ray.shutdown()
    if saved is None:
        del os.environ[DRILL_ENV]
    else:
        os.environ[DRILL_ENV] = saved


def _torchrun_equivalent(spec):
    return [r["loss"] for r in Trainer(spec, log_to_stdout=False).train()]


def _leftovers(job_id):
    """The job's named actors still alive and its placement group unless removed, from Ray's GCS
    (the state API, ``ray.util.state``, would need the dashboard)."""
    named = ray.util.list_named_actors(all_namespaces=True)
    actors = [a["name"] for a in named if a["name"].startswith(f"hp:{job_id}:")]
    groups = [
        g["name"]
        for g in ray.util.placement_group_table().values()
        if g["name"] == f"hp:{job_id}" and g["state"] != "REMOVED"
    ]
    return actors, groups


def _wait_step(handle, step, timeout=180):
    """Until the job has done ``step`` steps; fails (never hangs) if it ends or stalls first."""
    deadline = time.time() + timeout
    while True:
        status = handle.status()
        if status["step"] >= step:
            return status
        assert status["state"] not in ("FAILED", "SUCCEEDED", "CANCELLED"), status
        assert time.time() < deadline, f"no step {step} after {timeout} s: {status}"
        time.sleep(0.2)


def _finish(handle):
    handle.shutdown()
    deadline = time.time() + 30
    while any(_leftovers(handle.job_id)) and time.time() < deadline:
        time.sleep(0.5)
    assert _leftovers(handle.job_id) == ([], [])


def test_hsdp_job_succeeds_with_torchrun_losses_and_keeps_every_metric(cluster, ranks, tmp_path):
    spec = _spec(tmp_path, "hsdp", parallelism={"dp_replicate": 2}, checkpoint={"interval": 2, "keep": 2})
    handle = start_job(spec)
    status = handle.wait(timeout=300)
    assert status["state"] == "SUCCEEDED", status
    assert [h["state"] for h in status["history"]][:1] == ["QUEUED"] and "RUNNING" in [
        h["state"] for h in status["history"]
    ]
    # Nobody polled while it ran: every step's record is still there.
    records = handle.poll(since_step=0)["records"]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in handle.poll(since_step=4)["records"]] == [5, 6]
    expected = ranks(2).run(_torchrun_equivalent, _spec(tmp_path / "ref", "hsdp", parallelism={"dp_replicate": 2}))[0]
    assert [r["loss"] for r in records] == expected
    # step 2's checkpoint was pruned (keep: 2): the listing shows only what is on storage
    assert [c["step"] for c in handle.checkpoints()] == [4, 6]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-00000004", "step-00000006"]
    assert all("kept" not in c for c in handle.checkpoints())
    assert any("step     6/6" in line["line"] for line in handle.logs(rank=0))
    _finish(handle)


def test_killed_worker_restarts_from_checkpoint(cluster, ranks, tmp_path):
    spec = _spec(tmp_path, "kill", training={"steps": 24}, checkpoint={"interval": 4}, failure={"max_restarts": 2})
    handle = start_job(spec)
    _wait_step(handle, 6)
    worker = ray.get_actor(worker_name(handle.job_id, 1), namespace=NAMESPACE)
    pid = ray.get(worker.address.remote()).pid
    os.kill(pid, signal.SIGKILL)
    status = handle.wait(timeout=300)
    assert status["state"] == "SUCCEEDED", status
    assert status["restarts"] == 1 and "a worker died" in status["restart_reasons"][0]
    expected = ranks(2).run(_torchrun_equivalent, _spec(tmp_path / "ref", "kill", training={"steps": 24}))[0]
    assert handle.poll(since_step=23)["records"][-1]["loss"] == expected[-1]
    _finish(handle)


class HangOnRank1(nn.Module):
    """Rank 1 blocks at its third forward: rank 0 then waits in a collective forever."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.layers = nn.ModuleList([nn.Linear(8, 16)])
        self.calls = 0

    def init_weights(self):
        nn.init.normal_(self.emb.weight)
        nn.init.normal_(self.layers[0].weight)
        nn.init.zeros_(self.layers[0].bias)

    def forward(self, x):
        self.calls += 1
        if self.calls == 3 and os.environ.get("RANK") == "1":
            time.sleep(3600)
        return self.layers[0](self.emb(x))


def hang_model():
    return HangOnRank1()


def test_hang_is_detected_within_the_timeout(cluster, tmp_path):
    model = {"name": "tests.actors.test_ray_jobs:hang_model", "flavor": None}
    spec = _spec(
        tmp_path, "hang", model=model, data={"vocab_size": 16}, training={"steps": 50}, failure={"step_timeout_s": 4}
    )
    handle = start_job(spec)
    _wait_step(handle, 2)
    status = handle.wait(timeout=120)  # rank 1 sleeps for an hour: only the watchdog ends this
    assert status["state"] == "FAILED" and "hang: no progress" in status["message"], status
    assert "after step 2" in status["message"], status
    stacks = [line["line"] for line in handle.logs(rank=1) if "watchdog" in line["line"]]
    assert stacks and "time.sleep(3600)" in stacks[0]
    _finish(handle)


def test_a_report_that_runs_after_a_later_steps_does_not_move_the_step_back(cluster, tmp_path):
    """The coordinator runs calls on several threads, so Ray may run step 1's report after step
    2's; the job's step is the last one completed all the same (CI once saw a job fail "after step
    2" whose status still said step 1)."""
    from hpservice.actors.coordinator import Coordinator

    coordinator = Coordinator.options(namespace=NAMESPACE).remote("order-0", _spec(tmp_path, "order"))
    try:
        for step in (2, 1):  # one at a time: this order, whatever the threads do
            ray.get(coordinator.report.remote({"step": step, "loss": 1.0}))
        assert ray.get(coordinator.status.remote())["step"] == 2
    finally:
        ray.kill(coordinator)


class SlowFirstStep(HangOnRank1):
    def forward(self, x):
        self.calls += 1
        if self.calls == 1:
            time.sleep(8)  # a first step (compile, warm-up, a slow disk) far longer than step_timeout_s
        return self.layers[0](self.emb(x))


def slow_first_step_model():
    return SlowFirstStep()


def test_a_slow_first_step_is_not_a_hang(cluster, tmp_path):
    model = {"name": "tests.actors.test_ray_jobs:slow_first_step_model", "flavor": None}
    failure = {"step_timeout_s": 4, "startup_timeout_s": 600}
    spec = _spec(tmp_path, "slowstart", model=model, data={"vocab_size": 16}, training={"steps": 3}, failure=failure)
    handle = start_job(spec)
    status = handle.wait(timeout=300)
    assert status["state"] == "SUCCEEDED", status
    _finish(handle)


def test_infeasible_job_fails_fast_with_its_reason(cluster, tmp_path):
    spec = _spec(tmp_path, "big", resources={"workers": 64, "cpus_per_worker": 2}, parallelism={"dp_replicate": 64})
    handle = start_job(spec)
    status = handle.wait(timeout=60)
    assert status["state"] == "FAILED", status  # at once: handle.wait bounds it
    assert "needs 64 workers x (2 CPU)" in status["message"] and "1 node(s): 4 CPU" in status["message"]
    assert "to fit it: a larger cluster (e.g. hpservice serve --num-cpus 128" in status["message"]
    _finish(handle)
    from hpservice.actors.placement import cluster_fit

    eight = _spec(tmp_path, "eight", resources={"workers": 8})
    why = cluster_fit(eight, 0)  # the fix it names makes it fit
    assert "--set resources.cpus_per_worker=0.5 (the workers then share the cores)" in why
    assert cluster_fit(_spec(tmp_path, "eight", resources={"workers": 8, "cpus_per_worker": 0.5}), 0) is None


def test_cancel_is_graceful_and_leaves_nothing(cluster, tmp_path):
    spec = _spec(tmp_path, "cancel", training={"steps": 10000}, checkpoint={"interval": 1000})
    handle = start_job(spec)
    _wait_step(handle, 3)
    handle.stop(graceful=True, deadline_s=60)
    status = handle.wait(timeout=120)
    assert status["state"] == "CANCELLED" and "stopped gracefully" in status["message"], status
    assert "CANCELLING" in [h["state"] for h in status["history"]]
    saved = handle.checkpoints()
    assert saved and saved[-1]["step"] >= 3  # the stop checkpointed the step it finished
    _finish(handle)
    with pytest.raises(ValueError):
        JobHandle.attach(handle.job_id)


def test_a_config_error_fails_at_once_naming_every_rank(cluster, tmp_path):
    """A spec the trainer refuses while building (a freeze pattern that matches nothing) fails the
    same way every time: no restart is spent on it, and the message names the ranks that raised
    (grouping by message: test_failures_are_grouped_by_message_and_classified)."""
    spec = _spec(tmp_path, "config", training={"freeze": ["layers.9"]}, failure={"max_restarts": 3})
    handle = start_job(spec)
    status = handle.wait(timeout=180)
    assert status["state"] == "FAILED" and status["restarts"] == 0, status
    # whichever ranks had raised by the poll that saw the first (on a loaded machine, maybe one)
    assert re.match(r"the job's spec cannot run \(not retried\): ranks? (0, 1|0|1) raised: ", status["message"]), status
    assert "training.freeze: 'layers.9' matches no parameter" in status["message"]
    _finish(handle)


PREEMPTION = "preempted by job urgent-1 (priority 10 > 0)"


def test_a_preemption_that_meets_the_last_step_lets_the_job_succeed_and_release_everything(cluster, drill, tmp_path):
    """The race a serve drill found, forced: the coordinator holds (the drill file) while the job
    trains its last step; the preemption arrives after it and before the coordinator has seen it.
    The job SUCCEEDS (a finished job is not resumed), its history says when the stop arrived, and
    nothing of it is left holding resources. It used to raise RUNNING -> PREEMPTED and stay RUNNING."""
    spec = _spec(tmp_path, "race", training={"steps": 4}, resources={"workers": 1})
    drill.write_text("hold")
    try:
        handle = start_job(spec)
        _wait_step(handle, 4)  # reported by the workers while supervision holds
        handle.stop(graceful=True, deadline_s=60, preempted_by=PREEMPTION)
    finally:
        drill.unlink()
    status = handle.wait(timeout=120)
    assert status["state"] == "SUCCEEDED", status
    assert status["message"] == "finished 4 steps; the stop asked meanwhile came after the last step", status
    assert any(h["message"] == f"stop asked at step 4: {PREEMPTION}" for h in status["history"]), status["history"]
    _finish(handle)


@pytest.mark.parametrize("handler", ["QUEUED", "STARTING", "RUNNING", "CANCELLING"])
def test_a_coordinator_whose_handler_raises_fails_the_job_saying_why_and_releases_it(cluster, drill, tmp_path, handler):
    """Any exception out of a state handler ends the job FAILED with the error in its history and
    the traceback in its log, its workers and placement group released, instead of a job that no
    one supervises."""
    spec = _spec(tmp_path, f"raise-{handler.lower()}", training={"steps": 10000}, resources={"workers": 1})
    drill.write_text(handler)
    try:
        handle = start_job(spec)
        if handler == "CANCELLING":
            _wait_step(handle, 1)
            handle.stop(graceful=True, deadline_s=60, preempted_by=PREEMPTION)
        status = handle.wait(timeout=180)
    finally:
        drill.unlink()
    assert status["state"] == "FAILED", status
    assert status["message"] == f"the job's supervision failed in {handler}: DrillFault: drill: the {handler} handler raised"
    assert any("coordinator: supervision raised" in line["line"] for line in handle.logs()), handle.logs()
    _finish(handle)


def test_the_end_of_an_attempt_is_finished_at_the_last_step_whatever_was_asked():
    from hpservice.actors.failure_policy import AttemptEnd, WorkerPoll, attempt_end
    from hpservice.jobs import JobState

    def polls(*ranks):
        return [WorkerPoll(r, step, done, 0.0, None, False) for r, (step, done) in enumerate(ranks)]

    assert attempt_end(polls((4, True), (3, False)), 4) is None  # a rank still trains
    assert attempt_end(polls((4, True), (4, True)), 4) == AttemptEnd(True, 4)
    assert attempt_end(polls((2, True), (2, True)), 4) == AttemptEnd(False, 2)  # stopped short
    # every live state a stop can find a job in leads to PREEMPTED; CANCELLING may still succeed
    for state in (JobState.QUEUED, JobState.STARTING, JobState.RUNNING, JobState.RESTARTING, JobState.CANCELLING):
        assert state.can_become(JobState.PREEMPTED), state
    assert JobState.CANCELLING.can_become(JobState.SUCCEEDED)


def test_a_cancel_wins_over_a_preemption_whichever_came_first():
    from hpservice.actors.failure_policy import preemption_after_stop

    why = "preempted by job x (priority 10 > 0)"
    assert preemption_after_stop(False, None, why) == why  # preempted
    assert preemption_after_stop(True, why, None) is None  # then cancelled: CANCELLED
    assert preemption_after_stop(True, None, why) is None  # cancelled, then preempted: still CANCELLED
    assert preemption_after_stop(True, why, "another reason") == why  # the first preemption's reason stays


def test_failures_are_grouped_by_message_and_classified():
    from hpservice.actors.failure_policy import FailureKind, RestartPolicy, WorkerPoll, failure_from_polls

    polls = [
        WorkerPoll(0, 3, True, 0.0, "Traceback ...\nRuntimeError: boom"),
        WorkerPoll(1, 3, False, 0.0),
        WorkerPoll(2, 3, True, 0.0, "Traceback ...\nRuntimeError: boom"),
        WorkerPoll(3, 3, True, 0.0, "Traceback ...\nOSError: disk full"),
    ]
    failure = failure_from_polls(polls)
    assert failure.reason == "ranks 0, 2 raised: RuntimeError: boom; rank 3 raised: OSError: disk full"
    assert failure.kind is FailureKind.WORKER and failure_from_polls(polls[1:2]) is None
    policy = RestartPolicy(max_restarts=2)
    assert policy.should_restart(failure, 1) and not policy.should_restart(failure, 2)
    assert [policy.backoff_s(n) for n in (1, 2, 3, 9)] == [1.0, 2.0, 4.0, 30.0]
    config = failure_from_polls([WorkerPoll(0, 0, True, 0.0, "TrainingError: bad", config_error=True)])
    assert config.kind is FailureKind.CONFIG and not policy.should_restart(config, 0)


class OneBlock(HangOnRank1):
    def forward(self, x):
        return self.layers[0](self.emb(x))


def one_block_model():
    return OneBlock()


def test_a_compiled_job_keeps_its_compile_cache_in_its_own_directory(cluster, tmp_path):
    """training.compile writes Inductor's kernels; a job's go under its run directory, not into the
    per-user temp folder every tenant's jobs on the node would share. A one-block model: its cache
    is cold by design, and this is about where the kernels go (the trainer's compile tests check
    what they compute)."""
    model = {"name": "tests.actors.test_ray_jobs:one_block_model", "flavor": None}
    spec = _spec(
        tmp_path, "compiled", model=model, data={"vocab_size": 16},
        training={"steps": 2, "compile": True}, resources={"workers": 1},
    )  # fmt: skip
    handle = start_job(spec)
    status = handle.wait(timeout=400)
    assert status["state"] == "SUCCEEDED", status
    cache = tmp_path / "metrics" / handle.job_id / "compile-cache"
    assert cache.is_dir() and any(p.suffix == ".so" for p in cache.rglob("*")), sorted(cache.rglob("*"))
    _finish(handle)
