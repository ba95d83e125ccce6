"""``python -m hpservice.bench memory --quick``: the estimate beside the measured peak."""

import json

from tests.bench._inprocess import bench


def test_bench_memory_prints_estimate_measurement_and_ratio_per_configuration():
    proc = bench("memory", "--quick", "--json")
    assert proc.returncode == 0, proc.stderr
    assert "ratio" in proc.stdout and "1 configuration: median error" in proc.stdout
    grid = json.loads(proc.stdout.splitlines()[-1])["grid"]
    assert [row["config"] for row in grid["rows"]] == ["llama, 1 rank, AC none"]
    for row in grid["rows"]:
        assert row["estimate_bytes"] > 0 and abs(row["ratio"] - 1) < 0.10 and row["traced"]
        assert row["ratio"] == row["estimate_bytes"] / row["measured_bytes"]
