"""Tensor-parallel plan for the built-in Llama (``hpservice.models.llama``), as torchtitan applies it.

Attention ``wq``/``wk``/``wv`` and the MLP's ``w1``/``w3`` are colwise (each rank holds a slice of
the heads / hidden units), ``wo`` and ``w2`` rowwise (the Partial products reduced once), the
output head colwise with ``use_local_output=False``: the logits stay a DTensor sharded on the
vocabulary, for ``vocab_parallel_cross_entropy``. With ``vocab_parallel_embedding`` (the default)
the token embedding is rowwise: its weight ``Shard(0)`` over the vocabulary, each rank looks up
only its own ids and the Partial result is reduced.

Without sequence parallelism the residual stream and the norms are plain replicated tensors
(every rank computes the norms on the whole sequence). With ``sequence_parallel=True`` (the
Megatron-LM / torchtitan layout) the residual stream is a DTensor sharded on the sequence
(``Shard(1)``) from the embedding to the final norm:

- the embedding reduce-scatters its Partial result onto the sequence dim
  (``RowwiseParallel(output_layouts=Shard(1))``; without a vocab-parallel embedding, its
  replicated output is sliced: ``PrepareModuleOutput``);
- the norms run on each rank's positions (``SequenceParallel``: weights ``Replicate``, their
  Partial gradients all-reduced by a hook);
- ``attention`` and ``feed_forward`` all-gather their input once (``PrepareModuleInput``
  ``Shard(1) -> Replicate``; the rotary table, a plain tensor, passes through), so ``wq``/``wk``/``wv``
  and ``w1``/``w3`` see the whole sequence;
- ``wo`` and ``w2`` reduce-scatter onto the sequence dim (``RowwiseParallel(output_layouts=Shard(1))``)
  and return DTensors, so the residual adds are DTensor + DTensor;
- the head all-gathers the final norm's output (``ColwiseParallel(input_layouts=Shard(1))``).

Each all-reduce of plain TP becomes a reduce-scatter plus an all-gather (the same bytes), and the
norms' and residuals' activations are stored once per rank instead of ``tp`` times. An uneven
sequence (``S % tp != 0``) is fine: the shards are ``torch.chunk`` pieces.

Between the colwise and rowwise projections, attention runs on the local heads: the colwise
outputs are local tensors ``[B, S, (n_heads / tp) * head_dim]``, so ``apply_llama_tp`` divides each
``Attention``'s ``n_heads`` and ``n_kv_heads`` by ``tp`` (rotary embeddings, the GQA repeat and
SDPA are per head, so they run unchanged on a rank's heads; so do Qwen3's per-head ``q_norm`` /
``k_norm``, as ``SequenceParallel`` on the heads dim). Colwise biases (Qwen2) are sharded with
their rows. A mixture-of-experts feed-forward (Qwen3-MoE) runs whole on every tp rank (the
same tokens, routing and experts; with sequence parallelism its input is all-gathered and its
output cut back to each rank's piece); expert parallelism is what splits experts. Every rank must start from the same
weights: the plan slices parameters locally.
"""

from __future__ import annotations

from torch import nn

from ..dtensor import DeviceMesh, Replicate, Shard
from .api import parallelize_module
from .style import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

__all__ = ["apply_llama_tp", "llama_tp_plan"]


def _check_heads(model: nn.Module, tp: int) -> None:
    cfg = model.cfg
    for name, value in (("n_heads", cfg.n_heads), ("n_kv_heads", cfg.n_kv_heads)):
        if value % tp != 0:
            raise ValueError(
                f"tensor parallelism: LlamaConfig.{name} ({value}) must be divisible by tp ({tp}) "
                f"(n_heads {cfg.n_heads}, n_kv_heads {cfg.n_kv_heads})"
            )
    if cfg.tie_embeddings:
        raise NotImplementedError("tensor parallelism: a Llama with tie_embeddings=True is not supported")


