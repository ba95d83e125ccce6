"""The trainer on one CUDA GPU: bf16, activation checkpointing, compile, MFU and memory, the
profiler's memory snapshot. Skipped without a GPU; ``scripts/gpu-check`` runs them."""

import pytest

from .._jobs import tiny_llama_job as _spec
from .._jobs import train as _run

pytestmark = pytest.mark.cuda


def _gpu(tmp_path, **sections):
    sections.setdefault("resources", {})["use_gpu"] = True
    return _spec(tmp_path, **sections)


def test_bf16_step_reports_mfu_and_cuda_memory(tmp_path):
    history = _run(_gpu(tmp_path, parallelism={"mixed_precision": "bf16"}))
    last = history[-1]
    assert last["peak_memory_allocated_gib"] > 0 and last["peak_memory_reserved_gib"] >= last["peak_memory_allocated_gib"]
    assert last["mfu"] is None or 0 < last["mfu"] < 1  # None on a GPU missing from the peak table
    assert history[-1]["loss"] < history[0]["loss"] + 1.0


@pytest.mark.parametrize("training", [{"activation_checkpointing": "full"}, {"compile": True},
                                      {"compile": True, "activation_checkpointing": "selective"}],
                         ids=["ac-full", "compile", "compile-op-ac"])  # fmt: skip
def test_ac_and_compile_train_as_eager_on_cuda(tmp_path, training):
    eager = [r["loss"] for r in _run(_gpu(tmp_path / "a"))]
    other = [r["loss"] for r in _run(_gpu(tmp_path / "b", training={"steps": 4, **training}))]
    assert other == pytest.approx(eager, abs=1e-4)  # fp32; compiled kernels reorder sums


def test_profile_writes_a_memory_snapshot_on_cuda(tmp_path):
    _run(_gpu(tmp_path, metrics={"profile": {"start_step": 2, "steps": 2}}))
    names = sorted(p.name for p in tmp_path.glob("t-*/artifacts/*"))
    assert names == ["rank0-steps2-3.memory.pickle", "rank0-steps2-3.trace.json"]
