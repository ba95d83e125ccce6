"""Trust, round 3 for the service: what a tenant's fields and files can make the server pay.

Each test attacks one class of cost through the REST API (or the worker-side function the API
hands the file to) and checks it is refused clearly (the field, the file and key, the bound) or
bounded, that nothing is stored, and that the server keeps answering other owners meanwhile.
The attacks are about the service, not the database: SQLite only."""

from __future__ import annotations

import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from hpservice.api import Settings, create_app
from hpservice.api.settings import Bounds, Principal

pytestmark = pytest.mark.databases("sqlite")

ALICE, BOB = "t-alice-0123456789", "t-bob-0123456789"
TOKENS = {ALICE: Principal("alice"), BOB: Principal("bob")}
LLAMA = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 172, "vocab_size": 256,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
TWO_WORKERS = {"workers": 2}


def _client(tmp_path, **settings) -> TestClient:
    s = Settings(data_dir=tmp_path / "data", tokens=dict(TOKENS), **settings)
    return TestClient(create_app(s, connect_ray=False, supervise=False))


def _auth(token):
    return {"Authorization": f"Bearer {token}"}


def _spec(**sections):
    spec = {"name": "tiny", "model": {"name": "llama", "flavor": "tiny"}, "training": {"steps": 3}}
    for key, value in sections.items():
        spec[key] = {**spec.get(key, {}), **value}
    return spec


def _jobs(c) -> list[str]:
    return [j.id for j in c.app.state.store.list_jobs(owner=None, state=None, name=None, limit=1000, cursor=None)]


def _refused(c, spec, field, *fragments, token=ALICE):
    """422 with a detail at ``field`` holding every fragment; nothing stored."""
    before = _jobs(c)
    r = c.post("/v1/jobs", json=spec, headers=_auth(token))
    assert r.status_code == 422, r.text
    details = r.json()["error"]["details"]
    assert any(d["path"] == field and all(f in d["message"] for f in fragments) for d in details), details
    assert _jobs(c) == before
    return details


@pytest.fixture
def models(tmp_path) -> Path:
    root = tmp_path / "models"
    (root / "m").mkdir(parents=True)
    return root


# ---- 1. a crafted config.json is a 4xx naming the file and key -------------------------------


