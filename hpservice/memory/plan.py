"""Where a job is handed over: does it fit its devices, and ``parallelism: auto``.

- ``check_fit(spec, device_memory, device)``: the estimate (``estimate.py``) against the device's
  memory. A job over it gets a ``SpecError`` with the breakdown of its fullest rank and the nearest
  layouts that fit (one change each: more tensor or pipeline parallelism, activation
  checkpointing, a smaller micro-batch, mixed precision), fastest first.
- ``choose_layout(spec, device_memory, device)``: ``parallelism: auto``. Every layout of the
  job's workers (dp_shard, dp_replicate, tp, pp, cp, ep, the micro-batch through
  ``training.grad_accum``, activation checkpointing) that the spec's explicit fields allow and
  ``preflight.check_layout`` accepts is timed by the cost model (``step_seconds``); in that order
  each is estimated until two fit: the chosen one and the runner-up. None fitting is a
  ``SpecError`` naming the closest rejected layouts and why each was rejected.

The cost model of one step on one rank, in seconds::

    compute / (1 - bubble)  +  exposed communication  +  micro-batches x blocks x overhead

``compute`` is the family's training FLOPs per token (``ModelSpec.flops_per_token``, else 6 N)
times the rank's share of the step's tokens (the global batch over every rank: data, tensor and
context parallelism divide it alike), times 4/3 under full activation checkpointing (one forward
again), over the device's sustained FLOP rate. ``bubble`` is the pipeline schedule's, simulated.
Communication is the bytes each rank sends per step (ring algorithms, as ``bench plan`` counts
them: fully_shard's all-gathers per micro-batch and its reduce-scatter, HSDP's all-reduce, tensor
parallelism's four all-reduces per block and micro-batch, context parallelism's key/value
exchange, the pipeline's activations, expert parallelism's all-to-all) at the link they cross
(inside a node or across nodes); on an accelerator fully_shard's overlap with compute hides all
but ``fsdp_exposed`` of it; every message pays the link's latency. The overhead is per block and
micro-batch (launches, hooks, Python; more where the block's ops go through DTensor or ring
attention). ``DeviceProfile`` holds the rates: defaults per device kind, or measured ones
(``python -m hpservice.bench memory --auto`` measures this machine's from a few training steps).
"""

from __future__ import annotations

import dataclasses
import itertools
import math

from hpservice.spec import JobSpec, ParallelismSpec, SpecError, TrainingSpec

from .estimate import MemoryEstimate, gib

__all__ = ["GPU_MEMORY", "DeviceProfile", "Fit", "check_fit", "choose_layout", "gpu_memory", "layout_label", "step_seconds"]

GPU_MEMORY = {  # Ray's accelerator_type -> bytes per GPU (the smaller where a type comes in two sizes)
    "H200": 141 << 30, "H100": 80 << 30, "H800": 80 << 30, "A100": 40 << 30, "A100-80G": 80 << 30,
    "A800": 80 << 30, "L40S": 48 << 30, "L40": 48 << 30, "A40": 48 << 30, "A10G": 24 << 30, "L4": 24 << 30,
    "V100": 16 << 30, "T4": 16 << 30, "B200": 180 << 30, "GH200": 96 << 30,
}  # fmt: skip


def gpu_memory(resources: dict) -> int | None:
    """A Ray node's GPU memory from its ``accelerator_type:<X>`` resource, None if unknown."""
    for key in resources:
        if key.startswith("accelerator_type:"):
            return GPU_MEMORY.get(key.split(":", 1)[1])
    return None


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """Sustained rates of one device and its links (per device)."""

    flops: float  # FLOP/s a training step sustains in the compute dtype
    intra_gbs: float  # GB/s a device sends inside a node
    inter_gbs: float  # GB/s a device sends across nodes
    devices_per_node: int
    block_overhead_s: float  # per block, forward and backward, per micro-batch: launches, hooks, Python
    fsdp_exposed: float  # share of fully_shard's communication that compute does not hide
    latency_s: float  # per collective (or point-to-point message)
    sharded_overhead: float  # the block overhead's multiple when its ops are DTensor ops (tp) or ring attention (cp)
    host_gbs: float = 20.0  # GB/s between the device and host memory (cpu_offload)
    host_flops: float = 2e10  # FLOP/s of the host's optimizer step (cpu_offload)

    @classmethod
    def default(cls, device: str, mixed_precision: str = "bf16") -> DeviceProfile:
        if device == "cuda":  # an H100 at ~40% of its dense peak; NVLink and 400 Gb/s InfiniBand
            return cls(400e12 if mixed_precision != "none" else 50e12, 300.0, 40.0, 8, 1e-4, 0.2, 3e-5, 1.5)
        return cls(2e10, 1.0, 1.0, 1 << 16, 2e-3, 1.0, 2e-4, 3.0)  # one CPU core, gloo on loopback


