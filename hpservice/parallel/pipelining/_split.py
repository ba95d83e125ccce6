"""Splitting a model into pipeline stages by its blocks (torchtitan's ``pipeline_llama``).

A model that can be pipelined keeps its blocks in ``model.layers``, an ``nn.ModuleDict`` keyed
``"0"``, ``"1"``, ... and has ``keep_stage(layers, first=, last=)``, which trims it in place to
the blocks named ``layers``, plus the embedding on the first stage and the final norm and head on
the last (the built-in Llama and MLP models do; a custom model brings its own). Each stage is a
copy of the whole model built on the meta device, trimmed: parameter names stay those of the
whole model, so a checkpoint of the stages is a checkpoint of the model and loads into any other
pp size. Nothing is allocated here; the trainer lays out and initialises each stage itself.

Blocks per stage: ``layers_per_stage`` when given (``parallelism.pp_layers_per_stage``), else as
even as possible with the first stages taking one more.
"""

from __future__ import annotations

import copy

import torch.nn as nn

from ._orders import stage_rank

__all__ = ["split_layers", "split_model"]


def split_layers(n_layers: int, num_stages: int, layers_per_stage: list[int] | None = None) -> list[range]:
    """The blocks of each stage, first stage first; ``ValueError`` naming the fields when they
    cannot be split so (fewer blocks than stages, counts that do not add up)."""
    if layers_per_stage is None:
        if n_layers < num_stages:
            raise ValueError(
                f"parallelism.pp x pp_virtual_stages = {num_stages} stages, but the model has {n_layers} blocks: "
                "every stage needs at least one"
            )
        base, extra = divmod(n_layers, num_stages)
        layers_per_stage = [base + (1 if s < extra else 0) for s in range(num_stages)]
    elif len(layers_per_stage) != num_stages or sum(layers_per_stage) != n_layers or min(layers_per_stage) < 1:
        raise ValueError(
            f"parallelism.pp_layers_per_stage {layers_per_stage}: expected {num_stages} counts of at least 1 "
            f"adding up to the model's {n_layers} blocks"
        )
    bounds, start = [], 0
    for count in layers_per_stage:
        bounds.append(range(start, start + count))
        start += count
    return bounds


def split_model(
    model: nn.Module,
    pp_rank: int,
    pp: int,
    virtual_stages: int = 1,
    layers_per_stage: list[int] | None = None,
    keep_stage=None,
) -> list[tuple[int, nn.Module]]:
    """``(stage_index, module)`` for each stage pp rank ``pp_rank`` holds (stage ``s`` on rank
    ``s % pp``), each a trimmed copy of ``model`` (see the module doc). ``keep_stage(part, layers,
    first=, last=)`` trims a copy (a model bundle's ``pipeline_stage``; default, the model's own
    ``keep_stage`` method). ``ValueError`` for a model that cannot be split."""
    layers = getattr(model, "layers", None)
    if keep_stage is None and callable(getattr(model, "keep_stage", None)):
        keep_stage = type(model).keep_stage
    if not isinstance(layers, nn.ModuleDict) or keep_stage is None:
        raise ValueError(
            f"parallelism.pp > 1 needs a model whose blocks are in .layers (an nn.ModuleDict) and that has a "
            f"keep_stage(layers, first=, last=) method, as the built-in llama has; {type(model).__name__} has not"
        )
    names = list(layers.keys())
    num_stages = pp * virtual_stages
    bounds = split_layers(len(names), num_stages, layers_per_stage)
    mine = [s for s in range(num_stages) if stage_rank(s, pp) == pp_rank]
    stages = []
    for s in mine:
        part = copy.deepcopy(model)  # on the meta device: no memory
        keep_stage(part, [names[i] for i in bounds[s]], first=s == 0, last=s == num_stages - 1)
        stages.append((s, part))
    return stages
