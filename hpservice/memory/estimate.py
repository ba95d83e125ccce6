"""A job's peak memory per rank, before anything runs: ``estimate(spec, device=...)``.

Per pp rank (the ranks of one stage hold the same; data-, tensor-, context- and expert-parallel
ranks hold the same but for rounding), by component, in bytes:

- **parameters, gradients, optimizer state**: this rank's pieces as the trainer lays them out
  (``_layout``): fully_shard's flat shard of every unit (``C`` padded elements in the parameters'
  dtype) and its gradient buffer of the same size (allocated for frozen parameters too); AdamW's
  two fp32 moments (SGD's momentum) of the trainable parameters' real elements; QLoRA's NF4 base
  at its 4-bit size; with tensor parallelism alone (no fully_shard) each parameter's local piece
  and a gradient per trainable one.
- **fully_shard buffers** kept across steps (``fsdp/_fsdp_param_group.py``): the reduce-scatter
  output (``C``, reduce dtype), the all-gather input when mixed precision casts (``C``); on CPU also
  the all-gather output and the reduce-scatter input (``S x C`` each), which an accelerator frees
  after each use.
- **DPO reference**: the frozen copy (``reference: copy``: a second model sharded like the
  policy, with its own fully_shard buffers) or the starting adapter (``initial_adapter``).
- **gathered parameters and gradients** (held at the peak, backward's start): the root's unsharded
  parameters (gathered at the root's forward, resharded after the whole backward) and the last
  block's (kept after its forward), or every block's with ``reshard_after_forward: false``; a
  pipeline stage holds all its parameters and their gradients unsharded (resharded and reduced
  after its last micro-batch); on an accelerator one unit's all-gather output and reduce-scatter
  input besides.
- **activations and loss**: one micro-batch's forward and backward run on fake tensors through
  this rank's local part (``_activations.trace_step``: saved tensors, logits, the loss's copies,
  recomputation under activation checkpointing, the backward's temporaries, as the code allocates
  them); a pipeline rank keeps the activations of as many micro-batches as its schedule holds at
  once (``parallel.pipelining.simulate``).
- **in host memory (cpu_offload)**: with ``cpu_offload`` on an accelerator, the shards, their
  gradients, the optimizer state and its step live in host memory: reported, not in the device's peak.
- **optimizer step temporaries**: on CPU AdamW steps one parameter at a time (two temporaries
  the size of the largest); on CUDA torch's foreach path (our DTensor is registered for it) holds
  the square roots of every second moment at once (the trainable shards' size, fp32).

The peak is the persistent part plus the larger of the forward/backward part and the optimizer
step's. What is not in it (the assumptions, also in every estimate's ``assumptions``): the
caching allocator's fragmentation and reserve on an accelerator (budget ~5-10%), the CUDA
context and NCCL's own buffers (~0.5-1 GiB per GPU), Python and library memory on CPU, routing
imbalance beyond uniform under expert parallelism (``ep_imbalance``), and ``torch.compile``'s
effects (compiled regions can save less).
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict

from hpservice.sizing import micro_rows

__all__ = ["COMPONENTS", "MAX_BLOCKS", "MemoryEstimate", "RankMemory", "estimate", "too_large_to_estimate"]

MAX_BLOCKS = 512
"""Blocks the estimate lays out on the meta device (the deepest real models have about 130): a
spec with more (admissible by the size floor when its blocks are tiny) would cost the server a
build of every one at submit, so it is not estimated."""


def too_large_to_estimate(spec) -> str | None:
    """Why ``spec``'s model is not estimated (more than ``MAX_BLOCKS`` blocks, from its config
    alone: nothing built), or None."""
    from hpservice.preflight import known_config

    cfg = known_config(spec)
    blocks = getattr(cfg, "n_layers", None)
    if isinstance(blocks, int) and blocks > MAX_BLOCKS:
        return f"the model has {blocks} blocks, more than the {MAX_BLOCKS} the memory planner lays out"
    return None

PERSISTENT = ("parameters", "gradients", "optimizer state", "fully_shard buffers", "DPO reference")
TRANSIENT = ("gathered parameters and gradients", "activations and loss", "optimizer step temporaries")
HOST = "in host memory (cpu_offload)"  # reported, not on the device
COMPONENTS = PERSISTENT + TRANSIENT + (HOST,)

_DTYPE_BYTES = {"none": 4, "bf16": 2, "fp16": 2}


@dataclasses.dataclass
class RankMemory:
    """One pp rank's estimate (every rank when there is no pipeline)."""

    ranks: str  # which ranks: "every rank", "pp rank 0 (stages 0, 2)"
    components: dict[str, int]  # bytes, COMPONENTS' names
    phase: str = ""  # where the peak is: "forward and backward" or "optimizer step"
    # fully_shard's gradient buffers stay; plain (tensor-parallel only) gradients exist from the
    # backward to the optimizer step, when the activations are gone
    flat_gradients: bool = True

    def _parts(self) -> tuple[int, int, int]:
        c = self.components
        grads = c.get("gradients", 0)
        persistent = sum(c.get(k, 0) for k in PERSISTENT) - (0 if self.flat_gradients else grads)
        step = c.get("gathered parameters and gradients", 0) + c.get("activations and loss", 0)
        optimizer = c.get("optimizer step temporaries", 0) + (0 if self.flat_gradients else grads)
        return persistent, step, optimizer

    @property
    def peak(self) -> int:
        persistent, step, optimizer = self._parts()
        return persistent + max(step, optimizer)

    def __post_init__(self) -> None:
        _, step, optimizer = self._parts()
        self.phase = self.phase or ("forward and backward" if step >= optimizer else "optimizer step")


