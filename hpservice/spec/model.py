"""The model of a job spec: one pydantic ``JobSpec`` of sections, their fields, defaults, bounds
and the checks a spec can make on its own (cross-field rules, ``resized``, ``with_run``).

Reading it from YAML or JSON, with overrides and errors that name fields, is ``loading.py``.
"""

from __future__ import annotations

import difflib
import json
import os
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .composition import refusals

_MAX_PATH = 4096  # characters in a path or URL field
INT64 = (-(1 << 63), (1 << 63) - 1)  # integers are stored as int64
MAX_OVERRIDES_BYTES = 64 << 10


MAX_DEVICE_MEMORY = 1 << 44  # 16 TiB: more than any accelerator (or host) a worker has
_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """``"64G"``, ``"512M"``, ``"1.5T"`` or a plain number of bytes (binary units, a trailing
    ``i``/``B`` allowed: ``64GiB``, ``80GB`` is 80 GiB as GPU makers count it)."""
    import re

    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not match:
        raise ValueError(f"{text!r} is not a size: use a number of bytes or one with K, M, G or T (e.g. 80GiB)")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).upper()])


def parse_device_memory(value: int | str) -> int:
    """A device's memory (``resources.device_memory``, ``validate --device-memory``): bytes or a
    size (``parse_size``); a ``ValueError`` saying why for anything else, for zero or less, and for
    more than ``MAX_DEVICE_MEMORY``."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"{value!r} is not a size: use bytes (an integer) or a string like 80GiB")
    if isinstance(value, str):
        value = parse_size(value)
    if value <= 0 or value > MAX_DEVICE_MEMORY:
        raise ValueError(f"{value} bytes is not a device's memory: it must be more than 0 and at most 16 TiB")
    return value


class SpecError(ValueError):
    """An invalid job spec; ``errors`` lists (field path, message) pairs."""

    def __init__(self, message: str, errors: list[tuple[str, str]] | None = None):
        super().__init__(message)
        self.errors = errors or []


class _Section(BaseModel):
    # strict: `tensorboard: 0` or `steps: "5"` is an error, not a silent coercion.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True, strict=True)


class LoraSpec(_Section):
    """Low-rank adapters in PEFT's vocabulary (``peft.LoraConfig``'s fields): the base weights
    frozen, ``lora_A`` / ``lora_B`` trained beside each target linear layer (docs/lora.md)."""

    r: int = Field(..., ge=1, le=4096, description="the adapters' rank (at most the adapted layer's width)")
    lora_alpha: float = Field(..., gt=0, description="the update is scaled by lora_alpha / r (use_rslora: / sqrt(r))")
    lora_dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input")
    target_modules: list[Annotated[str, Field(max_length=64)]] | Literal["all-linear"] = Field(
        "all-linear",
        description="PEFT's names of the layers to adapt (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
        "down_proj, lm_head; or ours: wq ... w3, output), or 'all-linear' (every linear layer but the head)",
    )
    use_rslora: bool = Field(False, description="rank-stabilised scaling: lora_alpha / sqrt(r)")
    bias: Literal["none"] = Field("none", description="only 'none' (PEFT's default): biases stay frozen")
    quantize_base: Literal["none", "nf4"] = Field(
        "none",
        description="QLoRA: 'nf4' holds the adapted layers' frozen weights in torchao's 4-bit NF4 (block 64, "
        "double-quantised scalers), dequantised in the forward; needs model.init_from (docs/lora.md)",
    )


class ModelSpec(_Section):
    name: str | None = Field(
        None,
        max_length=200,
        description="built-in model (deepseek_v3, llama, mistral, mlp, qwen2, qwen3, qwen3_moe) or "
        "'package.module:factory'; null: the family of the init_from checkpoint, else llama",
    )
    flavor: str | None = Field(
        None,
        max_length=64,
        description="size preset of a built-in model (tiny, small, 1B, 8B; null: tiny); a factory takes none",
    )
    overrides: dict[str, Any] = Field(
        default_factory=dict,
        description=f"config fields to change, or factory kwargs (at most {MAX_OVERRIDES_BYTES} bytes as JSON)",
    )

    init_from: str | None = Field(
        None,
        max_length=_MAX_PATH,
        description="a Hugging Face checkpoint directory (config.json + safetensors) of llama, qwen2, qwen3, "
        "mistral, qwen3_moe or deepseek_v3: the model takes its family (model.name may be left out), its config, "
        "and starts from its weights (a fresh optimizer; resume_from continues a run of ours instead)",
    )
    lora: LoraSpec | None = Field(None, description="train low-rank adapters instead of every weight (docs/lora.md)")
    init_adapter: str | None = Field(
        None,
        max_length=_MAX_PATH,
        description="model.lora: start from this PEFT adapter directory (adapter_config.json + "
        "adapter_model.safetensors); its r, alpha and targets must be model.lora's",
    )

    @model_validator(mode="after")
    def _adapter_needs_lora(self):
        if self.init_adapter is not None and self.lora is None:
            raise ValueError("model.init_adapter: needs model.lora (the adapter's r, lora_alpha and target_modules)")
        return self

    @model_validator(mode="after")
    def _flavor_exists(self):
        """A built-in model's flavor must be one of its own. (Other names are checked where they
        are resolved: ``hpservice.preflight.check_model``, the server's allowlist in the service.)"""
        from hpservice.models import list_flavors, list_models  # torch: only when a spec is validated

        name = "llama" if self.name is None else self.name
        if name not in list_models() and self.flavor is not None:
            raise ValueError(
                f"model.flavor: {self.flavor!r} only applies to the built-in models ({', '.join(list_models())}); "
                f"{name!r} takes its settings from model.overrides (its factory's keyword arguments): "
                "leave flavor out"
            )
        if self.flavor is not None and self.init_from is None:
            flavors = list_flavors(name)
            if self.flavor not in flavors:
                raise ValueError(
                    f"model.flavor: {self.flavor!r} is not a flavor of {name}; allowed: {', '.join(flavors)}"
                    + did_you_mean(self.flavor, flavors)
                )
        return self

    @model_validator(mode="after")
    def _init_from_family(self):
        from hpservice.models import HF_FAMILIES

        if self.init_from is not None and self.name is not None and self.name not in HF_FAMILIES:
            raise ValueError(
                f"model.init_from imports Hugging Face checkpoints into {', '.join(HF_FAMILIES)}, not {self.name!r} "
                "(leave model.name out to take the checkpoint's family)"
            )
        return self

    @field_validator("overrides")
    @classmethod
    def _overrides_bounded(cls, v: dict) -> dict:
        size = len(json.dumps(v))
        if size > MAX_OVERRIDES_BYTES:
            raise ValueError(f"{size} bytes as JSON; at most {MAX_OVERRIDES_BYTES}")
        return v


