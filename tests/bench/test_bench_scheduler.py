"""bench scheduler: a deterministic simulation (fixed seed, simulated time), so its numbers are
the same on every machine; what it reports is checked, and that priority pays off."""

import json

from hpservice.bench.scheduler import make_jobs, simulate
from tests.bench._inprocess import bench


def test_bench_scheduler_reports_delay_per_priority_and_utilisation():
    proc = bench("scheduler", "--jobs", "120", "--cpus", "16", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["bench"] == "scheduler" and set(report["ours"]["delay_s"]) == {"0", "5", "10"}
    assert sum(d["jobs"] for d in report["ours"]["delay_s"].values()) == 120
    assert 0 < report["ours"]["utilisation"] <= 1 and 0 < report["fifo"]["utilisation"] <= 1
    # the urgent jobs wait less than under FIFO (simulated time: the same on every machine)
    assert report["mean_delay_ratio_vs_fifo"]["10"] < 1


def test_the_simulation_never_oversubscribes_and_starts_every_job():
    jobs = make_jobs(80, seed=3, mean_gap_s=2.0)
    for policy in ("ours", "fifo"):
        result = simulate(jobs, cpus=8, policy=policy, backfill_bound_s=300)
        assert sum(d["jobs"] for d in result["delay_s"].values()) == 80
        assert result["utilisation"] <= 1.0 + 1e-9 and 0 < result["peak_cpus"] <= 8 + 1e-9
