"""LoRA: low-rank adapters on a model's linear layers, in PEFT's vocabulary and layout.

A target ``nn.Linear`` (``W``: ``[out, in]``) becomes a ``LoRALinear``: ``W`` (and its bias) frozen,
two trained matrices beside it, PEFT's names and shapes::

    y = x W^T + b + scaling * dropout(x) A^T B^T     A: lora_A [r, in], B: lora_B [out, r]
    scaling = lora_alpha / r   (use_rslora: lora_alpha / sqrt(r))

initialised as PEFT's default (``init_lora_weights=True``): A Kaiming-uniform (``a = sqrt(5)``), B
zero, so a fresh adapter leaves the model's output unchanged. The module keeps the linear's name, so
the base weight is still ``layers.0.attention.wq.weight``; the adapters are ``...wq.lora_A`` and
``...wq.lora_B``, parameters of the same module (fully_shard shards them with their block).

Target modules are named as PEFT names them for the Hugging Face model (``q_proj``, ``k_proj``,
``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj``, ``lm_head``; DeepSeek-V3's
``q_a_proj`` ...), or as our modules (``wq`` ... ``w3``, ``output``); a custom model's layers by
their own names (``fc1``); or ``all-linear`` (PEFT's: every linear layer but the output head;
refused on a model with routed experts, where PEFT's would adapt the router and experts too).

An adapter goes in and out in PEFT's files: ``adapter_config.json`` and
``adapter_model.safetensors`` with keys ``base_model.model.<the HF module>.lora_A.weight``. Where a
family's query and key rows are stored interleaved here and half-split in Hugging Face's layout
(``cfg.hf_rotate_half``), ``lora_B``'s rows of ``wq`` / ``wk`` are reordered as the weight's rows
are, both ways; ``lora_A`` acts on the input and needs none.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "NF4_BLOCK",
    "LoRALinear",
    "LoraSettings",
    "apply_lora",
    "is_nf4",
    "lora_targets",
    "nf4_available",
    "nf4_problems",
    "peft_module_names",
    "quantize_base_nf4",
    "shard_base_nf4",
]

# our module name (last part) -> PEFT's (the Hugging Face module's)
_PEFT_NAMES = {
    "wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj",
    "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj", "output": "lm_head",
}  # fmt: skip
_OURS = {v: k for k, v in _PEFT_NAMES.items()}


@dataclasses.dataclass(frozen=True)
class LoraSettings:
    r: int
    lora_alpha: float
    lora_dropout: float = 0.0
    target_modules: tuple[str, ...] | str = "all-linear"
    use_rslora: bool = False
    quantize_base: str = "none"  # "nf4": QLoRA (quantize_base_nf4)

    @property
    def scaling(self) -> float:
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)


class LoRALinear(nn.Linear):
    """An ``nn.Linear`` whose weight (and bias) stays fixed, with a trained low-rank update."""

    def __init__(self, in_features: int, out_features: int, bias: bool, settings: LoraSettings, device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.r, self.scaling = settings.r, settings.scaling
        self.lora_A = nn.Parameter(torch.empty(settings.r, in_features, device=device, dtype=dtype))
        self.lora_B = nn.Parameter(torch.empty(out_features, settings.r, device=device, dtype=dtype))
        self.lora_dropout = nn.Dropout(settings.lora_dropout) if settings.lora_dropout > 0 else nn.Identity()
        self.adapters_enabled = True  # False: the base layer alone (DPO's reference, PEFT's disable_adapter)
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, settings: LoraSettings) -> LoRALinear:
        """The adapted layer, taking over ``linear``'s weight and bias tensors (nothing is copied);
        off the meta device its adapters are initialised (``reset_lora_parameters``)."""
        w = linear.weight
        out = cls(linear.in_features, linear.out_features, linear.bias is not None, settings, device="meta", dtype=w.dtype)
        out.weight = nn.Parameter(w.data, requires_grad=False)
        if linear.bias is not None:
            out.bias = nn.Parameter(linear.bias.data, requires_grad=False)
        if w.device.type != "meta":
            out.lora_A = nn.Parameter(torch.empty_like(out.lora_A, device=w.device))
            out.lora_B = nn.Parameter(torch.empty_like(out.lora_B, device=w.device))
            out.reset_lora_parameters()
        return out

    def reset_lora_parameters(self) -> None:
        """PEFT's default init: A Kaiming-uniform (``a = sqrt(5)``, as ``nn.Linear``'s weight), B zero."""
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if is_nf4(self.weight):  # QLoRA: the 4-bit base dequantised for this product (torchao's linear)
            from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4

            mesh = getattr(self, "nf4_mesh", None)
            base = linear_nf4(x, self.weight) if mesh is None else _ShardedNF4Linear.apply(x, self.weight, mesh)
            base = base + self.bias if self.bias is not None else base
        else:
            base = F.linear(x, self.weight, self.bias)
        if not self.adapters_enabled:
            return base
        return base + F.linear(F.linear(self.lora_dropout(x), self.lora_A), self.lora_B) * self.scaling

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, r={self.r}, scaling={self.scaling:g}"


_HEADS = ("output", "lm_head", "head")  # a model's output layer: left out of all-linear, as PEFT does


def peft_module_names(model: nn.Module) -> dict[str, str]:
    """Our linear layers that LoRA can target -> their PEFT names: the Hugging Face module's for
    the built-in families' layers (DeepSeek-V3's ``wq_a`` is ``q_a_proj``), else the module's own
    last name (a custom model's ``fc1``)."""
    from .hf import hf_name

    out = {}
    for name, module in model.named_modules():
        if not (isinstance(module, nn.Linear) and name):
            continue
        try:
            out[name] = hf_name(f"{name}.weight").removesuffix(".weight").rsplit(".", 1)[-1]
        except ValueError:  # no Hugging Face tensor: a custom model's layer, or our mlp's
            last = name.rsplit(".", 1)[-1]
            out[name] = _PEFT_NAMES.get(last, last)
    return out


def lora_targets(model: nn.Module, target_modules) -> list[str]:
    """The names of the modules ``target_modules`` selects; ``ValueError`` for a name that matches
    no linear layer, listing the model's, and for a selection that adapts nothing."""
    linear = peft_module_names(model)
    if target_modules == "all-linear":
        from .moe import GroupedExperts

        if any(isinstance(m, GroupedExperts) for m in model.modules()):
            # PEFT's all-linear on a Hugging Face MoE also adapts the router and the routed experts
            # (target_parameters): not built here, so the name would train something else.
            raise ValueError(
                "model.lora.target_modules: 'all-linear' on a model with routed experts would adapt the router "
                "and the experts too, as PEFT does; adapters on those are not built yet. Name the layers to "
                f"adapt instead (attention, dense and shared-expert MLPs): {', '.join(sorted(set(linear.values()) - {'lm_head'}))}"
            )
        chosen = [n for n, peft in linear.items() if peft not in _HEADS and n.rsplit(".", 1)[-1] not in _HEADS]
        if not chosen:
            raise ValueError("model.lora.target_modules: 'all-linear' finds no linear layer but the output head in this model")
        return chosen
    wanted = set(target_modules)
    known = set(linear.values()) | {_OURS.get(p, p) for p in linear.values()}
    unknown = sorted(wanted - known)
    if unknown:
        ours = sorted({_OURS[p] for p in linear.values() if p in _OURS})
        raise ValueError(
            f"model.lora.target_modules: {unknown} match no linear layer of this model; its linear layers: "
            f"{', '.join(sorted(set(linear.values())))}"
            + (f" (or our names {', '.join(ours)}, or 'all-linear')" if ours else " (or 'all-linear')")
        )
    return [n for n, peft in linear.items() if peft in wanted or _OURS.get(peft, peft) in wanted]


def apply_lora(model: nn.Module, settings: LoraSettings) -> list[str]:
    """Replace each target linear layer of ``model`` by a ``LoRALinear``, in place; returns the
    adapted modules' names. ``ValueError`` for a rank above a layer's width."""
    names = lora_targets(model, settings.target_modules)
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        linear = getattr(parent, child)
        if settings.r > min(linear.in_features, linear.out_features):
            raise ValueError(
                f"model.lora.r: {settings.r} is above {name}'s width ({linear.in_features} -> {linear.out_features})"
            )
        setattr(parent, child, LoRALinear.from_linear(linear, settings))
    return names


# ---- QLoRA: the frozen base in 4-bit NF4 ----------------------------------------------------------

# torchao's NF4 defaults, the QLoRA paper's: one absmax scaler per 64 weights, the scalers
# themselves quantised to 8 bits in blocks of 256. A weight's element count must divide into both.
NF4_BLOCK, NF4_SCALER_BLOCK = 64, 256


def is_nf4(t) -> bool:
    return type(t).__name__ == "NF4Tensor"  # torchao's class, imported only where QLoRA runs


def nf4_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("torchao") is not None


def nf4_problems(model: nn.Module) -> list[str]:
    """The adapted layers whose weight NF4's blocks do not divide (``quantize_base_nf4`` refuses them)."""
    unit = NF4_BLOCK * NF4_SCALER_BLOCK
    return [
        f"{name}.weight ({module.out_features} x {module.in_features} = {module.weight.numel()} elements)"
        for name, module in model.named_modules()
        if isinstance(module, LoRALinear) and module.weight.numel() % unit
    ]


@torch.no_grad()
def quantize_base_nf4(model: nn.Module) -> int:
    """Replace each ``LoRALinear``'s frozen weight (a plain tensor, filled) by torchao's
    ``NF4Tensor`` of it; returns how many. ``ValueError`` naming the layers NF4's blocks do not divide."""
    problems = nf4_problems(model)
    if problems:
        raise ValueError(
            f"model.lora.quantize_base: nf4 needs each adapted weight's element count divisible by "
            f"{NF4_BLOCK} x {NF4_SCALER_BLOCK} (torchao's NF4 blocks); not: {', '.join(problems[:4])}"
            f"{' ...' if len(problems) > 4 else ''}"
        )
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    count = 0
    for module in model.modules():
        if isinstance(module, LoRALinear) and not is_nf4(module.weight):
            module.weight = nn.Parameter(to_nf4(module.weight.detach(), NF4_BLOCK, NF4_SCALER_BLOCK), requires_grad=False)
            count += 1
    return count


def _gather_nf4(shard, mesh, dtype: torch.dtype) -> torch.Tensor:
    """The whole weight of an NF4 row shard, dequantised to ``dtype``: its 4-bit codes and scalers
    all-gathered over ``mesh`` (torchao's FSDP2 pre/post all-gather protocol), then decoded."""
    import torch.distributed as dist

    inner, meta = shard.fsdp_pre_all_gather(mesh)
    n, group = mesh.size(), mesh.get_group()
    gathered = []
    for t in inner:
        pieces = [torch.empty_like(t) for _ in range(n)]
        dist.all_gather(pieces, t.contiguous(), group=group)
        gathered.append(torch.cat([p.reshape(-1) for p in pieces]))
    whole, _ = shard.fsdp_post_all_gather(tuple(gathered), meta, dtype)
    return whole.to(dtype)


class _ShardedNF4Linear(torch.autograd.Function):
    """``x @ W^T`` with ``W`` gathered from this rank's NF4 rows for the forward and again for the
    backward (nothing whole is kept between them, as fully_shard reshards); ``W`` has no gradient."""

    @staticmethod
    def forward(ctx, x, shard, mesh):
        ctx.shard, ctx.mesh = shard, mesh
        return F.linear(x, _gather_nf4(shard, mesh, x.dtype))

    @staticmethod
    def backward(ctx, grad):
        return grad @ _gather_nf4(ctx.shard, ctx.mesh, grad.dtype), None, None


@torch.no_grad()
def shard_base_nf4(model: nn.Module, mesh) -> int:
    """Keep only this rank's rows of each NF4 base weight, split over the 1-d ``mesh`` (the ranks
    fully_shard shards over) at NF4's block boundaries, so the 4-bit base is sharded as fully_shard
    shards the rest: the forward gathers a layer's codes and scalers, decodes, and frees them. A
    weight whose rows or blocks do not divide by the mesh's size stays whole; returns how many
    were sharded."""
    n, rank = mesh.size(), mesh.get_local_rank()
    if n == 1:
        return 0
    count = 0
    for module in model.modules():
        w = getattr(module, "weight", None)
        if not (isinstance(module, LoRALinear) and is_nf4(w)):
            continue
        if w.size(0) % n or (w.numel() // n) % (NF4_BLOCK * NF4_SCALER_BLOCK):
            continue
        module.weight = nn.Parameter(torch.split(w, w.size(0) // n)[rank], requires_grad=False)
        module.nf4_mesh = mesh
        count += 1
    return count