_CHAT_FIELD_KEYS = {
    "messages": ("messages", "role", "content", "tools"),
    "sharegpt": ("conversations", "from", "value", "tools"),
    "alpaca": ("instruction", "input", "output", "system"),
    "prompt_completion": ("prompt", "completion", "tools"),
}


class ChatSourceSpec(_Section):
    """One source of a chat-data mixture."""

    path: str = Field(..., max_length=_MAX_PATH, description="a .jsonl or .parquet file, a glob of them, or a datasets save_to_disk directory")
    weight: float = Field(1.0, ge=0, le=1000, description="records per epoch relative to the source's size (2: each twice; 0.5: a seeded half)")


class DataSpec(_Section):
    kind: Literal["synthetic", "tokens", "text", "chat", "preference"] = Field(
        "synthetic",
        description="synthetic tokens, a .bin token file, a text file, conversations (chat: JSONL / Parquet / a "
        "datasets directory, rendered with the model's chat template; docs/fine-tuning.md), or preference pairs "
        "{prompt, chosen, rejected} for objective.kind dpo (docs/dpo.md)",
    )
    path: str | None = Field(
        None,
        max_length=_MAX_PATH,
        description="file for kind 'tokens' or 'text'; kind 'chat': a .jsonl or .parquet file, a glob of them, or a "
        "datasets save_to_disk directory (or data.sources)",
    )
    sources: list[ChatSourceSpec] = Field(
        default_factory=list, max_length=64, description="kind 'chat': a mixture of sources with weights (instead of data.path)"
    )
    tokenizer: str | None = Field(
        None,
        max_length=_MAX_PATH,
        description="kind 'text': a Hugging Face tokenizer.json to tokenize it with (once, into the run's "
        "directory); default the byte-level tokenizer (vocabulary 256). Kind 'chat': a tokenizer directory "
        "(tokenizer.json, tokenizer_config.json with its chat_template); default model.init_from",
    )
    format: Literal["messages", "sharegpt", "alpaca", "prompt_completion"] = Field(
        "messages",
        description="kind 'chat': the records' format: OpenAI messages (role/content), ShareGPT conversations "
        "(from/value), Alpaca (instruction/input/output), or prompt/completion",
    )
    fields: dict[str, Annotated[str, Field(max_length=200)]] = Field(
        default_factory=dict,
        max_length=8,
        description="kind 'chat': the records' field names where they differ from the format's (e.g. {messages: chat, "
        "role: speaker})",
    )
    chat_template: str | None = Field(
        None,
        max_length=256 << 10,
        description="kind 'chat': a Jinja chat template, inline or a .jinja file; default the tokenizer's",
    )
    train_on: Literal["assistant", "last_assistant", "completion", "all"] = Field(
        "assistant",
        description="kind 'chat': the tokens the loss learns from: every assistant turn, the last one, the "
        "completion (prompt/completion data; its default), or every token",
    )
    train_eos: bool = Field(True, description="kind 'chat': train each assistant turn's end-of-turn token (else generation never stops)")
    packing: Literal["none", "first_fit", "best_fit"] = Field(
        "none",
        description="kind 'chat': several conversations per sequence (attention and positions kept per conversation), or "
        "one per sequence, padded",
    )
    truncation: Literal["drop", "truncate"] = Field(
        "drop", description="kind 'chat': a conversation longer than seq_len is dropped, or cut to seq_len (both counted)"
    )
    on_bad_record: Literal["error", "skip"] = Field(
        "error", description="kind 'chat': a record that does not match its format stops the job naming it, or is skipped and counted"
    )
    vocab_size: int | None = Field(None, gt=0, description="vocabulary size (synthetic data; defaults to the model's)")
    seq_len: int = Field(64, gt=1, description="tokens per sample")
    global_batch: int = Field(8, gt=0, description="samples per optimizer step, over all data-parallel ranks")
    seed: int = Field(0, description="data order seed: the batch of a step depends only on (seed, step)")
    document_mask: bool = Field(
        False,
        description="packed documents: each token attends only to earlier tokens of its own document, a document "
        "ending at the end-of-text token (data.eos_id); blockwise attention, never a [seq, seq] mask",
    )
    eos_id: int | None = Field(
        None,
        ge=0,
        description="the end-of-text token id that ends a document (document_mask); default: the one hpservice "
        "prepare-data recorded beside the token file",
    )

    @model_validator(mode="after")
    def _chat_fields(self):
        chat_only = ("sources", "format", "fields", "chat_template", "train_on", "train_eos", "packing", "truncation", "on_bad_record")
        # preference pairs take the tokenizer's template, the field names, truncation and the bad-record policy
        pair_fields = ("fields", "chat_template", "truncation", "on_bad_record")
        for name in chat_only:  # a default value is no setting (a dumped spec carries every field)
            if self.kind == "chat" or (self.kind == "preference" and name in pair_fields):
                continue
            field = type(self).model_fields[name]
            default = field.default_factory() if field.default_factory is not None else field.default
            if getattr(self, name) != default:
                kinds = "'chat' and 'preference'" if name in pair_fields else "'chat'"
                raise ValueError(f"data.{name} applies to kind {kinds}, not {self.kind!r}")
        if self.kind == "preference":
            if not self.path:
                raise ValueError("data.path is required for kind 'preference' (a .jsonl or .parquet file, a glob, or a datasets directory)")
            for key in self.fields:
                if key not in ("prompt", "chosen", "rejected"):
                    raise ValueError(f"data.fields.{key}: not a field of preference pairs; their fields: prompt, chosen, rejected")
        if self.kind != "chat":
            return self
        if bool(self.path) == bool(self.sources):
            raise ValueError("data.path or data.sources (one of them) is required for kind 'chat'")
        allowed = _CHAT_FIELD_KEYS[self.format]
        for key in self.fields:
            if key not in allowed:
                raise ValueError(f"data.fields.{key}: not a field of format {self.format!r}; its fields: {', '.join(allowed)}")
        if self.document_mask or self.eos_id is not None:
            raise ValueError("data.document_mask / data.eos_id: kind 'chat' keeps attention per conversation itself (data.packing)")
        if self.sources and not any(s.weight > 0 for s in self.sources):
            raise ValueError("data.sources: every weight is 0")
        return self

    @model_validator(mode="after")
    def _path_for_files(self):
        if self.kind in ("tokens", "text") and not self.path:
            raise ValueError(f"data.path is required for kind {self.kind!r}")
        if self.tokenizer is not None and self.kind not in ("text", "chat", "preference"):
            raise ValueError(f"data.tokenizer applies to kinds 'text', 'chat' and 'preference' (a 'tokens' file is already tokenized), not {self.kind!r}")
        unrecorded = self.kind == "synthetic" or (self.kind == "text" and self.tokenizer is None)  # no prepare-data file
        if self.document_mask and self.eos_id is None and unrecorded:
            what = "synthetic tokens" if self.kind == "synthetic" else "byte-level text"
            raise ValueError(f"data.document_mask with {what} needs data.eos_id (the token that ends a document)")
        return self


