"""Hugging Face checkpoints of the Llama, Qwen2, Qwen3 and Mistral families into our decoder
(``llama.py`` and its family files), each rank reading only its own slices, and back.

A checkpoint directory holds ``config.json`` and ``model.safetensors``, or sharded
``model-0000x-of-0000y.safetensors`` files listed in ``model.safetensors.index.json``.

- ``hf_family(dir)``: the family, from ``architectures`` (else ``model_type``): ``FAMILIES``.
- ``config_from_hf(dir)`` maps the config (hidden size, layers, heads, KV heads, head_dim,
  intermediate size, rope theta, RMS eps, tied embeddings, vocab; Qwen2's q/k/v biases, Qwen3's
  q/k norms, Mistral's sliding window) to a ``LlamaConfig`` (transformers 4's ``rope_theta`` /
  ``rope_scaling`` and 5's ``rope_parameters``; plain, Llama 3 ``llama3`` and YaRN ``yarn`` frequencies).
  Anything we would compute differently is refused with the key and the value (other rope
  types, output-projection or MLP biases, Qwen's per-layer sliding windows, an activation other
  than SiLU), never approximated.
- ``load_hf_weights(model, dir)`` fills an already built (and possibly sharded) ``Llama`` in
  place. For each parameter, a DTensor (FSDP, HSDP, TP and their compositions) or a plain
  tensor, the rank computes the global rectangle its local piece covers and reads only that from
  the safetensors file (``safe_open(...).get_slice``). The full model never exists on one rank.

Rotary layout: our attention rotates interleaved channel pairs ``(2i, 2i+1)`` (Meta's layout).
Hugging Face's ``q_proj`` / ``k_proj`` rows (and their biases, and Qwen3's ``q_norm`` / ``k_norm``
channels) are permuted for its ``rotate_half``: within each head, row ``c * head_dim/2 + i`` of
theirs is our row ``2i + c``. Our rows of a query/key weight
are read head by head, from the heads the local rows touch, and reordered.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import tempfile
from pathlib import Path

import torch

from hpservice.checkpoint._reader import CheckpointReader, dcp_load
from hpservice.inputs import (
    MAX_INDEX_BYTES,
    MAX_JSON_BYTES,
    InputError,
    InputFileError,
    load_json,
    open_input,
    opened_path,
    read_input,
)

from . import MODEL_SPECS, config_class, model_class
from .hf_config import validated_config
from .hf_text import write_text_files
from .llama import Llama, LlamaConfig

__all__ = [
    "FAMILIES",
    "HFFormatError",
    "config_from_hf",
    "export_checkpoint_hf",
    "export_hf",
    "family_of",
    "hf_config",
    "hf_family",
    "hf_name",
    "hf_names",
    "hf_tensors",
    "load_hf_weights",
    "save_hf_pretrained",
]

# family -> (model_type, architecture) of its Hugging Face checkpoints: from the families' bundles
FAMILIES = {name: (spec.hf.model_type, spec.hf.architecture) for name, spec in MODEL_SPECS.items() if spec.hf}


class HFFormatError(ValueError):
    """A Hugging Face checkpoint we cannot read exactly: the file, the key, what we found."""


def _read_config(path: Path) -> dict:
    """The checkpoint's ``config.json``, parsed: opened as an input that must lie in the
    checkpoint's own directory (a symlink leading elsewhere is refused), a regular file of at
    most ``MAX_JSON_BYTES`` whose JSON is bounded in depth and size (the server reads it at
    submit: no file may stall or exhaust it). Its keys are validated by ``hf_config``."""
    config = Path(path) / "config.json"
    try:
        text = read_input(config, MAX_JSON_BYTES, within=[Path(os.path.realpath(path))])
        raw = load_json(text, str(config))
    except InputError:
        raise
    except InputFileError as e:
        raise HFFormatError(f"{e}: not a model config") from None
    except OSError as e:
        raise HFFormatError(f"{config}: cannot read ({e.strerror})") from None
    if not isinstance(raw, dict):
        raise HFFormatError(f"{config}: the top level is a JSON {type(raw).__name__}, not an object")
    return raw


def _family(cfg: dict, where: Path) -> str:
    archs = cfg.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise HFFormatError(f"{where}: architectures must be a list of class names, got {type(archs).__name__}")
    for family, (model_type, arch) in FAMILIES.items():
        if arch in archs or (not archs and cfg.get("model_type") == model_type):
            return family
    supported = ", ".join(f"{a} ({t})" for t, a in FAMILIES.values())
    raise HFFormatError(
        f"{where}: architectures = {archs!r}, model_type = {cfg.get('model_type')!r} is not a family we import "
        f"(supported: {supported})"
    )


def hf_family(path: str | Path) -> str:
    """The built-in model (``FAMILIES``' key) of the Hugging Face checkpoint at ``path``, from its
    ``config.json``'s ``architectures`` (else ``model_type``); ``HFFormatError`` naming both otherwise."""
    return _family(_read_config(Path(path)), Path(path) / "config.json")


def config_from_hf(path: str | Path, family: str | None = None, **overrides) -> LlamaConfig:
    """Our config for the checkpoint at ``path`` (of ``family``, which must be the checkpoint's
    own; None: whichever it is); ``overrides`` replace fields (e.g. ``max_seq_len`` shorter than
    the checkpoint's)."""
    where = Path(path) / "config.json"
    raw = _read_config(Path(path))
    found = _family(raw, where)
    cfg = validated_config(raw, where)
    if family is not None and found != family:
        raise HFFormatError(f"{where}: a {found} checkpoint ({FAMILIES[found][1]}), not a {family} one (model.name)")

    def refuse(key: str, allowed, why: str):
        value = cfg.get(key)
        if value not in allowed:
            raise HFFormatError(f"{where}: {key} = {value!r} is not supported: {why}")

    # transformers 5 writes rope_parameters (rope_theta inside); 4.x rope_theta and rope_scaling.
    rope = dict(cfg.get("rope_parameters") or {})
    theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
    v5 = rope if rope.get("rope_type", rope.get("type")) not in (None, "default") else None
    scaling = v5 or cfg.get("rope_scaling") or None
    if scaling is not None:
        scaling = {("rope_type" if k == "type" else k): v for k, v in scaling.items()}
        if scaling.get("rope_type") == "default":
            scaling = None
        elif scaling.get("rope_type") not in ("llama3", "yarn"):
            key = "rope_parameters" if v5 else "rope_scaling"
            raise HFFormatError(
                f"{where}: {key} of rope_type {scaling.get('rope_type')!r} is not supported: plain, Llama 3 "
                "('llama3') and YaRN ('yarn') frequencies are implemented"
            )
        elif scaling.get("rope_type") == "yarn":
            scaling.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings", 2048))
            if scaling.get("factor") is None:  # transformers: the ratio of the two contexts
                scaling["factor"] = cfg.get("max_position_embeddings", 2048) / scaling["original_max_position_embeddings"]
            if scaling.get("partial_rotary_factor", 1.0) != 1.0:
                raise HFFormatError(f"{where}: partial_rotary_factor = {scaling['partial_rotary_factor']!r} is not supported")
    adapter = MODEL_SPECS[found].hf
    if "qkv_bias" not in adapter.variants:  # Qwen2's q/k/v always have biases; the others' adds o_proj's too
        refuse("attention_bias", (None, False), "biases on all four attention projections are not implemented")
    refuse("mlp_bias", (None, False), "our MLP projections have no bias")
    refuse("hidden_act", (None, "silu"), "our MLP is SwiGLU with SiLU")
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    fields = {
        "dim": cfg["hidden_size"],
        "n_layers": cfg["num_hidden_layers"],
        "n_heads": heads,
        "n_kv_heads": cfg.get("num_key_value_heads") or heads,
        "attn_head_dim": None if head_dim * heads == cfg["hidden_size"] else head_dim,
        "vocab_size": cfg["vocab_size"],
        "hidden_dim": cfg["intermediate_size"],
        "norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
        "rope_theta": float(theta),
        "rope_scaling": scaling,
        "max_seq_len": cfg.get("max_position_embeddings", 2048),
        "tie_embeddings": bool(cfg.get("tie_word_embeddings", False)),
    }

    def need(key: str):
        if cfg.get(key) is None:
            raise HFFormatError(f"{where}: no {key}")
        return cfg[key]

    try:  # the family's own fields (its state-dict adapter, ModelSpec.hf)
        fields.update(adapter.config_fields(cfg, need, refuse))
    except HFFormatError:
        raise
    except ValueError as e:
        raise HFFormatError(f"{where}: {e}") from None
    fields.update(overrides)
    try:
        return config_class(found)(**fields)
    except (TypeError, ValueError) as e:  # the sizes' own rules (heads divide the width, ...)
        raise HFFormatError(f"{where}: {e}") from None


_BLOCK_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wq.bias": "self_attn.q_proj.bias",
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.bias": "self_attn.v_proj.bias",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.router.gate.weight": "mlp.gate.weight",
    "feed_forward.expert_bias": "mlp.gate.e_score_correction_bias",  # a buffer: DeepSeek-V3's
    "feed_forward.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "feed_forward.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
    "feed_forward.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    # DeepSeek's multi-head latent attention
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
}
# our stacked experts' tensors [E, ...] -> Hugging Face's one tensor per expert
_EXPERTS = {
    "feed_forward.experts.w1": "mlp.experts.{}.gate_proj.weight",
    "feed_forward.experts.w3": "mlp.experts.{}.up_proj.weight",
    "feed_forward.experts.w2": "mlp.experts.{}.down_proj.weight",
}
# rows (or channels) rotated by the rotary embedding, in our interleaved order
_ROTARY = ("attention.wq.weight", "attention.wk.weight", "attention.wq.bias", "attention.wk.bias", "q_norm.weight", "k_norm.weight")


