"""CheckpointReader: one committed checkpoint, opened for reading and nothing else.

A checkpoint a job resumes from or initialises from is an input: it may be a tenant's files
under a data root, or another job's directory. Reading it never creates, renames or deletes
anything (``CheckpointManager`` does that, for the job's own checkpoint directory only), and
nothing in its files can run code (``_untrusted``). A local checkpoint is opened through
``hpservice.inputs``: its directory's real path is checked against the job's input roots when
the load starts, and every file in it is checked again on its own descriptor.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from hpservice.inputs import MAX_INDEX_BYTES, InputError, input_dir, load_json, read_input

from ._errors import CheckpointError
from ._state import Model, load_optimizer_state_dict, model_state_dict, optimizer_load_targets
from ._storage import MANIFEST, FsspecStorage, is_remote, local_path
from ._untrusted import SafeFileSystemReader, SafeFsspecReader, load_extra_bytes

__all__ = ["CheckpointReader", "check_shapes", "dcp_load", "sha256_of", "single_process_quiet", "verify_files"]


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class CheckpointReader:
    """The committed checkpoint at ``location``: a local ``.../step-N`` directory, or its URL."""

    def __init__(self, location: str | os.PathLike):
        self.location = location
        self.remote: FsspecStorage | None = None
        if is_remote(location):
            root, _, self.name = str(location).rstrip("/").rpartition("/")
            self.remote = FsspecStorage(root)
        else:
            self.path = local_path(location)

    def __repr__(self) -> str:
        return f"CheckpointReader({str(self.location)!r})"

    @contextlib.contextmanager
    def opened(self):
        """(DCP storage reader, verified manifest, ``extra(rank)``) while the checkpoint is open for
        reading: for loads this class does not make (a partial load, an export in pieces)."""
        if self.remote is not None:
            manifest = self.remote.verify(self.name)
            yield SafeFsspecReader(self.remote.location(self.name)), manifest, self._remote_extra
            return
        with input_dir(self.path) as real:
            manifest = verify_files(real)

            def extra(rank: int) -> dict:
                directory = real / "extra"
                mine = directory / f"rank-{rank}.pt"
                name = mine if mine.exists() else directory / "rank-0.pt"
                return load_extra_bytes(read_input(name, MAX_INDEX_BYTES, within=[real]), str(name))

            yield SafeFileSystemReader(real), manifest, extra

    def _remote_extra(self, rank: int) -> dict:
        data, source = self.remote.read_extra(self.name, rank)
        return load_extra_bytes(data, source)

    def manifest(self) -> dict:
        with self.opened() as (_, manifest, _):
            return manifest

    def extra(self, rank: int = 0) -> dict:
        """Rank ``rank``'s trainer state (rank 0's when that rank did not save)."""
        with self.opened() as (_, _, extra):
            return extra(rank)

    def load(
        self,
        model: Model,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        group=None,
        ignore_frozen_params: bool = False,
    ) -> dict[str, Any]:
        """Load into ``model`` (and ``optimizer``), resharding as needed; collective over ``group``
        (None: this process alone). Returns this rank's trainer state (``extra``).
        ``ignore_frozen_params``: the parameters that do not train keep their values."""
        with self.opened() as (reader, _, extra):
            metadata = reader.read_metadata()
            saved = {tuple(v): metadata.state_dict_metadata[k] for k, v in metadata.planner_data.items()}
            state: dict[str, Any] = {"model": model_state_dict(model, ignore_frozen_params=ignore_frozen_params)}
            check_shapes(saved, state["model"], "model")
            if optimizer is not None:
                if not any(k[0] == "optim" for k in saved):
                    raise CheckpointError(f"{self.location} holds no optimizer state")
                state["optim"] = optimizer_load_targets(model, {k: v for k, v in saved.items() if k[0] == "optim"})
            dcp_load(state, reader, self.location, group=group)
            if optimizer is not None:
                load_optimizer_state_dict(model, optimizer, state["optim"], process_group=group)
            return extra(_rank())

    def load_model_tensors(self) -> dict[str, torch.Tensor]:
        """Every model tensor, whole, in this process (for export)."""
        with self.opened() as (reader, _, _):
            metadata = reader.read_metadata()
            targets: dict[str, torch.Tensor] = {}
            for key, md in metadata.state_dict_metadata.items():
                fqn_path = metadata.planner_data[key]
                if fqn_path[0] == "model" and hasattr(md, "size"):
                    targets[fqn_path[1]] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
            if not targets:
                raise CheckpointError(f"{self.location} holds no model tensors")
            state = {"model": targets}
            dcp_load(state, reader, self.location)
            return state["model"]


def dcp_load(state: dict, reader, location, *, group=None, planner=None) -> None:
    """``dcp.load`` of ``state`` through ``reader``, collective over ``group`` (None: this process
    alone), with a refusal or an error on any rank raised as itself (an ``InputError``, an
    ``UnsafeCheckpointError``) or as one ``CheckpointError`` naming its cause, not DCP's per-rank
    traceback dump."""
    try:
        with single_process_quiet(group is None):
            dcp.load(state, storage_reader=reader, planner=planner, process_group=group, no_dist=group is None)
    except CheckpointException as e:
        causes = [failure[0] if isinstance(failure, tuple) else failure for failure in e.failures.values()]
        cause = causes[0] if causes else e
        if isinstance(cause, (CheckpointError, InputError)):
            raise cause from None
        raise CheckpointError(f"{location} could not be read: {type(cause).__name__}: {cause}") from e


@contextlib.contextmanager
def single_process_quiet(active: bool):
    """DCP warns that it assumes a single process even when told so (no_dist=True): silence that."""
    import warnings

    with warnings.catch_warnings():
        if active:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def verify_files(path: Path, *, checksums: bool = False) -> dict:
    """The manifest of ``path``, after checking every listed file exists with its size (and hash)."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"{path} is not a committed checkpoint (no {MANIFEST})")
    try:
        manifest = load_json(read_input(manifest_path, MAX_INDEX_BYTES, within=[Path(os.path.realpath(path))]), str(manifest_path))
        files = manifest["files"]
        names = [(str(e["name"]), int(e["size"])) for e in files]
    except (ValueError, KeyError, TypeError) as e:  # InputFileError (a bound) is a ValueError
        raise CheckpointError(f"{path}: unreadable {MANIFEST} ({e})") from e
    for name, _ in names:
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise CheckpointError(f"{path}: its {MANIFEST} lists {name!r}, outside the checkpoint")
    for name, size in names:
        p = path / name
        if not p.is_file():
            raise CheckpointError(f"{path} is incomplete: {name} is missing")
        if p.stat().st_size != size:
            raise CheckpointError(f"{path} is corrupt: {name} has {p.stat().st_size} bytes, manifest says {size}")
    if checksums:
        for entry in files:
            if sha256_of(path / entry["name"]) != entry["sha256"]:
                raise CheckpointError(f"{path} is corrupt: {entry['name']} fails its sha256 check")
    return manifest


def check_shapes(saved: dict[tuple, Any], targets: dict[str, Any], prefix: str) -> None:
    """Name every missing key and every shape mismatch before loading anything."""
    missing, mismatched = [], []
    for name, value in targets.items():
        md = saved.get((prefix, name))
        if md is None:
            missing.append(name)
        elif isinstance(value, torch.Tensor) and tuple(getattr(md, "size", ())) != tuple(value.shape):
            mismatched.append(f"{name}: checkpoint {tuple(md.size)} vs model {tuple(value.shape)}")
    if missing or mismatched:
        parts = []
        if missing:
            parts.append(f"missing keys: {missing}")
        if mismatched:
            parts.append(f"shape mismatches: {mismatched}")
        raise CheckpointError("checkpoint does not match the model; " + "; ".join(parts))