@pytest.mark.parametrize(
    ("config", "fragment"),
    [
        ("[1, 2]", "top level is a JSON list, not an object"),
        ('"llama"', "top level is a JSON str, not an object"),
        (json.dumps({**LLAMA, "num_attention_heads": 0}), "num_attention_heads = 0"),
        (json.dumps({**LLAMA, "rope_scaling": "yarn"}), "rope_scaling = 'yarn'"),
        (json.dumps({**LLAMA, "rope_scaling": [4.0]}), "rope_scaling = list"),
        (json.dumps({**LLAMA, "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 0}}),
         "rope_scaling.original_max_position_embeddings = 0"),
        ("[" * 500_000 + "]" * 500_000, "nested more than 32 levels"),
        (json.dumps({**LLAMA, "extra": json.loads("[" * 60 + "]" * 60)}), "nested more than 32 levels"),
        (json.dumps({**LLAMA, "architectures": "LlamaForCausalLM"}), "architectures"),
        (json.dumps({**LLAMA, "hidden_size": "64"}), "hidden_size"),
        (json.dumps({**LLAMA, "num_hidden_layers": 2**40}), "num_hidden_layers"),
    ],
    ids=["array", "string", "heads-0", "rope-str", "rope-list", "yarn-orig-0", "1MiB-nested", "nested-key",
         "architectures-str", "size-str", "layers-2^40"],
)  # fmt: skip
@pytest.mark.parametrize("parallelism", [{}, {"pp": 2}], ids=["plain", "pp2"])
def test_crafted_hf_configs_are_4xx_naming_file_and_key(tmp_path, models, config, fragment, parallelism):
    (models / "m" / "config.json").write_text(config)
    with _client(tmp_path, data_roots=(models,)) as c:
        spec = _spec(model={"init_from": str(models / "m")}, parallelism=parallelism, resources=TWO_WORKERS)
        details = _refused(c, spec, "model.init_from", fragment)
        assert any("config.json" in d["message"] for d in details), details
        assert c.post("/v1/jobs", json=_spec(), headers=_auth(BOB)).status_code == 201  # still serving


# ---- 2. layout checks are arithmetic, before anything is built ---------------------------------


@pytest.fixture
def modules_built(monkeypatch):
    """How many ``nn.Module``s the process builds (a layout check must build none)."""
    built = []
    init = torch.nn.Module.__init__

    def counting(self, *args, **kwargs):
        built.append(type(self).__name__)
        init(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "__init__", counting)
    return built


def test_layout_checks_build_nothing_and_refuse_before_spending(tmp_path, models, modules_built):
    (models / "m" / "config.json").write_text(json.dumps({**LLAMA, "num_hidden_layers": 3000}))
    with _client(tmp_path, data_roots=(models,)) as c:
        _refused(c, _spec(parallelism={"pp": 2, "pp_microbatches": 10**6}, resources=TWO_WORKERS),
                 "parallelism.pp_microbatches", "more than 4096")  # fmt: skip
        for spec in (  # thousands of (tiny) blocks: admitted by the size floor, not laid out to estimate them
            _spec(model={"overrides": {"n_layers": 3000}}, parallelism={"pp": 2}, resources=TWO_WORKERS),
            _spec(model={"init_from": str(models / "m")}, parallelism={"pp": 2}, resources=TWO_WORKERS),
        ):
            r = c.post("/v1/jobs", json=spec, headers=_auth(ALICE))
            assert r.status_code == 201 and r.json()["spec"]["memory_estimate"] is None
        _refused(c, _spec(model={"overrides": {"n_layers": 3000}}, parallelism={"auto": True}, resources=TWO_WORKERS),
                 "parallelism", "the model has 3000 blocks, more than the 512")  # fmt: skip
        # the split is still checked, by counting: 3 blocks cannot make 2 x 2 stages
        _refused(c, _spec(model={"overrides": {"n_layers": 3}}, resources=TWO_WORKERS,
                          parallelism={"pp": 2, "pp_schedule": "interleaved_1f1b", "pp_virtual_stages": 2}),
                 "parallelism.pp", "4 stages", "the model has 3 blocks")  # fmt: skip
        assert modules_built == []
        # within the bound, the admitted job is estimated: its model built on the meta device
        interleaved = {"pp": 2, "pp_schedule": "interleaved_1f1b", "pp_virtual_stages": 25}
        r = c.post("/v1/jobs", json=_spec(model={"overrides": {"n_layers": 100}}, parallelism=interleaved,
                                          resources=TWO_WORKERS), headers=_auth(ALICE))  # fmt: skip
        assert r.status_code == 201 and r.json()["spec"]["memory_estimate"]["ranks"][1]["ranks"].startswith("pp rank 1")
    assert modules_built.count("Llama") >= 1


# ---- 3. a FIFO (or device) is never opened for reading, and a stuck validation stalls nobody ---


def test_a_fifo_config_is_refused_without_blocking(tmp_path, models):
    from hpservice.inputs import InputFileError, read_input
    from hpservice.models.hf import HFFormatError, config_from_hf

    fifo = models / "m" / "config.json"
    os.mkfifo(fifo)
    with _client(tmp_path, data_roots=(models,)) as c:
        spec = _spec(model={"init_from": str(models / "m")}, parallelism={"pp": 2}, resources=TWO_WORKERS)
        for _ in range(8):  # more than the validation pool's threads
            _refused(c, spec, "model.init_from", "not a regular file")
        assert c.get("/healthz").status_code == 200
    # where the worker opens it (and where a FIFO is swapped in after the check): refused, not waited on
    outcome = {}

    def read():
        for fn in (lambda: read_input(fifo, 1 << 20), lambda: config_from_hf(models / "m")):
            try:
                fn()
            except (InputFileError, HFFormatError) as e:
                outcome.setdefault("errors", []).append(str(e))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout=60)  # a hang detector, not a timing: reading a FIFO blocks forever
    assert not reader.is_alive(), "reading a FIFO input blocked"
    assert len(outcome["errors"]) == 2 and all("not a regular file" in e for e in outcome["errors"]), outcome


def test_a_stuck_validation_stalls_neither_other_owners_nor_healthz(tmp_path, monkeypatch):
    from hpservice.api.routes import jobs as jobs_routes

    release = threading.Event()
    validate = jobs_routes._validate

    def stuck_for_mallory(data):
        if data.get("name") == "stuck":
            release.wait(120)
        return validate(data)

    monkeypatch.setattr(jobs_routes, "_validate", stuck_for_mallory)
    bounds = Bounds(validation_timeout_s=10.0, validations_per_owner=2)  # room for bob on a loaded machine
    with _client(tmp_path, bounds=bounds) as c, ThreadPoolExecutor(16) as pool:
        stuck = [pool.submit(c.post, "/v1/jobs", json={**_spec(), "name": "stuck"}, headers=_auth(ALICE)) for _ in range(12)]
        try:
            # while twelve of alice's validations hang, bob submits and the server answers /healthz
            other = pool.submit(c.post, "/v1/jobs", json=_spec(), headers=_auth(BOB))
            health = pool.submit(c.get, "/healthz")
            assert health.result(timeout=60).status_code == 200
            assert other.result(timeout=60).status_code == 201
            answers = [f.result(timeout=120) for f in stuck]
        finally:
            release.set()
    # past the deadline each is a 422 naming the bound; waiting for a slot counts toward it
    assert {r.status_code for r in answers} == {422}, [r.text for r in answers]
    assert all("--validation-timeout" in r.text for r in answers)


# ---- 4, 5. sizes: each worker's floor, the largest tensor, positions ---------------------------


@pytest.mark.parametrize(
    ("model", "field", "fragment"),
    [
        ({"overrides": {"dim": 10**6}}, "model", "--max-tensor-elements"),
        ({"overrides": {"n_layers": 10**5}}, "resources", "--max-worker-memory"),
        ({"name": "qwen3_moe", "overrides": {"num_experts": 10**6}}, "resources", "--max-worker-memory"),
        ({"overrides": {"max_seq_len": 10**9}}, "model", "--max-tensor-elements"),
    ],
    ids=["hidden-1e6", "layers-1e5", "experts-1e6", "positions-1e9"],
)
def test_model_sizes_past_the_operators_bounds_are_refused(tmp_path, model, field, fragment):
    with _client(tmp_path, bounds=Bounds(max_worker_memory=8 << 30)) as c:
        _refused(c, _spec(model=model), field, fragment)
        assert c.post("/v1/jobs", json=_spec(), headers=_auth(ALICE)).status_code == 201


@pytest.mark.parametrize(
    ("config", "fragment"),
    [
        ({"hidden_size": 1_000_448, "num_attention_heads": 4, "num_key_value_heads": 2}, "--max-tensor-elements"),
        (
            {"num_hidden_layers": 100_000, "hidden_size": 1024, "intermediate_size": 2048, "num_attention_heads": 8},
            "--max-worker-memory",
        ),
        ({"max_position_embeddings": 10**9}, "--max-tensor-elements"),
    ],
    ids=["hidden-1e6", "layers-1e5", "positions-1e9"],
)
def test_sizes_in_an_init_from_config_are_refused(tmp_path, models, config, fragment):
    (models / "m" / "config.json").write_text(json.dumps({**LLAMA, **config}))
    with _client(tmp_path, data_roots=(models,), bounds=Bounds(max_worker_memory=8 << 30)) as c:
        r = c.post("/v1/jobs", json=_spec(model={"init_from": str(models / "m")}), headers=_auth(ALICE))
        assert r.status_code == 422, r.text
        details = r.json()["error"]["details"]
        assert any(fragment in d["message"] and "config.json" in d["message"] for d in details), details


def test_seq_len_past_the_models_positions_is_refused(tmp_path, models):
    (models / "m" / "config.json").write_text(json.dumps({**LLAMA, "max_position_embeddings": 512}))
    with _client(tmp_path, data_roots=(models,)) as c:
        _refused(c, _spec(data={"seq_len": 10**9, "global_batch": 1}), "data.seq_len", "128 positions")
        _refused(c, _spec(eval={"interval": 1, "data": {"kind": "synthetic", "seq_len": 4096}}), "eval.data.seq_len", "128")
        init = {"init_from": str(models / "m")}
        _refused(c, _spec(model=init, data={"seq_len": 1024}), "data.seq_len", "512")
        assert c.post("/v1/jobs", json=_spec(model=init, data={"seq_len": 512}), headers=_auth(ALICE)).status_code == 201


# ---- 6, 7. tokenizers and generation configs: bounded in bytes and in structure, every path ---


def test_tokenizers_are_bounded_in_bytes_and_vocabulary(tmp_path, monkeypatch):
    from tokenizers import Tokenizer, models

    from hpservice.data._prepare import tokenizer_vocab_size
    from hpservice.inputs import MAX_TOKENIZER_BYTES, InputFileError
    from hpservice.models import hf_text

    huge = tmp_path / "huge.json"
    with open(huge, "wb") as f:  # sparse: past the bound without writing it
        f.truncate(MAX_TOKENIZER_BYTES + 1)
    with pytest.raises(InputFileError, match="larger than"):
        tokenizer_vocab_size(huge)
    vocab = {f"t{i}": i for i in range(300)}
    small = tmp_path / "tokenizer.json"
    small.write_text(Tokenizer(models.WordLevel(vocab, unk_token="t0")).to_str())
    assert tokenizer_vocab_size(small) == 300
    monkeypatch.setattr(hf_text, "MAX_VOCAB", 256)
    with pytest.raises(ValueError, match="a vocabulary of 300 tokens, more than 256"):
        tokenizer_vocab_size(small)
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    with pytest.raises(InputFileError, match="not a regular file"):
        tokenizer_vocab_size(fifo)


def test_generation_config_keeps_only_generation_keys_and_is_bounded(tmp_path):
    from hpservice.inputs import InputFileError
    from hpservice.models.hf_text import record_from_hf

    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    junk = {"eos_token_id": [1, 2], "temperature": 0.7, "pad": [{}] * 100_000, "nested": {"a": {"b": {}}}}
    (tmp_path / "generation_config.json").write_text(json.dumps(junk))
    assert record_from_hf(tmp_path)["generation_config"] == {"eos_token_id": [1, 2], "temperature": 0.7}
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": "hot"}))
    with pytest.raises(ValueError, match="temperature"):
        record_from_hf(tmp_path)
    (tmp_path / "generation_config.json").write_text('{"pad": [' + "{}," * ((16 << 20) // 3) + "{}]}")
    with pytest.raises(InputFileError, match="larger than"):
        record_from_hf(tmp_path)


def test_every_other_reader_of_a_tenant_file_is_bounded(tmp_path, monkeypatch):
    """The class, not only the cases above: a safetensors index, a checkpoint's manifest and
    trainer state, a JSONL record, a plain-text document and the tokenizer a token cache is keyed
    by are each refused past their bound (here made small) before they are held whole, and a
    malformed index is a clear error, not a TypeError."""
    from hpservice import inputs
    from hpservice.checkpoint import _reader
    from hpservice.checkpoint._errors import CheckpointError
    from hpservice.data import _prepare
    from hpservice.inputs import InputFileError
    from hpservice.models import hf
    from hpservice.train import _dataset

    model = tmp_path / "model"
    model.mkdir()
    index = model / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {f"layers.{i}.w": "model-1.safetensors" for i in range(100)}}))
    monkeypatch.setattr(hf, "MAX_INDEX_BYTES", 1000)
    with pytest.raises(InputFileError, match="larger than 1000 bytes"):
        hf._SafetensorsDir(model)
    for bad in ({"weight_map": ["a"]}, [1], {"weight_map": {"a": {"b": 1}}}):
        index.write_text(json.dumps(bad))
        with pytest.raises(hf.HFFormatError, match="not a safetensors index"):
            hf._SafetensorsDir(model)

    checkpoint = tmp_path / "step-1"
    checkpoint.mkdir()
    (checkpoint / "manifest.json").write_text(json.dumps({"files": [{"name": f"f{i}", "size": 1} for i in range(100)]}))
    monkeypatch.setattr(_reader, "MAX_INDEX_BYTES", 1000)
    with pytest.raises(CheckpointError, match="larger than 1000 bytes"):
        _reader.verify_files(checkpoint)

    monkeypatch.setattr(_prepare, "MAX_DOCUMENT_BYTES", 100)
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text(json.dumps({"text": "short"}) + "\n" + json.dumps({"text": "x" * 10_000}) + "\n")
    documents = _prepare._documents([jsonl], "text")
    assert next(documents) == "short"
    with pytest.raises(InputFileError, match=r"docs\.jsonl: a line longer than 100 characters"):
        next(documents)
    text = tmp_path / "book.txt"
    text.write_text("x" * 10_000)
    with pytest.raises(_prepare.DataPrepError, match=r"book\.txt: longer than 100 characters"):
        list(_prepare._documents([text], "text"))

    tokenizer = tmp_path / "tokenizer.json"
    with open(tokenizer, "wb") as f:  # sparse: past the bound without writing it
        f.truncate(inputs.MAX_TOKENIZER_BYTES + 1)
    with pytest.raises(InputFileError, match="larger than"):
        _dataset._file_key(str(text), str(tokenizer))


