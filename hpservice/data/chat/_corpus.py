"""Every record of a chat data section, encoded once: token ids, the trained-token mask, and where
each record starts; saved as ``.npy`` arrays (``allow_pickle=False`` both ways) under a key of
everything that decides them, so restarts and other ranks read, never re-encode.

Encoding runs in worker processes (the fast tokenizer, the sandboxed template) in chunks of
records, in order; each record's rendering is bounded in time by an alarm in the process that
renders it (``ChatOptions.template_seconds``), besides the template's own bounds.

What happens to each record is counted (``Corpus.stats``): encoded, too long and dropped or
truncated (``truncation``), without a trained token (skipped: nothing to learn), malformed
(an error naming the file, the line and the field, or skipped and counted under
``on_bad_record: skip``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import multiprocessing
import os
import signal
import threading
from pathlib import Path

import numpy as np

from ._encode import ChatEncoder, ChatTokenizer
from ._formats import RecordError, to_conversation
from ._records import expand_paths, read_records
from ._template import TemplateLimitError

__all__ = ["ChatOptions", "Corpus", "encode_corpus"]

_CHUNK = 256
_EXAMPLES = 5  # skipped records named in the stats


@dataclasses.dataclass(frozen=True)
class ChatOptions:
    seq_len: int
    format: str = "messages"
    fields: tuple[tuple[str, str], ...] = ()
    train_on: str = "assistant"
    train_eos: bool = True
    truncation: str = "drop"  # drop | truncate
    on_bad_record: str = "error"  # error | skip
    template_seconds: float = 10.0

    def key(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


@dataclasses.dataclass
class Corpus:
    tokens: np.ndarray  # int64 [T]: every kept record's tokens, concatenated
    mask: np.ndarray  # bool [T]: trained tokens
    starts: np.ndarray  # int64 [R + 1]: record r is tokens[starts[r]:starts[r + 1]]
    source: np.ndarray  # int32 [R]: which of the section's sources the record came from
    stats: dict

    @property
    def num_records(self) -> int:
        return len(self.starts) - 1

    def save(self, folder: Path) -> None:
        tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
        tmp.mkdir(parents=True, exist_ok=True)
        for name in ("tokens", "mask", "starts", "source"):
            np.save(tmp / f"{name}.npy", getattr(self, name), allow_pickle=False)
        (tmp / "stats.json").write_text(json.dumps(self.stats, indent=1, sort_keys=True))
        os.replace(tmp, folder)  # atomic: a reader sees all of it or none

    @classmethod
    def load(cls, folder: Path) -> Corpus:
        arrays = {n: np.load(folder / f"{n}.npy", allow_pickle=False, mmap_mode="r") for n in ("tokens", "mask", "starts", "source")}
        return cls(**arrays, stats=json.loads((folder / "stats.json").read_text()))


# ---- one worker's state: an encoder built once per process -----------------------------------------

_worker: dict = {}


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout


def _init(tok: ChatTokenizer, opts: ChatOptions) -> None:
    _worker["encoder"] = ChatEncoder(tok, train_eos=opts.train_eos)
    _worker["opts"] = opts


def _encode_one(where: str, record) -> tuple:
    """("ok", ids, mask), ("long",) (surely longer than seq_len, dropped) or ("bad", where, why)."""
    opts: ChatOptions = _worker["opts"]
    timed = threading.current_thread() is threading.main_thread()  # signals reach the main thread only
    previous = signal.signal(signal.SIGALRM, _alarm) if timed else None
    try:
        conv = to_conversation(record, opts.format, dict(opts.fields), opts.train_on)
        if timed:
            signal.setitimer(signal.ITIMER_REAL, opts.template_seconds)
        enc = _worker["encoder"].encode(conv, max_tokens=opts.seq_len if opts.truncation == "drop" else None)
    except _Timeout:
        return ("bad", where, f"rendering and tokenizing it took longer than {opts.template_seconds} s")
    except (RecordError, TemplateLimitError, ValueError) as e:
        return ("bad", where, str(e))
    finally:
        if timed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    if enc is None:
        return ("long",)
    return ("ok", enc.ids, enc.mask)


def _encode_chunk(items: list[tuple[str, object]]) -> list[tuple]:
    return [_encode_one(where, record) for where, record in items]


def _chunks(paths: list[str]):
    """([(where, record)] of up to _CHUNK records, source index) in order."""
    for index, path in enumerate(paths):
        chunk: list = []
        for item in read_records(path):
            chunk.append(item)
            if len(chunk) == _CHUNK:
                yield chunk, index
                chunk = []
        if chunk:
            yield chunk, index


def _results(paths: list[str], tok: ChatTokenizer, opts: ChatOptions, workers: int):
    """(source index, per-record result) in the records' order."""
    chunks = _chunks(paths)
    if multiprocessing.current_process().daemon:  # a daemonic process may not start children
        workers = 0
    if workers <= 0:
        _init(tok, opts)
        for chunk, index in chunks:
            for r in _encode_chunk(chunk):
                yield index, r
        return
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init, initargs=(tok, opts)) as pool:
        pending: list = []
        for chunk, index in chunks:  # a bounded window of chunks in flight, in order
            pending.append((index, pool.submit(_encode_chunk, chunk)))
            if len(pending) >= 2 * workers:
                index0, future = pending.pop(0)
                for r in future.result():
                    yield index0, r
        for index0, future in pending:
            for r in future.result():
                yield index0, r


