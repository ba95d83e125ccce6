"""Parallel styles: how one module's parameters, inputs and outputs are laid out on a 1-d mesh.

``ColwiseParallel`` (``nn.Linear``): weight ``Shard(0)``, bias ``Shard(0)``; input expected
``Replicate``; output ``Shard(-1)``. ``RowwiseParallel``: weight ``Shard(1)``, bias ``Replicate``;
input expected ``Shard(-1)``; output ``Replicate`` (the Partial product is reduced once, the bias
is added once).

On an ``nn.Embedding``: ``ColwiseParallel`` shards the embedding dim (weight ``Shard(1)``, ids
``Replicate``, output ``Shard(-1)``); ``RowwiseParallel`` shards the vocabulary (weight
``Shard(0)``, ids ``Replicate``, each rank looks up only its own ids: a Partial output, reduced to
``Replicate`` by default).

A parameter's gradient is redistributed to the parameter's placements (a tensor hook, put back
before each forward when the parameter was replaced, e.g. by ``to_empty`` or a checkpoint load),
so the optimizer sees matching layouts. The vocab-parallel embedding runs a local lookup whose
backward builds only the local rows of its gradient. With ``use_local_output=True`` the output is
the local ``torch.Tensor``, so plain modules (an activation) can sit between a colwise and a
rowwise layer.

A LoRA layer (``hpservice.models.lora.LoRALinear``: ``lora_A [r, in]``, ``lora_B [out, r]``) has
its adapters placed to match its base weight, so the forward needs no collective beyond the base
layer's: colwise, ``lora_A`` ``Replicate`` and ``lora_B`` ``Shard(0)`` (the update comes out
``Shard(-1)`` like the base output); rowwise, ``lora_A`` ``Shard(1)`` and ``lora_B`` ``Replicate``
(the update is Partial and rides the base product's one reduction). In the backward the ``r``-wide
partial product's gradient is all-reduced (``[tokens, r]`` or ``[r, in]``, small beside the base).

Both accept ``input_layouts`` (the layout of a plain-tensor input; a DTensor input is taken as it
is) and ``output_layouts`` (what the output is redistributed to) as in torch: e.g.
``ColwiseParallel(input_layouts=Shard(1))`` all-gathers a sequence-sharded input,
``RowwiseParallel(output_layouts=Shard(1))`` reduce-scatters the Partial product onto the
sequence dim (sequence parallelism).

``SequenceParallel`` (norms, dropout, any module computing per position): parameters
``Replicate``, input and output sharded on the sequence dim; the parameters' Partial gradients
(each rank saw only its positions) are all-reduced by the same hook. ``PrepareModuleInput`` /
``PrepareModuleOutput`` / ``PrepareModuleInputOutput`` only convert a module's inputs / outputs
(plain tensors are annotated with ``DTensor.from_local`` in the given layout, then redistributed
to the desired one; ``None`` entries are passed through).

Differences from torch: a DTensor input or output is always brought to the desired layout (torch
skips the redistribution when ``input_layouts == desired_input_layouts``, even if the DTensor has
another layout); bad arguments raise ``ValueError`` / ``TypeError`` (torch: ``AssertionError``);
a plain tensor annotated with a ``Shard`` layout may be an uneven ``torch.chunk`` piece (its global
size is gathered; torch assumes even pieces).

Parameters are sliced locally (``distribute_tensor(..., src_data_rank=None)``): no communication,
so every rank must hold the same initial weights (seed the init identically).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from .._graph_break import eager_under_compile
from ..dtensor import DeviceMesh, DTensor, Partial, Placement, Replicate, Shard, distribute_tensor

__all__ = [
    "ColwiseParallel",
    "ParallelStyle",
    "PrepareModuleInput",
    "PrepareModuleInputOutput",
    "PrepareModuleOutput",
    "RowwiseParallel",
    "SequenceParallel",
]


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
    _grad_to_layout(new)
    module.register_parameter(name, new)


_HOOKED = "_hpservice_grad_to_layout"


def _grad_to_layout(param) -> None:
    """Give ``param``'s gradient ``param``'s own layout (a tensor hook, registered once per tensor).

    Parameters get replaced or swapped after a plan is applied (``to_empty`` from the meta device
    drops tensor hooks and the tensor's attributes together, a checkpoint load or ``fully_shard``
    installs other tensors), so the styles call this again before every forward on the parameters
    the module holds then; the marker attribute makes it a no-op where the hook is in place.
    """
    if not isinstance(param, DTensor) or not param.requires_grad or getattr(param, _HOOKED, False):
        return
    mesh, placements = param.device_mesh, param.placements
    stale = param.is_leaf and param._backward_hooks is not None
    param.register_hook(lambda g: g if g.placements == placements else g.redistribute(mesh, placements))
    if stale:
        # ``torch.utils.swap_tensors`` (``to_empty``) keeps the Python dict of hooks but not its
        # installation on the new tensor, and ``register_hook`` only installs a new dict: install
        # it again (it holds the hooks registered on this parameter before, which fire again too).
        param._backward_hooks = param._backward_hooks
    setattr(param, _HOOKED, True)


@eager_under_compile
def _grad_hooks_pre_forward(module: nn.Module, _inputs) -> None:
    # Eager under torch.compile: a hook registered while dynamo traces a compiled block never
    # reached the gradient (sequence parallelism's norm weights kept Partial gradients, which
    # clip_grad_norm_ then refused at step 1).
    for param in module.parameters():
        _grad_to_layout(param)


def _redistribute(dt: DTensor, mesh: DeviceMesh, placements) -> DTensor:
    """``dt.redistribute(mesh, placements)``, a no-op when the layout already matches."""
    placements = tuple(Shard(p.dim + dt.ndim) if isinstance(p, Shard) and p.dim < 0 else p for p in placements)
    if mesh == dt.device_mesh and placements == tuple(dt.placements):
        return dt
    return dt.redistribute(mesh, placements)


class _LinearStyle(ParallelStyle):
    _weight: Placement
    _bias: Placement
    _desired_input: Placement
    _default_input: Placement
    _default_output: Placement
    # nn.Embedding: weight placement, desired and default input (the ids are replicated).
    _embedding_weight: Placement
    # A LoRA layer's adapters (lora_A [r, in], lora_B [out, r]), placed to match the weight.
    _lora_A: Placement
    _lora_B: Placement

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
            _distribute_param(module, "lora_A", device_mesh, self._lora_A)
            _distribute_param(module, "lora_B", device_mesh, self._lora_B)
        elif isinstance(module, nn.Embedding):
            if module.max_norm is not None or module.sparse:
                raise NotImplementedError(f"{type(self).__name__}: nn.Embedding with max_norm or sparse=True")
            desired, default_input = Replicate(), Replicate()
            _distribute_param(module, "weight", device_mesh, self._embedding_weight)
            if self._embedding_weight == Shard(0):
                # Vocab-parallel: a lookup whose backward builds only the local rows of the gradient.
                module.forward = functools.partial(_vocab_parallel_embedding, module)
        else:
            raise NotImplementedError(
                f"{type(self).__name__} supports nn.Linear and nn.Embedding only (got {type(module).__name__})"
            )
        layout = self._input_layouts if self._input_layouts is not None else default_input
        module.register_forward_pre_hook(_grad_hooks_pre_forward)
        module.register_forward_pre_hook(lambda m, inputs: self._prepare_input(inputs, device_mesh, layout, desired, m))
        module.register_forward_hook(lambda _m, _inputs, out: self._prepare_output(out, device_mesh))
        return module

    def _prepare_input(
        self, inputs: tuple, mesh: DeviceMesh, layout: Placement, desired: Placement, module: nn.Module
    ) -> tuple:
        x = inputs[0]
        if not isinstance(x, DTensor):
            shape = None
            if isinstance(module, nn.Linear) and isinstance(layout, Shard) and layout.dim in (-1, x.ndim - 1):
                # Sharded features (a rowwise input): the global size is the layer's in_features.
                shape = (*x.shape[:-1], module.in_features)
            # Otherwise (e.g. a sequence shard) the global size of the sharded dim is gathered:
            # exact for uneven shards.
            x = DTensor.from_local(x, mesh, [layout], shape=shape)
        x = _redistribute(x, mesh, [desired])
        return (x, *inputs[1:])

    def _prepare_output(self, out: DTensor, mesh: DeviceMesh):
        out = _redistribute(out, mesh, [self.output_layouts])
        return out.to_local() if self.use_local_output else out


class _VocabParallelLookup(torch.autograd.Function):
    """The lookup of replicated ``ids`` in this rank's vocabulary rows ``[lo, lo + n)`` of an
    embedding weight: ids outside the range give zero rows (the Partial(sum) over ranks is the full
    lookup). The backward builds the gradient of the local rows only (``[n, D]``, not ``[V, D]``):
    ids outside the range are sent to a spare row ``n`` that is dropped."""

    @staticmethod
    def forward(ctx, ids, weight, lo: int, padding_idx: int | None, scale_grad_by_freq: bool):
        n = weight.shape[0]
        outside = (ids < lo) | (ids >= lo + n)
        local_ids = torch.where(outside, torch.full_like(ids, n), ids - lo)
        ctx.save_for_backward(local_ids)
        ctx.n, ctx.scale_grad_by_freq = n, scale_grad_by_freq
        ctx.padding_idx = padding_idx - lo if padding_idx is not None and lo <= padding_idx < lo + n else -1
        if n == 0:  # an empty torch.chunk piece of the vocabulary
            return weight.new_zeros((*ids.shape, weight.shape[1]))
        out = nn.functional.embedding(local_ids.clamp(max=n - 1), weight)
        return out.masked_fill(outside.unsqueeze(-1), 0)

    @staticmethod
    def backward(ctx, grad):
        (local_ids,) = ctx.saved_tensors
        grad_weight = torch.ops.aten.embedding_dense_backward(
            grad.contiguous(), local_ids, ctx.n + 1, ctx.padding_idx, ctx.scale_grad_by_freq
        )
        return None, grad_weight[: ctx.n], None, None, None


def _vocab_parallel_embedding(module: nn.Embedding, ids) -> DTensor:
    """``nn.Embedding.forward`` for a weight sharded on the vocabulary (``Shard(0)``): Partial(sum)."""
    weight = module.weight
    local_ids = ids.to_local() if isinstance(ids, DTensor) else ids  # replicated ids (the style's input)
    lo = weight._spec.local_offset[0]
    out = _VocabParallelLookup.apply(local_ids, weight.to_local(), lo, module.padding_idx, module.scale_grad_by_freq)
    return DTensor.from_local(out, weight.device_mesh, [Partial()], shape=(*local_ids.shape, weight.shape[1]))


class ColwiseParallel(_LinearStyle):
    """Shard an ``nn.Linear`` by output features (weight ``Shard(0)``, bias ``Shard(0)``), an
    ``nn.Embedding`` by embedding dim (weight ``Shard(1)``, output ``Shard(-1)``)."""

    _weight = Shard(0)
    _bias = Shard(0)
    _desired_input = Replicate()
    _default_input = Replicate()
    _default_output = Shard(-1)
    _embedding_weight = Shard(1)
    _lora_A = Replicate()
    _lora_B = Shard(0)


class RowwiseParallel(_LinearStyle):
    """Shard an ``nn.Linear`` by input features (weight ``Shard(1)``, bias ``Replicate``), an
    ``nn.Embedding`` by vocabulary (weight ``Shard(0)``, ids ``Replicate``, output ``Replicate``)."""

    _weight = Shard(1)
    _bias = Replicate()
    _desired_input = Shard(-1)
    _default_input = Shard(-1)
    _default_output = Replicate()
    _embedding_weight = Shard(0)
    _lora_A = Shard(1)
    _lora_B = Replicate()


# ---- sequence parallelism -------------------------------------------------------------------------


class SequenceParallel(ParallelStyle):
    """Run a module on the sequence-sharded activations (Megatron-LM sequence parallelism,
    Korthikanti et al. 2022): every parameter of the module (and its submodules) becomes a
    ``Replicate`` DTensor, the first input is sharded on ``sequence_dim``, and the output, computed
    per position, stays sharded on it. For modules that work per position: ``nn.LayerNorm``, RMSNorm,
    ``nn.Dropout``, elementwise activations.

    The first input: a DTensor not sharded on ``sequence_dim`` is redistributed to it; a plain
    tensor is taken to be this rank's sequence shard already (``DTensor.from_local`` with
    ``Shard(sequence_dim)``: pieces must be ``torch.chunk`` pieces, uneven included). The other
    inputs are passed unchanged. ``use_local_output=True`` returns the local shard.

    Each rank sees only its positions, so a parameter's gradient comes back ``Partial``; a hook
    all-reduces it to ``Replicate`` (the parameter's layout), so a stock optimizer step gives the
    single-device update. As in torch, the parameters are taken as they are (no broadcast): every
    rank must hold the same values (the ones-init of a norm, or a seeded init).
    """

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = False):
        self.sequence_sharding = (Shard(sequence_dim),)
        self.use_local_output = use_local_output

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(sequence_dim={self.sequence_sharding[0].dim}, "
            f"use_local_output={self.use_local_output})"
        )

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if device_mesh.ndim != 1:
            raise ValueError(f"{type(self).__name__}: expected a 1-d mesh, got {device_mesh}")
        for submodule in module.modules():
            for name in [n for n, p in submodule.named_parameters(recurse=False) if p is not None]:
                _distribute_param(submodule, name, device_mesh, Replicate())
        module.register_forward_pre_hook(_grad_hooks_pre_forward)
        module.register_forward_pre_hook(lambda mod, inputs: self._prepare_input(mod, inputs, device_mesh))
        module.register_forward_hook(lambda _m, _inputs, out: self._prepare_output(out))
        return module

    def _prepare_input(self, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        if not inputs:
            raise ValueError(f"SequenceParallel: {type(module).__name__} was called without a positional input")
        x = inputs[0]
        if isinstance(x, DTensor):
            x = _redistribute(x, mesh, self.sequence_sharding)
        elif isinstance(x, torch.Tensor):
            x = DTensor.from_local(x, mesh, self.sequence_sharding)
        else:
            raise ValueError(
                f"SequenceParallel: expected the input of {type(module).__name__} to be a torch.Tensor or DTensor, "
                f"got {type(x).__name__}"
            )
        return (x, *inputs[1:])

    def _prepare_output(self, out):
        if not self.use_local_output:
            return out
        if not isinstance(out, DTensor):
            raise TypeError(f"SequenceParallel(use_local_output=True): expected a DTensor output, got {type(out)}")
        return out.to_local()


# ---- converting inputs and outputs ----------------------------------------------------------------


def _as_layouts(layouts, what: str) -> tuple[Placement | None, ...] | None:
    if layouts is None or isinstance(layouts, Placement):
        return layouts if layouts is None else (layouts,)
    layouts = tuple(layouts)
    for p in layouts:
        if p is not None and not isinstance(p, Placement):
            raise TypeError(f"{what}: expected Placements or None, got {p!r}")
    return layouts


def _convert(value: Any, mesh: DeviceMesh, layout: Placement | None, desired: Placement | None, local: bool, what: str):
    """One input/output: annotate a plain tensor with ``layout``, redistribute to ``desired``
    (``None``: keep), return the local tensor with ``local``. ``layout=None``: passed through."""
    if layout is None:
        return value
    if isinstance(value, DTensor):
        dt = value  # taken as it is (torch does not check it against ``layout`` either)
    elif isinstance(value, torch.Tensor):
        dt = DTensor.from_local(value, mesh, [layout])
    else:
        raise TypeError(f"{what}: expected a torch.Tensor for layout {layout}, got {type(value).__name__}")
    if desired is not None:
        dt = _redistribute(dt, mesh, [desired])
    return dt.to_local() if local else dt


class PrepareModuleInput(ParallelStyle):
    """Convert a module's inputs at runtime (a forward pre-hook), as in torch.

    ``input_layouts``: one placement per positional input (a single placement = one input), the
    layout a plain-tensor input is annotated with (``DTensor.from_local``; a DTensor input is taken
    as it is); ``None`` entries leave that input untouched (a non-tensor, or a tensor that stays
    plain). ``desired_input_layouts`` (same length): what each is redistributed to (``None``:
    kept). ``input_kwarg_layouts`` / ``desired_input_kwarg_layouts``: the same for keyword
    arguments, by name (unnamed keywords pass through). ``use_local_output=True`` hands the module
    the local tensors instead of DTensors.

    Example (a block whose first input is sequence-sharded and whose second is a plain rotary
    table): ``PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None))``.
    """

    def __init__(
        self,
        *,
        input_layouts: Placement | tuple[Placement | None, ...] | None = None,
        desired_input_layouts: Placement | tuple[Placement | None, ...] | None = None,
        input_kwarg_layouts: dict[str, Placement] | None = None,
        desired_input_kwarg_layouts: dict[str, Placement] | None = None,
        use_local_output: bool = False,
    ):
        self.input_layouts = _as_layouts(input_layouts, "PrepareModuleInput.input_layouts")
        self.desired_input_layouts = _as_layouts(desired_input_layouts, "PrepareModuleInput.desired_input_layouts")
        self.use_local_output = use_local_output
        if self.input_layouts is not None:
            if self.desired_input_layouts is None:
                raise ValueError("PrepareModuleInput: desired_input_layouts is required with input_layouts")
            if len(self.input_layouts) != len(self.desired_input_layouts):
                raise ValueError(
                    f"PrepareModuleInput: input_layouts ({len(self.input_layouts)} entries) and "
                    f"desired_input_layouts ({len(self.desired_input_layouts)}) must have the same length"
                )
        self.with_kwargs = input_kwarg_layouts is not None
        self.input_kwarg_layouts = dict(input_kwarg_layouts or {})
        self.desired_input_kwarg_layouts = dict(desired_input_kwarg_layouts or {})
        if self.with_kwargs and len(self.input_kwarg_layouts) != len(self.desired_input_kwarg_layouts):
            raise ValueError(
                "PrepareModuleInput: input_kwarg_layouts and desired_input_kwarg_layouts must have the same length"
            )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(input_layouts={self.input_layouts}, "
            f"desired_input_layouts={self.desired_input_layouts}, input_kwarg_layouts={self.input_kwarg_layouts}, "
            f"desired_input_kwarg_layouts={self.desired_input_kwarg_layouts}, use_local_output={self.use_local_output})"
        )

    def _prepare_inputs(self, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        if self.input_layouts is None:
            return inputs
        if not isinstance(inputs, tuple):
            inputs = (inputs,)
        if len(inputs) != len(self.input_layouts):
            raise ValueError(
                f"PrepareModuleInput: {type(module).__name__} got {len(inputs)} positional inputs but "
                f"input_layouts has {len(self.input_layouts)} entries"
            )
        what = f"PrepareModuleInput({type(module).__name__})"
        return tuple(
            _convert(x, mesh, layout, desired, self.use_local_output, what)
            for x, layout, desired in zip(inputs, self.input_layouts, self.desired_input_layouts, strict=True)
        )

    def _prepare_kwargs(self, module: nn.Module, kwargs: dict, mesh: DeviceMesh) -> dict:
        what = f"PrepareModuleInput({type(module).__name__})"
        return {
            key: _convert(
                value,
                mesh,
                self.input_kwarg_layouts.get(key),
                self.desired_input_kwarg_layouts.get(key),
                self.use_local_output,
                f"{what} keyword {key!r}",
            )
            for key, value in kwargs.items()
        }

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if self.with_kwargs:
            module.register_forward_pre_hook(
                lambda mod, args, kwargs: (
                    self._prepare_inputs(mod, args, device_mesh),
                    self._prepare_kwargs(mod, kwargs, device_mesh),
                ),
                with_kwargs=True,
            )
        else:
            module.register_forward_pre_hook(lambda mod, args: self._prepare_inputs(mod, args, device_mesh))
        return module


class PrepareModuleOutput(ParallelStyle):
    """Convert a module's outputs at runtime (a forward hook), as in torch.

    ``output_layouts``: one placement per output (a single placement = one output; a tuple for a
    module returning a tuple), the layout a plain-tensor output is annotated with (a DTensor output
    is taken as it is); ``None`` entries pass that output through. ``desired_output_layouts``
    (same length): what each is redistributed to. ``use_local_output=True`` (the default) returns
    local tensors. A single output comes back as itself, several as a tuple.
    """

    def __init__(
        self,
        *,
        output_layouts: Placement | tuple[Placement | None, ...],
        desired_output_layouts: Placement | tuple[Placement | None, ...],
        use_local_output: bool = True,
    ):
        self.output_layouts = _as_layouts(output_layouts, "PrepareModuleOutput.output_layouts")
        self.desired_output_layouts = _as_layouts(desired_output_layouts, "PrepareModuleOutput.desired_output_layouts")
        if self.output_layouts is None or self.desired_output_layouts is None:
            raise ValueError("PrepareModuleOutput: output_layouts and desired_output_layouts are required")
        if len(self.output_layouts) != len(self.desired_output_layouts):
            raise ValueError(
                f"PrepareModuleOutput: output_layouts ({len(self.output_layouts)} entries) and "
                f"desired_output_layouts ({len(self.desired_output_layouts)}) must have the same length"
            )
        self.use_local_output = use_local_output

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(output_layouts={self.output_layouts}, "
            f"desired_output_layouts={self.desired_output_layouts}, use_local_output={self.use_local_output})"
        )

    def _prepare_outputs(self, module: nn.Module, outputs, mesh: DeviceMesh):
        outs = outputs if isinstance(outputs, tuple) else (outputs,)
        if len(outs) != len(self.output_layouts):
            raise ValueError(
                f"PrepareModuleOutput: {type(module).__name__} returned {len(outs)} outputs but output_layouts "
                f"has {len(self.output_layouts)} entries"
            )
        what = f"PrepareModuleOutput({type(module).__name__})"
        prepared = tuple(
            _convert(y, mesh, layout, desired, self.use_local_output, what)
            for y, layout, desired in zip(outs, self.output_layouts, self.desired_output_layouts, strict=True)
        )
        return prepared[0] if len(prepared) == 1 else prepared

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_hook(lambda mod, _inputs, outputs: self._prepare_outputs(mod, outputs, device_mesh))
        return module


class PrepareModuleInputOutput(ParallelStyle):
    """``PrepareModuleInput`` and ``PrepareModuleOutput`` in one style (torch's arguments:
    ``use_local_input`` for the inputs, ``use_local_output`` for the outputs)."""

    def __init__(
        self,
        *,
        input_layouts: Placement | tuple[Placement | None, ...] | None = None,
        desired_input_layouts: Placement | tuple[Placement | None, ...] | None = None,
        input_kwarg_layouts: dict[str, Placement] | None = None,
        desired_input_kwarg_layouts: dict[str, Placement] | None = None,
        use_local_input: bool = False,
        output_layouts: Placement | tuple[Placement | None, ...],
        desired_output_layouts: Placement | tuple[Placement | None, ...],
        use_local_output: bool = True,
    ):
        self.prepare_module_input = PrepareModuleInput(
            input_layouts=input_layouts,
            desired_input_layouts=desired_input_layouts,
            input_kwarg_layouts=input_kwarg_layouts,
            desired_input_kwarg_layouts=desired_input_kwarg_layouts,
            use_local_output=use_local_input,
        )
        self.prepare_module_output = PrepareModuleOutput(
            output_layouts=output_layouts,
            desired_output_layouts=desired_output_layouts,
            use_local_output=use_local_output,
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.prepare_module_input!r}, {self.prepare_module_output!r})"

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.prepare_module_input._apply(module, device_mesh)
        self.prepare_module_output._apply(module, device_mesh)
        return module