class ObjectiveSpec(_Section):
    """What the training minimises: next-token cross entropy (sft), or Direct Preference
    Optimization on preference pairs (dpo), in TRL's ``DPOConfig`` vocabulary (docs/dpo.md)."""

    kind: Literal["sft", "dpo"] = Field("sft", description="sft: cross entropy on the data's labels; dpo: preference pairs (data.kind preference)")
    beta: float = Field(0.1, gt=0, le=100, description="dpo: the strength of the reference's pull (TRL's beta; ipo: its tau)")
    loss_type: Literal["sigmoid", "ipo", "hinge", "robust"] = Field(
        "sigmoid",
        description="dpo: sigmoid (DPO), ipo (length-normalised, as TRL's), hinge (SLiC), robust (label-smoothed, "
        "rDPO); each as TRL's DPOTrainer computes it",
    )
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="dpo, loss_type robust: the share of pairs assumed flipped")
    reference: Literal["auto", "adapters_off", "initial_adapter", "copy", "precomputed"] = Field(
        "auto",
        description="dpo: the reference model. auto: with model.lora the model with its adapters off (a fresh "
        "adapter) or a frozen copy of model.init_adapter's (initial_adapter); without, a frozen copy of the model "
        "sharded like it (copy). precomputed: the model's own log-probabilities as it starts, in one pass before "
        "training (no reference model held)",
    )

    @model_validator(mode="after")
    def _dpo_only(self):
        if self.kind == "sft":
            for name in ("beta", "loss_type", "label_smoothing", "reference"):
                field = type(self).model_fields[name]
                if getattr(self, name) != field.default:
                    raise ValueError(f"objective.{name} applies to objective.kind dpo, not sft")
        if self.label_smoothing > 0 and self.loss_type != "robust":
            raise ValueError(
                f"objective.label_smoothing: TRL's {self.loss_type} loss has none; use loss_type robust (rDPO)"
            )
        return self


