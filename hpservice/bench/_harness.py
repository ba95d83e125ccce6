"""What the training-step benchmarks (``fsdp``, ``tp``) share: how configs are trained, timed and
counted on the ranks, and how the per-rank results become one table.

- ``ConfigTrainer``: one configuration (a wrapped copy of the model, AdamW ``LR``) and what was measured.
  ``timed_step`` times one whole step (``zero_grad``, forward, loss, backward, ``step``) after a
  barrier; ``count_step`` runs one step counting the collectives it issues. Benches subclass it
  for how a config computes its loss (``forward_backward``) and counts collectives (``counter``).
- ``train`` / ``train_all``: the configs take turns one step at a time, rotating which goes
  first, ``warmup`` untimed then ``steps`` timed steps each, then one step of each ``after``
  method (counting collectives, sampling RSS); ``train_all`` trains the distributed configs on
  every rank, then the single-process reference alone on rank 0. ``start_rank``: one torch
  thread and seed 0 in a rank process.
- ``tracked_bytes``: parameters + gradients + optimizer state a rank holds (local tensors of
  DTensors, ours or torch's). ``count_patched`` / ``count_profiled``: collectives counted by
  patching functions of a module, or as backend events (``gloo:*``) of ``torch.profiler``.
- ``combine``: one row per config from every rank's results: the slowest rank's median step, the
  largest rank's memory, the collectives per step (None if the ranks disagree), the mean final
  loss, and its distance to the single-process reference. ``summary``: the JSON report around it.
- ``format_table``: the rows as a text table, driven by a list of ``Column``.
- ``add_step_options`` / ``steps_and_warmup``: the ``--steps`` ... ``--timeout`` options.
- ``MLP``: the residual MLP both benches train.
- ``rss_bytes`` / ``max_rss_bytes`` / ``malloc_trim`` / ``RssSampler``: resident memory now, at
  its peak, after handing freed heap back, and sampled on a thread while a step runs.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import ctypes
import math
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from hpservice.train._utilisation import rss_bytes  # the benches' memory readings too

REFERENCE = "single"
LR = 1e-3
DEFAULT_STEPS = 20
DEFAULT_WARMUP = 3
QUICK_STEPS = 3
QUICK_WARMUP = 1
MIB = 2**20

Batch = tuple[torch.Tensor, torch.Tensor]
Counter = Callable[[], contextlib.AbstractContextManager[dict[str, int]]]


# ---- model -----------------------------------------------------------------------------------


class MLPBlock(nn.Module):
    """Pre-norm residual MLP: ``x + fc2(gelu(fc1(norm(x))))``."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class MLP(nn.Module):
    def __init__(self, dim: int, depth: int):
        super().__init__()
        self.blocks = nn.ModuleList(MLPBlock(dim) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


# ---- training --------------------------------------------------------------------------------


class ConfigTrainer:
    """One configuration: its model (``wrap`` of a copy of ``base``), AdamW, and what was measured."""

    def __init__(self, name: str, spec: Any, base: nn.Module, wrap: Callable[[nn.Module], nn.Module]):
        self.name = name
        self.spec = spec
        self.model = wrap(copy.deepcopy(base))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR, weight_decay=0.01)
        self.times_s: list[float] = []
        self.loss = math.nan
        self.collectives: int | None = None
        self.collective_kinds: dict[str, int] = {}

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward, loss and backward; returns the loss."""
        raise NotImplementedError

    def counter(self) -> Counter | None:
        """What counts this config's collectives; None: nothing to count (the single process)."""
        return None if self.name == REFERENCE else count_profiled

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.opt.zero_grad()
        loss = self.forward_backward(x, y)
        self.opt.step()
        return loss

    def _record(self, loss: torch.Tensor) -> None:
        loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss  # torch's loss_parallel: a DTensor
        self.loss = loss.item()

    def timed_step(self, x: torch.Tensor, y: torch.Tensor, barrier: bool) -> float:
        if barrier:
            dist.barrier()
        start = time.perf_counter()
        loss = self.step(x, y)
        elapsed = time.perf_counter() - start
        self._record(loss)
        return elapsed

    def count_step(self, x: torch.Tensor, y: torch.Tensor, barrier: bool) -> None:
        counter = self.counter()
        if counter is None:
            self.collectives = 0
            self._record(self.step(x, y))
            return
        if barrier:
            dist.barrier()
        with counter() as counts:
            self._record(self.step(x, y))
        self.collectives = sum(counts.values())
        self.collective_kinds = {k: v for k, v in counts.items() if v}

    def result(self) -> dict:
        return {
            "step_ms": statistics.median(self.times_s) * 1e3,
            "tracked_bytes": tracked_bytes(self.model, self.opt),
            "collectives_per_step": self.collectives,
            "collective_kinds": self.collective_kinds,
            "final_loss": self.loss,
        }


