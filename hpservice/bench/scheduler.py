"""``python -m hpservice.bench scheduler``: the queue's decisions on a few hundred jobs, simulated.

Jobs of mixed sizes (1-8 workers), lengths and priorities (0, 5, 10) from four owners arrive at
random (a fixed seed) at a fake cluster of ``--cpus`` CPUs. Time is simulated: at every arrival
and every completion the queue decides, exactly as the supervisor's tick does
(``hpservice.api.scheduler.decide``). The anchor, in the same run on the same jobs, is a
strict first-in-first-out queue (Ray Jobs' behaviour, and ours before the scheduler): the head
starts when it fits and everything waits behind it.

Reported per priority: the mean, median and 90th percentile of the queueing delay (start -
arrival); overall: utilisation (CPU-seconds used / CPU-seconds available until the last job
ends) and the makespan; and the ratios against FIFO.
"""

from __future__ import annotations

import heapq
import json
import random
import statistics

from hpservice.api.scheduler import JobDemand, Quotas, decide

PRIORITIES = (0, 5, 10)


def make_jobs(n: int, seed: int, mean_gap_s: float) -> list[tuple[JobDemand, float]]:
    """``n`` (job, run time) pairs with random arrivals, sizes, lengths, owners and priorities."""
    rng = random.Random(seed)
    t = 0.0
    jobs = []
    for i in range(n):
        t += rng.expovariate(1.0 / mean_gap_s)
        workers = rng.choices((1, 2, 4, 8), weights=(4, 3, 2, 1))[0]
        priority = rng.choices(PRIORITIES, weights=(7, 2, 1))[0]
        owner = f"team{rng.randrange(4)}"
        jobs.append((JobDemand(f"j{i:04d}", owner, priority, workers, 1.0, 0, t), rng.uniform(20, 200)))
    return jobs


def _fifo(queued: list[JobDemand], free: float) -> list[str]:
    start = []
    for job in sorted(queued, key=lambda j: (j.queued_at, j.id)):
        if job.workers * job.cpus > free + 1e-9:
            break
        start.append(job.id)
        free -= job.workers * job.cpus
    return start


def simulate(jobs: list[tuple[JobDemand, float]], cpus: float, policy: str, backfill_bound_s: float) -> dict:
    """Run ``jobs`` through the queue; each job's start time."""
    length = {j.id: run for j, run in jobs}
    by_id = {j.id: j for j, _ in jobs}
    arrivals = sorted(jobs, key=lambda p: p[0].queued_at)
    events: list[tuple[float, int, str]] = []  # (time, 0 = completion first, job id)
    for j, _ in arrivals:
        heapq.heappush(events, (j.queued_at, 1, j.id))
    queued: dict[str, JobDemand] = {}
    running: dict[str, JobDemand] = {}
    started: dict[str, float] = {}
    free = cpus
    end = 0.0
    peak = 0.0  # the most CPUs in use at once
    while events:
        now, kind, job_id = heapq.heappop(events)
        if kind == 0:
            free += running.pop(job_id).workers * by_id[job_id].cpus
        else:
            queued[job_id] = by_id[job_id]
        if events and events[0][0] == now:
            continue  # decide once all events of this instant are in
        if policy == "fifo":
            start = _fifo(list(queued.values()), free)
        else:
            start = decide(list(queued.values()), list(running.values()), {"CPU": free}, Quotas(), now, backfill_bound_s).start
        for s in start:
            job = queued.pop(s)
            running[s] = job
            started[s] = now
            free -= job.workers * job.cpus
            heapq.heappush(events, (now + length[s], 0, s))
            end = max(end, now + length[s])
        peak = max(peak, cpus - free)
    first = min(j.queued_at for j, _ in jobs)
    used = sum(j.workers * j.cpus * length[j.id] for j, _ in jobs)
    delays = {p: [started[j.id] - j.queued_at for j, _ in jobs if j.priority == p] for p in PRIORITIES}
    return {
        "delay_s": {
            str(p): {
                "jobs": len(d),
                "mean": statistics.fmean(d),
                "median": statistics.median(d),
                "p90": statistics.quantiles(d, n=10)[-1] if len(d) > 1 else d[0],
            }
            for p, d in delays.items()
            if d
        },
        "utilisation": used / (cpus * (end - first)),
        "makespan_s": end - first,
        "peak_cpus": peak,
    }


def add_parser(sub) -> None:
    p = sub.add_parser("scheduler", help="the queue (priorities, fair share, backfill) vs FIFO on simulated jobs")
    p.add_argument("--jobs", type=int, default=300)
    p.add_argument("--cpus", type=float, default=32, help="the fake cluster's CPUs (a worker takes one)")
    p.add_argument("--mean-gap-s", type=float, default=4.0, help="mean time between arrivals")
    p.add_argument("--backfill-bound-s", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run)


def run(args) -> int:
    jobs = make_jobs(args.jobs, args.seed, args.mean_gap_s)
    ours = simulate(jobs, args.cpus, "ours", args.backfill_bound_s)
    fifo = simulate(jobs, args.cpus, "fifo", args.backfill_bound_s)
    print(f"{args.jobs} jobs on {args.cpus:g} CPUs (seed {args.seed}); queueing delay in s, mean / median / p90")
    print(f"{'priority':>8} {'jobs':>5} {'ours':>26} {'FIFO':>26} {'mean ratio':>11}")
    ratios = {}
    for p, d in ours["delay_s"].items():
        f = fifo["delay_s"][p]
        ratios[p] = d["mean"] / f["mean"] if f["mean"] else float("nan")
        cell = lambda x: f"{x['mean']:8.0f} {x['median']:8.0f} {x['p90']:8.0f}"  # noqa: E731
        print(f"{p:>8} {d['jobs']:>5} {cell(d):>26} {cell(f):>26} {ratios[p]:>11.2f}")
    print(
        f"utilisation: ours {ours['utilisation']:.3f}, FIFO {fifo['utilisation']:.3f} "
        f"(ratio {ours['utilisation'] / fifo['utilisation']:.3f}); makespan ours {ours['makespan_s']:.0f} s, "
        f"FIFO {fifo['makespan_s']:.0f} s"
    )
    if args.json:
        report = {
            "bench": "scheduler", "jobs": args.jobs, "cpus": args.cpus, "seed": args.seed, "ours": ours, "fifo": fifo,
            "mean_delay_ratio_vs_fifo": ratios, "utilisation_ratio_vs_fifo": ours["utilisation"] / fifo["utilisation"],
        }  # fmt: skip
        print(json.dumps(report))
    return 0

