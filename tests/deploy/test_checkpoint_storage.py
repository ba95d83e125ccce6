"""Checkpoint roots beyond a plain path: fsspec URLs (memory://, a directory-backed "remote" store
on two gloo ranks) and local file:// URLs, through the same CheckpointManager."""

import json
import uuid
from pathlib import Path

import fsspec
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from fsspec.implementations.local import LocalFileSystem

from hpservice.checkpoint import CheckpointError, CheckpointManager
from hpservice.checkpoint._storage import is_remote, local_path
from hpservice.dtensor import DTensor, init_device_mesh
from hpservice.fsdp import fully_shard

from ..fsdp._models import MLP


def _trained(seed=0, steps=1):
    torch.manual_seed(seed)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for i in range(steps):
        g = torch.Generator().manual_seed(i)
        model(torch.randn(4, 7, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _full(v):
    return v.full_tensor() if isinstance(v, DTensor) else v


def _same(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(_full(sa[k]), _full(sb[k])) for k in sa)


def _same_optim(a, b) -> bool:
    sa = [{k: _full(v) for k, v in s.items()} for s in a.state.values()]
    sb = [{k: _full(v) for k, v in s.items()} for s in b.state.values()]
    return len(sa) == len(sb) and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(sa, sb)
    )


@pytest.fixture
def memory_root():
    root = f"memory://hp-ckpt-{uuid.uuid4().hex[:8]}/run"
    yield root
    fs = fsspec.filesystem("memory")
    if fs.exists(root):
        fs.rm(root, recursive=True)


@pytest.fixture(params=["memory", "file"])
def root(request, memory_root, tmp_path):
    return memory_root if request.param == "memory" else f"file://{tmp_path}/ckpt"


def test_uri_kinds():
    assert not is_remote("ckpt") and not is_remote("/abs/ckpt") and not is_remote(Path("s3://x"))
    assert not is_remote("file:///data/ckpt") and not is_remote("local:///data/ckpt")
    assert is_remote("memory://x") and is_remote("s3://bucket/prefix") and is_remote("gs://b/p")
    assert is_remote("simplecache::s3://bucket/prefix")  # chained URLs go through fsspec
    assert local_path("file:///data/ckpt") == Path("/data/ckpt")
    assert local_path("ckpt") == Path("ckpt")


def test_save_list_latest_load_prune(root, tmp_path):
    model, opt = _trained(steps=2)
    manager = CheckpointManager(root, keep=2)
    assert manager.list() == [] and manager.latest() is None
    rng = torch.get_rng_state()
    for step in (1, 2, 3):
        manager.save(step, model, opt, extra={"step": step, "rng": rng}, metrics={"loss": 1.0 / step})
    listed = manager.list()
    assert [c["step"] for c in listed] == [2, 3]  # keep=2 pruned step 1
    assert manager.latest()["step"] == 3 and listed[-1]["metrics"] == {"loss": 1.0 / 3}
    assert all(c["size"] > 0 and c["world_size"] == 1 for c in listed)
    if root.startswith("memory://"):
        assert listed[-1]["path"] == f"{root}/step-00000003"  # a URL under the root as given
        assert "step-00000001" not in [p.rsplit("/", 1)[-1] for p in fsspec.filesystem("memory").ls(root, detail=False)]
    else:  # file:// is the local layout, unchanged: plain directories, the step renamed into place
        local = tmp_path / "ckpt"
        assert listed[-1]["path"] == str(local / "step-00000003")
        assert sorted(p.name for p in local.iterdir()) == ["step-00000002", "step-00000003"]

    fresh, fresh_opt = _trained(seed=1)
    assert not _same(model, fresh)
    extra = CheckpointManager(root).load(fresh, fresh_opt)
    assert extra["step"] == 3 and torch.equal(extra["rng"], rng)
    assert _same(model, fresh) and _same_optim(opt, fresh_opt)
    assert CheckpointManager(root).load(_trained(seed=2)[0], step=2)["step"] == 2
    with pytest.raises(CheckpointError, match=r"no committed checkpoint for step 1 .*available: \[2, 3\]"):
        manager.load(fresh, step=1)


def test_manifest_written_last_lists_every_file(memory_root):
    model, opt = _trained()
    manager = CheckpointManager(memory_root)
    manager.save(5, model, opt, extra={"step": 5}, metrics={"loss": 0.5})
    fs = fsspec.filesystem("memory")
    manifest = json.loads(fs.cat_file(f"{memory_root}/step-00000005/manifest.json"))
    names = {f["name"] for f in manifest["files"]}
    assert {".metadata", "extra/rank-0.pt"} <= names and any(n.endswith(".distcp") for n in names)
    assert "manifest.json" not in names
    sizes = {f["name"]: f["size"] for f in manifest["files"]}
    for name, size in sizes.items():
        assert fs.info(f"{memory_root}/step-00000005/{name}")["size"] == size
    assert manifest["step"] == 5 and manifest["world_size"] == 1 and manifest["metrics"] == {"loss": 0.5}
    assert all(f["sha256"] is None for f in manifest["files"])  # no read-back of remote objects


def test_incomplete_save_is_ignored_and_cleaned(root, tmp_path):
    model, opt = _trained()
    manager = CheckpointManager(root, keep=5)
    manager.save(1, model, opt, extra={"step": 1})

    def crash():
        raise RuntimeError("killed between shard files and manifest")

    manager._before_commit = crash
    with pytest.raises(RuntimeError, match="killed between"):
        manager.save(2, model, opt, extra={"step": 2})
    assert [c["step"] for c in manager.list()] == [1] and manager.latest()["step"] == 1
    if root.startswith("memory://"):
        fs = fsspec.filesystem("memory")
        left = f"{root}/step-00000002"  # the shard files are there, the manifest is not
        assert fs.find(left) and not fs.exists(f"{left}/manifest.json")
    else:
        left = tmp_path / "ckpt" / "step-00000002.tmp"
        assert left.is_dir()
    with pytest.raises(CheckpointError, match=r"available: \[1\]"):
        manager.load(model, step=2)
    assert manager.load(_trained(seed=3)[0])["step"] == 1  # latest is still the committed one

    again = CheckpointManager(root, keep=5)  # a restarted job removes what the crash left
    assert [c["step"] for c in again.list()] == [1]
    if root.startswith("memory://"):
        assert not fsspec.filesystem("memory").exists(left)
    else:
        assert not left.exists()


def test_resave_same_step_replaces_it(memory_root):
    model, opt = _trained()
    manager = CheckpointManager(memory_root)
    manager.save(1, model, opt, extra={"version": 1})
    model2, opt2 = _trained(seed=7)
    manager.save(1, model2, opt2, extra={"version": 2})
    assert [c["step"] for c in manager.list()] == [1]
    target = _trained(seed=8)[0]
    assert manager.load(target)["version"] == 2 and _same(model2, target)


def test_missing_object_is_reported(memory_root):
    model, _ = _trained()
    manager = CheckpointManager(memory_root)
    manager.save(1, model)
    fs = fsspec.filesystem("memory")
    shard = next(p for p in fs.find(f"{memory_root}/step-00000001") if p.endswith(".distcp"))
    fs.rm(shard)
    with pytest.raises(CheckpointError, match=r"incomplete: __0_0\.distcp is missing"):
        manager.load(_trained(seed=1)[0])
    with pytest.raises(CheckpointError, match="no committed checkpoint under"):
        CheckpointManager(f"{memory_root}-empty").load(model)


def test_async_save_and_best_retention(memory_root):
    model, opt = _trained()
    manager = CheckpointManager(memory_root, keep=2, async_save=True, best_metric="loss", best_mode="min")
    for step, loss in [(1, 0.5), (2, 0.9), (3, 0.8), (4, 0.7)]:
        manager.save(step, model, opt, extra={"step": step}, metrics={"loss": loss})
    manager.close()
    assert [c["step"] for c in manager.list()] == [1, 3, 4]


# ---- two gloo ranks on a "remote" store ----------------------------------------------------------
class SharedDirFileSystem(LocalFileSystem):
    """An fsspec filesystem under its own protocol, backed by a shared local directory: the object-store
    code path (no rename, manifest last) on several processes, which memory:// cannot be."""

    protocol = ("hptest",)

    @classmethod
    def _strip_protocol(cls, path):
        path = str(path)
        if path.startswith("hptest://"):
            path = path[len("hptest://") :]
        return super()._strip_protocol(path)


def _sharded_save_and_load(url, crash_dir):
    fsspec.register_implementation("hptest", SharedDirFileSystem, clobber=True)
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    model = MLP()
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(4, 7)).pow(2).mean().backward()
    opt.step()
    manager = CheckpointManager(url, keep=2)
    manager.save(1, model, opt, extra={"rank": dist.get_rank()})
    manager._before_commit = lambda: (_ for _ in ()).throw(RuntimeError("crash"))
    with pytest.raises(RuntimeError, match="crash"):
        manager.save(2, model, opt, extra={"rank": dist.get_rank()})
    dist.barrier()
    assert [c["step"] for c in CheckpointManager(url).list()] == [1]
    full = {k: _full(v).clone() for k, v in model.state_dict().items()}
    torch.manual_seed(5)
    other = MLP()
    for b in other.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(other, mesh=mesh)
    extra = CheckpointManager(url).load(other)
    assert extra["rank"] == dist.get_rank()  # each rank gets back its own trainer state
    assert all(torch.equal(_full(v), full[k]) for k, v in other.state_dict().items())
    return sorted(p.name for p in Path(crash_dir).iterdir())


def test_two_ranks_on_an_object_store_protocol(ranks, tmp_path):
    url = f"hptest://{tmp_path}/store"
    listing = ranks(2).run(_sharded_save_and_load, url, str(tmp_path / "store"))[0]
    assert listing == ["step-00000001"]  # the crashed step-2 prefix was removed by the next manager
    manifest = json.loads((tmp_path / "store" / "step-00000001" / "manifest.json").read_text())
    names = {f["name"] for f in manifest["files"]}
    assert {"extra/rank-0.pt", "extra/rank-1.pt", ".metadata"} <= names
    assert sum(n.endswith(".distcp") for n in names) == 2 and manifest["world_size"] == 2
