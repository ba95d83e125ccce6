"""File-backed sources: TokenFile (pre-tokenised ``.bin``) and TextFile (UTF-8 text, byte tokens).

Token file format (nanoGPT style): a flat array of token ids, no header, little-endian
``uint16`` (vocabularies up to 65536) or ``uint32``. The dtype is the ``dtype`` argument if
given, else ``uint32`` when the file name ends in ``.u32.bin`` and ``uint16`` otherwise.
``write_token_file`` writes this format.

Both sources memory-map the file (``numpy.memmap``, read-only, opened lazily on first use) and
copy out only the windows a rank needs, so a file larger than memory is fine, and pickling a
source (e.g. to ship it to a Ray actor) sends the path, not the data.

Window sampling: step ``s`` draws ``global_batch`` window starts uniformly from the valid
starts ``[0, num_tokens - seq_len)`` with a generator seeded by ``(seed, s)``; rank ``r``
reads windows ``[r * local_b, (r + 1) * local_b)``. Windows may overlap and repeat (sampling
with replacement); there are no epochs.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from hpservice.inputs import open_input

from ._base import TAG_WINDOWS, TokenSource, check_int, check_seed, seeded_rng
from ._tokenizer import ByteTokenizer

__all__ = ["TextFile", "TokenFile", "resolve_token_dtype", "write_token_file"]

_U32_SUFFIX = ".u32.bin"
_MAX_CHUNK = 1 << 26  # tokens per chunk when scanning a whole file for its max id


def resolve_token_dtype(path: str | os.PathLike, dtype=None) -> np.dtype:
    """The little-endian dtype of a token file: ``dtype`` if given, else from the file name.

    ``dtype`` may be anything ``numpy.dtype`` accepts for a 2- or 4-byte unsigned int
    (``np.uint16``, ``"uint32"``, ...). Without it: ``uint32`` for ``*.u32.bin``, else ``uint16``.
    """
    if dtype is None:
        return np.dtype("<u4") if str(path).endswith(_U32_SUFFIX) else np.dtype("<u2")
    d = np.dtype(dtype)
    if d.kind != "u" or d.itemsize not in (2, 4):
        raise ValueError(f"token file dtype must be uint16 or uint32, got {d} (for {path})")
    return np.dtype(f"<u{d.itemsize}")


def write_token_file(path: str | os.PathLike, tokens, dtype=None) -> Path:
    """Write ``tokens`` (ints, any shape; flattened) as a token file; returns the path.

    ``dtype``: ``np.uint16`` or ``np.uint32``; by default inferred from the name like
    ``TokenFile`` does (``uint32`` for ``*.u32.bin``, else ``uint16``). Name a ``uint32`` file
    ``*.u32.bin`` so ``TokenFile`` infers its dtype, or pass ``dtype`` there too; writing
    ``uint16`` to a ``*.u32.bin`` name is refused. Raises ValueError if a token does not fit
    the dtype (it is never truncated). The file is written next to its final name and renamed,
    so readers never see half of it.
    """
    path = Path(path)
    d = resolve_token_dtype(path, dtype)
    if d.itemsize != 4 and path.name.endswith(_U32_SUFFIX):
        raise ValueError(f"{path}: a *{_U32_SUFFIX} file must hold uint32 tokens, got dtype {d.name}")
    arr = np.asarray(tokens).reshape(-1)
    if arr.size and arr.dtype.kind not in "iub":
        raise ValueError(f"tokens must be integers, got dtype {arr.dtype} (writing {path})")
    if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(d).max):
        raise ValueError(
            f"tokens must be in [0, {np.iinfo(d).max}] for {d.name}, got [{arr.min()}, {arr.max()}] (writing {path})"
        )
    tmp = path.with_name(path.name + ".tmp")
    arr.astype(d).tofile(tmp)
    os.replace(tmp, path)
    return path


def _check_file(path: str | os.PathLike) -> Path:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"data file not found: {path}")
    if not path.is_file():
        raise ValueError(f"data path is not a regular file: {path}")
    return path


class _MemmapWindows(TokenSource):
    """Shared part of the file sources: lazy read-only memmap and seeded window sampling."""

    def __init__(self, path: str | os.PathLike, dtype: np.dtype, seed: int):
        self.path = _check_file(path)
        self.dtype = dtype
        self.seed = check_seed(seed)
        size = self.path.stat().st_size
        if size % dtype.itemsize:
            raise ValueError(
                f"{self.path}: size {size} bytes is not a multiple of {dtype.itemsize} "
                f"({dtype.name} tokens); wrong dtype, or a truncated file?"
            )
        self.num_tokens = size // dtype.itemsize
        if self.num_tokens < 2:
            raise ValueError(f"{self.path}: holds {self.num_tokens} tokens; need at least 2 (an input and its target)")
        self._mmap: np.memmap | None = None

    @property
    def tokens(self) -> np.memmap:
        """The whole file as a read-only 1-D memmap (opened on first use)."""
        if self._mmap is None:  # an input: read-only, and confined to the job's input roots when opened
            with open_input(self.path) as f:
                self._mmap = np.memmap(f, dtype=self.dtype, mode="r", shape=(self.num_tokens,))
        return self._mmap

    def window_starts(self, step: int, global_batch: int, seq_len: int) -> np.ndarray:
        """Start offsets of the ``global_batch`` windows of ``step`` (the same on every rank)."""
        n_starts = self.num_tokens - seq_len
        if n_starts < 1:
            raise ValueError(
                f"{self.path}: holds {self.num_tokens} tokens, fewer than seq_len + 1 = {seq_len + 1} for one sample"
            )
        rng = seeded_rng(TAG_WINDOWS, self.seed, step)
        return rng.integers(0, n_starts, size=global_batch)

    def _rows(self, step: int, global_batch: int, first: int, count: int, seq_len: int) -> np.ndarray:
        starts = self.window_starts(step, global_batch, seq_len)[first : first + count]
        tokens = self.tokens
        rows = np.empty((count, seq_len + 1), dtype=np.int64)
        for r, start in enumerate(starts):
            rows[r] = tokens[start : start + seq_len + 1]
        return rows

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_mmap"] = None  # reopen after unpickling instead of sending the data
        return state


class TokenFile(_MemmapWindows):
    """Windows of a pre-tokenised ``.bin`` file of ``uint16``/``uint32`` ids (see the module docstring).

    ``vocab_size``: pass the model's vocabulary size; every batch is then checked to hold only
    ids below it (an out-of-range id would otherwise fail deep inside an embedding, on GPU
    asynchronously). If not given, it is ``max id + 1``, computed on first access by one
    chunked pass over the file.
    """

    def __init__(self, path: str | os.PathLike, dtype=None, *, vocab_size: int | None = None, seed: int = 0):
        super().__init__(path, resolve_token_dtype(path, dtype), seed)
        self._vocab_size = None if vocab_size is None else check_int("vocab_size", vocab_size, 1)
        self._check_ids = vocab_size is not None

    @property
    def vocab_size(self) -> int:
        if self._vocab_size is None:
            tokens = self.tokens
            top = 0
            for lo in range(0, self.num_tokens, _MAX_CHUNK):
                top = max(top, int(tokens[lo : lo + _MAX_CHUNK].max()))
            self._vocab_size = top + 1
        return self._vocab_size

    def _rows(self, step: int, global_batch: int, first: int, count: int, seq_len: int) -> np.ndarray:
        rows = super()._rows(step, global_batch, first, count, seq_len)
        if self._check_ids and rows.size and int(rows.max()) >= self._vocab_size:
            raise ValueError(
                f"{self.path}: token id {int(rows.max())} at step {step} is >= vocab_size={self._vocab_size}"
            )
        return rows

    def __repr__(self) -> str:
        return f"TokenFile({str(self.path)!r}, dtype={self.dtype.name}, num_tokens={self.num_tokens}, seed={self.seed})"


class TextFile(_MemmapWindows):
    """Windows of a UTF-8 text file, tokenised by ``ByteTokenizer``: token = byte (vocab 256).

    The file's bytes are the token stream, memory-mapped as ``uint8``; nothing is decoded or
    validated up front, and windows may start or end inside a multi-byte character (a byte
    model does not care; ``tokenizer.decode`` replaces the broken ends when printing).
    """

    vocab_size = ByteTokenizer.vocab_size

    def __init__(self, path: str | os.PathLike, *, seed: int = 0):
        super().__init__(path, np.dtype(np.uint8), seed)
        self.tokenizer = ByteTokenizer()

    def __repr__(self) -> str:
        return f"TextFile({str(self.path)!r}, num_tokens={self.num_tokens}, seed={self.seed})"
