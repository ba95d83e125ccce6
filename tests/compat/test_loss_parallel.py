"""torch's ``loss_parallel()`` recipe through torch and through ours on the same gloo ranks:
``F.cross_entropy`` of class-sharded logits gives torch's loss (value and placements) and the
same gradients, for each reduction, ignored targets and logits with the class on dim 1 of 3."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


def _apis():
    import torch.distributed.tensor as t
    import torch.distributed.tensor.parallel as tp
    from torch.distributed.device_mesh import init_device_mesh

    import hpservice.dtensor as ours
    import hpservice.parallel as our_tp

    world = dist.get_world_size()
    return {
        "ours": (ours, our_tp, ours.init_device_mesh("cpu", (world,))),
        "torch": (t, tp, init_device_mesh("cpu", (world,))),
    }


def _recipes():
    torch.manual_seed(0)
    head = nn.Linear(8, 10)  # 10 classes: uneven over 4 ranks
    x = torch.randn(6, 8)
    target = torch.tensor([1, 9, 0, -100, 5, 3])
    seq_target = torch.randint(0, 10, (2, 3))
    out = {}
    for name, (api, tp, mesh) in _apis().items():
        results = {}
        for reduction in ("mean", "sum", "none"):
            model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 10))
            model[1].load_state_dict(head.state_dict())
            with torch.no_grad():
                model[0].weight.copy_(torch.eye(8))
                model[0].bias.zero_()
            tp.parallelize_module(model, mesh, {"1": tp.ColwiseParallel(use_local_output=False)})
            with tp.loss_parallel():
                logits = model(x)
                loss = F.cross_entropy(logits, target, reduction=reduction)
                loss.sum().backward() if reduction == "none" else loss.backward()
            grad = model[1].weight.grad
            results[reduction] = (
                type(loss).__name__, tuple(type(p).__name__ for p in loss.placements), tuple(loss.shape),
                loss.full_tensor().detach(), grad.full_tensor(), model[0].weight.grad.clone(),
            )  # fmt: skip
        # class on dim 1 of 3 (N, C, S): the logits of a 1-D conv head
        logits3 = api.distribute_tensor(torch.randn(2, 10, 3, generator=torch.Generator().manual_seed(3)), mesh, [api.Shard(1)])
        with tp.loss_parallel():
            results["3d"] = F.cross_entropy(logits3, seq_target).full_tensor()
        out[name] = results
    with pytest.raises(NotImplementedError, match="with label_smoothing is not supported yet"):
        ours_api, our_tp, mesh = _apis()["ours"]
        logits = ours_api.distribute_tensor(torch.randn(6, 10), mesh, [ours_api.Shard(1)])
        with our_tp.loss_parallel():
            F.cross_entropy(logits, target, label_smoothing=0.1)
    return out


def test_loss_parallel_is_torchs(ranks):
    for result in ranks(4).run(_recipes):
        ours, theirs = result["ours"], result["torch"]
        for key in ("mean", "sum", "none"):
            assert ours[key][:3] == theirs[key][:3], (key, ours[key][:3], theirs[key][:3])
            for mine, torchs in zip(ours[key][3:], theirs[key][3:], strict=True):
                torch.testing.assert_close(mine, torchs, msg=key)
        torch.testing.assert_close(ours["3d"], theirs["3d"])
