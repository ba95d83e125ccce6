"""The metric registry: every metric a training step reports, declared once.

A step's record is ``{"step": N, "time": <wall clock>, <metric>: <value>, ...}``: the trainer
builds it with ``step_record`` (which refuses a name not declared here), and every sink takes
what it carries from ``METRICS``: metrics.jsonl, the API's SSE stream and the page keep the whole
record; TensorBoard, MLflow, W&B and the Prometheus gauges take ``scalars(record)`` (a table such
as ``expert_load`` as one scalar per cell, ``expert_load/<layer>/<expert>``); the progress line
takes the metrics with a ``line`` format. A new metric is one entry here and the code that
measures it. Torch-free: the API server and the CLI import it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Literal

__all__ = ["METRICS", "SINKS", "Metric", "progress_line", "scalars", "step_record"]

# Where step records go. "jsonl", "sse" (the API's stream and the page) carry records whole; the
# others carry scalars; "line" is the progress line (the CLI, the logs).
SINKS = ("jsonl", "sse", "line", "tensorboard", "mlflow", "wandb", "prometheus")
_ALL = frozenset(SINKS)
_NOT_LINE = _ALL - {"line"}
_NOT_PROMETHEUS = _NOT_LINE - {"prometheus"}  # a Prometheus name has no "/" (TRL's DPO names do)


@dataclasses.dataclass(frozen=True)
class Metric:
    name: str
    unit: str
    description: str
    when: str = "every step"  # which steps or runs have it
    kind: Literal["scalar", "table"] = "scalar"  # table: {row: [values]} (one scalar per cell)
    line: str | None = None  # the progress line's rendering, a format with {value}; None: not on it
    sinks: frozenset[str] = _NOT_LINE  # where it goes ("line" is added when ``line`` is set)

    def __post_init__(self):
        if self.line is not None:
            object.__setattr__(self, "sinks", self.sinks | {"line"})
        if not self.sinks <= _ALL:
            raise ValueError(f"metric {self.name}: unknown sinks {sorted(self.sinks - _ALL)}")


METRICS: tuple[Metric, ...] = (
    Metric("loss", "nats", "training loss: cross entropy over the step's valid labels", line="loss {value:.4f}"),
    Metric("lr", "", "learning rate of the step", line="lr {value:.2e}"),
    Metric("grad_norm", "", "total gradient norm before clipping", line="grad_norm {value:.3f}"),
    Metric("tokens_per_s", "tokens/s", "global batch tokens over the step's wall time", line="{value:,.0f} tok/s"),
    Metric("step_time_s", "s", "wall time of the step", line="{value_ms:.0f} ms/step"),
    Metric("mfu", "", "model FLOPs utilisation per rank (attention included)", line="mfu {value:.1%}",
           when="where the device's peak is known"),
    Metric("mfu_no_attention", "", "model FLOPs utilisation per rank, attention left out",
           when="where the device's peak is known"),
    Metric("achieved_tflops_per_rank", "TFLOP/s", "model FLOPs per second per rank"),
    Metric("peak_tflops_per_rank", "TFLOP/s", "the device's peak (datasheet, or a CPU matmul probe)",
           when="where the device's peak is known"),
    Metric("flops_per_token", "FLOP", "training FLOPs per token (forward and backward)"),
    Metric("flops_per_token_no_attention", "FLOP", "training FLOPs per token without attention's"),
    Metric("peak_memory_allocated_gib", "GiB", "rank 0's peak CUDA memory allocated in the step", when="CUDA"),
    Metric("peak_memory_reserved_gib", "GiB", "rank 0's peak CUDA memory reserved in the step", when="CUDA"),
    Metric("rss_gib", "GiB", "rank 0's resident memory at the end of the step"),
    Metric("estimated_peak_gib", "GiB", "rank 0's peak memory as estimated before the job started (docs/memory.md)",
           when="jobs planned by validate, run or submit"),
    Metric("peak_memory_per_rank_gib", "GiB", "each rank's peak in the step (CUDA allocated, else resident) and "
           "its estimate where the job was planned: {rank: [measured, estimated]}", kind="table"),
    Metric("peak_rss_gib", "GiB", "rank 0's resident memory high-water mark"),
    Metric("trainable_params", "", "parameters the optimizer trains (a LoRA run: its adapters)"),
    Metric("total_params", "", "parameters of the whole model"),
    Metric("params_gib", "GiB", "rank 0's pieces of the parameters (its shards under fully_shard / tp)"),
    Metric("grads_gib", "GiB", "rank 0's gradients: one per trainable parameter piece"),
    Metric("optimizer_state_gib", "GiB", "rank 0's optimizer state (AdamW: two moments per trainable parameter)"),
    Metric("expert_load", "tokens", "tokens routed to each expert, per MoE layer", kind="table",
           when="mixture-of-experts models"),
    Metric("expert_imbalance", "", "the busiest expert's load over the mean, worst layer",
           line="busiest expert {value:.2f}x mean", when="mixture-of-experts models"),
    Metric("moe_aux_loss", "", "the load-balancing auxiliary loss (rank 0's)", line="aux {value:.4f}",
           when="mixture-of-experts models with an aux loss"),
    Metric("moe_dropped", "pairs", "(token, expert) pairs dropped by the capacity factor",
           when="mixture-of-experts models with a capacity factor"),
    Metric("trained_tokens", "tokens", "labels the step's loss learned from (masked data: not every token trains)",
           line="{value:,.0f} trained", when="data whose labels are masked (chat)"),
    Metric("epoch", "", "epochs of the data completed at the step's start", when="chat data"),
    Metric("packing_efficiency", "", "conversation tokens over all positions of the step's global batch",
           when="chat data"),
    # DPO (objective.kind dpo): TRL DPOTrainer's names and meanings, means over the step's pairs
    Metric("rewards/chosen", "nats", "beta x (policy - reference) log-probability of the chosen answers", when="DPO",
           sinks=_NOT_PROMETHEUS),
    Metric("rewards/rejected", "nats", "beta x (policy - reference) log-probability of the rejected answers",
           when="DPO", sinks=_NOT_PROMETHEUS),
    Metric("rewards/accuracies", "", "share of pairs whose chosen reward exceeds the rejected one",
           line="acc {value:.2f}", when="DPO", sinks=_NOT_PROMETHEUS),
    Metric("rewards/margins", "nats", "chosen minus rejected reward", line="margin {value:.3f}", when="DPO",
           sinks=_NOT_PROMETHEUS),
    Metric("logps/chosen", "nats", "policy log-probability of the chosen answers (sum over their tokens)", when="DPO",
           sinks=_NOT_PROMETHEUS),
    Metric("logps/rejected", "nats", "policy log-probability of the rejected answers", when="DPO",
           sinks=_NOT_PROMETHEUS),
    Metric("reference_gib", "GiB", "rank 0's DPO reference: a frozen copy's parameter pieces, the starting "
           "adapter's copy, or 0 with the adapters switched off", when="DPO"),
    Metric("val_loss", "nats", "validation loss: the mean over eval.steps batches", line="val_loss {value:.4f}",
           when="evaluation steps"),
    Metric("val_ppl", "", "validation perplexity, exp(val_loss)", when="evaluation steps"),
)  # fmt: skip

_BY_NAME = {m.name: m for m in METRICS}
_RECORD_KEYS = ("step", "time")  # every record's own fields, not metrics


def step_record(step: int, time: float, values: dict) -> dict:
    """A step's record: ``values`` by declared metric (``None``: not measured this step, left
    out). A name not in ``METRICS`` is a ValueError: no sink may carry an undeclared metric."""
    unknown = sorted(set(values) - set(_BY_NAME))
    if unknown:
        raise ValueError(f"undeclared metrics {unknown}: declare them in hpservice.metrics.METRICS")
    return {"step": step, "time": time, **{k: v for k, v in values.items() if v is not None}}


def scalars(record: dict, sink: str) -> Iterator[tuple[str, float]]:
    """``(name, value)`` of each metric of ``record`` that ``sink`` carries, tables one scalar
    per cell (``expert_load/<layer>/<expert>``); non-finite values are kept (a sink shows NaN)."""
    for name, value in record.items():
        metric = _BY_NAME.get(name)
        if metric is None or sink not in metric.sinks or value is None:
            continue
        if metric.kind == "table":
            for row, cells in value.items():
                for i, cell in enumerate(cells):
                    yield f"{name}/{row}/{i}", float(cell)
        else:
            yield name, float(value)


def progress_line(record: dict) -> str:
    """The metrics of ``record`` that go on the progress line, in ``METRICS`` order."""
    parts = []
    for metric in METRICS:
        value = record.get(metric.name)
        if metric.line is None or value is None:
            continue
        parts.append(metric.line.format(value=value, value_ms=value * 1000))
    return "  ".join(parts)
