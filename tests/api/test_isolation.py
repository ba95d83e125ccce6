"""Tenant isolation, attacked: job specs that name code or reach files beyond what the operator
allows are 422 at submit (naming the field and the rule) and nothing is stored; accepted jobs
write only under their own directory; tokens files are strict; tokens stay out of logs."""

import json
import logging
import os

import pytest
from fastapi.testclient import TestClient

from hpservice.api import Settings, admission, create_app
from hpservice.api.logs import RedactTokens, redact
from hpservice.api.settings import Principal, load_tokens

ALICE, BOB, ADMIN = "t-alice-0123456789", "t-bob-0123456789", "t-admin-0123456789"
TOKENS = {ALICE: Principal("alice"), BOB: Principal("bob"), ADMIN: Principal("ops", admin=True)}


def _client(tmp_path, **settings):
    s = Settings(data_dir=tmp_path / "data", tokens=dict(TOKENS), **settings)
    return TestClient(create_app(s, connect_ray=False, supervise=False))


def _auth(token):
    return {"Authorization": f"Bearer {token}"}


def _spec(**sections):
    spec = {"name": "tiny", "model": {"name": "llama", "flavor": "tiny"}, "training": {"steps": 3}}
    for key, value in sections.items():
        spec[key] = {**spec.get(key, {}), **value}
    return spec


def _rejected(c, spec, field, fragment, token=ALICE):
    before = c.get("/v1/jobs", headers=_auth(ADMIN)).json()["items"]
    r = c.post("/v1/jobs", json=spec, headers=_auth(token))
    assert r.status_code == 422, r.text
    details = r.json()["error"]["details"]
    assert any(d["path"] == field and fragment in d["message"] for d in details), details
    assert c.get("/v1/jobs", headers=_auth(ADMIN)).json()["items"] == before  # nothing stored


# ---- code ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("factory", ["subprocess:run", "os:system", "builtins:eval", "hpservice.models:build_model"])
def test_model_factories_outside_the_allowlist_are_refused(tmp_path, factory):
    with _client(tmp_path) as c:
        spec = _spec(model={"name": factory, "flavor": None, "overrides": {"args": "touch /tmp/pwned"}})
        _rejected(c, spec, "model.name", "not a built-in model nor a factory this server allows (allowed: deepseek_v3, llama, mistral, mlp, qwen2, qwen3, qwen3_moe")


def test_allowed_factories_by_setting_and_entry_point(tmp_path, monkeypatch):
    monkeypatch.setattr(admission, "entry_point_factories", lambda: {"team-net": "team_models.nets:make"})
    with _client(tmp_path, model_factories=("tests.api._factories:tiny",)) as c:
        data = {"kind": "synthetic", "vocab_size": 64}  # a factory's vocabulary is not known before it is built
        tiny = _spec(model={"name": "tests.api._factories:tiny", "flavor": None}, data=data)
        ok = c.post("/v1/jobs", json=tiny, headers=_auth(ALICE))
        assert ok.status_code == 201, ok.text
        no_vocab = c.post("/v1/jobs", json={**tiny, "data": {"kind": "synthetic"}}, headers=_auth(ALICE))
        assert no_vocab.status_code == 422 and "data.vocab_size" in no_vocab.text
        by_name = c.post("/v1/jobs", json=_spec(model={"name": "team-net", "flavor": None}, data=data), headers=_auth(ALICE))
        assert by_name.status_code == 201 and by_name.json()["spec"]["model"]["name"] == "team_models.nets:make"
        r = c.post("/v1/jobs", json=_spec(model={"name": "os:system", "flavor": None}), headers=_auth(ALICE))
        assert r.status_code == 422 and "tests.api._factories:tiny" in r.text and "team-net" in r.text


