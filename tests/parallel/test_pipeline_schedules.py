"""Pipeline schedules as pure per-rank action lists, checked before anything runs them: every
micro-batch forwarded and backwarded exactly once per stage, every send received, no deadlock;
their bubbles against the closed forms, and their activation memory against 1F1B's bound."""

import pytest

from hpservice.parallel.pipelining import (
    Action,
    ComputationType,
    ScheduleError,
    compute_order,
    simulate,
    with_communication,
)

F, B, I = ComputationType.FORWARD, ComputationType.FULL_BACKWARD, ComputationType.BACKWARD_INPUT  # noqa: E741
W = ComputationType.BACKWARD_WEIGHT
GRID = [(pp, m) for pp in (1, 2, 3, 4) for m in (pp, 2 * pp, 8)]


def _run(schedule, pp, m, v=1, durations=None):
    return simulate(with_communication(compute_order(schedule, pp, m, v), pp), pp, durations)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero_bubble"])
@pytest.mark.parametrize(("pp", "m"), GRID)
def test_each_schedule_runs_every_microbatch_once_per_stage_without_deadlock(schedule, pp, m):
    order = compute_order(schedule, pp, m)
    for rank, actions in order.items():
        kinds = {a.kind for a in actions}
        assert {a.stage for a in actions} == {rank}
        per_mb = sorted((a.microbatch, a.kind.value) for a in actions)
        expected = sorted((mb, k) for mb in range(m) for k in (("F", "I", "W") if I in kinds else ("F", "B")))
        assert per_mb == expected
    timeline = _run(schedule, pp, m)  # raises on a deadlock, a lost send, a missing backward
    closed_form = (pp - 1) / (m + pp - 1)
    if schedule == "zero_bubble":
        assert timeline.bubble <= closed_form + 1e-9 and (pp == 1 or timeline.bubble < closed_form)
    else:
        assert timeline.bubble == pytest.approx(closed_form)
    if schedule != "gpipe":  # 1F1B's bound: rank r holds at most pp - r micro-batches
        assert all(timeline.peak_activations[r] <= pp - r for r in range(pp))
    else:
        assert all(p == m for p in timeline.peak_activations.values())


@pytest.mark.parametrize(("pp", "m", "v"), [(2, 4, 2), (4, 8, 2), (4, 4, 3), (3, 6, 2), (2, 2, 4)])
def test_interleaved_1f1b_visits_each_rank_v_times_and_shrinks_the_bubble(pp, m, v):
    order = compute_order("interleaved_1f1b", pp, m, v)
    for rank, actions in order.items():
        assert {a.stage for a in actions} == {rank + k * pp for k in range(v)}  # loop placement
        assert len(actions) == 2 * m * v
    cost = {F: 1 / v, B: 2 / v}  # each of a rank's v stages holds 1/v of its layers
    timeline = _run("interleaved_1f1b", pp, m, v, cost)
    assert timeline.bubble == pytest.approx((pp - 1) / (v * m + pp - 1))
    assert timeline.bubble < _run("1f1b", pp, m).bubble or pp == 1


def test_transfers_pair_every_send_with_a_receive_on_the_next_stages_rank():
    programs = with_communication(compute_order("1f1b", 2, 3), 2)
    assert [str(a) for a in programs[0]] == [
        "0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0B0", "0F2", "0SEND_F2", "0RECV_B1", "0B1", "0RECV_B2", "0B2",
    ]  # fmt: skip
    assert [str(a) for a in programs[1]][:4] == ["1RECV_F0", "1F0", "1B0", "1SEND_B0"]


def test_a_schedule_that_cannot_run_is_refused_naming_why():
    # both ranks wait to receive before they send
    stuck = {
        0: [Action(0, ComputationType.RECV_B, 0), Action(0, F, 0), Action(0, ComputationType.SEND_F, 0)],
        1: [Action(1, ComputationType.RECV_F, 0), Action(1, F, 0), Action(1, B, 0)],
    }
    with pytest.raises(ScheduleError, match=r"deadlock: rank 0 at 0RECV_B0, rank 1 at 1RECV_F0"):
        simulate(stuck, 2)
    twice = with_communication({0: [Action(0, F, 0), Action(0, F, 0), Action(0, B, 0)]}, 1)
    with pytest.raises(ScheduleError, match="runs twice"):
        simulate(twice, 1)
    missing = with_communication({0: [Action(0, F, 0), Action(0, F, 1), Action(0, B, 0)]}, 1)
    with pytest.raises(ScheduleError, match="micro-batch 1 needs one backward"):
        simulate(missing, 1)
    with pytest.raises(ValueError, match=r"1f1b: micro-batches \(2\) must be >= pp \(4\)"):
        compute_order("1f1b", 4, 2)
    with pytest.raises(ValueError, match=r"interleaved_1f1b: micro-batches \(6\) must be a multiple of pp \(4\)"):
        compute_order("interleaved_1f1b", 4, 6, 2)
    with pytest.raises(ValueError, match="expected one of gpipe, 1f1b, interleaved_1f1b, zero_bubble"):
        compute_order("looped_bfs", 2, 4)


@pytest.mark.parametrize(("pp", "m", "v"), [(2, 4, 2), (4, 8, 2), (4, 4, 3), (3, 6, 2), (2, 2, 4)])
def test_zero_bubble_with_several_stages_per_rank_splits_interleaved_backwards_and_shrinks_its_bubble(pp, m, v):
    order = compute_order("zero_bubble", pp, m, v)
    for rank, actions in order.items():
        assert {a.stage for a in actions} == {rank + k * pp for k in range(v)}
        per = sorted((a.stage, a.microbatch, a.kind.value) for a in actions)
        assert per == sorted((s, mb, k) for s in range(rank, pp * v, pp) for mb in range(m) for k in "FIW")
        for a in actions:  # each weight gradient after its input gradient
            if a.kind is W:
                assert actions.index(Action(a.stage, I, a.microbatch)) < actions.index(a)
    zb = _run("zero_bubble", pp, m, v, {F: 1 / v, I: 1 / v, W: 1 / v})  # raises on a deadlock
    interleaved = _run("interleaved_1f1b", pp, m, v, {F: 1 / v, B: 2 / v})
    assert zb.bubble < interleaved.bubble
    assert all(zb.peak_activations[r] <= interleaved.peak_activations[r] + 1 for r in range(pp))
    with pytest.raises(ValueError, match=r"zero_bubble with 2 stages per rank: micro-batches \(3\) must be a multiple of pp \(2\)"):
        compute_order("zero_bubble", 2, 3, 2)
