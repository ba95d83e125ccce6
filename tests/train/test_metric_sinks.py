"""Every metric in every sink it is declared for (``hpservice.metrics.METRICS``), read back.

One run of a tiny mixture-of-experts model (so the MoE metrics exist: an aux loss, a capacity
factor that drops pairs, routing biases) with validation, writing metrics.jsonl, TensorBoard,
MLflow and W&B (offline); the Prometheus gauges and the progress line from its records. Each
sink is read back from what it wrote, not from what was sent to it.
"""

import json
import time

import pytest

from hpservice.actors.gauges import JobGauges
from hpservice.metrics import METRICS, SINKS, progress_line, scalars, step_record
from hpservice.preflight import plan_memory

from .._jobs import tiny_llama_job
from .._jobs import train as _run

CUDA_ONLY = {m.name for m in METRICS if m.when == "CUDA"}
CHAT_ONLY = {m.name for m in METRICS if "chat" in m.when}  # tests/train/test_chat_training.py reports them
DPO_ONLY = {m.name for m in METRICS if m.when == "DPO"}  # tests/train/test_dpo.py reports and checks them


@pytest.fixture(scope="module")
def moe_run(ranks, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sinks")
    spec = tiny_llama_job(
        tmp,
        "sinks",
        model={
            "name": "qwen3_moe",
            "flavor": "tiny",
            "overrides": {"aux_loss_coef": 0.01, "bias_update_rate": 0.001, "capacity_factor": 1.0},
        },
        training={"steps": 3},
        eval={"data": {"kind": "synthetic", "seq_len": 32, "global_batch": 8, "seed": 7}, "interval": 2, "steps": 1},
        metrics={"tensorboard": True, "mlflow": {"experiment": "sinks"}, "wandb": {"project": "sinks"}},
    )
    spec = plan_memory(spec, device_memory=None, device="cpu")  # as run / submit plan it: its estimate is reported
    history = ranks(1).run(_run, spec)[0]
    (run_dir,) = tmp.glob("sinks-*/")
    return history, run_dir


def test_the_run_reports_every_metric_but_the_cuda_ones(moe_run):
    history, _ = moe_run
    reported = {k for r in history for k in r} - {"step", "time"}
    assert reported == {m.name for m in METRICS} - CUDA_ONLY - CHAT_ONLY - DPO_ONLY


def test_metrics_jsonl_and_the_stream_carry_every_record_whole(moe_run):
    history, run_dir = moe_run
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert lines == json.loads(json.dumps(history))  # the same records the API streams (on_metrics)


def _expected(history, sink):
    return {name for r in history for name, _ in scalars(r, sink)}


def test_tensorboard_has_every_scalar(moe_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    history, run_dir = moe_run
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert tags == _expected(history, "tensorboard")
    assert any(t.startswith("expert_load/") for t in tags) and "val_loss" in tags and "mfu" in tags
    assert [e.value for e in events.Scalars("loss")] == pytest.approx([r["loss"] for r in history])


def test_mlflow_has_every_scalar(moe_run, monkeypatch):
    import mlflow

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    history, run_dir = moe_run
    client = mlflow.tracking.MlflowClient((run_dir / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("sinks").experiment_id])
    assert set(run.data.metrics) == _expected(history, "mlflow")
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "moe_aux_loss")]
    assert steps == [r["step"] for r in history]


def test_wandb_has_every_scalar(moe_run):
    history, run_dir = moe_run
    (run_file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    # W&B's record log keeps each key as text; its writer may still be flushing (bounded wait)
    expected = _expected(history, "wandb")
    deadline = time.monotonic() + 120
    while not all(n.encode() in run_file.read_bytes() for n in expected) and time.monotonic() < deadline:
        time.sleep(0.2)
    data = run_file.read_bytes()
    assert [n for n in sorted(expected) if n.encode() not in data] == []


def test_prometheus_gauges_get_every_scalar(moe_run):
    history, _ = moe_run
    made, values = {}, {}

    class Gauge:
        def __init__(self, name, description, tag_keys):
            self.name, self.tag_keys = name, tag_keys
            made[name] = self

        def set(self, value, tags):
            assert set(tags) == set(self.tag_keys), (self.name, tags)
            values[(self.name, tags.get("layer"), tags.get("expert"))] = value

    gauges = JobGauges("job-1", make=Gauge)
    for record in history:
        gauges.record(record)
    assert set(made) == {f"hpservice_{m.name}" for m in METRICS if "prometheus" in m.sinks} | {
        "hpservice_step",
        "hpservice_restarts",
    }
    got = {name.removeprefix("hpservice_") + (f"/{layer}/{expert}" if layer else "") for name, layer, expert in values}
    assert got - {"step"} == _expected(history, "prometheus")
    assert values[("hpservice_loss", None, None)] == history[-1]["loss"]


def test_the_progress_line_has_its_metrics():
    record = step_record(
        7,
        0.0,
        {"loss": 2.5, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 1234.0, "step_time_s": 0.25, "mfu": 0.1,
         "expert_imbalance": 1.5, "moe_aux_loss": 0.01, "val_loss": 2.75, "rss_gib": 1.0},
    )  # fmt: skip
    line = progress_line(record)
    assert line == (
        "loss 2.5000  lr 1.00e-03  grad_norm 0.500  1,234 tok/s  250 ms/step  mfu 10.0%  "
        "busiest expert 1.50x mean  aux 0.0100  val_loss 2.7500"
    )
    assert {m.name for m in METRICS if "line" in m.sinks} == {
        "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "mfu", "expert_imbalance", "moe_aux_loss", "val_loss",
        "trained_tokens", "rewards/accuracies", "rewards/margins",
    }  # fmt: skip


def test_an_undeclared_metric_is_refused():
    with pytest.raises(ValueError, match=r"undeclared metrics \['los'\]"):
        step_record(1, 0.0, {"los": 1.0})
    assert set(SINKS) >= {s for m in METRICS for s in m.sinks}
