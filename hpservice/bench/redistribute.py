"""Redistribute benchmark: ``hpservice.dtensor`` against ``torch.distributed.tensor``.

What is measured: the wall time of one ``redistribute`` call until its local result is ready
(``to_local()``, and waiting an ``AsyncCollectiveTensor`` should torch hand one back), for the
same transitions, sizes and input values in both libraries, on local gloo ranks with one
intra-op thread each. Inputs are built once, outside the timed region; the meshes of both
libraries sit on the same default process group.

How: one measurement is a barrier (so every rank starts together) followed by ``iters``
back-to-back calls; the per-call time is the block's time divided by ``iters``. After a
warm-up, measurements of ours and torch alternate, swapping which goes first every round, so
machine noise (N ranks sharing few cores, other processes) hits both alike rather than
whichever ran during a bad second. Each rank keeps the median over rounds; the slowest rank's
median is reported, since a collective is as slow as its slowest participant.

Both results are also compared (local piece and full tensor): a fast wrong answer is flagged.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.distributed as dist

from hpservice.launch import run_ranks

__all__ = ["add_parser", "bench_rank", "combine", "format_table", "summary"]

# Placements are written as codes ("S0", "R", "P") so one list drives both libraries.
TRANSITIONS: dict[str, tuple[tuple[tuple[str, ...], tuple[str, ...]], ...]] = {
    "1d": (
        (("S0",), ("R",)),
        (("R",), ("S0",)),
        (("P",), ("R",)),
        (("P",), ("S0",)),
        (("S0",), ("S1",)),
    ),
    "2d": (
        (("S0", "S0"), ("R", "R")),
        (("R", "R"), ("S0", "S0")),
        (("P", "P"), ("R", "R")),
        (("P", "P"), ("S0", "S0")),
        (("S0", "S0"), ("S1", "S1")),
        (("S0", "S1"), ("R", "R")),
        (("P", "P"), ("S0", "S1")),
        (("S0", "R"), ("R", "S0")),
    ),
}
SMALL = ("small", (8, 8))  # per-call cost: planning, dispatch, wrappers, collective latency
LARGE = ("large", (2048, 2048))  # 16 MB of float32: the copies around the collectives matter
# Many short rounds rather than few long ones: the median then resists bursts of noise, and
# ours and torch alternate often. Defaults keep the full run near 1.5 min on 2 cores, 4 ranks.
DEFAULT_ITERS = 5
DEFAULT_ROUNDS = 15
DEFAULT_WARMUP = 2
QUICK = {"iters": 3, "rounds": 3, "warmup": 1}


@dataclass(frozen=True)
class _Library:
    """One DTensor implementation: its ``init_device_mesh`` and the module with DTensor,
    distribute_tensor and the placement classes."""

    name: str
    init_device_mesh: Callable
    api: ModuleType

    def placements(self, codes: Sequence[str]) -> list:
        return [
            self.api.Replicate() if c == "R" else self.api.Partial() if c == "P" else self.api.Shard(int(c[1:]))
            for c in codes
        ]


def _libraries() -> tuple[_Library, _Library]:
    import torch.distributed.tensor as theirs
    from torch.distributed.device_mesh import init_device_mesh

    import hpservice.dtensor as ours

    return _Library("ours", ours.init_device_mesh, ours), _Library("torch", init_device_mesh, theirs)


def _meshes(world: int) -> list[tuple[str, tuple[int, ...]]]:
    """A 1-D mesh over all ranks and, for an even world, a 2-D (2, world / 2) mesh."""
    return [("1d", (world,))] + ([("2d", (2, world // 2))] if world % 2 == 0 else [])


def _make_input(lib: _Library, mesh, codes: Sequence[str], shape: tuple[int, ...]):
    """The same global value in both libraries, as integer-valued floats so that Partial sums
    are exact whatever order a backend reduces in. A Partial source holds a different value on
    each rank (the global value is their sum); other placements cut one shared tensor. Each rank
    slices its own copy (``src_data_rank=None``), so building inputs needs no communication."""
    partial = "P" in codes
    gen = torch.Generator().manual_seed(1000 + (dist.get_rank() if partial else 0))
    full = torch.randint(-8, 8, shape, generator=gen).float()
    whole = lib.placements(["R" if c == "P" else c for c in codes])
    local = lib.api.distribute_tensor(full, mesh, whole, src_data_rank=None).to_local()
    return lib.api.DTensor.from_local(local, mesh, lib.placements(codes), shape=full.shape, stride=full.stride())


def _ready(dt) -> torch.Tensor:
    """The local result once it is really there. torch 2.13 waits inside a synchronous
    redistribute, but its locals may be an AsyncCollectiveTensor (other releases, other paths):
    waiting here makes sure no library is timed before its collective has finished."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    local = dt.to_local()
    return local.wait() if isinstance(local, AsyncCollectiveTensor) else local


def _redistribute_ready(x, mesh, placements) -> torch.Tensor:
    """One timed call."""
    return _ready(x.redistribute(mesh, placements))


def _block_us(call: Callable[[], object], iters: int) -> float:
    """Per-call µs of ``iters`` back-to-back calls, started together on every rank."""
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        call()
    return (time.perf_counter() - start) / iters * 1e6


def _measure(calls: dict[str, Callable[[], object]], iters: int, rounds: int, warmup: int) -> dict[str, float]:
    """Median per-call µs of each call, measured in alternating order (see module doc)."""
    for call in calls.values():
        for _ in range(warmup):
            call()
    names = list(calls)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            samples[name].append(_block_us(calls[name], iters))
    return {name: statistics.median(s) for name, s in samples.items()}


