"""Overhead benchmark: the same job under ``torchrun -m hpservice.train`` and under ``hpservice run``.

What is measured: one job spec (a Llama on synthetic tokens, ``--workers`` CPU ranks, no
checkpoints, no eval) run to the end by each launcher, as separate processes, taking turns
(``--repeats`` each, alternating which goes first):

- ``torchrun``: ``python -m torch.distributed.run --nproc-per-node W -m hpservice.train job.yaml``:
  plain torch processes, the trainer writes its metrics to ``metrics.jsonl`` only.
- ``hpservice``: ``python -m hpservice run job.yaml``: a local Ray cluster, the coordinator actor,
  one worker actor per rank, the metrics pipe (worker -> coordinator -> the CLI's poll), the live
  progress display.

Steady-state step time is the median *step period*: the wall-clock time between the ends of
consecutive steps on rank 0 (each record's ``time``), over the steps after ``--warmup``. A
period includes everything a launcher adds between two steps (rank 0 handing its record to the
coordinator, the metrics file, the step consensus all-reduce), which ``step_time_s`` alone (the
trainer's own timer) would leave out. Both launchers give each rank one CPU thread (torchrun sets
``OMP_NUM_THREADS=1``, Ray sets it to the actor's ``num_cpus``, 1 here).

Time to first step is reported for both too (process start to rank 0's first record; for
``hpservice`` that includes starting Ray), but the ratio the issue tracks is the steady one:
``step_time_ratio_vs_torchrun`` = hpservice / torchrun. Time to first step against Ray Train's
``TorchTrainer`` is ``bench service``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from hpservice.launch import free_port

SYSTEMS = ("torchrun", "hpservice")


def job_spec(flavor: str, workers: int, steps: int, seq_len: int, batch: int, gpu: bool = False) -> dict:
    return {
        "name": "overhead",
        "model": {"name": "llama", "flavor": flavor},
        "data": {"kind": "synthetic", "seq_len": seq_len, "global_batch": batch},
        "training": {"steps": steps},
        "resources": {"workers": workers, "use_gpu": gpu},
        "parallelism": {"mixed_precision": "bf16" if gpu else "none"},
        "metrics": {"log_every": 10_000},
    }


def _records(metrics_dir: Path) -> list[dict]:
    (path,) = metrics_dir.glob("*/metrics.jsonl")  # <metrics.dir>/<run_id>/metrics.jsonl
    return [json.loads(line) for line in path.read_text().splitlines()]


def run_once(system: str, job: Path, workers: int, out: Path, timeout: float) -> dict:
    """Run the job under ``system``; its per-step records and wall-clock start."""
    out.mkdir(parents=True)
    overrides = ["--set", f"metrics.dir={out}"]
    if system == "torchrun":
        cmd = [
            sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={workers}",
            "--master-addr=127.0.0.1", f"--master-port={free_port()}",
            "-m", "hpservice.train", str(job), *overrides,
        ]  # fmt: skip
    else:
        cmd = [sys.executable, "-m", "hpservice", "run", str(job), *overrides]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    start = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{system} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return {"start": start, "records": _records(out)}


def periods(records: list[dict], warmup: int) -> list[float]:
    times = [r["time"] for r in records]
    return [b - a for a, b in itertools.pairwise(times)][warmup:]


def run(
    flavor: str, workers: int, steps: int, warmup: int, repeats: int, seq_len: int, batch: int, gpu: bool = False
) -> dict:
    runs: dict[str, list[dict]] = {s: [] for s in SYSTEMS}
    with tempfile.TemporaryDirectory(prefix="hpservice-bench-overhead-") as tmp:
        job = Path(tmp) / "job.yaml"
        job.write_text(yaml.safe_dump(job_spec(flavor, workers, steps, seq_len, batch, gpu)))
        for i in range(repeats):
            order = SYSTEMS if i % 2 == 0 else SYSTEMS[::-1]
            for system in order:
                runs[system].append(run_once(system, job, workers, Path(tmp) / f"{system}-{i}", timeout=900))
    out: dict = {"flavor": flavor, "device": "cuda" if gpu else "cpu", "workers": workers, "steps": steps, "warmup": warmup, "repeats": repeats}
    for system in SYSTEMS:
        all_periods = [p for r in runs[system] for p in periods(r["records"], warmup)]
        out[f"{system}_step_ms"] = statistics.median(all_periods) * 1e3
        out[f"{system}_step_ms_runs"] = [statistics.median(periods(r["records"], warmup)) * 1e3 for r in runs[system]]
        out[f"{system}_first_step_s"] = statistics.median(r["records"][0]["time"] - r["start"] for r in runs[system])
        out[f"{system}_tokens_per_s"] = seq_len * batch / statistics.median(all_periods)
    out["step_time_ratio_vs_torchrun"] = out["hpservice_step_ms"] / out["torchrun_step_ms"]
    out["first_step_ratio_vs_torchrun"] = out["hpservice_first_step_s"] / out["torchrun_first_step_s"]
    return out


def _main(args: argparse.Namespace) -> int:
    r = run(args.flavor, args.workers, args.steps, args.warmup, args.repeats, args.seq_len, args.batch, args.gpu)
    print(
        f"overhead: llama {r['flavor']}, {r['workers']} {'GPU (bf16)' if args.gpu else 'CPU'} ranks, batch {args.batch} x {args.seq_len} tokens, "
        f"{r['steps']} steps ({r['warmup']} warm-up), {r['repeats']} runs each, alternating"
    )
    print(f"{'':12}{'step ms':>10}{'per run':>22}{'tokens/s':>12}{'first step s':>14}")
    for system in SYSTEMS:
        per_run = ", ".join(f"{v:.1f}" for v in r[f"{system}_step_ms_runs"])
        print(
            f"{system:12}{r[f'{system}_step_ms']:>10.2f}{per_run:>22}{r[f'{system}_tokens_per_s']:>12,.0f}"
            f"{r[f'{system}_first_step_s']:>14.1f}"
        )
    print(
        f"hpservice run / torchrun: steady step time {r['step_time_ratio_vs_torchrun']:.3f}x (goal <= 1.02), "
        f"time to first step {r['first_step_ratio_vs_torchrun']:.2f}x"
    )
    if args.json:
        print(json.dumps(r))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("overhead", help="steady step time: hpservice run (Ray actors) vs torchrun, same job spec")
    p.add_argument("--flavor", default="small", help="llama flavor (default small)")
    p.add_argument("--workers", type=int, default=2, help="CPU ranks (default 2)")
    p.add_argument("--steps", type=int, default=40, help="steps per run (default 40)")
    p.add_argument("--warmup", type=int, default=5, help="step periods left out at the start (default 5)")
    p.add_argument("--repeats", type=int, default=2, help="runs of each launcher, alternating (default 2)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="global batch (default 8)")
    p.add_argument("--gpu", action="store_true", help="one GPU per rank, bf16 (resources.use_gpu: true)")
    p.add_argument("--json", action="store_true", help="also print one final line of JSON with the results")
    p.set_defaults(run=_main)