def hf_names(name: str, shape: tuple[int, ...]) -> list[str]:
    """The Hugging Face tensors of one of our parameters of ``shape``: one, or one per expert."""
    parts = name.split(".")
    rest = ".".join(parts[2:])
    if parts[0] == "layers" and rest in _EXPERTS:
        return [f"model.layers.{parts[1]}.{_EXPERTS[rest].format(e)}" for e in range(shape[0])]
    return [hf_name(name)]


def hf_tensors(name: str, value: torch.Tensor, cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """One of our parameters' values as Hugging Face's tensors (rotary rows reordered where the
    family's are, expert stacks split), contiguous for safetensors."""
    if ".".join(name.split(".")[2:]) in _EXPERTS:
        return {key: value[e].contiguous() for e, key in enumerate(hf_names(name, tuple(value.shape)))}
    if cfg.hf_rotate_half:
        value = _to_hf_layout(name, value, cfg.head_dim)
    return {hf_name(name): value.contiguous()}


def hf_name(name: str) -> str:
    """The Hugging Face tensor name of one of our decoder's parameters (every family's; an
    expert stack has one per expert: ``hf_names``)."""
    parts = name.split(".")
    if name == "tok_embeddings.weight":
        return "model.embed_tokens.weight"
    if name == "norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    if parts[0] == "layers":
        i, rest = parts[1], ".".join(parts[2:])
        if rest in _BLOCK_NAMES:
            return f"model.layers.{i}.{_BLOCK_NAMES[rest]}"
    raise HFFormatError(f"no Hugging Face tensor for our parameter {name!r}")


class _SafetensorsDir:
    """Tensor name -> file of a (sharded) safetensors checkpoint, opened lazily."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        self.path, self._open, self._files = path, safe_open, {}
        self._real = Path(os.path.realpath(path))  # every file read must lie in the checkpoint's directory
        index = path / "model.safetensors.index.json"
        single = path / "model.safetensors"
        if index.is_file():
            try:
                weight_map = load_json(read_input(index, MAX_INDEX_BYTES, within=[self._real]), str(index))["weight_map"]
                if not all(isinstance(v, str) for v in weight_map.values()):
                    raise TypeError("weight_map's values must be file names")
                self.where = {k: path / v for k, v in weight_map.items()}
            except InputFileError:
                raise
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise HFFormatError(f"{index}: not a safetensors index ({type(e).__name__}: {e})") from None
        elif single.is_file():
            names = self._file(single).keys()  # safetensors' handle, not a dict
            self.where = dict.fromkeys(names, single)
        else:
            raise HFFormatError(f"{path}: no model.safetensors or model.safetensors.index.json")

    def _file(self, f: Path):
        if f not in self._files:
            try:
                with open_input(f, within=[self._real]) as opened:  # safetensors maps this very file
                    self._files[f] = self._open(opened_path(opened, f), framework="pt")
            except InputError:
                raise
            except Exception as e:  # safetensors raises its own error types for corrupt headers
                raise HFFormatError(f"{f}: cannot read safetensors ({e})") from None
        return self._files[f]

    def slice(self, name: str):
        if name not in self.where:
            raise HFFormatError(f"{self.path}: tensor {name!r} is missing")
        return self._file(self.where[name]).get_slice(name)


def _region(param: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]:
    """(global offset, local shape, local tensor to fill) of a plain or DTensor parameter."""
    from hpservice.dtensor import DTensor

    if isinstance(param, DTensor):
        spec = param._spec
        return spec.local_offset, spec.local_shape, param.to_local()
    return (0,) * param.ndim, tuple(param.shape), param.data


def _rotary_rows(offset: int, count: int, head_dim: int) -> tuple[int, int, torch.Tensor]:
    """For our rows [offset, offset + count) of a q/k weight: the head-aligned HF row range to
    read, and for each of our rows its index inside that range."""
    first, last = offset // head_dim, math.ceil((offset + count) / head_dim)
    ours = torch.arange(offset, offset + count)
    head, within = ours // head_dim, ours % head_dim
    theirs = head * head_dim + (within % 2) * (head_dim // 2) + within // 2
    return first * head_dim, last * head_dim, theirs - first * head_dim


@torch.no_grad()
def load_hf_weights(model: Llama, path: str | Path) -> None:
    """Fill ``model`` (built from ``config_from_hf(path)``, sharded or not) with the
    checkpoint's weights, each rank reading only what its local pieces need."""
    path = Path(path)
    files = _SafetensorsDir(path)
    for name, buffer in model.named_buffers():  # DeepSeek-V3's routing biases (Qwen3-MoE has none: zeros)
        if name.endswith("feed_forward.expert_bias") and hf_name(name) in files.where:
            buffer.copy_(files.slice(hf_name(name))[:].to(buffer.dtype))
    for name, param in model.named_parameters():  # a tied head appears once, as the embedding
        if name.endswith((".lora_A", ".lora_B")):  # LoRA adapters: not the base's (models/peft_adapter.py)
            continue
        _fill_from_hf(files, name, param, model.cfg)


def _fill_from_hf(files: _SafetensorsDir, name: str, param: torch.Tensor, cfg: LlamaConfig) -> None:
    """Our tensor ``name`` (a parameter, sharded or not, or a plain tensor) from the checkpoint's,
    reading only the rectangle this rank's piece covers."""
    if ".".join(name.split(".")[2:]) in _EXPERTS:
        _load_experts(files, name, param)
        return
    key = hf_name(name)
    if key == "model.embed_tokens.weight" and key not in files.where and cfg.tie_embeddings:
        key = "lm_head.weight"
    source = files.slice(key)
    shape = tuple(source.get_shape())
    if shape != tuple(param.shape):
        raise HFFormatError(f"{files.path}: tensor {key} has shape {list(shape)}, our {name} needs {list(param.shape)}")
    copy_local_piece(source, param, rotary=cfg.hf_rotate_half and name.endswith(_ROTARY), head_dim=cfg.head_dim)


def copy_local_piece(source, param: torch.Tensor, *, rotary: bool, head_dim: int) -> None:
    """Fill this rank's piece of ``param`` (sharded or not) from the safetensors slice ``source``
    of the whole tensor, reading only that rectangle; ``rotary``: the rows are Hugging Face's
    half-split query/key rows, reordered to our interleaved ones."""
    offset, local_shape, local = _region(param)
    if local.numel() == 0:
        return
    cols = [slice(o, o + n) for o, n in zip(offset[1:], local_shape[1:], strict=True)]
    if rotary:
        lo, hi, index = _rotary_rows(offset[0], local_shape[0], head_dim)
        value = source[(slice(lo, hi), *cols)][index]
    else:
        value = source[tuple(slice(o, o + n) for o, n in zip(offset, local_shape, strict=True))]
    local.copy_(value.to(local.dtype))


_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


def base_fingerprint(path: str | Path) -> str:
    """What identifies a Hugging Face base checkpoint wherever it is mounted: a sha256 over its
    ``config.json`` and its safetensors files' names and sizes (a LoRA run's checkpoints hold the
    adapters only, so a resume checks that its ``model.init_from`` is the base they trained on)."""
    import hashlib

    path = Path(path)
    files = _SafetensorsDir(path)
    h = hashlib.sha256(json.dumps(_read_config(path), sort_keys=True).encode())
    for f in sorted(set(files.where.values())):
        real = Path(os.path.realpath(f))
        if files._real not in real.parents:  # an index naming a file elsewhere: never looked at
            raise HFFormatError(f"{path}: its index names {f.name}, outside the checkpoint's directory")
        h.update(f"{f.name}:{real.stat().st_size}".encode())
    return h.hexdigest()


def _load_experts(files: _SafetensorsDir, name: str, param: torch.Tensor) -> None:
    """Our stacked ``[E, rows, cols]`` expert weight from the checkpoint's one tensor per expert,
    only the experts and the rectangle of each that this rank's piece covers."""
    keys = hf_names(name, tuple(param.shape))
    offset, local_shape, local = _region(param)
    for key in keys:
        shape = tuple(files.slice(key).get_shape())
        if shape != tuple(param.shape[1:]):
            raise HFFormatError(f"{files.path}: tensor {key} has shape {list(shape)}, our {name} needs {list(param.shape[1:])} per expert")
    if local.numel() == 0:
        return
    inner = tuple(slice(o, o + n) for o, n in zip(offset[1:], local_shape[1:], strict=True))
    for i in range(local_shape[0]):
        local[i].copy_(files.slice(keys[offset[0] + i])[inner].to(local.dtype))


# ---- export -----------------------------------------------------------------------------------


def hf_config(cfg: LlamaConfig, text: dict | None = None, family: str = "llama") -> dict:
    """The ``config.json`` transformers needs for our model of config ``cfg`` and ``family``
    (``FAMILIES``); ``text`` (a run's ``hf_text`` record) adds its special token ids and the
    source's ``max_position_embeddings`` (a job's ``max_seq_len`` is the context it trained on,
    not the model's limit)."""
    model_type, arch = FAMILIES[family]
    config = {
        "architectures": [arch],
        "model_type": model_type,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_hidden_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "max_position_embeddings": cfg.max_seq_len,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    config.update(MODEL_SPECS[family].hf.config_keys(cfg))
    return {**config, **((text or {}).get("config") or {})}


def _check_family(cfg: LlamaConfig, family: str) -> None:
    """The variants ``cfg`` uses exist in ``family``'s Hugging Face model (a Llama has no q/k norms)."""
    if family not in FAMILIES:
        raise HFFormatError(f"Hugging Face export covers {', '.join(FAMILIES)}, not {family!r}")
    adapter = MODEL_SPECS[family].hf
    uses = {"qkv_bias": cfg.qkv_bias, "qk_norm": cfg.qk_norm, "sliding_window": cfg.sliding_window is not None}
    has = adapter.variants
    missing = [k for k, used in uses.items() if used and k not in has]
    missing += [k for k in has if k != "sliding_window" and not uses[k]] + adapter.unsupported(cfg)
    if missing:
        raise HFFormatError(
            f"a {family} model with these settings ({', '.join(f'{k}={getattr(cfg, k)!r}' for k in missing)}) "
            f"has no {FAMILIES[family][1]} equivalent"
        )


def _to_hf_layout(name: str, value: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Our interleaved query/key rows -> Hugging Face's rotate_half rows (the inverse of the load)."""
    if not name.endswith(_ROTARY):
        return value
    rows, rest = value.shape[0], value.shape[1:]
    return value.view(rows // head_dim, head_dim // 2, 2, *rest).transpose(1, 2).reshape(value.shape)


def export_hf(
    checkpoint: str | Path,
    out: str | Path,
    cfg: LlamaConfig,
    *,
    max_shard_bytes: int = 2 << 30,
    text: dict | None = None,
    family: str = "llama",
    lora: dict | None = None,
    base: str | Path | None = None,
) -> dict:
    """Write a committed checkpoint of our ``family`` model (``FAMILIES``) as a Hugging Face checkpoint directory:
    ``config.json``, ``model-0000x-of-0000y.safetensors`` and their index, loadable by
    ``transformers.AutoModelForCausalLM.from_pretrained(out)``; with ``text`` (the run's
    ``hf_text`` record) also its special token ids, ``generation_config.json`` and tokenizer files
    (then ``AutoTokenizer.from_pretrained(out)`` loads, and ``generate`` stops at end of text).

    Streams: the tensors are read from the sharded checkpoint and written one shard file at a
    time (at most ``max_shard_bytes`` of tensors in memory, or one tensor if larger). Writes into
    ``out`` + ``.tmp`` and renames at the end: a failed export leaves nothing at ``out``.
    ``base`` (a Hugging Face checkpoint directory): where the weights the checkpoint does not
    hold come from (a LoRA run's checkpoints hold its adapters only).
    Returns ``{"files": [...], "tensors": N}``."""
    checkpoint, out = Path(checkpoint), Path(out)
    _check_family(cfg, family)
    with CheckpointReader(checkpoint).opened() as (reader, _, _):
        return _export_hf(checkpoint, reader, out, cfg, max_shard_bytes, text, family, lora, base)


def _export_hf(
    checkpoint: Path,
    reader,
    out: Path,
    cfg: LlamaConfig,
    max_shard_bytes: int,
    text: dict | None,
    family: str,
    lora: dict | None = None,
    base: str | Path | None = None,
) -> dict:
    import shutil
    import types

    metadata = reader.read_metadata()
    ours = {}
    for key, md in metadata.state_dict_metadata.items():
        path = metadata.planner_data[key]
        if path[0] == "model" and hasattr(md, "size"):
            ours[path[1]] = md
    with torch.device("meta"):
        wanted = {n: tuple(p.shape) for n, p in _exported(model_class(family)(cfg), family)}
    if base is not None and any(n not in ours for n in wanted):  # from the base, in its own dtype
        base = _SafetensorsDir(Path(base))
        for n, shape in wanted.items():
            if n not in ours:
                dtype = _SAFETENSORS_DTYPES.get(base.slice(hf_names(n, shape)[0]).get_dtype(), torch.float32)
                ours[n] = types.SimpleNamespace(size=shape, properties=types.SimpleNamespace(dtype=dtype), base=True)
    problems = [f"{n} is missing" for n in wanted if n not in ours] + [
        f"{n} has shape {list(ours[n].size)}, the config needs {list(shape)}"
        for n, shape in wanted.items()
        if n in ours and tuple(ours[n].size) != shape
    ]
    if problems:
        raise HFFormatError(f"{checkpoint}: does not hold the model of this config: {'; '.join(problems)}")
    names = list(wanted)
    expected = {key for n in names for key in hf_names(n, wanted[n])}
    groups, size = [[]], 0
    for n in names:
        md = ours[n]
        nbytes = math.prod(md.size) * md.properties.dtype.itemsize
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(n)
        size += nbytes
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{out.name}.tmp-", dir=out.parent))  # this export's own
    try:
        files = _write_shards(reader, tmp, groups, ours, cfg, lora, base)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    weight_map = {}
    for fname, tensor_names in files:
        weight_map.update(dict.fromkeys(tensor_names, fname))
    if set(weight_map) != expected:
        shutil.rmtree(tmp, ignore_errors=True)
        raise HFFormatError(f"{checkpoint}: exported tensors {sorted(set(weight_map) ^ expected)} do not match the model")
    total = sum(math.prod(ours[n].size) * ours[n].properties.dtype.itemsize for n in names)
    (tmp / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    (tmp / "config.json").write_text(json.dumps(hf_config(cfg, text, family), indent=2))
    extras = write_text_files(text, tmp)
    _replace_dir(tmp, out)
    return {"files": [f for f, _ in files] + extras, "tensors": len(weight_map)}


def _replace_dir(new: Path, out: Path) -> None:
    """Put the directory ``new`` at ``out``, replacing what is there: the old one is renamed
    aside first (under a name of its own), so an export running beside this one never sees a
    half-deleted directory, and whichever finishes last is the one left."""
    import shutil

    for _ in range(100):
        old = None
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f"{out.name}.old-", dir=out.parent))
            with contextlib.suppress(FileNotFoundError):  # another export moved it first
                out.rename(old / "x")
        try:
            new.rename(out)
        except OSError:  # another export put its own there meanwhile: move that one aside too
            continue
        finally:
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        return
    shutil.rmtree(new, ignore_errors=True)
    raise OSError(f"{out}: could not be replaced (other exports of it kept replacing it)")


def _write_shards(
    reader, tmp: Path, groups: list, ours: dict, cfg: LlamaConfig, lora: dict | None = None, base=None
) -> list:
    """One safetensors file per group of tensors, read from the checkpoint group by group (those
    it does not hold from ``base``); with ``lora`` (the run's LoRA record) each adapted weight
    gets its update merged in, in fp32, as PEFT's ``merge_and_unload``: ``W + scaling * B @ A``."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    adapted = set(lora["modules"]) if lora else set()
    files = []
    for i, group in enumerate(groups, start=1):
        targets = {n: torch.empty(tuple(ours[n].size), dtype=ours[n].properties.dtype) for n in group}
        merged = [n for n in group if n.endswith(".weight") and n.removesuffix(".weight") in adapted]
        for n in merged:
            for which in ("lora_A", "lora_B"):
                key = f"{n.removesuffix('.weight')}.{which}"
                targets[key] = torch.empty(tuple(ours[key].size), dtype=ours[key].properties.dtype)
        from_base = {n: targets.pop(n) for n in list(targets) if getattr(ours.get(n), "base", False)}
        dcp_load({"model": targets}, reader, tmp, planner=DefaultLoadPlanner(allow_partial_load=True))
        for n, t in from_base.items():
            _fill_from_hf(base, n, t, cfg)
        targets.update(from_base)
        for n in merged:
            module = n.removesuffix(".weight")
            a, b = targets.pop(f"{module}.lora_A").float(), targets.pop(f"{module}.lora_B").float()
            targets[n] = (targets[n].float() + lora["scaling"] * (b @ a)).to(targets[n].dtype)
        fname = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        tensors = {k: v for n, t in targets.items() for k, v in hf_tensors(n, t, cfg).items()}
        save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
        files.append((fname, list(tensors)))
        del targets, tensors
    return files


def export_checkpoint_hf(
    checkpoint: str | Path, out: str | Path, *, max_shard_bytes: int = 2 << 30, base: str | Path | None = None
) -> dict:
    """``export_hf`` with the model and config the trainer recorded in the checkpoint. A LoRA run's
    checkpoint holds its adapters only: its frozen base is read from ``base`` (default: the run's
    ``model.init_from``), which must be the base the adapters were trained on (its fingerprint)."""
    try:
        recorded = CheckpointReader(checkpoint).extra(0).get("model")
    except (OSError, RuntimeError) as e:
        raise HFFormatError(f"{checkpoint}: cannot read the trainer's record extra/rank-0.pt ({e})") from None
    if not recorded or recorded.get("name") not in FAMILIES or not recorded.get("config"):
        raise HFFormatError(
            f"{checkpoint}: no model config of {', '.join(FAMILIES)} recorded (a checkpoint of another model, or "
            "written before hpservice recorded it); Hugging Face export covers those built-in models"
        )
    cfg = config_class(recorded["name"])(**recorded["config"])
    lora = recorded.get("lora")  # a LoRA run: its adapters merged into the weights (merge_and_unload)
    if lora is not None:
        from .lora import LoraSettings

        fields = {f.name for f in dataclasses.fields(LoraSettings)}
        lora = {**lora, "scaling": LoraSettings(**{k: v for k, v in lora.items() if k in fields}).scaling}
    if lora is not None and lora.get("base_fingerprint"):  # the frozen base a LoRA run's checkpoints leave out
        base = base or lora.get("base")
        if base_fingerprint(base) != lora["base_fingerprint"]:
            raise HFFormatError(
                f"{checkpoint}: its adapters were trained on the base {lora.get('base')!r}; {str(base)!r} is another "
                "model (config.json or weight files differ): give that base with --base"
            )
    elif base is not None:
        raise HFFormatError(f"{checkpoint}: holds its whole model; a base is only read for a LoRA run's adapters")
    return export_hf(
        checkpoint, out, cfg, max_shard_bytes=max_shard_bytes, text=recorded.get("text"), family=recorded["name"],
        lora=lora, base=base,
    )


def export_checkpoint_peft(checkpoint: str | Path, out: str | Path) -> dict:
    """The LoRA adapters of a committed checkpoint as a PEFT adapter directory
    (``adapter_config.json``, ``adapter_model.safetensors``) that ``peft.PeftModel.from_pretrained``
    loads onto the Hugging Face base."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from .lora import LoraSettings
    from .peft_adapter import adapter_config, peft_tensors, write_adapter

    checkpoint, out = Path(checkpoint), Path(out)
    recorded = CheckpointReader(checkpoint).extra(0).get("model") or {}
    lora = recorded.get("lora")
    if lora is None or recorded.get("name") not in FAMILIES or not recorded.get("config"):
        raise HFFormatError(f"{checkpoint}: not a checkpoint of a LoRA run (model.lora) of a built-in family")
    cfg = config_class(recorded["name"])(**recorded["config"])
    fields = {f.name for f in dataclasses.fields(LoraSettings)}
    settings = LoraSettings(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in lora.items() if k in fields})
    with CheckpointReader(checkpoint).opened() as (reader, _, _):
        metadata = reader.read_metadata()
        names = {metadata.planner_data[k][1]: md for k, md in metadata.state_dict_metadata.items()
                 if metadata.planner_data[k][0] == "model" and metadata.planner_data[k][1].endswith((".lora_A", ".lora_B"))}  # fmt: skip
        targets = {n: torch.empty(tuple(md.size), dtype=md.properties.dtype) for n, md in names.items()}
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f"{out.name}.tmp-", dir=out.parent))
        dcp_load({"model": targets}, reader, tmp, planner=DefaultLoadPlanner(allow_partial_load=True))
    tensors = {}
    for n, value in targets.items():
        module, which = n.rsplit(".", 1)
        tensors.update(peft_tensors(module, which, value, cfg))
    files = write_adapter(tmp, tensors, adapter_config(settings, lora["modules"], lora.get("base")))
    _replace_dir(tmp, out)
    return {"files": files, "tensors": len(tensors)}


