"""The memory estimate against what training allocates.

The measurement is ``TensorMemoryTracker`` around a real step on gloo ranks (every tensor the
rank allocates, counted from before its model is built); the tracker itself is checked against
torch's ``MemTracker`` where that one is not hampered (one iteration of a plain module)."""

from __future__ import annotations

import gc

import pytest
import torch

from hpservice.bench.memory import job
from hpservice.memory import estimate
from hpservice.memory._tracker import TensorMemoryTracker
from hpservice.memory.measure import measure


def _step(model, opt):
    model(torch.randn(64, 256)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def test_the_tracker_measures_what_torchs_memtracker_measures():
    from torch.distributed._tools.mem_tracker import MemTracker

    def run(tracker):
        torch.manual_seed(0)
        with tracker:
            model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
            opt = torch.optim.AdamW(model.parameters())
            _step(model, opt)
            gc.collect()
            return model, opt

    ours = TensorMemoryTracker()
    kept = run(ours)
    theirs = MemTracker()
    kept_too = run(theirs)
    cpu = torch.device("cpu")
    assert ours.peak == theirs.get_tracker_snapshot("peak")[cpu]["Total"]
    assert ours.current == theirs.get_tracker_snapshot()[cpu]["Total"]
    # parameters, AdamW's two moments and step counts, nothing else between steps (grads set to None)
    params = list(kept[0].parameters())
    assert ours.current == 3 * sum(p.numel() * 4 for p in params) + 4 * len(params)
    del kept, kept_too


def test_the_tracker_follows_storage_resizes_and_frees():
    with TensorMemoryTracker() as mem:
        t = torch.empty(1 << 20)
        assert mem.current == 4 << 20
        t.untyped_storage().resize_(0)  # how fully_shard frees its unsharded parameters
        assert mem.current == 0
        t.untyped_storage().resize_(8 << 20)
        assert mem.current == mem.peak == 8 << 20
        del t
        assert mem.current == 0


# (family, workers, parallelism, training, lora): one of each layout kind, on the models the
# bench grid uses; the grid itself (48 + 8 configurations) is python -m hpservice.bench memory
CASES = {  # one rank without checkpointing: tests/bench/test_bench_memory.py
    "1 rank, AC full, LoRA": ("qwen3", 1, {}, {"activation_checkpointing": "full"}, True),
    "fsdp 2, accum 2": ("llama", 2, {}, {"grad_accum": 2}, False),
    "tp 2, AC selective": ("qwen3", 2, {"tp": 2}, {"activation_checkpointing": "selective"}, False),
    "pp 2": ("llama", 2, {"pp": 2}, {}, False),
    "cp 2, bf16": ("llama", 2, {"cp": 2, "mixed_precision": "bf16"}, {}, False),
    "moe ep 2 (formula)": ("qwen3_moe", 2, {"ep": 2}, {}, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_estimate_is_within_ten_percent_of_the_measured_peak_of_every_rank(ranks, case):
    family, workers, parallelism, training, lora = CASES[case]
    spec = job(family, workers, parallelism, training, lora=lora)
    est = estimate(spec, device="cpu")
    measured = measure(spec, pool=ranks(workers))
    per_pp = len(est.ranks)
    for r in measured:  # pp is the outermost dim: rank r is on pp rank r // (world / pp)
        expected = est.ranks[r["rank"] // (workers // per_pp)].peak
        assert abs(expected / r["peak_bytes"] - 1) < 0.10, (case, r["rank"], expected, r["peak_bytes"])
    assert est.traced == (family != "qwen3_moe")  # routing's data-dependent shapes: the formula


class _OwnModel(torch.nn.Module):
    """A factory's model: no ``layers``, so one fully_shard unit; traced as a whole."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(512, 128)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.GELU(), torch.nn.Linear(512, 128))
        self.head = torch.nn.Linear(128, 512)

    def forward(self, ids):
        return self.head(self.mlp(self.embed(ids)))


def own_model():
    return _OwnModel()


@pytest.mark.parametrize("workers", [1, 2])
def test_a_factory_models_estimate_is_within_ten_percent_of_its_measured_peak(ranks, workers):
    from hpservice.spec import parse_job

    spec = parse_job({
        "name": "own", "model": {"name": "tests.memory.test_estimate:own_model", "flavor": None},
        "data": {"kind": "synthetic", "seq_len": 128, "global_batch": 8, "vocab_size": 512},
        "training": {"steps": 3}, "resources": {"workers": workers}, "metrics": {"log_every": 1000},
    })  # fmt: skip
    est = estimate(spec, device="cpu")
    assert est.traced
    for r in measure(spec, pool=ranks(workers)):
        assert abs(est.peak / r["peak_bytes"] - 1) < 0.10, (r, est.peak)


def test_the_estimate_breaks_down_by_component_and_says_what_it_assumes():
    spec = job("llama", 2, {"mixed_precision": "bf16"}, {"grad_accum": 2})
    est = estimate(spec, device="cuda")
    (rank,) = est.ranks
    # fully_shard over 2 ranks: fp32 shards and gradient buffers, AdamW's two moments
    assert rank.components["optimizer state"] == 2 * rank.components["parameters"]
    assert rank.components["gradients"] == rank.components["parameters"]
    assert rank.components["activations and loss"] > 0 and rank.components["gathered parameters and gradients"] > 0
    record = est.record()
    assert record["device"] == "cuda" and record["ranks"][0]["peak_gib"] == pytest.approx(est.peak / 2**30, abs=1e-4)
    assert any("CUDA context" in a for a in record["assumptions"])
    # sync_every_micro_batch: no unsharded gradients held through the accumulation
    synced = estimate(job("llama", 2, {"mixed_precision": "bf16", "sync_every_micro_batch": True}, {"grad_accum": 2}), device="cuda")
    assert synced.peak < est.peak
    # cpu_offload on a GPU: the shards, gradients and optimizer state are host memory, not the device's
    offloaded = estimate(job("llama", 2, {"mixed_precision": "bf16", "cpu_offload": True}), device="cuda")
    assert offloaded.ranks[0].components["parameters"] == 0 and offloaded.ranks[0].components["in host memory (cpu_offload)"] > 0


def test_a_pipeline_stage_is_estimated_per_pp_rank():
    est = estimate(job("llama", 2, {"pp": 2, "pp_schedule": "gpipe", "pp_microbatches": 4}), device="cpu")
    first, last = est.ranks
    assert first.ranks.startswith("pp rank 0") and last.ranks.startswith("pp rank 1")
    assert first.peak != last.peak  # the embedding on one, the head and the loss on the other