class TrainingSpec(_Section):
    steps: int = Field(100, gt=0, description="optimizer steps")
    seed: int = Field(0, description="parameter init seed")
    grad_accum: int = Field(1, ge=1, description="micro-batches per step (gradients sync on the last only)")
    max_grad_norm: float | None = Field(1.0, gt=0, description="global gradient clipping norm; null disables clipping")
    skip_nonfinite: bool = Field(False, description="skip a step whose loss is NaN/inf instead of failing the run")
    activation_checkpointing: Literal["none", "full", "selective"] = Field(
        "none",
        description="recompute activations in backward: full (every block), selective (every selective_every-th "
        "block, or op-level: keep matmul and attention outputs, recompute the rest)",
    )
    selective_every: int | None = Field(
        None, ge=1, description="selective: checkpoint every k-th block; null: op-level selective checkpointing"
    )
    compile: bool = Field(
        False,
        description="torch.compile each transformer block and the loss (torchtitan's per-block compile); composes "
        "with every parallelism; on CPU needs a C++ compiler",
    )
    freeze: list[str] = Field(
        default_factory=list,
        max_length=256,
        description="parameters to keep fixed: 'embeddings', 'output', 'norm', 'layers.A-B' (blocks A to B), or "
        "fnmatch patterns of parameter names ('layers.*.attention.*'); each must match something",
    )


class OptimizerSpec(_Section):
    name: Literal["adamw", "sgd"] = Field("adamw", description="torch.optim.AdamW or torch.optim.SGD")
    lr: float = Field(3e-4, gt=0, description="peak learning rate (after warm-up)")
    weight_decay: float = Field(0.0, ge=0, description="decoupled weight decay (AdamW) or L2 penalty (SGD)")
    betas: tuple[float, float] = Field((0.9, 0.95), description="adamw: the moments' decay rates")
    eps: float = Field(1e-8, gt=0, description="adamw: added to the denominator")
    momentum: float = Field(0.0, ge=0, description="sgd only")


class LRSchedulerSpec(_Section):
    warmup_steps: int = Field(0, ge=0, description="linear warm-up from 0")
    decay: Literal["cosine", "linear", "constant"] = Field("cosine", description="shape of the decay after warm-up")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="final lr as a fraction of optimizer.lr")


