"""Where rank 0's step records go besides the caller's callback: a list of sinks.

Every sink takes each step's record (``log``) and is closed once at the end (``close``). The
trainer builds the list once from ``metrics:`` and never asks which sinks it holds, so a new
destination is one class here and one line in ``build_sinks``. Which metrics each carries is
declared in ``hpservice.metrics.METRICS``, not here.

- ``metrics.jsonl`` in the run's directory: always (the service, ``hpservice status`` and
  resumption read it);
- TensorBoard (``metrics.tensorboard: true``), MLflow (``metrics.mlflow``), Weights & Biases
  (``metrics.wandb``): each only when asked for, and its package imported only then.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

from hpservice.metrics import scalars
from hpservice.spec import JobSpec

from ._errors import TrainingError

__all__ = ["JsonlSink", "MetricSink", "TensorBoardSink", "build_sinks"]


class MetricSink(Protocol):
    def log(self, record: dict) -> None:
        """One step's record (``step`` and the metrics; keys a sink does not know are ignored)."""

    def close(self) -> None:
        """Flush and release; called once, after the last ``log``."""


class JsonlSink:
    """``<run dir>/metrics.jsonl``: one JSON line per record, flushed per line (appended on resume)."""

    def __init__(self, run_dir: Path):
        run_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(run_dir / "metrics.jsonl", "a")  # noqa: SIM115 - closed in close()

    def log(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardSink:
    """Event files under ``<run dir>/tensorboard``."""

    def __init__(self, run_dir: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise TrainingError(
                "metrics.tensorboard: true needs the tensorboard package (pip install tensorboard)"
            ) from e
        self._writer = SummaryWriter(str(run_dir / "tensorboard"))

    def log(self, record: dict) -> None:
        for name, value in scalars(record, "tensorboard"):
            self._writer.add_scalar(name, value, record["step"])

    def close(self) -> None:
        self._writer.close()


def build_sinks(spec: JobSpec, run_dir: Path) -> list[MetricSink]:
    """Rank 0's sinks for ``spec.metrics``, in the order records reach them."""
    sinks: list[MetricSink] = [JsonlSink(run_dir)]
    if spec.metrics.tensorboard:
        sinks.append(TensorBoardSink(run_dir))
    if spec.metrics.mlflow is not None:
        from ._mlflow import MLflowSink

        sinks.append(MLflowSink(spec, run_dir))
    if spec.metrics.wandb is not None:
        from ._wandb import WandbSink

        sinks.append(WandbSink(spec, run_dir))
    return sinks