def train(
    trainers: Sequence[ConfigTrainer],
    batch: Callable[[int], Batch],
    steps: int,
    warmup: int,
    barrier: bool,
    after: Sequence[str] = ("count_step",),
) -> None:
    """``warmup`` untimed, then ``steps`` timed steps per trainer (their times in ``times_s``), then
    one step of each trainer method named in ``after``, ``(x, y, barrier)``; all are steps of the
    same trajectory. The trainers take turns one step at a time, rotating which goes first."""
    for step in range(warmup + steps + len(after)):
        x, y = batch(step)
        shift = step % len(trainers)
        for t in [*trainers[shift:], *trainers[:shift]]:
            if step >= warmup + steps:
                getattr(t, after[step - warmup - steps])(x, y, barrier)
            else:
                elapsed = t.timed_step(x, y, barrier)
                if step >= warmup:
                    t.times_s.append(elapsed)


def start_rank() -> tuple[int, int]:
    """Set up a rank process (one torch thread; seed 0, so the model made next is the same on
    every rank and in every config); returns its rank and the world size."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    return dist.get_rank(), dist.get_world_size()


def train_all(
    new_trainer: Callable[[str], ConfigTrainer],
    configs: Sequence[str],
    batch: Callable[[int], Batch],
    reference_batch: Callable[[int], Batch],
    steps: int,
    warmup: int,
    after: Sequence[str] = ("count_step",),
) -> dict[str, dict]:
    """Run on every rank: train the distributed ``configs`` interleaved (every step behind a
    barrier); rank 0 then trains the single-process reference on ``reference_batch``. Returns
    this rank's ``ConfigTrainer.result`` per config."""
    trainers = [new_trainer(name) for name in configs]
    train(trainers, batch, steps, warmup, barrier=True, after=after)
    results = {t.name: t.result() for t in trainers}
    if dist.get_rank() == 0:  # alone, last: no collective is left that the other ranks wait in
        del trainers
        single = new_trainer(REFERENCE)
        train([single], reference_batch, steps, warmup, barrier=False, after=after)
        results[REFERENCE] = single.result()
    return results


# ---- tracked memory and collectives ----------------------------------------------------------


def _local_nbytes(t: torch.Tensor) -> int:
    """Bytes of what this rank holds of ``t``: the local tensor of a DTensor (ours or torch's)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def tracked_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """Parameters + gradients + optimizer state held by this rank (local tensors)."""
    total = 0
    for p in model.parameters():
        total += _local_nbytes(p)
        if p.grad is not None:
            total += _local_nbytes(p.grad)
    for state in opt.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                total += _local_nbytes(value)
    return total


@contextlib.contextmanager
def count_patched(module, names: Sequence[str]) -> Iterator[dict[str, int]]:
    """Count calls of ``module.<name>`` for each name the module has, while inside."""
    counts = {name: 0 for name in names if hasattr(module, name)}
    originals = {name: getattr(module, name) for name in counts}

    def counting(name: str, fn: Callable) -> Callable:
        def wrapped(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)

        return wrapped

    for name, fn in originals.items():
        setattr(module, name, counting(name, fn))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(module, name, fn)


@contextlib.contextmanager
def _silenced_stderr() -> Iterator[None]:
    """The profiler's C++ side prints start/stop lines on fd 2; keep them out of the report."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


@contextlib.contextmanager
def count_profiled() -> Iterator[dict[str, int]]:
    """Backend collectives (``gloo:all_reduce`` ...) recorded by torch.profiler while inside; the
    counts come in name order."""
    counts: dict[str, int] = {}
    with _silenced_stderr():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            yield counts
        events = prof.events()
    found: dict[str, int] = {}
    for event in events:
        if event.name.startswith(("gloo:", "nccl:")):
            found[event.name] = found.get(event.name, 0) + 1
    counts.update(sorted(found.items()))


# ---- report ----------------------------------------------------------------------------------


def combine(
    per_rank: Sequence[dict], configs: Sequence[str], memory: Sequence[str] = ("tracked",), loss_spread: bool = False
) -> dict[str, dict]:
    """One row per config (and the reference): slowest rank's median, largest rank's memory (each
    ``<m>_bytes`` of ``memory`` as ``<m>_mib``), mean final loss (with ``loss_spread``, also its
    spread over the ranks), and the final loss's distance to the reference's."""
    rows: dict[str, dict] = {}
    for name in (*configs, REFERENCE):
        got = [r["results"][name] for r in per_rank if name in r["results"]]
        counts = {g["collectives_per_step"] for g in got}
        losses = [g["final_loss"] for g in got]
        row = {"step_ms": max(g["step_ms"] for g in got)}
        row.update({f"{m}_mib": max(g[f"{m}_bytes"] for g in got) / MIB for m in memory})
        row["collectives_per_step"] = counts.pop() if len(counts) == 1 else None  # None: ranks disagree
        row["collective_kinds"] = got[0]["collective_kinds"]
        row["final_loss"] = statistics.fmean(losses)
        if loss_spread:
            row["final_loss_spread_over_ranks"] = max(losses) - min(losses)
        rows[name] = row
    ref = rows[REFERENCE]["final_loss"]
    for row in rows.values():
        row["loss_diff_vs_single"] = abs(row["final_loss"] - ref)
    return rows


