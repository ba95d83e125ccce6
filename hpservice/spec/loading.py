"""Reading a job spec: YAML (safe, 1.2-style floats, bounded aliases and nesting), ``key=value``
overrides, the bounds of a spec as plain data, and validation into a ``JobSpec`` whose errors name
every bad field (``training.steps: ...``) and, for unknown fields, what is allowed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from .model import INT64, JobSpec, SpecError, did_you_mean

# Bounds of a spec as plain data, whatever its source (a YAML alias bomb expands past any body
# limit): nesting, values after alias expansion, characters of strings, integers (stored as int64).
MAX_DEPTH = 32
MAX_VALUES = 20_000
MAX_TEXT = 1 << 20
MAX_ALIASES = 100


class _Loader(yaml.SafeLoader):
    """YAML with 1.2-style floats (PyYAML reads ``3e-4``, no dot, as a string, which a strict
    spec rejects), at most ``MAX_ALIASES`` aliases and ``MAX_DEPTH`` levels of nesting."""

    def __init__(self, stream):
        super().__init__(stream)
        self._aliases = 0
        self._depth = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.events.AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_ALIASES:
                raise yaml.composer.ComposerError(
                    None, None, f"more than {MAX_ALIASES} aliases", self.peek_event().start_mark
                )
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH + 1:
                raise yaml.composer.ComposerError(
                    None, None, f"nested deeper than {MAX_DEPTH} levels", self.peek_event().start_mark
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"^[-+]?(?:[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?|\.[0-9_]+(?:[eE][-+]?[0-9]+)?|[0-9][0-9_]*[eE][-+]?[0-9]+|\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+0123456789."),
)


def yaml_error(e: yaml.YAMLError, file: str | Path | None = None) -> str:
    """How every reader of YAML reports a syntax error: ``FILE:LINE:COL: YAML syntax error: ...``
    for a file (editors jump there), ``YAML syntax error at line L, column C: ...`` for a body."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e)
    if file is not None:
        return f"{file}:{mark.line + 1}:{mark.column + 1}: YAML syntax error: {problem}" if mark else f"{file}: YAML syntax error: {problem}"
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    return f"YAML syntax error{where}: {problem}"


def yaml_load(text: str):
    """Parse YAML text (safe loader, 1.2-style floats)."""
    return yaml.load(text, Loader=_Loader)


def _section_fields(loc: tuple) -> list[str] | None:
    """The field names (and aliases) allowed where ``loc``'s last part was found."""
    model: type[BaseModel] = JobSpec
    for part in loc[:-1]:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            field = next((f for f in model.model_fields.values() if f.alias == part), None)
        if field is None:
            return None
        inner = [a for a in getattr(field.annotation, "__args__", (field.annotation,)) if isinstance(a, type)]
        inner = [a for a in inner if issubclass(a, BaseModel)]
        if not inner:
            return None
        model = inner[0]
    return [f.alias or name for name, f in model.model_fields.items()]


def _message(err: dict) -> str:
    if err["type"] == "extra_forbidden":
        allowed = _section_fields(err["loc"])
        if allowed:
            return f"unknown field{did_you_mean(err['loc'][-1], allowed)}; allowed: {', '.join(allowed)}"
    return err["msg"].removeprefix("Value error, ")


def _located(path: str, message: str) -> tuple[str, str]:
    """A validator's message that names a field inside its section (``"model.flavor: ..."``), or
    for the whole spec's validators any field (``"data.seq_len: ..."``), is reported at that field."""
    field, sep, rest = message.partition(": ")
    inside = field.startswith(path + ".") or (path == "<root>" and field.partition(".")[0] in JobSpec.model_fields)
    if sep and inside and " " not in field:
        return field, rest
    return path, message


def _field_path(loc: tuple) -> str:
    return ".".join(str(p) for p in loc) or "<root>"


def check_bounds(data: Any, *, source: str = "job") -> None:
    """Raise SpecError unless ``data`` stays within the spec's bounds: nesting, number of values
    and characters after alias expansion, integers in int64, finite floats. Iterative, and it
    stops at the first bound crossed, so a bomb costs at most ``MAX_VALUES`` steps."""
    stack = [(data, "", 0)]
    values = text = 0
    while stack:
        value, path, depth = stack.pop()
        values += 1
        where = path or "<root>"
        if values > MAX_VALUES:
            raise SpecError(f"{source}: more than {MAX_VALUES} values", [(where, f"more than {MAX_VALUES} values")])
        if depth > MAX_DEPTH:
            raise SpecError(f"{source}: nested deeper than {MAX_DEPTH} levels", [(where, "nested too deeply")])
        if isinstance(value, bool) or value is None:
            continue
        if isinstance(value, int):
            if not INT64[0] <= value <= INT64[1]:
                raise SpecError(f"{source}: integer out of range", [(where, "integer outside the 64-bit range")])
        elif isinstance(value, float):
            if value != value or value in (float("inf"), float("-inf")):
                raise SpecError(f"{source}: non-finite number", [(where, f"{value} is not a finite number")])
        elif isinstance(value, str):
            text += len(value)
        elif isinstance(value, dict):
            for key, item in value.items():
                text += len(str(key))
                stack.append((item, f"{path}.{key}" if path else str(key), depth + 1))
        elif isinstance(value, list | tuple):
            stack.extend((item, f"{path}.{i}" if path else str(i), depth + 1) for i, item in enumerate(value))
        if text > MAX_TEXT:
            raise SpecError(f"{source}: more than {MAX_TEXT} characters of text", [(where, "too much text")])


def parse_job(data: Any, *, source: str = "job") -> JobSpec:
    """Validate a mapping into a JobSpec; raise SpecError naming every bad field."""
    if not isinstance(data, dict):
        raise SpecError(f"{source}: expected a mapping of sections, got {type(data).__name__}")
    check_bounds(data, source=source)
    try:
        text = json.dumps(data)
    except (TypeError, ValueError) as e:
        raise SpecError(
            f"{source}: values must be plain strings, numbers, booleans, lists and mappings ({e})"
        ) from None
    try:
        # JSON mode: strict types, with JSON's own conversions (arrays for tuples, ints for floats).
        return JobSpec.model_validate_json(text)
    except ValidationError as e:
        errors = [_located(_field_path(err["loc"]), _message(err)) for err in e.errors()]
        lines = "\n".join(f"  {path}: {msg}" for path, msg in errors)
        raise SpecError(f"{source}: invalid job spec\n{lines}", errors) from None


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply ``key.path=value`` overrides (values parsed as YAML) to a job mapping."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise SpecError(f"override {item!r}: expected key.path=value")
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise SpecError(f"override {item!r}: {part} is not a section")
        node[parts[-1]] = yaml_load(raw)
    return data


def load_job(path: str | Path, overrides: list[str] | None = None) -> JobSpec:
    """Read a YAML job file; YAML errors name the line, spec errors the field path."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise SpecError(f"{path}: cannot read job file ({e.strerror})") from None
    try:
        data = yaml_load(text)
    except yaml.YAMLError as e:
        raise SpecError(yaml_error(e, path)) from None
    data = data if data is not None else {}
    if overrides:
        if not isinstance(data, dict):
            raise SpecError(f"{path}: expected a mapping of sections")
        apply_overrides(data, overrides)
    return parse_job(data, source=str(path))

