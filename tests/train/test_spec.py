"""The job spec: good files load, bad ones name the field path (or the YAML line)."""

import json
from pathlib import Path

import pytest

from hpservice.cli import main
from hpservice.spec import JobSpec, SpecError, apply_overrides, load_job, parse_job

EXAMPLES = sorted(Path(__file__).resolve().parents[2].joinpath("examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_are_valid(path):
    spec = load_job(path)
    assert spec.name and spec.training.steps > 0


def test_defaults_and_aliases():
    spec = parse_job({"name": "a", "checkpoint": {"async": True}})
    assert spec.checkpoint.async_ is True and spec.model.name is None and spec.parallelism.dp_shard == -1
    assert spec.parallelism.resolve(4) == (1, 4)
    assert parse_job({"name": "a", "parallelism": {"dp_replicate": 2}}).parallelism.resolve(4) == (2, 2)


@pytest.mark.parametrize(
    "data,path,message",
    [
        ({"name": "a", "training": {"steps": 0}}, "training.steps", "greater than 0"),
        ({"name": "a", "trainig": {}}, "trainig", "unknown field (did you mean 'training'?)"),
        ({"name": "a", "model": {"flavour": "tiny"}}, "model.flavour", "unknown field (did you mean 'flavor'?)"),
        ({"name": "a", "parallelism": {"dp_shard": 0}}, "parallelism.dp_shard", "-1"),
        ({"name": "a", "parallelism": {"tp": 0}}, "parallelism.tp", "greater than or equal to 1"),
        ({"name": "a", "parallelism": {"sequence_parallel": True}}, "parallelism.sequence_parallel", "needs tp > 1"),
        ({"name": "a", "data": {"kind": "tokens"}}, "data", "data.path is required"),
        ({"name": "a", "data": {"kind": "parquet"}}, "data.kind", "'synthetic', 'tokens', 'text', 'chat' or 'preference'"),
        ({"name": "bad name!"}, "name", "should match pattern"),
        ({}, "name", "Field required"),
        ({"name": "a", "data": {"global_batch": 6}, "training": {"grad_accum": 4}}, "<root>", "not divisible"),
    ],
)
def test_errors_name_the_field_path(data, path, message):
    with pytest.raises(SpecError) as e:
        parse_job(data)
    assert any(p == path and message in m for p, m in e.value.errors), e.value.errors
    assert path in str(e.value)


def test_yaml_syntax_error_names_the_line(tmp_path):
    bad = tmp_path / "job.yaml"
    bad.write_text("name: a\ntraining:\n  steps: [1\n")
    with pytest.raises(SpecError, match=r"job.yaml:4:1: YAML syntax error"):
        load_job(bad)
    with pytest.raises(SpecError, match="cannot read job file"):
        load_job(tmp_path / "missing.yaml")


def test_world_size_must_fit_parallelism():
    spec = parse_job({"name": "a", "parallelism": {"dp_replicate": 2}})
    with pytest.raises(SpecError, match="world size 3 is not divisible by dp_replicate x tp = 2"):
        spec.parallelism.resolve(3)
    with pytest.raises(SpecError, match="dp_shard 3 x tp 1 != world size 4"):
        parse_job({"name": "a", "parallelism": {"dp_shard": 3}}).parallelism.resolve(4)


def check_world(spec):
    """What every launcher checks first (hpservice.preflight.check_layout), raised."""
    from hpservice.preflight import check_layout, raise_if

    raise_if(check_layout(spec), "job")


def test_overrides():
    data = apply_overrides({"name": "a"}, ["training.steps=5", "optimizer.lr=1e-3", "model.overrides.dim=32"])
    spec = parse_job(data)
    assert spec.training.steps == 5 and spec.optimizer.lr == 1e-3 and spec.model.overrides == {"dim": 32}
    with pytest.raises(SpecError, match=r"expected key\.path=value"):
        apply_overrides({}, ["training.steps"])


def test_cli_validate_and_schema(tmp_path, capsys):
    tiny = EXAMPLES[0].with_name("tiny-cpu.yaml")
    assert main(["validate", str(tiny)]) == 0
    # the fine-tuning example reads files its script prepares first: validate says which are missing
    assert main(["validate", str(EXAMPLES[0].with_name("finetune-cpu.yaml"))]) == 2
    assert "data.path: runs/finetune-example/train.bin: no such file" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: a\ntraining: {steps: -1}\n")
    assert main(["validate", str(bad)]) == 2  # a spec error is a usage error, as for run and submit
    assert "training.steps" in capsys.readouterr().err
    assert main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert schema["title"] == "JobSpec" and "training" in schema["properties"]
    assert JobSpec.model_json_schema()["additionalProperties"] is False


@pytest.mark.parametrize(
    ("data", "path", "message"),
    [
        ({"name": "a", "optimizer": {"lrr": 0.1}}, "optimizer.lrr", "unknown field (did you mean 'lr'?); allowed: name, lr,"),
        ({"name": "a", "checkpoint": {"asyn": True}}, "checkpoint.asyn", "did you mean 'async'?"),
        ({"name": "a", "model": {"flavor": "tinyy"}}, "model.flavor", "'tinyy' is not a flavor of llama; allowed: tiny, small"),
    ],
)  # fmt: skip
def test_misspellings_get_the_allowed_values_and_a_suggestion(data, path, message):
    with pytest.raises(SpecError) as e:
        parse_job(data)
    assert any(p == path and message in m for p, m in e.value.errors), e.value.errors


def test_a_model_name_this_machine_cannot_resolve_is_refused_for_local_runs(tmp_path, capsys):
    from hpservice.preflight import check_model

    spec = parse_job({"name": "a", "model": {"name": "lama"}})  # a server might know it: the spec parses
    assert check_model(spec) == [("model.name", "'lama' is neither a built-in model (deepseek_v3, llama, mistral, mlp, qwen2, qwen3, qwen3_moe) nor "
                                             "'package.module:factory' (did you mean 'llama'?)")]  # fmt: skip
    job = tmp_path / "job.yaml"
    job.write_text("name: a\nmodel: {name: lama}\n")
    assert main(["validate", str(job)]) == 2 and "did you mean 'llama'?" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("parallelism", "workers", "fragment"),
    [({"tp": 3}, 2, "not divisible by dp_replicate x tp = 3"), ({"dp_shard": 3}, 2, "dp_shard 3 x tp 1 != world size 2")],
)
def test_a_layout_that_cannot_fill_the_workers_is_refused_before_anything_starts(tmp_path, capsys, parallelism, workers, fragment):
    spec = parse_job({"name": "a", "parallelism": parallelism, "resources": {"workers": workers}})
    with pytest.raises(SpecError) as e:
        check_world(spec)
    assert e.value.errors[0][0] == "parallelism" and fragment in e.value.errors[0][1]
    job = tmp_path / "job.yaml"
    job.write_text(f"name: a\nparallelism: {json.dumps(parallelism)}\nresources: {{workers: {workers}}}\n")
    assert main(["validate", str(job)]) == 2 and fragment in capsys.readouterr().err
    assert main(["run", str(job)]) == 2  # refused before Ray starts
    assert "(resources.workers is 2)" in capsys.readouterr().err


def test_the_gpu_question_is_decided_once_and_handed_down():
    from hpservice.actors.coordinator import attempt_spec

    auto = parse_job({"name": "a", "resources": {"workers": 2}}).resources
    assert (auto.gpus_per_worker(0), auto.gpus_per_worker(1), auto.gpus_per_worker(2)) == (0, 0, 1)
    assert parse_job({"name": "a", "resources": {"use_gpu": True}}).resources.gpus_per_worker(0) == 1
    spec = parse_job({"name": "a", "resources": {"workers": 2}, "checkpoint": {"interval": 5}})
    first, restart = attempt_spec(spec, False, 1), attempt_spec(spec, True, 0)
    assert first.resources.use_gpu is True and first.checkpoint.resume_from is None
    assert restart.resources.use_gpu is False and restart.checkpoint.resume_from == "latest"
    assert spec.resources.use_gpu == "auto"  # the stored spec stays as submitted


def test_every_field_is_described_and_docs_jobspec_is_current(capsys):
    """docs/jobspec.md is ``hpservice schema --markdown`` (regenerate it when a field changes), and
    no field or subcommand lacks a description."""
    from pathlib import Path

    from hpservice.spec import fields_reference

    rows = [line for line in fields_reference().splitlines() if line.startswith("| `")]
    assert rows and not [r for r in rows if r.rstrip().endswith("|  |")], "fields without a description"
    doc = Path(__file__).resolve().parents[2] / "docs" / "jobspec.md"
    assert doc.read_text() == fields_reference(), "docs/jobspec.md is stale: hpservice schema --markdown > docs/jobspec.md"
    assert main(["schema", "--markdown"]) == 0 and capsys.readouterr().out == fields_reference()
    import argparse

    from hpservice.cli import local, server, service

    sub = argparse.ArgumentParser().add_subparsers()
    for group in (local, server, service):
        group.add_parsers(sub)
    undescribed = [name for name, p in sub.choices.items() if not (p.description or "") and name not in _helps(sub)]
    assert not undescribed, undescribed


def _helps(sub) -> set[str]:
    return {a.dest for a in sub._choices_actions if a.help}


def test_a_runs_outputs_are_absolute_paths_where_the_run_is_decided(tmp_path, monkeypatch):
    """Relative output dirs would mean each node's own working directory (a multi-node job's
    ranks would then write to different disks): with_run makes them absolute; URLs stay."""
    monkeypatch.chdir(tmp_path)
    spec = parse_job({"name": "rel", "metrics": {"dir": "runs"}}).with_run("rel-1")
    assert spec.metrics.dir == str(tmp_path / "runs")
    assert spec.checkpoint.dir == str(tmp_path / "runs" / "rel-1" / "checkpoints")
    explicit = parse_job({"name": "rel", "checkpoint": {"dir": "ckpt"}}).with_run("rel-2")
    assert explicit.checkpoint.dir == str(tmp_path / "ckpt")
    remote = parse_job({"name": "rel", "checkpoint": {"dir": "s3://bucket/x"}, "metrics": {"dir": "memory://m"}})
    remote = remote.with_run("rel-3")
    assert remote.checkpoint.dir == "s3://bucket/x" and remote.metrics.dir == "memory://m"


def test_gloo_binds_to_the_interface_of_the_nodes_address():
    import socket
    import sys

    from hpservice.launch import socket_interface

    if sys.platform == "linux":
        assert socket_interface("127.0.0.1") == "lo"
    assert socket_interface("203.0.113.254") is None  # TEST-NET: no interface of this machine has it
    hostname_ip = socket.gethostbyname(socket.gethostname())
    assert socket_interface(hostname_ip) in ({n for _, n in socket.if_nameindex()} | {None})


def test_an_elastic_job_resizes_with_the_same_global_batch_and_shard_groups():
    hsdp = parse_job({"name": "e", "resources": {"workers": 8, "min_workers": 2}, "parallelism": {"dp_shard": 2, "dp_replicate": 4}})
    assert hsdp.elastic_sizes() == [4, 2]  # not 6: 3 replicas of 2 cannot keep the global batch of 4 x 2
    two = hsdp.resized(2)  # the shard group of 2 stays; one replica left
    assert (two.parallelism.dp_replicate, two.parallelism.dp_shard, two.training.grad_accum) == (1, 2, 4)
    assert two.data.global_batch == hsdp.data.global_batch and two.resources.workers == 2
    fsdp = parse_job({"name": "e", "resources": {"workers": 4, "min_workers": 1}})
    assert fsdp.elastic_sizes() == [2, 1]
    assert fsdp.resized(1).parallelism.resolve(1) == (1, 1) and fsdp.resized(1).training.grad_accum == 4
    with pytest.raises(SpecError, match="3 workers: data-parallel size 3 does not divide 4 x grad_accum 1"):
        fsdp.resized(3)
    piped = parse_job(
        {"name": "e", "resources": {"workers": 8, "min_workers": 2}, "parallelism": {"pp": 2, "dp_shard": 2, "dp_replicate": 2}}
    )
    assert piped.elastic_sizes() == [4]  # the pipeline and its stages' shard groups stay: only replicas go
    four = piped.resized(4)
    assert (four.parallelism.pp, four.parallelism.dp_replicate, four.parallelism.dp_shard) == (2, 1, 2)
    assert four.training.grad_accum == 2  # twice the micro-batches of the same size
    with pytest.raises(SpecError, match="2 workers cannot hold shard groups of dp_shard 2 x tp 1 on each of pp 2 stages"):
        piped.resized(2)


def test_min_workers_is_checked_before_anything_starts():
    with pytest.raises(SpecError, match=r"resources\.min_workers 5 is more than resources\.workers 4"):
        parse_job({"name": "e", "resources": {"workers": 4, "min_workers": 5}})
    spec = parse_job({"name": "e", "resources": {"workers": 8, "min_workers": 3}})
    with pytest.raises(SpecError) as e:
        check_world(spec)
    assert "resources.min_workers: 3 workers: data-parallel size 3 does not divide 8" in str(e.value)
    assert "(sizes it can shrink to: 4)" in str(e.value)
    check_world(parse_job({"name": "e", "resources": {"workers": 8, "min_workers": 4}}))
    # bounded work: checking the elastic sizes of the largest allowed job is a fraction of a second,
    # and a larger one is refused (the fuzzer found a submit that checked a billion sizes)
    check_world(parse_job({"name": "e", "resources": {"workers": 100_000, "min_workers": 1}, "data": {"global_batch": 100_000}}))
    with pytest.raises(SpecError, match="less than or equal to 100000"):
        parse_job({"name": "e", "resources": {"workers": 10**9, "min_workers": 1}})