def summary(
    bench: str, rows: dict[str, dict], spec: Any, world: int, steps: int, warmup: int, ratios: dict, **extra
) -> dict:
    """The JSON report: the run, the ``ratios``, the largest distance of a config's final loss to
    the reference's, ``extra``, and the rows."""
    return {
        "bench": bench,
        "model": spec.kind,
        "model_spec": asdict(spec),
        "world_size": world,
        "steps": steps,
        "warmup": warmup,
        **ratios,
        "max_loss_diff_vs_single": max(row["loss_diff_vs_single"] for name, row in rows.items() if name != REFERENCE),
        **extra,
        "configs": rows,
    }


@dataclass(frozen=True)
class Column:
    """A table column: ``row[key]`` formatted with ``spec``, right-aligned in ``width``; "n/a" for None."""

    title: str
    width: int
    key: str
    spec: str = ""

    def cell(self, row: dict) -> str:
        value = row[self.key]
        return "n/a" if value is None else format(value, self.spec)


STEP_MS = Column("step ms", 9, "step_ms", ".2f")
TRACKED = Column("tracked MiB/rank", 17, "tracked_mib", ".2f")
COLLECTIVES = Column("coll/step", 10, "collectives_per_step")
FINAL_LOSS = Column("final loss", 12, "final_loss", ".6f")
LOSS_DIFF = Column("|loss - single|", 16, "loss_diff_vs_single", ".2e")


def format_table(rows: dict[str, dict], columns: Sequence[Column], footnote: str) -> str:
    """One line per config (the reference marked ``*``, explained by ``footnote``)."""
    header = " ".join([f"{'config':<8}", *(f"{c.title:>{c.width}}" for c in columns)])
    lines = [header, "-" * len(header)]
    for name, row in rows.items():
        label = name + ("*" if name == REFERENCE else "")
        lines.append(" ".join([f"{label:<8}", *(f"{c.cell(row):>{c.width}}" for c in columns)]))
    lines.append(f"* {footnote}")
    return "\n".join(lines)


# ---- command line ----------------------------------------------------------------------------


def add_step_options(p: argparse.ArgumentParser, loss_tol: float) -> None:
    """``--steps``, ``--warmup``, ``--quick``, ``--json``, ``--loss-tol`` (default ``loss_tol``), ``--timeout``."""
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"timed steps per config (default {DEFAULT_STEPS}, {QUICK_STEPS} with --quick)",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help=f"untimed steps per config before the timed ones (default {DEFAULT_WARMUP}, {QUICK_WARMUP} with --quick)",
    )
    p.add_argument("--quick", action="store_true", help="tiny model and few steps (for tests)")
    p.add_argument("--json", action="store_true", help="also print one final line of JSON with all results")
    p.add_argument(
        "--loss-tol",
        type=float,
        default=loss_tol,
        help="exit with status 1 if a config's final loss is further than this from the single process",
    )
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before the ranks are killed")


def steps_and_warmup(args: argparse.Namespace, bench: str) -> tuple[int, int] | None:
    """``--steps`` and ``--warmup`` or their defaults (quick or not); None (said why) if out of range."""
    steps = args.steps if args.steps is not None else QUICK_STEPS if args.quick else DEFAULT_STEPS
    warmup = args.warmup if args.warmup is not None else QUICK_WARMUP if args.quick else DEFAULT_WARMUP
    if steps < 1 or warmup < 0:
        print(f"{bench}: --steps must be >= 1 and --warmup >= 0")
        return None
    return steps, warmup


# ---- memory ----------------------------------------------------------------------------------



def malloc_trim() -> None:
    """Hand freed heap memory back to the OS (glibc), so RSS before a step is the live memory."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class RssSampler:
    """Polls the RSS on a thread while inside; ``peak`` is the largest value seen. torch ops
    release the GIL while they run, so the thread samples during forward and backward too."""

    def __init__(self, interval_s: float = 2e-4):
        self.interval_s = interval_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(self.interval_s)

    def __enter__(self) -> RssSampler:
        self.peak = rss_bytes()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())
