"""Settings of the control plane (flags of `hpservice serve`, or environment variables)."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from hpservice.sizing import MAX_TENSOR_ELEMENTS
from hpservice.spec import NAME_PATTERN, parse_size

from .scheduler import EVERYONE, Quota, Quotas

MAX_WORKERS_PER_JOB = 1024  # the default operator limit on one job's workers (--max-workers-per-job)
MIN_CPUS_PER_WORKER = 0.1  # the default operator limit on a worker's CPU share: at most 10 workers per core
LEASE_TTL_S = 10.0  # the supervisor lease: a replica that stopped renewing it (killed) is replaced after this long
MIN_LEASE_TTL_S = 2.0  # several ticks: a leader slowed for a moment must not lose it


@dataclass(frozen=True)
class Bounds:
    """What one job may make this server and its workers pay (``hpservice serve`` options; the
    table in docs/api.md). Each is checked before the job costs it: at submit, from arithmetic on
    the spec and its model's config (``hpservice.preflight.check_size``), and while it runs for
    what only running shows (its directory's bytes: ``hpservice.train``; its log lines: the
    supervisor)."""

    max_worker_memory: int | None = None
    """Bytes one worker may hold (its training state's floor, ``hpservice.sizing``); None: the
    largest node's memory as Ray reports it, else this host's."""
    max_tensor_elements: int = MAX_TENSOR_ELEMENTS
    """Elements of the largest single tensor a job's model may have."""
    device_memory: int | None = None
    """Bytes of one worker's GPU: a job whose estimated peak per rank (``hpservice.memory``) is
    more is refused at submit, naming layouts that fit; None: the GPU type's as Ray reports it
    (``api/supervisor.py``), else a job is checked against its own ``resources.device_memory`` only."""
    max_checkpoints_kept: int = 20
    """The largest ``checkpoint.keep``."""
    max_job_bytes: int | None = None
    """Bytes one job's directory may hold (checkpoints, metrics, exports); None: a quarter of the
    jobs volume."""
    max_owner_bytes: int | None = None
    """Bytes all of one owner's job directories may hold; None: half of the jobs volume."""
    max_log_lines_per_job: int = 1_000_000
    """Log lines the store keeps of one job; a job that writes more is stopped, saying so."""
    validation_timeout_s: float = 30.0
    """The longest one spec's validation may take (``api/validation.py``)."""
    validations_per_owner: int = 2
    """Specs of one owner validated at once."""
    exports_per_owner: int = 2
    """Exports of one owner's checkpoints running at once."""

    def __post_init__(self):
        for name in ("max_tensor_elements", "max_checkpoints_kept", "max_log_lines_per_job", "validations_per_owner", "exports_per_owner"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value!r}")
        for name in ("max_worker_memory", "max_job_bytes", "max_owner_bytes", "device_memory"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"--{name.replace('_', '-')} must be a number of bytes >= 1, got {value!r}")
        if not 0 < self.validation_timeout_s < float("inf"):
            raise ValueError(f"--validation-timeout must be a number of seconds > 0, got {self.validation_timeout_s!r}")

    def job_bytes(self, jobs_root: Path) -> int:
        return self.max_job_bytes if self.max_job_bytes is not None else _volume(jobs_root) // 4

    def owner_bytes(self, jobs_root: Path) -> int:
        return self.max_owner_bytes if self.max_owner_bytes is not None else _volume(jobs_root) // 2


def _volume(path: Path) -> int:
    """Total bytes of the filesystem ``path`` is on (its nearest existing parent's)."""
    import shutil

    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).total


def bounds_from_options(**options) -> Bounds:
    """``Bounds`` from ``hpservice serve``'s options (sizes as text, e.g. ``64G``); a bad value
    raises ValueError naming the option."""
    values = dict(options)
    for name in ("max_worker_memory", "max_job_bytes", "max_owner_bytes", "device_memory"):
        if isinstance(values.get(name), str):
            try:
                values[name] = parse_size(values[name])
            except ValueError as e:
                raise ValueError(f"--{name.replace('_', '-')}: {e}") from None
    if "validation_timeout" in values:
        values["validation_timeout_s"] = values.pop("validation_timeout")
    return Bounds(**values)