# ---- 8. storage: checkpoints kept, bytes per job and per owner, log lines ---------------------


def test_storage_bounds_at_admission(tmp_path):
    bounds = Bounds(max_job_bytes=10 << 20, max_owner_bytes=30 << 20)
    with _client(tmp_path, bounds=bounds) as c:
        _refused(c, _spec(checkpoint={"interval": 1, "keep": 10**9}), "checkpoint.keep", "--max-checkpoints-kept")
        ok = c.post("/v1/jobs", json=_spec(), headers=_auth(ALICE)).json()
        assert ok["spec"]["storage_limit_bytes"] == 10 << 20  # the per-job bound, a submitted value replaced
        mine = Path(ok["spec"]["metrics"]["dir"]) / "blob"
        mine.parent.mkdir(parents=True, exist_ok=True)
        with open(mine, "wb") as f:
            f.write(os.urandom(25 << 20))
        left = c.post("/v1/jobs", json={**_spec(), "storage_limit_bytes": 10**15}, headers=_auth(ALICE)).json()
        assert 0 < left["spec"]["storage_limit_bytes"] <= 5 << 20  # what is left of alice's
        with open(mine, "ab") as f:
            f.write(os.urandom(6 << 20))
        _refused(c, _spec(), "storage", "--max-owner-bytes")
        assert c.post("/v1/jobs", json=_spec(), headers=_auth(BOB)).status_code == 201  # bob's own budget


