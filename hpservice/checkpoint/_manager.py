"""CheckpointManager: sharded, atomic, optionally asynchronous checkpoints of a training run.

Layout under ``root``::

    step-00000100/              a committed checkpoint (it has manifest.json)
        .metadata, __R_0.distcp torch.distributed.checkpoint files (each rank writes its shards)
        extra/rank-R.pt         each rank's trainer state (RNG states, data position, ...)
        manifest.json           step, time, world size, metrics, every file's size and sha256
    step-00000200.tmp/          being written, or left by a crash: never loaded, cleaned up

Commit protocol: every rank writes into ``step-N.tmp/`` and lists the files it wrote with their
sizes and sha256 (torch.distributed.checkpoint's write results name them); rank 0 gathers the
lists, checks that every rank's files are present at the commit location with their sizes, writes
the manifest (every file, its size, hash and writer) and renames the directory to ``step-N/``
(one atomic rename); every rank then learns the outcome. A checkpoint without a manifest does not
exist, so a crash at any moment leaves the previous checkpoint as ``latest()``.

Shared storage: a local ``root`` must be one directory for every rank (a volume every node
mounts). On node-local disks each node would hold only its own ranks' shards; so the manager
checks, when it is created, that every rank sees a file rank 0 wrote there, and the commit checks
every rank's files again. Either failing is a ``CheckpointStorageError`` on every rank, naming the
ranks that do not share the directory: the job cannot checkpoint there, and retrying does not
help. Resuming from ``latest`` is decided by rank 0 and checked on every rank, so no rank
starts fresh while another loads.

Storage: ``root`` is a local directory (a path or a ``file://`` URL; a mounted shared volume
counts) with the layout above, or an fsspec URL (``s3://bucket/prefix``, ``gs://...``,
``memory://...``). Object stores have no atomic rename: there, every rank writes straight into
``step-N/`` and rank 0 writes the manifest last, so "committed iff the manifest exists" holds
unchanged (``_storage`` describes that protocol). ``CheckpointInfo["path"]`` is then a URL.

Async save: the state is copied to CPU ("staged") on the caller's thread, then a background
thread writes and commits it while training continues. It communicates over a gloo group of its
own, so its collectives never interleave with training's. The next ``save`` (and ``wait`` /
``close``) waits for it; its errors are raised there, never dropped.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from hpservice.dtensor import DTensor

from ._errors import CheckpointError, CheckpointStorageError
from ._names import step_dir_name, step_of
from ._reader import CheckpointReader, check_shapes, sha256_of, single_process_quiet, verify_files
from ._state import Model, model_state_dict, optimizer_state_dict
from ._storage import MANIFEST, FsspecStorage, is_remote, local_path

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointStorageError",
    "check_shapes",
    "single_process_quiet",
    "verify_files",
]

FORMAT_VERSION = 1


def _root_cause(e: BaseException) -> str:
    """The innermost error of ``e`` in one line: through ``__cause__`` / ``__context__`` and the
    per-rank failures torch.distributed.checkpoint collects."""
    seen = set()
    while id(e) not in seen:
        seen.add(id(e))
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint's CheckpointException
        if isinstance(failures, dict) and failures:
            inner = next(iter(failures.values()))
            e = inner[0] if isinstance(inner, tuple) else inner
            continue
        nxt = e.__cause__ or e.__context__
        if nxt is None:
            break
        e = nxt
    if isinstance(e, OSError) and e.strerror:
        where = f": {e.filename}" if e.filename else ""
        return f"{type(e).__name__}: [Errno {e.errno}] {e.strerror}{where}"
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


class CheckpointInfo(dict):
    """One committed checkpoint: step, path, time, size (bytes), metrics."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class _RecordingWriter(FileSystemWriter):
    """torch's FileSystemWriter, remembering the files this rank wrote (for the manifest)."""

    written: list[str]

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        self.written = sorted({r.storage_data.relative_path for r in future.value()})
        return future


def _describe_file(tmp: Path, name: str, rank: int) -> dict:
    path = tmp / name
    return {"name": name, "size": path.stat().st_size, "sha256": sha256_of(path), "rank": rank}


def _host() -> str:
    return socket.gethostname()


def _stage(value, buffers: dict, key: str = ""):
    """A CPU copy of a state dict, so training can change the originals while it is written.

    The copies go into ``buffers`` (by state-dict path), kept from one save to the next: a save
    waits for the previous write first, so its buffers are free again. Reusing them makes staging
    a plain memory copy; fresh ones cost a page fault per 4 KiB on first touch, which was most of
    the blocked time of an async save (1.1 s of a 768 MiB-per-rank state, ``bench checkpoint``).
    """
    if isinstance(value, DTensor):
        return DTensor(_stage_tensor(value._wait_local(), buffers, key), value._spec)
    if isinstance(value, torch.Tensor):
        return _stage_tensor(value, buffers, key)
    if isinstance(value, dict):
        return {k: _stage(v, buffers, f"{key}/{k}") for k, v in value.items()}
    if hasattr(value, "getvalue"):  # BytesIO
        return type(value)(value.getvalue())
    return value