@dataclass(frozen=True)
class Principal:
    owner: str
    admin: bool = False


@dataclass
class Settings:
    host: str = "127.0.0.1"
    port: int = 8000
    data_dir: Path = field(
        default_factory=lambda: Path(os.environ.get("HPSERVICE_DATA_DIR", "~/.hpservice")).expanduser()
    )
    database_url: str | None = field(default_factory=lambda: os.environ.get("HPSERVICE_DATABASE_URL"))
    # Where jobs write (<jobs_dir>/<owner>/<job id>/): default <data_dir>/jobs. A deployment puts it on
    # the volume every Ray pod mounts at the same path, so workers on any node write there too.
    jobs_dir: Path | None = field(
        default_factory=lambda: Path(p).expanduser() if (p := os.environ.get("HPSERVICE_JOBS_DIR")) else None
    )
    ray_address: str | None = field(default_factory=lambda: os.environ.get("RAY_ADDRESS"))
    tokens: dict[str, Principal] = field(default_factory=dict)
    poll_interval_s: float = 0.5
    dashboard_url: str | None = None
    # What job specs may name (api/admission.py): model factories besides the built-ins and the
    # hpservice.models entry points, and the directories input files may come from.
    model_factories: tuple[str, ...] = field(default_factory=lambda: _env_list("HPSERVICE_MODEL_FACTORIES", ","))
    data_roots: tuple[Path, ...] = field(
        default_factory=lambda: tuple(Path(p).expanduser() for p in _env_list("HPSERVICE_DATA_ROOTS", os.pathsep))
    )
    docs: bool = True  # serve /docs, /redoc and /openapi.json
    # The queue (api/scheduler.py): per-owner quotas and default priorities, and how long a job
    # that does not fit may be overtaken by smaller ones
    quotas: Quotas = field(default_factory=Quotas)
    backfill_bound_s: float = 600.0
    # The size of one job (api/admission.py): without these, one spec could ask Ray for a hundred
    # thousand worker processes (workers: 100000, cpus_per_worker: 1e-9), quotas file or not
    max_workers_per_job: int = field(
        default_factory=lambda: int(os.environ.get("HPSERVICE_MAX_WORKERS_PER_JOB", MAX_WORKERS_PER_JOB))
    )
    min_cpus_per_worker: float = field(
        default_factory=lambda: float(os.environ.get("HPSERVICE_MIN_CPUS_PER_WORKER", MIN_CPUS_PER_WORKER))
    )
    # Open event streams (SSE) per owner (api/limits.py): each holds a connection and polls the store
    max_streams_per_owner: int = 64
    # What one job may cost (memory, tensors, disk, logs, validation, exports): see Bounds
    bounds: Bounds = field(default_factory=Bounds)
    # Replicas: how long a leader that stopped renewing the supervisor lease (killed) keeps it;
    # a standby takes over after this long
    lease_ttl_s: float = LEASE_TTL_S

    def __post_init__(self):
        self.tokens = dict(self.tokens)  # callers pass plain dicts; lookups go through principal_for

    def principal_for(self, token: str) -> Principal | None:
        """The principal of a presented token, compared in constant time."""
        presented = hashlib.sha256(token.encode()).digest()
        found = None
        for known, principal in self.tokens.items():
            if hmac.compare_digest(presented, hashlib.sha256(known.encode()).digest()):
                found = principal
        return found

    @property
    def jobs_root(self) -> Path:
        """The directory of every job's outputs: ``jobs_dir``, else ``<data_dir>/jobs``."""
        return self.jobs_dir if self.jobs_dir is not None else self.data_dir / "jobs"

    @property
    def db_url(self) -> str:
        if self.database_url:
            return self.database_url
        self.data_dir.mkdir(parents=True, exist_ok=True)
        return f"sqlite:///{self.data_dir / 'hpservice.db'}"

    @property
    def auth_enabled(self) -> bool:
        return bool(self.tokens)

    def check_bind(self) -> None:
        """Without tokens the API is open: it may only listen on loopback."""
        if self.auth_enabled:
            return
        try:
            loopback = self.host == "localhost" or ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise ValueError(
                f"refusing to bind {self.host}: no API tokens are configured (set --tokens-file or HPSERVICE_TOKENS), "
                "so only loopback addresses are allowed"
            )


