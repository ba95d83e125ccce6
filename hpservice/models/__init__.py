"""Model definitions for the training runtime, and a small registry to build them by name.

Built-in models (each in one plain file):

- ``"llama"``: Llama-style decoder (``llama.py``); flavors ``tiny``, ``small``, ``1B``, ``8B``.
- ``"qwen2"`` (``qwen2.py``: q/k/v biases), ``"qwen3"`` (``qwen3.py``: per-head q/k norms, head
  width of its own), ``"mistral"`` (``mistral.py``: sliding window): the same decoder as the
  llama with those variants; flavors ``tiny`` and the released sizes.
- ``"qwen3_moe"`` (``qwen3_moe.py``): Qwen3 with mixture-of-experts layers (``moe.py``).
- ``"deepseek_v3"`` (``deepseek_v3.py``): multi-head latent attention, shared experts, grouped
  sigmoid routing with aux-loss-free balancing.
- ``"mlp"``: residual MLP for benchmarks (``mlp.py``); flavors ``tiny``, ``small``.

A Hugging Face checkpoint (``init_from``) picks its family itself (``hf.hf_family``): its
``config.json``'s ``architectures`` / ``model_type``.

A job can also name its own model as ``"package.module:factory"``: the module is imported and
``factory(**overrides)`` must return an ``nn.Module``.

Usage::

    model = build_model("llama", "tiny")
    model = build_model("llama", "8B", {"max_seq_len": 4096}, device="meta")
    model = build_model("my_pkg.models:make_model", overrides={"width": 512})

What the trainer can rely on for the built-ins:

- **Blocks**: the repeated blocks are ``model.layers``, an ``nn.ModuleDict`` keyed ``"0"``,
  ``"1"``, ... (``model.blocks()`` lists them): parameter names are a list's
  (``layers.3.attention.wq.weight``), and stay so in a pipeline stage.
- **Pipeline stages**: ``model.keep_stage(layers, first=, last=)`` trims a (meta) model in place
  to one stage; its forward then passes hidden states in and/or out.
- Wrap each block with ``fully_shard`` (and/or activation checkpointing), then the root module,
  so the embedding/head land in the root group.
- **Init**: ``model.init_weights()`` re-initialises every parameter in place using only
  ``torch.nn.init.*`` on whole parameters (works on sharded DTensors) and recomputes the non-
  persistent buffers (Llama's ``rope_cache``) on the parameters' device. Meta-device flows:
  with ``hpservice.fsdp``: ``build_model(..., device="meta")`` -> ``fully_shard`` each block, then
  the root (it allocates the shards on the mesh device; no ``to_empty``) -> ``init_weights()``;
  without FSDP: ``build_model(..., device="meta")`` -> ``to_empty(device=...)`` -> ``init_weights()``
  (which also re-ties a tied head that ``to_empty`` split). A normal (non-meta) build is already
  initialised. ``trunc_normal_`` is avoided on purpose: torch's rejection-sampling version calls
  ``.any()``, which sharded DTensors do not support.
- **Forward**: ``model(tokens: LongTensor[B, S]) -> logits[B, S, vocab_size]``; the loss is the
  trainer's (cross entropy on shifted tokens).
- **MFU**: ``flops_per_token(model_config(name, flavor, overrides), seq_len)``; ``num_params(model)``.

Registry errors are ``ValueError`` with a message naming the bad value and the allowed ones, except
a factory that returns something other than an ``nn.Module`` (``TypeError``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import types
import typing

import torch
from torch import nn

from . import deepseek_v3, llama, mistral, mlp, qwen2, qwen3, qwen3_moe
from ._spec import HFNames, ModelSpec
from .deepseek_v3 import DEEPSEEK_V3_FLAVORS, DeepseekV3, DeepseekV3Config
from .llama import LLAMA_FLAVORS, Llama, LlamaConfig, num_params
from .mistral import MISTRAL_FLAVORS, Mistral
from .mlp import MLP_FLAVORS, MLPConfig, MLPModel
from .qwen2 import QWEN2_FLAVORS, Qwen2
from .qwen3 import QWEN3_FLAVORS, Qwen3
from .qwen3_moe import QWEN3_MOE_FLAVORS, Qwen3Moe, Qwen3MoeConfig

__all__ = [
    "DEEPSEEK_V3_FLAVORS",
    "HF_FAMILIES",
    "LLAMA_FLAVORS",
    "MISTRAL_FLAVORS",
    "MLP_FLAVORS",
    "MODEL_SPECS",
    "QWEN2_FLAVORS",
    "QWEN3_FLAVORS",
    "QWEN3_MOE_FLAVORS",
    "DeepseekV3",
    "DeepseekV3Config",
    "HFNames",
    "Llama",
    "LlamaConfig",
    "MLPConfig",
    "MLPModel",
    "Mistral",
    "ModelSpec",
    "Qwen2",
    "Qwen3",
    "Qwen3Moe",
    "Qwen3MoeConfig",
    "build_model",
    "config_class",
    "factory_model_spec",
    "flops_per_token",
    "list_flavors",
    "list_models",
    "model_class",
    "model_config",
    "model_spec",
    "num_params",
    "resolve_factory",
    "resolve_name",
]

_DEFAULT_FLAVOR = "tiny"


# The families, each declared once by its own file (``MODEL_SPEC``: ``_spec.ModelSpec``).
MODEL_SPECS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        llama.MODEL_SPEC,
        qwen2.MODEL_SPEC,
        qwen3.MODEL_SPEC,
        mistral.MODEL_SPEC,
        qwen3_moe.MODEL_SPEC,
        deepseek_v3.MODEL_SPEC,
        mlp.MODEL_SPEC,
    )
}
HF_FAMILIES = tuple(name for name, spec in MODEL_SPECS.items() if spec.hf is not None)
"""The built-ins that import and export Hugging Face checkpoints (``hf.py``)."""


def model_spec(name: str) -> ModelSpec:
    """The bundle of a built-in family; ``ValueError`` naming the allowed ones otherwise."""
    return _builtin(name)


def factory_model_spec(name: str, model: nn.Module) -> ModelSpec:
    """The bundle of a custom factory's model (``package.module:factory``): a tensor-parallel plan
    where the model brings one (a ``parallelize(tp_mesh, sequence_parallel=...)`` method), a
    pipeline split where it brings a ``keep_stage(layers, first=, last=)`` method (blocks in
    ``.layers``, an ``nn.ModuleDict``, as the built-ins), MoE upkeep where it is built from our ``MoE`` layers,
    no Hugging Face names, the 6N FLOPs estimate."""
    from .moe import moe_post_optimizer_hooks

    def parallelize(m: nn.Module, tp_mesh, sequence_parallel: bool) -> None:
        m.parallelize(tp_mesh, sequence_parallel=sequence_parallel)

    return ModelSpec(
        name=name,
        model_cls=type(model),
        config_cls=type(None),
        flavors={},
        description=f"custom model {name}",
        flops_per_token=None,
        parallelize=parallelize if callable(getattr(model, "parallelize", None)) else None,
        pipeline_stage=type(model).keep_stage if callable(getattr(model, "keep_stage", None)) else None,
        post_optimizer_hooks=moe_post_optimizer_hooks,
    )


def resolve_name(name: str | None, init_from: str | None = None) -> str:
    """The model a spec's ``model.name`` / ``model.init_from`` mean: the name when given, else the
    family of the Hugging Face checkpoint (read from its ``config.json``), else the llama."""
    if name is not None:
        return name
    if init_from is not None:
        from .hf import hf_family

        return hf_family(init_from)
    return "llama"


def list_models() -> list[str]:
    """Names of the built-in models (custom ``package.module:factory`` names are also accepted)."""
    return sorted(MODEL_SPECS)


def list_flavors(name: str) -> list[str]:
    """Flavors of a built-in model, in table order (smallest first)."""
    return list(_builtin(name).flavors)


def model_config(name: str | None, flavor: str | None = None, overrides: dict | None = None, init_from: str | None = None):
    """The config dataclass of a built-in model: the flavor's config (default ``"tiny"``), or with
    ``init_from`` the Hugging Face checkpoint's (``hf.py``; ``HF_FAMILIES``; ``name`` None: the
    checkpoint's family), with ``overrides`` applied. Unknown fields and wrongly typed values raise ``ValueError``."""
    name = resolve_name(name, init_from)
    entry = _builtin(name)
    if init_from is not None:
        if name not in HF_FAMILIES:
            raise ValueError(
                f"init_from: Hugging Face checkpoints import into {', '.join(HF_FAMILIES)}, not {name!r}"
            )
        from .hf import config_from_hf

        return _apply_overrides(config_from_hf(init_from, family=name), overrides or {})
    flavor = _DEFAULT_FLAVOR if flavor is None else flavor
    if flavor not in entry.flavors:
        raise ValueError(f"unknown flavor {flavor!r} for model {name!r}; allowed flavors: {', '.join(entry.flavors)}")
    return _apply_overrides(entry.flavors[flavor], overrides or {})