@dataclasses.dataclass
class MemoryEstimate:
    device: str  # "cuda" or "cpu": what the ranks run on
    ranks: list[RankMemory]
    assumptions: list[str]
    micro_batch: int  # rows per rank per micro-batch
    traced: bool  # activations from the fake-tensor run (else the formula)

    @property
    def peak(self) -> int:
        return max(r.peak for r in self.ranks)

    @property
    def worst(self) -> RankMemory:
        return max(self.ranks, key=lambda r: r.peak)

    def record(self) -> dict:
        """What the job's record and the page show (GiB)."""
        return {
            "device": self.device,
            "peak_gib": round(self.peak / 2**30, 4),
            "micro_batch": self.micro_batch,
            "ranks": [
                {"ranks": r.ranks, "peak_gib": round(r.peak / 2**30, 4), "phase": r.phase,
                 "components_gib": {k: round(v / 2**30, 4) for k, v in r.components.items() if v}}
                for r in self.ranks
            ],
            "assumptions": self.assumptions,
        }

    def breakdown(self, indent: str = "  ") -> str:
        lines = []
        for r in self.ranks:
            lines.append(f"{indent}{r.ranks}: {gib(r.peak)} at its peak ({r.phase})")
            lines += [f"{indent}  {k:<36}{gib(v):>12}" for k, v in r.components.items() if v]
        return "\n".join(lines)