def test_a_job_past_its_storage_budget_stops_clearly(tmp_path):
    from hpservice.train import Trainer
    from hpservice.train._storage import StorageLimitError
    from tests._jobs import tiny_llama_job

    spec = tiny_llama_job(tmp_path, checkpoint={"interval": 1, "keep": 20})
    spec = spec.model_copy(update={"storage_limit_bytes": 64 << 10})  # less than one tiny checkpoint
    trainer = Trainer(spec, log_to_stdout=False)
    with pytest.raises(StorageLimitError, match="more than the 65536 bytes this server allows") as e:
        trainer.train()
    assert "checkpoint.keep" in str(e.value)
    assert trainer.step == 1  # stopped after the first checkpoint, not at the end


class _Handle:
    def __init__(self):
        self.stops = []

    def stop(self, **kwargs):
        self.stops.append(kwargs)


def test_a_job_past_its_log_lines_is_stopped_failed_and_its_extra_lines_dropped(tmp_path):
    from hpservice.api.store import Store
    from hpservice.api.supervisor import Supervisor

    store = Store(f"sqlite:///{tmp_path / 'db.sqlite'}")
    job_id = store.create_job("j1", "tiny", "alice", _spec(), 3, None)[0].id
    supervisor = Supervisor(store, max_log_lines_per_job=5)
    handle = _Handle()
    lines = [{"rank": 0, "step": 1, "time": float(i + 1), "line": f"line {i}", "seq": i + 1} for i in range(8)]
    supervisor.store.add_logs(job_id, supervisor._within_log_bound(job_id, handle, lines[:3]))
    assert handle.stops == []
    supervisor.store.add_logs(job_id, supervisor._within_log_bound(job_id, handle, lines[3:]))
    supervisor.store.add_logs(job_id, supervisor._within_log_bound(job_id, handle, lines[3:]))
    assert [line["line"] for line in store.logs(job_id, None, None)[0]] == [f"line {i}" for i in range(5)]
    assert len(handle.stops) == 1 and "--max-log-lines-per-job" in handle.stops[0]["failed_by"]
    assert "--max-log-lines-per-job" in store.get_job(job_id).message
    store.close()


