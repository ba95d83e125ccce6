"""``python -m hpservice.bench memory``: the memory estimate against the measured peak, and
``parallelism: auto`` against a brute-force sweep.

**Estimate vs measurement.** A grid of configurations, families (llama, qwen3) x layouts (one
rank, fully_shard 2, tensor parallel 2, pipeline 2, HSDP 2 x 2, context parallel 2) x activation
checkpointing (none, full) x LoRA (off, on), and a few more (bf16, gradient accumulation with and
without ``sync_every_micro_batch``, selective checkpointing, no reshard after forward, a mixture
of experts with expert parallelism), each a small model trained on gloo ranks of this machine.
For each: the estimate (``hpservice.memory.estimate``, device ``cpu``: fully_shard keeps its
collective buffers there), and the measured peak of one step after two warm-up steps, per rank,
with ``TensorMemoryTracker`` (``hpservice.memory.measure``: every tensor the rank allocates, from
before its model is built); the table shows the fullest rank of each and the ratio, then the
worst ratio and the median error.

**auto vs brute force** (``--auto``): a job small enough to sweep, with a device memory that
rules some layouts out. Every layout ``parallelism: auto`` considers (``memory.plan.candidates``)
that passes the layout checks and whose *measured* peak fits is timed (median of 5 steps after
2; a layout whose estimate is more than 15% past the memory is not run), and auto's choice (with the cost model calibrated on this machine: a matmul's FLOP rate
and a gloo all-reduce's bandwidth) is compared with the fastest: the goal is within 10%.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

MIB = 2**20

_MODEL = {"dim": 256, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 4096, "max_seq_len": 256}
LAYOUTS = {  # name -> (workers, parallelism)
    "1 rank": (1, {}),
    "fsdp 2": (2, {}),
    "tp 2": (2, {"tp": 2}),
    "pp 2": (2, {"pp": 2}),
    "hsdp 2x2": (4, {"dp_replicate": 2}),
    "cp 2": (2, {"cp": 2}),
}
EXTRAS = {  # name -> (family, workers, parallelism, training)
    "fsdp 2, bf16": ("llama", 2, {"mixed_precision": "bf16"}, {}),
    "fsdp 2, accum 2": ("llama", 2, {}, {"grad_accum": 2}),
    "fsdp 2, accum 2, sync each": ("llama", 2, {"sync_every_micro_batch": True}, {"grad_accum": 2}),
    "fsdp 2, selective AC": ("qwen3", 2, {}, {"activation_checkpointing": "selective"}),
    "fsdp 2, no reshard": ("qwen3", 2, {"reshard_after_forward": False}, {}),
    "pp 2 gpipe x4": ("llama", 2, {"pp": 2, "pp_schedule": "gpipe", "pp_microbatches": 4}, {}),
    "fsdp 2 x tp 2": ("qwen3", 4, {"tp": 2}, {}),
    "moe ep 2": ("qwen3_moe", 2, {"ep": 2}, {}),
}


def job(family: str, workers: int, parallelism: dict, training: dict | None = None, *, lora: bool = False,
        batch: int = 4, seq: int = 256, **extra) -> object:  # fmt: skip
    from hpservice.spec import parse_job

    overrides = dict(_MODEL)
    if family == "qwen3_moe":
        overrides.update(num_experts=4, experts_per_token=2, moe_hidden_dim=256)
    model: dict = {"name": family, "flavor": "tiny", "overrides": overrides}
    if lora:
        model["lora"] = {"r": 8, "lora_alpha": 16}
    return parse_job({
        "name": "bench-memory", "model": model, "data": {"kind": "synthetic", "seq_len": seq, "global_batch": batch},
        "training": {"steps": 3, **(training or {})}, "parallelism": parallelism, "resources": {"workers": workers},
        "metrics": {"log_every": 1000}, **extra,
    })  # fmt: skip


def grid(quick: bool) -> dict[str, object]:
    configs = {}
    if quick:  # the smoke run
        return {"llama, 1 rank, AC none": job("llama", 1, {})}
    for family in ("llama", "qwen3"):
        for layout in LAYOUTS:
            workers, parallelism = LAYOUTS[layout]
            for ac in ("none", "full"):
                for lora in (False, True):
                    name = f"{family}, {layout}, AC {ac}{', LoRA' if lora else ''}"
                    configs[name] = job(family, workers, parallelism, {"activation_checkpointing": ac}, lora=lora)
    for name, (family, workers, parallelism, training) in EXTRAS.items():
        configs[f"{family}, {name}"] = job(family, workers, parallelism, training)
    return configs


def estimate_vs_measured(quick: bool) -> dict:
    from hpservice.launch import RankPool
    from hpservice.memory import estimate
    from hpservice.memory.measure import measure

    rows = []
    pools: dict[int, RankPool] = {}
    try:
        for name, spec in grid(quick).items():
            est = estimate(spec, device="cpu")
            world = spec.resources.workers
            if world not in pools:
                pools[world] = RankPool(world).__enter__()
            measured = measure(spec, pool=pools[world])
            peak = max(r["peak_bytes"] for r in measured)
            rows.append({"config": name, "estimate_bytes": est.peak, "measured_bytes": peak, "ratio": est.peak / peak,
                         "per_rank_measured": [r["peak_bytes"] for r in measured],
                         "per_rank_estimate": [r.peak for r in est.ranks], "traced": est.traced})  # fmt: skip
            print(f"  {name:<48}{est.peak / MIB:>10.1f}{peak / MIB:>10.1f}{est.peak / peak:>8.3f}", flush=True)
    finally:
        for pool in pools.values():
            pool.__exit__(None, None, None)
    errors = [abs(r["ratio"] - 1) for r in rows]
    worst = max(rows, key=lambda r: abs(r["ratio"] - 1))
    return {"rows": rows, "worst": worst, "median_error": statistics.median(errors), "max_error": max(errors)}


# ---- auto vs brute force -------------------------------------------------------------------------


def _link_rank(nbytes: int) -> tuple[float, float]:
    """(GB/s each rank sends in a ring all-reduce of ``nbytes``, seconds of a one-number all-reduce)."""
    import torch
    import torch.distributed as dist

    def timed(t: torch.Tensor, n: int) -> float:
        dist.all_reduce(t)
        start = time.perf_counter()
        for _ in range(n):
            dist.all_reduce(t)
        return (time.perf_counter() - start) / n

    world = dist.get_world_size()
    sent = 2 * nbytes * (world - 1) / world
    return sent / timed(torch.ones(nbytes // 4), 3) / 1e9, timed(torch.ones(1), 50)


def calibrate(pools: dict, spec) -> object:
    """This machine's ``DeviceProfile`` from measurements: gloo's all-reduce bandwidth and latency;
    the sustained FLOP rate and the per-block overhead from one rank's steps of ``spec``'s model
    with 1 and 8 micro-batches (the same compute, eight times the micro-batches); the sharded
    blocks' overhead multiple from a tensor-parallel step."""
    from hpservice.memory.measure import step_time
    from hpservice.memory.plan import DeviceProfile, _model_facts, step_seconds

    gbs, latency = max(pools[2].run(_link_rank, 16 * MIB), key=lambda r: r[1])
    cfg, params, fpt = _model_facts(spec)
    blocks = cfg.n_layers
    one = spec.model_copy(update={
        "parallelism": spec.parallelism.model_copy(update={"auto": False}),
        "resources": spec.resources.model_copy(update={"workers": 1}),
    })  # fmt: skip
    t1 = step_time(one, pool=pools[1], steps=5)
    t8 = step_time(one.model_copy(update={"training": one.training.model_copy(update={"grad_accum": 8})}), pool=pools[1], steps=5)
    overhead = max(1e-6, (t8 - t1) / (7 * blocks))
    flops = fpt(cfg, spec.data.seq_len) * spec.data.global_batch * spec.data.seq_len / max(t1 - blocks * overhead, 1e-6)
    base = DeviceProfile(flops, gbs, gbs, 1 << 16, overhead, 1.0, latency, 1.0)
    tp = spec.model_copy(update={"parallelism": spec.parallelism.model_copy(update={"auto": False, "tp": 2, "dp_shard": 1})})
    t_tp = step_time(tp, pool=pools[2], steps=5)
    sharded = 1 + max(0.0, t_tp - step_seconds(tp, cfg, params, base, fpt)) / (blocks * overhead)
    return dataclasses.replace(base, sharded_overhead=sharded)


