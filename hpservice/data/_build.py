"""build_source: a TokenSource from a job config's ``data`` section."""

from __future__ import annotations

import os

from ._base import TokenSource
from ._files import TextFile, TokenFile
from ._synthetic import SyntheticTokens

__all__ = ["SOURCE_KINDS", "build_source"]

SOURCE_KINDS = ("synthetic", "tokens", "text")


def build_source(
    kind: str,
    *,
    path: str | os.PathLike | None = None,
    vocab_size: int | None = None,
    seed: int = 0,
    dtype=None,
) -> TokenSource:
    """Build a source by name.

    * ``"synthetic"``: ``SyntheticTokens(vocab_size, seed)``; needs ``vocab_size``, takes no path.
    * ``"tokens"``: ``TokenFile(path, dtype, vocab_size=vocab_size, seed=seed)``; needs ``path``.
    * ``"text"``: ``TextFile(path, seed=seed)``; needs ``path``; ``vocab_size``, if given, must be 256.

    Raises ValueError for an unknown kind or a missing/contradictory argument, and
    FileNotFoundError (naming the path) for a file that does not exist.
    """
    if kind not in SOURCE_KINDS:
        raise ValueError(f"unknown data source kind {kind!r}; expected one of {', '.join(SOURCE_KINDS)}")
    if kind == "synthetic":
        if vocab_size is None:
            raise ValueError("data source 'synthetic' needs vocab_size")
        if path is not None:
            raise ValueError(f"data source 'synthetic' takes no path, got {path!r}")
        if dtype is not None:
            raise ValueError(f"data source 'synthetic' takes no dtype, got {dtype!r}")
        return SyntheticTokens(vocab_size, seed=seed)
    if path is None:
        raise ValueError(f"data source {kind!r} needs a path")
    if kind == "tokens":
        return TokenFile(path, dtype, vocab_size=vocab_size, seed=seed)
    if vocab_size is not None and vocab_size != TextFile.vocab_size:
        raise ValueError(f"data source 'text' is byte-level with vocab_size 256, got vocab_size={vocab_size}")
    if dtype is not None:
        raise ValueError(f"data source 'text' takes no dtype, got {dtype!r}")
    return TextFile(path, seed=seed)
