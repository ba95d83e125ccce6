"""The job spec's field reference in Markdown (``docs/jobspec.md``; ``hpservice schema --markdown``)."""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel

from .composition import markdown_table
from .model import JobSpec


def fields_reference() -> str:
    """Markdown: every job-spec field with its type, default and meaning (``docs/jobspec.md`` is
    this text; ``hpservice schema --markdown`` prints it)."""
    import typing

    def type_name(annotation) -> str:
        origin, args = typing.get_origin(annotation), typing.get_args(annotation)
        if origin is Literal:
            return " \\| ".join(f"`{a}`" for a in args)
        if origin is dict:
            return "mapping"
        if origin in (list, tuple):
            return f"list of {type_name(args[0])}" if origin is list else "[" + ", ".join(map(type_name, args)) + "]"
        if args:  # a union
            return " \\| ".join(type_name(a) for a in args)
        return "null" if annotation is type(None) else getattr(annotation, "__name__", str(annotation))

    lines = [
        "# Job spec reference",
        "",
        "Generated from `hpservice.spec.JobSpec` (`hpservice schema --markdown`); the JSON Schema is",
        "`hpservice schema`. Unknown fields are errors; values are strictly typed.",
    ]

    def section(model: type[BaseModel], prefix: str) -> None:
        rows, nested = [], []
        for name, f in model.model_fields.items():
            key = f.alias or name
            sub = [a for a in typing.get_args(f.annotation) or (f.annotation,) if isinstance(a, type) and issubclass(a, BaseModel)]
            if sub:
                nested.append((sub[0], f"{prefix}{key}."))
                continue
            value = f.default_factory() if f.default_factory is not None else f.default
            default = "required" if f.is_required() else f"`{json.dumps(value)}`"
            description = (f.description or "").replace("|", "\\|")
            rows.append(f"| `{prefix}{key}` | {type_name(f.annotation)} | {default} | {description} |")
        if rows:
            lines.extend(["", f"## {prefix.rstrip('.') or 'top level'}", "", "| field | type | default | meaning |", "|---|---|---|---|", *rows])
        for model_, prefix_ in nested:
            section(model_, prefix_)

    section(JobSpec, "")
    lines += [
        "",
        "## What does not compose",
        "",
        "Settings that are valid one by one but cannot run together (`hpservice/spec/composition.py`,",
        "the one table the spec, the preflight and the trainer read):",
        "",
        markdown_table().rstrip("\n"),
    ]
    return "\n".join(lines) + "\n"