@dataclasses.dataclass
class Fit:
    spec: JobSpec
    seconds: float  # estimated step time
    estimate: MemoryEstimate | None = None

    @property
    def label(self) -> str:
        return layout_label(self.spec)


# ---- the layout's name ---------------------------------------------------------------------------


def layout_label(spec: JobSpec) -> str:
    from hpservice.parallel_dims import ParallelDims

    p, t = spec.parallelism, spec.training
    dims = ParallelDims.from_spec(p, spec.resources.workers)
    parts = [f"dp_shard {dims.dp_shard}"]
    for name, value in (("dp_replicate", dims.dp_replicate), ("tp", p.tp), ("pp", p.pp), ("cp", p.cp), ("ep", p.ep)):
        if value > 1:
            parts.append(f"{name} {value}")
    from .estimate import micro_rows

    parts.append(f"micro_batch {micro_rows(spec)}")
    parts.append(f"activation_checkpointing {t.activation_checkpointing}")
    if p.sync_every_micro_batch and t.grad_accum > 1:
        parts.append("sync_every_micro_batch")
    return ", ".join(parts)


# ---- the cost model ------------------------------------------------------------------------------


def ring_bytes(kind: str, n: int, nbytes: float) -> float:
    """Bytes one rank sends in a ring ``kind`` over ``n`` ranks whose full result is ``nbytes``:
    all-gather and reduce-scatter ``(n-1)/n`` of it, all-reduce twice that."""
    if n <= 1:
        return 0.0
    return nbytes * (n - 1) / n * (2 if kind == "all_reduce" else 1)


