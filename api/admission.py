"""What a job spec sent to the service may name: code, and the files it reads and writes.

A spec is untrusted input. ``admit`` checks it at submit, before anything is stored, and gives back the spec
the job runs with. A violation is a ``SpecError`` naming the field and the rule, which the route
answers with 422. The rules:

- **Code.** ``model.name`` is a built-in model, or a factory the operator allows. Allowed
  factories come from ``Settings.model_factories`` (``--allow-model module:factory``) or from the
  ``hpservice.models`` entry points of installed packages, by entry-point name or by value.
  ``hpservice run`` and torchrun on one's own machine skip this check and import any factory.
  ``runtime.py_modules`` / ``working_dir`` (code shipped with the job) are refused: a job runs the
  code installed in the server's image.
- **Outputs.** Every job writes under its own directory, ``<jobs-dir>/<owner>/<job-id>/``
  (``--jobs-dir``, default ``<data-dir>/jobs``).
  Relative ``metrics.dir`` / ``checkpoint.dir`` resolve there; absolute paths must stay inside it
  (symlinks and ``..`` are resolved first). Storage URLs are refused, since this server has no
  storage prefix of its own.
- **Size.** At most ``--max-workers-per-job`` workers, each with at least
  ``--min-cpus-per-worker`` CPUs, for every owner (quotas bound what runs at once; these bound one job).
  At most ``--max-checkpoints-kept`` checkpoints kept. After the inputs are admitted (and only
  then: nothing reads a tenant-named file before this module has said the tenant may read it),
  ``check_admitted`` runs the checks that read the model's config: its layout, its composition,
  and its size against ``--max-worker-memory`` and ``--max-tensor-elements``.
- **Storage.** A job's directory may hold ``--max-job-bytes``, and all of an owner's
  ``--max-owner-bytes``: an owner already past that is refused at submit, and each job runs with
  the smaller of the two budgets left (``JobSpec.storage_limit_bytes``), which its trainer
  enforces as it writes.
- **Inputs.** Checked here by name, and again by each worker on the file it opens
  (``JobSpec.input_roots``, below). ``data.path``, ``data.tokenizer``, chat data's ``data.sources`` and
  ``data.chat_template`` file, and their ``eval.data`` twins must lie under one
  of the operator's data roots
  (``Settings.data_roots``, ``--data-root``); with none configured, the service reads no files.
  ``checkpoint.resume_from`` and ``model.init_from`` may name a checkpoint in one of the owner's
  own job directories (an admin may name any owner's), or one under a data root. Each must exist
  where this server can see it (``hpservice.preflight.check_inputs``).
"""

from __future__ import annotations

import functools
import os
from importlib import metadata
from pathlib import Path

from hpservice.models import list_models
from hpservice.preflight import (
    check_composition,
    check_inputs,
    check_layout,
    check_size,
    job_device,
    plan_memory,
    raise_if,
)
from hpservice.spec import JobSpec, SpecError
from hpservice.train._storage import directory_bytes

from .settings import Principal, Settings

ENTRY_POINT_GROUP = "hpservice.models"


@functools.lru_cache(maxsize=1)
def entry_point_factories() -> dict[str, str]:
    """``name -> "module:factory"`` of the ``hpservice.models`` entry points installed here."""
    return {ep.name: ep.value for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}


def allowed_factories(settings: Settings) -> dict[str, str]:
    """Every name a spec may give as ``model.name`` besides the built-ins -> the factory it runs."""
    allowed = {f: f for f in settings.model_factories}
    for name, value in entry_point_factories().items():
        allowed[name] = value
        allowed[value] = value
    return allowed


def job_dir(settings: Settings, owner: str, job_id: str) -> Path:
    """The one directory a job writes into."""
    return _real(settings.jobs_root) / owner / job_id


