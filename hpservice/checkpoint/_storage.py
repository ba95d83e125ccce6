"""Where checkpoints live: a local directory, or any fsspec URL (``s3://``, ``gs://``, ``memory://``, ...).

``CheckpointManager(root)`` takes either:

- a path, a ``pathlib.Path``, or a ``file://`` / ``local://`` URL: a local directory, with the
  layout and commit protocol described in ``_manager`` (every rank writes into ``step-N.tmp/``,
  rank 0 writes the manifest there and renames the directory to ``step-N/`` in one atomic
  ``os.replace``), unchanged. A mounted shared volume (NFS, a Kubernetes PVC) is local here;
- any other URL (and chained ones, ``simplecache::s3://...``): :class:`FsspecStorage`, through
  fsspec and torch.distributed.checkpoint's ``FsspecWriter`` / ``FsspecReader``. The filesystem's own package must be installed
  (``s3fs`` for ``s3://``, ``gcsfs`` for ``gs://``, ``adlfs`` for ``abfs://``; ``memory://``
  is built in); credentials and endpoints come from its usual environment (``AWS_*``,
  ``GOOGLE_APPLICATION_CREDENTIALS``, ...) or fsspec's ``FSSPEC_<PROTOCOL>_<OPTION>`` variables,
  e.g. ``FSSPEC_S3_ENDPOINT_URL`` for MinIO.

Object stores have no atomic rename of a prefix (fsspec emulates one by copying every object),
so :class:`FsspecStorage` commits without one:

1. rank 0 removes what earlier crashed saves left (``step-N/`` prefixes without a manifest,
   ``step-N.tmp/`` prefixes) and, when the step is saved again, first deletes the old
   checkpoint's manifest (it stops being committed), then its objects;
2. every rank writes its shard files and ``extra/rank-R.pt`` directly under ``step-N/``; a barrier;
3. rank 0 lists ``step-N/`` and writes ``step-N/manifest.json`` (name and size of every file)
   LAST, in one PUT: object stores make a single object visible whole or not at all.

A checkpoint is committed if and only if its manifest exists, exactly as on a local disk:
readers (``list``, ``latest``, ``load``) skip a prefix without one, so a crash at any moment
leaves the previous checkpoint as the latest. Deleting (pruning) removes the manifest first,
so a half-deleted checkpoint is never loaded. Reading every object back to hash it would
download the whole checkpoint on rank 0 at every save, so remote manifests record sizes with
``"sha256": null`` (the stores check integrity on upload); ``load`` checks every file's
presence and size, as it does locally.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import posixpath
from pathlib import Path
from typing import Any

import torch

from ._errors import CheckpointError
from ._names import step_of

__all__ = ["FsspecStorage", "is_remote", "local_path"]

MANIFEST = "manifest.json"
_LOCAL_PROTOCOLS = ("file", "local")


def is_remote(root: str | os.PathLike) -> bool:
    """Whether ``root`` is a URL of a non-local fsspec filesystem (``s3://...``, ``memory://...``)."""
    if isinstance(root, os.PathLike):
        return False
    root = str(root)
    if "://" not in root:
        return False
    from fsspec.core import split_protocol

    protocol, _ = split_protocol(root.split("::")[-1])
    return protocol not in _LOCAL_PROTOCOLS or "::" in root


def local_path(root: str | os.PathLike) -> Path:
    """The directory of a local root: a path as it is, a ``file://`` URL without its scheme."""
    if isinstance(root, os.PathLike) or "://" not in str(root):
        return Path(root)
    from fsspec.core import url_to_fs

    _, path = url_to_fs(str(root))  # file:///abs/dir -> /abs/dir (a relative one is made absolute)
    return Path(path)


class FsspecStorage:
    """A prefix of an fsspec filesystem; see the module docstring for the commit protocol."""

    def __init__(self, url: str):
        from fsspec.core import url_to_fs

        self.url = url.rstrip("/")
        self.fs, base = url_to_fs(self.url)
        self.base = base.rstrip("/")
        self.root = self.url

    # ---- names and paths -----------------------------------------------------------------
    def location(self, name: str) -> str:
        """The URL of ``name`` (a ``step-N`` prefix) under the root: what CheckpointInfo's path is."""
        return f"{self.url}/{name}"

    def name_of(self, location: str) -> str | None:
        """``step-N`` if ``location`` is a checkpoint URL under this root, else None."""
        head, _, name = str(location).rstrip("/").rpartition("/")
        return name if head == self.url and step_of(name) is not None else None

    def _path(self, *parts: str) -> str:
        return "/".join((self.base, *parts))

    def _refresh(self) -> None:
        self.fs.invalidate_cache()  # other ranks and processes write here: never trust a cached listing

    # ---- queries ---------------------------------------------------------------------------
    def names(self) -> list[str]:
        """Names of the entries directly under the root (``step-N``, ``step-N.tmp``, ...)."""
        self._refresh()
        try:
            entries = self.fs.ls(self.base, detail=False)
        except FileNotFoundError:
            return []
        return sorted({posixpath.basename(str(e).rstrip("/")) for e in entries})

    def manifest(self, name: str) -> dict | None:
        try:
            return json.loads(self.fs.cat_file(self._path(name, MANIFEST)))
        except FileNotFoundError:
            return None

    def committed(self) -> list[tuple[str, dict]]:
        """(name, manifest) of every committed checkpoint, in name order."""
        out = []
        for name in self.names():
            if step_of(name) is not None:
                manifest = self.manifest(name)
                if manifest is not None:
                    out.append((name, manifest))
        return out

    def _files(self, name: str) -> dict[str, int]:
        """Relative name -> size of every object under ``name``."""
        self._refresh()
        prefix = self._path(name)
        try:
            found = self.fs.find(prefix, detail=True)
        except FileNotFoundError:
            return {}
        out = {}
        for path, info in found.items():
            if info.get("type", "file") == "file":
                out[posixpath.relpath(str(path), prefix)] = int(info["size"])
        return out

    def verify(self, name: str) -> dict:
        """The manifest of ``name``, after checking every listed file exists with its size."""
        where = self.location(name)
        manifest = self.manifest(name)
        if manifest is None:  # the same messages as the local verify_files
            raise CheckpointError(f"{where} is not a committed checkpoint (no {MANIFEST})")
        present = self._files(name)
        for f in manifest["files"]:
            if f["name"] not in present:
                raise CheckpointError(f"{where} is incomplete: {f['name']} is missing")
            if present[f["name"]] != f["size"]:
                raise CheckpointError(
                    f"{where} is corrupt: {f['name']} has {present[f['name']]} bytes, manifest says {f['size']}"
                )
        return manifest

    # ---- writes ----------------------------------------------------------------------------
    def remove(self, name: str) -> None:
        """Delete ``name``: its manifest first (it stops being committed), then everything else."""
        for path, recursive in ((self._path(name, MANIFEST), False), (self._path(name), True)):
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(path, recursive=recursive)
        self._refresh()

    def remove_incomplete(self) -> None:
        for name in self.names():
            if step_of(name.removesuffix(".tmp")) is None:
                continue
            if name.endswith(".tmp") or self.manifest(name) is None:
                self.remove(name)

    def begin(self, name: str) -> None:
        """Make ``name`` empty for a new save (a re-saved step loses its old checkpoint first)."""
        self.remove(name)
        with contextlib.suppress(OSError, NotImplementedError):  # stores without directories need none
            self.fs.makedirs(self._path(name), exist_ok=True)

    def writer(self, name: str):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        # fsync means nothing to an object store; on a non-file stream DCP would os.sync() the machine
        return FsspecWriter(self.location(name), sync_files=False)

    def reader(self, name: str):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(self.location(name))

    def save_extra(self, name: str, rank: int, extra: dict[str, Any]) -> None:
        buffer = io.BytesIO()
        torch.save(extra, buffer)
        with contextlib.suppress(OSError, NotImplementedError):  # filesystems with real directories need it
            self.fs.makedirs(self._path(name, "extra"), exist_ok=True)
        self.fs.pipe_file(self._path(name, "extra", f"rank-{rank}.pt"), buffer.getvalue())

    def read_extra(self, name: str, rank: int) -> tuple[bytes, str]:
        """The bytes of rank ``rank``'s trainer state under ``name`` (rank 0's when it saved none)
        and their URL; untrusted, loaded by ``_untrusted.load_extra_bytes``."""
        for r in (rank, 0):
            path = self._path(name, "extra", f"rank-{r}.pt")
            try:
                return self.fs.cat_file(path), f"{self.location(name)}/extra/rank-{r}.pt"
            except FileNotFoundError:
                if r == 0:
                    raise
        raise AssertionError("unreachable")

    def commit(self, name: str, manifest: dict[str, Any]) -> None:
        """List what every rank wrote under ``name``, then write the manifest last (one PUT)."""
        files = self._files(name)
        files.pop(MANIFEST, None)
        manifest = {
            **manifest,
            "files": [{"name": n, "size": files[n], "sha256": None} for n in sorted(files)],
        }
        self.fs.pipe_file(self._path(name, MANIFEST), json.dumps(manifest, indent=1).encode())
        self._refresh()