class ParallelismSpec(_Section):
    auto: bool = Field(
        False,
        description="let hpservice choose the layout (dp_shard, dp_replicate, tp, pp, cp, ep, training.grad_accum and "
        "training.activation_checkpointing) that fits resources.device_memory with the lowest estimated step time; "
        "the fields set beside it are kept as constraints. `parallelism: auto` is short for {auto: true}. Resolved "
        "where the job is handed over (validate, run, submit): the job runs with the chosen fields (docs/memory.md)",
    )
    dp_replicate: int = Field(1, ge=1, description="HSDP replicate groups (across nodes)")
    dp_shard: int = Field(-1, description="ranks a model is sharded over; -1 = the rest of the world")
    tp: int = Field(
        1, ge=1, description="tensor parallel degree (the built-in llama); fully_shard then shards over the dp dims"
    )
    cp: int = Field(
        1,
        ge=1,
        description="context parallel degree: every sequence is split over cp ranks (load-balanced: a head and a "
        "tail chunk each) and attention runs as ring attention; fully_shard shards over dp_shard x cp. "
        "data.seq_len must be divisible by 2 x cp",
    )
    pp: int = Field(
        1,
        ge=1,
        description="pipeline parallel degree: the model's blocks are split into pp x pp_virtual_stages stages "
        "(the first also holds the embedding, the last the final norm and head), stage s on pp rank s % pp; the "
        "outermost mesh dim, so it is the one that crosses nodes",
    )
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"] = Field(
        "1f1b",
        description="with pp > 1, the order of the micro-batches' forwards and backwards: gpipe (all forwards, then "
        "all backwards), 1f1b, interleaved_1f1b (pp_virtual_stages stages per rank) or zero_bubble (backward split "
        "into input and weight gradients; with pp_virtual_stages > 1, interleaved)",
    )
    pp_microbatches: int | None = Field(
        None,
        ge=1,
        description="with pp > 1, micro-batches each data-parallel rank's batch is split into per step (times "
        "training.grad_accum); default pp",
    )
    pp_virtual_stages: int = Field(
        1, ge=1, description="stages per pp rank (interleaved_1f1b or zero_bubble): a shorter pipeline fill and drain"
    )
    pp_layers_per_stage: list[int] | None = Field(
        None,
        max_length=4096,
        description="with pp > 1, how many blocks each stage holds, first stage first (they add up to the model's "
        "blocks); default as even as possible, the first stages taking one more",
    )
    ep: int = Field(
        1,
        ge=1,
        description="expert parallel degree (mixture-of-experts models): each layer's experts are split over ep of "
        "the dp_shard ranks, the routed tokens exchanged with all-to-all; it must divide dp_shard and the "
        "model's experts",
    )
    cp_rotate: Literal["ring", "allgather"] = Field(
        "ring",
        description="with cp > 1, how keys/values reach every rank: passed round a ring (ring), or gathered at once "
        "(allgather: one collective, all of a sequence's keys/values on every rank)",
    )
    sequence_parallel: bool = Field(
        False,
        description="with tp > 1: shard the residual stream, norms and their activations on the sequence dim "
        "(Megatron/torchtitan sequence parallelism)",
    )
    reshard_after_forward: bool = Field(
        True, description="free each block's gathered parameters after its forward (the last block keeps them)"
    )
    sync_every_micro_batch: bool = Field(
        False,
        description="with training.grad_accum > 1 under fully_shard: reduce-scatter each micro-batch's gradients into "
        "the shards (torchtitan's way) instead of keeping the whole model's unsharded gradients until the last "
        "micro-batch: less memory (the model's size in the compute dtype per rank), grad_accum times the "
        "reduce-scatters",
    )
    mixed_precision: Literal["none", "bf16", "fp16"] = Field(
        "none", description="compute dtype of parameters in forward/backward (gradients reduce in fp32)"
    )
    cpu_offload: bool = Field(False, description="keep sharded parameters, gradients and optimizer state in CPU memory")

    @model_validator(mode="before")
    @classmethod
    def _auto_shorthand(cls, data):
        if data == "auto":
            return {"auto": True}
        if isinstance(data, str):
            raise ValueError(f"{data!r} is not a layout: use auto, or a mapping of fields")
        return data

    @field_validator("dp_shard")
    @classmethod
    def _dp_shard(cls, v: int) -> int:
        if v != -1 and v < 1:
            raise ValueError("must be -1 (the rest of the world) or >= 1")
        return v

    @model_validator(mode="after")
    def _composes(self):
        for field, message in refusals("parallelism", self):  # the composition table's rules of this section
            raise ValueError(f"{field}: {message}")
        return self

    @model_validator(mode="after")
    def _pipeline_composes_with_what_is_built(self):
        if self.pp == 1:
            for name in ("pp_microbatches", "pp_layers_per_stage"):
                if getattr(self, name) is not None:
                    raise ValueError(f"parallelism.{name} needs pp > 1")
            if self.pp_virtual_stages != 1:
                raise ValueError("parallelism.pp_virtual_stages needs pp > 1")
            return self
        if self.sync_every_micro_batch:
            raise ValueError(
                "parallelism.sync_every_micro_batch: a pipeline stage reduces its gradients after its last micro-batch "
                "(pp > 1); it applies to gradient accumulation without pp"
            )
        if self.pp_virtual_stages > 1 and self.pp_schedule not in ("interleaved_1f1b", "zero_bubble"):
            raise ValueError(
                f"parallelism.pp_virtual_stages {self.pp_virtual_stages}: several stages per rank need pp_schedule "
                f"interleaved_1f1b or zero_bubble, not {self.pp_schedule}"
            )
        stages = self.pp * self.pp_virtual_stages
        counts = self.pp_layers_per_stage
        if counts is not None and (len(counts) != stages or min(counts) < 1):
            raise ValueError(
                f"parallelism.pp_layers_per_stage {counts}: expected {stages} counts (pp {self.pp} x "
                f"pp_virtual_stages {self.pp_virtual_stages}), each >= 1"
            )
        return self

    def microbatches(self, grad_accum: int = 1) -> int:
        """Micro-batches per step of a pipeline (``pp_microbatches``, default pp, times ``grad_accum``)."""
        return (self.pp_microbatches or self.pp) * grad_accum

    @property
    def fixed_degree(self) -> int:
        """Ranks the dims other than dp_shard take: pp x dp_replicate x cp x tp."""
        return self.pp * self.dp_replicate * self.cp * self.tp

    def _fixed_names(self, shard: int | None = None) -> str:
        """``dp_replicate x tp`` (and ``pp``, ``cp`` where they are set), with sizes when asked."""
        shard_dim = [("dp_shard", shard)] if shard is not None else []
        dims = [("pp", self.pp), ("dp_replicate", self.dp_replicate), *shard_dim, ("cp", self.cp), ("tp", self.tp)]
        shown = [(n, s) for n, s in dims if n in ("dp_replicate", "dp_shard", "tp") or s > 1]
        return " x ".join(f"{n} {s}" if shard is not None else n for n, s in shown)

    def resolve(self, world_size: int) -> tuple[int, int]:
        """(dp_replicate, dp_shard) for ``world_size`` ranks."""
        fixed = self.fixed_degree
        rest, rem = divmod(world_size, fixed)
        if rem:
            raise SpecError(f"parallelism: world size {world_size} is not divisible by {self._fixed_names()} = {fixed}")
        shard = rest if self.dp_shard == -1 else self.dp_shard
        if fixed * shard != world_size:
            raise SpecError(f"parallelism: {self._fixed_names(shard)} != world size {world_size}")
        return self.dp_replicate, shard


MAX_WORKERS = 100_000  # more than any cluster has; bounds the work of checking elastic sizes


