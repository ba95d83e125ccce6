"""State dicts keyed by parameter names, for the model and its optimizer.

torch's ``Optimizer.state_dict()`` keys state by parameter *index*, which changes with the
model's wrapping and the optimizer's groups; a checkpoint keys it by the parameter's
fully-qualified name instead, so it loads into a model sharded any other way. Tensor values
stay DTensors (each rank saves only its shard) or plain tensors (replicated: saved once).

A model may come in parts (``list[nn.Module]``): a rank's pipeline stages, whose parameter names
are the whole model's. Their state is one name-keyed dict, and where the ranks hold different
parts (pipeline parallelism), each optimizer group's names are the union over ``group``'s
ranks, so the saved groups describe the whole model and load into any other split.
"""

from __future__ import annotations

import io
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from hpservice.dtensor import DTensor

from ._untrusted import load_param_groups, save_param_groups

__all__ = ["load_optimizer_state_dict", "model_state_dict", "optimizer_state_dict", "param_names"]

Model = nn.Module | Sequence[nn.Module]


def _parts(model: Model) -> list[nn.Module]:
    return [model] if isinstance(model, nn.Module) else list(model)


def model_state_dict(model: Model, *, ignore_frozen_params: bool = False) -> dict:
    """The state dict of the model, or of all its parts (their names do not overlap).

    ``ignore_frozen_params`` (torch DCP's ``StateDictOptions`` name): leave out parameters with
    ``requires_grad=False`` (a LoRA run's base, which comes from ``model.init_from`` again);
    buffers stay."""
    state: dict = {}
    for part in _parts(model):
        part_state = part.state_dict()
        if ignore_frozen_params:
            frozen = {n for n, p in part.named_parameters(remove_duplicate=False) if not p.requires_grad}
            part_state = {k: v for k, v in part_state.items() if k not in frozen}
        state.update(part_state)
    return state


def _named_parameters(model: Model) -> Iterator[tuple[str, torch.Tensor]]:
    for part in _parts(model):
        yield from part.named_parameters()


def param_names(model: Model) -> dict[int, str]:
    """id(parameter) -> its first fully-qualified name (tied weights count once)."""
    return {id(p): name for name, p in _named_parameters(model)}


def _union_over_ranks(names: list[list[str]], group) -> list[list[str]]:
    """Each optimizer group's names, united over the ranks of ``group`` (None: this rank's)."""
    if group is None or dist.get_world_size(group) == 1:
        return names
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, names, group=group)
    united = []
    for i in range(len(names)):
        seen: dict[str, None] = {}
        for theirs in every:
            seen.update(dict.fromkeys(theirs[i] if i < len(theirs) else []))
        united.append(list(seen))
    return united


def optimizer_state_dict(model: Model, optimizer: torch.optim.Optimizer, *, process_group=None) -> dict:
    """{"state": {fqn: {key: tensor}}, "param_groups": BytesIO(torch.save of the groups, with fqn
    lists united over ``process_group``'s ranks)}; collective over it when it is given."""
    names = param_names(model)
    state: dict[str, dict] = {}
    groups = []
    for group in optimizer.param_groups:
        fqns = []
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError("optimizer_state_dict: the optimizer holds a parameter that is not in the model")
            fqns.append(names[id(p)])
            if p in optimizer.state:
                state[names[id(p)]] = dict(optimizer.state[p])
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": fqns})
    for saved, fqns in zip(groups, _union_over_ranks([g["params"] for g in groups], process_group), strict=True):
        saved["params"] = fqns
    return {"state": state, "param_groups": save_param_groups(groups)}


def optimizer_load_targets(model: Model, saved_keys: dict[tuple, object]) -> dict:
    """Tensors for DCP to load the optimizer state into, shaped and sharded like the parameters.

    ``saved_keys`` maps each saved optimizer entry's path, e.g. ("optim", "state", fqn, "exp_avg"),
    to its storage metadata.
    """
    params = dict(_named_parameters(model))
    state: dict[str, dict] = {}
    for path, md in saved_keys.items():
        if len(path) != 4 or path[1] != "state":
            continue
        _, _, fqn, key = path
        size = getattr(md, "size", None)
        if size is None:
            value = None  # bytes: DCP replaces it
        elif fqn in params and tuple(size) == tuple(params[fqn].shape) and isinstance(params[fqn], DTensor):
            value = torch.zeros_like(params[fqn], dtype=md.properties.dtype)
        else:
            value = torch.zeros(tuple(size), dtype=md.properties.dtype)
        state.setdefault(fqn, {})[key] = value
    return {"state": state, "param_groups": io.BytesIO()}


def load_optimizer_state_dict(
    model: Model, optimizer: torch.optim.Optimizer, loaded: dict, *, process_group=None
) -> None:
    """Put name-keyed optimizer state (as loaded by DCP) into ``optimizer``; each group's names,
    united over ``process_group``'s ranks, must be the saved group's (collective over it)."""
    names = param_names(model)
    saved_groups = load_param_groups(loaded["param_groups"].getvalue())
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(
            f"optimizer has {len(optimizer.param_groups)} param groups, the checkpoint {len(saved_groups)}"
        )
    index, groups, state = 0, [], {}
    mine = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    united = _union_over_ranks(mine, process_group)
    for group, saved, everyone in zip(optimizer.param_groups, saved_groups, united, strict=True):
        fqns = [names[id(p)] for p in group["params"]]
        if sorted(everyone) != sorted(saved["params"]):
            missing = sorted(set(everyone) - set(saved["params"]))
            extra = sorted(set(saved["params"]) - set(everyone))
            raise ValueError(
                f"optimizer param group differs from the checkpoint: missing {missing}, unexpected {extra}"
            )
        ids = []
        for fqn in fqns:
            if fqn in loaded["state"]:
                state[index] = loaded["state"][fqn]
            ids.append(index)
            index += 1
        groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": ids})
    optimizer.load_state_dict({"state": state, "param_groups": groups})