def _exported(model: Llama, family: str) -> list[tuple[str, torch.Tensor]]:
    """What a Hugging Face checkpoint of ``family`` holds of ``model``: its parameters (a tied
    head once, as the embedding) and the buffers its adapter names (DeepSeek-V3's routing biases)."""
    named = list(model.named_parameters())
    buffers = MODEL_SPECS[family].hf.buffers
    return named + [(n, b) for n, b in model.named_buffers() if buffers and n.endswith(buffers)]


def family_of(model: Llama) -> str:
    """The family (``FAMILIES``' key) of one of our built-in decoder models."""
    for family in FAMILIES:
        if type(model) is model_class(family):
            return family
    raise HFFormatError(f"{type(model).__name__} has no Hugging Face family (one of {', '.join(FAMILIES)})")


def save_hf_pretrained(model: Llama, out: str | Path) -> Path:
    """Write an unsharded model of ours (any family) in Hugging Face format (one safetensors file
    + config.json): a model made here that transformers, or ``model.init_from``, can start from."""
    from safetensors.torch import save_file

    family = family_of(model)
    _check_family(model.cfg, family)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {
        k: v.cpu() for n, p in _exported(model, family) for k, v in hf_tensors(n, p.detach(), model.cfg).items()
    }
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(model.cfg, family=family), indent=2))
    return out
