"""FSDP benchmark: ``hpservice.fsdp.fully_shard`` against torch FSDP2 and DDP, step by step.

What is measured: whole training steps (``zero_grad``, forward, loss, backward, AdamW ``step``)
of the same model, from the same initial values, on the same data, in four configurations:

- ``ours``   hpservice.fsdp.fully_shard on an ``hpservice.dtensor`` mesh (each block, then the
  root; the last block with ``reshard_after_forward=False``, torchtitan's default policy, since
  backward starts with it)
- ``fsdp2``  torch.distributed.fsdp.fully_shard on a torch mesh, wrapped the same way
- ``ddp``    torch.nn.parallel.DistributedDataParallel (default buckets)
- ``single`` one process on the concatenated global batch: the loss every other config must match

The three distributed configs live side by side in the same rank processes (one ``run_ranks``
call) and take turns one step at a time, rotating which goes first, so machine noise (N ranks
on few cores, other processes) hits all of them alike. Every rank trains on its slice of a
deterministic global batch (``torch.chunk`` of it along dim 0). ``single`` runs afterwards on
rank 0, on the whole global batch, for as many steps.

Per config, reported:

- step ms: each rank's median over the timed steps (every step starts with a barrier, so the
  ranks start together); the slowest rank's median is reported, since a step with collectives
  is as slow as its slowest rank. ``single`` does the work of all ranks in one process.
- tracked MiB/rank: bytes of the parameters, gradients and AdamW state that a rank holds after
  a step: the local tensors of DTensors (ours, FSDP2), the full tensors for DDP and single;
  the largest rank is reported. Transient memory (all-gathered parameters, activations, DDP
  buckets) is not in it: see RSS.
- RSS peak MiB: all configs share one process, so ``ru_maxrss`` (reported once, in the header)
  cannot tell them apart. Instead one untimed step per config runs after ``gc.collect()`` and
  ``malloc_trim(0)`` with a thread polling the resident set size (``/proc/self/statm``); the
  peak seen is reported, and ``+step`` is that peak minus the RSS just before the step (what
  the step itself allocated: activations, unsharded parameters, gradients, buckets). Since the
  other configs' models stay resident, compare ``+step`` across configs, not the peak.
- coll/step: collectives issued during one untimed step. ours: calls of ``all_gather_flat``,
  ``reduce_scatter_flat`` and ``all_reduce_flat`` (patched in ``_fsdp_param_group``); FSDP2:
  calls of the ``torch.distributed`` collectives it uses (patched on the module); DDP: its
  reducer calls the process group from C++, so its backend collectives are counted with
  ``torch.profiler`` instead (events named ``gloo:*``).
- final loss: the loss of the last step, mean over ranks (each rank's slice is the same size,
  so that is the global-batch loss), and its distance to the single-process loss.

Steps per config: ``--warmup`` untimed steps, ``--steps`` timed steps, then one step counting
collectives and one sampling RSS (last, so both see the steady state: DDP, for one, broadcasts
its rebuilt bucket order in its second step). All are training steps of the same trajectory;
the final loss is that of the last one.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from hpservice.bench import _harness as h
from hpservice.bench._harness import LR, MIB, MLP, REFERENCE, count_patched, count_profiled
from hpservice.launch import run_ranks
from hpservice.train._utilisation import max_rss_bytes

__all__ = ["MLP", "FSDPWorkload", "Transformer", "add_parser", "bench_rank", "combine", "format_table", "summary"]

CONFIGS = ("ours", "fsdp2", "ddp")
# torch.distributed collectives FSDP2 may issue (2.13 names and the older ones).
_TORCH_COLLECTIVES = (
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_reduce",
    "all_gather_single",
    "reduce_scatter_single",
)
_OUR_COLLECTIVES = ("all_gather_flat", "reduce_scatter_flat", "all_reduce_flat")


# ---- models ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class FSDPWorkload:
    """Model and data sizes. ``batch`` is per rank: sequences (transformer) or rows (mlp)."""

    kind: str  # "mlp" or "transformer"
    dim: int
    depth: int
    batch: int
    heads: int = 0
    vocab: int = 0
    seq: int = 0

    def describe(self) -> str:
        if self.kind == "mlp":
            return f"{self.depth} residual MLP blocks, dim {self.dim} (hidden {4 * self.dim})"
        return (
            f"decoder-only transformer: {self.depth} layers, dim {self.dim}, {self.heads} heads, "
            f"vocab {self.vocab}, seq {self.seq}"
        )

    def batch_desc(self, world: int) -> str:
        unit = "rows" if self.kind == "mlp" else f"sequences of {self.seq} tokens"
        return f"{self.batch} {unit} per rank, {self.batch * world} global"


SPECS = {
    ("mlp", False): FSDPWorkload("mlp", dim=384, depth=4, batch=64),
    ("mlp", True): FSDPWorkload("mlp", dim=32, depth=2, batch=4),
    ("transformer", False): FSDPWorkload("transformer", dim=256, depth=4, batch=4, heads=4, vocab=1024, seq=64),
    ("transformer", True): FSDPWorkload("transformer", dim=32, depth=2, batch=2, heads=2, vocab=64, seq=8),
}


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(b, t, c))


class DecoderBlock(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class Transformer(nn.Module):
    """Token + position embeddings, decoder blocks, final norm, untied head."""

    def __init__(self, vocab: int, dim: int, depth: int, heads: int, seq: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(DecoderBlock(dim, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def make_model(spec: FSDPWorkload) -> nn.Module:
    if spec.kind == "mlp":
        return MLP(spec.dim, spec.depth)
    return Transformer(spec.vocab, spec.dim, spec.depth, spec.heads, spec.seq)


def global_batch(spec: FSDPWorkload, step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: the same on every rank and in every config."""
    g = torch.Generator().manual_seed(10_000 + step)
    n = spec.batch * world
    if spec.kind == "mlp":
        return torch.randn(n, spec.dim, generator=g), torch.randn(n, spec.dim, generator=g)
    tokens = torch.randint(0, spec.vocab, (n, spec.seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def compute_loss(spec: FSDPWorkload, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = model(x)
    if spec.kind == "mlp":
        return F.mse_loss(out, y)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


# ---- the configurations ----------------------------------------------------------------------


def _wrap_ours(model: nn.Module, world: int) -> nn.Module:
    from hpservice.dtensor import init_device_mesh
    from hpservice.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for i, block in enumerate(model.blocks):  # torchtitan's policy: the last block keeps its params
        fully_shard(block, mesh=mesh, reshard_after_forward=i < len(model.blocks) - 1)
    return fully_shard(model, mesh=mesh)


def _wrap_fsdp2(model: nn.Module, world: int) -> nn.Module:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    for i, block in enumerate(model.blocks):  # torchtitan's policy: the last block keeps its params
        fully_shard(block, mesh=mesh, reshard_after_forward=i < len(model.blocks) - 1)
    return fully_shard(model, mesh=mesh)


def _wrap_ddp(model: nn.Module, world: int) -> nn.Module:
    return nn.parallel.DistributedDataParallel(model)


_WRAPPERS: dict[str, Callable[[nn.Module, int], nn.Module]] = {
    "ours": _wrap_ours,
    "fsdp2": _wrap_fsdp2,
    "ddp": _wrap_ddp,
    REFERENCE: lambda model, world: model,
}


class _FSDPConfigTrainer(h.ConfigTrainer):
    """One configuration: its model, AdamW, and what was measured (also the RSS of one step)."""

    def __init__(self, name: str, spec: FSDPWorkload, base: nn.Module, world: int):
        super().__init__(name, spec, base, lambda model: _WRAPPERS[name](model, world))
        self.rss_before = 0
        self.rss_peak = 0

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = compute_loss(self.spec, self.model, x, y)
        loss.backward()
        return loss

    def counter(self) -> h.Counter | None:
        return {"ours": _count_ours, "fsdp2": _count_torch, "ddp": count_profiled}.get(self.name)

    def rss_step(self, x: torch.Tensor, y: torch.Tensor, barrier: bool) -> None:
        gc.collect()
        h.malloc_trim()
        if barrier:
            dist.barrier()
        self.rss_before = h.rss_bytes()
        with h.RssSampler() as sampler:
            self._record(self.step(x, y))
        self.rss_peak = max(sampler.peak, self.rss_before)

    def result(self) -> dict:
        return {
            **super().result(),
            "rss_peak_bytes": self.rss_peak,
            "rss_step_bytes": self.rss_peak - self.rss_before,
        }


# ---- counting collectives --------------------------------------------------------------------


def _count_ours() -> contextlib.AbstractContextManager[dict[str, int]]:
    import hpservice.fsdp._fsdp_param_group as group_module

    return count_patched(group_module, _OUR_COLLECTIVES)


def _count_torch() -> contextlib.AbstractContextManager[dict[str, int]]:
    return count_patched(dist, _TORCH_COLLECTIVES)


# ---- per rank --------------------------------------------------------------------------------


def _local(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    return t.chunk(world)[rank]


def bench_rank(spec: FSDPWorkload, steps: int, warmup: int) -> dict:
    """Run on every rank: train every distributed config, interleaved; rank 0 then runs the
    single-process reference. Returns this rank's medians, memory, counts and final losses."""
    rank, world = h.start_rank()
    base = make_model(spec)

    def local_batch(step: int) -> h.Batch:
        x, y = global_batch(spec, step, world)
        return _local(x, rank, world), _local(y, rank, world)

    results = h.train_all(
        lambda name: _FSDPConfigTrainer(name, spec, base, world),
        CONFIGS,
        local_batch,
        lambda step: global_batch(spec, step, world),
        steps,
        warmup,
        after=("count_step", "rss_step"),
    )
    return {"rank": rank, "results": results, "max_rss_bytes": max_rss_bytes()}


# ---- report ----------------------------------------------------------------------------------


def combine(per_rank: Sequence[dict]) -> dict[str, dict]:
    """One row per config: slowest rank's median, largest rank's memory, mean final loss."""
    return h.combine(per_rank, CONFIGS, memory=("tracked", "rss_peak", "rss_step"))


COLUMNS = (
    h.STEP_MS,
    h.TRACKED,
    h.Column("RSS peak MiB", 13, "rss_peak_mib", ".1f"),
    h.Column("+step MiB", 10, "rss_step_mib", ".1f"),
    h.COLLECTIVES,
    h.FINAL_LOSS,
    h.LOSS_DIFF,
)


def format_table(rows: dict[str, dict]) -> str:
    return h.format_table(
        rows, COLUMNS, "one process on the global batch (all ranks' work), run on rank 0 after the others"
    )


def ratios(rows: dict[str, dict]) -> dict[str, float]:
    ours = rows["ours"]
    return {
        "step_time_ratio_vs_fsdp2": ours["step_ms"] / rows["fsdp2"]["step_ms"],
        "step_time_ratio_vs_ddp": ours["step_ms"] / rows["ddp"]["step_ms"],
        "memory_ratio_vs_fsdp2": ours["tracked_mib"] / rows["fsdp2"]["tracked_mib"],
        "memory_ratio_vs_ddp": ours["tracked_mib"] / rows["ddp"]["tracked_mib"],
    }


def summary(rows: dict[str, dict], spec: FSDPWorkload, world: int, steps: int, warmup: int, max_rss: int) -> dict:
    return h.summary("fsdp", rows, spec, world, steps, warmup, ratios(rows), max_rss_mib_per_rank=max_rss / MIB)


def run(args: argparse.Namespace) -> int:
    """Print the table (and JSON); exit status 1 if a config's final loss is off the reference."""
    if args.world_size < 2:
        print("fsdp: --world-size must be >= 2")
        return 2
    spec = SPECS[(args.model, args.quick)]
    steps_warmup = h.steps_and_warmup(args, "fsdp")
    if steps_warmup is None:
        return 2
    steps, warmup = steps_warmup
    per_rank = run_ranks(bench_rank, args.world_size, spec, steps, warmup, timeout=args.timeout)
    rows = combine(per_rank)
    max_rss = max(r["max_rss_bytes"] for r in per_rank)
    n_params = sum(p.numel() for p in make_model(spec).parameters())
    print(
        f"fsdp: hpservice.fsdp.fully_shard (ours) vs torch FSDP2 vs DDP; {args.world_size} gloo ranks x 1 thread\n"
        f"model: {spec.describe()}, {n_params / 1e6:.2f}M params; batch: {spec.batch_desc(args.world_size)}; "
        f"AdamW lr {LR}\n"
        f"steps per config: {warmup} warm-up + {steps} timed + 1 counting collectives + 1 sampling RSS, "
        f"configs interleaved step by step\n"
        f"step ms: slowest rank's median; tracked: params + grads + AdamW state a rank holds; "
        f"peak ru_maxrss of a rank process (all configs): {max_rss / MIB:.1f} MiB\n"
    )
    print(format_table(rows))
    r = ratios(rows)
    print(
        f"\nours/fsdp2: step time {r['step_time_ratio_vs_fsdp2']:.2f}x, "
        f"tracked memory {r['memory_ratio_vs_fsdp2']:.2f}x\n"
        f"ours/ddp:   step time {r['step_time_ratio_vs_ddp']:.2f}x, tracked memory {r['memory_ratio_vs_ddp']:.2f}x"
    )
    report = summary(rows, spec, args.world_size, steps, warmup, max_rss)
    if args.json:
        print(json.dumps(report))
    return 0 if report["max_loss_diff_vs_single"] <= args.loss_tol else 1


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("fsdp", help="time training steps: hpservice fully_shard vs torch FSDP2 vs DDP")
    p.add_argument("--world-size", type=int, default=2, help="number of local gloo ranks (default 2)")
    p.add_argument("--model", choices=("mlp", "transformer"), default="mlp", help="model to train (default mlp)")
    h.add_step_options(p, loss_tol=1e-3)
    p.set_defaults(run=run)
