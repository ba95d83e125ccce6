"""Where a job's workers go: placement-group bundles that keep each shard group inside one node.

Ranks are laid out as the device mesh is, ``(pp, dp_replicate, dp_shard, cp, tp)`` row-major, so
the ranks of one shard group (``dp_shard x cp x tp`` of them: the all-gathers and reduce-scatters
of every layer, tensor parallelism's per-op collectives, context parallelism's ring) are
consecutive, and only the gradient all-reduce of HSDP and the pipeline's point-to-point
activations run between groups. A group must therefore sit inside one node, while
``dp_replicate`` and ``pp`` (the outermost dim: a stage's groups, then the next stage's) may span
nodes.

``resources.placement``:

- ``shard_group`` (default): one bundle per shard group holding all of its workers' resources. A
  bundle never spans nodes, so Ray itself keeps each group whole; the bundles are PACKed (several
  groups may share a node). Worker ``r`` runs in bundle ``r // group_size``. A group larger than
  every node is refused with the reason (the job can never start).
- ``pack``, ``spread``, ``strict_pack``: one bundle per worker with Ray's strategy of that name;
  groups may then span nodes (``strict_pack``: every worker on one node).

Pure functions of the spec and of the cluster's node resources, so the coordinator, the
supervisor and the tests decide the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

PLACEMENTS = ("shard_group", "pack", "spread", "strict_pack")


@dataclass(frozen=True)
class PlacementPlan:
    """Ray placement-group bundles for one attempt, and the bundle each rank runs in."""

    placement: str
    strategy: str  # Ray's placement-group strategy
    worker: dict  # the resources of one worker (its share of its bundle)
    bundles: tuple[dict, ...]
    bundle_of_rank: tuple[int, ...]
    group_size: int  # ranks that must share a node (1 when the placement does not keep groups)

    @property
    def workers(self) -> int:
        return len(self.bundle_of_rank)


def shard_group_size(spec) -> int:
    """Ranks in one shard group: ``dp_shard x cp x tp`` (the innermost mesh dims)."""
    from hpservice.parallel_dims import ParallelDims

    return ParallelDims.from_spec(spec.parallelism, spec.resources.workers).shard_group_size


def worker_resources(spec, gpus: int) -> dict:
    return {"CPU": spec.resources.cpus_per_worker, **({"GPU": gpus} if gpus else {})}


def plan_placement(spec, gpus: int) -> PlacementPlan:
    """The bundles of ``spec``'s workers (``gpus``: GPUs per worker, 0 or 1)."""
    n = spec.resources.workers
    one = worker_resources(spec, gpus)
    placement = spec.resources.placement
    if placement == "shard_group":
        size = shard_group_size(spec)
        bundle = {k: v * size for k, v in one.items()}
        bundles = tuple(dict(bundle) for _ in range(n // size))
        return PlacementPlan(placement, "PACK", one, bundles, tuple(r // size for r in range(n)), size)
    return PlacementPlan(placement, placement.upper(), one, tuple(dict(one) for _ in range(n)), tuple(range(n)), 1)


def _fits(bundle: dict, resources: dict) -> int:
    """How many ``bundle``s ``resources`` (one node's) hold."""
    counts = [math.floor(resources.get(k, 0) / v + 1e-9) for k, v in bundle.items() if v > 0]
    return min(counts) if counts else 1_000_000


def _describe(resources: dict) -> str:
    return ", ".join(f"{resources[k]:g} {k}" for k in ("CPU", "GPU") if k in resources) or "nothing"


def infeasible(plan: PlacementPlan, nodes: list[dict], spec) -> str | None:
    """None if ``plan`` can ever be placed on ``nodes`` (each node's total resources), else why
    not, and how to make it fit."""
    bundle = plan.bundles[0]
    per_node = [_fits(bundle, r) for r in nodes]
    if plan.strategy == "STRICT_PACK":
        room = max((_fits(plan.worker, r) for r in nodes), default=0)
        if room >= plan.workers:
            return None
        return (
            f"resources.placement strict_pack puts all {plan.workers} workers on one node; the largest holds {room} "
            f"(nodes: {'; '.join(_describe(r) for r in nodes)}); use placement pack to let them span nodes"
        )
    if sum(per_node) >= len(plan.bundles):
        return None
    one = plan.worker
    need = f"{plan.workers} workers x ({_describe(one)})"
    where = f"the cluster has {len(nodes)} node(s): {'; '.join(_describe(r) for r in nodes) or 'none alive'}"
    fixes = []
    if plan.group_size > 1:
        largest = max((_fits(one, r) for r in nodes), default=0)
        what = f"each shard group (dp_shard x tp = {plan.group_size} workers, {_describe(bundle)}) must fit in one node"
        why = f"job needs {need}; {what}, and only {sum(per_node)} of the {len(plan.bundles)} groups fit; {where}"
        if 0 < largest < plan.group_size:
            fixes.append(f"shard groups of at most {largest} workers (set parallelism.dp_replicate to split the world)")
        fixes.append("--set resources.placement=pack (shard groups may then span nodes: slower collectives)")
    else:
        why = f"job needs {need}; {where}, room for {sum(per_node)} such workers"
    biggest = max((r.get("CPU", 0) for r in nodes), default=0)
    share = math.floor(biggest / spec.resources.workers * 4) / 4  # CPUs per worker that fit all workers on one node
    if "GPU" not in one and share > 0:
        fixes.append(f"--set resources.cpus_per_worker={share:g} (the workers then share the cores)")
    cpus = math.ceil(spec.resources.workers * spec.resources.cpus_per_worker)
    fixes.append(f"a larger cluster (e.g. hpservice serve --num-cpus {cpus} on one machine)")
    return f"{why}; to fit it: {' or '.join(fixes)}"



def cluster_fit(spec, gpus: int, alive: list[dict] | None = None) -> str | None:
    """None if ``spec``'s workers (``gpus`` each) can ever be placed on this cluster's live nodes
    as its placement asks, else why not and how to make it fit (``infeasible``). ``alive``: their
    resources, read once by a caller checking many jobs; None reads them from Ray now."""
    if alive is None:
        from . import nodes

        alive = nodes.alive_resources()
    return infeasible(plan_placement(spec, gpus), alive, spec)
