"""Attacks on input confinement: a file or directory swapped for a symlink after it was checked.

The service checks input paths at submit; these tests swap what is at a checked path afterwards
(a file for a symlink to a file outside the roots, a checkpoint directory for one outside, a
shard inside a checkpoint for a link out) and check that the reader, which checks the file it
actually opened, refuses it, while the same files read from inside the roots load.
"""

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from hpservice.checkpoint import CheckpointManager, CheckpointReader
from hpservice.data import TokenFile, prepare_data
from hpservice.inputs import InputError, confine, open_input


@pytest.fixture
def roots(tmp_path):
    """A data root with a token file and a checkpoint, a secret outside it, and confinement to the
    root for this test only."""
    root, outside = tmp_path / "datasets", tmp_path / "elsewhere"
    root.mkdir()
    outside.mkdir()
    np.arange(100, dtype=np.uint16).tofile(root / "corpus.bin")
    np.full(100, 7, dtype=np.uint16).tofile(outside / "secret.bin")
    confine([root])
    yield root, outside
    confine(None)


def _swap_for_link(path: Path, target: Path) -> None:
    """What a tenant who can write under a data root does after the submit's check."""
    tmp = path.with_name(path.name + ".swap")
    tmp.symlink_to(target)
    os.replace(tmp, path)


def test_a_file_swapped_for_a_symlink_out_is_refused_when_opened(roots):
    root, outside = roots
    with open_input(root / "corpus.bin") as f:
        assert len(f.read()) == 200
    source = TokenFile(root / "corpus.bin", seed=0)  # checked (and sized) before the swap
    _swap_for_link(root / "corpus.bin", outside / "secret.bin")
    with pytest.raises(InputError, match="outside the directories this job may read"):
        source.tokens  # noqa: B018 (opening is what is refused)
    with pytest.raises(InputError):
        open_input(root / "corpus.bin")


def test_a_symlink_that_stays_inside_the_roots_is_fine(roots):
    root, _ = roots
    (root / "alias.bin").symlink_to(root / "corpus.bin")
    assert int(TokenFile(root / "alias.bin", seed=0).tokens[5]) == 5


def test_a_parent_directory_swapped_for_a_symlink_out_is_refused(roots):
    root, outside = roots
    (root / "sub").mkdir()
    (outside / "sub").mkdir()
    (outside / "sub" / "corpus.bin").write_bytes(b"\0\1" * 50)
    (root / "sub" / "corpus.bin").write_bytes(b"\0\1" * 50)
    source = TokenFile(root / "sub" / "corpus.bin", seed=0)
    os.rename(root / "sub", root / "old-sub")
    (root / "sub").symlink_to(outside / "sub", target_is_directory=True)
    with pytest.raises(InputError):
        source.tokens  # noqa: B018


def test_inputs_open_read_only(roots):
    root, _ = roots
    with pytest.raises(ValueError, match="read-only"):
        open_input(root / "corpus.bin", "r+b")


def _checkpoint(root: Path) -> Path:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    confine(None)  # writing it is the owner's business, not the confined job's
    CheckpointManager(root).save(1, model, None, {"step": 1})
    return root / "step-00000001"


def test_a_checkpoint_directory_swapped_for_one_outside_is_refused(roots):
    root, outside = roots
    inside = _checkpoint(root / "ckpts")
    elsewhere = _checkpoint(outside / "ckpts")
    confine([root])
    CheckpointReader(inside).load(torch.nn.Linear(4, 3))  # the control: inside the roots, it loads
    os.rename(inside, inside.with_name("moved"))
    inside.symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(InputError):
        CheckpointReader(inside).load(torch.nn.Linear(4, 3))


def test_a_shard_inside_a_checkpoint_linked_out_is_refused(roots):
    root, outside = roots
    checkpoint = _checkpoint(root / "ckpts")
    copy = _checkpoint(outside / "ckpts")
    confine([root])
    shard = next(checkpoint.glob("*.distcp"))
    _swap_for_link(shard, copy / shard.name)  # same size, so the manifest check passes
    with pytest.raises(InputError, match="outside the directories"):
        CheckpointReader(checkpoint).load(torch.nn.Linear(4, 3))


def test_tokenizer_and_text_inputs_are_confined(roots, tmp_path):
    pytest.importorskip("tokenizers")
    from hpservice.data import train_tokenizer

    root, outside = roots
    (root / "docs.txt").write_text("hello world, hello tokens " * 40)
    confine(None)
    train_tokenizer([root / "docs.txt"], root / "tok.json", 300)
    confine([root])
    prepare_data([root / "docs.txt"], tmp_path / "out.bin", root / "tok.json")  # inside: fine
    (outside / "private.txt").write_text("private notes " * 20)
    _swap_for_link(root / "docs.txt", outside / "private.txt")
    with pytest.raises(InputError):
        prepare_data([root / "docs.txt"], tmp_path / "out2.bin", root / "tok.json")
    _swap_for_link(root / "tok.json", outside / "private.txt")
    with pytest.raises(InputError):
        prepare_data([root / "old.txt"], tmp_path / "out3.bin", root / "tok.json")


def test_a_job_confined_by_the_service_refuses_a_data_file_swapped_after_admission(ranks, tmp_path):
    """The worker's own path: a spec as the service admits it (``input_roots`` set), whose
    ``data.path`` was swapped for a link out of the data root after the check at submit."""
    from tests._jobs import tiny_llama_job
    from tests._jobs import train as run

    root, outside = tmp_path / "datasets", tmp_path / "elsewhere"
    root.mkdir()
    outside.mkdir()
    (np.arange(4000) % 256).astype(np.uint16).tofile(outside / "secret.bin")
    (root / "corpus.bin").symlink_to(outside / "secret.bin")  # what the check at submit never saw
    spec = tiny_llama_job(tmp_path, data={"kind": "tokens", "path": str(root / "corpus.bin")})
    confined = spec.model_copy(update={"input_roots": [str(root)]})
    with pytest.raises(Exception, match="outside the directories this job may read"):
        ranks(1).run(run, confined)
    assert ranks(1).run(run, spec)[0]  # the control: unconfined (hpservice run), the same file trains