# ---- outputs ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("section", "value"),
    [
        ("checkpoint", "/etc"),
        ("checkpoint", "../../../elsewhere"),
        ("checkpoint", "s3://bucket/anyone"),
        ("metrics", "/tmp"),
        ("metrics", "runs/../../.."),
    ],
)
def test_outputs_outside_the_jobs_own_directory_are_refused(tmp_path, section, value):
    with _client(tmp_path) as c:
        _rejected(c, _spec(**{section: {"dir": value}}), f"{section}.dir", value)


def test_outputs_resolve_inside_the_jobs_own_directory_and_two_jobs_never_share_one(tmp_path):
    with _client(tmp_path) as c:
        a = c.post("/v1/jobs", json=_spec(checkpoint={"interval": 2}), headers=_auth(ALICE)).json()
        b = c.post("/v1/jobs", json=_spec(checkpoint={"interval": 2}), headers=_auth(ALICE)).json()
        rel = c.post("/v1/jobs", json=_spec(checkpoint={"dir": "mine"}), headers=_auth(BOB)).json()
    data = os.path.realpath(tmp_path / "data")
    for job in (a, b):
        home = f"{data}/jobs/alice/{job['id']}"
        assert job["spec"]["run_id"] == job["id"]
        assert job["spec"]["metrics"]["dir"] == f"{home}/runs"
        assert job["spec"]["checkpoint"]["dir"] == f"{home}/runs/{job['id']}/checkpoints"
    assert a["spec"]["checkpoint"]["dir"] != b["spec"]["checkpoint"]["dir"]  # same name, own outputs
    assert rel["spec"]["checkpoint"]["dir"] == f"{data}/jobs/bob/{rel['id']}/mine"


# ---- inputs -------------------------------------------------------------------------------------


def test_input_files_only_from_the_operators_data_roots(tmp_path):
    root = tmp_path / "datasets"
    root.mkdir()
    (root / "corpus.txt").write_text("hello world " * 100)
    (root / "leak.txt").symlink_to("/etc/passwd")
    text = {"kind": "text"}
    with _client(tmp_path) as c:  # no data roots: no files at all
        _rejected(c, _spec(data={**text, "path": str(root / "corpus.txt")}), "data.path", "reads no input files")
    with _client(tmp_path, data_roots=(root,)) as c:
        _rejected(c, _spec(data={**text, "path": "/etc/shadow"}), "data.path", "outside the allowed data roots")
        _rejected(c, _spec(data={**text, "path": f"{root}/../../../etc/shadow"}), "data.path", "outside")
        _rejected(c, _spec(data={**text, "path": str(root / "leak.txt")}), "data.path", "outside")  # symlink out
        held_out = {"data": {**text, "path": "/etc/passwd"}, "interval": 1}
        _rejected(c, _spec(eval=held_out), "eval.data.path", "outside the allowed data roots")
        tokenized = {**text, "path": str(root / "corpus.txt"), "tokenizer": "/etc/passwd"}
        _rejected(c, _spec(data=tokenized), "data.tokenizer", "outside the allowed data roots")
        ok = c.post("/v1/jobs", json=_spec(data={**text, "path": str(root / "corpus.txt")}), headers=_auth(ALICE))
        assert ok.status_code == 201, ok.text