_TOKEN_KEYS = {"owner", "admin"}


def load_tokens(tokens_file: str | None = None, env: str | None = None) -> dict[str, Principal]:
    """Tokens from a YAML file ``{TOKEN: {owner: alice, admin: false}}`` and/or ``TOKEN=owner[:admin],...``.

    Strict: ``admin`` is a YAML boolean (the string "false" is an error, not a truthy value),
    unknown keys are errors, owners are safe names (they name directories). Every error names
    the entry, never the token itself."""
    tokens: dict[str, Principal] = {}
    if tokens_file:
        data = yaml.safe_load(Path(tokens_file).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{tokens_file}: expected a mapping of token -> {{owner, admin}}")
        for i, (token, entry) in enumerate(data.items(), start=1):
            where = f"{tokens_file}: entry {i}"
            if not isinstance(token, str):
                raise ValueError(f"{where}: the token must be a string")
            if not isinstance(entry, dict):
                raise ValueError(f"{where}: expected {{owner: NAME, admin: true|false}}")
            unknown = set(entry) - _TOKEN_KEYS
            if unknown:
                raise ValueError(f"{where}: unknown keys {sorted(map(str, unknown))} (allowed: owner, admin)")
            admin = entry.get("admin", False)
            if not isinstance(admin, bool):
                raise ValueError(f"{where}: admin must be true or false (a YAML boolean), got {admin!r}")
            tokens[token] = Principal(_owner(entry.get("owner"), where), admin)
    env = env if env is not None else os.environ.get("HPSERVICE_TOKENS", "")
    for i, item in enumerate(filter(None, (part.strip() for part in env.split(","))), start=1):
        token, sep, who = item.partition("=")
        where = f"HPSERVICE_TOKENS: entry {i}"
        if not sep or not token or not who:
            raise ValueError(f"{where}: expected TOKEN=owner[:admin]")
        owner, _, flag = who.partition(":")
        if flag not in ("", "admin"):
            raise ValueError(f"{where}: the flag after the owner must be 'admin', got {flag!r}")
        tokens[token] = Principal(_owner(owner, where), flag == "admin")
    return tokens


def load_quotas(path: str | None) -> Quotas:
    """Quotas from a YAML file ``{OWNER or "*": {workers: N, gpus: N, priority: P}}`` (each key
    optional; ``*`` applies to owners without an entry of their own). Strict: unknown keys and
    values that are not integers are errors naming the entry."""
    if path is None:
        return Quotas()
    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of owner -> {{workers, gpus, priority}}")
    quotas = {}
    for owner, entry in data.items():
        where = f"{path}: {owner!r}"
        if owner != EVERYONE:
            _owner(owner, where)
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: expected {{workers: N, gpus: N, priority: P}}")
        unknown = set(entry) - {"workers", "gpus", "priority"}
        if unknown:
            raise ValueError(f"{where}: unknown keys {sorted(map(str, unknown))} (allowed: workers, gpus, priority)")
        for key, value in entry.items():
            low = -1000 if key == "priority" else 0
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= 1_000_000:
                raise ValueError(f"{where}: {key} must be an integer >= {low}, got {value!r}")
        quotas[owner] = Quota(entry.get("workers"), entry.get("gpus"), entry.get("priority", 0))
    return Quotas(quotas)


def _owner(value, where: str) -> str:
    if not isinstance(value, str) or not re.match(NAME_PATTERN, value):
        raise ValueError(f"{where}: owner must be a name of letters, digits, '.', '_' or '-' (it names a directory)")
    return value


def _env_list(name: str, sep: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in os.environ.get(name, "").split(sep) if p.strip())