def auto_vs_brute_force(quick: bool) -> dict:
    from hpservice.launch import RankPool
    from hpservice.memory import estimate
    from hpservice.memory.measure import measure, step_time
    from hpservice.memory.plan import _model_facts, _valid, candidates, choose_layout, layout_label, step_seconds

    spec = job("llama", 2, "auto", batch=8, seq=256)
    device_memory = 150 * MIB  # rules out the micro-batches of 4 and 8 rows without checkpointing
    spec = spec.model_copy(update={"resources": spec.resources.model_copy(update={"device_memory": device_memory})})
    cfg, params, fpt = _model_facts(spec)
    with RankPool(1) as one, RankPool(2) as pool:
        profile = calibrate({1: one, 2: pool}, spec)
        print(f"  calibrated: {profile.flops / 1e9:.1f} GFLOP/s, {profile.intra_gbs:.2f} GB/s, latency "
              f"{profile.latency_s * 1e6:.0f} us, {profile.block_overhead_s * 1e3:.2f} ms per block and micro-batch, "
              f"x{profile.sharded_overhead:.2f} sharded", flush=True)  # fmt: skip
        chosen, runner_up = choose_layout(spec, device_memory, "cpu", profile, budget_s=None)
        print(f"  auto chooses [{chosen.label}], runner-up [{runner_up.label if runner_up else None}]", flush=True)
        results = []
        for candidate in candidates(spec, cfg):
            if _valid(candidate) is not None:
                continue
            label = layout_label(candidate)
            if quick and candidate.parallelism.pp > 1:
                continue
            try:
                est = estimate(candidate, device="cpu")
                if est.peak > 1.15 * device_memory:  # far past it (the grid checks the estimate): not run
                    results.append({"layout": label, "estimate_bytes": est.peak, "measured_bytes": None, "fits": False})
                    continue
                peak = max(r["peak_bytes"] for r in measure(candidate, pool=pool))
            except Exception as e:  # a layout the trainer refuses is not a candidate
                print(f"  {label}: not run ({str(e).splitlines()[0][:80]})")
                continue
            fits = peak <= device_memory
            seconds = step_time(candidate, pool=pool, steps=5) if fits else None
            results.append({"layout": label, "measured_bytes": peak, "estimate_bytes": est.peak, "fits": fits,
                            "step_s": seconds, "model_s": step_seconds(candidate, cfg, params, profile, fpt)})  # fmt: skip
            shown = f"{seconds * 1000:8.1f} ms" if seconds else "  (does not fit)"
            print(f"  {label:<72}{peak / MIB:>8.1f} MiB{shown}", flush=True)
    timed = [r for r in results if r["fits"]]
    fastest = min(timed, key=lambda r: r["step_s"])
    picked = next((r for r in results if r["layout"] == chosen.label), None)
    return {
        "device_memory_bytes": device_memory,
        "profile": dataclasses.asdict(profile),
        "chosen": chosen.label,
        "runner_up": runner_up.label if runner_up else None,
        "fastest": fastest,
        "picked": picked,
        "picked_vs_fastest": picked["step_s"] / fastest["step_s"] if picked and picked["step_s"] else None,
        "rows": results,
    }