def admit(spec: JobSpec, principal: Principal, job_id: str, settings: Settings) -> JobSpec:
    """The spec with its model factory, outputs and inputs checked and resolved for this job;
    raises SpecError listing every violation."""
    errors: list[tuple[str, str]] = []
    home = job_dir(settings, principal.owner, job_id)
    model = _admit_model(spec, settings, errors)
    metrics_dir = _output(spec.metrics.dir, "metrics.dir", home, errors)
    checkpoint_dir = spec.checkpoint.dir
    if checkpoint_dir is not None:
        checkpoint_dir = str(_output(checkpoint_dir, "checkpoint.dir", home, errors))
    data = _admit_data(spec.data, "data", home, settings, errors)
    evaluation = spec.eval
    if evaluation.data is not None:
        evaluation = evaluation.model_copy(
            update={"data": _admit_data(evaluation.data, "eval.data", home, settings, errors)}
        )
    if model.init_from is not None:  # a pretrained checkpoint: an input like resume_from
        checked_init = _checkpoint_input(model.init_from, principal, home, settings, errors, "model.init_from")
        model = model.model_copy(update={"init_from": checked_init})
    if model.init_adapter is not None:  # a PEFT adapter: the owner's job output or a data root's
        checked = _checkpoint_input(model.init_adapter, principal, home, settings, errors, "model.init_adapter")
        model = model.model_copy(update={"init_adapter": checked})
    resume = spec.checkpoint.resume_from
    if resume not in (None, "latest"):
        resume = _checkpoint_input(resume, principal, home, settings, errors, "checkpoint.resume_from")
    _admit_size(spec, settings, errors)
    storage = _storage_budget(settings, principal, errors)
    priority, limit = spec.scheduling.priority, settings.quotas.of(principal.owner).priority
    if priority is not None and priority > limit and not principal.admin:
        # a tenant's own priority would let it preempt everyone else's jobs
        errors.append(("scheduling.priority", f"{priority} is above {limit}, the highest the operator allows owner "
                       f"{principal.owner} (their quotas file's priority)"))  # fmt: skip
    for field in ("py_modules", "working_dir"):
        if getattr(spec.runtime, field):  # code from the server's disk into every worker: the operator's image only
            errors.append((f"runtime.{field}", "not allowed on this server: a job runs the models installed in the "
                           "server's image (the operator allows factories with --allow-model or hpservice.models entry points)"))  # fmt: skip
    if spec.metrics.wandb is not None and spec.metrics.wandb.mode != "offline":
        errors.append(("metrics.wandb.mode", "only 'offline' on this server: jobs write their W&B runs in their own directory"))
    if spec.metrics.mlflow is not None and spec.metrics.mlflow.tracking_uri is not None:
        errors.append(("metrics.mlflow.tracking_uri", "not allowed on this server: jobs log to MLflow in their own directory"))
    if errors:
        lines = "\n".join(f"  {path}: {msg}" for path, msg in errors)
        raise SpecError(f"job spec: not allowed on this server\n{lines}", errors)
    checked = spec.model_copy(
        update={
            "model": model,
            "data": data,
            "eval": evaluation,
            "metrics": spec.metrics.model_copy(update={"dir": str(metrics_dir)}),
            "checkpoint": spec.checkpoint.model_copy(update={"dir": checkpoint_dir, "resume_from": resume}),
            "run_id": None,
            "input_roots": input_roots(settings, principal, home),
            "storage_limit_bytes": storage,
        }
    )
    # The files it reads exist, where this server can see them (the data roots and job directories
    # the API shares with the workers); a root this machine does not have is the workers' to judge.
    missing = check_inputs(checked, visible=lambda p: server_sees(settings, p))
    if missing:
        lines = "\n".join(f"  {path}: {msg}" for path, msg in missing)
        raise SpecError(f"job spec: names inputs that do not exist or cannot be used\n{lines}", missing)
    return checked.with_run(job_id)


