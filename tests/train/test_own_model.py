"""A user's own model (docs/models-and-data.md, "Bring your own model"): a plain nn.Module of
torch layers trains like one device; one that cannot be initialised on meta is refused by name;
and everything knowable about a job is refused before anything starts (hpservice.preflight)."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from hpservice.preflight import check_factories_import, preflight
from hpservice.spec import SpecError, parse_job
from hpservice.train import Trainer, TrainingError

from .._jobs import tiny_llama_job as _spec

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 32


class PlainLM(nn.Module):
    """Standard torch layers only: no init_weights, no parallelize, no layers list."""

    def __init__(self, vocab: int = VOCAB, dim: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mix = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        h = self.embed(tokens)
        return self.head(self.norm(h + self.mix(h)))


class Scaled(nn.Module):
    """A layer with a parameter of its own and no reset_parameters: nothing could initialise it."""

    def __init__(self, dim: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * self.scale


def plain_lm(dim: int = 16):
    return PlainLM(dim=dim)


def scaled_lm():
    model = PlainLM()
    model.norm = Scaled(16)
    return model


def _job(tmp, **sections):
    return _spec(tmp, model={"name": "tests.train.test_own_model:plain_lm", "flavor": None}, data={"vocab_size": VOCAB}, **sections)


def _losses_and_weights(spec):
    trainer = Trainer(spec, log_to_stdout=False)
    losses = [r["loss"] for r in trainer.train()]
    full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in trainer.model.state_dict().items()}
    return losses, full


def test_a_plain_module_without_init_weights_trains_like_one_device(ranks, tmp_path):
    spec = _job(tmp_path, training={"steps": 4})
    fsdp_losses, fsdp_weights = ranks(2).run(_losses_and_weights, spec)[0]
    one_losses, one_weights = ranks(1).run(_losses_and_weights, _job(tmp_path / "one", training={"steps": 4}))[0]
    assert fsdp_losses == pytest.approx(one_losses, abs=1e-5)
    assert fsdp_losses[-1] < fsdp_losses[0]
    assert fsdp_weights.keys() == one_weights.keys()
    for name, value in fsdp_weights.items():
        torch.testing.assert_close(value, one_weights[name], atol=1e-5, rtol=1e-5, msg=name)
    # reset_parameters ran: LayerNorm starts at ones/zeros, no uninitialised memory anywhere
    assert all(torch.isfinite(v).all() for v in one_weights.values())


def _refused(spec):
    with pytest.raises(TrainingError, match=r"norm \(Scaled\) holds scale but has no reset_parameters\(\)"):
        Trainer(spec, log_to_stdout=False)
    return True


def test_a_module_that_nothing_can_initialise_is_refused_by_name(ranks, tmp_path):
    spec = _spec(tmp_path, model={"name": "tests.train.test_own_model:scaled_lm", "flavor": None}, data={"vocab_size": VOCAB})
    assert ranks(1).run(_refused, spec) == [True]


def _errors(data, **kwargs):
    with pytest.raises(SpecError) as e:
        preflight(parse_job({"name": "p", **data}), **kwargs)
    return dict(e.value.errors)


def test_a_factory_takes_no_flavor_and_its_overrides_are_tried_on_meta(tmp_path):
    name = "tests.train.test_own_model:plain_lm"
    with pytest.raises(SpecError, match=r"model.flavor: 'tiny' only applies to the built-in models"):
        parse_job({"name": "p", "model": {"name": name, "flavor": "tiny"}})
    ok = parse_job({"name": "p", "model": {"name": name, "overrides": {"dim": 8}}, "data": {"vocab_size": VOCAB}})
    preflight(ok)  # no flavor needed, nothing to fix
    assert parse_job({"name": "p"}).model.flavor is None  # a built-in's null flavor is its tiny one
    bad = _errors({"model": {"name": name, "overrides": {"width": 8}}})
    assert "unexpected keyword argument 'width'" in bad["model.overrides"]
    missing = _errors({"model": {"name": "no_such_package.models:build"}})
    assert "cannot import module 'no_such_package.models'" in missing["model.name"]
    # the service resolves names of its own: not checked when the job does not run here
    remote = {"name": "p", "model": {"name": "no_such_package.models:build"}, "data": {"vocab_size": VOCAB}}
    preflight(parse_job(remote), here=False)


def test_what_can_only_fail_is_refused_before_anything_starts(tmp_path):
    errors = _errors({
        "data": {"kind": "tokens", "path": str(tmp_path / "nope.bin"), "global_batch": 6},
        "model": {"name": "llama", "init_from": str(tmp_path)},
        "checkpoint": {"resume_from": str(tmp_path / "step-00000009")},
        "resources": {"workers": 4},
    })  # fmt: skip
    assert errors["data.path"] == f"{tmp_path / 'nope.bin'}: no such file"
    assert errors["model.init_from"] == f"{tmp_path}: no config.json (a Hugging Face checkpoint directory has one)"
    assert errors["checkpoint.resume_from"] == f"{tmp_path / 'step-00000009'}: no such checkpoint directory"
    assert errors["data.global_batch"].startswith("6 does not split over 4 data-parallel ranks x grad_accum 1: it must be a multiple of 4")
    accum = _errors({"data": {"global_batch": 8}, "training": {"grad_accum": 4}, "resources": {"workers": 4}})
    assert accum["data.global_batch"].startswith("8 does not split over 4 data-parallel ranks x grad_accum 4")
    # workers elsewhere: the layout is still checked, the files are theirs to judge
    remote = _errors({"data": {"kind": "tokens", "path": "/nope.bin", "global_batch": 6}, "resources": {"workers": 4}}, here=False)
    assert list(remote) == ["data.global_batch"]


def test_what_cannot_run_together_is_refused_by_validate_run_and_submit_alike():
    """A factory on synthetic data without data.vocab_size: refused naming the field, here and for
    workers elsewhere. A sliding window shorter than seq_len composes with cp and document masks."""
    factory = {"model": {"name": "tests.train.test_own_model:plain_lm"}}
    for here in (True, False):
        errors = _errors({**factory, "eval": {"interval": 2, "data": {"kind": "synthetic"}}}, here=here)
        assert "required with a custom model" in errors["data.vocab_size"], errors
        assert "required with a custom model" in errors["eval.data.vocab_size"], errors
        mistral = {"name": "p", "model": {"name": "mistral", "flavor": "tiny"}, "data": {"seq_len": 32}}  # window 16
        preflight(parse_job({**mistral, "parallelism": {"cp": 2}, "resources": {"workers": 2}}), here=here)
        preflight(parse_job({**mistral, "data": {"seq_len": 32, "document_mask": True, "eos_id": 0}}), here=here)


def _train_losses(spec):
    return [r["loss"] for r in Trainer(spec, log_to_stdout=False).train()]


def test_a_sliding_window_as_long_as_the_sequence_trains_under_context_parallelism(ranks, tmp_path):
    """Mistral with sliding_window >= seq_len under cp 2: the same losses as without a window."""
    runs = []
    for window in (32, None):
        spec = _spec(
            tmp_path / str(window),
            model={"name": "mistral", "flavor": "tiny", "overrides": {"sliding_window": window}},
            parallelism={"cp": 2},
            training={"steps": 3},
        )
        runs.append(ranks(2).run(_train_losses, spec)[0])
    assert runs[0] == runs[1]


@pytest.mark.parametrize(
    ("parallelism", "data"),
    [({"cp": 2}, {}), ({"cp": 2}, {"document_mask": True, "eos_id": 3}), ({}, {"document_mask": True, "eos_id": 3})],
    ids=["cp2", "cp2-documents", "documents"],
)
def test_a_sliding_window_shorter_than_the_sequence_trains_like_one_process(ranks, tmp_path, parallelism, data):
    """Mistral's window of 8 over sequences of 32 (it used to be refused under cp and document
    masks): ring and blockwise attention apply the window as one process's masked SDPA does, so
    the losses are one process's, and a window changes them."""
    def spec(name, window, layout):
        return _spec(
            tmp_path / name,
            model={"name": "mistral", "flavor": "tiny", "overrides": {"sliding_window": window}},
            parallelism=layout,
            data={"seq_len": 32, **data},
            training={"steps": 3},
        )

    one = ranks(1).run(_train_losses, spec("one", 8, {}))[0]
    cp = parallelism.get("cp", 1)
    ours = ranks(cp).run(_train_losses, spec("ours", 8, parallelism))[0]
    no_window = ranks(1).run(_train_losses, spec("none", None, {}))[0]
    assert ours == pytest.approx(one, abs=1e-5)
    assert ours != pytest.approx(no_window, abs=1e-3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a CUDA device")
def test_a_gpu_job_on_a_machine_without_one_is_refused_here_only():
    errors = _errors({"resources": {"use_gpu": True}})
    assert errors == {"resources.use_gpu": "true, but this machine has no CUDA device: use auto or false"}
    preflight(parse_job({"name": "p", "resources": {"use_gpu": True}}), devices_here=False)


def test_a_server_refuses_an_allowed_factory_that_does_not_import():
    assert check_factories_import(["tests.train.test_own_model:plain_lm"]) == []
    (error,) = check_factories_import(["tests.train.test_own_model:plain_lm", "mymodule:build"])
    assert error == ("--allow-model", "custom model 'mymodule:build': cannot import module 'mymodule': No module named 'mymodule'")
    from hpservice.serve import serve

    # a remote Ray address: the check comes before anything connects or listens
    assert serve("127.0.0.1", 1, None, "ray://127.0.0.1:1", None, allow_models=["mymodule:build"]) == 2


def test_validate_builds_the_users_factory_and_names_what_fails(tmp_path):
    package = tmp_path / "mymodels"
    package.mkdir()
    (package / "__init__.py").write_text(
        textwrap.dedent(
            """
            import torch.nn as nn

            def build(dim=8, vocab=64):
                return nn.Sequential(nn.Embedding(vocab, dim), nn.Linear(dim, vocab))
            """
        )
    )
    job = tmp_path / "job.yaml"
    job.write_text("name: mine\nmodel: {name: 'mymodels:build', overrides: {dim: 4}}\ndata: {vocab_size: 64}\n")
    env = {"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin"}
    cmd = [sys.executable, "-m", "hpservice", "validate", str(job)]
    ok = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert ok.returncode == 0, ok.stderr
    assert "valid job 'mine' (mymodels:build, 100 steps)" in ok.stdout
    wrong = subprocess.run([*cmd, "--set", "model.overrides.depth=2"], capture_output=True, text=True, timeout=120, env=env)
    assert wrong.returncode == 2
    assert "model.overrides: mymodels:build(**overrides) failed on the meta device: TypeError" in wrong.stderr
    assert "unexpected keyword argument 'depth'" in wrong.stderr


def _docs_example() -> tuple[str, str]:
    """The Python and YAML blocks of docs/models-and-data.md's "Bring your own model"."""
    text = (ROOT / "docs" / "models-and-data.md").read_text()
    section = text[text.index("## Bring your own model") :]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    job = section.split("```yaml\n", 1)[1].split("```", 1)[0]
    return code, job


def _docs_example_losses(spec):
    return [r["loss"] for r in Trainer(spec, log_to_stdout=False).train()]


def test_the_docs_own_model_example_trains_as_written(tmp_path, monkeypatch):
    from hpservice.spec import yaml_load

    code, job = _docs_example()
    (tmp_path / "mymodels").mkdir()
    (tmp_path / "mymodels" / "__init__.py").write_text(code)
    data = yaml_load(job)
    assert data["model"]["name"] == "mymodels:build" and data["runtime"] == {"py_modules": ["./mymodels"]}
    monkeypatch.chdir(tmp_path)
    data["model"]["overrides"] = {"dim": 16, "n_layers": 2, "vocab": 64}  # the docs' model, smaller
    data["data"] = {"vocab_size": 64, "seq_len": 16, "global_batch": 4}
    spec = parse_job({**data, "training": {"steps": 3}, "metrics": {"dir": str(tmp_path)}})
    preflight(spec)  # imports mymodels through runtime.py_modules, builds it on meta
    monkeypatch.syspath_prepend(str(tmp_path))  # what Ray's py_modules does on each worker
    try:
        losses = _docs_example_losses(spec)  # in this process: one rank
    finally:
        sys.modules.pop("mymodels", None)
    assert len(losses) == 3 and all(map(torch.isfinite, torch.tensor(losses)))
