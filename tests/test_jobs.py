"""hpservice.jobs: the job vocabulary and the end-of-run summary."""

import io

import pytest
from rich.console import Console

from hpservice.cli._render import print_summary
from hpservice.jobs import EXIT_FOR_STATE, ExitCode, JobState, steady_state


def test_states_exit_codes_and_terminal():
    assert [s for s in JobState if s.is_terminal] == [JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED]
    assert JobState("RUNNING") == "RUNNING" and not JobState.RUNNING.is_terminal
    assert {s: int(c) for s, c in EXIT_FOR_STATE.items()} == {"SUCCEEDED": 0, "FAILED": 1, "CANCELLED": 130}
    assert ExitCode.USAGE == 2
    with pytest.raises(ValueError):
        JobState("DONE")


def test_steady_state_leaves_out_the_warm_up_and_weights_by_time():
    records = [{"step": 1, "tokens_per_s": 10.0, "step_time_s": 10.0}]  # the first step: warm-up
    records += [{"step": s, "tokens_per_s": 100.0 if s % 2 else 300.0, "step_time_s": 3.0 if s % 2 else 1.0}
                for s in range(2, 12)]  # fmt: skip
    steady = steady_state(records)
    assert steady["steps"] == 10
    assert steady["tokens_per_s"] == pytest.approx((5 * 300 + 5 * 300) / (5 * 3 + 5 * 1))  # tokens / seconds
    assert steady_state([]) == {}


def test_summary_reports_the_steady_rate_not_the_last_step():
    out = io.StringIO()
    records = [{"step": s, "loss": 5.0 - s / 10, "tokens_per_s": 1000.0, "step_time_s": 0.1} for s in range(1, 10)]
    records.append({"step": 10, "loss": 4.0, "tokens_per_s": 1.0, "step_time_s": 0.1})  # a slow last step
    job = {"state": "SUCCEEDED", "message": "finished 10 steps", "total_steps": 10, "restarts": 0, "checkpoints": []}
    print_summary(Console(file=out, width=200), job, records)
    text = out.getvalue()
    assert "SUCCEEDED: finished 10 steps" in text and "final loss 4.0000" in text
    assert "889 tok/s steady (mean over the last 9 steps)" in text  # step 1 left out; not the last "1 tok/s"
    assert "expert load" not in text


def test_summary_of_a_moe_job_names_its_most_imbalanced_layer():
    out = io.StringIO()
    record = {"step": 3, "loss": 4.0, "expert_load": {"1": [10, 10, 10, 10], "3": [4, 24, 6, 6]}, "expert_imbalance": 2.4}
    print_summary(Console(file=out, width=200), {"state": "SUCCEEDED", "total_steps": 3}, [record])
    assert "expert load at the last step: 2 MoE layers; the most imbalanced, layer 3, from 4 to 24 tokens per expert (2.40x the mean)" in out.getvalue()


def test_transitions_are_typed_and_an_ended_job_never_moves():
    from hpservice.jobs import ACTIVE_STATES, TERMINAL_STATES

    for ended in TERMINAL_STATES:
        assert not any(ended.can_become(s) for s in JobState)
    for live in ACTIVE_STATES:  # the cluster or the coordinator can be lost at any moment
        assert all(live.can_become(s) for s in (JobState.FAILED, JobState.CANCELLED, JobState.QUEUED))
    assert JobState.QUEUED.can_become("STARTING") and not JobState.QUEUED.can_become("SUCCEEDED")
    assert JobState.RUNNING.can_become("SUCCEEDED") and not JobState.RESTARTING.can_become("SUCCEEDED")
    assert not JobState.CANCELLING.can_become("RUNNING")
