"""Where each step's record goes: rank 0's callback (``on_metrics``), its sinks (metrics.jsonl,
TensorBoard, MLflow, W&B) and its progress line; other ranks' own line (step time, memory)."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path

from hpservice.metrics import progress_line
from hpservice.spec import JobSpec

from ._metrics import MetricSink, build_sinks

__all__ = ["Reporter"]


class Reporter:
    """``on_metrics(record)`` runs on rank 0 after each step; ``log_fn(line)`` receives progress
    lines (default: print, unless ``log_to_stdout`` is False)."""

    def __init__(
        self,
        spec: JobSpec,
        rank: int,
        run_dir: Path,
        *,
        on_metrics: Callable[[dict], None] | None,
        log_fn: Callable[[str], None] | None,
        log_to_stdout: bool,
    ):
        self.spec, self.rank, self.output_dir, self.on_metrics = spec, rank, run_dir, on_metrics
        self._sinks: list[MetricSink] = []
        self._log = log_fn if log_fn is not None else (functools.partial(print, flush=True) if log_to_stdout else None)
        self._log_fn = log_fn

    def open_sinks(self) -> None:
        """Rank 0's destinations besides ``on_metrics`` (metrics.jsonl first), after a resume
        reported the steps before it."""
        if self.rank == 0:
            self._sinks = build_sinks(self.spec, self.output_dir)

    def line(self, text: str) -> None:
        """A progress line of rank 0's."""
        if self._log is not None and self.rank == 0:
            self._log(text)

    def report_earlier_steps(self, reported_up_to: int, step: int) -> None:
        """``on_metrics`` for each step in (``reported_up_to``, the resume step] that this run's
        ``metrics.jsonl`` holds (the first record of a step: a re-trained step's is the same)."""
        path = self.output_dir / "metrics.jsonl"
        if self.rank != 0 or self.on_metrics is None or step <= reported_up_to or not path.is_file():
            return
        earlier: dict[int, dict] = {}
        with open(path) as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:  # a line cut short by a killed process
                    continue
                s = record.get("step") if isinstance(record, dict) else None
                if isinstance(s, int) and reported_up_to < s <= step:
                    earlier.setdefault(s, record)
        for s in sorted(earlier):
            self.on_metrics(earlier[s])

    def report(self, record: dict) -> None:
        if self.rank != 0:
            self._report_own(record)
            return
        if self.on_metrics is not None:
            self.on_metrics(record)
        for sink in self._sinks:
            sink.log(record)
        every = self.spec.metrics.log_every
        if self._log is not None and (record["step"] % every == 0 or record["step"] == self.spec.training.steps):
            self._log(f"[{self.spec.name}] step {record['step']:>5}/{self.spec.training.steps}  {progress_line(record)}")

    def _report_own(self, record: dict) -> None:
        """Ranks other than 0: a line of their own (step time, memory) every ``log_every`` steps,
        where lines are kept per rank (``log_fn``: the service's ``logs --rank N``); never to
        stdout, where torchrun would print it once per rank."""
        every = self.spec.metrics.log_every
        if self._log_fn is None or not (record["step"] % every == 0 or record["step"] == self.spec.training.steps):
            return
        memory = record.get("peak_memory_allocated_gib", record["peak_rss_gib"])
        self._log_fn(
            f"[{self.spec.name}] rank {self.rank} step {record['step']:>5}/{self.spec.training.steps}  "
            f"{record['step_time_s'] * 1000:.0f} ms/step  peak memory {memory:.2f} GiB"
        )

    def close(self) -> None:
        sinks, self._sinks = self._sinks, []
        for sink in sinks:
            sink.close()
