"""Service benchmark: time to the first training step, our Ray job runtime against Ray Train.

What is measured, on one local Ray cluster that the benchmark starts for itself
(``actors.init_local_ray``: a new instance, never a cluster that was already running; no
dashboard), for the same tiny job (Llama ``tiny``, synthetic tokens, ``--workers`` CPU workers,
global batch 8 x 32 tokens, AdamW):

- ``ours``: ``actors.start_job(spec)`` with a parsed ``JobSpec``. Time to first step is from the
  ``start_job`` call (the submission; the spec is parsed before) to the moment a client polling
  ``handle.poll(after=cursor)`` every 10 ms first receives a metrics record: what a user of the
  service sees. The job then runs its remaining steps (for the latency below) and ends with
  ``handle.shutdown()``.
- ``ray_train``: ``ray.train.torch.TorchTrainer`` with ``ScalingConfig(num_workers=--workers,
  use_gpu=False)`` (Ray Train V2, the default of the installed Ray). Its train loop builds the
  same model with ``build_model("llama", "tiny")``, wraps it with ``ray.train.torch.prepare_model``
  (DDP over gloo), takes one AdamW step on the same synthetic batch as our step 1, and calls
  ``ray.train.report``. Time to first step is from the ``trainer.fit()`` call (the trainer is
  built before) to the wall-clock time at which rank 0 finished that step, as rank 0 recorded it.
  Ray Train V2 gives the driver nothing while ``fit()`` runs, and its ``Result.metrics`` stays
  empty when no checkpoint is reported, so rank 0 writes its timestamps to a file the driver
  reads after ``fit()`` returns (same machine, same clock).

The ratio ours/Ray Train is therefore conservative for ours: our time includes the trip of the
record to a polling client (the latency below, milliseconds), Ray Train's does not. Runs of the
two systems alternate, swapping which goes first every repeat, and each run starts once the
previous one has handed back its CPUs and a short settle pause has passed; the median over
repeats is reported. The first run of each system may also pay one-off costs (files not yet in
the page cache, anything a system sets up once per cluster), which the median over several
repeats mostly leaves out.

Where our time goes: the coordinator stamps its state changes with wall-clock times
(``QUEUED`` once constructed, ``STARTING`` once the placement group is ready, ``RUNNING`` once
the worker actors answered ``start``), and rank 0 appends each record to ``metrics.jsonl`` right
after handing it to the coordinator, which a driver thread watches (``os.stat`` every 1 ms). So
submit -> coordinator up -> placement group -> workers up -> trainer init (the trainer thread:
importing torch, gloo rendezvous, mesh, model on meta, ``fully_shard``, init) -> step 1 (its
``step_time_s``) -> record seen by the client. The phases are per run; the table shows each
phase's median, which need not add up to the median total.

Metric latency (ours): for every record, (time the poller first received it) minus (time the
file watcher first saw the same step in rank 0's ``metrics.jsonl``). The records carry no
wall-clock timestamp and the trainer is not changed for this benchmark, so the file line is the
end-of-step mark. What this includes: the worker -> coordinator call, the coordinator's
buffering, and the wait for the next poll (a client polling every 10 ms waits up to 10 ms plus
one poll round trip, whose median is reported next to it). Limits: the file is written a few
microseconds after the record is handed to Ray and seen at most ~1 ms later, so a single sample
can be up to ~1 ms low (even slightly negative); it needs the client on rank 0's machine, which
a local benchmark is. Differences of consecutive sightings minus ``step_time_s`` were not used:
they measure the change of latency from one record to the next (plus the gap between steps),
not the latency itself.

Everything started is stopped: each job ends with ``handle.shutdown()`` (and the benchmark
waits for its coordinator to be gone), and ``ray.shutdown()`` runs in a ``finally``. If Ray
Train cannot be imported (``pip install "ray[train]"``), only ours is measured and the ratio is
null.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

__all__ = ["add_parser", "measure_ours", "measure_ray_train", "run"]

SYSTEMS = ("ours", "ray_train")
MODEL = ("llama", "tiny")
SEQ_LEN = 32
GLOBAL_BATCH = 8
LR = 3e-3
DEFAULT_STEPS = 30
QUICK_STEPS = 8
DEFAULT_REPEATS = 3
QUICK_REPEATS = 1
POLL_S = 0.01  # the client's poll interval
WATCH_S = 0.001  # the metrics.jsonl watcher's interval
SETTLE_S = 1.0  # pause before each run, once the cluster's CPUs are free again

OURS_PHASES = (
    ("coordinator_up", "submit -> coordinator actor up (QUEUED)"),
    ("placement", "placement group ready (STARTING)"),
    ("workers_up", "worker actors started (RUNNING)"),
    ("trainer_init", "trainer init: torch import, rendezvous, model, FSDP"),
    ("first_step", "step 1 itself (its step_time_s)"),
    ("delivery", "record reaches the polling client"),
)
RAY_TRAIN_PHASES = (
    ("loop_start", "fit() -> train loop starts on rank 0"),
    ("model_ready", "imports, model built, prepare_model (DDP)"),
    ("first_step", "step 1 itself"),
)


class BenchError(RuntimeError):
    """A run did not produce its measurement."""


def job_data(name: str, workers: int, steps: int, root: Path) -> dict:
    """The job: tiny Llama on synthetic data, ``workers`` CPU workers, no checkpoints."""
    return {
        "name": name,
        "model": {"name": MODEL[0], "flavor": MODEL[1]},
        "data": {"kind": "synthetic", "seq_len": SEQ_LEN, "global_batch": GLOBAL_BATCH},
        "training": {"steps": steps},
        "optimizer": {"lr": LR},
        "lr_scheduler": {"decay": "constant"},
        "resources": {"workers": workers, "use_gpu": False},
        "checkpoint": {"dir": str(root / "checkpoints")},
        "metrics": {"dir": str(root / "metrics")},
    }


# ---- ours -----------------------------------------------------------------------------------


class _FileWatcher:
    """Notes when each step's line first appears in a ``metrics.jsonl`` (wall-clock time)."""

    def __init__(self, path: Path, interval_s: float = WATCH_S):
        self.path = path
        self.interval_s = interval_s
        self.first_seen: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="metrics-watcher", daemon=True)

    def _watch(self) -> None:
        offset, pending = 0, b""
        while not self._stop.is_set():
            with contextlib.suppress(FileNotFoundError):
                if os.stat(self.path).st_size > offset:
                    now = time.time()
                    with open(self.path, "rb") as f:
                        f.seek(offset)
                        chunk = f.read()
                    offset += len(chunk)
                    *lines, pending = (pending + chunk).split(b"\n")
                    for line in lines:
                        if line.strip():
                            self.first_seen.setdefault(json.loads(line)["step"], now)
            time.sleep(self.interval_s)

    def __enter__(self) -> _FileWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _wait_gone(job_id: str, timeout_s: float = 30.0) -> None:
    """Wait until the job's coordinator actor no longer exists (shutdown() ends it)."""
    import ray

    from hpservice.actors import NAMESPACE, coordinator_name

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get_actor(coordinator_name(job_id), namespace=NAMESPACE)
        except ValueError:
            return
        time.sleep(0.1)
    print(f"service: warning: coordinator of {job_id} still alive {timeout_s:.0f} s after shutdown()", file=sys.stderr)