class ResourcesSpec(_Section):
    workers: int = Field(1, ge=1, le=MAX_WORKERS, description="training workers (one per GPU, or per CPU slot)")
    use_gpu: Literal["auto"] | bool = Field(
        "auto", description="a GPU per worker: true, false, or auto (when the cluster has one for every worker)"
    )
    cpus_per_worker: float = Field(1.0, gt=0, description="CPUs each worker reserves (fractions share cores)")
    min_workers: int | None = Field(
        None,
        ge=1,
        le=MAX_WORKERS,
        description="elastic: when a node is lost and no room for every worker comes back within "
        "failure.capacity_wait_s, go on with as few as this many (same global batch: more gradient accumulation), "
        "and grow back to workers at the next checkpoint once there is room; null: always all workers",
    )
    device_memory: int | None = Field(
        None,
        description="memory of one worker's device (its GPU; its host share on CPU): bytes, or a string like 80GiB. "
        "A job whose estimated peak per rank exceeds it is refused with the breakdown and layouts that fit; "
        "parallelism: auto picks a layout under it. Default: what the cluster reports (the operator's "
        "--device-memory, or the GPU type Ray knows); unset and unknown: not checked",
    )
    placement: Literal["shard_group", "pack", "spread", "strict_pack"] = Field(
        "shard_group",
        description="where workers go: shard_group keeps each shard group (dp_shard x tp ranks) inside one node and "
        "lets dp_replicate span nodes (a group larger than every node is refused); pack, spread, strict_pack: one "
        "worker per placement-group bundle with Ray's strategy of that name (groups may span nodes)",
    )

    @field_validator("device_memory", mode="before")
    @classmethod
    def _device_memory(cls, v):
        return None if v is None else parse_device_memory(v)

    @model_validator(mode="after")
    def _min_workers_at_most_workers(self):
        if self.min_workers is not None and self.min_workers > self.workers:
            raise ValueError(f"resources.min_workers {self.min_workers} is more than resources.workers {self.workers}")
        return self

    def gpus_per_worker(self, cluster_gpus: float) -> int:
        """The one decision of "does this job use GPUs": 1 or 0 per worker, given the GPUs the
        cluster has. The coordinator makes it per attempt and hands the workers a spec where
        ``use_gpu`` is that answer, never ``auto``."""
        if self.use_gpu == "auto":
            return 1 if cluster_gpus >= self.workers else 0
        return 1 if self.use_gpu else 0


class CheckpointSpec(_Section):
    interval: int = Field(0, ge=0, description="save every N steps and at the end; 0 saves nothing")
    keep: int = Field(3, ge=1, description="committed checkpoints kept, newest first (older ones are deleted)")
    dir: str | None = Field(
        None,
        max_length=_MAX_PATH,
        description="checkpoint root directory (a path or a storage URL); default <metrics.dir>/<run_id>/checkpoints, "
        "this run's own",
    )
    async_: bool = Field(False, alias="async", description="write checkpoints in the background")
    resume_from: str | None = Field(None, max_length=_MAX_PATH, description="'latest' or a checkpoint directory")
    keep_best: Literal["loss", "val_loss"] | None = Field(
        None, description="also keep the checkpoint with the lowest value of this metric (val_loss needs eval)"
    )


class FailureSpec(_Section):
    max_restarts: int = Field(
        0, ge=0, description="restarts from the latest checkpoint after a worker failure (config errors never restart)"
    )
    step_timeout_s: float = Field(600.0, gt=0, description="a step making no progress this long is a hang")
    startup_timeout_s: float = Field(
        1800.0,
        gt=0,
        description="rendezvous, model build, checkpoint load and the first step of an attempt may take this long "
        "before it counts as a hang (step_timeout_s applies from then on)",
    )
    capacity_wait_s: float = Field(
        300.0,
        gt=0,
        description="after a node is lost, how long to wait for room for the job's workers on the live nodes "
        "before failing (a lost node does not count as a restart)",
    )


class MLflowSpec(_Section):
    tracking_uri: str | None = Field(
        None, max_length=_MAX_PATH, description="tracking server or database; default a file store in the run's directory"
    )
    experiment: str | None = Field(None, max_length=200, description="experiment name (default: the job name)")


class WandbSpec(_Section):
    project: str | None = Field(None, max_length=200, description="W&B project (default: the job name)")
    mode: Literal["offline", "online"] = Field(
        "offline", description="offline: written under the run's directory only (wandb sync uploads it later)"
    )


class ProfileSpec(_Section):
    start_step: int = Field(3, ge=1, le=INT64[1], description="first profiled step (1-based; earlier steps warm up)")
    steps: int = Field(2, ge=1, le=100, description="steps in the trace")
    memory: bool = Field(True, description="on CUDA, also record allocations and write a memory snapshot")


class MetricsSpec(_Section):
    log_every: int = Field(1, ge=1, description="a progress line every N steps (metrics are kept for every step)")
    tensorboard: bool = Field(False, description="also write TensorBoard event files under the run's directory")
    mlflow: MLflowSpec | None = Field(None, description="also log the run to MLflow (the mlflow package)")
    wandb: WandbSpec | None = Field(None, description="also log the run to Weights & Biases (the wandb package)")
    profile: ProfileSpec | None = Field(
        None,
        description="torch profiler trace (Chrome/Perfetto JSON) of a few steps per rank, under <run dir>/profile; "
        "listed and downloadable as the job's artifacts",
    )
    dir: str = Field(
        "runs", max_length=_MAX_PATH, description="where runs write: metrics.jsonl (and TensorBoard events) under <dir>/<run_id>"
    )


NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"  # job names, run ids, owners: safe path components
RUN_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,79}$"  # new_run_id: a name, "-", 8 hex digits (the store's 80)


def new_run_id(name: str) -> str:
    """A run's (and a service job's) id: the job name and 8 random hex digits."""
    return f"{name}-{uuid.uuid4().hex[:8]}"


class SchedulingSpec(_Section):
    priority: int | None = Field(
        None,
        ge=-1000,
        le=1000,
        description="queue priority on a server (higher starts first); null: the owner's default from the "
        "operator's quotas (else 0)",
    )


class EvalSpec(_Section):
    """A validation loss on held-out data every ``interval`` steps (0: never)."""

    data: DataSpec | None = Field(None, description="the held-out data (a data section); needed when interval > 0")
    interval: int = Field(0, ge=0, description="evaluate after every N optimizer steps and after the last; 0 disables")
    steps: int = Field(4, gt=0, description="batches per evaluation: the same ones every time, so values compare")

    @model_validator(mode="after")
    def _data_when_enabled(self):
        if self.interval and self.data is None:
            raise ValueError("eval.data is required when eval.interval > 0")
        if self.data is not None and (self.data.document_mask or self.data.eos_id is not None):
            raise ValueError(
                "eval.data.document_mask / eval.data.eos_id: evaluation attends as training does; set data.document_mask"
            )
        return self


class RuntimeSpec(_Section):
    """Code a job's workers import that is not installed where they run: Ray ships it with the job
    (its ``runtime_env``). For ``hpservice run``; a service installs its models in its image instead
    (``hpservice.models`` entry points), and refuses this section."""

    py_modules: list[Annotated[str, Field(max_length=_MAX_PATH)]] = Field(
        default_factory=list,
        max_length=16,
        description="local package directories (or .py / .whl files) every worker can import, e.g. ['./mymodels'] for "
        "model.name 'mymodels:build'; relative to where the job is started (Ray runtime_env py_modules)",
    )
    working_dir: str | None = Field(
        None,
        max_length=_MAX_PATH,
        description="a local directory every worker starts in and imports from (Ray runtime_env working_dir)",
    )

    def runtime_env(self) -> dict | None:
        """Ray's ``runtime_env`` for the driver that starts the job (``hpservice run`` passes it to
        ``ray.init``, so the coordinator and every worker get it); None when empty."""
        env = {}
        if self.py_modules:
            env["py_modules"] = [os.path.abspath(os.path.expanduser(m)) for m in self.py_modules]
        if self.working_dir is not None:
            env["working_dir"] = os.path.abspath(os.path.expanduser(self.working_dir))
        return env or None

    def import_paths(self) -> list[str]:
        """Where this machine finds the same code: each module's parent directory, the working dir."""
        env = self.runtime_env() or {}
        return [os.path.dirname(m) for m in env.get("py_modules", [])] + ([env["working_dir"]] if "working_dir" in env else [])