def server_sees(settings: Settings, path: str | os.PathLike) -> bool:
    """Whether this server can judge ``path`` itself: it lies under a data root or the jobs
    directory that exists here (a root only the workers mount is theirs to judge)."""
    seen = [root for root in map(_real, [*settings.data_roots, settings.jobs_root]) if root.is_dir()]
    return any(_within(_real(path), root) for root in seen)


def worker_memory(settings: Settings, node_memory: int | None) -> int:
    """What one worker may hold: ``--max-worker-memory``, else the largest node's memory
    (``node_memory``, from Ray), else this host's."""
    if settings.bounds.max_worker_memory is not None:
        return settings.bounds.max_worker_memory
    if node_memory:
        return node_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_admitted(
    spec: JobSpec, settings: Settings, node_memory: int | None = None, devices: tuple[float, int | None] = (0.0, None)
) -> JobSpec:
    """The checks that read the admitted job's model config (where this server can see it): its
    layout, its composition and its size (``hpservice.preflight``), then its memory estimate
    against the device's memory (``plan_memory``; ``parallelism: auto`` resolved there): the spec
    the job runs with, or one ``SpecError``. ``devices``: the cluster's GPUs and their memory."""
    read = spec.model.init_from is None or server_sees(settings, spec.model.init_from)
    errors = check_layout(spec, read_files=read) + check_composition(spec, read_files=read)
    if not errors:
        memory, elements = worker_memory(settings, node_memory), settings.bounds.max_tensor_elements
        errors = check_size(spec, worker_memory=memory, tensor_elements=elements, read_files=read)
    raise_if(errors, "job spec")
    gpus, gpu_memory = devices
    device = job_device(spec, gpus >= spec.resources.workers)
    if not read:  # the model's config is only where the workers are: no estimate here
        if spec.parallelism.auto:
            raise_if([("parallelism", "auto needs the model's config where the job is submitted, and model.init_from "
                       "is not under a data root or job directory this server sees")], "job spec")  # fmt: skip
        return spec.model_copy(update={"memory_estimate": None})
    memory = (settings.bounds.device_memory or gpu_memory) if device == "cuda" else None  # a CPU job: its own figure
    source = "the server's --device-memory" if settings.bounds.device_memory else "the cluster's GPU memory"
    return plan_memory(spec, device_memory=memory, device=device, source=source)


def _storage_budget(settings: Settings, principal: Principal, errors: list) -> int:
    """The bytes the new job may write: the per-job bound, or what the owner has left if less."""
    root = _real(settings.jobs_root)
    per_job, per_owner = settings.bounds.job_bytes(root), settings.bounds.owner_bytes(root)
    used = directory_bytes(root / principal.owner) if (root / principal.owner).is_dir() else 0
    left = per_owner - used
    if left <= 0:
        errors.append(("storage", f"owner {principal.owner}'s jobs hold {used} bytes, at or past the {per_owner} "
                       "bytes this server keeps for one owner (--max-owner-bytes): delete old jobs first"))  # fmt: skip
    return max(1, min(per_job, left))


def input_roots(settings: Settings, principal: Principal, home: Path) -> list[str]:
    """Where the job's workers may open inputs (checked on each file as it is opened, see
    ``hpservice.inputs``): the data roots, and the job directories its checkpoint inputs may come
    from (the owner's; every owner's for an admin). The rules above, as directories."""
    jobs = home.parent.parent
    own = jobs if principal.admin else jobs / principal.owner
    return [str(_real(r)) for r in settings.data_roots] + [str(own)]


def _admit_size(spec: JobSpec, settings: Settings, errors: list) -> None:
    """The operator's limits on one job's size (whatever the owner's quotas): workers, and each
    worker's CPU share (a tiny share would let a few CPUs' worth of quota start thousands of processes)."""
    r = spec.resources
    if r.workers > settings.max_workers_per_job:
        errors.append(("resources.workers", f"{r.workers} is more than {settings.max_workers_per_job}, the most "
                       "workers one job may have on this server (the operator's --max-workers-per-job)"))  # fmt: skip
    keep, most = spec.checkpoint.keep, settings.bounds.max_checkpoints_kept
    if keep > most:
        errors.append(("checkpoint.keep", f"{keep} is more than {most}, the most checkpoints a job may keep on this "
                       "server (--max-checkpoints-kept)"))  # fmt: skip
    if r.cpus_per_worker < settings.min_cpus_per_worker:
        errors.append(("resources.cpus_per_worker", f"{r.cpus_per_worker:g} is less than {settings.min_cpus_per_worker:g}, "
                       "the smallest CPU share per worker on this server (the operator's --min-cpus-per-worker)"))  # fmt: skip


