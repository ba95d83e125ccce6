"""PEFT's adapter files for our LoRA layers (``models/lora.py``): ``adapter_config.json`` and
``adapter_model.safetensors``, read and written.

Keys are PEFT's for the Hugging Face model, ``base_model.model.<HF module>.lora_A.weight``; values
are in Hugging Face's layout (``lora_B``'s query / key rows reordered where the family's are,
``hf.py``). An adapter file is an untrusted input: opened confined and bounded
(``hpservice.inputs``), read with safetensors (no pickle), and each tensor checked against the
layer it adapts before any value is used.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn as nn

from hpservice.inputs import MAX_JSON_BYTES, load_json, open_input, opened_path, read_input

from .hf import _ROTARY, _to_hf_layout, copy_local_piece, hf_name
from .lora import LoRALinear, LoraSettings

__all__ = ["AdapterError", "adapter_config", "load_adapter", "peft_key", "peft_tensors", "read_adapter_config"]

MAX_ADAPTER_BYTES = 8 << 30


class AdapterError(ValueError):
    """A PEFT adapter that does not fit the model, or is not one."""


def peft_key(module: str, which: str) -> str:
    """PEFT's key of our module's ``lora_A`` / ``lora_B``."""
    return f"base_model.model.{hf_name(module + '.weight').removesuffix('.weight')}.{which}.weight"


def peft_tensors(module: str, which: str, value: torch.Tensor, cfg) -> dict[str, torch.Tensor]:
    """One adapter matrix of ours as PEFT's tensor (B's rotary rows in Hugging Face's order)."""
    if which == "lora_B" and cfg.hf_rotate_half and f"{module}.weight".endswith(_ROTARY):
        value = _to_hf_layout(f"{module}.weight", value, cfg.head_dim)
    return {peft_key(module, which): value.contiguous()}


def adapter_config(settings: LoraSettings, modules: list[str], base: str | None) -> dict:
    """``adapter_config.json`` of an adapter on ``modules`` (our names)."""
    peft_names = sorted({peft_module_names_of(m) for m in modules})
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
        "r": settings.r, "lora_alpha": settings.lora_alpha, "lora_dropout": settings.lora_dropout,
        "target_modules": peft_names, "use_rslora": settings.use_rslora, "bias": "none",
        "fan_in_fan_out": False, "init_lora_weights": True, "modules_to_save": None, "use_dora": False,
    }  # fmt: skip


def peft_module_names_of(module: str) -> str:
    """The Hugging Face module name PEFT targets for our ``module`` (``q_proj``, ``q_a_proj``)."""
    return hf_name(f"{module}.weight").removesuffix(".weight").rsplit(".", 1)[-1]


def read_adapter_config(path: str | Path) -> dict:
    """The PEFT ``adapter_config.json`` of the adapter directory ``path``, checked to be LoRA of a
    kind this engine computes exactly."""
    where = Path(path) / "adapter_config.json"
    cfg = load_json(read_input(where, MAX_JSON_BYTES), str(where))
    if not isinstance(cfg, dict) or cfg.get("peft_type") != "LORA":
        raise AdapterError(f"{where}: not a LoRA adapter (peft_type {cfg.get('peft_type') if isinstance(cfg, dict) else None!r})")
    for key, allowed in (("use_dora", (False, None)), ("fan_in_fan_out", (False, None)), ("bias", ("none", None))):
        if cfg.get(key) not in allowed:
            raise AdapterError(f"{where}: {key}={cfg.get(key)!r} is not supported (only {allowed[0]!r})")
    if cfg.get("modules_to_save"):
        raise AdapterError(f"{where}: modules_to_save is not supported yet")
    return cfg


def settings_from_config(cfg: dict, where: str | Path) -> LoraSettings:
    """The engine's LoRA settings of a PEFT ``adapter_config.json`` (``read_adapter_config``'s)."""
    targets = cfg.get("target_modules")
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise AdapterError(f"{where}: target_modules {targets!r}: a list of module names is supported (not a pattern)")
    try:
        return LoraSettings(
            int(cfg["r"]), float(cfg["lora_alpha"]), float(cfg.get("lora_dropout") or 0.0), tuple(targets),
            bool(cfg.get("use_rslora") or False),
        )  # fmt: skip
    except (KeyError, TypeError, ValueError) as e:
        raise AdapterError(f"{where}: r and lora_alpha must be numbers ({type(e).__name__}: {e})") from None


@torch.no_grad()
def load_adapter(model: nn.Module, path: str | Path, *, whole: bool = True) -> int:
    """Fill every ``LoRALinear`` of ``model`` (sharded or not) from the PEFT adapter directory
    ``path``; returns how many matrices were read. Every tensor the model's adapters need must be
    there with its shape, and (``whole``: the model is not one pipeline stage of several) the file
    may hold no other (a different base or targets)."""
    from safetensors import safe_open

    path = Path(path)
    cfg = model.cfg
    wanted = {}
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            for which in ("lora_A", "lora_B"):
                wanted[peft_key(name, which)] = (name, which, getattr(module, which))
    with open_input(path / "adapter_model.safetensors") as f, safe_open(opened_path(f, path / "adapter_model.safetensors"), "pt") as st:
        keys = set(st.keys())
        missing, extra = sorted(set(wanted) - keys), sorted(keys - set(wanted)) if whole else []
        if missing or extra:
            raise AdapterError(
                f"{path}: the adapter does not fit this model's LoRA layers: missing {missing[:4]}{' ...' if len(missing) > 4 else ''}, "
                f"not in the model {extra[:4]}{' ...' if len(extra) > 4 else ''} (model.lora.target_modules and r must be "
                "the adapter's)"
            )
        for key, (module, which, param) in wanted.items():
            source = st.get_slice(key)
            shape = tuple(source.get_shape())
            if shape != tuple(param.shape):
                raise AdapterError(f"{path}: {key} has shape {list(shape)}, the model's {module}.{which} needs {list(param.shape)}")
            rotary = which == "lora_B" and cfg.hf_rotate_half and f"{module}.weight".endswith(_ROTARY)
            copy_local_piece(source, param, rotary=rotary, head_dim=cfg.head_dim)
    return len(wanted)


def write_adapter(out: Path, tensors: dict[str, torch.Tensor], config: dict) -> list[str]:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return ["adapter_model.safetensors", "adapter_config.json"]