def gib(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB" if n >= 2**28 else f"{n / 2**20:,.1f} MiB"


def _pipeline_held(spec) -> dict[int, int]:
    """The most micro-batches each pp rank holds activations of at once (its schedule simulated)."""
    from hpservice.parallel.pipelining import compute_order, simulate, with_communication

    p = spec.parallelism
    m = p.microbatches(spec.training.grad_accum)
    timeline = simulate(with_communication(compute_order(p.pp_schedule, p.pp, m, p.pp_virtual_stages), p.pp), p.pp)
    return dict(timeline.peak_activations)


def estimate(spec, *, device: str = "cuda") -> MemoryEstimate:
    """The per-rank estimate of ``spec`` running on ``device`` ranks (module doc). Builds the model
    on the meta device (a factory's too), so it needs what ``build_meta_model`` needs: for
    ``init_from``, its config.json."""
    import torch

    from hpservice.parallel_dims import ParallelDims

    from ._activations import formula_bytes

    if (why := too_large_to_estimate(spec)) is not None:
        raise ValueError(why)

    p, t = spec.parallelism, spec.training
    dims = ParallelDims.from_spec(p, spec.resources.workers)
    fsdp = bool(dims.fsdp_dim_names)
    shard_ranks = dims.dp_shard * dims.cp if fsdp else 1
    param_b = _DTYPE_BYTES[p.mixed_precision]
    reduce_b = 4
    lora = spec.model.lora
    nf4 = lora is not None and lora.quantize_base == "nf4"
    rows, seq = micro_rows(spec), math.ceil(spec.data.seq_len / p.cp)
    held = _pipeline_held(spec) if p.pp > 1 else {0: 1}
    last_stage = p.pp * p.pp_virtual_stages - 1
    opt_state = {"adamw": 8, "sgd": 4 if spec.optimizer.momentum else 0}[spec.optimizer.name]
    untraced = None  # why the activations came from the formula
    # fake CUDA tensors need a CUDA build; CPU kernels save the same tensors (flash attention: the
    # output and its log-sum-exp)
    trace_device = "cuda" if device == "cuda" and torch.cuda.is_available() else "cpu"
    ranks = []
    for pp_rank in range(p.pp):
        c = dict.fromkeys(COMPONENTS, 0)
        units = []
        saved_per_micro = peak_one = 0
        facts = _stage_facts(spec, pp_rank, shard_ranks, nf4, seq, trace_device)
        for stage, part_units, per_row in facts:
            units += part_units
            if isinstance(per_row, str):
                untraced = per_row
                cfg, blocks = _stage_config(spec, pp_rank, stage)
                vocab = math.ceil(cfg.vocab_size / p.tp) if stage == last_stage else None
                saved, peak = formula_bytes(cfg, rows * seq, blocks, p.tp, param_b, t.activation_checkpointing != "none", vocab)
            else:  # what one micro-batch saves grows with its rows: traced for one
                saved, peak = rows * per_row[0], rows * per_row[1]
            saved_per_micro += saved
            peak_one = max(peak_one, peak)
        trainable = sum(u.trainable for u in units)
        if fsdp:
            c["parameters"] = sum(u.shard for u in units) * 4 + sum(u.nf4_bytes for u in units)
            c["gradients"] = sum(u.shard for u in units if u.shard) * 4
            scratch = sum(u.shard * reduce_b + (u.shard * param_b if param_b != 4 or p.cpu_offload else 0) for u in units)
            if device == "cpu":
                scratch += sum(u.unsharded * (param_b + reduce_b) for u in units)
            c["fully_shard buffers"] = scratch
        else:
            c["parameters"] = sum(u.real for u in units) * 4
            c["gradients"] = trainable * 4
        c["optimizer state"] = trainable * opt_state
        if spec.objective.kind == "dpo":
            ref = spec.objective.reference
            if ref == "copy" or (ref == "auto" and lora is None):
                c["DPO reference"] = c["parameters"] + c["fully_shard buffers"] + c["gradients"]
            elif ref == "initial_adapter":
                c["DPO reference"] = trainable * 4
        # held during forward and backward
        block_units = [u for u in units if u.name != "root"]
        root = next((u for u in units if u.name == "root"), None)
        gathered = grads_kept = 0
        if fsdp:
            # at the peak (backward's start): the root, and the last block (kept after its forward),
            # or every block where none is resharded (a pipeline stage reshards after its last
            # micro-batch); the gradients come as activations go
            blocks_held = (
                sum(u.unsharded for u in block_units)
                if (p.pp > 1 or not p.reshard_after_forward)
                else max((u.unsharded for u in block_units), default=0)
            )
            gathered = ((root.unsharded if root else 0) + blocks_held) * param_b
            if device != "cpu":  # one unit's all-gather output and reduce-scatter input at a time
                gathered += max((u.unsharded for u in units), default=0) * (param_b + reduce_b)
        # unreduced gradients kept between micro-batches (fully_shard reduces each micro-batch's at
        # once with sync_every_micro_batch; plain tensor-parallel gradients accumulate in place)
        if p.pp > 1 or (t.grad_accum > 1 and not (fsdp and p.sync_every_micro_batch)):
            grads_kept = sum(u.trainable_whole for u in units) * (param_b if fsdp else 4)
        in_flight = held.get(pp_rank, 1)
        micro = p.microbatches(t.grad_accum) if p.pp > 1 else t.grad_accum
        activations = (in_flight - 1) * saved_per_micro + peak_one
        if grads_kept and micro > in_flight:  # a micro-batch's backward runs after another's gradients exist
            gathered += grads_kept
        elif grads_kept and in_flight > 1 and grads_kept > saved_per_micro:  # after the first backward, one fewer held
            gathered += grads_kept
            activations -= saved_per_micro
        c["gathered parameters and gradients"] = gathered
        c["activations and loss"] = activations
        largest_trainable = max((u.largest_trainable for u in units), default=0)
        # torch's optimizers run foreach (every parameter's temporary at once: AdamW's square roots of
        # the second moments) on CUDA, where our DTensor is registered for it; one at a time on CPU
        c["optimizer step temporaries"] = (trainable * 4 if device == "cuda" else 2 * largest_trainable * 4) if opt_state else 0
        if p.cpu_offload and fsdp and device != "cpu":  # the shards, their gradients and the optimizer live in host memory
            offloaded = ("parameters", "gradients", "optimizer state", "optimizer step temporaries")
            c[HOST] = sum(c[k] for k in offloaded)
            for k in offloaded:
                c[k] = 0
        label = "every rank" if p.pp == 1 else f"pp rank {pp_rank} (stage{'s' if len(facts) > 1 else ''} {', '.join(str(f[0]) for f in facts)})"
        ranks.append(RankMemory(label, c, flat_gradients=fsdp))
    return MemoryEstimate(device, ranks, _assumptions(spec, device, untraced), micro_rows(spec), untraced is None)


_CACHE: OrderedDict[tuple, object] = OrderedDict()  # meta models, layouts, traces: least recently used go
_CACHE_SIZE = 4096
_MODELS: OrderedDict[tuple, object] = OrderedDict()
_MODELS_SIZE = 16


class _Failed:
    def __init__(self, error: Exception):
        self.error = error


def _cached(key: tuple, build):
    """``build()``, once per ``key``; a build that raised raises the same again (a layout the
    model refuses is refused for every candidate that shares it, without building it again).
    Models (``meta``, ``parts``: module trees) are kept fewer than the small facts."""
    cache, size = (_MODELS, _MODELS_SIZE) if key[0] in ("meta", "parts") else (_CACHE, _CACHE_SIZE)
    if key in cache:
        cache.move_to_end(key)
    else:
        try:
            cache[key] = build()
        except Exception as e:  # kept to raise again
            cache[key] = _Failed(e)
        while len(cache) > size:
            cache.popitem(last=False)
    value = cache[key]
    if isinstance(value, _Failed):
        raise value.error
    return value


def _model_key(spec) -> tuple:
    """What the meta model depends on: the model section, the frozen patterns, the sequence length
    (a sliding window that covers it is dropped), whether cp needs positions."""
    return (spec.model.model_dump_json(), tuple(spec.training.freeze), spec.data.seq_len, spec.parallelism.cp > 1)


def meta_model_of(spec) -> tuple:
    """The trainer's whole meta model of ``spec`` (``_layout.meta_model``: bundle, model, frozen
    names), built once per model and kept with the estimates' other facts; not to be changed."""
    from ._layout import meta_model

    return _cached(("meta", *_model_key(spec)), lambda: meta_model(spec))


def _layout_key(spec, pp_rank: int) -> tuple:
    """What one pp rank's narrowed parts depend on: the model and the tp, pp and ep layout."""
    p = spec.parallelism
    return (*_model_key(spec), p.tp, p.sequence_parallel, p.pp, p.pp_virtual_stages, tuple(p.pp_layers_per_stage or ()), p.ep, pp_rank)


def _stage_facts(spec, pp_rank: int, shard_ranks: int, nf4: bool, seq: int, trace_device: str) -> list:
    """``(stage, fully_shard units, per-row (saved, peak) or why not traced)`` of each of the pp
    rank's stages. The meta model, each layout's units and each trace are cached apart: the
    estimates of one job's many layouts (``parallelism: auto``) share most of them."""
    from ._activations import trace_blocks
    from ._layout import fsdp_units, rank_parts

    p, t = spec.parallelism, spec.training
    layout = _layout_key(spec, pp_rank)
    trace = (t.activation_checkpointing, t.selective_every, p.mixed_precision, seq, trace_device)
    units_key, trace_key = ("units", *layout, shard_ranks, nf4), ("trace", *layout, *trace)
    last_stage = p.pp * p.pp_virtual_stages - 1

    def parts():
        return _cached(("parts", *layout), lambda: rank_parts(spec, pp_rank, meta_model_of(spec)))

    def build_units() -> list:
        _, stages, frozen = parts()
        return [fsdp_units(part, frozen, shard_ranks, p.ep, nf4) for _, part in stages]

    def build_traces() -> list:
        _, stages, frozen = parts()
        return [
            (stage, trace_blocks(part, spec, frozen, first=stage == 0, last=stage == last_stage, rows=1, seq=seq,
                                 dim=part.cfg.dim if hasattr(part, "cfg") else 0, device=trace_device))
            for stage, part in stages
        ]  # fmt: skip

    units, traces = _cached(units_key, build_units), _cached(trace_key, build_traces)
    return [(stage, u, traced) for u, (stage, traced) in zip(units, traces, strict=True)]


def _stage_config(spec, pp_rank: int, stage: int):
    """(config, blocks) of one stage, for the formula: from the layout ``_stage_facts`` cached."""
    from ._layout import rank_parts

    _, stages, _ = _cached(("parts", *_layout_key(spec, pp_rank)), lambda: rank_parts(spec, pp_rank, meta_model_of(spec)))
    part = dict(stages)[stage]
    return part.cfg, len(getattr(part, "layers", []) or [])


def _assumptions(spec, device: str, untraced: str | None) -> list[str]:
    out = [
        "tensor memory only: "
        + (
            "add the CUDA context, NCCL's buffers and the caching allocator's reserve (about 1 GiB and 5-10%)"
            if device == "cuda"
            else "Python, the libraries and the allocator's slack come on top"
        ),
        "activations from one micro-batch run on fake tensors through this rank's part"
        if untraced is None
        else f"activations by formula: the model did not run on fake tensors ({untraced})",
    ]
    p = spec.parallelism
    if p.ep > 1:
        out.append("expert parallelism: routing as uniform; a skewed router sends more tokens to the busiest rank")
    if p.cp > 1:
        out.append("context parallelism: attention as on the rank's own sequence part; ring buffers not counted")
    if spec.training.compile:
        out.append("torch.compile: estimated as eager (compiled regions usually save less)")
    if p.cpu_offload:
        out.append("cpu_offload: the shards, their gradients and the optimizer state are in host memory, not in the peak")
    return out
