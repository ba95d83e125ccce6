"""Measured peak memory of a job's training step, per rank, on this machine's CPUs.

``measure(spec)`` runs ``spec`` with ``hpservice.train.Trainer`` on ``resources.workers`` gloo
ranks (fresh processes), each inside a ``TensorMemoryTracker`` entered before its model is built,
so every tensor the rank allocates is counted: its shards, gradients, optimizer state,
fully_shard's buffers, activations and every temporary. ``warmup`` steps run first (the
optimizer's state exists after the first), then the peak is reset and the next step's
high-water mark is the measurement. This is what ``python -m hpservice.bench memory`` compares
the estimate with; on a GPU, ``torch.cuda.max_memory_allocated`` of the same step is the
equivalent (the trainer reports it as ``peak_memory_allocated_gib``).
"""

from __future__ import annotations

import gc
import tempfile

__all__ = ["measure", "step_time"]


def _rank(spec_json: str, warmup: int, run_dir: str) -> dict:
    import torch
    import torch.distributed as dist

    from hpservice.spec import JobSpec
    from hpservice.train import Trainer

    from ._tracker import TensorMemoryTracker

    torch.set_num_threads(1)
    spec = JobSpec.model_validate_json(spec_json)
    spec = spec.model_copy(update={"metrics": spec.metrics.model_copy(update={"dir": run_dir})})
    with TensorMemoryTracker() as mem:
        trainer = Trainer(spec, log_to_stdout=False)
        for _ in range(warmup):
            trainer.train_step()
        gc.collect()
        mem.reset_peak()
        before = mem.current
        record = trainer.train_step()
        peak = mem.peak
    trainer.close()
    return {"rank": dist.get_rank(), "peak_bytes": peak, "between_steps_bytes": before, "loss": record["loss"]}


def measure(spec, *, warmup: int = 2, timeout: float = 900.0, pool=None) -> list[dict]:
    """Each rank's ``{rank, peak_bytes, between_steps_bytes, loss}`` for one step of ``spec``
    (after ``warmup`` steps), in rank order; on ``pool`` (a ``RankPool`` of the job's size) if
    given, else on fresh rank processes."""
    steps = spec.training.model_copy(update={"steps": warmup + 1})
    spec = spec.model_copy(update={"training": steps})
    with tempfile.TemporaryDirectory(prefix="hpservice-memory-") as tmp:
        out = _run(pool, _rank, spec.resources.workers, spec.model_dump_json(), warmup, tmp, timeout=timeout)
    return sorted(out, key=lambda r: r["rank"])


def _timed_rank(spec_json: str, warmup: int, steps: int, run_dir: str) -> float:
    import statistics
    import time

    import torch

    from hpservice.spec import JobSpec
    from hpservice.train import Trainer

    torch.set_num_threads(1)
    spec = JobSpec.model_validate_json(spec_json)
    spec = spec.model_copy(update={"metrics": spec.metrics.model_copy(update={"dir": run_dir})})
    trainer = Trainer(spec, log_to_stdout=False)
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        trainer.train_step()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    trainer.close()
    return statistics.median(times)


def step_time(spec, *, warmup: int = 2, steps: int = 3, timeout: float = 900.0, pool=None) -> float:
    """The median step time of ``spec`` (the slowest rank's), after ``warmup`` steps."""
    training = spec.training.model_copy(update={"steps": warmup + steps})
    spec = spec.model_copy(update={"training": training})
    with tempfile.TemporaryDirectory(prefix="hpservice-steptime-") as tmp:
        out = _run(pool, _timed_rank, spec.resources.workers, spec.model_dump_json(), warmup, steps, tmp, timeout=timeout)
    return max(out)


def _run(pool, fn, world: int, *args, timeout: float):
    from hpservice.launch import run_ranks

    if pool is not None:
        return pool.run(fn, *args, timeout=timeout)
    return run_ranks(fn, world, *args, timeout=timeout)