class JobSpec(_Section):
    name: str = Field(..., pattern=NAME_PATTERN, description="job name")
    run_id: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,80}$",
        description="set by hpservice when the run starts (the job id in the service): the run's outputs go under "
        "<metrics.dir>/<run_id>; leave unset",
    )
    input_roots: list[Annotated[str, Field(max_length=_MAX_PATH)]] | None = Field(
        None,
        max_length=64,
        description="set by the service when it admits a job: the directories its workers may read inputs from "
        "(checked on each file as it is opened); unset (anywhere) under hpservice run; a submitted value is replaced",
    )
    storage_limit_bytes: int | None = Field(
        None,
        ge=1,
        le=INT64[1],
        description="set by the service when it admits a job: the most bytes the job's directory may hold (its "
        "trainer stops the job past it); unset (no bound) under hpservice run; a submitted value is replaced",
    )
    memory_estimate: dict[str, Any] | None = Field(
        None,
        description="set by hpservice where the job is handed over (validate, run, submit): the per-rank memory "
        "estimate (docs/memory.md), shown beside the measured peak; a submitted value is replaced",
    )
    model: ModelSpec = Field(default_factory=ModelSpec)
    data: DataSpec = Field(default_factory=DataSpec)
    objective: ObjectiveSpec = Field(default_factory=ObjectiveSpec)
    training: TrainingSpec = Field(default_factory=TrainingSpec)
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    lr_scheduler: LRSchedulerSpec = Field(default_factory=LRSchedulerSpec)
    parallelism: ParallelismSpec = Field(default_factory=ParallelismSpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    failure: FailureSpec = Field(default_factory=FailureSpec)
    metrics: MetricsSpec = Field(default_factory=MetricsSpec)
    eval: EvalSpec = Field(default_factory=EvalSpec)
    scheduling: SchedulingSpec = Field(default_factory=SchedulingSpec)
    runtime: RuntimeSpec = Field(default_factory=RuntimeSpec)

    def with_run(self, run_id: str | None = None) -> JobSpec:
        """This spec with its run decided: ``run_id`` (default: the spec's own, else a new one) and
        the default checkpoint directory inside the run's directory, so two runs of one job file
        never share outputs. A spec that already has its run comes back as it is."""
        if self.run_id is not None and (run_id is None or run_id == self.run_id):
            return self
        run_id = run_id or new_run_id(self.name)
        metrics = self.metrics
        if "://" not in metrics.dir and not os.path.isabs(metrics.dir):
            # absolute where the run is decided: a relative path would mean each node's own working
            # directory, so the ranks of a multi-node job would write to different disks
            metrics = metrics.model_copy(update={"dir": os.path.abspath(metrics.dir)})
        spec = self.model_copy(update={"metrics": metrics})
        checkpoint = self.checkpoint
        if checkpoint.dir is None:
            checkpoint = checkpoint.model_copy(update={"dir": f"{spec.run_dir(run_id)}/checkpoints"})
        elif "://" not in checkpoint.dir and not os.path.isabs(checkpoint.dir):
            checkpoint = checkpoint.model_copy(update={"dir": os.path.abspath(checkpoint.dir)})
        return spec.model_copy(update={"run_id": run_id, "checkpoint": checkpoint})

    def resuming_from_latest(self) -> JobSpec:
        """This spec, resuming from its own latest checkpoint (a restarted or requeued attempt)."""
        return self.model_copy(update={"checkpoint": self.checkpoint.model_copy(update={"resume_from": "latest"})})

    def resized(self, workers: int) -> JobSpec:
        """This job on ``workers`` workers (elastic resizing), with the same model and the same
        global batch: the shard group (``dp_shard x cp x tp``) and the pipeline (``pp``) are kept
        and the replicas change when ``dp_shard`` is set, else ``dp_shard`` takes the rest;
        gradient accumulation grows by the factor the data-parallel size shrinks by, so each
        rank's micro-batch stays the same (with pp: more micro-batches of the same size).
        Raises SpecError when ``workers`` cannot hold that layout."""
        if workers == self.resources.workers:
            return self
        p, t = self.parallelism, self.training
        old_replicate, old_shard = p.resolve(self.resources.workers)
        old_dp = old_replicate * old_shard
        if p.dp_shard == -1:
            parallelism = p
        else:
            group = p.dp_shard * p.cp * p.tp
            replicate, rem = divmod(workers, p.pp * group)
            cp = f" x cp {p.cp}" if p.cp > 1 else ""
            stages = f" on each of pp {p.pp} stages" if p.pp > 1 else ""
            if rem or replicate < 1:
                raise SpecError(
                    f"{workers} workers cannot hold shard groups of dp_shard {p.dp_shard}{cp} x tp {p.tp}{stages}"
                )
            parallelism = p.model_copy(update={"dp_replicate": replicate})
        replicate, shard = parallelism.resolve(workers)
        accum, rem = divmod(t.grad_accum * old_dp, replicate * shard)
        if rem:
            raise SpecError(
                f"{workers} workers: data-parallel size {replicate * shard} does not divide "
                f"{old_dp} x grad_accum {t.grad_accum} (the global batch could not stay {self.data.global_batch})"
            )
        return self.model_copy(
            update={
                "resources": self.resources.model_copy(update={"workers": workers}),
                "parallelism": parallelism,
                "training": t.model_copy(update={"grad_accum": accum}),
                "memory_estimate": None,  # it was the other layout's
            }
        )

    def elastic_sizes(self) -> list[int]:
        """The smaller worker counts this job may shrink to (largest first): ``min_workers`` and up."""
        low = self.resources.min_workers or self.resources.workers
        sizes = []
        for n in range(self.resources.workers - 1, low - 1, -1):
            try:
                self.resized(n)
            except SpecError:
                continue
            sizes.append(n)
        return sizes

    def run_dir(self, run_id: str | None = None) -> str:
        """Where this run writes its metrics (a path or a URL)."""
        run_id = run_id or self.run_id
        if run_id is None:
            raise SpecError("the run is not decided yet (JobSpec.with_run)")
        return f"{self.metrics.dir.rstrip('/')}/{run_id}"

    def artifacts_dir(self, run_id: str | None = None) -> str:
        """Where a run writes its downloadable artifacts (profiler traces, memory snapshots)."""
        return f"{self.run_dir(run_id)}/artifacts"

    @model_validator(mode="after")
    def _keep_best_is_measured(self):
        if self.checkpoint.keep_best == "val_loss" and not self.eval.interval:
            raise ValueError("checkpoint.keep_best: val_loss needs eval.interval > 0 (a validation loss)")
        return self

    @model_validator(mode="after")
    def _composes(self):
        for field, message in refusals("job", self):  # the composition table's rules over sections
            raise ValueError(f"{field}: {message}")
        return self

    @model_validator(mode="after")
    def _batch_divides(self):
        if self.data.global_batch % self.training.grad_accum:
            raise ValueError(
                f"data.global_batch {self.data.global_batch} is not divisible by training.grad_accum {self.training.grad_accum}"
            )
        return self


def did_you_mean(value: str, allowed) -> str:
    """`` (did you mean 'x'?)`` for a close misspelling of one of ``allowed``, else ``""``."""
    close = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""