def measure_ours(name: str, workers: int, steps: int, root: Path, timeout_s: float) -> dict:
    """Submit one job, poll it every ``POLL_S`` until it ends; times in seconds."""
    from hpservice.actors import start_job
    from hpservice.jobs import TERMINAL_STATES
    from hpservice.spec import parse_job

    spec = parse_job(job_data(name, workers, steps, root))
    seen: dict[int, float] = {}
    records: dict[int, dict] = {}
    rtts: list[float] = []
    last = 0

    def poll(handle) -> dict:
        nonlocal last
        sent = time.time()
        update = handle.poll(after=last)
        now = time.time()
        rtts.append(now - sent)
        for record in update["records"]:
            seen.setdefault(record["step"], now)
            records.setdefault(record["step"], record)
        last = update["cursor"]
        return update["status"]

    with _FileWatcher(root / "metrics" / name / "metrics.jsonl") as watcher:
        submitted = time.time()
        handle = start_job(spec, job_id=name)
        try:
            deadline = time.monotonic() + timeout_s
            while (status := poll(handle))["state"] not in TERMINAL_STATES:
                if time.monotonic() > deadline:
                    raise BenchError(f"job {name} still {status['state']} after {timeout_s:.0f} s")
                time.sleep(POLL_S)
            poll(handle)  # a record reported just before the end may arrive after the final state
            time.sleep(10 * WATCH_S)  # let the watcher see the last line
        finally:
            handle.shutdown()
            _wait_gone(handle.job_id)
    if status["state"] != "SUCCEEDED" or 1 not in seen:
        raise BenchError(f"job {name} ended {status['state']}: {status['message']}")

    state_time = {}
    for entry in status["history"]:
        state_time.setdefault(entry["state"], entry["time"])
    first_done = watcher.first_seen.get(1)
    phases = {
        "coordinator_up": state_time["QUEUED"] - submitted,
        "placement": state_time["STARTING"] - state_time["QUEUED"],
        "workers_up": state_time["RUNNING"] - state_time["STARTING"],
        "trainer_init": None if first_done is None else first_done - state_time["RUNNING"] - records[1]["step_time_s"],
        "first_step": records[1]["step_time_s"],
        "delivery": None if first_done is None else seen[1] - first_done,
    }
    latencies = [seen[s] - watcher.first_seen[s] for s in sorted(seen) if s in watcher.first_seen]
    return {
        "time_to_first_step_s": seen[1] - submitted,
        "first_step_done_s": None if first_done is None else first_done - submitted,
        "phases_s": phases,
        "latencies_s": latencies,
        "poll_rtt_s": statistics.median(rtts),
        "records": len(records),
    }


