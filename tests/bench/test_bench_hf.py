"""The Hugging Face import/export benchmark runs end to end on the small size, and our import
gives transformers' logits. Timings depend on the machine and never go in tests."""

import json

from tests.bench._inprocess import bench


def test_hf_bench_small_runs_and_agrees_with_transformers():
    proc = bench("hf", "--size", "small", "--json")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["max_abs_logit_diff"] < 1e-4 and result["world"] == 2
    for key in ("transformers_load_s", "ours_load_s", "ours_export_s", "ours_rss_mib_per_rank"):
        assert result[key] >= 0, key
    assert "ours/transformers: load" in proc.stdout