def _main(args: argparse.Namespace) -> int:
    result: dict = {}
    if not args.no_grid:
        print("memory: estimate vs measured peak per rank (MiB, the fullest rank), CPU gloo ranks")
        print(f"  {'configuration':<48}{'estimate':>10}{'measured':>10}{'ratio':>8}")
        g = result["grid"] = estimate_vs_measured(args.quick)
        n = len(g["rows"])
        print(f"{n} configuration{'s' if n != 1 else ''}: median error {g['median_error']:.2%}, worst {g['worst']['config']} "
              f"ratio {g['worst']['ratio']:.3f}")  # fmt: skip
    if args.auto:
        print("auto vs brute force: llama tiny, 2 ranks, global batch 8 x 256, device memory 150 MiB")
        a = result["auto"] = auto_vs_brute_force(args.quick)
        print(f"auto chose [{a['chosen']}] (runner-up [{a['runner_up']}]); the fastest measured: "
              f"[{a['fastest']['layout']}] {a['fastest']['step_s'] * 1000:.1f} ms; chosen / fastest "
              f"{a['picked_vs_fastest']:.3f}" if a["picked_vs_fastest"] else f"auto chose [{a['chosen']}], not measured")  # fmt: skip
    if args.json:
        print(json.dumps(result, default=str))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("memory", help="the memory estimate vs the measured peak per rank; parallelism: auto vs brute force")
    p.add_argument("--quick", action="store_true", help="a few configurations (the tests' smoke run)")
    p.add_argument("--auto", action="store_true", help="also sweep every layout auto considers and time the ones that fit")
    p.add_argument("--no-grid", action="store_true", help="skip the estimate-vs-measurement grid (with --auto: the sweep alone)")
    p.add_argument("--json", action="store_true", help="also print the result as one JSON line")
    p.set_defaults(run=_main)
