"""Parallel styles: how one module's parameters, inputs and outputs are laid out on a 1-d mesh.

``ColwiseParallel`` (``nn.Linear``): weight ``Shard(0)``, bias ``Shard(0)``; input expected
``Replicate``; output ``Shard(-1)``. ``RowwiseParallel``: weight ``Shard(1)``, bias ``Replicate``;
input expected ``Shard(-1)``; output ``Replicate`` (the Partial product is reduced once, the bias
is added once).

On an ``nn.Embedding``: ``ColwiseParallel`` shards the embedding dim (weight ``Shard(1)``, ids
``Replicate``, output ``Shard(-1)``); ``RowwiseParallel`` shards the vocabulary (weight
``Shard(0)``, ids ``Replicate``, each rank looks up only its own ids: a Partial output, reduced to
``Replicate`` by default).

A parameter's gradient is redistributed to the parameter's placements (a hook), so the optimizer
sees matching layouts (the vocab-parallel embedding's gradient comes back replicated and is
sliced locally: no communication). With ``use_local_output=True`` the output is the local ``torch.Tensor``, so plain
modules (an activation) can sit between a colwise and a rowwise layer.

Parameters are sliced locally (``distribute_tensor(..., src_data_rank=None)``): no communication,
so every rank must hold the same initial weights (seed the init identically).
"""

from __future__ import annotations

from torch import nn

from ..dtensor import DeviceMesh, DTensor, Placement, Replicate, Shard, distribute_tensor

__all__ = ["ColwiseParallel", "ParallelStyle", "RowwiseParallel"]


class ParallelStyle:
    """Base class: ``_apply(module, mesh)`` parallelizes ``module`` in place and returns it."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        raise NotImplementedError


def _distribute_param(module: nn.Module, name: str, mesh: DeviceMesh, placement: Placement) -> None:
    param = getattr(module, name, None)
    if param is None:
        return
    if isinstance(param, DTensor):
        raise ValueError(f"{type(module).__name__}.{name} is already a DTensor")
    dt = distribute_tensor(param.detach(), mesh, [placement], src_data_rank=None)
    new = nn.Parameter(dt, requires_grad=param.requires_grad)
    if new.requires_grad:
        placements = new.placements
        new.register_hook(lambda g: g if g.placements == placements else g.redistribute(mesh, placements))
    module.register_parameter(name, new)


class _LinearStyle(ParallelStyle):
    _weight: Placement
    _bias: Placement
    _desired_input: Placement
    _default_input: Placement
    _default_output: Placement
    # nn.Embedding: weight placement, desired and default input (the ids are replicated).
    _embedding_weight: Placement

    def __init__(
        self,
        *,
        input_layouts: Placement | None = None,
        output_layouts: Placement | None = None,
        use_local_output: bool = True,
    ):
        self._input_layouts = input_layouts
        self.output_layouts = output_layouts if output_layouts is not None else self._default_output
        self.use_local_output = use_local_output

    @property
    def input_layouts(self) -> Placement:
        """The layout of a plain-tensor input (default: ``Replicate`` ids for an embedding)."""
        return self._input_layouts if self._input_layouts is not None else self._default_input

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(input_layouts={self.input_layouts}, output_layouts={self.output_layouts}, "
            f"use_local_output={self.use_local_output})"
        )

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if device_mesh.ndim != 1:
            raise ValueError(f"{type(self).__name__}: expected a 1-d mesh, got {device_mesh}")
        if isinstance(module, nn.Linear):
            desired, default_input = self._desired_input, self._default_input
            _distribute_param(module, "weight", device_mesh, self._weight)
            _distribute_param(module, "bias", device_mesh, self._bias)
        elif isinstance(module, nn.Embedding):
            if module.max_norm is not None or module.sparse:
                raise NotImplementedError(f"{type(self).__name__}: nn.Embedding with max_norm or sparse=True")
            desired, default_input = Replicate(), Replicate()
            _distribute_param(module, "weight", device_mesh, self._embedding_weight)
        else:
            raise NotImplementedError(
                f"{type(self).__name__} supports nn.Linear and nn.Embedding only (got {type(module).__name__})"
            )
        layout = self._input_layouts if self._input_layouts is not None else default_input
        module.register_forward_pre_hook(lambda _m, inputs: self._prepare_input(inputs, device_mesh, layout, desired))
        module.register_forward_hook(lambda _m, _inputs, out: self._prepare_output(out, device_mesh))
        return module

    def _prepare_input(self, inputs: tuple, mesh: DeviceMesh, layout: Placement, desired: Placement) -> tuple:
        x = inputs[0]
        if not isinstance(x, DTensor):
            # Without shape= the global size of a sharded dim is gathered: exact for uneven shards.
            x = DTensor.from_local(x, mesh, [layout])
        x = x.redistribute(mesh, [desired])
        return (x, *inputs[1:])

    def _prepare_output(self, out: DTensor, mesh: DeviceMesh):
        out = out.redistribute(mesh, [self.output_layouts])
        return out.to_local() if self.use_local_output else out


class ColwiseParallel(_LinearStyle):
    """Shard an ``nn.Linear`` by output features (weight ``Shard(0)``, bias ``Shard(0)``), an
    ``nn.Embedding`` by embedding dim (weight ``Shard(1)``, output ``Shard(-1)``)."""

    _weight = Shard(0)
    _bias = Shard(0)
    _desired_input = Replicate()
    _default_input = Replicate()
    _default_output = Shard(-1)
    _embedding_weight = Shard(1)


class RowwiseParallel(_LinearStyle):
    """Shard an ``nn.Linear`` by input features (weight ``Shard(1)``, bias ``Replicate``), an
    ``nn.Embedding`` by vocabulary (weight ``Shard(0)``, ids ``Replicate``, output ``Replicate``)."""

    _weight = Shard(1)
    _bias = Replicate()
    _desired_input = Shard(-1)
    _default_input = Shard(-1)
    _default_output = Replicate()
    _embedding_weight = Shard(0)
