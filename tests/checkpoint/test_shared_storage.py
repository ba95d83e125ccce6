"""The commit protocol on storage that is not one directory for every rank (node-local disks,
simulated by giving each rank process its own working directory and a relative checkpoint dir):
the manager refuses it when created, a commit that lacks another rank's files is refused, and a
resume from latest never lets one rank load while another starts fresh."""

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hpservice.checkpoint import CheckpointManager, CheckpointStorageError

from .test_checkpoint import _model, _step


def _node_local_disks(base):
    os.chdir(Path(base) / f"node{dist.get_rank()}")  # the same relative path, a different disk per rank
    with pytest.raises(CheckpointStorageError) as e:
        CheckpointManager("ckpt")
    return str(e.value)


def test_a_checkpoint_dir_each_node_has_its_own_copy_of_is_refused_on_every_rank(ranks, tmp_path):
    for r in range(2):
        (tmp_path / f"node{r}").mkdir()
    messages = ranks(2).run(_node_local_disks, str(tmp_path))
    assert messages[0] == messages[1]  # every rank raises, none waits for the others
    assert "is not shared between the job's nodes: rank 1 (on " in messages[0]
    assert "use a directory every node mounts" in messages[0]


def _rank1_files_vanish(root):
    model = _model((2,))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    manager = CheckpointManager(root)
    _step(model, opt, 0)
    manager.save(1, model, opt)
    mine = json.loads((Path(root) / "step-00000001" / "manifest.json").read_text())["files"]

    def lose_rank1_files():  # as if rank 1 had written to its own node's disk
        if dist.get_rank() == 1:
            tmp = Path(root) / "step-00000002.tmp"
            for name in ("__1_0.distcp", "extra/rank-1.pt"):
                (tmp / name).unlink()
        dist.barrier()  # rank 0 checks after the loss

    manager._before_commit = lose_rank1_files
    _step(model, opt, 1)
    with pytest.raises(CheckpointStorageError) as e:
        manager.save(2, model, opt)
    assert manager.latest()["step"] == 1  # nothing committed
    return mine, str(e.value)


def test_rank0_commits_only_when_every_ranks_files_are_at_the_commit_location(ranks, tmp_path):
    (files, message), (_, message1) = ranks(2).run(_rank1_files_vanish, str(tmp_path))
    assert message == message1
    assert "checkpoint of step 2 not committed: rank 1's __1_0.distcp, extra/rank-1.pt missing at rank 0's" in message
    # the manifest lists every rank's files with the writer's size and hash
    by_name = {f["name"]: f for f in files}
    assert {"__0_0.distcp", "__1_0.distcp", "extra/rank-0.pt", "extra/rank-1.pt", ".metadata"} <= set(by_name)
    assert by_name["__1_0.distcp"]["rank"] == 1 and by_name[".metadata"]["rank"] == 0
    assert all(len(f["sha256"]) == 64 for f in files)


def _resume_where_rank1_sees_nothing(root):
    model = _model((2,))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    manager = CheckpointManager(root)
    manager.save(1, model, opt)
    if dist.get_rank() == 1:  # rank 1's view of storage lost the checkpoint
        manager.latest = lambda: None
        original = Path.is_file
        Path.is_file = lambda p: False if p.name == "manifest.json" else original(p)
    try:
        with pytest.raises(CheckpointStorageError) as e:
            manager.latest_step()
    finally:
        if dist.get_rank() == 1:
            Path.is_file = original
    return str(e.value)


def test_resume_from_latest_is_rank0s_checkpoint_and_every_rank_must_see_it(ranks, tmp_path):
    messages = ranks(2).run(_resume_where_rank1_sees_nothing, str(tmp_path))
    assert messages[0] == messages[1]
    assert "rank 0 resumes from step 1" in messages[0] and "rank 1 (on " in messages[0]



def _read_only_root(root):
    model = _model((2,))
    CheckpointManager(root).save(1, model)
    original = Path.write_text
    if dist.get_rank() == 0:  # a root this job only reads (root itself writes anywhere: refuse it here)

        def refuse(path, *a, **k):
            if path.name.startswith(".hp-shared-"):
                raise PermissionError(13, "Permission denied", str(path))
            return original(path, *a, **k)

        Path.write_text = refuse
    try:
        again = CheckpointManager(root)  # as a resume_from input
        again.load(model, step=1)
    finally:
        Path.write_text = original
    return True


def test_a_checkpoint_root_rank0_cannot_write_loads_without_any_rank_waiting(ranks, tmp_path):
    assert ranks(2).run(_read_only_root, str(tmp_path)) == [True, True]
