"""State dicts keyed by parameter names, for the model and its optimizer.

torch's ``Optimizer.state_dict()`` keys state by parameter *index*, which changes with the
model's wrapping and the optimizer's groups; a checkpoint keys it by the parameter's
fully-qualified name instead, so it loads into a model sharded any other way. Tensor values
stay DTensors (each rank saves only its shard) or plain tensors (replicated: saved once).
"""

from __future__ import annotations

import io

import torch
import torch.nn as nn

from hpservice.dtensor import DTensor

from ._untrusted import load_param_groups, save_param_groups

__all__ = ["load_optimizer_state_dict", "optimizer_state_dict", "param_names"]


def param_names(model: nn.Module) -> dict[int, str]:
    """id(parameter) -> its first fully-qualified name (tied weights count once)."""
    return {id(p): name for name, p in model.named_parameters()}


def optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """{"state": {fqn: {key: tensor}}, "param_groups": BytesIO(torch.save of the groups, with fqn lists)}."""
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
    return {"state": state, "param_groups": save_param_groups(groups)}


def optimizer_load_targets(model: nn.Module, saved_keys: dict[tuple, object]) -> dict:
    """Tensors for DCP to load the optimizer state into, shaped and sharded like the parameters.

    ``saved_keys`` maps each saved optimizer entry's path, e.g. ("optim", "state", fqn, "exp_avg"),
    to its storage metadata.
    """
    params = dict(model.named_parameters())
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


def load_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, loaded: dict) -> None:
    """Put name-keyed optimizer state (as loaded by DCP) into ``optimizer``."""
    names = param_names(model)
    saved_groups = load_param_groups(loaded["param_groups"].getvalue())
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(
            f"optimizer has {len(optimizer.param_groups)} param groups, the checkpoint {len(saved_groups)}"
        )
    index, groups, state = 0, [], {}
    for group, saved in zip(optimizer.param_groups, saved_groups, strict=True):
        fqns = [names[id(p)] for p in group["params"]]
        if sorted(fqns) != sorted(saved["params"]):
            missing = sorted(set(fqns) - set(saved["params"]))
            extra = sorted(set(saved["params"]) - set(fqns))
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