# ---- Ray Train ------------------------------------------------------------------------------


def _ray_train_loop(config: dict) -> None:
    """Ray Train's train loop: the same model and first step as our job's step 1, on every worker."""
    loop_start = time.time()
    import torch
    import torch.nn.functional as F
    from ray import train
    from ray.train.torch import prepare_model

    from hpservice.data import build_source
    from hpservice.models import build_model, model_config

    ctx = train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.manual_seed(0)
    model = prepare_model(build_model(*MODEL))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    source = build_source("synthetic", vocab_size=model_config(*MODEL).vocab_size, seed=0)
    model_ready = time.time()
    sample = source.batch(0, rank, world, GLOBAL_BATCH, SEQ_LEN)
    inputs, targets = sample.inputs, sample.labels
    logits = model(inputs)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()
    loss_value = loss.item()
    step_done = time.time()
    if rank == 0:
        stamps = {"loop_start": loop_start, "model_ready": model_ready, "step_done": step_done, "loss": loss_value}
        Path(config["stamps"]).write_text(json.dumps(stamps))
    train.report({"loss": loss_value, "step": 1})


def ray_train_missing() -> str | None:
    """None if Ray Train imports, else why not."""
    try:
        import ray.train.torch  # noqa: F401
    except ImportError as e:
        return f"{e}"
    return None


