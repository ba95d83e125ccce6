"""Everything about a job that can be known before anything starts, checked in one place.

A spec that parses can still be one that can only fail: a layout the workers cannot hold, a
global batch the data-parallel ranks cannot split, a model factory that does not import, a data
file that is not there, a GPU job on a machine without one. Each of these used to cost a
placement, a rendezvous and minutes of retries before the job failed. The checks here run where
the job is handed over, and each names the field, the value and what would work:

- ``check_layout``: the parallelism divides ``resources.workers`` (and each elastic size), the
  global batch divides over the data-parallel ranks and gradient accumulation (or the pipeline's
  micro-batches), the pipeline schedule runs with those micro-batches, and a built-in model splits
  into the pipeline's stages, and expert parallelism divides a built-in model's experts: arithmetic
  on the spec and the model's config, nothing built. Knowable anywhere: ``validate``, ``run``,
  ``submit`` and the API all run it (the API without reading a tenant's file before admission).
- ``check_model``: a ``package.module:factory`` imports here and builds on the meta device
  (nothing is allocated). For a job run on this machine (``validate``, ``run``); the service has
  its operator's allowlist instead (``api/admission.py``), and the server checks at startup that every
  allowed factory imports (``check_factories_import``).
- ``check_inputs``: the files a job reads exist (data, tokenizer, ``model.init_from``,
  ``checkpoint.resume_from``). ``run`` and ``validate`` check them on this machine; the API checks
  the ones under a data root it can see itself (a root it cannot see is the workers' business).
- ``check_composition``: settings that cannot run together (a factory on synthetic data without
  ``data.vocab_size``; a sliding window shorter than ``seq_len`` under ``cp`` or
  ``document_mask``; a ``seq_len`` longer than the model's positions).
- ``check_size``: what one worker must hold at the least (``hpservice.sizing``) against what the
  operator lets a worker hold, and the model's largest tensor against the operator's cap (the
  service runs it; ``validate`` and ``run`` leave a user's own machine to the user).
- ``check_devices``: ``resources.use_gpu: true`` on a machine with no CUDA device, for a job whose
  workers run here.
- ``plan_memory``: the per-rank memory estimate (``hpservice.memory``) against the device's memory
  (``resources.device_memory``, else what the caller knows of the devices), with the nearest
  layouts that fit when it does not; ``parallelism: auto`` resolved to the layout it picks. It
  gives back the spec the job runs with, its estimate in ``memory_estimate``. ``validate``,
  ``run`` and the API (after admission) run it; ``check_layout`` leaves an ``auto`` spec's
  layout to it.

``preflight(spec, ...)`` runs the ones that apply and raises one ``SpecError`` listing them all.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable
from pathlib import Path

from hpservice.parallel_dims import ParallelDims
from hpservice.spec import JobSpec, SpecError, did_you_mean
from hpservice.spec.composition import refusals

Errors = list[tuple[str, str]]


def raise_if(errors: Errors, source: str) -> None:
    """One ``SpecError`` naming every (field, message) in ``errors``; nothing when empty."""
    if errors:
        lines = "\n".join(f"  {path}: {msg}" for path, msg in errors)
        raise SpecError(f"{source}: invalid job spec\n{lines}", errors)


MAX_MICROBATCHES = 4096
"""Micro-batches per step (``grad_accum``, or ``pp_microbatches x grad_accum``): each is a
schedule entry every rank holds and a loop iteration; real recipes use tens to a few hundred."""


def check_layout(spec: JobSpec, *, read_files: bool = True) -> Errors:
    """The parallelism divides the workers, ``min_workers`` is a size the job can shrink to, and
    the global batches split evenly over the data-parallel ranks (and training's micro-batches).

    Arithmetic on the spec and the model's config only: nothing is built, and nothing is split
    per stage. ``read_files``: a ``model.init_from`` config may be read (the service passes False
    before admission has said the tenant may read that path, and checks again after)."""
    errors: Errors = []
    workers = spec.resources.workers
    if spec.parallelism.auto:  # plan_memory picks a layout that passes these checks
        return errors
    try:
        dims = ParallelDims.from_spec(spec.parallelism, workers)
    except SpecError as e:
        message = f"{str(e).removeprefix('parallelism: ')} (resources.workers is {workers})"
        return [("parallelism", message)]
    low = spec.resources.min_workers
    if low is not None and low < workers and low not in spec.elastic_sizes():
        try:
            spec.resized(low)
            message = f"{low} workers cannot run this job's layout"
        except SpecError as e:
            message = str(e)
        sizes = spec.elastic_sizes()
        if sizes:
            message += f" (sizes it can shrink to: {', '.join(map(str, sizes))})"
        errors.append(("resources.min_workers", message))
    p, dp, accum = spec.parallelism, dims.dp_size, spec.training.grad_accum
    micro, micro_name = (p.microbatches(accum), "pipeline micro-batches") if p.pp > 1 else (accum, "grad_accum")
    if micro > MAX_MICROBATCHES:
        field = "parallelism.pp_microbatches" if p.pp > 1 and p.pp_microbatches else "training.grad_accum"
        return errors + [(field, f"{micro} {micro_name} per step, more than {MAX_MICROBATCHES}: use fewer, larger micro-batches")]
    batch = spec.data.global_batch
    if batch % (dp * micro):
        fits = dp * micro
        near = [n for n in (batch // fits * fits, (batch // fits + 1) * fits) if n > 0]
        errors.append((
            "data.global_batch",
            f"{batch} does not split over {dp} data-parallel ranks x {micro_name} {micro}: it must be a multiple of "
            f"{fits} (e.g. {' or '.join(map(str, near))})",
        ))  # fmt: skip
    if p.pp > 1:
        errors += _pipeline_errors(spec, read_files)
    if p.ep > 1:
        errors += _expert_errors(spec, read_files)
    if spec.eval.interval and spec.eval.data is not None and spec.eval.data.global_batch % dp:
        e = spec.eval.data.global_batch
        errors.append(("eval.data.global_batch", f"{e} does not split over {dp} data-parallel ranks: use a multiple of {dp}"))
    return errors


def known_config(spec: JobSpec, read_files: bool = True):
    """The config of the job's built-in model when it can be known here (a flavor with its
    overrides; ``init_from``'s config.json with ``read_files``), else None: a factory's is known
    only once it is built, and a config that does not parse is ``check_inputs``' to report."""
    from hpservice.models import list_models, model_config

    m = spec.model
    if (m.name is not None and m.name not in list_models()) or (m.init_from is not None and not read_files):
        return None
    try:
        return model_config(m.name, m.flavor, m.overrides, m.init_from)
    except Exception:  # an unknown flavor, a broken config.json: check_model / check_inputs say which
        return None


def _pipeline_errors(spec: JobSpec, read_files: bool) -> Errors:
    """The schedule runs with the job's micro-batches, and a built-in model's blocks split into
    its stages (counted from the config; a factory's model is split where it is built: ``check_model``)."""
    from hpservice.parallel.pipelining import check_schedule

    p = spec.parallelism
    micro = p.microbatches(spec.training.grad_accum)
    try:
        check_schedule(p.pp_schedule, p.pp, micro, p.pp_virtual_stages)
    except ValueError as e:
        return [("parallelism.pp_schedule", f"{e} (parallelism.pp_microbatches x training.grad_accum = {micro})")]
    cfg = known_config(spec, read_files)
    return [] if cfg is None else stage_split_errors(cfg, spec)


def stage_split_errors(cfg, spec: JobSpec) -> Errors:
    """A built-in model of config ``cfg`` splits into ``pp x pp_virtual_stages`` stages (what
    ``split_model`` and the models' ``keep_stage`` refuse, computed from counts)."""
    from hpservice.parallel.pipelining import split_layers

    p = spec.parallelism
    stages = p.pp * p.pp_virtual_stages
    try:
        split_layers(cfg.n_layers, stages, p.pp_layers_per_stage)
    except ValueError as e:
        return [("parallelism.pp", str(e))]
    if getattr(cfg, "tie_embeddings", False):
        return [("parallelism.pp", "a model with tie_embeddings cannot be split into pipeline stages: the head and the "
                 "embedding are one parameter, and they would live on different stages")]  # fmt: skip
    return []


def _expert_errors(spec: JobSpec, read_files: bool) -> Errors:
    """A built-in model has mixture-of-experts layers whose experts ``parallelism.ep`` divides (a
    factory's model is checked where it is built)."""
    cfg, ep = known_config(spec, read_files), spec.parallelism.ep
    if cfg is None:
        return []
    if not hasattr(cfg, "num_experts") or cfg.sparse_layers() == 0:
        return [("parallelism.ep", f"{ep}: the model has no mixture-of-experts layers to split (e.g. qwen3_moe has)")]
    if cfg.num_experts % ep:
        return [("parallelism.ep", f"{ep} does not divide the model's {cfg.num_experts} experts per layer")]
    return []


def _split_errors(model, spec: JobSpec) -> Errors:
    """The (meta) ``model`` of a factory splits into every pp rank's stages."""
    from hpservice.parallel.pipelining import split_model

    p = spec.parallelism
    try:
        for rank in range(p.pp):
            split_model(model, rank, p.pp, p.pp_virtual_stages, p.pp_layers_per_stage)
    except ValueError as e:
        return [("parallelism.pp", str(e))]
    return []


def check_model(spec: JobSpec) -> Errors:
    """The model resolves on this machine: a built-in, or a factory that imports and builds on the
    meta device with the job's ``overrides`` (a wrong keyword, a missing package: here, not on a
    worker two minutes later)."""
    from hpservice.models import build_model, list_models

    builtins = list_models()
    name = spec.model.name
    if name is None or name in builtins:  # None: the llama, or init_from's family (check_inputs)
        return []
    if ":" not in name:
        message = f"{name!r} is neither a built-in model ({', '.join(builtins)}) nor 'package.module:factory'"
        return [("model.name", message + did_you_mean(name, builtins))]
    missing = [m for m in spec.runtime.py_modules if not os.path.exists(os.path.expanduser(m))]
    if missing:
        return [("runtime.py_modules", f"{m}: no such file or directory") for m in missing]
    try:
        with _importable(spec.runtime.import_paths()):
            model = build_model(name, None, spec.model.overrides, device="meta")
    except ValueError as e:  # cannot import, no such attribute, not callable
        return [("model.name", str(e))]
    except Exception as e:  # the factory itself failed: a wrong keyword argument, its own checks
        return [("model.overrides", f"{name}(**overrides) failed on the meta device: {type(e).__name__}: {e}")]
    return _split_errors(model, spec) if spec.parallelism.pp > 1 else []


@contextlib.contextmanager
def _importable(paths: list[str]):
    """``runtime.py_modules`` and ``working_dir`` on this process's import path for the check, as
    Ray puts them on each worker's (and gone again afterwards)."""
    before = list(sys.path)
    sys.path[:0] = paths
    try:
        yield
    finally:
        sys.path[:] = before


def check_factories_import(factories) -> Errors:
    """Every ``module:factory`` an operator allows imports on this machine (``hpservice serve
    --allow-model``): a typo or a package missing from the server's environment is refused at
    startup rather than failing every job that names it."""
    from hpservice.models import resolve_factory

    errors: Errors = []
    for name in factories:
        try:
            resolve_factory(name)
        except ValueError as e:
            errors.append(("--allow-model", str(e)))
    return errors


def input_files(spec: JobSpec) -> list[tuple[str, str, str]]:
    """(field, path, kind) of every file or directory the job reads, kind ``file`` or ``dir``."""
    found = []
    for prefix, data in (("data", spec.data), ("eval.data", spec.eval.data if spec.eval.interval else None)):
        if data is None:
            continue
        if data.kind in ("chat", "preference"):  # globs, directories, weighted sources: _chat_errors reads them
            continue
        if data.path is not None and data.kind != "synthetic":
            found.append((f"{prefix}.path", data.path, "file"))
        if data.tokenizer is not None:
            found.append((f"{prefix}.tokenizer", data.tokenizer, "file"))
    if spec.model.init_from is not None:
        found.append(("model.init_from", spec.model.init_from, "dir"))
    if spec.model.init_adapter is not None:
        found.append(("model.init_adapter", spec.model.init_adapter, "dir"))
    resume = spec.checkpoint.resume_from
    if resume not in (None, "latest") and "://" not in resume:
        found.append(("checkpoint.resume_from", resume, "dir"))
    return found


def check_inputs(spec: JobSpec, visible: Callable[[Path], bool] = lambda p: True) -> Errors:
    """The job's input files exist, for each one ``visible`` says this machine can judge."""
    errors: Errors = []
    for field, raw, kind in input_files(spec):
        path = Path(raw).expanduser()
        if not visible(path):
            continue
        if kind == "file" and not path.is_file():
            errors.append((field, f"{raw}: no such file" if not path.exists() else f"{raw}: not a file"))
        elif kind == "dir" and not path.is_dir():
            what = {"checkpoint.resume_from": "checkpoint directory", "model.init_adapter": "PEFT adapter directory"}.get(
                field, "Hugging Face checkpoint directory"
            )
            errors.append((field, f"{raw}: no such {what}" if not path.exists() else f"{raw}: not a directory"))
        elif field == "model.init_from":
            errors += _init_from_errors(spec, raw, path)
        elif field == "model.init_adapter":
            errors += _adapter_errors(spec, raw, path)
    for prefix, data in (("data", spec.data), ("eval.data", spec.eval.data if spec.eval.interval else None)):
        if data is not None and data.kind in ("chat", "preference"):
            errors += _chat_errors(prefix, data, spec.model.init_from, visible)
    return errors


CHAT_SAMPLE = 64  # records of each chat file checked against the declared format before start


def _chat_errors(prefix: str, d, init_from: str | None, visible: Callable[[Path], bool]) -> Errors:
    """A chat data section before start: the tokenizer and its template load and compile (never
    rendered here: a template is a tenant's code, run only in the job's own processes), and the
    first ``CHAT_SAMPLE`` records of every file match the declared format, each error naming the
    file, the line and the field."""
    from hpservice.data.chat import ChatTemplate, expand_paths, load_chat_tokenizer, template_text
    from hpservice.inputs import InputError

    errors: Errors = []
    tok_path = d.tokenizer or init_from
    if tok_path is None:
        errors.append((f"{prefix}.tokenizer", f"kind {d.kind!r} needs a tokenizer directory (tokenizer.json and "
                       "tokenizer_config.json), or model.init_from's"))  # fmt: skip
    elif visible(Path(tok_path)) and (d.tokenizer or Path(tok_path).expanduser().is_dir()):  # a missing init_from: said once
        field = f"{prefix}.tokenizer" if d.tokenizer else "model.init_from"
        try:
            tok = load_chat_tokenizer(tok_path, template_text(d.chat_template))
            if tok.template is None and d.kind == "chat":  # preference pairs of strings need none
                errors.append((f"{prefix}.chat_template", f"the tokenizer at {tok_path} has no chat template; give one "
                               "(inline, or a .jinja file)"))  # fmt: skip
            else:
                ChatTemplate(tok.template, tok.special_tokens)
        except InputError:
            errors.append((field, f"{tok_path}: resolves outside the allowed roots"))
        except (OSError, ValueError, UnicodeDecodeError) as e:
            errors.append((f"{prefix}.chat_template" if "chat template" in str(e) else field, str(e)))
    sources = [(f"{prefix}.sources[{i}].path", s.path) for i, s in enumerate(d.sources)] or [(f"{prefix}.path", d.path)]
    for field, raw in sources:
        if not visible(Path(raw.split("*")[0] or ".")):
            continue
        try:
            files = expand_paths(raw)
        except FileNotFoundError as e:
            errors.append((field, str(e)))
            continue
        for f in files:
            errors += _chat_sample_errors(field, f, d)
    return errors


def _record_error(record, d) -> str | None:
    """Why ``record`` does not match the section's declared shape (never rendering a template)."""
    from hpservice.data.chat import RecordError, to_conversation
    from hpservice.data.preference import check_record

    try:
        if d.kind == "preference":
            check_record(record, d.fields)
        else:
            to_conversation(record, d.format, d.fields, d.train_on)
    except RecordError as e:
        return f"{e} ({'preference pairs' if d.kind == 'preference' else f'format {d.format!r}'})"
    return None


def _chat_sample_errors(field: str, f: str, d) -> Errors:
    from hpservice.data.chat import read_records
    from hpservice.inputs import InputError

    seen = 0
    try:
        for where, record in read_records(f):
            seen += 1
            problem = _record_error(record, d)
            if problem is not None and d.on_bad_record == "error":
                return [(field, f"{where}: {problem}")]
            if seen == CHAT_SAMPLE:
                break
    except InputError:
        return [(field, f"{f}: resolves outside the allowed roots")]
    except (OSError, ValueError) as e:
        return [(field, str(e))]
    return [] if seen else [(field, f"{f}: no records")]


def _adapter_errors(spec: JobSpec, raw: str, path: Path) -> Errors:
    """A PEFT adapter directory whose settings are model.lora's (the tensors are checked against
    the model's layers when they are loaded)."""
    from hpservice.inputs import InputError
    from hpservice.models.peft_adapter import AdapterError, read_adapter_config

    try:
        cfg = read_adapter_config(path)
    except InputError:
        return [("model.init_adapter", f"{raw}: resolves outside the allowed roots")]
    except (AdapterError, OSError, ValueError) as e:
        return [("model.init_adapter", str(e))]
    lora, errors = spec.model.lora, []
    for key in ("r", "lora_alpha", "use_rslora"):
        theirs = cfg.get(key, False if key == "use_rslora" else None)
        if theirs != getattr(lora, key):
            errors.append((f"model.lora.{key}", f"{getattr(lora, key)!r}, but the adapter at {raw} has {theirs!r}"))
    if not (path / "adapter_model.safetensors").is_file():
        errors.append(("model.init_adapter", f"{raw}: no adapter_model.safetensors (adapter_model.bin, a pickle, is never read)"))
    return errors


def _init_from_errors(spec: JobSpec, raw: str, path: Path) -> Errors:
    """The checkpoint has a config.json of a family we import, the one model.name names, with
    settings we compute exactly (``hf.config_from_hf``)."""
    from hpservice.inputs import InputError
    from hpservice.models.hf import HFFormatError, config_from_hf

    config = path / "config.json"
    if not config.is_file():
        if config.exists() or config.is_symlink():  # a FIFO, device or directory is never opened
            return [("model.init_from", f"{raw}: config.json is not a regular file")]
        return [("model.init_from", f"{raw}: no config.json (a Hugging Face checkpoint directory has one)")]
    try:
        config_from_hf(path, family=spec.model.name)
    except InputError:  # a config.json leading out of its directory: say so, never what it reached
        return [("model.init_from", f"{raw}: config.json resolves outside the checkpoint directory")]
    except (HFFormatError, KeyError, TypeError, ValueError) as e:
        what = f"config.json has no {e}" if isinstance(e, KeyError) else str(e)
        return [("model.init_from", what)]
    except Exception as e:  # a tenant's file must never be a 500: whatever it made us trip on, say so
        return [("model.init_from", f"{raw}/config.json cannot be read as a model config ({type(e).__name__}: {e})")]
    return []


def check_composition(spec: JobSpec, *, read_files: bool = True) -> Errors:
    """The composition table's rules that need the model (``hpservice.spec.composition``, scope
    ``model``: a factory's vocabulary), and ``seq_len`` against the model's positions, from a
    built-in's flavor and overrides anywhere and ``model.init_from``'s config.json only with
    ``read_files`` (on the machine the job runs on)."""
    name = spec.model.name
    custom = name is not None and ":" in name
    cfg = None if custom else known_config(spec, read_files)
    errors: Errors = list(refusals("model", spec, cfg))
    if cfg is None:
        return errors
    if spec.model.lora is not None:
        errors += _lora_errors(spec, cfg)
    max_len = getattr(cfg, "max_seq_len", None)
    for where, d in (("data", spec.data), ("eval.data", spec.eval.data if spec.eval.interval else None)):
        if d is not None and max_len is not None and d.seq_len > max_len:
            errors.append((
                f"{where}.seq_len",
                f"{d.seq_len} is longer than the model's {max_len} positions ({_max_len_field(spec)}); use at most "
                f"{max_len}",
            ))  # fmt: skip
    return errors


def _lora_errors(spec: JobSpec, cfg) -> Errors:
    """model.lora's targets name linear layers of the model and its rank fits them: checked on a
    meta-device model of a few blocks (every block has the same layers)."""
    import dataclasses

    import torch

    from hpservice.models import model_class, resolve_name
    from hpservice.models.lora import NF4_BLOCK, NF4_SCALER_BLOCK, apply_lora, nf4_available, nf4_problems
    from hpservice.train._model import lora_settings

    few = dataclasses.replace(cfg, n_layers=min(cfg.n_layers, 4)) if hasattr(cfg, "n_layers") else cfg
    try:
        with torch.device("meta"):
            model = model_class(resolve_name(spec.model.name, spec.model.init_from))(few)
        apply_lora(model, lora_settings(spec.model.lora))
        if spec.model.lora.quantize_base == "nf4" and not nf4_available():
            return [("model.lora.quantize_base", "nf4 needs torchao's NF4 tensor, which is not installed here "
                     "(pip install 'hpservice[qlora]')")]  # fmt: skip
        if spec.model.lora.quantize_base == "nf4" and (problems := nf4_problems(model)):
            return [("model.lora.quantize_base", f"nf4 needs each adapted weight's element count divisible by "
                     f"{NF4_BLOCK} x {NF4_SCALER_BLOCK} (torchao's NF4 blocks); not: {', '.join(problems[:4])}")]  # fmt: skip
    except ValueError as e:
        field, _, message = str(e).partition(": ")
        return [(field if field.startswith("model.lora") else "model.lora", message or str(e))]
    return []


def _max_len_field(spec: JobSpec) -> str:
    if "max_seq_len" in spec.model.overrides:
        return "model.overrides.max_seq_len"
    return "max_position_embeddings of model.init_from's config.json" if spec.model.init_from else "the flavor's max_seq_len"


def _model_fields(spec: JobSpec) -> str:
    """Where a model's sizes come from, for a refusal to name."""
    m = spec.model
    fields = ["model.init_from's config.json" if m.init_from else f"model.flavor {m.flavor or 'tiny'}"]
    if m.overrides:
        fields.append(f"model.overrides ({', '.join(sorted(m.overrides))})")
    return " and ".join(fields)


_FLOOR_FIELDS = {  # the component of a memory floor -> the fields that size it
    "parameters, gradients and optimizer state": "the model's size ({model}) over parallelism (dp_shard, tp, pp)",
    "the rotary table": "the model's positions (max_seq_len / max_position_embeddings)",
    "the micro-batch's token ids (inputs and targets, int64)": "data.seq_len x data.global_batch per micro-batch",
    "the micro-batch's logits": "data.seq_len x data.global_batch per micro-batch, x the vocabulary",
    "each block's input, kept for the backward": "data.seq_len x data.global_batch per micro-batch, x the model's blocks",
}


def check_size(
    spec: JobSpec, *, worker_memory: int | None, tensor_elements: int, read_files: bool = True
) -> Errors:
    """The job fits what one worker may hold (``worker_memory`` bytes; None: no bound) and no
    tensor of its model is larger than ``tensor_elements``: floors computed from the config
    (``hpservice.sizing``), so nothing is allocated to find out."""
    from hpservice.sizing import largest_tensor, memory_floor

    errors: Errors = []
    cfg = known_config(spec, read_files)
    if cfg is not None:
        what, elements = largest_tensor(cfg)
        if elements > tensor_elements:
            errors.append(("model", f"{what} would have {elements:.4g} elements ({_model_fields(spec)}), more than "
                           f"{tensor_elements:.4g}, the largest tensor this server allows (--max-tensor-elements)"))  # fmt: skip
    if worker_memory is None:
        return errors
    floor = memory_floor(spec, cfg)
    total = sum(floor.values())
    if total > worker_memory:
        top = max(floor, key=floor.get)
        parts = ", ".join(f"{name} {_gib(n)}" for name, n in sorted(floor.items(), key=lambda kv: -kv[1]) if n)
        errors.append((
            "resources",
            f"each worker would hold at least {_gib(total)} ({parts}), more than the {_gib(worker_memory)} a worker "
            f"may hold on this server (--max-worker-memory); the most is {top}, set by "
            f"{_FLOOR_FIELDS[top].format(model=_model_fields(spec))}",
        ))  # fmt: skip
    return errors


def _gib(n: float) -> str:
    return f"{n / 2**30:.3g} GiB" if n >= 2**27 else f"{n / 2**20:.3g} MiB"


def check_devices(spec: JobSpec) -> Errors:
    """A job that must have a GPU, for workers that run on this machine."""
    import torch

    if spec.resources.use_gpu is True and not torch.cuda.is_available():
        return [("resources.use_gpu", "true, but this machine has no CUDA device: use auto or false")]
    return []


def plan_memory(
    spec: JobSpec, *, device_memory: int | None, device: str, profile=None, source: str = "the device memory given",
    budget_s: float | None = 20.0,
) -> JobSpec:
    """``spec`` with its memory estimate (``memory_estimate``), and with ``parallelism: auto`` the
    layout chosen; a ``SpecError`` when it does not fit ``resources.device_memory`` (else
    ``device_memory``: what the caller knows of the devices; None: nothing to check against) on
    ``device`` ("cuda" or "cpu") ranks; ``source`` names where ``device_memory`` came from;
    ``budget_s``: the most seconds auto's search may take (None: no bound, the same choice on every
    machine given the same inputs, as torchrun's ranks each choose). A model that cannot be built here is not estimated
    (``check_model`` / ``check_inputs`` report why), unless the layout is to be chosen."""
    from hpservice.memory.plan import check_fit, choose_layout

    memory = spec.resources.device_memory or device_memory
    if spec.resources.device_memory is not None:
        source = "resources.device_memory"
    if spec.parallelism.auto:
        chosen, runner_up = choose_layout(spec, memory, device, profile, budget_s=budget_s)
        record = {
            **chosen.spec.memory_estimate,
            **({"device_memory_gib": round(memory / 2**30, 4)} if memory else {}),
            "auto": {
                "chosen": chosen.label,
                "chosen_step_s": round(chosen.seconds, 6),
                "runner_up": runner_up.label if runner_up else None,
                "runner_up_step_s": round(runner_up.seconds, 6) if runner_up else None,
                "why": "the lowest estimated step time of the layouts that fit"
                + (f" ({gib_text(memory)} per device)" if memory else " (no device memory to fit: none given or known)"),
            },
        }
        return chosen.spec.model_copy(update={"memory_estimate": record})
    estimate = check_fit(spec, memory, device, profile, source)
    record = estimate.record() if estimate is not None else None
    if record is not None and memory is not None:
        record["device_memory_gib"] = round(memory / 2**30, 4)
    return spec.model_copy(update={"memory_estimate": record})


def gib_text(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB"


def job_device(spec: JobSpec, gpus_available: bool) -> str:
    """What the job's ranks run on, for its estimate: ``resources.use_gpu``, or with auto, GPUs
    where the caller says there are enough."""
    use = spec.resources.use_gpu
    return "cuda" if (use is True or (use == "auto" and gpus_available)) else "cpu"


def preflight(spec: JobSpec, *, source: str = "job", here: bool = True, devices_here: bool | None = None) -> None:
    """Raise ``SpecError`` listing everything that would make ``spec`` fail before it starts.
    ``here``: the job runs on this machine (its model and files are this machine's);
    ``devices_here``: its workers use this machine's devices (default ``here``)."""
    errors = check_layout(spec, read_files=here) + check_composition(spec, read_files=here)
    if here:
        errors += check_model(spec) + check_inputs(spec)
    if here if devices_here is None else devices_here:
        errors += check_devices(spec)
    raise_if(errors, source)