def test_chat_inputs_only_from_the_data_roots_and_checked_before_they_are_stored(tmp_path):
    # every file a chat job names (its sources, globs included, its tokenizer, a template file) is an
    # input under the data roots; a record that does not match the format is refused at submit
    from tests.data.chat_fixtures import CONVERSATIONS, tokenizer_dir

    root = tmp_path / "datasets"
    root.mkdir()
    tok = tokenizer_dir(root, "qwen2_5")
    (root / "chats.jsonl").write_text(json.dumps({"messages": CONVERSATIONS["one turn"]}) + "\n")
    (root / "bad.jsonl").write_text(json.dumps({"messages": [{"role": "wizard", "content": "x"}]}) + "\n")
    chat = {"kind": "chat", "path": str(root / "chats.jsonl"), "tokenizer": str(tok), "seq_len": 64}
    with _client(tmp_path, data_roots=(root,)) as c:
        _rejected(c, _spec(data={**chat, "path": f"{root}/../../../etc/*"}), "data.path", "outside the allowed data roots")
        _rejected(c, _spec(data={**chat, "tokenizer": "/etc"}), "data.tokenizer", "outside the allowed data roots")
        _rejected(c, _spec(data={**chat, "chat_template": "/etc/passwd"}), "data.chat_template", "outside the allowed data roots")
        mixture = {**chat, "path": None, "sources": [{"path": str(root / "chats.jsonl")}, {"path": "/etc/passwd", "weight": 2.0}]}
        _rejected(c, _spec(data=mixture), "data.sources[1].path", "outside the allowed data roots")
        _rejected(c, _spec(data={**chat, "path": str(root / "bad.jsonl")}), "data.path", "bad.jsonl:1: messages[0].role: unknown role 'wizard'")
        ok = c.post("/v1/jobs", json=_spec(data=chat), headers=_auth(ALICE))
        assert ok.status_code == 201, ok.text


def test_resuming_another_owners_checkpoint_is_refused(tmp_path):
    with _client(tmp_path) as c:
        bobs = c.post("/v1/jobs", json=_spec(checkpoint={"interval": 1}), headers=_auth(BOB)).json()
        bob_ckpt = f"{bobs['spec']['checkpoint']['dir']}/step-00000001"
        spec = _spec(checkpoint={"resume_from": bob_ckpt})
        r = c.post("/v1/jobs", json=spec, headers=_auth(ALICE))
        assert r.status_code == 422 and r.json()["error"]["details"][0]["path"] == "checkpoint.resume_from"
        assert c.post("/v1/jobs", json=spec, headers=_auth(BOB)).status_code == 201  # the owner may
        assert c.post("/v1/jobs", json=spec, headers=_auth(ADMIN)).status_code == 201  # and an admin
        for evil in ("/etc", f"{tmp_path}/data/hpservice.db", "s3://other/step-1"):
            r = c.post("/v1/jobs", json=_spec(checkpoint={"resume_from": evil}), headers=_auth(ALICE))
            assert r.status_code == 422, evil


# ---- tokens -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ('tok-aaaaaaaaaaaaaaaa: {owner: alice, admin: "false"}\n', "admin must be true or false"),
        ("tok-aaaaaaaaaaaaaaaa: {owner: alice, admn: true}\n", "unknown keys ['admn']"),
        ("tok-aaaaaaaaaaaaaaaa: {owner: ../../etc}\n", "owner must be a name"),
        ("tok-aaaaaaaaaaaaaaaa: {admin: true}\n", "owner must be a name"),
        ("tok-aaaaaaaaaaaaaaaa: alice\n", "expected {owner"),
    ],
)
def test_tokens_file_is_strict_and_errors_never_show_the_token(tmp_path, text, fragment):
    f = tmp_path / "tokens.yaml"
    f.write_text(text)
    with pytest.raises(ValueError, match="entry 1") as info:
        load_tokens(str(f), env="")
    assert fragment in str(info.value) and "tok-aaaa" not in str(info.value)


def test_tokens_from_the_environment_are_strict():
    assert load_tokens(None, env="abcdefghijklmnop=alice:admin")["abcdefghijklmnop"] == Principal("alice", True)
    with pytest.raises(ValueError, match="must be 'admin'"):
        load_tokens(None, env="abcdefghijklmnop=alice:root")
    settings = Settings(tokens=load_tokens(None, env="abcdefghijklmnop=alice"))
    assert settings.principal_for("abcdefghijklmnop") == Principal("alice")
    assert settings.principal_for("abcdefghijklmnoq") is None and settings.principal_for("") is None


