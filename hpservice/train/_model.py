"""The trainer's model: the whole model on the meta device, this rank's parts of it laid out and
filled, and what the run records of it (its family and config, its tokenizer files, its FLOPs).

The full model never exists on one rank: it is built on the meta device, split into this rank's
pipeline stages, each laid out (``_parallelize``), then each rank allocates and fills only its own
pieces, from ``model.init_from`` or the seed (``_init_weights``).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging

import torch
import torch.nn as nn

from hpservice.models import (
    MODEL_SPECS,
    ModelSpec,
    build_model,
    factory_model_spec,
    model_config,
    num_params,
    resolve_name,
)
from hpservice.models.hf import load_hf_weights
from hpservice.models.lora import LoRALinear, LoraSettings, apply_lora, quantize_base_nf4, shard_base_nf4
from hpservice.parallel import ParallelDims
from hpservice.spec import JobSpec

from ._errors import TrainingError
from ._init_weights import init_weights
from ._optimizer import freeze
from ._parallelize import parallelize
from ._pipeline import apply_pp, build_pipeline_schedule
from ._utilisation import Utilisation

__all__ = ["ModelFacts", "build_meta_model", "build_model_parts", "describe_model"]

log = logging.getLogger("hpservice.train")


@dataclasses.dataclass
class ModelFacts:
    """What the run knows of its model besides the modules."""

    record: dict  # what a checkpoint records: name, config (built-in families), text (tokenizer files)
    vocab_size: int | None  # what the data must fit
    utilisation: Utilisation  # MFU from the model's FLOPs per token


def build_meta_model(spec: JobSpec, dims: ParallelDims) -> tuple[ModelSpec, nn.Module, set[str]]:
    """The model's bundle (its family's ``ModelSpec``, or a custom factory's), the whole model on
    the meta device with the bundle's converters applied, and the names of its frozen parameters
    (``training.freeze``: the patterns must match the whole model)."""
    m = spec.model
    name = resolve_name(m.name, m.init_from)  # the family of an init_from checkpoint
    model = build_model(name, m.flavor, m.overrides, device="meta", init_from=m.init_from)
    bundle = MODEL_SPECS[name] if name in MODEL_SPECS else factory_model_spec(name, model)
    for convert in bundle.converters:
        convert(model)
    adapted = _apply_lora(model, m.lora)
    for module in model.modules():  # a window that covers every sequence is no window: no mask to build
        if getattr(module, "sliding_window", None) is not None and module.sliding_window >= spec.data.seq_len:
            module.sliding_window = None
    frozen = set(freeze(model, spec.training.freeze))
    if adapted:  # every weight but the adapters' stays as it is
        frozen |= {n for n, _ in model.named_parameters() if not n.endswith((".lora_A", ".lora_B"))}
    if dims.cp > 1 and "positions" not in inspect.signature(model.forward).parameters:
        raise TrainingError(
            "parallelism.cp > 1 needs a model whose forward takes positions= (the global position of each "
            "token of its part of the sequence), as the built-in llama's does"
        )
    return bundle, model, frozen


def lora_settings(lora) -> LoraSettings:
    """The spec's ``model.lora`` as the engine's settings."""
    targets = lora.target_modules if isinstance(lora.target_modules, str) else tuple(lora.target_modules)
    return LoraSettings(lora.r, lora.lora_alpha, lora.lora_dropout, targets, lora.use_rslora, lora.quantize_base)


def _apply_lora(model: nn.Module, lora) -> list[str]:
    if lora is None:
        return []
    try:
        return apply_lora(model, lora_settings(lora))
    except ValueError as e:
        raise TrainingError(str(e)) from e


@torch.no_grad()
def _init_adapters(part: nn.Module, spec: JobSpec, mesh) -> None:
    """A pretrained base's adapters: PEFT's init from the seed (sharding-independent streams, as
    ``init_weights``), then ``model.init_adapter``'s values where one is given."""
    from hpservice.dtensor import random as dtensor_random
    from hpservice.models.peft_adapter import AdapterError, load_adapter

    adapters = [(n, mod) for n, mod in part.named_modules() if isinstance(mod, LoRALinear)]
    if not adapters:
        return
    dtensor_random.manual_seed(spec.training.seed)
    named = [(f"{n}.{w}", getattr(mod, w)) for n, mod in adapters for w in ("lora_A", "lora_B")]
    with dtensor_random.parameter_streams(named):
        for _, mod in adapters:
            mod.reset_lora_parameters()
    if spec.model.init_adapter is not None:
        try:
            load_adapter(part, spec.model.init_adapter, whole=spec.parallelism.pp == 1)
        except (AdapterError, OSError) as e:
            raise TrainingError(f"model.init_adapter: {e}") from e


