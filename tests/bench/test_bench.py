"""The redistribute benchmark runs end to end and its results agree with torch's.

Only the shape of the output is checked: timings depend on the machine and never go in tests.
"""

import json

from tests.bench._inprocess import bench


def test_redistribute_bench_quick_runs_and_matches_torch():
    proc = bench("redistribute", "--quick", "--json", "--ranks", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert any("transition" in line and "ours/torch" in line for line in lines), proc.stdout
    report = json.loads(lines[-1])
    assert report["bench"] == "redistribute"
    assert report["ranks"] == 2
    assert isinstance(report["max_ratio_vs_torch"], float)
    assert isinstance(report["small_overhead_ratio"], float)
    assert report["results"], "no transitions were measured"
    mismatched = [r["transition"] for r in report["results"] if not r["match"]]
    assert not mismatched, f"ours and torch disagree on {mismatched}"
    table_rows = [line for line in lines[:-1] if " -> " in line]
    assert len(table_rows) == len(report["results"])
    assert all(line.endswith("match") and "MISMATCH" not in line for line in table_rows)