def test_the_sse_token_never_reaches_a_log_line(caplog):
    assert redact("GET /v1/jobs/x/events?token=s3cret&x=1 HTTP/1.1") == "GET /v1/jobs/x/events?token=<redacted>&x=1 HTTP/1.1"
    logger = logging.getLogger("test.access")
    logger.addFilter(RedactTokens())
    with caplog.at_level(logging.INFO, logger="test.access"):
        # uvicorn's access record: the path with its query string is an argument
        logger.info('%s - "%s %s HTTP/%s" %d', "127.0.0.1:1", "GET", "/v1/jobs/x/events?token=s3cret", "1.1", 200)
    assert "s3cret" not in caplog.text and "token=<redacted>" in caplog.text


def test_the_operator_can_close_the_docs(tmp_path):
    with _client(tmp_path) as c:
        assert c.get("/docs").status_code == 200 and c.get("/openapi.json").status_code == 200
    with _client(tmp_path, docs=False) as c:
        assert c.get("/docs").status_code == 404 and c.get("/openapi.json").status_code == 404
        assert c.get("/healthz").status_code == 200


def test_init_from_reads_only_the_owners_jobs_or_a_data_root(tmp_path):
    root = tmp_path / "models"
    (root / "llama-hf").mkdir(parents=True)
    (root / "llama-hf" / "config.json").write_text("{}")
    with _client(tmp_path, data_roots=(root,)) as c:
        # read where it is allowed: a config of no family we import is refused before anything runs
        _rejected(c, _spec(model={"init_from": str(root / "llama-hf")}), "model.init_from", "not a family we import")
        llama = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 172, "vocab_size": 256,
                 "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
        # config.json is read at submit: a symlink out of the checkpoint (to another owner's JSON
        # or a device) is refused without saying what it reached, and a huge file is not read whole
        secret = tmp_path / "secret-config.json"
        secret.write_text(json.dumps({**llama, "architectures": ["SecretArch"]}))
        (root / "llama-hf" / "config.json").unlink()
        (root / "llama-hf" / "config.json").symlink_to(secret)
        _rejected(c, _spec(model={"init_from": str(root / "llama-hf")}), "model.init_from", "resolves outside the checkpoint")
        (root / "llama-hf" / "config.json").unlink()
        (root / "llama-hf" / "config.json").write_text(" " * (2 << 20) + "{}")
        _rejected(c, _spec(model={"init_from": str(root / "llama-hf")}), "model.init_from", "not a model config")
        (root / "llama-hf" / "config.json").write_text(json.dumps(llama))
        bobs = c.post("/v1/jobs", json=_spec(), headers=_auth(BOB)).json()
        theirs = f"{bobs['spec']['metrics']['dir']}/hf"
        _rejected(c, _spec(model={"init_from": theirs}), "model.init_from", "neither a checkpoint of alice's own jobs")
        _rejected(c, _spec(model={"init_from": "/etc"}), "model.init_from", "nor under an allowed data root")
        ok = c.post("/v1/jobs", json=_spec(model={"init_from": str(root / "llama-hf")}), headers=_auth(ALICE))
        assert ok.status_code == 201 and ok.json()["spec"]["model"]["init_from"] == os.path.realpath(root / "llama-hf")


def test_tracking_sinks_stay_inside_the_job(tmp_path):
    """metrics.mlflow / metrics.wandb must not send a tenant's run anywhere else: an MLflow tracking
    URI and W&B online mode are refused; the defaults (stores in the job's own directory) pass."""
    with _client(tmp_path) as c:
        _rejected(c, _spec(metrics={"mlflow": {"tracking_uri": "http://10.0.0.9:5000"}}), "metrics.mlflow.tracking_uri", "not allowed")
        _rejected(c, _spec(metrics={"mlflow": {"tracking_uri": "sqlite:////etc/x.db"}}), "metrics.mlflow.tracking_uri", "not allowed")
        _rejected(c, _spec(metrics={"wandb": {"mode": "online"}}), "metrics.wandb.mode", "only 'offline'")
        ok = c.post("/v1/jobs", json=_spec(metrics={"mlflow": {}, "wandb": {}}), headers=_auth(ALICE))
        assert ok.status_code == 201, ok.text


