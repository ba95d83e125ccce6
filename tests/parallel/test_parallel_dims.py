"""ParallelDims: the mesh's dims and each rank's data-parallel slice, against torch's own
DeviceMesh built by hand for the same layout."""

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh

from hpservice.parallel_dims import DP_REPLICATE, DP_SHARD, TP, ParallelDims
from hpservice.spec import ParallelismSpec, SpecError


@pytest.mark.parametrize(
    ("parallelism", "world", "dims", "fsdp"),
    [
        ({}, 1, [(DP_SHARD, 1)], (DP_SHARD,)),
        ({}, 4, [(DP_SHARD, 4)], (DP_SHARD,)),
        ({"dp_replicate": 2}, 4, [(DP_REPLICATE, 2), (DP_SHARD, 2)], (DP_REPLICATE, DP_SHARD)),
        ({"tp": 2}, 4, [(DP_SHARD, 2), (TP, 2)], (DP_SHARD,)),
        ({"tp": 4}, 4, [(TP, 4)], ()),  # tensor parallelism alone: nothing for fully_shard
        ({"dp_replicate": 2, "tp": 2}, 4, [(DP_REPLICATE, 2), (DP_SHARD, 1), (TP, 2)], (DP_REPLICATE, DP_SHARD)),
    ],
)
def test_sizes_and_mesh_dims_follow_the_spec(parallelism, world, dims, fsdp):
    d = ParallelDims.from_spec(ParallelismSpec(**parallelism), world)
    assert d.mesh_dims == dims and d.fsdp_dim_names == fsdp
    assert d.dp_replicate * d.dp_shard * d.tp == world
    assert d.dp_size == d.dp_replicate * d.dp_shard and d.shard_group_size == d.dp_shard * d.tp


def test_a_layout_that_does_not_fill_the_world_is_refused_naming_the_fields():
    with pytest.raises(SpecError, match="dp_replicate 1 x dp_shard 3 x tp 1 != world size 4"):
        ParallelDims.from_spec(ParallelismSpec(dp_shard=3), 4)
    with pytest.raises(SpecError, match="not divisible by dp_replicate x tp = 3"):
        ParallelDims.from_spec(ParallelismSpec(tp=3), 4)
    with pytest.raises(RuntimeError, match="build_mesh"):
        ParallelDims(1, 2, 1, 2).world_mesh  # noqa: B018


def _mesh_ranks(parallelism):
    d = ParallelDims.from_spec(ParallelismSpec(**parallelism), dist.get_world_size())
    mesh = d.build_mesh("cpu")
    names, sizes = zip(*d.mesh_dims, strict=True)
    theirs = torch_init_device_mesh("cpu", sizes, mesh_dim_names=names)
    # the data-parallel rank: the flat index over torch's (dp_replicate, dp_shard) coordinates
    coords = dict(zip(names, theirs.get_coordinate(), strict=True))
    expected = coords.get(DP_REPLICATE, 0) * d.dp_shard + coords.get(DP_SHARD, 0)
    return (
        mesh.mesh.tolist() == theirs.mesh.tolist(),
        d.dp_rank == expected,
        d.tp_mesh.get_local_rank() == coords[TP] if d.tp > 1 else d.tp_mesh is None,
        d.dp_mesh.size() == d.dp_size if d.fsdp_dim_names else d.dp_mesh is None,
    )


@pytest.mark.parametrize("parallelism", [{}, {"dp_replicate": 2}, {"tp": 2}, {"dp_replicate": 2, "tp": 2}, {"tp": 4}])
def test_the_mesh_and_data_parallel_rank_match_torchs_mesh(ranks, parallelism):
    for result in ranks(4).run(_mesh_ranks, parallelism):
        assert result == (True, True, True, True)
