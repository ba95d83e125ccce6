"""``hpservice run job.yaml``: one job on an embedded local Ray (or a given cluster), with a live
progress bar; Ctrl-C cancels gracefully (a second Ctrl-C stops at once)."""

from __future__ import annotations

import math
import os
import time

from rich.console import Console

from hpservice._progress import job_progress
from hpservice.cli._render import print_summary
from hpservice.jobs import EXIT_FOR_STATE, TERMINAL_STATES


def run_job(spec, *, address: str | None = None, console: Console | None = None) -> int:
    """Run ``spec`` to a terminal state, rendering progress; returns the process exit code."""
    import ray

    from hpservice.actors import connect, start_job

    console = console or Console()
    # A laptop job may ask for more CPU slots than cores: workers then share them.
    needed = math.ceil(spec.resources.workers * spec.resources.cpus_per_worker)
    connect(address, num_cpus=max(os.cpu_count() or 1, needed), runtime_env=spec.runtime.runtime_env())
    handle = start_job(spec)
    workers, steps = spec.resources.workers, spec.training.steps
    console.print(
        f"job [bold]{handle.job_id}[/]: {workers} worker{'s' * (workers != 1)}, {steps} step{'s' * (steps != 1)}"
    )
    cursor, last, interrupts = 0, None, 0
    records: dict[int, dict] = {}  # by step: a restart's re-run steps replace the earlier ones
    try:
        with job_progress(console) as progress:
            task = progress.add_task("train", total=spec.training.steps, state="QUEUED", loss="-", tps="-", restarts=0)
            while True:
                try:
                    update = handle.poll(after=cursor)
                    status, cursor = update["status"], update["cursor"]
                    if update["records"]:
                        records.update((r["step"], r) for r in update["records"])
                        last = update["records"][-1]
                    progress.update(
                        task,
                        completed=status["step"],
                        state=status["state"],
                        loss=f"{last['loss']:.4f}" if last else "-",
                        tps=f"{last['tokens_per_s']:,.0f}" if last else "-",
                        restarts=status["restarts"],
                    )
                    if status["state"] in TERMINAL_STATES:
                        break
                    time.sleep(0.5)
                except KeyboardInterrupt:
                    interrupts += 1
                    graceful = interrupts == 1
                    console.print(
                        "cancelling: finishing the step and checkpointing (Ctrl-C again to stop now)"
                        if graceful
                        else "stopping now"
                    )
                    handle.stop(graceful=graceful, deadline_s=60 if graceful else 0)
        print_summary(console, status, [records[k] for k in sorted(records)])
        return EXIT_FOR_STATE[status["state"]]
    finally:
        handle.shutdown()
        ray.shutdown()