def test_a_stop_for_a_bound_ends_the_job_failed():
    from hpservice.actors.coordinator import Coordinator
    from hpservice.jobs import JobState

    coordinator = Coordinator.__ray_actor_class__.__new__(Coordinator.__ray_actor_class__)
    coordinator._failed_by, coordinator._preempted_by = "the job wrote more than 5 log lines", None
    assert coordinator._stopped("stopped gracefully at step 3") == (
        JobState.FAILED, "the job wrote more than 5 log lines; stopped gracefully at step 3")  # fmt: skip


# ---- 9. exports: one per directory at a time, a bound per owner, never an uncaught 500 -------


def _train_and_checkpoint(spec):
    from tests._jobs import train

    return train(spec)[0]["loss"]


def test_concurrent_exports_of_one_checkpoint_all_succeed(ranks, tmp_path):
    from hpservice.api.admission import job_dir
    from hpservice.models.hf import export_checkpoint_hf
    from tests._jobs import tiny_llama_job

    with _client(tmp_path) as c:
        job = c.post("/v1/jobs", json=_spec(), headers=_auth(ALICE)).json()
        home = job_dir(c.app.state.settings, "alice", job["id"])
        spec = tiny_llama_job(home, training={"steps": 1}, checkpoint={"interval": 1, "dir": str(home / "ckpt")})
        ranks(1).run(_train_and_checkpoint, spec)
        step_dir = str(home / "ckpt" / "step-00000001")
        c.app.state.store.update_status(job["id"], {"state": "SUCCEEDED", "checkpoints": [{"step": 1, "path": step_dir}]})
        with ThreadPoolExecutor(24) as pool:
            answers = list(pool.map(lambda _: c.post(f"/v1/jobs/{job['id']}/checkpoints/1/export", headers=_auth(ALICE)), range(24)))
        assert {r.status_code for r in answers} <= {200, 429}, [r.text for r in answers if r.status_code not in (200, 429)]
        assert any(r.status_code == 200 for r in answers)
        out = Path(answers[0].json()["path"]) if answers[0].status_code == 200 else home / "exports" / "step-00000001-hf"
    # without the route's single flight too: each export writes its own temporary directory
    with ThreadPoolExecutor(6) as pool:
        done = list(pool.map(lambda _: export_checkpoint_hf(step_dir, out), range(6)))
    assert all(d["tensors"] == done[0]["tensors"] > 0 for d in done)
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name]  # no temporary directory left behind
    import transformers

    assert transformers.AutoModelForCausalLM.from_pretrained(out) is not None


