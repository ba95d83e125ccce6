"""ByteTokenizer: the identity map between UTF-8 bytes and token ids (vocabulary of 256)."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["ByteTokenizer"]


class ByteTokenizer:
    """Token id = byte value of the UTF-8 encoding, so ``vocab_size == 256``.

    No merges, no special tokens: a non-ASCII character becomes several tokens (its UTF-8
    bytes). ``decode(encode(s)) == s`` for every string. ``decode`` of a sequence that cuts a
    multi-byte character (e.g. a model's sample, or a window taken from the middle of a file)
    replaces the broken bytes with U+FFFD instead of raising.
    """

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of ``text`` as a list of ints in ``[0, 256)``."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        """The text whose UTF-8 bytes are ``ids`` (ints in ``[0, 256)``; tensors/arrays of them too)."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < 256]
        if bad:
            raise ValueError(f"byte token ids must be in [0, 256), got {bad[:5]}")
        return bytes(ids).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=256)"
