"""The context-parallelism benchmark runs end to end and reports what it promises: a row per
sequence length and cp size, and activation memory per rank that falls with cp (the bytes autograd
keeps, counted exactly: not a timing). Timings are printed, never asserted."""

import json

from tests.bench._inprocess import bench


def test_cp_bench_reports_memory_falling_with_cp():
    proc = bench("cp", "--seq-lens", "512", "--cps", "1", "2", "--steps", "1", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[1].split() == ["seq", "cp", "step", "ms", "vs", "cp", "1", "held", "MiB/rank", "vs", "cp", "1"]
    result = json.loads(lines[-1])
    rows = {(r["seq_len"], r["cp"]): r for r in result["rows"]}
    assert set(rows) == {(512, 1), (512, 2)}
    assert rows[(512, 2)]["held_ratio_vs_cp1"] < 0.7, rows  # each rank keeps about half the activations
    assert "no CPU kernel" in result["torch_context_parallel"]