def test_an_export_runs_in_a_worker_process_and_one_that_dies_takes_only_that_worker():
    import signal
    from concurrent.futures.process import BrokenProcessPool

    from hpservice.api.limits import Exports

    exports = Exports(per_owner=1, processes=1)
    try:
        worker = exports.in_worker_process(os.getpid)
        assert worker != os.getpid()
        with pytest.raises(BrokenProcessPool):
            exports.in_worker_process(os.kill, worker, signal.SIGKILL)  # an export killed (out of memory)
        assert exports.in_worker_process(os.getpid) not in (worker, os.getpid())  # a new worker serves the next
    finally:
        exports.shutdown()


def test_exports_per_owner_are_bounded_and_one_directory_is_written_once():
    import asyncio

    from hpservice.api.errors import APIError
    from hpservice.api.limits import Exports

    async def scenario():
        exports, release, calls = Exports(per_owner=1), threading.Event(), []

        def slow():
            calls.append(1)
            release.wait(60)
            return {"files": [], "tensors": 1}

        first = asyncio.ensure_future(exports.run("alice", "/out/a", slow))
        same = asyncio.ensure_future(exports.run("alice", "/out/a", slow))
        await asyncio.sleep(0.05)
        with pytest.raises(APIError) as refused:
            await exports.run("alice", "/out/b", slow)
        other_owner = asyncio.ensure_future(exports.run("bob", "/out/c", slow))
        await asyncio.sleep(0.05)
        release.set()
        results = await asyncio.gather(first, same, other_owner)
        return refused.value, results, len(calls)

    refused, results, calls = asyncio.run(scenario())
    assert refused.status == 429 and "--exports-per-owner" in refused.message
    assert results[0] is results[1]  # the second request for /out/a got the first one's result
    assert calls == 2  # alice's /out/a once, bob's once


