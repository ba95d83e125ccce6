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

What an input may cost its reader is bounded here too, once for every reader (the server at
submit, a worker at start, an export):

- only regular files are read: a file is opened non-blocking and refused unless ``fstat`` says it
  is a regular file, so a FIFO, a device or a socket named as an input never blocks a thread;
- ``read_input(path, limit)`` refuses a file past ``limit`` bytes before reading it whole
  (``MAX_JSON_BYTES`` for configs, ``MAX_TOKENIZER_BYTES`` for a ``tokenizer.json``);
- ``read_lines(f, limit, where)`` yields a text file's lines, refusing one past ``limit`` bytes
  before it is held whole (``MAX_DOCUMENT_BYTES``: a JSONL record, a plain-text document);
- ``load_json(text, where)`` refuses JSON nested deeper than ``MAX_JSON_DEPTH`` or holding more
  than ``MAX_JSON_ITEMS`` values, so what a reader then walks is bounded by structure, not only
  by bytes. Readers then keep only the keys they use, validated (``models/hf_config.py``).

Each refusal is an ``InputFileError`` (a ``ValueError``) naming the file and the bound.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path

__all__ = [
    "MAX_DOCUMENT_BYTES",
    "MAX_INDEX_BYTES",
    "MAX_JSON_BYTES",
    "MAX_JSON_DEPTH",
    "MAX_JSON_ITEMS",
    "MAX_TOKENIZER_BYTES",
    "InputError",
    "InputFileError",
    "confine",
    "input_dir",
    "load_json",
    "open_input",
    "opened_path",
    "read_input",
    "read_lines",
]

MAX_JSON_BYTES = 1 << 20  # config.json, generation_config.json, tokenizer_config.json: a few KiB each
MAX_TOKENIZER_BYTES = 64 << 20  # a tokenizer.json: Llama 3's and Qwen's ~10 MiB, Gemma's ~33 MiB
MAX_INDEX_BYTES = 64 << 20  # model.safetensors.index.json (DeepSeek-V3's: 9 MiB), a checkpoint's manifest
MAX_DOCUMENT_BYTES = 256 << 20  # one training document: a JSONL line, a plain-text file
MAX_JSON_DEPTH = 32  # a model config nests 3 levels, a tokenizer.json about 6
MAX_JSON_ITEMS = 4 << 20  # values in one JSON document (a 262k vocabulary with its merges: ~0.8M)


class InputError(PermissionError):
    """An input resolved (at open time) to a file outside the roots the job may read."""


class InputFileError(ValueError):
    """An input that is not a regular file, or is past a bound on its size or structure."""


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
    roots (and under ``within``, when given) and is a regular file (a directory with
    ``directory``). The caller closes it.

    A file is opened with ``O_NONBLOCK``: opening a FIFO for reading otherwise waits for a writer,
    forever if none comes. The flag is cleared again once ``fstat`` says it is a regular file."""
    flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
    flags |= getattr(os, "O_DIRECTORY", 0) if directory else getattr(os, "O_NONBLOCK", 0)
    fd = os.open(path, flags)
    for roots in (_roots, within):
        if roots is not None:
            _check(fd, path, roots)
    if not directory:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            os.close(fd)
            raise InputFileError(f"input {os.fspath(path)} is not a regular file (a FIFO, device or socket is never read)")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return fd


def open_input(path: str | os.PathLike, mode: str = "rb", *, within: Sequence[Path] | None = None):
    """``open(path, mode)`` for an input: read-only (``"rb"`` or ``"r"``) and confined (see the module
    docstring). ``within``: roots this file must also lie under (e.g. its checkpoint directory)."""
    if mode not in ("rb", "r"):
        raise ValueError(f"inputs are opened read-only ('rb' or 'r'), not {mode!r}")
    fd = open_fd(path, within=within)
    return os.fdopen(fd, mode, encoding=None if "b" in mode else "utf-8")


def read_input(path: str | os.PathLike, limit: int, *, within: Sequence[Path] | None = None) -> bytes:
    """The bytes of the input file ``path`` (opened as ``open_input`` does), refused with
    ``InputFileError`` when it holds more than ``limit`` bytes (before reading it whole)."""
    fd = open_fd(path, within=within)
    with os.fdopen(fd, "rb") as f:
        if os.fstat(fd).st_size > limit:
            raise InputFileError(f"{os.fspath(path)}: larger than {limit} bytes, more than a file of its kind holds")
        data = f.read(limit + 1)
    if len(data) > limit:  # a file that grew since fstat
        raise InputFileError(f"{os.fspath(path)}: larger than {limit} bytes, more than a file of its kind holds")
    return data


def read_lines(f, limit: int, where: str) -> Iterator[str]:
    """The lines of the text file ``f`` (open for reading), each refused with ``InputFileError``
    once it passes ``limit`` characters, before more of it is read."""
    while line := f.readline(limit + 1):
        if len(line) > limit:
            raise InputFileError(f"{where}: a line longer than {limit} characters, more than one document may hold")
        yield line


def load_json(text: str | bytes, where: str, *, max_depth: int = MAX_JSON_DEPTH, max_items: int = MAX_JSON_ITEMS):
    """``json.loads(text)``, refused with ``InputFileError`` naming ``where`` when it is not JSON,
    nests deeper than ``max_depth`` or holds more than ``max_items`` values (checked without
    recursion, so no document can exhaust the stack)."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise InputFileError(f"{where}: JSON nested more than {max_depth} levels deep") from None
    except ValueError as e:  # JSONDecodeError, and UnicodeDecodeError of bytes
        raise InputFileError(f"{where}: not valid JSON ({e})") from None
    stack, items = [(value, 1)], 0
    while stack:
        node, depth = stack.pop()
        items += 1
        if items > max_items:
            raise InputFileError(f"{where}: more than {max_items} JSON values")
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        for child in children:
            if isinstance(child, dict | list):
                if depth + 1 > max_depth:
                    raise InputFileError(f"{where}: JSON nested more than {max_depth} levels deep")
                stack.append((child, depth + 1))
            else:
                items += 1
    if items > max_items:
        raise InputFileError(f"{where}: more than {max_items} JSON values")
    return value


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