def _stage_tensor(t: torch.Tensor, buffers: dict, key: str) -> torch.Tensor:
    t = t.detach()
    buf = buffers.get(key)
    if buf is None or buf.shape != t.shape or buf.dtype != t.dtype or buf.stride() != t.stride():
        buf = buffers[key] = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
    buf.copy_(t)
    return buf


class CheckpointManager:
    """Save, list, load and prune checkpoints of a (sharded) model and optimizer.

    Every rank must create the manager and call ``save``/``load`` (they are collective).
    ``keep``: committed checkpoints kept (newest first); ``best_metric``/``best_mode``: also keep
    the best one by that metric.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        keep: int = 3,
        async_save: bool = False,
        best_metric: str | None = None,
        best_mode: str = "min",
    ):
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"CheckpointManager(keep): expected an int >= 1, got {keep!r}")
        if best_mode not in ("min", "max"):
            raise ValueError(f"CheckpointManager(best_mode): expected 'min' or 'max', got {best_mode!r}")
        # fsspec for object stores (and other non-local URLs); None: the local directory self.root
        self._remote = FsspecStorage(str(root)) if is_remote(root) else None
        self.root = self._remote.url if self._remote is not None else local_path(root)
        self.keep = keep
        self.async_save = async_save
        self.best_metric, self.best_mode = best_metric, best_mode
        self._group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hp-ckpt") if async_save else None
        self._pending: Future | None = None
        self._staging: dict[str, torch.Tensor] = {}  # async saves' CPU copies, reused (see _stage)
        self._before_commit = None  # test hook: called on every rank between shard files and manifest
        if _rank() == 0:
            if self._remote is None:
                self.root.mkdir(parents=True, exist_ok=True)
            self._remove_incomplete()
        self._barrier()
        if self._remote is None and self._group is not None:
            self._check_shared()

    @property
    def group(self):
        """The gloo group the manager's collectives use (None in a single process)."""
        return self._group

    def _check_shared(self) -> None:
        """Every rank sees a file rank 0 wrote under ``root``, or ``CheckpointStorageError``
        on every rank (see the module doc)."""
        marker = self.root / f".hp-shared-{self._broadcast(uuid.uuid4().hex)}"
        wrote = True
        if _rank() == 0:
            try:
                marker.write_text(_host())
            except OSError:  # a root this job only reads (a resume_from input): nothing is committed there
                wrote = False
        if not self._broadcast(wrote):  # every rank learns it after the write, or nobody waits
            return
        blind = self._ranks_without(marker.is_file())
        if _rank() == 0:
            marker.unlink(missing_ok=True)
        if blind:
            raise CheckpointStorageError(
                f"checkpoint.dir {self.root} is not shared between the job's nodes: {blind} cannot see what rank 0 "
                "writes there; use a directory every node mounts (a shared volume) or an object "
                "store URL (s3://, gs://)"
            )

    def _ranks_without(self, ok: bool) -> str | None:
        """Collective: the ranks whose ``ok`` is false, with their hosts (``rank 1 (on node-b)``),
        or None when every rank's is true."""
        if self._group is None:
            return None if ok else f"rank 0 (on {_host()})"
        seen = [None] * dist.get_world_size(self._group)
        dist.all_gather_object(seen, (ok, _host()), group=self._group)
        blind = [f"rank {r} (on {host})" for r, (fine, host) in enumerate(seen) if not fine]
        return ", ".join(blind) or None

    def latest_step(self) -> int | None:
        """Collective: the step of the latest committed checkpoint as rank 0 sees it, which every
        rank must see too (``CheckpointStorageError`` otherwise): the ranks of a resuming job all
        load it or all start fresh."""
        info = self.latest() if _rank() == 0 or self._group is None else None
        step = self._broadcast(None if info is None else info["step"])
        if step is not None and self._remote is None:
            blind = self._ranks_without((self.root / step_dir_name(step) / MANIFEST).is_file())
            if blind:
                raise CheckpointStorageError(
                    f"rank 0 resumes from step {step} under {self.root}, but {blind} cannot see that checkpoint: "
                    "checkpoint.dir is not shared between the job's nodes"
                )
        return step

    # ---- queries --------------------------------------------------------------------------
    def list(self) -> list[CheckpointInfo]:
        """Committed checkpoints, oldest first."""
        out = []
        if self._remote is not None:
            found = [(self._remote.location(name), data) for name, data in self._remote.committed()]
        elif not self.root.is_dir():
            return out
        else:
            found = []
            for entry in self.root.iterdir():
                manifest = entry / MANIFEST
                if step_of(entry.name) is None or not manifest.is_file():
                    continue
                found.append((str(entry), json.loads(manifest.read_text())))
        for path, data in found:
            out.append(
                CheckpointInfo(
                    step=data["step"],
                    path=path,
                    time=data["time"],
                    size=sum(f["size"] for f in data["files"]),
                    metrics=data.get("metrics", {}),
                    world_size=data["world_size"],
                )
            )
        return sorted(out, key=lambda c: c["step"])

    def latest(self) -> CheckpointInfo | None:
        checkpoints = self.list()
        return checkpoints[-1] if checkpoints else None

    # ---- save -----------------------------------------------------------------------------
    def save(
        self,
        step: int,
        model: Model,
        optimizer: torch.optim.Optimizer | None = None,
        extra: dict[str, Any] | None = None,
        *,
        metrics: dict[str, float] | None = None,
        ignore_frozen_params: bool = False,
    ) -> None:
        """Save ``model`` (and ``optimizer``) at ``step``; ``extra`` is this rank's trainer state.
        ``ignore_frozen_params``: without the parameters that do not train (``model_state_dict``)."""
        self.wait()
        state: dict[str, Any] = {"model": model_state_dict(model, ignore_frozen_params=ignore_frozen_params)}
        if optimizer is not None:
            state["optim"] = optimizer_state_dict(model, optimizer, process_group=self._group)
        extra = dict(extra or {})
        if self.async_save:
            staged = _stage(state, self._staging)
            self._pending = self._executor.submit(self._write_and_commit_or_explain, step, staged, extra, metrics or {})
        else:
            self._write_and_commit_or_explain(step, state, extra, metrics or {})

    def wait(self) -> None:
        """Wait for an async save in flight; raise its error if it failed."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def _write_and_commit_or_explain(self, step: int, state: dict, extra: dict, metrics: dict) -> None:
        """The write, with a failure named by its root cause (a full disk, a read-only volume)
        in one line instead of torch.distributed.checkpoint's per-rank traceback dump."""
        try:
            self._write_and_commit(step, state, extra, metrics)
        except CheckpointError:
            raise
        except (Exception, CheckpointException) as e:  # torch's CheckpointException is a BaseException
            raise CheckpointError(
                f"checkpoint of step {step} could not be written to {self.root}: {_root_cause(e)}"
            ) from e

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)

    def _write_and_commit(self, step: int, state: dict, extra: dict, metrics: dict) -> None:
        if self._remote is not None:
            return self._write_and_commit_remote(step, state, extra, metrics)
        final = self.root / step_dir_name(step)
        tmp = self.root / f"{step_dir_name(step)}.tmp"
        if _rank() == 0:
            self._remove_incomplete()
            tmp.mkdir(parents=True)
        self._barrier()
        writer = _RecordingWriter(str(tmp))
        with single_process_quiet(self._group is None):
            dcp.save(state, storage_writer=writer, process_group=self._group, no_dist=self._group is None)
        (tmp / "extra").mkdir(exist_ok=True)
        extra_name = f"extra/rank-{_rank()}.pt"
        torch.save(extra, tmp / extra_name)
        mine = [_describe_file(tmp, name, _rank()) for name in [*writer.written, extra_name]]
        if _rank() == 0:
            mine.append(_describe_file(tmp, ".metadata", 0))
        files = self._gather(mine)  # every rank's files are complete
        if self._before_commit is not None:
            self._before_commit()
        problem = None
        if _rank() == 0:
            problem = _missing(tmp, files)
            if problem is None:
                manifest = {
                    "format": FORMAT_VERSION,
                    "step": step,
                    "time": time.time(),
                    "world_size": dist.get_world_size() if dist.is_initialized() else 1,
                    "metrics": metrics,
                    "files": sorted(files, key=lambda f: f["name"]),
                }
                partial = tmp / (MANIFEST + ".part")
                partial.write_text(json.dumps(manifest, indent=1))
                os.replace(partial, tmp / MANIFEST)
                if final.exists():  # re-saving a step replaces it
                    shutil.rmtree(final)
                os.replace(tmp, final)
                self._prune()
        problem = self._broadcast(problem)
        if problem is not None:
            raise CheckpointStorageError(f"checkpoint of step {step} not committed: {problem}")

    def _gather(self, mine: list[dict]) -> list[dict]:
        """Every rank's file list, on rank 0 (the others get theirs back)."""
        if self._group is None:
            return mine
        lists = [None] * dist.get_world_size(self._group) if _rank() == 0 else None
        dist.gather_object(mine, lists, dst=0, group=self._group)
        return [f for part in lists for f in part] if _rank() == 0 else mine

    def _broadcast(self, value):
        """Rank 0's ``value`` on every rank."""
        if self._group is None:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self._group)
        return box[0]

    def _write_and_commit_remote(self, step: int, state: dict, extra: dict, metrics: dict) -> None:
        """The object-store protocol: write under ``step-N/``, the manifest last (see ``_storage``)."""
        name = step_dir_name(step)
        if _rank() == 0:
            self._remove_incomplete()
            self._remote.begin(name)
        self._barrier()
        with single_process_quiet(self._group is None):
            dcp.save(
                state, storage_writer=self._remote.writer(name), process_group=self._group, no_dist=self._group is None
            )
        self._remote.save_extra(name, _rank(), extra)
        self._barrier()  # every rank's files are complete
        if self._before_commit is not None:
            self._before_commit()
        if _rank() == 0:
            self._remote.commit(
                name,
                {
                    "format": FORMAT_VERSION,
                    "step": step,
                    "time": time.time(),
                    "world_size": dist.get_world_size() if dist.is_initialized() else 1,
                    "metrics": metrics,
                },
            )
            self._prune()
        self._barrier()

    def _prune(self) -> None:
        checkpoints = self.list()
        keep = {c["step"] for c in checkpoints[-self.keep :]}
        if self.best_metric is not None:
            scored = [c for c in checkpoints if self.best_metric in c["metrics"]]
            if scored:
                pick = min if self.best_mode == "min" else max
                keep.add(pick(scored, key=lambda c: c["metrics"][self.best_metric])["step"])
        for c in checkpoints:
            if c["step"] not in keep:
                if self._remote is not None:
                    self._remote.remove(self._remote.name_of(c["path"]))
                else:
                    shutil.rmtree(c["path"], ignore_errors=True)

    def _remove_incomplete(self) -> None:
        if self._remote is not None:
            return self._remote.remove_incomplete()
        for entry in self.root.iterdir():
            ours = entry.is_dir() and step_of(entry.name.removesuffix(".tmp")) is not None
            if ours and (entry.name.endswith(".tmp") or not (entry / MANIFEST).exists()):
                shutil.rmtree(entry, ignore_errors=True)

    def _barrier(self) -> None:
        if self._group is not None:
            dist.barrier(group=self._group)

    # ---- load -----------------------------------------------------------------------------
    def resolve(self, step: int | str = "latest") -> Path | str:
        """The committed checkpoint's directory (its URL for a remote root)."""
        if step == "latest":
            info = self.latest()
            if info is None:
                raise CheckpointError(f"no committed checkpoint under {self.root}")
            return info["path"] if self._remote is not None else Path(info["path"])
        if isinstance(step, bool) or not isinstance(step, int):
            raise CheckpointError(f"step must be an int or 'latest', got {step!r}")
        if self._remote is not None:
            name = step_dir_name(step)
            committed = self._remote.manifest(name) is not None
            path = self._remote.location(name)
        else:
            path = self.root / step_dir_name(step)
            committed = (path / MANIFEST).is_file()
        if not committed:
            available = [c["step"] for c in self.list()]
            raise CheckpointError(f"no committed checkpoint for step {step} under {self.root} (available: {available})")
        return path

    def load(
        self,
        model: Model,
        optimizer: torch.optim.Optimizer | None = None,
        step: int | str = "latest",
        *,
        ignore_frozen_params: bool = False,
    ) -> dict[str, Any]:
        """Load into ``model`` (and ``optimizer``), resharding as needed; return this rank's ``extra``.
        ``ignore_frozen_params``: the frozen parameters keep their values (a checkpoint saved without them)."""
        self.wait()
        if step == "latest" and self._group is not None:
            step = self.latest_step()
            if step is None:
                raise CheckpointError(f"no committed checkpoint under {self.root}")
        return CheckpointReader(self.resolve(step)).load(
            model, optimizer, group=self._group, ignore_frozen_params=ignore_frozen_params
        )


def _missing(tmp: Path, files: list[dict]) -> str | None:
    """Why the files the ranks say they wrote are not all at ``tmp`` with their sizes, or None."""
    absent: dict[int, list[str]] = {}
    for f in files:
        p = tmp / f["name"]
        if not p.is_file() or p.stat().st_size != f["size"]:
            absent.setdefault(f["rank"], []).append(f["name"])
    if not absent:
        return None
    parts = [f"rank {r}'s {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}" for r, names in sorted(absent.items())]
    return (
        f"{'; '.join(parts)} missing at rank 0's {tmp} (on {_host()}): the checkpoint directory is not one storage "
        "for every rank (node-local disks?)"
    )