def _results(x, mesh, placements) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's piece and the full tensor after the transition, to compare the libraries."""
    out = x.redistribute(mesh, placements)
    return _ready(out), out.full_tensor()


def _bench_transition(libs, meshes, src, dst, shape, iters, rounds, warmup) -> tuple[dict[str, float], bool]:
    """Median per-call µs of each library for ``src -> dst``, and whether their results agree."""
    calls = {}
    for lib in libs:
        x = _make_input(lib, meshes[lib.name], src, shape)
        calls[lib.name] = functools.partial(_redistribute_ready, x, meshes[lib.name], lib.placements(dst))
    times = _measure(calls, iters, rounds, warmup)
    ours, theirs = (_results(*call.args) for call in calls.values())
    return times, all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


def _fmt(codes: Sequence[str]) -> str:
    text = [c if c in ("R", "P") else f"S({c[1:]})" for c in codes]
    return text[0] if len(text) == 1 else "(" + ", ".join(text) + ")"


def bench_rank(sizes: Sequence[tuple[str, tuple[int, ...]]], iters: int, rounds: int, warmup: int) -> list[dict]:
    """Run on every rank: this rank's median per-call µs of every transition, both libraries."""
    torch.set_num_threads(1)
    libs = _libraries()
    rows = []
    for mesh_name, mesh_shape in _meshes(dist.get_world_size()):
        meshes = {lib.name: lib.init_device_mesh("cpu", mesh_shape) for lib in libs}
        for src, dst in TRANSITIONS[mesh_name]:
            for size_name, shape in sizes:
                times, match = _bench_transition(libs, meshes, src, dst, shape, iters, rounds, warmup)
                rows.append(
                    {
                        "mesh": list(mesh_shape),
                        "transition": f"{_fmt(src)} -> {_fmt(dst)}",
                        "size": size_name,
                        "shape": list(shape),
                        "ours_us": times["ours"],
                        "torch_us": times["torch"],
                        "match": match,
                    }
                )
    return rows


def combine(per_rank: Sequence[list[dict]]) -> list[dict]:
    """One row per transition: the slowest rank's medians, and a match only if every rank matched."""
    rows = []
    for same in zip(*per_rank, strict=True):
        row = dict(same[0])
        row["ours_us"] = max(r["ours_us"] for r in same)
        row["torch_us"] = max(r["torch_us"] for r in same)
        row["ratio"] = row["ours_us"] / row["torch_us"]
        row["match"] = all(r["match"] for r in same)
        rows.append(row)
    return rows


def format_table(rows: Sequence[dict]) -> str:
    header = f"{'mesh':<8} {'shape':<10} {'transition':<30} {'ours us':>10} {'torch us':>10} {'ours/torch':>10}  result"
    lines = [header, "-" * len(header)]
    for r in rows:
        mesh = "x".join(map(str, r["mesh"]))
        shape = "x".join(map(str, r["shape"]))
        lines.append(
            f"{mesh:<8} {shape:<10} {r['transition']:<30} {r['ours_us']:>10.1f} {r['torch_us']:>10.1f} "
            f"{r['ratio']:>10.2f}  {'match' if r['match'] else 'MISMATCH'}"
        )
    return "\n".join(lines)


def summary(rows: Sequence[dict], ranks: int) -> dict:
    small = [r["ratio"] for r in rows if r["size"] == SMALL[0]]
    return {
        "bench": "redistribute",
        "ranks": ranks,
        "results": list(rows),
        "max_ratio_vs_torch": max(r["ratio"] for r in rows),
        "small_overhead_ratio": statistics.median(small),
    }


def run(args: argparse.Namespace) -> int:
    """Print the table (and JSON); exit status 1 if the libraries disagreed anywhere."""
    if args.ranks < 2:
        print("redistribute: --ranks must be >= 2")
        return 2
    sizes = [SMALL] if args.quick else [SMALL, LARGE]
    defaults = QUICK if args.quick else {"iters": DEFAULT_ITERS, "rounds": DEFAULT_ROUNDS, "warmup": DEFAULT_WARMUP}
    iters = args.iters if args.iters is not None else defaults["iters"]
    rounds = args.rounds if args.rounds is not None else defaults["rounds"]
    if iters < 1 or rounds < 1:
        print("redistribute: --iters and --rounds must be >= 1")
        return 2
    warmup = defaults["warmup"]
    per_rank = run_ranks(bench_rank, args.ranks, sizes, iters, rounds, warmup, timeout=args.timeout)
    rows = combine(per_rank)
    print(
        f"redistribute: hpservice.dtensor vs torch.distributed.tensor, {args.ranks} gloo ranks x 1 thread\n"
        f"median per-call time of the slowest rank; {rounds} rounds of {iters} calls, ours/torch interleaved\n"
    )
    print(format_table(rows))
    if args.json:
        print(json.dumps(summary(rows, args.ranks)))
    return 0 if all(r["match"] for r in rows) else 1


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("redistribute", help="time DTensor.redistribute: hpservice.dtensor vs torch")
    p.add_argument("--ranks", type=int, default=4, help="number of local gloo ranks (default 4)")
    p.add_argument(
        "--iters",
        type=int,
        default=None,
        help=f"calls per measurement (default {DEFAULT_ITERS}, {QUICK['iters']} with --quick)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        help=f"measurements per library and transition; the median is kept (default {DEFAULT_ROUNDS}, "
        f"{QUICK['rounds']} with --quick)",
    )
    p.add_argument("--quick", action="store_true", help="small tensors and few iterations only (for tests)")
    p.add_argument("--json", action="store_true", help="also print one final line of JSON with all results")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before the ranks are killed")
    p.set_defaults(run=run)
