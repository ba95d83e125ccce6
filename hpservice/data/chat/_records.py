"""Records as the user wrote them: JSONL, Parquet, and a directory saved by ``datasets``.

Every file is an untrusted input (``hpservice.inputs``): opened read-only and confined, a JSONL
line bounded in bytes and in JSON structure. ``path`` is one file, a glob, or a list of either.

- JSONL: one JSON object per line (blank lines skipped); ``where`` is ``file:line``.
- Parquet: row by row, in row groups (never the whole file at once); ``where`` is ``file:row``.
- ``datasets``' ``save_to_disk`` directory: the Arrow stream files its ``state.json`` lists, read
  with pyarrow (no code of the dataset's, no pickle); a ``DatasetDict`` directory is refused
  naming its splits.

Parquet and Arrow store records with one schema, so a key a record did not have reads back as
null (a struct's missing key inside ``tool_calls`` arguments, a field only later records have).
Such nulls are dropped, recursively: a null and a missing key are the same thing to a template
(transformers drops null message keys too), and a template testing ``is defined`` then sees the
record as written.
"""

from __future__ import annotations

import glob as globlib
from collections.abc import Iterator
from pathlib import Path

__all__ = ["MAX_RECORD_BYTES", "expand_paths", "read_records"]

MAX_RECORD_BYTES = 64 << 20  # one conversation (a JSONL line)


def expand_paths(path: str | list[str]) -> list[str]:
    """The files a ``data.path`` names, in order: each glob's matches sorted; a missing file or a
    glob that matches nothing is an error naming it."""
    out: list[str] = []
    for p in [path] if isinstance(path, str) else list(path):
        if any(c in p for c in "*?["):
            found = sorted(globlib.glob(p, recursive=True))
            if not found:
                raise FileNotFoundError(f"{p}: the glob matches no file")
            out += found
        elif not Path(p).exists():
            raise FileNotFoundError(f"{p}: no such file or directory")
        else:
            out.append(p)
    return out


def _without_nulls(value):
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def _decoded(lines, path: str) -> Iterator[str]:
    try:
        yield from lines
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start} of a line)") from None


def _jsonl(path: str) -> Iterator[tuple[str, object]]:
    from hpservice.inputs import load_json, open_input, read_lines

    with open_input(path, "r") as f:
        for n, line in enumerate(_decoded(read_lines(f, MAX_RECORD_BYTES, path), path), start=1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                yield where, load_json(line, where)
            except ValueError as e:
                raise ValueError(f"{where}: not a JSON object ({e})") from None


def _parquet(path: str) -> Iterator[tuple[str, object]]:
    import pyarrow.parquet as pq

    from hpservice.inputs import open_input

    with open_input(path) as f:
        try:
            reader = pq.ParquetFile(f)
        except Exception as e:  # pyarrow's own error types
            raise ValueError(f"{path}: not a Parquet file ({e})") from None
        row = 0
        for batch in reader.iter_batches(batch_size=1024):
            for record in batch.to_pylist():
                row += 1
                yield f"{path}:row {row}", _without_nulls(record)


def _arrow_dir(path: str) -> Iterator[tuple[str, object]]:
    import pyarrow as pa

    from hpservice.inputs import MAX_JSON_BYTES, load_json, open_input, read_input

    root = Path(path)
    if (root / "dataset_dict.json").is_file():
        splits = load_json(read_input(root / "dataset_dict.json", MAX_JSON_BYTES), str(root / "dataset_dict.json"))
        names = splits.get("splits") if isinstance(splits, dict) else None
        raise ValueError(f"{path}: a DatasetDict of splits {names}; name one split's directory (e.g. {path}/train)")
    state_file = root / "state.json"
    if not state_file.is_file():
        raise ValueError(f"{path}: a directory without state.json: not one saved by datasets' save_to_disk")
    state = load_json(read_input(state_file, MAX_JSON_BYTES), str(state_file))
    files = [d.get("filename") for d in state.get("_data_files", [])] if isinstance(state, dict) else []
    if not files or not all(isinstance(n, str) and "/" not in n and n not in ("", ".", "..") for n in files):
        raise ValueError(f"{state_file}: _data_files does not list the dataset's Arrow files")
    row = 0
    for name in files:
        with open_input(root / name) as f:
            try:
                reader = pa.ipc.open_stream(f)
            except Exception as e:
                raise ValueError(f"{root / name}: not an Arrow stream ({e})") from None
            for batch in reader:
                for record in batch.to_pylist():
                    row += 1
                    yield f"{path}:row {row}", _without_nulls(record)


def read_records(path: str) -> Iterator[tuple[str, object]]:
    """(where, record) of one file or directory, in order."""
    if Path(path).is_dir():
        yield from _arrow_dir(path)
    elif path.endswith(".parquet"):
        yield from _parquet(path)
    elif path.endswith((".jsonl", ".json")):
        yield from _jsonl(path)
    else:
        raise ValueError(f"{path}: expected a .jsonl or .parquet file or a datasets directory")