def _admit_data(data, field: str, home: Path, settings: Settings, errors: list):
    """A data section's input files (the data, its tokenizer) checked against the data roots."""
    update = {}
    for key in ("path", "tokenizer"):
        value = getattr(data, key)
        if value is not None:
            update[key] = str(_input(value, f"{field}.{key}", home, settings, errors))
    template = data.chat_template
    if template is not None and "{{" not in template and "{%" not in template:  # a file, not the template itself
        update["chat_template"] = str(_input(template, f"{field}.chat_template", home, settings, errors))
    if data.sources:  # chat mixtures: every source's files, globs included, under a data root
        update["sources"] = [
            s.model_copy(update={"path": str(_input(s.path, f"{field}.sources[{i}].path", home, settings, errors))})
            for i, s in enumerate(data.sources)
        ]
    return data.model_copy(update=update)


def _admit_model(spec: JobSpec, settings: Settings, errors: list):
    name = spec.model.name
    if name is None or name in list_models():  # None: the llama, or init_from's family
        return spec.model
    allowed = allowed_factories(settings)
    if name in allowed:
        return spec.model.model_copy(update={"name": allowed[name]})
    offer = ", ".join([*list_models(), *sorted(allowed)])
    errors.append(
        (
            "model.name",
            f"{name!r} is not a built-in model nor a factory this server allows (allowed: {offer}); the "
            "operator allows factories with --allow-model or the hpservice.models entry points",
        )
    )
    return spec.model


def _real(path: str | os.PathLike) -> Path:
    return Path(os.path.realpath(os.path.expanduser(os.fspath(path))))


def _within(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def _is_url(value: str) -> bool:
    return "://" in value or "::" in value


def _output(value: str, field: str, home: Path, errors: list) -> Path | None:
    if _is_url(value):
        errors.append((field, f"{value!r}: storage URLs are not enabled on this server; give a path inside the job's directory"))
        return None
    path = _real(home / value)  # an absolute value replaces home
    if not _within(path, home):
        errors.append((field, f"{value!r} is outside the job's own directory ({home}); outputs stay there"))
        return None
    return path


def _input(value: str, field: str, home: Path, settings: Settings, errors: list) -> Path | None:
    if _is_url(value):
        errors.append((field, f"{value!r}: URLs are not readable on this server"))
        return None
    path = _real(home / value)
    roots = [_real(r) for r in settings.data_roots]
    if not roots:
        errors.append((field, "this server reads no input files (the operator allows directories with --data-root)"))
        return None
    if not any(_within(path, root) for root in roots):
        errors.append((field, f"{value!r} is outside the allowed data roots ({', '.join(map(str, roots))})"))
        return None
    return path


def _checkpoint_input(
    value: str, principal: Principal, home: Path, settings: Settings, errors: list, field: str
) -> str | None:
    if _is_url(value):
        errors.append((field, f"{value!r}: URLs are not readable on this server"))
        return None
    path = _real(home / value)
    jobs = home.parent.parent  # <data-dir>/jobs
    mine = jobs / principal.owner
    if _within(path, mine) or (principal.admin and _within(path, jobs)):
        return str(path)
    if any(_within(path, _real(r)) for r in settings.data_roots):
        return str(path)
    errors.append(
        (field, f"{value!r} is neither a checkpoint of {principal.owner}'s own jobs ({mine}) nor under an allowed data root")
    )
    return None
