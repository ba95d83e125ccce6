"""A Weights & Biases run next to ``metrics.jsonl``: the job spec as config, every step's metrics.

Offline by default (``mode: offline``): the run is written under the run's own directory
(``<metrics.dir>/<run_id>/wandb``) and nothing leaves the machine; ``wandb sync`` uploads it
later. ``mode: online`` logs live (the service refuses it). Rank 0 only.
"""

from __future__ import annotations

from pathlib import Path

from hpservice.metrics import scalars
from hpservice.spec import JobSpec

from ._errors import TrainingError


class WandbSink:
    def __init__(self, spec: JobSpec, run_dir: Path):
        try:
            import wandb
        except ImportError as e:
            raise TrainingError("metrics.wandb needs the wandb package (pip install wandb)") from e
        cfg = spec.metrics.wandb
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=cfg.project or spec.name,
            name=spec.run_id,
            id=spec.run_id,  # restarts of one job resume one W&B run
            resume="allow",
            dir=str(run_dir),
            mode=cfg.mode,
            config=spec.model_dump(mode="json", by_alias=True),
            settings=wandb.Settings(silent=True, console="off"),
        )

    def log(self, record: dict) -> None:
        self.run.log(dict(scalars(record, "wandb")), step=record["step"])

    def close(self) -> None:
        self.run.finish()