def build_model(
    name: str | None,
    flavor: str | None = None,
    overrides: dict | None = None,
    *,
    device: str | torch.device | None = None,
    init_from: str | None = None,
) -> nn.Module:
    """Build a model by name.

    - ``name``: a built-in (``list_models()``), ``"package.module:factory"``, or None: the
      ``init_from`` checkpoint's family, else the llama.
    - ``flavor``: a row of the built-in's flavor table (default ``"tiny"``); must be None for a factory.
    - ``overrides``: config fields to replace (built-in) or keyword arguments of the factory.
    - ``device``: build under ``torch.device(device)``; ``"meta"`` allocates nothing (then
      ``to_empty(device=...)`` and ``init_weights()``). None: the current default device.
    - ``init_from``: a Hugging Face checkpoint directory whose config the model takes (its weights:
      ``hf.load_hf_weights`` after the model is laid out).
    """
    name = resolve_name(name, init_from)
    if not isinstance(name, str) or not name:
        raise ValueError(f"model name must be a non-empty string, got {name!r}")
    if ":" in name:
        if flavor is not None:
            raise ValueError(
                f"flavor {flavor!r} only applies to built-in models ({', '.join(list_models())}), not {name!r}"
            )
        factory = resolve_factory(name)
        with _device_context(device):
            model = factory(**(overrides or {}))
        if not isinstance(model, nn.Module):
            raise TypeError(f"model factory {name!r} must return a torch.nn.Module, got {type(model).__name__}")
        return model
    cfg = model_config(name, flavor, overrides, init_from)
    with _device_context(device):
        return MODEL_SPECS[name].model_cls(cfg)


