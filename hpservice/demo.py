"""A tour of the DTensor core on local gloo ranks: ``hpservice demo``.

Each rank holds a piece of one global tensor on a 2-d mesh ("dp", "tp"); the demo moves it
through the main transitions, prints the plan of each (the planner is pure: no communication),
and checks every result against the single-device tensor.
"""

from __future__ import annotations

import torch

from hpservice.launch import run_ranks


def _tour(mesh_shape: tuple[int, int]) -> list[tuple[str, str, str, bool]]:
    from hpservice.dtensor import (
        DTensor,
        Partial,
        Replicate,
        Shard,
        distribute_tensor,
        init_device_mesh,
        plan_redistribution,
        random,
    )

    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    full = torch.randn(7, 5)  # uneven on purpose: 7 rows over the mesh
    rows = []
    transitions = [
        ((Shard(0), Shard(1)), (Replicate(), Replicate())),
        ((Shard(0), Replicate()), (Shard(1), Shard(0))),
        ((Shard(0), Shard(0)), (Replicate(), Shard(1))),
        ((Replicate(), Replicate()), (Shard(1), Shard(0))),
    ]
    for src, dst in transitions:
        dt = distribute_tensor(full, mesh, src)
        out = dt.redistribute(mesh, dst)
        plan = plan_redistribution(dt._spec, out._spec)
        rows.append(
            (_fmt(src), _fmt(dst), " -> ".join(type(s).__name__ for s in plan), torch.equal(out.full_tensor(), full))
        )
    # Partial -> Shard(0): one reduce-scatter; the global value is the sum over ranks.
    local = torch.full((7, 5), float(mesh.get_rank()))
    dt = DTensor.from_local(local, mesh, [Partial(), Partial()])
    out = dt.redistribute(mesh, [Shard(0), Shard(1)])
    total = float(sum(range(mesh.size())))
    rows.append(
        (
            "(P(sum), P(sum))",
            "(S(0), S(1))",
            "ReduceScatter -> ReduceScatter",
            torch.equal(out.full_tensor(), torch.full((7, 5), total)),
        )
    )
    # Sharded random init equals the replicated (single-device) init from the same seed.
    random.manual_seed(1234)
    sharded = distribute_tensor(torch.empty(7, 5), mesh, [Shard(0), Shard(1)], src_data_rank=None).uniform_()
    random.manual_seed(1234)
    whole = distribute_tensor(torch.empty(7, 5), mesh, [Replicate(), Replicate()], src_data_rank=None).uniform_()
    plan = plan_redistribution(sharded._spec, whole._spec)
    rows.append(
        (
            "uniform_ on (S(0), S(1))",
            "(R, R)",
            " -> ".join(type(s).__name__ for s in plan),
            torch.equal(sharded.full_tensor(), whole.to_local()),
        )
    )
    return rows


def _fmt(placements) -> str:
    return "(" + ", ".join(map(str, placements)) + ")"


def run_demo(ranks: int = 4) -> int:
    if ranks < 2 or ranks % 2:
        print("hpservice demo: --ranks must be an even number >= 2")
        return 2
    shape = (2, ranks // 2)
    rows = run_ranks(_tour, ranks, shape, timeout=300)[0]
    print(f"DTensor core demo: {ranks} gloo ranks, mesh {shape} ('dp', 'tp'), global tensor 7x5\n")
    print(f"{'from':<26} {'to':<16} {'plan':<36} matches single device")
    ok = True
    for src, dst, plan, good in rows:
        ok &= good
        print(f"{src:<26} {dst:<16} {plan:<36} {'yes' if good else 'NO'}")
    print("\nall results equal the single-device computation" if ok else "\nMISMATCH")
    return 0 if ok else 1
