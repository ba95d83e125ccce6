"""The tensor-parallel benchmark runs end to end, and ours and torch's tensor parallelism both
train like one process (the MLP and the built-in Llama).

Only correctness and the shape of the output are checked: timings depend on the machine and
never go in tests.
"""

import json

import pytest

from tests.bench._inprocess import bench

RATIO_KEYS = (
    "ratio_ours_vs_torch",
    "memory_ratio_ours_vs_torch",
    "memory_ratio_ours_vs_single",
    "max_loss_diff_vs_single",
)


def _bench(*args: str) -> tuple[list[str], dict]:
    proc = bench("tp", "--world-size", "2", "--quick", "--json", *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    return lines, json.loads(lines[-1])


@pytest.mark.parametrize("model,extra", [("mlp", ()), ("llama", ()), ("llama", ("--sequence-parallel",))])
def test_tp_bench_quick_runs_and_matches_single_process(model, extra):
    lines, report = _bench("--model", model, *extra)
    assert report["model_spec"]["sequence_parallel"] == bool(extra)
    assert any("config" in line and "step ms" in line and "|loss - single|" in line for line in lines), lines
    for name in ("ours", "torch", "single*"):
        assert any(line.split()[:1] == [name] for line in lines), f"no table row for {name}:\n" + "\n".join(lines)
    assert report["bench"] == "tp"
    assert report["model"] == model
    assert report["world_size"] == 2
    for key in RATIO_KEYS:
        assert isinstance(report[key], float), (key, report[key])
    assert set(report["configs"]) == {"ours", "torch", "single"}
    single = report["configs"]["single"]["final_loss"]
    for name in ("ours", "torch"):
        row = report["configs"][name]
        assert abs(row["final_loss"] - single) < 1e-4, (name, report["configs"])
        assert row["final_loss_spread_over_ranks"] < 1e-5, (name, row)
        assert row["collectives_per_step"] > 0, (name, row)  # tp communicates in every step
    # Every parallelized weight is halved; the norms (and the MLP's rowwise biases) stay whole.
    assert 0.45 < report["memory_ratio_ours_vs_single"] < 0.6, report