def encode_corpus(paths: list[list[str]], tok: ChatTokenizer, opts: ChatOptions, *, workers: int = 0) -> Corpus:
    """Encode the records of each source (a list of files per source) into one ``Corpus``.
    Raises ``ValueError`` naming the file, the line and the field for a malformed record (unless
    ``on_bad_record`` is ``skip``), and for a section that yields no trainable record."""
    ChatEncoder(tok, train_eos=opts.train_eos)  # a missing or broken template: refused before any work
    flat: list[str] = []
    source_of: list[int] = []
    for i, files in enumerate(paths):
        for f in expand_paths(files):
            flat.append(f)
            source_of.append(i)
    tokens, masks, lengths, sources = [], [], [], []
    stats = {"records": 0, "encoded": 0, "dropped_too_long": 0, "truncated": 0, "skipped_no_trained_token": 0,
             "skipped_bad": 0, "bad_examples": [], "trained_tokens": 0, "tokens": 0}  # fmt: skip
    for file_index, result in _results(flat, tok, opts, workers):
        stats["records"] += 1
        if result[0] == "bad":
            _, where, why = result
            if opts.on_bad_record == "error":
                raise ValueError(f"{where}: {why}")
            stats["skipped_bad"] += 1
            if len(stats["bad_examples"]) < _EXAMPLES:
                stats["bad_examples"].append(f"{where}: {why}")
            continue
        if result[0] == "long":
            stats["dropped_too_long"] += 1
            continue
        _, ids, mask = result
        if len(ids) > opts.seq_len:
            if opts.truncation == "drop":
                stats["dropped_too_long"] += 1
                continue
            ids, mask = ids[: opts.seq_len], mask[: opts.seq_len]
            stats["truncated"] += 1
        trained = int(mask[1:].sum())  # token 0 has no token before it to predict it from
        if trained == 0:
            stats["skipped_no_trained_token"] += 1
            continue
        stats["encoded"] += 1
        stats["trained_tokens"] += trained
        stats["tokens"] += len(ids)
        tokens.append(ids)
        masks.append(mask)
        lengths.append(len(ids))
        sources.append(source_of[file_index])
    if not tokens:
        raise ValueError(
            f"{', '.join(flat)}: no record to train on ({stats['records']} read: {stats['dropped_too_long']} longer than "
            f"seq_len {opts.seq_len}, {stats['skipped_no_trained_token']} without a trained token, "
            f"{stats['skipped_bad']} malformed)"
        )
    starts = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=starts[1:])
    return Corpus(np.concatenate(tokens), np.concatenate(masks), starts, np.asarray(sources, dtype=np.int32), stats)


def corpus_key(paths: list[list[str]], tok: ChatTokenizer, opts: ChatOptions) -> str:
    """Names an encoded corpus: its files' names, sizes and mtimes, the tokenizer, the template
    and the options."""
    h = hashlib.sha256(opts.key().encode())
    h.update(tok.tokenizer_json.encode())
    h.update((tok.template or "").encode())
    h.update(json.dumps(tok.special_tokens, sort_keys=True).encode())
    for files in paths:
        h.update(b"\x00source")
        for f in expand_paths(files):
            p = Path(f)
            for member in sorted(p.rglob("*")) if p.is_dir() else [p]:
                st = member.stat()
                h.update(f"{member.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]