def model_class(name: str) -> type[nn.Module]:
    """The class of a built-in model (``Llama``, ``Qwen3``, ...), built from its config alone."""
    return _builtin(name).model_cls


def config_class(name: str) -> type:
    """The config dataclass of a built-in model (``LlamaConfig``, ``Qwen3MoeConfig``, ...)."""
    return _builtin(name).config_cls


def flops_per_token(cfg: LlamaConfig | MLPConfig, seq_len: int, *, attention: bool = True) -> int:
    """Training FLOPs per token of a built-in model's config (its family's ``flops_per_token``)."""
    for spec in MODEL_SPECS.values():
        if type(cfg) is spec.config_cls:
            return spec.flops_per_token(cfg, seq_len, attention=attention)
    raise TypeError(f"flops_per_token: not the config of a built-in family: {type(cfg).__name__}")


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------


def _builtin(name: str) -> ModelSpec:
    if name not in MODEL_SPECS:
        raise ValueError(
            f"unknown model {name!r}; built-in models: {', '.join(list_models())}, "
            "or a custom factory written as 'package.module:factory'"
        )
    return MODEL_SPECS[name]


def _device_context(device):
    return contextlib.nullcontext() if device is None else torch.device(device)


def _apply_overrides(cfg, overrides: dict):
    if not isinstance(overrides, dict):
        raise ValueError(f"overrides must be a dict of config fields, got {type(overrides).__name__}")
    cls = type(cfg)
    hints = typing.get_type_hints(cls)
    allowed = [f.name for f in dataclasses.fields(cls)]
    for key, value in overrides.items():
        if key not in allowed:
            raise ValueError(f"unknown {cls.__name__} field {key!r}; allowed fields: {', '.join(allowed)}")
        if not _has_type(value, hints[key]):
            hint = " (YAML reads 1e-5 as a string; write 1.0e-5)" if isinstance(value, str) else ""
            raise ValueError(
                f"{cls.__name__}.{key} must be {_type_name(hints[key])}, got {type(value).__name__} {value!r}{hint}"
            )
    return dataclasses.replace(cfg, **overrides)  # runs the config's own validation


def _has_type(value, tp) -> bool:
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return any(_has_type(value, t) for t in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    return isinstance(tp, type) and isinstance(value, tp)


def _type_name(tp) -> str:
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return " or ".join(_type_name(t) for t in typing.get_args(tp))
    return "None" if tp is type(None) else getattr(tp, "__name__", str(tp))


def resolve_factory(spec: str):
    """The callable a ``"package.module:factory"`` name points at (imported here); ``ValueError``
    naming what is wrong with the name, the import or the attribute."""
    module_name, sep, attr_path = spec.partition(":")
    parts = attr_path.split(".")
    if (
        not sep
        or ":" in attr_path
        or not module_name
        or not all(p.isidentifier() for p in module_name.split("."))
        or not all(p.isidentifier() for p in parts)
    ):
        raise ValueError(f"custom model must be written 'package.module:factory', got {spec!r}")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"custom model {spec!r}: cannot import module {module_name!r}: {exc}") from exc
    for part in parts:
        if not hasattr(obj, part):
            raise ValueError(f"custom model {spec!r}: {obj.__name__!r} has no attribute {part!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"custom model {spec!r}: {attr_path!r} is not callable")
    return obj