# ---- 10. admission runs before anything reads a tenant-named path -----------------------------


@pytest.mark.parametrize("parallelism", [{"pp": 3}, {"ep": 2}], ids=["pp3", "ep2"])
def test_another_owners_file_is_refused_before_it_is_read(tmp_path, monkeypatch, parallelism):
    with _client(tmp_path) as c:
        alices = c.post("/v1/jobs", json=_spec(), headers=_auth(ALICE)).json()
        hers = Path(alices["spec"]["metrics"]["dir"]) / "hf"
        hers.mkdir(parents=True)
        config = hers / "config.json"
        config.write_text(json.dumps(LLAMA))
        os.utime(config, (1_000_000, os.stat(config).st_mtime))  # atime before mtime: any read moves it
        opened = []
        real_open = os.open

        def watching(path, *args, **kwargs):
            if str(hers) in os.fspath(path):
                opened.append(os.fspath(path))
            return real_open(path, *args, **kwargs)

        monkeypatch.setattr(os, "open", watching)
        spec = _spec(model={"init_from": str(hers)}, parallelism=parallelism, resources={"workers": 6},
                     data={"global_batch": 12})
        r = c.post("/v1/jobs", json=spec, headers=_auth(BOB))
        monkeypatch.undo()
        assert r.status_code == 422, r.text
        messages = " ".join(d["message"] for d in r.json()["error"]["details"])
        assert "neither a checkpoint of bob's own jobs" in messages
        for leak in ("blocks", "mixture", "experts", "layers", "hidden"):
            assert leak not in messages, messages
        assert opened == []
        assert os.stat(config).st_atime == 1_000_000


# ---- the operator's options -------------------------------------------------------------------


def test_serve_takes_each_bound_and_refuses_a_bad_one(capsys):
    from hpservice.api.settings import bounds_from_options
    from hpservice.cli import main

    remote = ["serve", "--ray-address", "ray://127.0.0.1:1", "--port", "1"]  # refused before it connects
    assert main([*remote, "--max-job-bytes", "lots"]) == 2
    assert "--max-job-bytes: 'lots' is not a size" in capsys.readouterr().err
    assert main([*remote, "--validations-per-owner", "0"]) == 2
    assert "--validations-per-owner must be an integer >= 1" in capsys.readouterr().err
    bounds = bounds_from_options(max_worker_memory="8G", max_owner_bytes="1.5T", validation_timeout=5.0, exports_per_owner=1)
    assert (bounds.max_worker_memory, bounds.max_owner_bytes) == (8 << 30, int(1.5 * (1 << 40)))
    assert (bounds.validation_timeout_s, bounds.exports_per_owner, bounds.max_checkpoints_kept) == (5.0, 1, 20)
