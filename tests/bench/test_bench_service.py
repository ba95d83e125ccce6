"""The service benchmark (time to first step: our Ray jobs vs Ray Train) runs end to end.

Only the shape of the output is checked: timings and ratios depend on the machine and never go
in tests. Ray Train may be missing (then the ratio is null and the run still succeeds).
"""

import json
import subprocess
import sys

KEYS = ("time_to_first_step_s", "ratio_vs_ray_train", "metric_latency_s")


def test_service_bench_quick_runs_and_reports_time_to_first_step():
    # one worker per system: the shape of the report is the same, and each worker costs seconds to start
    proc = subprocess.Popen(
        [sys.executable, "-m", "hpservice.bench", "service", "--quick", "--workers", "1", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.terminate()  # SIGTERM: the benchmark shuts its Ray down before exiting
        try:
            stdout, stderr = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        raise AssertionError(f"benchmark still running after 300 s\n{stdout}\n{stderr}") from None
    assert proc.returncode == 0, stdout + stderr
    lines = stdout.strip().splitlines()
    assert any("system" in line and "first step s" in line for line in lines), stdout
    assert any(line.split()[:1] == ["ours"] for line in lines), stdout
    report = json.loads(lines[-1])
    assert report["bench"] == "service"
    for key in KEYS:
        assert key in report, (key, report)
    assert isinstance(report["time_to_first_step_s"], float), report["time_to_first_step_s"]
    assert report["time_to_first_step_s"] > 0
    assert report["ratio_vs_ray_train"] is None or isinstance(report["ratio_vs_ray_train"], float)
    assert report["metric_latency_s"] is None or isinstance(report["metric_latency_s"], float)
