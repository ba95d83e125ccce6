"""Planning a job's memory where it is handed over: ``resources.device_memory``, ``validate
--device-memory``, the submit check, ``parallelism: auto`` through validate, run and the API."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from hpservice.api import Settings, create_app
from hpservice.bench.memory import job
from hpservice.cli import main
from hpservice.memory.plan import choose_layout, layout_label
from hpservice.preflight import plan_memory
from hpservice.spec import JobSpec, SpecError, parse_job

EXAMPLE = Path(__file__).parents[2] / "examples" / "llama-1b-gpu.yaml"
MIB = 2**20


@pytest.mark.parametrize(
    ("value", "expected"),
    [("80GiB", 80 << 30), ("80GB", 80 << 30), ("512 MiB", 512 << 20), ("1.5T", 3 << 39), (85899345920, 80 << 30)],
)
def test_device_memory_is_bytes_or_a_size_and_is_normalised(value, expected):
    assert parse_job({"name": "x", "resources": {"device_memory": value}}).resources.device_memory == expected


@pytest.mark.parametrize(
    ("value", "fragment"),
    [(-1, "more than 0"), (0, "more than 0"), ("-5GiB", "is not a size"), ("lots", "is not a size"),
     (1 << 50, "at most 16 TiB"), ("100TiB", "at most 16 TiB"), (True, "is not a size"), (8.5, "is not a size")],
)  # fmt: skip
def test_a_bad_device_memory_is_refused_naming_the_field(value, fragment):
    with pytest.raises(SpecError) as e:
        parse_job({"name": "x", "resources": {"device_memory": value}})
    assert e.value.errors[0][0] == "resources.device_memory" and fragment in e.value.errors[0][1]


def test_parallelism_auto_is_short_for_auto_true_and_nothing_else_is_a_word():
    assert parse_job({"name": "x", "parallelism": "auto"}).parallelism.auto is True
    with pytest.raises(SpecError) as e:
        parse_job({"name": "x", "parallelism": "fast"})
    assert "use auto, or a mapping of fields" in str(e.value)


@pytest.fixture
def planning_dir(tmp_path, monkeypatch):
    """The GPU example where its data file is (a laptop planning a GPU job)."""
    (tmp_path / "data").mkdir()
    np.zeros(4096, dtype=np.uint16).tofile(tmp_path / "data" / "train.bin")
    shutil.copy(EXAMPLE, tmp_path / "job.yaml")
    monkeypatch.chdir(tmp_path)
    return tmp_path / "job.yaml"


def test_validate_refuses_a_job_over_its_device_memory_with_the_breakdown_and_layouts_that_fit(planning_dir, capsys):
    assert main(["validate", str(planning_dir), "--device-memory", "4GiB"]) == 2
    err = capsys.readouterr().err
    assert "does not fit its devices" in err and "more than the 4.00 GiB of --device-memory" in err
    assert "activations and loss" in err and "optimizer state" in err  # the breakdown
    assert "it fits with" in err and "GiB per rank)" in err  # what would
    assert main(["validate", str(planning_dir), "--device-memory", "80GiB"]) == 0
    out = capsys.readouterr().out
    assert "estimated peak memory per rank" in out and "of 80.00 GiB per device (cuda" in out
    assert main(["validate", str(planning_dir), "--device-memory", "lots"]) == 2
    assert "--device-memory: 'lots' is not a size" in capsys.readouterr().err


def test_a_job_that_fits_no_longer_does_with_a_single_change_offered(tmp_path):
    spec = job("llama", 2, {}, {}, batch=8, resources={"workers": 2, "device_memory": 200 * MIB})
    with pytest.raises(SpecError) as e:
        plan_memory(spec, device_memory=None, device="cpu")
    message = e.value.errors[0][1]
    assert e.value.errors[0][0] == "resources.device_memory" and "of resources.device_memory" in message
    assert "it fits with" in message and ("activation_checkpointing" in message or "micro_batch" in message)


def test_auto_picks_the_fastest_layout_that_fits_and_keeps_the_fields_set_beside_it():
    spec = job("llama", 2, "auto", {}, batch=8)
    chosen, runner_up = choose_layout(spec, 150 * MIB, "cpu")
    assert chosen.estimate.peak <= 150 * MIB and not chosen.spec.parallelism.auto
    assert runner_up is not None and runner_up.seconds >= chosen.seconds and runner_up.label != chosen.label
    roomy, _ = choose_layout(spec, 4 << 30, "cpu")
    assert roomy.seconds <= chosen.seconds  # more memory never makes the choice slower
    constrained = job("llama", 2, {"auto": True, "tp": 2}, {"activation_checkpointing": "full"}, batch=8)
    chosen, _ = choose_layout(constrained, 150 * MIB, "cpu")
    assert chosen.spec.parallelism.tp == 2 and chosen.spec.training.activation_checkpointing == "full"
    assert "tp 2" in chosen.label


def test_auto_with_nothing_that_fits_names_the_closest_layouts_and_why():
    spec = job("llama", 2, "auto", {}, batch=8)
    with pytest.raises(SpecError) as e:
        choose_layout(spec, 1 * MIB, "cpu")
    message = e.value.errors[0][1]
    assert e.value.errors[0][0] == "parallelism" and message.startswith("no layout of 2 workers fits: [")
    assert message.count("] needs") >= 3 and "more than the 1.0 MiB" in message
    with pytest.raises(SpecError) as e:  # constraints that leave no layout: say so
        choose_layout(job("llama", 2, {"auto": True, "tp": 4}, {}, batch=8), 1 << 30, "cpu")
    assert "no layout of 2 workers" in e.value.errors[0][1]


def _train_one_step(spec_json: str) -> dict:
    from hpservice.train import Trainer

    spec = JobSpec.model_validate_json(spec_json)
    trainer = Trainer(spec, log_to_stdout=False)
    record = trainer.train_step()
    trainer.close()
    return {"loss": record["loss"], "per_rank": record["peak_memory_per_rank_gib"], "estimate": record.get("estimated_peak_gib")}


def test_an_auto_job_runs_with_the_layout_chosen_and_reports_its_estimate_beside_each_ranks_peak(ranks, tmp_path):
    from hpservice.train._errors import TrainingError

    spec = job("llama", 2, "auto", {}, batch=8, metrics={"dir": str(tmp_path), "log_every": 1000})
    with pytest.raises(TrainingError, match="parallelism: auto is resolved where the job is handed over"):
        _train_one_step(spec.model_dump_json())  # before any process group: every rank must build one layout
    planned = plan_memory(spec, device_memory=150 * MIB, device="cpu")
    assert planned.memory_estimate["auto"]["chosen"] == layout_label(planned)
    out = ranks(2).run(_train_one_step, planned.model_dump_json())
    per_rank = out[0]["per_rank"]
    assert sorted(per_rank) == ["0", "1"] and all(measured > 0 for measured, _ in per_rank.values())
    assert out[0]["estimate"] == planned.memory_estimate["ranks"][0]["peak_gib"] == per_rank["0"][1]


def test_submit_refuses_what_does_not_fit_and_resolves_auto(tmp_path):
    settings = Settings(data_dir=tmp_path, tokens={})
    base = {"name": "tiny", "model": {"name": "llama", "flavor": "tiny"}, "training": {"steps": 2}}
    with TestClient(create_app(settings, connect_ray=False, supervise=False)) as c:
        r = c.post("/v1/jobs", json={**base, "resources": {"device_memory": "1MiB"}})
        assert r.status_code == 422
        detail = r.json()["error"]["details"][0]
        assert detail["path"] == "resources.device_memory" and "more than the 1.0 MiB" in detail["message"]
        r = c.post("/v1/jobs", json={**base, "parallelism": "auto", "resources": {"workers": 2, "device_memory": "1GiB"},
                                     "memory_estimate": {"peak_gib": 0}})  # fmt: skip
        assert r.status_code == 201, r.text
        spec = r.json()["spec"]
        assert spec["parallelism"]["auto"] is False and spec["memory_estimate"]["auto"]["chosen"]
        assert spec["memory_estimate"]["peak_gib"] > 0  # the submitted figure replaced by the service's
        r = c.post("/v1/jobs", json={**base, "parallelism": "auto", "resources": {"workers": 2, "device_memory": "1KiB"}})
        assert r.status_code == 422 and r.json()["error"]["details"][0]["path"] == "parallelism"
