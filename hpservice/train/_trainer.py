"""The training loop of a job. It knows nothing of Ray: it runs under torchrun, in a test's rank
pool, or inside a Ray worker actor, wherever torch.distributed's env:// variables are set.

Read it top to bottom: ``Trainer.__init__`` builds the mesh (``ParallelDims``: pp x dp_replicate x
dp_shard x cp x tp), the model (on the meta device, split into this rank's pipeline stages, each
laid out by tensor parallelism and fully_shard, then each rank allocates and initialises only its
own pieces), the optimizer, the LR schedule, the data and the checkpoints, and resumes if asked;
``train`` loops over ``train_step`` and saves checkpoints.

The model is ``model_parts``: one module, or with pipeline parallelism this rank's stages, whose
parameter names are the whole model's. A step runs the micro-batches through them with the
pipeline schedule (``parallelism.pp_schedule``), the loss on the last stage.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from hpservice.checkpoint import CheckpointManager, CheckpointReader, step_dir_name, step_of
from hpservice.data import build_source
from hpservice.dtensor import DeviceMesh, DTensor, Replicate, Shard, distribute_tensor
from hpservice.dtensor import random as dtensor_random
from hpservice.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from hpservice.inputs import confine, open_input
from hpservice.models import (
    HF_FAMILIES,
    build_model,
    flops_per_token,
    list_models,
    model_config,
    num_params,
    resolve_name,
)
from hpservice.models.hf import load_hf_weights
from hpservice.models.moe import dropped_pairs, expert_loads, mean_aux_loss, moe_layers, update_expert_biases
from hpservice.parallel import ParallelDims, vocab_parallel_cross_entropy
from hpservice.parallel.context_parallel import context_parallel, document_ids_from_eos, document_masking
from hpservice.parallel.context_parallel import positions as cp_positions
from hpservice.parallel.expert_parallel import apply_ep
from hpservice.parallel.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    split_model,
)
from hpservice.spec import JobSpec, new_run_id

from ._activation_checkpointing import apply_activation_checkpointing
from ._compile import apply_compile, check_compile_available
from ._errors import TrainingError
from ._grad_norm import clip_grad_norm_
from ._hold import wait_while_held
from ._metrics import MetricSink, build_sinks
from ._profile import StepProfiler
from ._storage import EVERY_STEPS as STORAGE_EVERY_STEPS
from ._storage import StorageBudget
from ._utilisation import Utilisation

log = logging.getLogger("hpservice.train")

MetricsCallback = Callable[[dict], None]


# ---- parallelism: small functions, as torchtitan applies them ---------------------------------
def init_distributed(device_type: str) -> bool:
    """Join torch.distributed from env:// (torchrun, Ray workers), or make a world of one on an
    in-process store: it has no one to meet, and it leaves no ``MASTER_PORT``/``RANK`` in this
    process's environment, where a later run in the same process (a notebook, a test) would take
    them for a rendezvous on a port that may no longer be free. Returns True if this call created
    the process group (the caller destroys it)."""
    if dist.is_initialized():
        return False
    backend = dist.Backend.default_device_backend_map.get(device_type, "gloo")
    timeout = timedelta(minutes=10)
    if "RANK" not in os.environ:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        dist.init_process_group(backend, timeout=timeout)
    return True


def pick_device(spec: JobSpec) -> torch.device:
    """This rank's device. ``use_gpu: auto`` is decided by the one rule,
    ``ResourcesSpec.gpus_per_worker``: a GPU each when there is one for every rank on this node
    (torchrun's ``LOCAL_WORLD_SIZE``). Under Ray the coordinator already decided (never ``auto``)."""
    local = spec.resources.model_copy(update={"workers": int(os.environ.get("LOCAL_WORLD_SIZE", "1"))})
    if local.gpus_per_worker(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        if not torch.cuda.is_available():
            raise TrainingError("resources.use_gpu is true but no CUDA device is available")
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _fsdp_policies(spec: JobSpec) -> tuple[MixedPrecisionPolicy, OffloadPolicy]:
    p = spec.parallelism
    dtype = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[p.mixed_precision]
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)
    return mp, CPUOffloadPolicy() if p.cpu_offload else OffloadPolicy()


def apply_expert_fsdp(model: nn.Module, dims: ParallelDims, spec: JobSpec) -> None:
    """fully_shard each expert-parallel ``GroupedExperts`` over the ranks that hold the same
    experts (``dp_shard_mod_ep``, with ``dp_replicate``: HSDP), torchtitan's ``dp_shard_mod_ep``:
    their ``Shard(0)`` pieces on the ep mesh are sharded again on a dim ep leaves whole. Their
    gradients hold the ep group's tokens' contributions: the reduce divides by the whole
    data-parallel size (``set_gradient_divide_factor``), the mean every other parameter gets."""
    from hpservice.models.moe import GroupedExperts

    names = ("dp_replicate", "dp_shard_mod_ep") if dims.dp_replicate > 1 else ("dp_shard_mod_ep",)
    mesh = dims.expert_mesh[names]
    mp, offload = _fsdp_policies(spec)
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            fully_shard(module, mesh=mesh, mp_policy=mp, offload_policy=offload)
            module.set_gradient_divide_factor(dims.dp_size)


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, spec: JobSpec) -> None:
    """fully_shard each block (``model.layers``, where the model has them), then the root
    (embeddings, final norm, head: everything not in a block). With ``reshard_after_forward`` the
    last block still keeps its parameters after forward, as torchtitan does: backward starts with
    it, so freeing them would only gather them again. A model without ``layers`` is one group:
    correct, but its whole unsharded size is gathered at once."""
    p = spec.parallelism
    mp, offload = _fsdp_policies(spec)
    layers = getattr(model, "layers", None)
    blocks = list(layers.values() if isinstance(layers, nn.ModuleDict) else layers) if layers is not None else []
    for i, block in enumerate(blocks):
        reshard = p.reshard_after_forward and i < len(blocks) - 1
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp, offload_policy=offload)
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload)


