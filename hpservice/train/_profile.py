"""A torch profiler trace of a few training steps (``metrics.profile``), one file per rank.

Steps ``start_step`` .. ``start_step + steps - 1`` run under ``torch.profiler.profile``, each as a
``record_function("train_step#N")`` range, so the trace shows the steps with fully_shard's phases
(``FSDP::all_gather``, ``FSDP::reduce_scatter``, ...) inside them. At the end the trace is
written as Chrome/Perfetto JSON (open it in https://ui.perfetto.dev or chrome://tracing) to
``<artifacts dir>/rank<R>-steps<A>-<B>.trace.json``; on CUDA with ``memory: true`` the
allocator's history over the same steps goes to ``rank<R>-steps<A>-<B>.memory.pickle``
(https://pytorch.org/memory_viz).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from hpservice.spec import ProfileSpec


class StepProfiler:
    def __init__(self, spec: ProfileSpec, out_dir: str | Path, rank: int, device: torch.device):
        self.spec = spec
        self.out_dir = Path(out_dir)
        self.rank = rank
        self.device = device
        self.last_step = spec.start_step + spec.steps - 1
        self._prof: profile | None = None
        self.written: list[Path] = []
        self.reported = False  # the trainer has said where the files are

    def _stem(self) -> str:
        return f"rank{self.rank}-steps{self.spec.start_step}-{self.last_step}"

    def step(self, step: int) -> contextlib.AbstractContextManager:
        """Context for training step ``step`` (1-based): profiled if it is in the range."""
        if not self.spec.start_step <= step <= self.last_step:
            return contextlib.nullcontext()
        if self._prof is None:
            self._start()
        return _StepRange(self, step)

    def _start(self) -> None:
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
            if self.spec.memory:
                torch.cuda.memory._record_memory_history(max_entries=100_000)
        self._prof = profile(activities=activities, record_shapes=True)
        self._prof.__enter__()

    def _stepped(self, step: int) -> None:
        if step == self.last_step:
            self.finish()

    def finish(self) -> list[Path]:
        """Stop and write the files (also when the run ends inside the range)."""
        if self._prof is None:
            return self.written
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        trace = self.out_dir / f"{self._stem()}.trace.json"
        prof.export_chrome_trace(str(trace))
        self.written.append(trace)
        if self.device.type == "cuda" and self.spec.memory:
            snapshot = self.out_dir / f"{self._stem()}.memory.pickle"
            torch.cuda.memory._dump_snapshot(str(snapshot))
            torch.cuda.memory._record_memory_history(enabled=None)
            self.written.append(snapshot)
        return self.written


class _StepRange(contextlib.AbstractContextManager):
    def __init__(self, profiler: StepProfiler, step: int):
        self.profiler, self.step = profiler, step
        self._range = record_function(f"train_step#{step}")

    def __enter__(self):
        self._range.__enter__()
        return self

    def __exit__(self, *exc):
        self._range.__exit__(*exc)
        if exc[0] is None:
            self.profiler._stepped(self.step)
        return False