def test_a_tenant_cannot_ship_code_with_its_job(tmp_path):
    """``runtime.py_modules`` / ``working_dir`` would make Ray upload a directory of the server's
    disk into every worker and import it: refused, for admins too; nothing is stored."""
    with _client(tmp_path) as c:
        for runtime in ({"py_modules": [str(tmp_path)]}, {"working_dir": "/etc"}):
            field = f"runtime.{next(iter(runtime))}"
            _rejected(c, _spec(runtime=runtime), field, "not allowed on this server")
            _rejected(c, _spec(runtime=runtime), field, "not allowed on this server", token=ADMIN)


def test_a_tenant_cannot_raise_its_own_priority_above_what_the_operator_allows(tmp_path):
    """A self-assigned priority would preempt every other owner's jobs: a job may ask for at most
    its owner's priority from the quotas file (0 without one); admins may ask for any."""
    from hpservice.api.scheduler import Quota, Quotas

    with _client(tmp_path, quotas=Quotas({"bob": Quota(priority=5)})) as c:
        _rejected(c, _spec(scheduling={"priority": 1000}), "scheduling.priority", "1000 is above 0, the highest")
        _rejected(c, _spec(scheduling={"priority": 6}), "scheduling.priority", "6 is above 5", token=BOB)
        for token, priority in ((ALICE, -5), (ALICE, 0), (BOB, 5), (ADMIN, 1000)):
            r = c.post("/v1/jobs", json=_spec(scheduling={"priority": priority}), headers=_auth(token))
            assert r.status_code == 201, (token, priority, r.text)


# ---- a job's size -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("resources", "field", "fragment"),
    [
        ({"workers": 100000, "cpus_per_worker": 1e-9}, "resources.workers", "the most workers one job may have"),
        ({"workers": 100000, "cpus_per_worker": 1e-9}, "resources.cpus_per_worker", "smallest CPU share"),
        ({"workers": 300, "cpus_per_worker": 0.01}, "resources.cpus_per_worker", "less than 0.1"),
        ({"workers": 1025}, "resources.workers", "more than 1024"),
    ],
)
def test_a_jobs_size_is_bounded_without_any_quotas_file(tmp_path, resources, field, fragment):
    spec = _spec(resources=resources, data={"global_batch": resources["workers"]})  # a layout that divides
    with _client(tmp_path) as c:
        _rejected(c, spec, field, fragment)
        _rejected(c, spec, field, fragment, token=ADMIN)  # for every owner


def test_the_operator_sets_a_jobs_size_limits(tmp_path):
    with _client(tmp_path, max_workers_per_job=4, min_cpus_per_worker=0.5) as c:
        _rejected(c, _spec(resources={"workers": 5}, data={"global_batch": 5}), "resources.workers", "more than 4")
        _rejected(c, _spec(resources={"workers": 2, "cpus_per_worker": 0.25}), "resources.cpus_per_worker", "0.5")
        ok = c.post("/v1/jobs", json=_spec(resources={"workers": 4, "cpus_per_worker": 0.5}), headers=_auth(ALICE))
        assert ok.status_code == 201, ok.text


def test_the_input_roots_a_worker_confines_to_are_the_servers_never_the_tenants(tmp_path):
    root = tmp_path / "datasets"
    root.mkdir()
    with _client(tmp_path, data_roots=(root,)) as c:
        r = c.post("/v1/jobs", json={**_spec(), "input_roots": ["/"]}, headers=_auth(ALICE))
        assert r.status_code == 201, r.text
        jobs = (tmp_path / "data").resolve() / "jobs"
        assert r.json()["spec"]["input_roots"] == [str(root.resolve()), str(jobs / "alice")]
        r = c.post("/v1/jobs", json=_spec(), headers=_auth(ADMIN))
        assert r.json()["spec"]["input_roots"] == [str(root.resolve()), str(jobs)]  # an admin reads every owner's
