"""Opening a job's input files: read-only, and confined to the allowed roots at the moment of opening.

A job spec sent to the service is untrusted, and so is every file it names. The service checks
input paths at submit (``api/admission.py``), but a tenant who can write under a data root can
swap a checked file for a symlink to any file afterwards; a check of the *name* says nothing about
what a later ``open`` reaches. So a worker checks what it actually opened: it opens the path
(following symlinks, read-only), then asks the kernel which file the descriptor refers to
(``/proc/self/fd/N``) and refuses it unless that real path lies under one of the roots. The check
and the read are on one descriptor, so a swap between them cannot change what is read; libraries
that need a path get ``/proc/self/fd/N``, which names that same open file.

The roots are one fact of the run: ``JobSpec.input_roots``, set by the service when it admits a
job (its data roots and the owner's job directories) and ``None`` (anywhere) under
``hpservice run`` and torchrun, where the user reads their own files. ``confine(roots)`` installs
them for the process (a worker runs one job); every reader of an input goes through
``open_input`` / ``input_dir``.

Where ``/proc/self/fd`` does not exist (macOS), the real path of the name is checked right after
opening, which narrows the race but does not close it; the service's workers run on Linux.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

__all__ = ["InputError", "confine", "input_dir", "open_input", "opened_path"]


class InputError(PermissionError):
    """An input resolved (at open time) to a file outside the roots the job may read."""


_roots: tuple[Path, ...] | None = None  # None: inputs may be anywhere (the user's own machine)


def confine(roots: Sequence[str | os.PathLike] | None) -> None:
    """Allow this process to read inputs only under ``roots`` (None: anywhere)."""
    global _roots
    _roots = None if roots is None else tuple(Path(os.path.realpath(r)) for r in roots)


def _fd_target(fd: int, name: str | os.PathLike) -> Path:
    """The real path of the file open as ``fd`` (the kernel's answer where it has one)."""
    try:
        return Path(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:
        return Path(os.path.realpath(name))


def _within(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def _check(fd: int, name: str | os.PathLike, roots: Sequence[Path] | None) -> Path:
    real = _fd_target(fd, name)
    if roots is not None and not any(_within(real, r) for r in roots):
        os.close(fd)
        allowed = ", ".join(map(str, roots)) or "none"
        raise InputError(f"input {os.fspath(name)} resolves to {real}, outside the directories this job may read ({allowed})")
    return real


def open_fd(path: str | os.PathLike, *, directory: bool = False, within: Sequence[Path] | None = None) -> int:
    """A read-only descriptor of ``path``, refused unless what it opened lies under the process's
    roots (and under ``within``, when given). The caller closes it."""
    flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | (getattr(os, "O_DIRECTORY", 0) if directory else 0)
    fd = os.open(path, flags)
    for roots in (_roots, within):
        if roots is not None:
            _check(fd, path, roots)
    return fd


def open_input(path: str | os.PathLike, mode: str = "rb", *, within: Sequence[Path] | None = None):
    """``open(path, mode)`` for an input: read-only (``"rb"`` or ``"r"``) and confined (see the module
    docstring). ``within``: roots this file must also lie under (e.g. its checkpoint directory)."""
    if mode not in ("rb", "r"):
        raise ValueError(f"inputs are opened read-only ('rb' or 'r'), not {mode!r}")
    fd = open_fd(path, within=within)
    return os.fdopen(fd, mode, encoding=None if "b" in mode else "utf-8")


def opened_path(f, name: str | os.PathLike) -> str:
    """A path naming the open file ``f`` itself, for libraries that open by name (safetensors,
    tokenizers): ``/proc/self/fd/N`` where it exists, else ``name`` (checked when it was opened)."""
    proc = f"/proc/self/fd/{f.fileno()}"
    return proc if os.path.exists(proc) else os.fspath(name)


@contextlib.contextmanager
def input_dir(path: str | os.PathLike) -> Iterator[Path]:
    """The real path of the input directory ``path``, checked against the roots while it is open.

    Files read under it are then opened with ``open_input(..., within=[that path])``: each is
    checked on its own descriptor, so a symlink or a swapped directory inside it that leads out is
    refused."""
    fd = open_fd(path, directory=True)
    try:
        yield _fd_target(fd, path)
    finally:
        os.close(fd)
