"""An MLflow run next to ``metrics.jsonl``: the job's parameters once, every step's metrics.

By default the run goes to a local file store in the run's own directory
(``<metrics.dir>/<run_id>/mlruns``; MLflow 3 keeps the file store behind
``MLFLOW_ALLOW_FILE_STORE``, which this sets for that default only). ``metrics.mlflow.tracking_uri``
names a tracking server or database instead. Rank 0 only.
"""

from __future__ import annotations

import os
from pathlib import Path

from hpservice.metrics import scalars
from hpservice.spec import JobSpec

from ._errors import TrainingError


def _flat(data: dict, prefix: str = "") -> dict[str, str]:
    out = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flat(value, f"{name}."))
        else:
            out[name] = str(value)[:500]  # MLflow's limit on a parameter value
    return out


class MLflowSink:
    def __init__(self, spec: JobSpec, run_dir: Path):
        try:
            import mlflow
        except ImportError as e:
            raise TrainingError("metrics.mlflow needs the mlflow package (pip install mlflow-skinny)") from e
        cfg = spec.metrics.mlflow
        uri = cfg.tracking_uri
        if uri is None:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (run_dir / "mlruns").resolve().as_uri()
        self.client = mlflow.tracking.MlflowClient(uri)
        experiment = cfg.experiment or spec.name
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
        self.run_id = self.client.create_run(experiment_id, run_name=spec.run_id).info.run_id
        self.uri = uri
        params = _flat(spec.model_dump(mode="json", by_alias=True))
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in sorted(params.items())]
        for i in range(0, len(items), 100):  # MLflow takes at most 100 parameters per call
            self.client.log_batch(self.run_id, params=items[i : i + 100])

    def log(self, record: dict) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(name, value, now, record["step"]) for name, value in scalars(record, "mlflow")]
        for i in range(0, len(metrics), 1000):  # MLflow takes at most 1000 metrics per call (expert loads)
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def close(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status=status)
