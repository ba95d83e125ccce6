"""``ModelSpec``: everything about one model family in one object (torchtitan's ``ModelSpec``).

Each family's file declares its bundle (``MODEL_SPEC``): its model and config classes, its flavors,
its Hugging Face names (import and export), its tensor-parallel plan, its pipeline split, the
post-optimizer hooks it needs, and the converters applied to its meta model before it is laid out
(where LoRA, QLoRA and float8 go). ``hpservice.models`` collects them; the model registry, the
Hugging Face importer's family table, the family lists of the trainer and ``docs/models.md``
derive from them, so a new family is one file (plus its tests) and a line in ``_SPECS``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

__all__ = ["HFNames", "ModelSpec"]


def _nothing(*_args, **_kwargs) -> dict:
    return {}


def _no_hooks(*_args, **_kwargs) -> list:
    return []


@dataclasses.dataclass(frozen=True)
class HFNames:
    """The family's Hugging Face state-dict adapter (torchtitan's ``StateDictAdapter``): how
    transformers names it (``config.json``'s ``model_type`` and ``architectures``) and what is the
    family's own in converting its config and tensors; ``models/hf.py`` does the part every
    decoder family shares (the common config keys, tensor names, rotary row order, sharded
    reads and writes) and calls these for the rest.

    - ``config_fields(cfg, need, refuse)``: our config's own fields from a validated
      ``config.json`` ``cfg`` (``need(key)`` its value or an error; ``refuse(key, allowed, why)``
      an error unless allowed); a ``ValueError`` names a bad key;
    - ``config_keys(our_cfg)``: its ``config.json`` keys for our config, beyond the common ones;
    - ``variants``: which of our decoder's options its transformers class has (``qkv_bias``,
      ``qk_norm``, ``sliding_window``); a model using another cannot be exported as it, and one
      without ``qkv_bias`` refuses a config's ``attention_bias``;
    - ``unsupported(our_cfg)``: further settings of ours with no equivalent (names);
    - ``buffers``: suffixes of buffers its checkpoints hold besides parameters."""

    model_type: str
    architecture: str
    config_fields: Callable[..., dict] = _nothing
    config_keys: Callable[[Any], dict] = _nothing
    variants: frozenset[str] = frozenset()
    unsupported: Callable[[Any], list] = _no_hooks
    buffers: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    model_cls: type[nn.Module]
    config_cls: type
    flavors: Mapping[str, Any]
    description: str  # one line: what the family is (docs/models.md, help texts)
    # flops_per_token(config, seq_len, attention=True) -> training FLOPs per token (MFU); None: the
    # 6N estimate from the parameter count (a custom factory)
    flops_per_token: Callable[..., int] | None
    hf: HFNames | None = None  # None: no Hugging Face import/export
    # parallelize(model, tp_mesh, sequence_parallel) lays the model out on the tp mesh in place;
    # None: the family has no tensor-parallel plan (parallelism.tp > 1 is refused naming it)
    parallelize: Callable[[nn.Module, Any, bool], None] | None = None
    # pipeline_stage(model, layers, first=, last=) trims a meta model in place to one pipeline stage:
    # the blocks named ``layers``, the embedding if first, the norm and head if last (names stay the
    # whole model's); None: the family cannot be pipelined (parallelism.pp > 1 is refused naming it)
    pipeline_stage: Callable[..., None] | None = None
    # post_optimizer_hooks(whole, parts, dims, microbatches=, bias_update_rate=) -> the hooks run
    # after each optimizer step (MoE's load metrics and routing-bias update)
    post_optimizer_hooks: Callable[..., list] = _no_hooks
    # applied in order to the whole model on the meta device, before any layout (LoRA, float8)
    converters: tuple[Callable[[nn.Module], None], ...] = ()