def step_seconds(spec: JobSpec, cfg, params: int, profile: DeviceProfile, flops_per_token=None) -> float:
    """The cost model's step time (module doc). ``cfg``: the model's config (None: a factory, whose
    communication is counted from ``params`` alone); ``params``: its parameter count."""
    from hpservice.parallel_dims import ParallelDims

    p, t = spec.parallelism, spec.training
    world = spec.resources.workers
    dims = ParallelDims.from_spec(p, world)
    seq = spec.data.seq_len
    rows = spec.data.global_batch * (2 if spec.objective.kind == "dpo" else 1)
    per_token = flops_per_token(cfg, seq) if (flops_per_token and cfg is not None) else 6 * params
    recompute = {"none": 1.0, "selective": 1.1, "full": 4 / 3}[t.activation_checkpointing]
    compute = per_token * rows * seq / world * recompute / profile.flops
    bubble = 0.0
    micro = t.grad_accum
    if p.pp > 1:
        from hpservice.parallel.pipelining import compute_order, simulate, with_communication

        micro = p.microbatches(t.grad_accum)
        bubble = simulate(with_communication(compute_order(p.pp_schedule, p.pp, micro, p.pp_virtual_stages), p.pp), p.pp).bubble
    act_b = 2 if p.mixed_precision != "none" else 4
    dim = cfg.dim if cfg is not None else int(math.sqrt(params / 12))
    layers = cfg.n_layers if cfg is not None else 1
    tokens_micro = rows * seq // (dims.dp_size * micro * p.cp)  # one rank's micro-batch
    stage_params = params / (p.pp * p.tp)

    def link(ranks_spanned: int) -> float:
        return (profile.intra_gbs if ranks_spanned <= profile.devices_per_node else profile.inter_gbs) * 1e9

    shard = dims.dp_shard * p.cp
    span = shard * p.tp
    # gathered in each micro-batch's forward and again in its backward (once, without resharding
    # after forward); a pipeline stage stays gathered from its first micro-batch to its last
    gathers = 1 if p.pp > 1 else micro * (2 if p.reshard_after_forward else 1)
    ag = ring_bytes("all_gather", shard, stage_params * act_b) * gathers
    rs = ring_bytes("reduce_scatter", shard, stage_params * 4) * (micro if p.sync_every_micro_batch and p.pp == 1 else 1)
    fsdp = (ag + rs) / link(span)
    hsdp = ring_bytes("all_reduce", dims.dp_replicate, stage_params * 4 / max(shard, 1)) / link(world // p.pp)
    block_layers = layers / p.pp
    tp = ring_bytes("all_reduce", p.tp, 4 * block_layers * tokens_micro * dim * act_b) * micro / link(p.tp)
    kv = 2 * getattr(cfg, "n_kv_heads", getattr(cfg, "n_heads", 1)) * getattr(cfg, "head_dim", dim) if cfg is not None else dim
    cp = 3 * block_layers * ring_bytes("all_gather", p.cp, tokens_micro * p.cp * kv * act_b / p.tp) * micro / link(p.cp * p.tp)
    pp = 2 * tokens_micro * dim * act_b * micro * 2 / link(world // p.pp + 1) if p.pp > 1 else 0.0
    ep = 0.0
    if p.ep > 1 and cfg is not None and getattr(cfg, "num_experts", 0):
        sparse = cfg.sparse_layers() if hasattr(cfg, "sparse_layers") else layers
        ep = 4 * sparse / p.pp * tokens_micro * cfg.experts_per_token * dim * act_b * (p.ep - 1) / p.ep * micro / link(p.ep * p.tp)
    offload = 0.0
    if p.cpu_offload:  # shards copied in for each all-gather, gradients out, the optimizer stepped on the host
        shard_bytes = stage_params / max(shard, 1) * 4
        offload = shard_bytes * (2 * micro + 1) / (profile.host_gbs * 1e9) + stage_params / max(shard, 1) * 20 / profile.host_flops
    # messages, each paying the link's latency: fully_shard's per unit, tp's four per block, cp's
    # ring steps, the pipeline's sends, the all-to-alls
    units = block_layers + 1
    messages = (units * (gathers + (micro if p.sync_every_micro_batch else 1)) if shard > 1 else 0)
    messages += units if dims.dp_replicate > 1 else 0
    messages += micro * (4 * block_layers + 4) if p.tp > 1 else 0
    messages += micro * 3 * block_layers * (p.cp - 1)
    messages += 2 * micro if p.pp > 1 else 0
    messages += 4 * micro * block_layers if p.ep > 1 else 0
    exposed = fsdp * profile.fsdp_exposed + hsdp + tp + cp + pp + ep + offload + messages * profile.latency_s
    sharded = profile.sharded_overhead if (p.tp > 1 or p.cp > 1) else 1.0
    overhead = micro * block_layers * recompute * profile.block_overhead_s * sharded
    return compute / (1 - bubble) + exposed + overhead


# ---- fitting ------------------------------------------------------------------------------------


def _model_facts(spec: JobSpec):
    """(config or None, parameter count, flops_per_token or None) of the job's model: the meta
    model the estimates build (and cache), not a second build."""
    from .estimate import meta_model_of

    bundle, whole, _ = meta_model_of(spec)
    params = sum(p.numel() for p in whole.parameters())
    return getattr(whole, "cfg", None), params, bundle.flops_per_token


def _estimate(spec: JobSpec, device: str) -> MemoryEstimate | str:
    from .estimate import estimate

    try:
        return estimate(spec, device=device)
    except (ValueError, NotImplementedError, SpecError) as e:  # a layout the model cannot take
        return str(e).splitlines()[0]
    except Exception as e:  # the trainer's own refusals (TrainingError) and the like
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def _over(spec: JobSpec, est: MemoryEstimate, device_memory: int, source: str = "resources.device_memory") -> str:
    r = est.worst
    top = sorted(((k, v) for k, v in r.components.items() if v), key=lambda kv: -kv[1])[:3]
    return (
        f"needs {gib(r.peak)} on {r.ranks}, more than the {gib(device_memory)} of {source} "
        f"(most: {', '.join(f'{k} {gib(v)}' for k, v in top)})"
    )


def check_fit(
    spec: JobSpec, device_memory: int | None, device: str, profile: DeviceProfile | None = None,
    source: str = "resources.device_memory",
) -> MemoryEstimate | None:  # fmt: skip
    """The job's estimate (None where the model cannot be estimated here: its error is the
    preflight's to report); a ``SpecError`` with the breakdown and the nearest layouts that fit
    when it exceeds ``device_memory`` (``source``: where that figure came from)."""
    est = _estimate(spec, device)
    if isinstance(est, str):
        return None
    if device_memory is None or est.peak <= device_memory:
        return est
    suggestions = nearest_fits(spec, device_memory, device, profile)
    if not suggestions:  # no one change: the fastest whole layouts that fit, on more workers if need be
        import time

        deadline = time.monotonic() + SUGGEST_BUDGET_S
        workers = spec.resources.workers
        # the job's own workers first, offloading where there is host memory to offload to, then more workers
        offloads = (False, True) if device == "cuda" else (False,)
        tries = [(factor, offload) for factor in (1, 2, 4) for offload in offloads]
        for factor, offload in tries:
            left = deadline - time.monotonic()
            if left <= 0 or workers * factor > MAX_SUGGESTED_WORKERS:
                break
            free = _unconstrained(spec, workers * factor, offload)
            fits, _ = _search(free, device_memory, device, profile, want=3 if factor == 1 else 1, budget_s=left)
            more = (f"resources.workers {workers * factor}, " if factor > 1 else "") + ("cpu_offload, " if offload else "")
            suggestions = [(f"{more}{f.label} ({gib(f.estimate.peak)} per rank)", f.seconds) for f in fits]
            if suggestions:
                break
    offer = (
        "; it fits with " + ", or ".join(s for s, _ in suggestions)
        if suggestions
        else f"; nothing fits it on up to {4 * spec.resources.workers} workers: a shorter data.seq_len or a smaller model"
    )
    message = _over(spec, est, device_memory, source) + offer
    field = source if source.startswith("resources.") else "resources.device_memory"
    raise SpecError(f"job spec: does not fit its devices\n  {field}: {message}\n{est.breakdown('    ')}", [(field, message)])


# what a layout search keeps of the job's parallelism: not layout but how it computes
_KEPT = ("mixed_precision", "cpu_offload", "pp_schedule", "reshard_after_forward", "sequence_parallel", "cp_rotate")
SUGGEST_BUDGET_S = 15.0  # seconds the suggestions of a job that does not fit may take
MAX_SUGGESTED_WORKERS = 1024


def _unconstrained(spec: JobSpec, workers: int, offload: bool = False) -> JobSpec:
    """``spec`` on ``workers`` workers with every layout field free (auto, nothing set beside it),
    with ``offload``: its shards, gradients and optimizer state offloaded to host memory."""
    kept = {k: getattr(spec.parallelism, k) for k in _KEPT} | ({"cpu_offload": True} if offload else {})
    return spec.model_copy(update={
        "parallelism": ParallelismSpec.model_validate({"auto": True, **kept}),
        "training": TrainingSpec.model_validate(spec.training.model_dump(exclude={"grad_accum", "activation_checkpointing"})),
        "resources": spec.resources.model_copy(update={"workers": workers, "min_workers": None}),
    })  # fmt: skip


def _variant(spec: JobSpec, parallelism: dict | None = None, training: dict | None = None) -> JobSpec | None:
    try:
        return JobSpec.model_validate(
            {
                **spec.model_dump(by_alias=True),
                "parallelism": {**spec.parallelism.model_dump(), **(parallelism or {})},
                "training": {**spec.training.model_dump(), **(training or {})},
            }
        )
    except (ValueError, SpecError):
        return None


def _valid(spec: JobSpec) -> str | None:
    from hpservice.preflight import check_composition, check_layout

    errors = check_layout(spec) + check_composition(spec)
    return f"{errors[0][0]}: {errors[0][1]}" if errors else None


def nearest_fits(spec: JobSpec, device_memory: int, device: str, profile: DeviceProfile | None = None, most: int = 3) -> list[tuple[str, float]]:
    """One-change layouts of ``spec`` that fit, fastest first: ``(what to set, seconds)``."""
    p, t = spec.parallelism, spec.training
    changes: list[tuple[str, dict, dict]] = []
    world = spec.resources.workers
    for tp in (2, 4, 8):
        if tp > p.tp and world % (tp * p.pp * p.cp) == 0:
            changes.append((f"tp {tp}", {"tp": tp, "dp_shard": -1}, {}))
    for pp in (2, 4, 8):
        if pp > p.pp and world % (pp * p.tp * p.cp) == 0:
            changes.append((f"pp {pp}", {"pp": pp, "dp_shard": -1}, {}))
    for ac in ("selective", "full"):
        if ac != t.activation_checkpointing and not (ac == "selective" and t.activation_checkpointing == "full"):
            changes.append((f"activation_checkpointing: {ac}", {}, {"activation_checkpointing": ac}))
    for accum in (2, 4, 8, 16):
        changes.append((f"grad_accum {t.grad_accum * accum}", {}, {"grad_accum": t.grad_accum * accum}))
    if t.grad_accum > 1 and not p.sync_every_micro_batch and p.pp == 1:
        changes.append(("sync_every_micro_batch: true", {"sync_every_micro_batch": True}, {}))
    if p.mixed_precision == "none":
        changes.append(("mixed_precision: bf16", {"mixed_precision": "bf16"}, {}))
    if not p.cpu_offload and device == "cuda":
        changes.append(("cpu_offload: true", {"cpu_offload": True}, {}))
    cfg, params, fpt = _model_facts(spec)
    profile = profile or DeviceProfile.default(device, p.mixed_precision)
    fits: list[tuple[str, float]] = []
    tried: set[str] = set()
    for what, par, tr in changes:
        if "grad_accum" in what and any(f.startswith("grad_accum") for f, _ in fits):
            continue  # the smallest accumulation that fits is the one to offer
        candidate = _variant(spec, par, tr)
        if candidate is None or _valid(candidate) is not None:
            continue
        label = layout_label(candidate)
        if label in tried:
            continue
        tried.add(label)
        est = _estimate(candidate, device)
        if isinstance(est, MemoryEstimate) and est.peak <= device_memory:
            what = f"{what} ({gib(est.peak)} per rank)"
            if what.startswith("grad_accum"):
                what = f"micro_batch {est.micro_batch} ({what})"
            fits.append((what, step_seconds(candidate, cfg, params, profile, fpt)))
    fits.sort(key=lambda f: f[1])
    return fits[:most]


def _powers(n: int, cap: int) -> list[int]:
    """The powers of two up to ``cap`` that divide ``n``."""
    out, d = [], 1
    while d <= min(n, cap) and n % d == 0:
        out.append(d)
        d *= 2
    return out


def candidates(spec: JobSpec, cfg, devices_per_node: int = 8) -> list[JobSpec]:
    """Every layout of the job's workers the explicit fields allow (module doc), unchecked: powers
    of two of tp, pp, cp, ep and the micro-batch count; dp_replicate 1, all the data ranks, or a
    node's worth of shards per group."""
    p, t = spec.parallelism, spec.training
    base = p.model_dump()
    fixed_p = p.model_fields_set - {"auto"}
    fixed_t = t.model_fields_set
    world = spec.resources.workers
    heads = getattr(cfg, "n_kv_heads", None) or getattr(cfg, "n_heads", None)
    layers = getattr(cfg, "n_layers", 1)
    experts = getattr(cfg, "num_experts", 0) or 0

    def choices(name: str, values):
        return [getattr(p, name)] if name in fixed_p else list(values)

    tps = choices("tp", [d for d in _powers(world, 8) if heads is None or heads % d == 0] if cfg is not None else [1])
    pps = choices("pp", [d for d in _powers(world, 8) if d <= layers] if cfg is not None else [1])
    cps = choices("cp", [d for d in _powers(world, 4) if spec.data.seq_len % (2 * d) == 0] if cfg is not None else [1])
    acs = [t.activation_checkpointing] if "activation_checkpointing" in fixed_t else ["none", "selective", "full"]
    out = []
    for tp, pp, cp in itertools.product(tps, pps, cps):
        if world % (tp * pp * cp):
            continue
        data = world // (tp * pp * cp)
        # fully_shard over all the data ranks, plain replicas, or HSDP with a node's worth in each shard group
        node_shard = max(1, devices_per_node // (tp * cp))
        replicates = choices("dp_replicate", sorted({1, data} | ({data // node_shard} if data % node_shard == 0 else set())))
        for replicate in replicates:
            if data % replicate:
                continue
            shard = data // replicate
            if "dp_shard" in fixed_p and p.dp_shard not in (-1, shard):
                continue
            eps = choices("ep", [e for e in _powers(shard, shard) if experts % e == 0] if experts else [1])
            for ep in eps:
                dp = data
                batch = spec.data.global_batch
                micro_counts = _powers(batch // dp, 32) if batch % dp == 0 else []
                if "grad_accum" in fixed_t:
                    micro_counts = [t.grad_accum]
                syncs = [p.sync_every_micro_batch] if "sync_every_micro_batch" in fixed_p else [False, True]
                for accum, ac, sync in itertools.product(micro_counts, acs, syncs):
                    if sync and (accum == 1 or pp > 1 or (tp > 1 and cp == 1 and data == 1)):  # tp alone: no fully_shard
                        continue
                    par = {"auto": False, "tp": tp, "pp": pp, "cp": cp, "dp_replicate": replicate, "dp_shard": shard, "ep": ep,
                           "sync_every_micro_batch": sync}  # fmt: skip
                    if pp == 1:
                        par.update(pp_microbatches=None, pp_layers_per_stage=None, pp_virtual_stages=1)
                    try:  # the parallelism section's own checks; the rest is the preflight's (_valid)
                        parallelism = ParallelismSpec.model_validate({**base, **par})
                    except ValueError:
                        continue
                    training = t.model_copy(update={"grad_accum": accum, "activation_checkpointing": ac})
                    out.append(spec.model_copy(update={"parallelism": parallelism, "training": training}))
    return out


def _search(
    spec: JobSpec, device_memory: int | None, device: str, profile: DeviceProfile | None, *, want: int,
    most_estimates: int = 512, budget_s: float | None = 20.0,
) -> tuple[list[Fit], list[tuple[str, str, float]]]:  # fmt: skip
    """The ``want`` fastest layouts of ``spec`` that fit, and the rejected ones with why and how
    far from fitting (peak / memory). Estimates in cost order, at most ``most_estimates`` of them
    and for at most ``budget_s`` seconds (the API answers within its validation deadline)."""
    import time

    cfg, params, fpt = _model_facts(spec)
    profile = profile or DeviceProfile.default(device, spec.parallelism.mixed_precision)
    rejected: list[tuple[str, str, float]] = []
    timed: list[Fit] = []
    for candidate in candidates(spec, cfg, profile.devices_per_node):
        why = _valid(candidate)
        if why is not None:
            rejected.append((layout_label(candidate), why, math.inf))
            continue
        timed.append(Fit(candidate, step_seconds(candidate, cfg, params, profile, fpt)))
    timed.sort(key=lambda f: f.seconds)
    fits: list[Fit] = []
    deadline = time.monotonic() + budget_s if budget_s is not None else math.inf
    for fit in timed[:most_estimates]:
        if time.monotonic() > deadline:
            break
        est = _estimate(fit.spec, device)
        if isinstance(est, str):
            rejected.append((fit.label, est, math.inf))
            continue
        if device_memory is not None and est.peak > device_memory:
            rejected.append((fit.label, _over(fit.spec, est, device_memory), est.peak / device_memory))
            continue
        try:  # every check of a spec (candidates are built past the cross-section ones)
            checked = JobSpec.model_validate(fit.spec.model_dump(by_alias=True))
        except ValueError as e:
            rejected.append((fit.label, str(e).splitlines()[-1].strip(), math.inf))
            continue
        fit.estimate = est
        fit.spec = checked.model_copy(update={"memory_estimate": est.record()})
        fits.append(fit)
        if len(fits) == want:
            break
    rejected.sort(key=lambda r: r[2])
    return fits, rejected


def choose_layout(
    spec: JobSpec, device_memory: int | None, device: str, profile: DeviceProfile | None = None,
    budget_s: float | None = 20.0,
) -> tuple[Fit, Fit | None]:
    """``parallelism: auto`` (module doc): (the chosen layout, the runner-up or None); the chosen
    spec has ``auto`` false and its estimate. A ``SpecError`` naming the closest rejected layouts
    when nothing fits."""
    from .estimate import too_large_to_estimate

    if (why := too_large_to_estimate(spec)) is not None:
        raise SpecError(f"job spec: parallelism: auto\n  parallelism: auto: {why}; set the layout", [("parallelism", f"auto: {why}; set the layout")])
    try:
        fits, rejected = _search(spec, device_memory, device, profile, want=2, budget_s=budget_s)
    except SpecError:
        raise
    except Exception as e:  # the model cannot be built here (a factory, init_from elsewhere)
        message = f"auto needs the model's config where the job is handed over: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
        raise SpecError(f"job spec: parallelism: auto\n  parallelism: {message}", [("parallelism", message)]) from None
    if not fits:
        top = "; ".join(f"[{label}] {why}" for label, why, _ in rejected[:4])
        more = f" (and {len(rejected) - 4} more)" if len(rejected) > 4 else ""
        message = (
            f"no layout of {spec.resources.workers} workers fits: {top}{more}"
            if rejected
            else f"no layout of {spec.resources.workers} workers satisfies the fields set beside auto"
        )
        raise SpecError(f"job spec: parallelism: auto\n  parallelism: {message}", [("parallelism", message)])
    return fits[0], fits[1] if len(fits) > 1 else None
