"""Attacks on the files a job reads: a crafted checkpoint never runs code, reading one never writes.

Each attack plants a pickle whose ``__reduce__`` calls ``os.system("touch <marker>")`` in one file
of an otherwise valid checkpoint (its manifest rewritten to match, as an attacker would), then
loads it every way a checkpoint is read: ``CheckpointReader`` / ``CheckpointManager.load``
(resume), ``hpservice export`` (both formats), ``hpservice generate``, the remote (fsspec) path.
The marker must never exist. A benign checkpoint of the same shape is the control: it loads, and
bit-identically.
"""

import dataclasses
import hashlib
import io
import json
import os
import pickle
from pathlib import Path

import pytest
import torch

import hpservice.checkpoint._state as state_module
from hpservice.checkpoint import CheckpointError, CheckpointManager, CheckpointReader, UnsafeCheckpointError
from hpservice.checkpoint._untrusted import load_param_groups
from hpservice.cli import main
from hpservice.models.llama import Llama, LlamaConfig


class Evil:
    """Runs a shell command when unpickled by a loader that builds arbitrary objects."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


CFG = LlamaConfig()  # tiny, byte-level: hpservice generate needs no tokenizer


def _trained(seed: int = 0):
    torch.manual_seed(seed)
    model = Llama(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, CFG.vocab_size, (2, 9))
    logits = model(tokens[:, :-1])
    torch.nn.functional.cross_entropy(logits.reshape(-1, CFG.vocab_size), tokens[:, 1:].reshape(-1)).backward()
    opt.step()
    return model, opt


def _save(root, step: int = 2) -> Path:
    model, opt = _trained()
    extra = {"step": step, "rng": torch.get_rng_state(), "model": {"name": "llama", "config": dataclasses.asdict(CFG)}}
    CheckpointManager(root).save(step, model, opt, extra)
    return Path(root) / f"step-{step:08d}"


def _forge(checkpoint: Path, name: str, data: bytes) -> None:
    """Replace one file of a committed checkpoint, and its manifest entry, as an attacker would."""
    (checkpoint / name).write_bytes(data)
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    for f in manifest["files"]:
        if f["name"] == name:
            f["size"], f["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


def _evil_torch_file(marker: Path) -> bytes:
    buffer = io.BytesIO()
    torch.save({"step": 2, "payload": Evil(marker)}, buffer)
    return buffer.getvalue()


@pytest.fixture
def marker(tmp_path):
    path = tmp_path / "pwned"
    yield path
    assert not path.exists(), "a crafted checkpoint ran code"


def _every_reader(checkpoint: Path, *, with_extra: bool = False) -> list[str]:
    """Load ``checkpoint`` every way hpservice reads one; the error texts (each must fail)."""
    errors = []
    model, opt = _trained(seed=1)
    loads = [
        lambda: CheckpointReader(checkpoint).load(model, opt),
        lambda: CheckpointManager(checkpoint.parent).load(model, opt, step=2),
    ]
    if with_extra:  # the trainer state alone (what export and generate read first)
        loads.append(lambda: CheckpointReader(checkpoint).extra())
    for load in loads:
        with pytest.raises(CheckpointError) as e:
            load()
        errors.append(str(e.value))
    return errors


def _cli_fails(argv, capsys) -> str:
    assert main(argv) != 0
    return capsys.readouterr().err


def test_a_crafted_dcp_metadata_pickle_never_runs(tmp_path, marker, capsys):
    checkpoint = _save(tmp_path / "ckpt")
    _forge(checkpoint, ".metadata", pickle.dumps(Evil(marker)))
    for error in _every_reader(checkpoint):
        assert "refusing to load posix.system" in error, error
    assert "refusing" in _cli_fails(["export", str(checkpoint), str(tmp_path / "out.safetensors")], capsys)
    assert "refusing" in _cli_fails(["export", str(checkpoint), str(tmp_path / "hf"), "--format", "hf"], capsys)
    assert "refusing" in _cli_fails(["generate", str(checkpoint), "--prompt", "a", "--max-new-tokens", "2"], capsys)


def test_a_crafted_trainer_state_file_never_runs(tmp_path, marker, capsys):
    checkpoint = _save(tmp_path / "ckpt")
    _forge(checkpoint, "extra/rank-0.pt", _evil_torch_file(marker))
    for error in _every_reader(checkpoint, with_extra=True):
        assert "weights_only" in error, error
    assert "weights_only" in _cli_fails(["export", str(checkpoint), str(tmp_path / "hf"), "--format", "hf"], capsys)
    assert "weights_only" in _cli_fails(["generate", str(checkpoint), "--prompt", "a", "--max-new-tokens", "2"], capsys)


def test_crafted_optimizer_param_groups_never_run(tmp_path, marker, monkeypatch):
    # the writer of this checkpoint (the attacker) stores a pickle in the param_groups blob
    monkeypatch.setattr(state_module, "save_param_groups", lambda groups: io.BytesIO(pickle.dumps(Evil(marker))))
    checkpoint = _save(tmp_path / "ckpt")
    monkeypatch.undo()
    model, opt = _trained(seed=1)
    with pytest.raises(UnsafeCheckpointError, match=r"refusing to load posix\.system"):
        CheckpointReader(checkpoint).load(model, opt)
    CheckpointReader(checkpoint).load(model)  # the model alone does not read the groups


def test_param_groups_of_older_checkpoints_still_load_as_plain_data():
    groups = [{"lr": 0.1, "betas": (0.9, 0.95), "foreach": None, "params": ["w", "b"]}]
    assert load_param_groups(pickle.dumps(groups)) == groups  # the bare pickle older versions wrote
    with pytest.raises(UnsafeCheckpointError):
        load_param_groups(pickle.dumps([{"lr": Path("x")}]))  # any global, however harmless, is refused


def test_metadata_that_points_outside_the_checkpoint_is_refused(tmp_path):
    checkpoint = _save(tmp_path / "ckpt")
    metadata = pickle.loads((checkpoint / ".metadata").read_bytes())  # our own file: trusted here
    for info in metadata.storage_data.values():
        info.relative_path = "../../elsewhere/__0_0.distcp"
    _forge(checkpoint, ".metadata", pickle.dumps(metadata))
    model, opt = _trained(seed=1)
    with pytest.raises(UnsafeCheckpointError, match="outside the checkpoint directory"):
        CheckpointReader(checkpoint).load(model, opt)


def test_remote_checkpoints_are_loaded_as_safely(tmp_path, marker):
    pytest.importorskip("fsspec")
    url = f"memory://untrusted-{os.getpid()}/run"
    manager = CheckpointManager(url)
    model, opt = _trained()
    manager.save(2, model, opt, {"step": 2})
    import fsspec

    fs = fsspec.filesystem("memory")
    base = url.removeprefix("memory://") + "/step-00000002"
    fs.pipe_file(f"{base}/extra/rank-0.pt", _evil_torch_file(marker))
    fs.pipe_file(f"{base}/.metadata", pickle.dumps(Evil(marker)))
    manifest = json.loads(fs.cat_file(f"{base}/manifest.json"))
    for f in manifest["files"]:
        f["size"] = fs.info(f"{base}/{f['name']}")["size"]
    fs.pipe_file(f"{base}/manifest.json", json.dumps(manifest).encode())
    with pytest.raises(UnsafeCheckpointError, match=r"refusing to load posix\.system"):
        CheckpointReader(f"{url}/step-00000002").load(model, opt)
    with pytest.raises(UnsafeCheckpointError, match="weights_only"):
        CheckpointReader(f"{url}/step-00000002").extra()
    fs.rm(url.removeprefix("memory://"), recursive=True)


def test_the_benign_control_loads_bit_identically(tmp_path, capsys):
    checkpoint = _save(tmp_path / "ckpt")
    saved_model, saved_opt = _trained()
    model, opt = _trained(seed=1)
    extra = CheckpointReader(checkpoint).load(model, opt)
    assert extra["step"] == 2
    for (name, a), b in zip(saved_model.state_dict().items(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    for p_saved, p in zip(saved_model.parameters(), model.parameters(), strict=True):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(saved_opt.state[p_saved][key], opt.state[p][key]), key
    assert opt.param_groups[0]["betas"] == saved_opt.param_groups[0]["betas"]
    assert main(["export", str(checkpoint), str(tmp_path / "hf"), "--format", "hf"]) == 0
    assert main(["generate", str(checkpoint), "--prompt", "a", "--max-new-tokens", "2"]) == 0


def _tree(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns, p.stat().st_size) for p in sorted(root.rglob("*"))}


def test_reading_a_checkpoint_never_writes_beside_it(tmp_path):
    root = tmp_path / "shared-dataset"
    checkpoint = _save(root)
    (root / "step-00000009.tmp").mkdir()  # what a writer would clean up: not a reader's business
    (root / "step-00000007").mkdir()  # incomplete (no manifest)
    (root / "notes.txt").write_text("mine")
    before = _tree(root)
    model, opt = _trained(seed=1)
    CheckpointReader(checkpoint).load(model, opt)
    CheckpointReader(checkpoint).extra()
    assert main(["export", str(checkpoint), str(tmp_path / "out.safetensors")]) == 0
    assert _tree(root) == before


def test_a_hugging_face_directory_is_read_as_safetensors_only(tmp_path, marker, capsys):
    """``model.init_from`` and ``hpservice generate`` on an HF directory: a pickled
    ``pytorch_model.bin`` is never loaded, and an index that points outside the directory is refused."""
    from hpservice.inputs import InputError
    from hpservice.models.hf import HFFormatError, load_hf_weights, save_hf_pretrained

    model, _ = _trained()
    crafted = save_hf_pretrained(model, tmp_path / "hf-bin")
    (crafted / "model.safetensors").unlink()
    torch.save({"payload": Evil(marker)}, crafted / "pytorch_model.bin")  # what transformers would unpickle
    with pytest.raises(HFFormatError, match=r"no model\.safetensors"):
        load_hf_weights(Llama(CFG), crafted)
    assert "no model.safetensors" in _cli_fails(["generate", str(crafted), "--prompt", "a", "--max-new-tokens", "2"], capsys)

    outside = save_hf_pretrained(model, tmp_path / "elsewhere")
    escaping = save_hf_pretrained(model, tmp_path / "hf-index")
    from safetensors import safe_open

    with safe_open(str(escaping / "model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
    (escaping / "model.safetensors").unlink()
    index = {"metadata": {}, "weight_map": dict.fromkeys(keys, "../elsewhere/model.safetensors")}
    (escaping / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(InputError, match="outside"):
        load_hf_weights(Llama(CFG), escaping)
    load_hf_weights(Llama(CFG), outside)  # the control: the same weights, in their own directory
