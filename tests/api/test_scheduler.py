"""The queue's decisions (api/scheduler.decide), case by case: priority, quotas, fair share,
backfill and its bound, with the reason every waiting job is given."""

import re

import pytest

from hpservice.api.scheduler import JobDemand, Quota, Quotas, decide

pytestmark = pytest.mark.databases("sqlite")  # pure decisions: no store (the supervisor's tests run on both)


def job(id, owner="alice", workers=1, priority=None, at=0.0, cpus=1.0, gpus=0):
    return JobDemand(id, owner, priority, workers, cpus, gpus, at)


def test_higher_priority_starts_first_whatever_came_first():
    queued = [job("old", at=0), job("urgent", priority=10, at=5)]
    d = decide(queued, [], {"CPU": 1}, Quotas(), now=10)
    assert d.start == ("urgent",)
    assert d.waiting["old"].startswith("waiting for resources: needs 1 x 1 CPU")


def test_an_owner_at_quota_waits_and_blocks_nobody():
    quotas = Quotas({"alice": Quota(workers=4)})
    running = [job("a1", workers=4)]
    queued = [job("a2", workers=2, at=0), job("b1", owner="bob", workers=2, at=1)]
    d = decide(queued, running, {"CPU": 8}, quotas, now=5)
    assert d.start == ("b1",)
    assert d.waiting["a2"] == "waiting: owner alice at quota 4/4 workers (this job needs 2)"


def test_gpu_quota_and_the_operators_default_for_everyone():
    quotas = Quotas({"*": Quota(gpus=2)})
    d = decide([job("g", owner="carol", workers=4, gpus=1)], [], {"CPU": 8, "GPU": 8}, quotas, now=0)
    assert d.start == () and d.waiting["g"] == "waiting: owner carol at quota 0/2 GPUs (this job needs 4)"


def test_fair_share_at_equal_priority_goes_to_the_owner_using_least():
    running = [job("a-running", workers=2)]
    queued = [job("a2", at=0), job("a3", at=1), job("b1", owner="bob", at=2), job("b2", owner="bob", at=3)]
    d = decide(queued, running, {"CPU": 3}, Quotas(), now=5)
    # bob uses 0, alice 2: bob, bob (now 2 each, alice older), alice
    assert d.start == ("b1", "b2", "a2")
    assert "a3" in d.waiting


def test_the_owners_default_priority_applies_when_the_job_sets_none():
    quotas = Quotas({"ops": Quota(priority=5)})
    d = decide([job("a", at=0), job("o", owner="ops", at=1)], [], {"CPU": 1}, quotas, now=2)
    assert d.start == ("o",)
    d = decide([job("a", priority=9, at=0), job("o", owner="ops", at=1)], [], {"CPU": 1}, quotas, now=2)
    assert d.start == ("a",)


def test_smaller_jobs_backfill_until_the_blocked_job_has_waited_the_bound():
    queued = [job("big", workers=4, at=0), job("small", workers=1, at=1)]
    d = decide(queued, [], {"CPU": 2}, Quotas(), now=100, backfill_bound_s=600)
    assert d.start == ("small",)
    assert d.waiting["big"] == (
        "waiting for resources: needs 4 x 1 CPU (smaller jobs may start ahead of it until it has waited 600 s)"
    )
    d = decide(queued, [], {"CPU": 2}, Quotas(), now=700, backfill_bound_s=600)
    assert d.start == ()  # the cluster drains for the big one
    assert d.waiting["small"] == (
        "waiting behind job big (priority 0): it has waited past the backfill bound of 600 s, so nothing overtakes it"
    )


def test_every_job_that_does_not_start_gets_a_reason():
    queued = [job(f"j{i}", owner=f"o{i % 3}", workers=1 + i % 3, priority=i % 2, at=i) for i in range(30)]
    d = decide(queued, [], {"CPU": 10}, Quotas({"o1": Quota(workers=3)}), now=50)
    assert set(d.start) | set(d.waiting) == {j.id for j in queued} and not set(d.start) & set(d.waiting)
    assert sum(j.workers for j in queued if j.id in d.start) <= 10


def test_the_operators_quotas_file_is_strict(tmp_path):
    import pytest

    from hpservice.api.settings import load_quotas

    good = tmp_path / "quotas.yaml"
    good.write_text("alice: {workers: 4, gpus: 2, priority: 5}\n'*': {workers: 8}\n")
    quotas = load_quotas(str(good))
    assert quotas.of("alice") == Quota(4, 2, 5) and quotas.of("bob") == Quota(8, None, 0)
    for text, message in (
        ("alice: {workers: 4, cpus: 2}\n", "unknown keys ['cpus'] (allowed: workers, gpus, priority)"),
        ("alice: {workers: '4'}\n", "workers must be an integer >= 0, got '4'"),
        ("alice: {priority: true}\n", "priority must be an integer >= -1000, got True"),
        ("'../etc': {workers: 1}\n", "owner must be a name"),
        ("- alice\n", "expected a mapping of owner"),
    ):
        bad = tmp_path / "bad.yaml"
        bad.write_text(text)
        with pytest.raises(ValueError, match=re.escape(message)):
            load_quotas(str(bad))


def test_a_higher_priority_job_that_cannot_fit_preempts_the_lowest_priority_youngest_running_jobs():
    running = [job("low-old", workers=2, priority=0, at=0), job("low-young", workers=2, priority=0, at=5),
               job("mid", workers=2, priority=5, at=1)]  # fmt: skip
    urgent = job("urgent", workers=2, priority=10, at=9)
    d = decide([urgent], running, {"CPU": 0}, Quotas(), now=10)
    assert d.start == () and d.preempt == {"low-young": "preempted by job urgent (priority 10 > 0)"}
    assert d.waiting["urgent"] == "waiting for low-young to checkpoint and stop (preempted for it)"
    # while that one stops, nothing more is preempted
    d = decide([urgent], running, {"CPU": 0}, Quotas(), now=11, preempting=frozenset({"low-young"}))
    assert d.preempt == {} and d.start == ()
    # a job of equal priority preempts nobody, nor one that would not fit even then
    assert decide([job("same", workers=2, priority=0, at=9)], running, {"CPU": 0}, Quotas(), now=10).preempt == {}
    assert decide([job("huge", workers=9, priority=10, at=9)], running, {"CPU": 0}, Quotas(), now=10).preempt == {}
    d = decide([job("big", workers=4, priority=10, at=9)], running, {"CPU": 0}, Quotas(), now=10)
    assert set(d.preempt) == {"low-young", "low-old"}