def apply_tp(model: nn.Module, mesh: DeviceMesh, spec: JobSpec) -> None:
    """Tensor parallelism on the 1-d "tp" mesh: the model's own plan, ``model.parallelize(tp_mesh,
    sequence_parallel=...)`` (the built-in llama's is ``apply_llama_tp``; a custom model brings
    one). On a meta-device model it only records layouts: each rank later allocates its pieces."""
    parallelize = getattr(model, "parallelize", None)
    if not callable(parallelize):
        raise TrainingError(
            f"parallelism.tp > 1 needs a model with a parallelize(tp_mesh, sequence_parallel=...) method, as the "
            f"built-in llama has; {type(model).__name__} has none"
        )
    try:
        parallelize(mesh, sequence_parallel=spec.parallelism.sequence_parallel)
    except ValueError as e:
        raise TrainingError(str(e)) from e


PIPELINE_SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "zero_bubble": ScheduleInterleavedZeroBubble,
}


def apply_pp(model: nn.Module, pp_rank: int, spec: JobSpec) -> list[tuple[int, nn.Module]]:
    """This pp rank's stages of the (meta) model: ``(stage_index, module)``, split by blocks
    (``hpservice.parallel.pipelining.split_model``), each still on the meta device."""
    p = spec.parallelism
    try:
        return split_model(model, pp_rank, p.pp, p.pp_virtual_stages, p.pp_layers_per_stage)
    except ValueError as e:
        raise TrainingError(str(e)) from e


def pass_local_shards_between_stages(model: nn.Module, tp_mesh: DeviceMesh, *, first: bool, last: bool) -> None:
    """Sequence parallelism under pp: inside a stage the hidden states are DTensors sharded on the
    sequence over tp (``Shard(1)``); between stages each tp rank sends its own piece to the same tp
    rank of the next stage, a plain tensor, and the next stage wraps it again. Both conversions are
    differentiable, so the gradients go back the same way."""
    if not first:
        model.register_forward_pre_hook(
            lambda _module, args: (DTensor.from_local(args[0], tp_mesh, [Shard(1)]), *args[1:])
        )
    if not last:
        model.register_forward_hook(lambda _module, _args, out: out.to_local() if isinstance(out, DTensor) else out)


def init_weights(model: nn.Module, mesh: DeviceMesh, seed: int) -> None:
    """Run the model's own ``init_weights()`` with the sharding-independent DTensor RNG, each
    parameter from a stream keyed by its name (``parameter_streams``), so every layout (FSDP,
    HSDP, tp, pipeline stages, one process) starts from the same values for the same seed.
    Parameters that are still plain tensors (replicated ones under tp alone) are wrapped as
    Replicate DTensors on ``mesh`` for the init, so they draw from the same streams, then unwrapped."""
    plain = []
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and not isinstance(param, DTensor):
                dt = distribute_tensor(param.detach(), mesh, [Replicate()] * mesh.ndim, src_data_rank=None)
                module.register_parameter(name, nn.Parameter(dt, requires_grad=param.requires_grad))
                plain.append((module, name))
    dtensor_random.manual_seed(seed)
    with torch.no_grad(), dtensor_random.parameter_streams(model.named_parameters()):
        if callable(getattr(model, "init_weights", None)):
            model.init_weights()
        else:
            reset_parameters(model)
    for module, name in plain:
        param = module._parameters[name]
        module.register_parameter(name, nn.Parameter(param.detach().to_local(), requires_grad=param.requires_grad))


def reset_parameters(model: nn.Module) -> None:
    """Initialise a model that has no ``init_weights()`` the way torch's meta-device recipe for
    fully_shard does: each submodule's own ``reset_parameters()`` (every torch layer has one).
    A module holding parameters or buffers of its own without one would keep the uninitialised
    memory ``to_empty`` gave it, so it is refused by name instead."""
    for name, module in model.named_modules():
        own = [*module._parameters.values(), *module._buffers.values()]
        if not any(t is not None for t in own):
            continue
        reset = getattr(module, "reset_parameters", None)
        if not callable(reset) and isinstance(module, nn.MultiheadAttention):
            reset = module._reset_parameters  # torch's own layer, which names it privately
        if not callable(reset):
            kinds = ", ".join(n for n, t in [*module._parameters.items(), *module._buffers.items()] if t is not None)
            raise TrainingError(
                f"model has no init_weights(), and {name or 'the root module'} ({type(module).__name__}) holds "
                f"{kinds} but has no reset_parameters(): the model is built on the meta device, so give the model an "
                "init_weights() (or that module a reset_parameters()) that fills every parameter and buffer"
            )
        reset()


