"""The trainer benchmarks (ac, checkpoint, overhead) run end to end on small settings and report
what they promise. Timings depend on the machine and never go in tests. ac (it sets what glibc
reads at process start) and overhead (it starts torchrun and Ray) run in a process of their own."""

import json
import subprocess
import sys

from tests.bench._inprocess import bench


def _bench(*args, timeout=600, own_process=True):
    if own_process:
        cmd = [sys.executable, "-m", "hpservice.bench", *args, "--json"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    else:
        proc = bench(*args, "--json")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, json.loads(proc.stdout.strip().splitlines()[-1])


def test_ac_bench_reports_memory_per_mode():
    out, r = _bench("ac", "--flavor", "tiny", "--batch", "4", "--seq-len", "64", "--steps", "2")
    assert set(r["rows"]) == {"none", "selective op", "selective 1/2", "full"}
    rows = r["rows"]
    assert all(row["tokens_per_s"] > 0 and row["held_bytes"] >= 0 for row in rows.values())
    assert isinstance(r["full_peak_within_bound"], bool) and "full holds" in out


def test_checkpoint_bench_reports_the_async_ratio():
    out, r = _bench("checkpoint", "--size", "tiny", "--repeats", "2", own_process=False)
    for key in ("async_blocking_ratio", "sync_save_s", "async_blocked_s", "load_reshard_s"):
        assert r[key] > 0, key
    assert r["world_size"] == 2 and "async/sync blocked time" in out


def test_overhead_bench_runs_both_launchers():
    out, r = _bench("overhead", "--flavor", "tiny", "--steps", "8", "--warmup", "2", "--repeats", "1")
    for key in ("step_time_ratio_vs_torchrun", "torchrun_step_ms", "hpservice_step_ms"):
        assert r[key] > 0, key
    assert "hpservice run / torchrun" in out


def test_lora_bench_measures_what_it_counts():
    """Full fine-tuning, LoRA and QLoRA on one model: each row's measured training state per rank
    equals its analytic count (AdamW's step scalars and NF4's per-tensor constants aside)."""
    out, r = _bench("lora", "--dim", "128", "--layers", "1", "--steps", "1", "--seq-len", "32", own_process=False)
    rows = r["rows"]
    for mode, row in rows.items():
        for part in ("params", "grads", "optimizer_state"):
            measured, counted = row[f"{part}_bytes"], row["analytic"][part]
            assert counted <= measured <= counted * 1.01 + 4096, (mode, part, measured, counted)
    assert rows["qlora"]["state_bytes"] < rows["lora"]["state_bytes"] < rows["full"]["state_bytes"]
    assert r["qlora_vs_lora_max_loss_diff"] < 0.05 and "QLoRA vs LoRA" in out


def test_dpo_bench_reports_each_reference_next_to_sft():
    out, r = _bench("dpo", "--dim", "128", "--layers", "1", "--steps", "1", "--seq-len", "48", "--pairs", "2", own_process=False)
    rows = r["rows"]
    assert set(rows) == {"sft full", "sft lora", "dpo lora, adapters off", "dpo lora, initial adapter", "dpo full, copy"}
    assert rows["dpo lora, adapters off"]["reference_bytes"] == 0
    adapter = rows["dpo lora, initial adapter"]["reference_bytes"]
    assert adapter > 0 and adapter == rows["dpo lora, initial adapter"]["grads_bytes"]  # the adapter's size, once
    assert rows["dpo full, copy"]["reference_bytes"] == rows["dpo full, copy"]["params_bytes"]  # sharded like the policy
    assert all(row["step_s"] > 0 for row in rows.values()) and "reference" in out
