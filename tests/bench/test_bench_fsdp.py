"""The FSDP benchmark runs end to end and every distributed config trains like one process.

Only correctness and the shape of the output are checked: timings depend on the machine and
never go in tests.
"""

import json

from tests.bench._inprocess import bench

RATIO_KEYS = ("step_time_ratio_vs_fsdp2", "step_time_ratio_vs_ddp", "memory_ratio_vs_fsdp2", "max_loss_diff_vs_single")


def test_fsdp_bench_quick_runs_and_matches_single_process():
    proc = bench("fsdp", "--world-size", "2", "--model", "mlp", "--quick", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert any("config" in line and "step ms" in line and "|loss - single|" in line for line in lines), proc.stdout
    for name in ("ours", "fsdp2", "ddp", "single*"):
        assert any(line.split()[:1] == [name] for line in lines), f"no table row for {name}:\n{proc.stdout}"
    report = json.loads(lines[-1])
    assert report["bench"] == "fsdp"
    assert report["model"] == "mlp"
    assert report["world_size"] == 2
    for key in RATIO_KEYS:
        assert isinstance(report[key], float), (key, report[key])
    assert report["max_loss_diff_vs_single"] < 1e-4, report["configs"]
    assert set(report["configs"]) == {"ours", "fsdp2", "ddp", "single"}
    # Sharding halves what a rank holds of params + grads + AdamW state (up to padding).
    assert report["memory_ratio_vs_fsdp2"] == 1.0
    assert 0.45 < report["memory_ratio_vs_ddp"] < 0.55
