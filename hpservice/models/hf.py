"""Hugging Face Llama checkpoints into our Llama, each rank reading only its own slices.

A checkpoint directory holds ``config.json`` and ``model.safetensors``, or sharded
``model-0000x-of-0000y.safetensors`` files listed in ``model.safetensors.index.json``.

- ``llama_config_from_hf(dir)`` maps the config (``LlamaForCausalLM``: hidden size, layers,
  heads, KV heads, intermediate size, rope theta, RMS eps, tied embeddings, vocab) to a
  ``LlamaConfig`` (transformers 4's ``rope_theta`` / ``rope_scaling`` and 5's
  ``rope_parameters``; plain and Llama 3 ``llama3`` frequencies). Anything we would compute
  differently is refused with the key and the value (other rope types, attention or MLP biases,
  a head_dim other than hidden / heads, an activation other than SiLU), never approximated.
- ``load_hf_weights(model, dir)`` fills an already built (and possibly sharded) ``Llama`` in
  place. For each parameter, a DTensor (FSDP, HSDP, TP and their compositions) or a plain
  tensor, the rank computes the global rectangle its local piece covers and reads only that from
  the safetensors file (``safe_open(...).get_slice``). The full model never exists on one rank.

Rotary layout: our attention rotates interleaved channel pairs ``(2i, 2i+1)`` (Meta's layout).
Hugging Face's ``q_proj`` / ``k_proj`` rows are permuted for its ``rotate_half``: within each
head, row ``c * head_dim/2 + i`` of theirs is our row ``2i + c``. Our rows of a query/key weight
are read head by head, from the heads the local rows touch, and reordered.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from hpservice.checkpoint._reader import CheckpointReader, dcp_load
from hpservice.inputs import InputError, open_input, opened_path

from .hf_text import write_text_files
from .llama import Llama, LlamaConfig

__all__ = ["HFFormatError", "export_checkpoint_hf", "export_hf", "hf_config", "hf_name", "llama_config_from_hf", "load_hf_weights", "save_hf_pretrained"]

_ARCHITECTURES = ("LlamaForCausalLM",)


class HFFormatError(ValueError):
    """A Hugging Face checkpoint we cannot read exactly: the file, the key, what we found."""


def _read_config(path: Path) -> dict:
    config = Path(path) / "config.json"
    try:
        with open_input(config, "r") as f:
            return json.loads(f.read())
    except InputError:
        raise
    except OSError as e:
        raise HFFormatError(f"{config}: cannot read ({e.strerror})") from None
    except ValueError as e:
        raise HFFormatError(f"{config}: not valid JSON ({e})") from None


def llama_config_from_hf(path: str | Path, **overrides) -> LlamaConfig:
    """Our ``LlamaConfig`` for the checkpoint at ``path``; ``overrides`` replace fields (e.g.
    ``max_seq_len`` shorter than the checkpoint's)."""
    cfg = _read_config(Path(path))
    where = Path(path) / "config.json"
    archs = cfg.get("architectures") or [cfg.get("model_type")]
    if not any(a in _ARCHITECTURES or a == "llama" for a in archs):
        raise HFFormatError(f"{where}: architectures {archs} are not supported (supported: {', '.join(_ARCHITECTURES)})")

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
        elif scaling.get("rope_type") != "llama3":
            key = "rope_parameters" if v5 else "rope_scaling"
            raise HFFormatError(
                f"{where}: {key} of rope_type {scaling.get('rope_type')!r} is not supported: plain and Llama 3 "
                "('llama3') frequencies are implemented"
            )
    refuse("attention_bias", (None, False), "our attention projections have no bias")
    refuse("mlp_bias", (None, False), "our MLP projections have no bias")
    refuse("hidden_act", (None, "silu"), "our MLP is SwiGLU with SiLU")
    heads = cfg["num_attention_heads"]
    if cfg.get("head_dim") not in (None, cfg["hidden_size"] // heads):
        raise HFFormatError(f"{where}: head_dim = {cfg['head_dim']} differs from hidden_size / num_attention_heads")
    fields = {
        "dim": cfg["hidden_size"],
        "n_layers": cfg["num_hidden_layers"],
        "n_heads": heads,
        "n_kv_heads": cfg.get("num_key_value_heads") or heads,
        "vocab_size": cfg["vocab_size"],
        "hidden_dim": cfg["intermediate_size"],
        "norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
        "rope_theta": float(theta),
        "rope_scaling": scaling,
        "max_seq_len": cfg.get("max_position_embeddings", 2048),
        "tie_embeddings": bool(cfg.get("tie_word_embeddings", False)),
    }
    fields.update(overrides)
    return LlamaConfig(**fields)


def hf_name(name: str) -> str:
    """The Hugging Face tensor name of one of our Llama's parameters."""
    parts = name.split(".")
    if name == "tok_embeddings.weight":
        return "model.embed_tokens.weight"
    if name == "norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    if parts[0] == "layers":
        i, rest = parts[1], ".".join(parts[2:])
        table = {
            "attention.wq.weight": "self_attn.q_proj.weight",
            "attention.wk.weight": "self_attn.k_proj.weight",
            "attention.wv.weight": "self_attn.v_proj.weight",
            "attention.wo.weight": "self_attn.o_proj.weight",
            "feed_forward.w1.weight": "mlp.gate_proj.weight",
            "feed_forward.w3.weight": "mlp.up_proj.weight",
            "feed_forward.w2.weight": "mlp.down_proj.weight",
            "attention_norm.weight": "input_layernorm.weight",
            "ffn_norm.weight": "post_attention_layernorm.weight",
        }
        if rest in table:
            return f"model.layers.{i}.{table[rest]}"
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
                with open_input(index, "r", within=[self._real]) as f:
                    self.where = {k: path / v for k, v in json.loads(f.read())["weight_map"].items()}
            except (ValueError, KeyError) as e:
                raise HFFormatError(f"{index}: not a safetensors index ({e})") from None
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
    """Fill ``model`` (built from ``llama_config_from_hf(path)``, sharded or not) with the
    checkpoint's weights, each rank reading only what its local pieces need."""
    path = Path(path)
    files = _SafetensorsDir(path)
    head_dim = model.cfg.head_dim
    for name, param in model.named_parameters():  # a tied head appears once, as the embedding
        key = hf_name(name)
        if key == "model.embed_tokens.weight" and key not in files.where and model.cfg.tie_embeddings:
            key = "lm_head.weight"
        source = files.slice(key)
        shape = tuple(source.get_shape())
        if shape != tuple(param.shape):
            raise HFFormatError(f"{path}: tensor {key} has shape {list(shape)}, our {name} needs {list(param.shape)}")
        offset, local_shape, local = _region(param)
        if local.numel() == 0:
            continue
        cols = [slice(o, o + n) for o, n in zip(offset[1:], local_shape[1:], strict=True)]
        if name.endswith(("attention.wq.weight", "attention.wk.weight")):
            lo, hi, index = _rotary_rows(offset[0], local_shape[0], head_dim)
            block = source[(slice(lo, hi), *cols)]
            value = block[index]
        else:
            value = source[tuple(slice(o, o + n) for o, n in zip(offset, local_shape, strict=True))]
        local.copy_(value.to(local.dtype))


# ---- export -----------------------------------------------------------------------------------


def hf_config(cfg: LlamaConfig, text: dict | None = None) -> dict:
    """The ``config.json`` transformers needs for our Llama of config ``cfg``; ``text`` (a run's
    ``hf_text`` record) adds its special token ids and the source's ``max_position_embeddings``
    (a job's ``max_seq_len`` is the context it trained on, not the model's limit)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
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
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
        **((text or {}).get("config") or {}),
    }


def _to_hf_layout(name: str, value: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Our interleaved query/key rows -> Hugging Face's rotate_half rows (the inverse of the load)."""
    if not name.endswith(("attention.wq.weight", "attention.wk.weight")):
        return value
    rows, cols = value.shape
    return value.view(rows // head_dim, head_dim // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def export_hf(
    checkpoint: str | Path, out: str | Path, cfg: LlamaConfig, *, max_shard_bytes: int = 2 << 30, text: dict | None = None
) -> dict:
    """Write a committed checkpoint of our Llama as a Hugging Face checkpoint directory:
    ``config.json``, ``model-0000x-of-0000y.safetensors`` and their index, loadable by
    ``transformers.AutoModelForCausalLM.from_pretrained(out)``; with ``text`` (the run's
    ``hf_text`` record) also its special token ids, ``generation_config.json`` and tokenizer files
    (then ``AutoTokenizer.from_pretrained(out)`` loads, and ``generate`` stops at end of text).

    Streams: the tensors are read from the sharded checkpoint and written one shard file at a
    time (at most ``max_shard_bytes`` of tensors in memory, or one tensor if larger). Writes into
    ``out`` + ``.tmp`` and renames at the end: a failed export leaves nothing at ``out``.
    Returns ``{"files": [...], "tensors": N}``."""
    checkpoint, out = Path(checkpoint), Path(out)
    with CheckpointReader(checkpoint).opened() as (reader, _, _):
        return _export_hf(checkpoint, reader, out, cfg, max_shard_bytes, text)


def _export_hf(checkpoint: Path, reader, out: Path, cfg: LlamaConfig, max_shard_bytes: int, text: dict | None) -> dict:
    import shutil

    metadata = reader.read_metadata()
    ours = {}
    for key, md in metadata.state_dict_metadata.items():
        path = metadata.planner_data[key]
        if path[0] == "model" and hasattr(md, "size"):
            ours[path[1]] = md
    with torch.device("meta"):
        wanted = {n: tuple(p.shape) for n, p in Llama(cfg).named_parameters()}  # a tied head appears once
    problems = [f"{n} is missing" for n in wanted if n not in ours] + [
        f"{n} has shape {list(ours[n].size)}, the config needs {list(shape)}"
        for n, shape in wanted.items()
        if n in ours and tuple(ours[n].size) != shape
    ]
    if problems:
        raise HFFormatError(f"{checkpoint}: does not hold the model of this config: {'; '.join(problems)}")
    names = list(wanted)
    expected = {hf_name(n) for n in names}
    groups, size = [[]], 0
    for n in names:
        md = ours[n]
        nbytes = math.prod(md.size) * md.properties.dtype.itemsize
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(n)
        size += nbytes
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        files = _write_shards(reader, tmp, groups, ours, cfg)
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
    (tmp / "config.json").write_text(json.dumps(hf_config(cfg, text), indent=2))
    extras = write_text_files(text, tmp)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return {"files": [f for f, _ in files] + extras, "tensors": len(weight_map)}


def _write_shards(reader, tmp: Path, groups: list, ours: dict, cfg: LlamaConfig) -> list:
    """One safetensors file per group of tensors, read from the checkpoint group by group."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    files = []
    for i, group in enumerate(groups, start=1):
        targets = {n: torch.empty(tuple(ours[n].size), dtype=ours[n].properties.dtype) for n in group}
        dcp_load({"model": targets}, reader, tmp, planner=DefaultLoadPlanner(allow_partial_load=True))
        fname = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        tensors = {hf_name(n): _to_hf_layout(n, t, cfg.head_dim).contiguous() for n, t in targets.items()}
        save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
        files.append((fname, list(tensors)))
        del targets, tensors
    return files


def export_checkpoint_hf(checkpoint: str | Path, out: str | Path, *, max_shard_bytes: int = 2 << 30) -> dict:
    """``export_hf`` with the model config the trainer recorded in the checkpoint (a llama's)."""
    try:
        recorded = CheckpointReader(checkpoint).extra(0).get("model")
    except (OSError, RuntimeError) as e:
        raise HFFormatError(f"{checkpoint}: cannot read the trainer's record extra/rank-0.pt ({e})") from None
    if not recorded or recorded.get("name") != "llama" or not recorded.get("config"):
        raise HFFormatError(
            f"{checkpoint}: no llama model config recorded (a checkpoint of another model, or written before "
            "hpservice recorded it); Hugging Face export covers the built-in llama"
        )
    cfg = LlamaConfig(**recorded["config"])
    return export_hf(checkpoint, out, cfg, max_shard_bytes=max_shard_bytes, text=recorded.get("text"))


def save_hf_pretrained(model: Llama, out: str | Path) -> Path:
    """Write an unsharded Llama in Hugging Face format (one safetensors file + config.json): a
    model made here that transformers, or ``model.init_from``, can start from."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {
        hf_name(n): _to_hf_layout(n, p.detach(), model.cfg.head_dim).contiguous().cpu()
        for n, p in model.named_parameters()
    }
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(model.cfg), indent=2))
    return out