def measure_ray_train(name: str, workers: int, root: Path) -> dict:
    """One TorchTrainer.fit() doing one step; times in seconds from the fit() call."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    stamps_path = root / f"{name}.json"
    trainer = TorchTrainer(
        _ray_train_loop,
        train_loop_config={"stamps": str(stamps_path)},
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=False),
        run_config=RunConfig(name=name, storage_path=str(root / "ray_train")),
    )
    submitted = time.time()
    try:
        result = trainer.fit()
    except Exception as e:  # Ray Train raises its run's failure from fit()
        raise BenchError(f"Ray Train run {name} failed: {type(e).__name__}: {e}") from e
    fit_s = time.time() - submitted
    if result.error is not None:
        raise BenchError(f"Ray Train run {name} failed: {result.error}")
    if not stamps_path.exists():
        raise BenchError(f"Ray Train run {name} ended without rank 0's timestamps")
    stamps = json.loads(stamps_path.read_text())
    return {
        "time_to_first_step_s": stamps["step_done"] - submitted,
        "phases_s": {
            "loop_start": stamps["loop_start"] - submitted,
            "model_ready": stamps["model_ready"] - stamps["loop_start"],
            "first_step": stamps["step_done"] - stamps["model_ready"],
        },
        "fit_s": fit_s,
    }


def _ray_train_measured(name: str, workers: int, root: Path) -> dict:
    """``measure_ray_train``, once more under a new name when its run fails: on a loaded machine
    Ray Train's controller can lose its worker group before the first step (its placement group
    removed), which says nothing of the time to a first step; a second failure is the result."""
    try:
        return measure_ray_train(name, workers, root)
    except BenchError as e:
        print(f"service: {e}; measuring Ray Train again", flush=True)
        return measure_ray_train(f"{name}-again", workers, root)


# ---- driver ---------------------------------------------------------------------------------


def _settle(timeout_s: float = 60.0) -> None:
    """Wait until every CPU of the cluster is free again, then a short pause."""
    import ray

    total = ray.cluster_resources().get("CPU", 0)
    deadline = time.monotonic() + timeout_s
    while ray.available_resources().get("CPU", 0) < total and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(SETTLE_S)


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def summarize(runs: dict[str, list[dict]], ray_train_error: str | None) -> dict:
    """Medians over repeats; latency over every record of every run of ours."""
    ours = runs["ours"]
    latencies = [lat for r in ours for lat in r["latencies_s"]]
    ttfs = _median(r["time_to_first_step_s"] for r in ours)
    rt = runs["ray_train"]
    rt_ttfs = _median(r["time_to_first_step_s"] for r in rt) if rt and ray_train_error is None else None
    return {
        "time_to_first_step_s": ttfs,
        "ray_train_time_to_first_step_s": rt_ttfs,
        "ratio_vs_ray_train": ttfs / rt_ttfs if rt_ttfs else None,
        "metric_latency_s": _median(latencies),
        "metric_latency_p90_s": _quantile(latencies, 0.9),
        "metric_latency_max_s": max(latencies) if latencies else None,
        "metric_latency_samples": len(latencies),
        "poll_rtt_s": _median(r["poll_rtt_s"] for r in ours),
        "ours_first_step_done_s": _median(r["first_step_done_s"] for r in ours),
        "ours_phases_s": {k: _median(r["phases_s"][k] for r in ours) for k, _ in OURS_PHASES},
        "ray_train_phases_s": {k: _median(r["phases_s"][k] for r in rt) for k, _ in RAY_TRAIN_PHASES} if rt else None,
        "ray_train_fit_s": _median(r["fit_s"] for r in rt) if rt else None,
    }


def _fmt(value: float | None, scale: float = 1.0, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value * scale:.{digits}f}"


def format_table(runs: dict[str, list[dict]], s: dict, ray_train_error: str | None) -> str:
    what = {
        "ours": "submit -> record received by a client polling every 10 ms",
        "ray_train": "fit() -> step 1 done on rank 0 (its wall clock)",
    }
    header = f"{'system':<10} {'first step s':>12} {'min':>7} {'max':>7}  measured"
    lines = [header, "-" * (len(header) + 50)]
    for name in SYSTEMS:
        times = [r["time_to_first_step_s"] for r in runs[name]]
        if not times:
            lines.append(f"{name:<10} {'n/a':>12} {'':>7} {'':>7}  {ray_train_error or 'not run'}")
            continue
        lines.append(
            f"{name:<10} {statistics.median(times):>12.2f} {min(times):>7.2f} {max(times):>7.2f}  {what[name]}"
        )
    ratio = s["ratio_vs_ray_train"]
    lines.append(
        f"\nours/ray_train time to first step: {'n/a (Ray Train not measured)' if ratio is None else f'{ratio:.2f}x'}"
    )
    lines.append(
        f"metric latency (ours, step end -> polling client): median {_fmt(s['metric_latency_s'], 1e3, 1)} ms, "
        f"p90 {_fmt(s['metric_latency_p90_s'], 1e3, 1)} ms, max {_fmt(s['metric_latency_max_s'], 1e3, 1)} ms "
        f"over {s['metric_latency_samples']} records; poll round trip median {_fmt(s['poll_rtt_s'], 1e3, 1)} ms"
    )
    lines.append("\nwhere the time to first step goes (median of each phase over repeats, s):")
    lines.append("  ours")
    for key, label in OURS_PHASES:
        lines.append(f"    {label:<55} {_fmt(s['ours_phases_s'][key]):>7}")
    if s["ray_train_phases_s"] is not None:
        lines.append("  ray_train")
        for key, label in RAY_TRAIN_PHASES:
            lines.append(f"    {label:<55} {_fmt(s['ray_train_phases_s'][key]):>7}")
        lines.append(f"    {'(whole fit(), teardown included)':<55} {_fmt(s['ray_train_fit_s']):>7}")
    return "\n".join(lines)


def _raise_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)  # so the finally blocks stop what was started


def run(args: argparse.Namespace) -> int:
    """Print the table (and JSON); exit status 1 if a run failed."""
    if args.workers < 1 or (args.repeats is not None and args.repeats < 1):
        print("service: --workers and --repeats must be >= 1")
        return 2
    repeats = args.repeats if args.repeats is not None else QUICK_REPEATS if args.quick else DEFAULT_REPEATS
    steps = args.steps if args.steps is not None else QUICK_STEPS if args.quick else DEFAULT_STEPS
    if steps < 2:
        print("service: --steps must be >= 2")
        return 2
    ray_train_error = ray_train_missing()
    if ray_train_error is not None:
        print(
            f'service: Ray Train is not available ({ray_train_error}); install it with pip install "ray[train]". '
            "Measuring ours only; the ratio is null."
        )

    import ray

    from hpservice.actors import init_local_ray

    in_main = threading.current_thread() is threading.main_thread()  # signal handlers live there only
    previous = signal.signal(signal.SIGTERM, _raise_on_sigterm) if in_main else None
    runs: dict[str, list[dict]] = {name: [] for name in SYSTEMS}
    failed = None
    try:
        # A fresh cluster of our own (never one already running), like every local Ray of hpservice.
        init_local_ray(num_cpus=max(4, args.workers + 1), dashboard=False)
        with tempfile.TemporaryDirectory(prefix="hpservice-bench-service-") as tmp:
            root = Path(tmp)
            tag = f"{os.getpid()}"
            for i in range(repeats):
                order = SYSTEMS if i % 2 == 0 else SYSTEMS[::-1]
                for name in order:
                    if name == "ray_train" and ray_train_error is not None:
                        continue
                    _settle()
                    run_name = f"bench-service-{tag}-{name.replace('_', '-')}-{i}"
                    try:
                        if name == "ours":
                            runs[name].append(measure_ours(run_name, args.workers, steps, root, args.timeout))
                        else:
                            runs[name].append(_ray_train_measured(run_name, args.workers, root))
                    except BenchError as e:
                        failed = str(e)
                        if name == "ours":
                            raise
                        ray_train_error = failed
                        print(f"service: {failed}")
    except BenchError as e:
        print(f"service: {e}")
        return 1
    finally:
        ray.shutdown()
        if in_main:
            signal.signal(signal.SIGTERM, previous)

    s = summarize(runs, ray_train_error)
    print(
        f"service: time to first training step, hpservice jobs on Ray actors (ours) vs Ray Train TorchTrainer\n"
        f"job: {MODEL[0]} {MODEL[1]}, synthetic data, global batch {GLOBAL_BATCH} x {SEQ_LEN} tokens, "
        f"{args.workers} CPU workers; ours runs {steps} steps (for the latency), Ray Train 1\n"
        f"one local Ray ({max(4, args.workers + 1)} CPUs, {os.cpu_count()} cores); {repeats} repeat(s), "
        f"systems alternating; median over repeats\n"
    )
    print(format_table(runs, s, ray_train_error))
    if args.json:
        report = {
            "bench": "service",
            "workers": args.workers,
            "repeats": repeats,
            "steps": steps,
            "poll_interval_s": POLL_S,
            **s,
            "ray_train_error": ray_train_error,
            "runs": runs,
        }
        print(json.dumps(report))
    return 1 if failed else 0


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("service", help="time to first training step: hpservice jobs vs Ray Train")
    p.add_argument("--workers", type=int, default=2, help="training workers per job (default 2)")
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help=f"runs per system, interleaved (default {DEFAULT_REPEATS}, {QUICK_REPEATS} with --quick)",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"steps of our job, for the metric latency (default {DEFAULT_STEPS}, {QUICK_STEPS} with --quick)",
    )
    p.add_argument("--quick", action="store_true", help="one repeat, few steps (for tests)")
    p.add_argument("--json", action="store_true", help="also print one final line of JSON with all results")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before one of our jobs counts as hung")
    p.set_defaults(run=run)
