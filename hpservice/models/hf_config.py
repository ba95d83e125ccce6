"""A Hugging Face ``config.json`` (and ``generation_config.json``) as a validated schema.

A checkpoint's config is a tenant's file: the server reads it at submit, a worker when it builds
the model. Every key ``hf.py`` reads is declared here with its type and range, so a config whose
top level is not an object, whose ``num_attention_heads`` is 0, whose ``rope_scaling`` is a
string, or whose YaRN ``original_max_position_embeddings`` is 0 is refused naming the file and
the key, before any arithmetic runs on it. Keys we do not read are kept as they are (a config
carries dozens: ``torch_dtype``, ``initializer_range``, ...), bounded by ``load_json``'s depth and
value count and by ``MAX_JSON_BYTES``.

Sizes are checked for type and sign here; whether a model of these sizes fits what a worker may
hold is the service's size bound (``hpservice.preflight.check_size``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError, create_model

__all__ = ["GENERATION_KEYS", "HFConfig", "generation_config", "validated_config"]

_DIM = (1 << 31) - 1  # every size of a model fits an int32: larger is not a size
Size = Annotated[StrictInt, Field(gt=0, le=_DIM)]
Count = Annotated[StrictInt, Field(ge=0, le=_DIM)]
Positive = Annotated[float, Field(gt=0, allow_inf_nan=False)]
Finite = Annotated[float, Field(allow_inf_nan=False)]
TokenIds = Annotated[StrictInt, Field(ge=0, le=_DIM)] | Annotated[list[Annotated[StrictInt, Field(ge=0, le=_DIM)]], Field(max_length=64)]


class _Schema(BaseModel):
    model_config = ConfigDict(extra="allow", strict=False, frozen=True)


class RopeScaling(_Schema):
    """``rope_scaling`` (transformers 4) or ``rope_parameters`` (5): the keys the rotary
    frequencies read (``llama.precompute_rope``)."""

    rope_type: str | None = Field(None, max_length=64)
    type: str | None = Field(None, max_length=64)
    rope_theta: Positive | None = None
    factor: Positive | None = None
    original_max_position_embeddings: Size | None = None
    low_freq_factor: Positive | None = None
    high_freq_factor: Positive | None = None
    beta_fast: Finite | None = None
    beta_slow: Finite | None = None
    mscale: Finite | None = None
    mscale_all_dim: Finite | None = None
    attention_factor: Finite | None = None
    truncate: StrictBool | None = None
    partial_rotary_factor: Positive | None = None


class HFConfig(_Schema):
    """The keys of a decoder's ``config.json`` that ``hf.config_from_hf`` reads."""

    architectures: list[Annotated[str, Field(max_length=200)]] | None = Field(None, max_length=16)
    model_type: str | None = Field(None, max_length=200)
    hidden_size: Size
    num_hidden_layers: Size
    num_attention_heads: Size
    num_key_value_heads: Size | None = None
    head_dim: Size | None = None
    intermediate_size: Size
    vocab_size: Size
    max_position_embeddings: Size | None = None
    rms_norm_eps: Positive | None = None
    rope_theta: Positive | None = None
    rope_scaling: RopeScaling | None = None
    rope_parameters: RopeScaling | None = None
    tie_word_embeddings: StrictBool | None = None
    attention_bias: StrictBool | None = None
    mlp_bias: StrictBool | None = None
    hidden_act: str | None = Field(None, max_length=64)
    use_sliding_window: StrictBool | None = None
    sliding_window: Size | None = None
    bos_token_id: TokenIds | None = None
    eos_token_id: TokenIds | None = None
    pad_token_id: TokenIds | None = None
    # mixture of experts (qwen3_moe)
    num_experts: Size | None = None
    num_local_experts: Size | None = None
    num_experts_per_tok: Size | None = None
    moe_intermediate_size: Size | None = None
    decoder_sparse_step: Size | None = None
    mlp_only_layers: list[Count] | None = Field(None, max_length=1 << 16)
    norm_topk_prob: StrictBool | None = None
    router_aux_loss_coef: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None
    output_router_logits: StrictBool | None = None
    # DeepSeek-V3
    rope_interleave: StrictBool | None = None
    scoring_func: str | None = Field(None, max_length=64)
    topk_method: str | None = Field(None, max_length=64)
    n_routed_experts: Size | None = None
    q_lora_rank: Size | None = None
    kv_lora_rank: Size | None = None
    qk_nope_head_dim: Size | None = None
    qk_rope_head_dim: Size | None = None
    v_head_dim: Size | None = None
    n_shared_experts: Count | None = None
    first_k_dense_replace: Count | None = None
    n_group: Size | None = None
    topk_group: Size | None = None
    routed_scaling_factor: Positive | None = None


def _refusal(where: Path, e: ValidationError) -> str:
    first = e.errors()[0]
    key = ".".join(str(part) for part in first["loc"]) or "(top level)"
    value = first.get("input")
    shown = repr(value) if not isinstance(value, dict | list) else type(value).__name__
    if len(shown) > 80:
        shown = shown[:77] + "..."
    more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
    if first["type"] == "missing":
        return f"{where}: no {key}{more}"
    return f"{where}: {key} = {shown}: {first['msg']}{more}"


def validated_config(raw: Any, where: Path) -> dict:
    """``raw`` (a parsed ``config.json``) checked against ``HFConfig``: the keys it had, typed,
    as a plain dict. ``ValueError`` naming ``where`` and the first bad key."""
    from .hf import HFFormatError

    if not isinstance(raw, dict):
        raise HFFormatError(f"{where}: the top level is a JSON {type(raw).__name__}, not an object")
    try:
        checked = HFConfig.model_validate(raw)
    except ValidationError as e:
        raise HFFormatError(_refusal(where, e)) from None
    return checked.model_dump(exclude_unset=True)


GENERATION_KEYS = {
    # what transformers' generate reads to stop and to sample (GenerationConfig); the rest is dropped
    "bos_token_id": TokenIds | None,
    "eos_token_id": TokenIds | None,
    "pad_token_id": TokenIds | None,
    "decoder_start_token_id": TokenIds | None,
    "do_sample": StrictBool | None,
    "temperature": Annotated[float, Field(ge=0, allow_inf_nan=False)] | None,
    "top_k": Count | None,
    "top_p": Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)] | None,
    "min_p": Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)] | None,
    "repetition_penalty": Positive | None,
    "max_length": Size | None,
    "max_new_tokens": Size | None,
    "num_beams": Size | None,
    "transformers_version": Annotated[str, Field(max_length=64)] | None,
}


GenerationConfig = create_model(
    "GenerationConfig",
    __config__=ConfigDict(extra="ignore", frozen=True),
    **{key: (kind, None) for key, kind in GENERATION_KEYS.items()},
)


def generation_config(raw: Any, where: Path) -> dict | None:
    """The keys of a ``generation_config.json`` that generation uses (``GENERATION_KEYS``),
    validated; everything else is dropped (a record is copied into every checkpoint)."""
    from .hf import HFFormatError

    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise HFFormatError(f"{where}: the top level is a JSON {type(raw).__name__}, not an object")
    try:
        checked = GenerationConfig.model_validate({k: v for k, v in raw.items() if k in GENERATION_KEYS})
    except ValidationError as e:
        raise HFFormatError(_refusal(where, e)) from None
    return checked.model_dump(exclude_unset=True) or None
