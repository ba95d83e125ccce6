"""``python -m hpservice.bench moe`` runs its three configurations on the tiny model: the same
model and data, so the same losses; the all-to-all bytes it counts are the analytic count's order."""

import pytest

from hpservice.bench import moe


def test_bench_moe_rows_agree_and_count_the_all_to_all():
    r = moe.run("tiny", ep=2, steps=1, warmup=1)
    grouped, naive, ep = r["rows"]
    assert [row["config"] for row in r["rows"]] == ["grouped, 1 process", "naive loop, 1 process", "ep 2"]
    assert naive["loss"] == pytest.approx(grouped["loss"], abs=1e-5) and ep["loss"] == pytest.approx(grouped["loss"], abs=1e-5)
    assert grouped["all_to_all_bytes_per_step"] == 0 < ep["all_to_all_bytes_per_step"]
    assert 0.5 < ep["all_to_all_ratio"] < 2.0  # routing near uniform at the start of training
    assert ep["all_to_all_analytic_bytes"] == moe.analytic_all_to_all_bytes(moe.SIZES["tiny"], 2)
    assert all(row["mfu"] > 0 and row["step_s"] > 0 for row in r["rows"])
