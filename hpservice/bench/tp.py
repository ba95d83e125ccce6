"""Tensor-parallel benchmark: ``hpservice.parallel`` against ``torch.distributed.tensor.parallel``.

What is measured: whole training steps (``zero_grad``, forward, loss, backward, AdamW ``step``)
of the same model, from the same initial values, on the same data, in three configurations:

- ``ours``   ``hpservice.parallel`` on an ``hpservice.dtensor`` mesh
- ``torch``  ``torch.distributed.tensor.parallel`` with the same plan on a torch
  ``init_device_mesh``
- ``single`` one process, no parallelism: the loss every other config must match

Models (``--model``):

- ``mlp``: a stack of residual blocks ``x + fc2(gelu(fc1(norm(x))))`` (``Linear(d, 4d)`` and
  ``Linear(4d, d)`` with biases, a LayerNorm in front), then a final LayerNorm; MSE loss against a
  random target. Plan: ``fc1`` colwise, ``fc2`` rowwise in every block (both libraries' defaults:
  plain-tensor input and output, the GELU runs on the local hidden slice). The norms stay plain
  replicated modules.
- ``llama``: the built-in ``hpservice.models.llama.Llama``. ours: ``apply_llama_tp`` (no sequence
  parallelism, vocab-parallel token embedding) and ``vocab_parallel_cross_entropy`` on the
  vocab-sharded logits. torch: the same module names with torch's styles: ``wq``/``wk``/``wv``/
  ``w1``/``w3`` ``ColwiseParallel()`` (local outputs, so attention runs on the local heads),
  ``wo``/``w2`` ``RowwiseParallel()``, ``tok_embeddings`` ``RowwiseParallel(input_layouts=Replicate())``
  (vocab-parallel lookup), ``output`` ``ColwiseParallel(use_local_output=False)`` and the cross
  entropy (forward and backward) inside ``loss_parallel()``; each ``Attention``'s ``n_heads`` /
  ``n_kv_heads`` divided by the tp degree exactly as ``apply_llama_tp`` does.

Tensor parallelism splits the model, not the data: every rank trains on the whole (same) batch,
and ``single`` trains on that batch too.

The two distributed configs live side by side in the same rank processes (one ``run_ranks``
call) and take turns one step at a time, rotating which goes first; every step starts with a
barrier. ``single`` runs afterwards on rank 0 for as many steps.

Per config, reported:

- step ms: each rank's median over the timed steps; the slowest rank's median is reported.
- tracked MiB/rank: bytes of the parameters, gradients and AdamW state a rank holds after the
  last step (local tensors of DTensors, ours or torch's); the largest rank is reported.
- coll/step: backend collectives (``gloo:*`` events of ``torch.profiler``) in one untimed step:
  the same counter for both libraries.
- final loss: the loss of the last step (the same on every rank; the mean over ranks is
  reported), and its distance to the single-process loss.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from hpservice.bench import _harness as h
from hpservice.bench._harness import LR, MLP, REFERENCE
from hpservice.launch import run_ranks

__all__ = ["MLP", "TPWorkload", "add_parser", "bench_rank", "combine", "format_table", "summary"]

CONFIGS = ("ours", "torch")


# ---- models ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TPWorkload:
    """Model and data sizes. The batch is ``batch x seq`` (rows of the MLP's input, or tokens);
    the same on every rank. Llama: ``dim``, ``depth``, ``heads``, ``kv_heads``, ``vocab`` are
    the ``LlamaConfig`` fields ``dim``, ``n_layers``, ``n_heads``, ``n_kv_heads``, ``vocab_size``."""

    kind: str  # "mlp" or "llama"
    dim: int
    depth: int
    batch: int
    seq: int
    heads: int = 0
    kv_heads: int = 0
    vocab: int = 0
    sequence_parallel: bool = False  # llama: the plan's sequence parallelism (both libraries)

    def llama_config(self):
        from hpservice.models.llama import LlamaConfig

        return LlamaConfig(
            dim=self.dim,
            n_layers=self.depth,
            n_heads=self.heads,
            n_kv_heads=self.kv_heads,
            vocab_size=self.vocab,
            max_seq_len=max(self.seq, 16),
        )

    def describe(self) -> str:
        if self.kind == "mlp":
            return f"{self.depth} residual MLP blocks, dim {self.dim} (hidden {4 * self.dim})"
        cfg = self.llama_config()
        return (
            f"Llama: {self.depth} layers, dim {self.dim}, {self.heads} heads / {self.kv_heads} kv heads, "
            f"ffn {cfg.ffn_hidden_dim}, vocab {self.vocab}" + (", sequence parallel" if self.sequence_parallel else "")
        )

    def batch_desc(self) -> str:
        unit = f"{self.seq} rows of dim {self.dim}" if self.kind == "mlp" else f"sequences of {self.seq} tokens"
        return f"{self.batch} x {unit}, the same on every rank"

    def check(self, world: int) -> str | None:
        """Why ``world`` cannot split this model evenly (torch needs even shards), or None."""
        if self.kind == "mlp":
            sizes = {"dim": self.dim, "hidden": 4 * self.dim}
        else:
            cfg = self.llama_config()
            sizes = {"n_heads": self.heads, "n_kv_heads": self.kv_heads, "ffn": cfg.ffn_hidden_dim, "vocab": self.vocab}
        bad = [f"{k} {v}" for k, v in sizes.items() if v % world]
        return f"{', '.join(bad)} not divisible by --world-size {world}" if bad else None


SPECS = {
    ("mlp", False): TPWorkload("mlp", dim=256, depth=4, batch=16, seq=8),
    ("mlp", True): TPWorkload("mlp", dim=32, depth=2, batch=4, seq=4),
    # The "small" flavor's shapes (dim 256, 4 layers, 8 / 4 heads, vocab 256).
    ("llama", False): TPWorkload("llama", dim=256, depth=4, batch=2, seq=64, heads=8, kv_heads=4, vocab=256),
    # The "tiny" flavor (LlamaConfig defaults).
    ("llama", True): TPWorkload("llama", dim=64, depth=2, batch=2, seq=16, heads=4, kv_heads=2, vocab=256),
}


def make_model(spec: TPWorkload) -> nn.Module:
    if spec.kind == "mlp":
        return MLP(spec.dim, spec.depth)
    from hpservice.models.llama import Llama

    return Llama(spec.llama_config())


def global_batch(spec: TPWorkload, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of ``step``: the same on every rank and in every config."""
    g = torch.Generator().manual_seed(10_000 + step)
    if spec.kind == "mlp":
        shape = (spec.batch, spec.seq, spec.dim)
        return torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    tokens = torch.randint(0, spec.vocab, (spec.batch, spec.seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


# ---- the configurations ----------------------------------------------------------------------


def _mlp_plan(model: nn.Module, colwise, rowwise) -> dict:
    plan = {}
    for i in range(len(model.blocks)):
        plan[f"blocks.{i}.fc1"] = colwise()
        plan[f"blocks.{i}.fc2"] = rowwise()
    return plan


def _wrap_ours(spec: TPWorkload, model: nn.Module, world: int) -> nn.Module:
    from hpservice.dtensor import init_device_mesh
    from hpservice.parallel import ColwiseParallel, RowwiseParallel, apply_llama_tp, parallelize_module

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    if spec.kind == "mlp":
        return parallelize_module(model, mesh, _mlp_plan(model, ColwiseParallel, RowwiseParallel))
    return apply_llama_tp(model, mesh, sequence_parallel=spec.sequence_parallel)


def torch_llama_plan(model: nn.Module, sequence_parallel: bool = False) -> dict:
    """torch styles on the module names of ``hpservice.parallel.llama_tp_plan`` (vocab-parallel
    embedding; with ``sequence_parallel`` torchtitan's layout, as ours)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    seq = Shard(1) if sequence_parallel else Replicate()
    plan = {
        # torch's RowwiseParallel takes a plain input as Shard(-1) unless told: the ids are replicated.
        "tok_embeddings": RowwiseParallel(
            input_layouts=Replicate(), output_layouts=seq, use_local_output=not sequence_parallel
        ),
        "output": ColwiseParallel(input_layouts=seq, use_local_output=False),
    }
    if sequence_parallel:
        plan["norm"] = SequenceParallel()
    for key in model.layers:
        p = f"layers.{key}."
        for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
            plan[p + name] = ColwiseParallel()
        plan[p + "attention.wo"] = RowwiseParallel(output_layouts=seq, use_local_output=not sequence_parallel)
        plan[p + "feed_forward.w2"] = RowwiseParallel(output_layouts=seq, use_local_output=not sequence_parallel)
        if sequence_parallel:
            plan[p + "attention_norm"] = SequenceParallel()
            plan[p + "ffn_norm"] = SequenceParallel()
            plan[p + "attention"] = PrepareModuleInput(
                input_layouts=(seq, None), desired_input_layouts=(Replicate(), None)
            )
            plan[p + "feed_forward"] = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
    return plan


def _wrap_torch(spec: TPWorkload, model: nn.Module, world: int) -> nn.Module:
    from torch.distributed.tensor import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    if spec.kind == "mlp":
        return parallelize_module(model, mesh, _mlp_plan(model, ColwiseParallel, RowwiseParallel))
    from hpservice.parallel import llama_tp_plan

    plan = torch_llama_plan(model, spec.sequence_parallel)
    ours = llama_tp_plan(model, world, sequence_parallel=spec.sequence_parallel)
    if set(plan) != set(ours):  # the same module names as our plan, or the comparison is off
        raise AssertionError(f"torch plan {sorted(set(plan) ^ set(ours))} differ from llama_tp_plan")
    parallelize_module(model, mesh, plan)
    for layer in model.layers.values():
        layer.attention.n_heads //= world
        layer.attention.n_kv_heads //= world
    return model


def _loss_ours(spec: TPWorkload, out, y: torch.Tensor) -> torch.Tensor:
    if spec.kind == "mlp":
        return F.mse_loss(out, y)
    from hpservice.parallel import vocab_parallel_cross_entropy

    return vocab_parallel_cross_entropy(out.flatten(0, 1), y.flatten())


def _loss_plain(spec: TPWorkload, out, y: torch.Tensor) -> torch.Tensor:
    if spec.kind == "mlp":
        return F.mse_loss(out, y)
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


class _TPConfigTrainer(h.ConfigTrainer):
    """One configuration: its model, AdamW, and what was measured."""

    def __init__(self, name: str, spec: TPWorkload, base: nn.Module, world: int):
        wrap = {"ours": _wrap_ours, "torch": _wrap_torch}.get(name)
        super().__init__(name, spec, base, lambda model: wrap(spec, model, world) if wrap else model)

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = self.model(x)
        if self.name == "torch" and self.spec.kind == "llama":
            from torch.distributed.tensor.parallel import loss_parallel

            with loss_parallel():  # the backward too: it starts from the sharded logits
                loss = _loss_plain(self.spec, out, y)
                loss.backward()
        else:
            loss = (_loss_ours if self.name == "ours" else _loss_plain)(self.spec, out, y)
            loss.backward()
        return loss


# ---- per rank --------------------------------------------------------------------------------


def bench_rank(spec: TPWorkload, steps: int, warmup: int) -> dict:
    """Run on every rank: train both distributed configs, interleaved; rank 0 then runs the
    single-process reference. Returns this rank's medians, memory, counts and final losses."""
    rank, world = h.start_rank()
    base = make_model(spec)

    def batch(step: int) -> h.Batch:
        return global_batch(spec, step)

    results = h.train_all(lambda name: _TPConfigTrainer(name, spec, base, world), CONFIGS, batch, batch, steps, warmup)
    return {"rank": rank, "results": results}


# ---- report ----------------------------------------------------------------------------------


def combine(per_rank: Sequence[dict]) -> dict[str, dict]:
    """One row per config: slowest rank's median, largest rank's memory, mean final loss."""
    return h.combine(per_rank, CONFIGS, loss_spread=True)


COLUMNS = (h.STEP_MS, h.TRACKED, h.COLLECTIVES, h.FINAL_LOSS, h.LOSS_DIFF)


def format_table(rows: dict[str, dict]) -> str:
    return h.format_table(rows, COLUMNS, "one process, no parallelism, the same batch; run on rank 0 after the others")


def ratios(rows: dict[str, dict]) -> dict[str, float]:
    ours, theirs = rows["ours"], rows["torch"]
    return {
        "ratio_ours_vs_torch": ours["step_ms"] / theirs["step_ms"],
        "memory_ratio_ours_vs_torch": ours["tracked_mib"] / theirs["tracked_mib"],
        "memory_ratio_ours_vs_single": ours["tracked_mib"] / rows[REFERENCE]["tracked_mib"],
    }


def summary(rows: dict[str, dict], spec: TPWorkload, world: int, steps: int, warmup: int) -> dict:
    return h.summary("tp", rows, spec, world, steps, warmup, ratios(rows))


def run(args: argparse.Namespace) -> int:
    """Print the table (and JSON); exit status 1 if a config's final loss is off the reference."""
    if args.world_size < 2:
        print("tp: --world-size must be >= 2")
        return 2
    spec = SPECS[(args.model, args.quick)]
    if args.sequence_parallel:
        if spec.kind != "llama":
            print("tp: --sequence-parallel needs --model llama")
            return 2
        spec = dataclasses.replace(spec, sequence_parallel=True)
    why = spec.check(args.world_size)
    if why:
        print(f"tp: {spec.kind}: {why}")
        return 2
    steps_warmup = h.steps_and_warmup(args, "tp")
    if steps_warmup is None:
        return 2
    steps, warmup = steps_warmup
    per_rank = run_ranks(bench_rank, args.world_size, spec, steps, warmup, timeout=args.timeout)
    rows = combine(per_rank)
    torch.manual_seed(0)
    n_params = sum(p.numel() for p in make_model(spec).parameters())
    print(
        f"tp: hpservice.parallel (ours) vs torch.distributed.tensor.parallel (torch); "
        f"{args.world_size} gloo ranks x 1 thread, tp degree {args.world_size}\n"
        f"model: {spec.describe()}, {n_params / 1e6:.2f}M params; batch: {spec.batch_desc()}; AdamW lr {LR}\n"
        f"steps per config: {warmup} warm-up + {steps} timed + 1 counting collectives, "
        f"configs interleaved step by step\n"
        f"step ms: slowest rank's median; tracked: params + grads + AdamW state a rank holds; "
        f"coll/step: gloo collectives (torch.profiler) in one step\n"
    )
    print(format_table(rows))
    r = ratios(rows)
    print(
        f"\nours/torch: step time {r['ratio_ours_vs_torch']:.2f}x, "
        f"tracked memory {r['memory_ratio_ours_vs_torch']:.2f}x (ours/single {r['memory_ratio_ours_vs_single']:.2f}x)"
    )
    report = summary(rows, spec, args.world_size, steps, warmup)
    if args.json:
        print(json.dumps(report))
    return 0 if report["max_loss_diff_vs_single"] <= args.loss_tol else 1


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "tp", help="time training steps: hpservice tensor parallelism vs torch.distributed.tensor.parallel"
    )
    p.add_argument("--world-size", type=int, default=2, help="number of local gloo ranks = tp degree (default 2)")
    p.add_argument("--model", choices=("mlp", "llama"), default="mlp", help="model to train (default mlp)")
    p.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="llama: the plans' sequence parallelism (norms and residual stream sharded on the sequence)",
    )
    h.add_step_options(p, loss_tol=1e-4)
    p.set_defaults(run=run)