def _file_key(path: str, tokenizer: str) -> str:
    """Names a tokenized copy: the text file's size and mtime and the tokenizer's bytes."""
    import hashlib

    st = Path(path).stat()
    h = hashlib.sha256(f"{Path(path).resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
    with open_input(tokenizer) as f:
        h.update(f.read())
    return h.hexdigest()[:12]


def _check_token_metadata(path: str, vocab: int | None) -> None:
    """A token file from ``hpservice prepare-data`` carries its tokenizer's vocabulary and dtype:
    refuse one the model cannot embed, or one whose dtype differs from what the reader infers."""
    from hpservice.data import read_metadata, resolve_token_dtype

    meta = read_metadata(path)
    if meta is None:
        return
    if vocab is not None and meta["vocab_size"] > vocab:
        raise TrainingError(
            f"data.path {path}: tokenized with a vocabulary of {meta['vocab_size']} ({meta.get('tokenizer')}), "
            f"larger than the model's {vocab}"
        )
    if resolve_token_dtype(path).name != meta["dtype"]:
        raise TrainingError(
            f"data.path {path}: holds {meta['dtype']} tokens but would be read as {resolve_token_dtype(path).name}"
        )


_FREEZE_ALIASES = {"embeddings": ("tok_embeddings.*",), "output": ("output.*",), "norm": ("norm.*",)}


def freeze(model: nn.Module, patterns: list[str]) -> list[str]:
    """``requires_grad_(False)`` on the parameters ``patterns`` name (fine-tuning part of a model);
    returns their names. A pattern that matches nothing is an error naming it (a typo must not
    train what was meant to stay fixed)."""
    import fnmatch
    import re

    names = [n for n, _ in model.named_parameters()]
    frozen: set[str] = set()
    for pattern in patterns:
        blocks = re.fullmatch(r"layers\.(\d+)(?:-(\d+))?", pattern)
        if blocks:
            lo, hi = int(blocks[1]), int(blocks[2] or blocks[1])
            globs = tuple(f"layers.{i}.*" for i in range(lo, hi + 1))
        else:
            globs = _FREEZE_ALIASES.get(pattern, (pattern,))
        matched = [n for n in names if any(fnmatch.fnmatchcase(n, g) for g in globs)]
        if not matched or (blocks and len({n.split(".")[1] for n in matched}) != hi - lo + 1):
            raise TrainingError(
                f"training.freeze: {pattern!r} matches no parameter (or not every block it names); parameter names "
                f"look like {', '.join(names[:3])}, ..."
            )
        frozen.update(matched)
    for name, param in model.named_parameters():
        if name in frozen:
            param.requires_grad_(False)
    return sorted(frozen)


def build_optimizer(model: nn.Module | list[nn.Module], spec: JobSpec) -> torch.optim.Optimizer:
    """One optimizer over the model's (or all its parts') trainable parameters."""
    o = spec.optimizer
    parts = model if isinstance(model, list) else [model]
    params = [p for part in parts for p in part.parameters() if p.requires_grad]  # training.freeze's stay out
    if o.name == "adamw":
        return torch.optim.AdamW(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    return torch.optim.SGD(params, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay)


def lr_lambda(spec: JobSpec) -> Callable[[int], float]:
    """Multiplier of optimizer.lr at a step: linear warm-up, then cosine/linear decay or constant."""
    s, steps = spec.lr_scheduler, spec.training.steps

    def factor(step: int) -> float:
        if step < s.warmup_steps:
            return (step + 1) / s.warmup_steps
        if s.decay == "constant":
            return 1.0
        progress = min(1.0, (step - s.warmup_steps) / max(1, steps - s.warmup_steps))
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if s.decay == "cosine" else 1 - progress
        return s.min_lr_ratio + (1 - s.min_lr_ratio) * shape

    return factor


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy in float32; with tensor parallelism the logits are sharded on
    the vocabulary and the loss never gathers them."""
    if isinstance(logits, DTensor):
        return vocab_parallel_cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _step_consensus(loss: torch.Tensor, stop_requested: bool, holders: int) -> tuple[float, bool]:
    """One all-reduce per step: the mean loss over the ``holders`` ranks that computed one (all,
    or the last pipeline stage's; the others add zero), and whether any rank was asked to stop.

    A stop request reaches each rank's thread at its own moment; deciding on it together, after
    the same step, keeps every rank issuing the same collectives (one rank checkpointing while
    another starts a step would hang both)."""
    flag = torch.tensor(float(stop_requested), dtype=torch.float64, device=loss.device)
    t = torch.stack([loss.detach().to(torch.float64).reshape(()), flag])  # on the loss's device (nccl needs cuda)
    dist.all_reduce(t)
    return t[0].item() / holders, t[1].item() > 0


class Trainer:
    """One training job on the ranks of the current torch.distributed world."""

    def __init__(
        self,
        spec: JobSpec,
        *,
        on_metrics: MetricsCallback | None = None,
        on_checkpoint: MetricsCallback | None = None,
        log_fn: Callable[[str], None] | None = None,
        log_to_stdout: bool = True,
        reported_up_to: int | None = None,
    ):
        """``on_metrics(record)`` and ``on_checkpoint(info)`` run on rank 0 after each step / commit;
        ``log_fn(line)`` receives progress lines (default: print, unless ``log_to_stdout`` is False).
        ``reported_up_to``: the last step whose metrics ``on_metrics``' listener already has; a
        run resuming past it first reports the steps between from its ``metrics.jsonl`` (an
        earlier attempt trained them, but its reports were lost with its coordinator)."""
        confine(spec.input_roots)  # inputs are checked again on each file as it is opened
        self.spec = spec
        self.on_metrics = on_metrics
        self.on_checkpoint = on_checkpoint
        self._stop = threading.Event()  # set by request_stop, from another thread, on this rank
        self._stopping = False  # agreed by all ranks after a step
        self.device = pick_device(spec)
        if spec.training.compile and (reason := check_compile_available(self.device.type)):
            raise TrainingError(reason)  # before any work: not a crash at the first step
        self._owns_group = init_distributed(self.device.type)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if spec.run_id is None:  # run directly (torchrun, tests): rank 0 names the run for all
            run_id = [new_run_id(spec.name) if self.rank == 0 else None]
            dist.broadcast_object_list(run_id, src=0)
            spec = self.spec = spec.with_run(run_id[0])
        # the mesh (pp x dp_replicate x dp_shard x cp x tp), the dims fully_shard shards over, this
        # rank's data-parallel rank and size: one object (hpservice/parallel_dims.py)
        self.parallel_dims = ParallelDims.from_spec(spec.parallelism, self.world)
        self.mesh = self.parallel_dims.build_mesh(self.device.type)
        self.tp = self.parallel_dims.tp > 1
        self.dp_mesh = self.parallel_dims.dp_mesh
        # every context- and tensor-parallel rank of one data-parallel rank reads the same batch
        self.dp_rank, self.dp_size = self.parallel_dims.dp_rank, self.parallel_dims.dp_size
        self.cp_mesh = self.parallel_dims.cp_mesh  # each sequence is split over it (ring attention)
        self.pp_mesh = self.parallel_dims.pp_mesh  # a micro-batch goes through its ranks' stages

        # Built on the meta device, split into this rank's pipeline stages, each laid out (tp, then
        # fully_shard over the dp dims), then each rank allocates and initialises only its own
        # pieces: the full model never exists on one rank.
        m = spec.model
        self.model_name = resolve_name(m.name, m.init_from)  # the family of an init_from checkpoint
        model = build_model(self.model_name, m.flavor, m.overrides, device="meta", init_from=m.init_from)
        for module in model.modules():  # a window that covers every sequence is no window (preflight)
            if getattr(module, "sliding_window", None) is not None and module.sliding_window >= spec.data.seq_len:
                module.sliding_window = None
        frozen = set(freeze(model, spec.training.freeze))  # the patterns must match the whole model
        if self.cp_mesh is not None and "positions" not in inspect.signature(model.forward).parameters:
            raise TrainingError(
                "parallelism.cp > 1 needs a model whose forward takes positions= (the global position of each "
                "token of its part of the sequence), as the built-in llama's does"
            )
        stages = apply_pp(model, self.parallel_dims.pp_rank, spec) if self.pp_mesh is not None else [(0, model)]
        self.fsdp = self.dp_mesh is not None
        last = spec.parallelism.pp * spec.parallelism.pp_virtual_stages - 1
        self.model_parts = [self._lay_out(part, frozen, first=s == 0, last=s == last) for s, part in stages]
        self._loss = torch.compile(cross_entropy_loss) if spec.training.compile else cross_entropy_loss
        self.pipeline = self._pipeline([s for s, _ in stages]) if self.pp_mesh is not None else None
        # mixture-of-experts layers: their aux loss's gradient scale, load metrics, routing biases
        self.moe = {k: v for part in self.model_parts for k, v in moe_layers(part).items()}
        self._has_moe = bool(self.moe) or bool(moe_layers(model))  # on some stage, if not this rank's
        n_micro = 1 if self.pp_mesh is not None else spec.training.grad_accum  # the pipeline divides its own
        for layer in self.moe.values():
            layer.aux_loss_scale = 1.0 / n_micro
        self.optimizer = build_optimizer(self.model_parts, spec)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(spec))
        self.model_config_dict = None
        self._bias_update_rate = 0.0
        self.text_record = self._text_record() if self.rank == 0 and self.model_name in HF_FAMILIES else None
        if self.model_name in list_models():
            config = model_config(self.model_name, m.flavor, m.overrides, m.init_from)
            self.model_config_dict = dataclasses.asdict(config)
            vocab = spec.data.vocab_size or config.vocab_size
            self._bias_update_rate = getattr(config, "bias_update_rate", 0.0)
            flops = flops_per_token(config, spec.data.seq_len)
            flops_no_attention = flops_per_token(config, spec.data.seq_len, attention=False)
        else:  # a custom factory: the 6N estimate
            vocab = spec.data.vocab_size
            flops = flops_no_attention = 6 * num_params(model)
        self.utilisation = Utilisation(self.device, spec.parallelism.mixed_precision, flops, flops_no_attention)
        if spec.data.kind == "synthetic" and vocab is None:
            raise TrainingError("data.vocab_size is required with a custom model on synthetic data")
        run_dir = Path(spec.run_dir())
        self.storage = StorageBudget(spec.storage_limit_bytes, [str(run_dir), spec.checkpoint.dir])
        self.eval_data = None
        if spec.eval.interval:
            self.eval_data = self._source(spec.eval.data, vocab, run_dir)
        self.data = self._source(spec.data, vocab, run_dir)
        self.eos_id = self._document_eos(spec.data) if spec.data.document_mask else None
        self.output_dir = run_dir
        self.step = 0

        c = spec.checkpoint
        self.checkpoints = None
        self._resumed: dict | None = None  # the run's own checkpoint it resumed from (resume_from: latest)
        if c.interval or c.resume_from:
            self.checkpoints = CheckpointManager(c.dir, keep=c.keep, async_save=c.async_, best_metric=c.keep_best)
            if c.resume_from:
                self._resume(c.resume_from)
        if reported_up_to is not None and self.rank == 0 and self.on_metrics is not None:
            self._report_earlier_steps(reported_up_to)
        # rank 0's destinations for each step's record besides on_metrics (metrics.jsonl first)
        self._sinks: list[MetricSink] = build_sinks(spec, self.output_dir) if self.rank == 0 else []
        self._log = log_fn if log_fn is not None else (functools.partial(print, flush=True) if log_to_stdout else None)
        self._log_fn = log_fn
        self._uncommitted: list[dict] = []  # async checkpoints not yet reported as committed
        if self._resumed is not None:  # listed again: an earlier attempt's workers may have written it unreported
            self._uncommitted.append(self._resumed)
            self._report_committed()
        self._profiler = None
        if spec.metrics.profile is not None:
            self._profiler = StepProfiler(spec.metrics.profile, spec.artifacts_dir(), self.rank, self.device)
        self._profiler_reported = False

    @property
    def model(self) -> nn.Module:
        """This rank's model: the whole model, or its one pipeline stage (``model_parts`` holds
        a rank's several stages under ``pp_virtual_stages``)."""
        if len(self.model_parts) != 1:
            raise AttributeError(
                f"this rank holds {len(self.model_parts)} pipeline stages: use Trainer.model_parts"
            )
        return self.model_parts[0]

    def _lay_out(self, model: nn.Module, frozen: set[str], *, first: bool = True, last: bool = True) -> nn.Module:
        """A (meta) model or stage laid out on this rank's mesh and filled: tp, activation
        checkpointing and compile, fully_shard (or tp alone: allocated as it is), then weights
        from ``model.init_from`` or the seed; ``frozen`` parameters stop requiring gradients.
        ``first`` / ``last``: whether it is the pipeline's first / last stage."""
        spec = self.spec
        if self.tp:
            apply_tp(model, self.parallel_dims.tp_mesh, spec)
            if spec.parallelism.sequence_parallel and not (first and last):
                pass_local_shards_between_stages(model, self.parallel_dims.tp_mesh, first=first, last=last)
        if self.parallel_dims.ep > 1:  # each layer's experts split over the ep ranks
            try:
                apply_ep(model, self.parallel_dims.expert_mesh["ep"])
            except ValueError as e:
                raise TrainingError(f"parallelism.ep {self.parallel_dims.ep}: {e}") from e
        try:  # after tp, before fully_shard (torchtitan's order)
            apply_activation_checkpointing(model, spec)
            if spec.training.compile:
                # ring attention, mixture-of-experts layers and tensor-parallel boundaries (DTensor
                # from_local / redistribute / to_local) run eagerly between compiled parts
                eager_parts = self.cp_mesh is not None or moe_layers(model) or self.parallel_dims.tp > 1
                apply_compile(model, fullgraph=not eager_parts)
        except ValueError as e:
            raise TrainingError(str(e)) from e
        if self.fsdp:
            if self.parallel_dims.ep > 1:  # first: the blocks' fully_shard then leaves the experts to these groups
                apply_expert_fsdp(model, self.parallel_dims, spec)
            apply_fsdp(model, self.dp_mesh, spec)
        else:  # tp alone: allocate each rank's pieces (the styles re-install their gradient hooks)
            if spec.parallelism.mixed_precision != "none" or spec.parallelism.cpu_offload:
                raise TrainingError(
                    "parallelism.mixed_precision and cpu_offload come from fully_shard: with tp alone (data-parallel "
                    "size 1) they are not built yet; use dp_shard >= 2 or set them to none/false"
                )
            model.to_empty(device=self.device)
        if spec.model.init_from is not None:  # pretrained weights: each rank reads its own slices
            model.init_buffers()
            load_hf_weights(model, spec.model.init_from)
        else:
            init_weights(model, self.parallel_dims.stage_mesh, spec.training.seed)
        for name, param in model.named_parameters():
            if name in frozen:
                param.requires_grad_(False)
        return model

    def _pipeline(self, stage_indices: list[int]):
        """The schedule (``parallelism.pp_schedule``) over this rank's stages, with the loss on
        the last; its micro-batches are ``pp_microbatches x training.grad_accum``."""
        p, accum = self.spec.parallelism, self.spec.training.grad_accum
        stages = [
            PipelineStage(part, s, p.pp * p.pp_virtual_stages, self.device, group=self.pp_mesh.get_group())
            for s, part in zip(stage_indices, self.model_parts, strict=True)
        ]
        try:
            return PIPELINE_SCHEDULES[p.pp_schedule](stages, p.microbatches(accum), loss_fn=self._loss)
        except ValueError as e:
            raise TrainingError(
                f"parallelism.pp_schedule {p.pp_schedule} with pp_microbatches x training.grad_accum = "
                f"{p.microbatches(accum)}: {e}"
            ) from e

    def _text_record(self) -> dict | None:
        """The special token ids, generation config and tokenizer files of this run's model
        (``hpservice.models.hf_text``): from ``model.init_from``, else from ``data.tokenizer``."""
        from hpservice.models.hf_text import record_from_hf, record_from_tokenizer

        try:
            if self.spec.model.init_from is not None:
                return record_from_hf(self.spec.model.init_from)
            if self.spec.data.kind == "text" and self.spec.data.tokenizer is not None:
                return record_from_tokenizer(self.spec.data.tokenizer)
        except Exception as e:  # a broken tokenizer stops the run where its data is read, saying why
            log.warning("the run's tokenizer files are not recorded for export: %s", e)
        return None

    def _source(self, d, vocab: int | None, run_dir: Path):
        """The token source of a data section. Text with ``tokenizer``: rank 0 tokenizes it once
        into a token file in the run's directory (``prepare-data``'s format; reused by restarts
        of the run) while the others wait, then every rank reads that file."""
        if d.kind == "text" and d.tokenizer is not None:
            from hpservice.data import prepare_data, token_file_suffix, tokenizer_vocab_size

            for what, path in (("data.path", d.path), ("data.tokenizer", d.tokenizer)):
                if not Path(path).is_file():  # every rank sees it: they all stop with this reason
                    raise TrainingError(f"{what}: {path}: no such file")
            try:  # every rank reads it: they all stop with the same reason
                suffix = token_file_suffix(tokenizer_vocab_size(d.tokenizer))  # uint32 files past 65,536 tokens
            except Exception as e:  # tokenizers raises its own exception type
                raise TrainingError(
                    f"data.tokenizer: {d.tokenizer}: cannot load a tokenizers tokenizer.json ({e})"
                ) from e
            cache = run_dir / "data" / f"{Path(d.path).name}.{_file_key(d.path, d.tokenizer)}{suffix}"
            failure = [None]  # rank 0's error, if any, so every rank stops with it (no rank waits forever)
            if self.rank == 0 and not cache.exists():
                try:
                    prepare_data([d.path], cache, d.tokenizer)
                except (ValueError, OSError) as e:
                    failure = [str(e)]
            if self.world > 1:
                dist.broadcast_object_list(failure, src=0)
            if failure[0] is not None:
                raise TrainingError(f"data.tokenizer: {failure[0]}")
            _check_token_metadata(str(cache), vocab)
            return build_source("tokens", path=cache, vocab_size=vocab, seed=d.seed)
        if d.kind == "tokens":
            _check_token_metadata(d.path, vocab)
        return build_source(d.kind, path=d.path, vocab_size=vocab if d.kind != "text" else None, seed=d.seed)

    def _document_eos(self, d) -> int:
        """The token that ends a document (``data.document_mask``): ``data.eos_id``, else the one
        prepare-data recorded beside the token file (the run's own token cache for text)."""
        if d.eos_id is not None:
            return d.eos_id
        from hpservice.data import read_metadata

        path = self.data.path if hasattr(self.data, "path") else None
        meta = read_metadata(str(path)) if path is not None else None
        if not meta or meta.get("eos_id") is None:
            raise TrainingError(
                f"data.document_mask: {path} records no end-of-text token (not written by hpservice prepare-data?); "
                "set data.eos_id"
            )
        return int(meta["eos_id"])

    # ---- checkpoints --------------------------------------------------------------------------
    def _resume(self, resume_from: str) -> None:
        """Continue exactly where a checkpoint left off: model, optimizer, schedule, RNG, data step."""
        if resume_from == "latest":
            if self.checkpoints.latest_step() is None:  # rank 0's answer, checked on every rank
                log.info(
                    "resume_from: latest, but no checkpoint under %s yet: starting fresh", self.spec.checkpoint.dir
                )
                return
            extra = self.checkpoints.load(self.model_parts, self.optimizer)
            latest = self.checkpoints.latest() if self.rank == 0 else None
            if latest is not None:
                self._resumed = {"step": latest["step"], "metrics": latest["metrics"], "time": latest["time"]}
        else:
            name = resume_from.rstrip("/").rpartition("/")[2]  # a path or a URL: .../step-N
            if step_of(name) is None:
                raise TrainingError(
                    f"checkpoint.resume_from: expected 'latest' or a .../step-N directory, got {resume_from!r}"
                )
            # an input (another run's, or a tenant's files): read-only, confined, no code in it runs
            reader = CheckpointReader(resume_from)
            extra = reader.load(self.model_parts, self.optimizer, group=self.checkpoints.group)
        self.step = extra["step"]
        self.scheduler.load_state_dict(extra["scheduler"])
        torch.set_rng_state(extra["rng"])
        dtensor_random.set_rng_state(extra["dtensor_rng"])

    def save_checkpoint(self, metrics: dict | None = None) -> None:
        extra = {
            "step": self.step,
            "scheduler": self.scheduler.state_dict(),
            "rng": torch.get_rng_state(),
            "dtensor_rng": dtensor_random.get_rng_state(),
            "data": {"seed": self.spec.data.seed, "step": self.step},
            # what the weights are, for exporting the checkpoint without the job spec (hpservice export --format hf)
            "model": {"name": self.model_name, "config": self.model_config_dict},
        }
        if self.rank == 0 and self.text_record is not None:  # what an HF export writes besides weights
            extra["model"]["text"] = self.text_record
        self._report_committed()  # save() waits for the previous async save: it is committed now
        self.checkpoints.save(self.step, self.model_parts, self.optimizer, extra, metrics=metrics)
        self._uncommitted.append({"step": self.step, "metrics": metrics or {}})
        if not self.spec.checkpoint.async_:
            self._report_committed()

    def _report_committed(self) -> None:
        """Tell ``on_checkpoint`` of each newly committed checkpoint, with ``kept``: the steps of
        every checkpoint still on storage (pruning by ``checkpoint.keep`` removed the others)."""
        if self.rank == 0 and self.on_checkpoint is not None and self._uncommitted:
            kept = [c["step"] for c in self.checkpoints.list()]
            for info in self._uncommitted:
                path = f"{self.spec.checkpoint.dir.rstrip('/')}/{step_dir_name(info['step'])}"  # a path or a URL
                self.on_checkpoint({**info, "path": path, "kept": kept})
        self._uncommitted.clear()

    def request_stop(self) -> None:
        """Stop after the step in which every rank has learned of the request (the ranks agree on it
        in that step's loss all-reduce), checkpoint (if configured), and return from train()."""
        self._stop.set()

    # ---- the loop -----------------------------------------------------------------------------
    def train(self) -> list[dict]:
        history = []
        interval = self.spec.checkpoint.interval
        saved_at = None
        try:
            while self.step < self.spec.training.steps and not self._stopping:
                wait_while_held(self.step, self._stop)  # a drill's hold (HPSERVICE_HOLD_FILE); unset: nothing
                record = self.train_step()
                history.append(record)
                if interval and (self.step % interval == 0 or self.step == self.spec.training.steps):
                    self.save_checkpoint({k: record[k] for k in ("loss", "val_loss") if k in record})
                    saved_at = self.step
                if self.rank == 0 and (saved_at == self.step or self.step % STORAGE_EVERY_STEPS == 0):
                    self.storage.check()
            if self._stopping and self.checkpoints is not None and history and saved_at != self.step:
                self.save_checkpoint({"loss": history[-1]["loss"]})
            if self.checkpoints is not None:
                self.checkpoints.wait()
                self._report_committed()
        finally:
            self.close()
        return history

    def train_step(self) -> dict:
        """One optimizer step (inside the profiler's range when ``metrics.profile`` covers it)."""
        if self._profiler is None:
            return self._train_step()
        with self._profiler.step(self.step + 1):
            record = self._train_step()
        if self._profiler.written and not self._profiler_reported:
            self._profiler_reported = True
            if self._log is not None and self.rank == 0:
                self._log(
                    f"[{self.spec.name}] profiler: wrote {', '.join(p.name for p in self._profiler.written)} (rank 0) under {self._profiler.out_dir}"
                )
        return record

    def _train_step(self) -> dict:
        spec = self.spec
        self.utilisation.start_step()
        start = time.perf_counter()
        accum = spec.training.grad_accum
        inputs, targets = self.data.batch(
            self.step, self.dp_rank, self.dp_size, spec.data.global_batch, spec.data.seq_len
        )
        inputs, targets = inputs.to(self.device), targets.to(self.device)
        loss_sum = torch.zeros((), device=self.device)
        if self.pipeline is not None:  # micro-batches through the stages; the loss on the last
            losses: list[torch.Tensor] = []
            self.pipeline.step(inputs, target=targets, losses=losses)
            if losses:
                loss_sum += torch.stack(losses).mean()
        else:
            for micro, (x, y) in enumerate(zip(inputs.chunk(accum), targets.chunk(accum), strict=True)):
                if self.fsdp:
                    self.model.set_requires_gradient_sync(micro == accum - 1)
                with self._attention(x):  # backward too: activation checkpointing recomputes there
                    loss = self._micro_batch_loss(x, y) / accum
                    loss.backward()
                loss_sum += loss.detach()
        loss_value, self._stopping = _step_consensus(loss_sum, self._stop.is_set(), self._loss_holders)
        if not math.isfinite(loss_value):
            self.optimizer.zero_grad()
            if not spec.training.skip_nonfinite:
                raise TrainingError(f"non-finite loss ({loss_value}) at step {self.step + 1}")
            log.warning("step %d: non-finite loss, step skipped", self.step + 1)
        max_norm = spec.training.max_grad_norm or float("inf")
        params = [p for part in self.model_parts for p in part.parameters()]
        grad_norm = clip_grad_norm_(params, max_norm, pp_group=self.pp_mesh.get_group() if self.pp_mesh else None)
        lr = self.scheduler.get_last_lr()[0]
        if math.isfinite(loss_value):
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad()
        self.step += 1
        elapsed = time.perf_counter() - start
        tokens = spec.data.global_batch * spec.data.seq_len
        record = {
            "step": self.step,
            "loss": loss_value,
            "lr": lr,
            "grad_norm": float(grad_norm),
            "tokens_per_s": tokens / elapsed,
            "step_time_s": elapsed,
            "time": time.time(),  # wall clock at the end of the step (step periods, latency)
            **self.utilisation.record(tokens / elapsed / self.world),
        }
        if self._has_moe:
            record.update(self._moe_step())
        interval = spec.eval.interval
        if interval and (self.step % interval == 0 or self.step == spec.training.steps):
            record.update(self.evaluate())
        self._report(record)
        return record

    def _moe_step(self) -> dict:
        """After the optimizer step: the step's expert loads (tokens per expert of each layer,
        summed over the ranks that saw other tokens), the routing biases moved toward balance
        (``bias_update_rate``), and the metrics: ``expert_load`` (layer -> tokens per expert),
        ``expert_imbalance`` (the largest max / mean load of a layer) and ``moe_aux_loss``
        (this rank's), ``moe_dropped`` (with a capacity factor: the (token, expert) pairs dropped,
        over all layers and data ranks). Under pipeline parallelism every stage's layers, gathered
        over the pp ranks (a stage of dense blocks contributes none)."""
        loads = expert_loads(self.moe, reduce=self._sum_over_token_ranks)
        if self._bias_update_rate:
            update_expert_biases(self.moe, loads, self._bias_update_rate)
        aux = mean_aux_loss(self.moe)
        dropped = dropped_pairs(self.moe, reduce=self._sum_over_token_ranks)
        if self.pp_mesh is not None:
            stages = [None] * self.parallel_dims.pp
            dist.all_gather_object(stages, (loads, aux, dropped), group=self.pp_mesh.get_group())
            loads = dict(sorted(((k, v) for stage in stages for k, v in stage[0].items()), key=lambda kv: int(kv[0])))
            auxes, drops = [s[1] for s in stages if s[1] is not None], [s[2] for s in stages if s[2] is not None]
            aux, dropped = (sum(auxes) if auxes else None), (sum(drops) if drops else None)
        record = {"expert_load": loads}
        if loads:
            record["expert_imbalance"] = max(max(row) / max(sum(row) / len(row), 1e-9) for row in loads.values())
        if aux is not None:
            record["moe_aux_loss"] = aux
        if dropped is not None:
            record["moe_dropped"] = dropped
        return record

    def _sum_over_token_ranks(self, t: torch.Tensor) -> None:
        """Sum ``t`` in place over the ranks that see other tokens (data-parallel and context-
        parallel; tensor-parallel ranks see the same ones)."""
        if self.world == 1:
            return
        for name in self.parallel_dims.fsdp_dim_names:
            dist.all_reduce(t, group=self.parallel_dims.world_mesh[name].get_group())

    def _micro_batch_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The mean loss of a micro-batch, ``x, y [B, S]``. Under context parallelism, of this
        rank's part of each sequence (``cp_positions``: a head and a tail chunk), the model told
        the tokens' global positions; every cp rank holds as many tokens, so the mean over ranks
        (the loss reported, the gradients fully_shard averages) is the whole batch's."""
        if self.cp_mesh is None:
            return self._loss(self.model(x), y)
        pos = cp_positions(x.shape[1], self.parallel_dims.cp, self.parallel_dims.cp_rank, device=x.device)
        return self._loss(self.model(x.index_select(1, pos), positions=pos), y.index_select(1, pos))

    @contextlib.contextmanager
    def _attention(self, x: torch.Tensor):
        """Inside: the model's attention as the job asks, for the micro-batch ``x [B, S]``: ring
        attention over the cp ranks, only within documents (``data.document_mask``: document ids
        from the end-of-text tokens of ``x``), both, or plain scaled_dot_product_attention."""
        docs = document_ids_from_eos(x, self.eos_id) if self.eos_id is not None else None
        if self.cp_mesh is not None:
            if docs is not None:
                pos = cp_positions(x.shape[1], self.parallel_dims.cp, self.parallel_dims.cp_rank, device=x.device)
                docs = docs.index_select(1, pos)
            context = context_parallel(self.cp_mesh, rotate=self.spec.parallelism.cp_rotate, document_ids=docs)
        elif docs is not None:
            context = document_masking(docs)
        else:
            yield
            return
        with context as active:
            yield
        if active.calls == 0:  # a model with its own attention would ignore both, without a word
            field = "parallelism.cp" if self.cp_mesh is not None else "data.document_mask"
            raise TrainingError(
                f"{field}: the model's attention never called scaled_dot_product_attention "
                "(torch.nn.functional's or hpservice.parallel.context_parallel's), so it cannot be split or masked"
            )

    @torch.no_grad()
    def evaluate(self) -> dict:
        """The mean loss (and perplexity) on ``eval.steps`` fixed held-out batches, each
        data-parallel rank on its own part of each batch; the same batches every time."""
        e = self.spec.eval
        for part in self.model_parts:
            part.eval()
        total = torch.zeros((), device=self.device)
        try:
            for k in range(e.steps):
                x, y = self.eval_data.batch(k, self.dp_rank, self.dp_size, e.data.global_batch, e.data.seq_len)
                x, y = x.to(self.device), y.to(self.device)
                if self.pipeline is not None:
                    total += self._pipeline_eval_loss(x, y)
                    continue
                with self._attention(x):
                    total += self._micro_batch_loss(x, y)
        finally:
            for part in self.model_parts:
                part.train()
        if self.world > 1:  # each dp rank holds its part's loss (tp ranks the same value): the mean
            dist.all_reduce(total)
            total /= self._loss_holders
        val_loss = float(total) / e.steps
        return {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0))}

    def _pipeline_eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The mean loss of ``x, y`` through the pipeline's forwards (on the last stage; zero on
        the others): its micro-batches' losses weighted by their rows, as the batch need not
        split evenly into them."""
        losses: list[torch.Tensor] = []
        self.pipeline.eval(x, target=y, losses=losses)
        if not losses:
            return torch.zeros((), device=self.device)
        rows = [len(part) for part in torch.tensor_split(x, len(losses))]
        return sum(loss * n for loss, n in zip(losses, rows, strict=True) if n) / x.shape[0]

    @property
    def _loss_holders(self) -> int:
        """Ranks that compute the loss: all of them, or with pipeline parallelism the last stage's."""
        return self.world // self.parallel_dims.pp

    # ---- metrics ------------------------------------------------------------------------------
    def _report_earlier_steps(self, reported_up_to: int) -> None:
        """``on_metrics`` for each step in (``reported_up_to``, the resume step] that this run's
        ``metrics.jsonl`` holds (the first record of a step: a re-trained step's is the same)."""
        path = self.output_dir / "metrics.jsonl"
        if self.step <= reported_up_to or not path.is_file():
            return
        earlier: dict[int, dict] = {}
        with open(path) as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:  # a line cut short by a killed process
                    continue
                step = record.get("step") if isinstance(record, dict) else None
                if isinstance(step, int) and reported_up_to < step <= self.step:
                    earlier.setdefault(step, record)
        for step in sorted(earlier):
            self.on_metrics(earlier[step])

    def _report(self, record: dict) -> None:
        if self.rank != 0:
            self._report_own(record)
            return
        if self.on_metrics is not None:
            self.on_metrics(record)
        for sink in self._sinks:
            sink.log(record)
        every = self.spec.metrics.log_every
        if self._log is not None and (record["step"] % every == 0 or record["step"] == self.spec.training.steps):
            self._log(
                f"[{self.spec.name}] step {record['step']:>5}/{self.spec.training.steps}  loss {record['loss']:.4f}  "
                f"lr {record['lr']:.2e}  grad_norm {record['grad_norm']:.3f}  "
                f"{record['tokens_per_s']:,.0f} tok/s  {record['step_time_s'] * 1000:.0f} ms/step"
                + (f"  mfu {record['mfu']:.1%}" if record.get("mfu") is not None else "")
                + (f"  busiest expert {record['expert_imbalance']:.2f}x mean" if "expert_imbalance" in record else "")
                + (f"  aux {record['moe_aux_loss']:.4f}" if "moe_aux_loss" in record else "")
            )

    def _report_own(self, record: dict) -> None:
        """Ranks other than 0: a line of their own (step time, memory) every ``log_every`` steps,
        where lines are kept per rank (``log_fn``: the service's ``logs --rank N``); never to
        stdout, where torchrun would print it once per rank."""
        every = self.spec.metrics.log_every
        if self._log_fn is None or not (record["step"] % every == 0 or record["step"] == self.spec.training.steps):
            return
        memory = record.get("peak_memory_allocated_gib", record["peak_rss_gib"])
        self._log_fn(
            f"[{self.spec.name}] rank {self.rank} step {record['step']:>5}/{self.spec.training.steps}  "
            f"{record['step_time_s'] * 1000:.0f} ms/step  peak memory {memory:.2f} GiB"
        )

    def close(self) -> None:
        if self._profiler is not None:
            self._profiler.finish()  # a run that ended inside the profiled steps still gets its trace
        if self.checkpoints is not None:
            self.checkpoints.close()
        sinks, self._sinks = self._sinks, []
        for sink in sinks:
            sink.close()
        if self._owns_group:
            dist.destroy_process_group()
            self._owns_group = False
