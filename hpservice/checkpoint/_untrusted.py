"""Loading checkpoint files that may have been crafted: nothing in them can run code.

A checkpoint a job reads may come from anywhere (a tenant's files under a data root, a download),
so every file of one is untrusted, and three of them are pickles in torch's formats:

- ``.metadata`` (torch.distributed.checkpoint's plan of what is where): a plain pickle, which
  torch's ``FileSystemReader`` loads with ``pickle.load`` -- a ``__reduce__`` in it runs any
  callable. :class:`MetadataUnpickler` builds only DCP's own metadata classes and the few torch
  values they hold (``torch.Size``, dtypes, layouts), and refuses every other global by name.
- ``extra/rank-R.pt`` (the trainer's state: step, RNG states, schedule): ``torch.load`` with
  ``weights_only=True``, torch's loader that builds tensors and plain containers only.
- the optimizer's ``param_groups`` (a byte blob inside the DCP files): written with
  ``torch.save`` and read with ``torch.load(weights_only=True)``; blobs of checkpoints written
  before that (a bare ``pickle.dumps`` of the groups) are read by an unpickler that admits no
  global at all (the groups are dicts, lists, strings and numbers).

Tensor shards themselves are read by DCP with ``torch.load(weights_only=True)`` already.
:class:`SafeFileSystemReader` and :class:`SafeFsspecReader` are DCP's readers with the metadata
loaded as above, every shard file name checked to be a plain name inside the checkpoint (no
``../``), and, locally, every file opened read-only and confined (``hpservice.inputs``).
"""

from __future__ import annotations

import io
import os
import pickle
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader  # fsspec comes with torch
from torch.distributed.checkpoint.filesystem import FileSystem

from hpservice.inputs import open_input

from ._errors import UnsafeCheckpointError

__all__ = [
    "MetadataUnpickler",
    "SafeFileSystemReader",
    "SafeFsspecReader",
    "load_extra_bytes",
    "load_param_groups",
    "save_param_groups",
]

_DCP_META = "torch.distributed.checkpoint.metadata"
# (module, name) -> what a DCP .metadata pickle may name: DCP's metadata dataclasses and the torch
# values inside them. Nothing here runs code when built: dataclass constructors and __setstate__.
_METADATA_GLOBALS = {
    (_DCP_META, "Metadata"),
    (_DCP_META, "MetadataIndex"),
    (_DCP_META, "StorageMeta"),
    (_DCP_META, "TensorProperties"),
    (_DCP_META, "TensorStorageMetadata"),
    (_DCP_META, "BytesStorageMetadata"),
    (_DCP_META, "ChunkStorageMetadata"),
    (_DCP_META, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),  # a layout by its name, from a fixed table
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "Path"),
    ("collections", "OrderedDict"),
}


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata, refusing any global outside DCP's metadata classes (and dtypes)."""

    def __init__(self, file, *, source: str):
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"{self.source}: refusing to load {module}.{name}: a checkpoint's metadata may name only "
            "torch.distributed.checkpoint's metadata classes (was the file crafted?)"
        )


class _PlainUnpickler(pickle.Unpickler):
    """Unpickles plain data only (dicts, lists, tuples, strings, numbers): every global is refused."""

    def __init__(self, file, *, source: str):
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        raise UnsafeCheckpointError(f"{self.source}: refusing to load {module}.{name}: only plain data is allowed here")


def load_metadata(stream, source: str):
    try:
        return MetadataUnpickler(stream, source=source).load()
    except UnsafeCheckpointError:
        raise
    except Exception as e:  # a truncated or garbled file
        raise UnsafeCheckpointError(f"{source}: not a torch.distributed.checkpoint metadata file ({e})") from e


def _weights_only(data: bytes, source: str):
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:  # what torch raises for a global outside its allowlist
        raise UnsafeCheckpointError(f"{source}: refused by torch.load(weights_only=True): {str(e).splitlines()[0]}") from e


def load_extra_bytes(data: bytes, source: str) -> dict:
    """A trainer-state file (``extra/rank-R.pt``), built without running anything in it."""
    extra = _weights_only(data, source)
    if not isinstance(extra, dict):
        raise UnsafeCheckpointError(f"{source}: expected a dict of trainer state, got {type(extra).__name__}")
    return extra


def save_param_groups(groups: list[dict]) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(groups, buffer)
    return io.BytesIO(buffer.getvalue())


def load_param_groups(data: bytes, source: str = "the checkpoint's optimizer param_groups") -> list[dict]:
    """The optimizer's param groups: ``torch.save`` format (a zip), or the bare pickle of older
    checkpoints, read as plain data."""
    if data[:2] == b"PK":
        groups = _weights_only(data, source)
    else:
        try:
            groups = _PlainUnpickler(io.BytesIO(data), source=source).load()
        except UnsafeCheckpointError:
            raise
        except Exception as e:
            raise UnsafeCheckpointError(f"{source}: unreadable ({e})") from e
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise UnsafeCheckpointError(f"{source}: expected a list of param group dicts")
    return groups


def _check_storage_names(storage_data: dict, where: str) -> None:
    """Every file DCP will read is a plain name inside the checkpoint (no ``/``, no ``..``)."""
    for info in storage_data.values():
        name = str(getattr(info, "relative_path", ""))
        if not name or name in (".", "..") or "/" in name or "\\" in name:
            raise UnsafeCheckpointError(f"{where}: its metadata points at {name!r}, outside the checkpoint directory")


class _ReadOnlyConfinedFileSystem(FileSystem):
    """DCP's local filesystem for reading one checkpoint directory: every file is opened
    read-only and must really lie under that directory (and the job's input roots)."""

    def __init__(self, directory: Path):
        self.directory = directory

    @contextmanager
    def create_stream(self, path, mode: str):
        if mode != "rb":
            raise PermissionError(f"{path}: a checkpoint being read is never written")
        with open_input(path, "rb", within=[self.directory]) as stream:
            yield stream

    def _refuse(self, *args, **kwargs):
        raise PermissionError("a checkpoint being read is never changed")

    rename = mkdir = rm_file = _refuse


class _SafeReading:
    """What both safe readers add to DCP's: safe metadata and checked file names."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        from torch.distributed.checkpoint.metadata import StorageMeta

        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = load_metadata(stream, str(path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        _check_storage_names(metadata.storage_data or {}, str(self.path))
        return metadata

    def set_up_storage_reader(self, metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        _check_storage_names(metadata.storage_data or {}, str(self.path))
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)


class SafeFileSystemReader(_SafeReading, FileSystemReader):
    """DCP's ``FileSystemReader`` for an untrusted local checkpoint directory ``path`` (its real
    path, as ``hpservice.inputs.input_dir`` gives it)."""

    def __init__(self, path: str | os.PathLike):
        super().__init__(path)
        self.fs = _ReadOnlyConfinedFileSystem(Path(path))


class SafeFsspecReader(_SafeReading, FsspecReader):
    """DCP's ``FsspecReader`` for an untrusted checkpoint at a URL: safe metadata, checked names."""
