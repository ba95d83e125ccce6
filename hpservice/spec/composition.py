"""What composes with what: every setting that parses on its own but cannot run with another.

One table (``COMPOSITIONS``), read by every layer that must refuse or explain a combination:

- the spec (``model.py``) checks the rules of its ``parallelism`` section and of the whole job
  when a spec is parsed, so ``validate``, ``run`` and ``submit`` refuse them alike;
- the preflight (``hpservice.preflight.check_composition``) checks the rules that need the
  model (a factory's vocabulary), once it is known;
- the runtime raises the same rule's message where it meets the combination anyway (a job built
  in code, without a spec: ``refusal(rule_id, ...)``);
- the docs print the table (``docs/jobspec.md``, from ``markdown_table``).

Each rule names the field a refusal is reported at, what it does not compose with, and what to do
instead. A rule whose combination gets built is deleted here, and nowhere else.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

__all__ = ["COMPOSITIONS", "Composition", "markdown_table", "refusal", "refusals"]

Scope = Literal["parallelism", "job", "model", "runtime"]
_WHEN = {
    "parallelism": "when the spec is parsed",
    "job": "when the spec is parsed",
    "model": "at preflight (validate, run, submit), once the model's config is known",
    "runtime": "when the job builds its layout",
}


@dataclasses.dataclass(frozen=True)
class Composition:
    """A combination that is refused. ``fields(subject, cfg)`` lists the fields at which
    ``subject`` (by ``scope``: the ``parallelism`` section, the whole job, the job with its model's
    config ``cfg``) holds it, none when it does not; ``message`` is formatted with
    ``facts(subject, cfg, field)`` and the ``field``."""

    id: str
    scope: Scope
    combination: str  # for the docs: what does not compose
    message: str
    fields: Callable[[Any, Any], list[str]]
    facts: Callable[[Any, Any, str], dict] = lambda subject, cfg, field: {}


def _sections(spec) -> list[tuple[str, Any]]:
    """``data`` and, where set, ``eval.data``, as (prefix, section)."""
    found = [("data", spec.data)]
    if spec.eval.data is not None:
        found.append(("eval.data", spec.eval.data))
    return [(where, d) for where, d in found if d is not None]


def _seq_len_not_divisible(spec, _) -> list[str]:
    cp = spec.parallelism.cp
    return [f"{where}.seq_len" for where, d in _sections(spec) if cp > 1 and d.seq_len % (2 * cp)]


def _documents_under_pp(spec, _) -> list[str]:
    if spec.parallelism.pp == 1:
        return []
    found = [f"{where}.document_mask" for where, d in _sections(spec) if d.document_mask]
    return found + [f"{where}.packing" for where, d in _sections(spec) if d.kind == "chat" and d.packing != "none"]


def _compiled_document_masks(spec, _) -> list[str]:
    if not spec.training.compile or spec.parallelism.cp > 1:
        return []
    packed = any(d.document_mask or (d.kind == "chat" and d.packing != "none") for _, d in _sections(spec))
    return ["training.compile"] if packed else []


def _qlora_layouts(spec, _) -> list[str]:
    if spec.model.lora is None or spec.model.lora.quantize_base == "none":
        return []
    return [f"parallelism.{k}" for k in ("tp", "ep") if getattr(spec.parallelism, k) > 1]


def _qlora_without_base(spec, _) -> list[str]:
    if spec.model.lora is None or spec.model.lora.quantize_base == "none" or spec.model.init_from is not None:
        return []
    return ["model.lora.quantize_base"]


def _objective_without_its_data(spec, _) -> list[str]:
    dpo, pairs = spec.objective.kind == "dpo", spec.data.kind == "preference"
    if dpo and not pairs:
        return ["objective.kind"]
    if pairs and not dpo:
        return ["data.kind"]
    if spec.eval.data is not None and spec.eval.data.kind == "preference" and not dpo:
        return ["eval.data.kind"]
    return []


def _dpo_with_eval(spec, _) -> list[str]:
    return ["eval.interval"] if spec.objective.kind == "dpo" and spec.eval.interval else []


def _dpo_reference(spec, _) -> list[str]:
    o, m = spec.objective, spec.model
    if o.kind != "dpo":
        return []
    if o.reference in ("adapters_off", "initial_adapter") and m.lora is None:
        return ["objective.reference"]
    if o.reference == "initial_adapter" and m.init_adapter is None:
        return ["objective.reference"]
    return []


def _reference_reason(spec) -> str:
    r = spec.objective.reference
    if spec.model.lora is None:
        return f"{r} needs model.lora (the reference is the model with its adapters off or at their start)"
    return "initial_adapter needs model.init_adapter (the adapter the reference keeps frozen)"


def _synthetic_without_vocab(spec, _) -> list[str]:
    if spec.model.name is None or ":" not in spec.model.name:
        return []
    return [f"{where}.vocab_size" for where, d in _sections(spec) if d.kind == "synthetic" and d.vocab_size is None]


COMPOSITIONS: tuple[Composition, ...] = (
    Composition(
        id="sequence_parallel_needs_tp",
        scope="parallelism",
        combination="`sequence_parallel: true` with `tp: 1`",
        message="needs tp > 1 (it shards over the tensor-parallel ranks)",
        fields=lambda p, _: ["parallelism.sequence_parallel"] if p.sequence_parallel and p.tp == 1 else [],
    ),
    Composition(
        id="ep_with_pp_or_cp",
        scope="parallelism",
        combination="`ep > 1` with `pp > 1` or `cp > 1`",
        message="ep > 1 with pp > 1 or cp > 1 is not built yet; use ep with dp, HSDP and tp",
        fields=lambda p, _: ["parallelism.ep"] if p.ep > 1 and (p.pp > 1 or p.cp > 1) else [],
    ),
    Composition(
        id="pp_with_cp",
        scope="parallelism",
        combination="`pp > 1` with `cp > 1`",
        message="pp > 1 with cp > 1 is not built yet; use one of them",
        fields=lambda p, _: ["parallelism.pp"] if p.pp > 1 and p.cp > 1 else [],
    ),
    Composition(
        id="cp_seq_len",
        scope="job",
        combination="`cp > 1` with a `seq_len` (of `data` or `eval.data`) not divisible by `2 x cp`",
        message="{seq_len} is not divisible by 2 x parallelism.cp = {chunks} (context parallelism gives each rank a "
        "head and a tail chunk of every sequence)",
        fields=_seq_len_not_divisible,
        facts=lambda spec, _, field: {"seq_len": _at(spec, field), "chunks": 2 * spec.parallelism.cp},
    ),
    Composition(
        id="documents_with_pp",
        scope="job",
        combination="`pp > 1` with packed documents (`data.document_mask`, or chat data's `packing`)",
        message="attention within each packed document is not built under pipeline parallelism yet (the stages would "
        "attend across documents); use packing: none (chat data), or dp / tp / cp",
        fields=_documents_under_pp,
    ),
    Composition(
        id="compile_with_document_masks",
        scope="job",
        combination="`training.compile` with packed documents (`data.document_mask`, or chat data's `packing`) and "
        "`cp: 1`",
        message="torch.compile does not trace the one-rank document-masked attention yet (it fails at the first "
        "step); use compile: false, packing: none (chat data), or cp > 1, where it runs",
        fields=_compiled_document_masks,
    ),
    Composition(
        id="qlora_with_tp_or_ep",
        scope="job",
        combination="`model.lora.quantize_base: nf4` with `tp > 1` or `ep > 1`",
        message="a 4-bit NF4 base under tensor or expert parallelism is not built yet; QLoRA runs with dp / "
        "fully_shard / HSDP (each rank holds the NF4 base whole), pp or cp",
        fields=_qlora_layouts,
    ),
    Composition(
        id="qlora_without_init_from",
        scope="job",
        combination="`model.lora.quantize_base: nf4` without `model.init_from`",
        message="nf4 quantises a pretrained base: set model.init_from (a Hugging Face checkpoint directory)",
        fields=_qlora_without_base,
    ),
    Composition(
        id="objective_and_data",
        scope="job",
        combination="`objective.kind: dpo` without `data.kind: preference`, or preference data with `objective.kind: sft`",
        message="DPO trains on preference pairs and preference pairs train only with DPO: set objective.kind dpo and "
        "data.kind preference together",
        fields=_objective_without_its_data,
    ),
    Composition(
        id="dpo_with_eval",
        scope="job",
        combination="`objective.kind: dpo` with `eval.interval`",
        message="evaluation during DPO (its loss and rewards on held-out pairs) is not built yet",
        fields=_dpo_with_eval,
    ),
    Composition(
        id="dpo_reference",
        scope="job",
        combination="`objective.reference` that the model cannot give: adapters_off or initial_adapter without "
        "`model.lora`, or initial_adapter without `model.init_adapter`",
        message="{reason}",
        fields=_dpo_reference,
        facts=lambda spec, _, field: {"reason": _reference_reason(spec)},
    ),
    Composition(
        id="factory_synthetic_vocab",
        scope="model",  # after admission: a factory outside the allowlist is refused as that first
        combination="a custom model (`model.name: pkg.mod:fn`) on synthetic data without `vocab_size`",
        message="required with a custom model ({name}) on synthetic data: a built-in model's comes from its config, "
        "a factory's is not known before it is built",
        fields=_synthetic_without_vocab,
        facts=lambda spec, _, field: {"name": spec.model.name},
    ),
    Composition(
        id="fsdp_options_without_dp",
        scope="runtime",
        combination="`mixed_precision` or `cpu_offload` with no data-parallel dim (tp alone)",
        message="parallelism.mixed_precision and cpu_offload come from fully_shard: with tp alone (data-parallel size "
        "1) they are not built yet; use dp_shard >= 2 or set them to none/false",
        fields=lambda spec, _: [],  # the layout's sizes are known when it is built (hpservice/train/_parallelize.py)
    ),
)

_BY_ID = {c.id: c for c in COMPOSITIONS}


class _Named(dict):
    def __missing__(self, key: str) -> str:
        return f"<{key}>"


def refusal(rule_id: str, **facts) -> str:
    """The message of rule ``rule_id`` with the ``facts`` the caller knows (a fact it does not
    know reads ``<name>``): the runtime's refusal, in the table's wording."""
    return _BY_ID[rule_id].message.format_map(_Named(facts))


def refusals(scope: Scope, subject: Any, cfg: Any = None) -> list[tuple[str, str]]:
    """(field, message) of every rule of ``scope`` that ``subject`` holds, for each field it names."""
    out = []
    for rule in COMPOSITIONS:
        if rule.scope != scope:
            continue
        for field in rule.fields(subject, cfg):
            out.append((field, rule.message.format(field=field, **rule.facts(subject, cfg, field))))
    return out


def _at(spec, path: str):
    value = spec
    for part in path.split("."):
        value = getattr(value, part)
    return value


def markdown_table() -> str:
    """The table for the docs: what does not compose, when it is refused, and what it says."""
    lines = ["| does not compose | refused | says |", "|---|---|---|"]
    for rule in COMPOSITIONS:
        message = rule.message.replace("{", "<").replace("}", ">").replace("|", "/")
        lines.append(f"| {rule.combination} | {_WHEN[rule.scope]} | {message} |")
    return "\n".join(lines) + "\n"