def llama_tp_plan(
    model: nn.Module,
    tp: int | None = None,
    *,
    sequence_parallel: bool = False,
    vocab_parallel_embedding: bool = True,
) -> dict[str, ParallelStyle]:
    """The plan dict (submodule FQN -> style) for a ``Llama`` (see the module doc).

    ``tp``: when given, checks that the query and key/value head counts divide by it (a
    ``ValueError`` naming the sizes otherwise). ``sequence_parallel``: shard the residual stream,
    the norms and their activations on the sequence dim between the projections.
    ``vocab_parallel_embedding``: shard the token embedding over the vocabulary (``False``: it
    stays a plain replicated parameter). The head always returns vocab-sharded DTensor logits.
    """
    if tp is not None:
        _check_heads(model, tp)
    seq = Shard(1)
    plan: dict[str, ParallelStyle] = {}
    if sequence_parallel:
        if vocab_parallel_embedding:
            plan["tok_embeddings"] = RowwiseParallel(
                input_layouts=Replicate(), output_layouts=seq, use_local_output=False
            )
        else:
            # A plain embedding's output is the whole replicated sequence: keep each rank's piece.
            plan["tok_embeddings"] = PrepareModuleOutput(
                output_layouts=Replicate(), desired_output_layouts=seq, use_local_output=False
            )
        plan["norm"] = SequenceParallel()
        plan["output"] = ColwiseParallel(input_layouts=seq, use_local_output=False)
    else:
        if vocab_parallel_embedding:
            plan["tok_embeddings"] = RowwiseParallel()  # ids Replicate, output Replicate (a plain tensor)
        plan["output"] = ColwiseParallel(use_local_output=False)
    for key, block in model.layers.items():
        p = f"layers.{key}."
        dense = hasattr(block.feed_forward, "w1")  # else a mixture of experts: replicated on the tp ranks
        if sequence_parallel:
            plan.update(
                {
                    p + "attention_norm": SequenceParallel(),
                    # x: all-gathered once for wq/wk/wv; rope (a plain full-sequence tensor) untouched.
                    p + "attention": PrepareModuleInput(
                        input_layouts=(seq, None),
                        desired_input_layouts=(Replicate(), None),
                        use_local_output=hasattr(block.attention, "colwise"),  # MLA's latent projections are plain
                    ),
                    p + "attention.wo": RowwiseParallel(output_layouts=seq, use_local_output=False),
                    p + "ffn_norm": SequenceParallel(),
                }
            )
            if dense:
                plan[p + "feed_forward"] = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
                plan[p + "feed_forward.w2"] = RowwiseParallel(output_layouts=seq, use_local_output=False)
            else:  # the whole sequence in (all-gathered), each rank's piece of it out
                plan[p + "feed_forward"] = PrepareModuleInputOutput(
                    input_layouts=(seq,), desired_input_layouts=(Replicate(),), use_local_input=True,
                    output_layouts=Replicate(), desired_output_layouts=seq, use_local_output=False,
                )  # fmt: skip
        else:
            plan[p + "attention.wo"] = RowwiseParallel()
            if dense:
                plan[p + "feed_forward.w2"] = RowwiseParallel()
        if getattr(model.cfg, "qk_norm", False):
            # per head, on each rank's heads ([B, S, heads, head_dim]): weights replicated, their
            # gradients (each rank's heads' part) all-reduced
            for norm in ("q_norm", "k_norm"):
                plan[p + "attention." + norm] = SequenceParallel(sequence_dim=2, use_local_output=True)
        # by heads: a Llama's q, k, v; MLA's query and per-head key/value up-projection (its latent is one head)
        for name in getattr(block.attention, "colwise", ("wq", "wk", "wv")):
            plan[p + "attention." + name] = ColwiseParallel()
        if dense:
            plan.update({p + "feed_forward.w1": ColwiseParallel(), p + "feed_forward.w3": ColwiseParallel()})
    # a pipeline stage (Llama.keep_stage) holds the embedding only first, the norm and head only last
    return {fqn: style for fqn, style in plan.items() if getattr(model, fqn.split(".")[0], None) is not None}


def apply_llama_tp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    sequence_parallel: bool = False,
    vocab_parallel_embedding: bool = True,
) -> nn.Module:
    """Parallelize a ``Llama`` in place on the 1-d tensor-parallel ``mesh`` and return it:
    ``llama_tp_plan`` (same keyword arguments) plus the per-rank head counts of every ``Attention``.
    The model then returns logits as a DTensor sharded on the vocabulary (``Shard(-1)``): use
    ``vocab_parallel_cross_entropy``."""
    tp = mesh.size()
    _check_heads(model, tp)
    plan = llama_tp_plan(
        model, tp, sequence_parallel=sequence_parallel, vocab_parallel_embedding=vocab_parallel_embedding
    )
    parallelize_module(model, mesh, plan)
    for layer in model.layers.values():
        layer.attention.n_heads //= tp
        layer.attention.n_kv_heads //= tp
        if hasattr(layer.attention, "tp_mesh"):  # MLA: its shared rotary key sums its heads' gradients
            layer.attention.tp_mesh = mesh
    return model
