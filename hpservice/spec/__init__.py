"""The job spec: one pydantic model for a whole training job, shared by every layer.

The trainer, the Ray actors, the REST API and the CLI all read the same ``JobSpec``. Unknown
fields are rejected (a typo must not silently fall back to a default), every error names its
field path (``training.steps``), and YAML syntax errors name the line.

A minimal job file::

    name: tiny
    model: {name: llama, flavor: tiny}
    training: {steps: 100}

``model.py`` is the spec itself (its sections, fields and checks); ``loading.py`` reads it from
YAML or JSON with overrides; ``reference.py`` writes its field reference.
"""

from .loading import (
    MAX_ALIASES,
    MAX_DEPTH,
    MAX_TEXT,
    MAX_VALUES,
    apply_overrides,
    check_bounds,
    load_job,
    parse_job,
    yaml_error,
    yaml_load,
)
from .model import (
    INT64,
    MAX_OVERRIDES_BYTES,
    MAX_WORKERS,
    NAME_PATTERN,
    RUN_ID_PATTERN,
    CheckpointSpec,
    DataSpec,
    EvalSpec,
    FailureSpec,
    JobSpec,
    LRSchedulerSpec,
    MetricsSpec,
    MLflowSpec,
    ModelSpec,
    OptimizerSpec,
    ParallelismSpec,
    ProfileSpec,
    ResourcesSpec,
    RuntimeSpec,
    SchedulingSpec,
    SpecError,
    TrainingSpec,
    WandbSpec,
    did_you_mean,
    new_run_id,
    parse_device_memory,
    parse_size,
)
from .reference import fields_reference

__all__ = [
    "INT64",
    "MAX_ALIASES",
    "MAX_DEPTH",
    "MAX_OVERRIDES_BYTES",
    "MAX_TEXT",
    "MAX_VALUES",
    "MAX_WORKERS",
    "NAME_PATTERN",
    "RUN_ID_PATTERN",
    "CheckpointSpec",
    "DataSpec",
    "EvalSpec",
    "FailureSpec",
    "JobSpec",
    "LRSchedulerSpec",
    "MLflowSpec",
    "MetricsSpec",
    "ModelSpec",
    "OptimizerSpec",
    "ParallelismSpec",
    "ProfileSpec",
    "ResourcesSpec",
    "RuntimeSpec",
    "SchedulingSpec",
    "SpecError",
    "TrainingSpec",
    "WandbSpec",
    "apply_overrides",
    "check_bounds",
    "did_you_mean",
    "fields_reference",
    "load_job",
    "new_run_id",
    "parse_device_memory",
    "parse_job",
    "parse_size",
    "yaml_error",
    "yaml_load",
]