def build_model_parts(
    bundle: ModelSpec,
    whole: nn.Module,
    frozen: set[str],
    dims: ParallelDims,
    spec: JobSpec,
    device: torch.device,
    loss_fn,
) -> tuple[list[nn.Module], object | None]:
    """This rank's stages (or the whole model), each laid out and filled, and with pipeline
    parallelism the schedule over them with ``loss_fn`` on the last stage."""
    stages = apply_pp(whole, dims.pp_rank, spec, bundle) if dims.pp > 1 else [(0, whole)]
    last = spec.parallelism.pp * spec.parallelism.pp_virtual_stages - 1
    for s, part in stages:
        parallelize(part, bundle, dims, spec, device, first=s == 0, last=s == last)
        if spec.model.init_from is not None:  # pretrained weights: each rank reads its own slices
            part.init_buffers()
            load_hf_weights(part, spec.model.init_from)
            _init_adapters(part, spec, dims.stage_mesh)
        else:
            init_weights(part, dims.stage_mesh, spec.training.seed)
            if spec.model.init_adapter is not None:
                _init_adapters(part, spec, dims.stage_mesh)
        for name, param in part.named_parameters():
            if name in frozen:
                param.requires_grad_(False)
        if spec.model.lora is not None and spec.model.lora.quantize_base == "nf4":
            quantize_base_nf4(part)  # QLoRA: the whole base weights (fully_shard left them), to NF4
            if dims.dp_mesh is not None:  # then each rank keeps its rows, as fully_shard would
                shard_dim = dims.dp_mesh.mesh_dim_names[-1]
                shard_base_nf4(part, dims.dp_mesh[shard_dim] if dims.dp_mesh.ndim > 1 else dims.dp_mesh)
    parts = [part for _, part in stages]
    if dims.pp == 1:
        return parts, None
    return parts, build_pipeline_schedule(stages, spec, device, dims.pp_mesh.get_group(), loss_fn)


def _text_record(spec: JobSpec) -> dict | None:
    """The special token ids, generation config and tokenizer files of this run's model
    (``hpservice.models.hf_text``): from ``model.init_from``, else from ``data.tokenizer``."""
    from hpservice.models.hf_text import record_from_hf, record_from_tokenizer

    try:
        if spec.model.init_from is not None:
            return record_from_hf(spec.model.init_from)
        if spec.data.kind == "text" and spec.data.tokenizer is not None:
            return record_from_tokenizer(spec.data.tokenizer)
    except Exception as e:  # a broken tokenizer stops the run where its data is read, saying why
        log.warning("the run's tokenizer files are not recorded for export: %s", e)
    return None


def describe_model(bundle: ModelSpec, whole: nn.Module, spec: JobSpec, device: torch.device, rank: int) -> ModelFacts:
    """The model's record (rank 0 adds its tokenizer files), vocabulary and FLOP counts (the
    family's, or for a custom factory the 6N estimate)."""
    m = spec.model
    record = {"name": bundle.name, "config": None}
    if rank == 0 and bundle.hf is not None and (text := _text_record(spec)) is not None:
        record["text"] = text  # what an HF export writes besides weights
    if bundle.flops_per_token is not None:
        config = model_config(bundle.name, m.flavor, m.overrides, m.init_from)
        record["config"] = dataclasses.asdict(config)
        vocab = spec.data.vocab_size or config.vocab_size
        flops = bundle.flops_per_token(config, spec.data.seq_len)
        flops_no_attention = bundle.flops_per_token(config, spec.data.seq_len, attention=False)
    else:
        vocab = spec.data.vocab_size
        flops = flops_no_attention = 6 * num_params(whole)
    if spec.data.kind == "synthetic" and vocab is None:
        raise TrainingError("data.vocab_size is required with a custom model on synthetic data")
    if m.lora is not None:  # what a PEFT export writes: the settings and the adapted modules
        adapted = [n for n, mod in whole.named_modules() if isinstance(mod, LoRALinear)]
        trainable = sum(p.numel() for n, p in whole.named_parameters() if n.endswith((".lora_A", ".lora_B")))
        record["lora"] = {**dataclasses.asdict(lora_settings(m.lora)), "modules": adapted, "base": m.init_from,
                          "trainable": trainable, "total": num_params(whole)}  # fmt: skip
        if m.init_from is not None:  # the base the adapters belong to, wherever it is mounted
            from hpservice.models.hf import base_fingerprint

            record["lora"]["base_fingerprint"] = base_fingerprint(m.init_from)
    return ModelFacts(record, vocab, Utilisation(device, spec.parallelism.mixed_precision, flops, flops_no_attention))
