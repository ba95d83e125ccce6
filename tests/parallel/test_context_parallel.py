"""Context parallelism: ring attention over a sequence sharded across gloo ranks equals
``F.scaled_dot_product_attention`` on the whole sequence on one device, values and gradients
(fp32, 1e-5), causal, bidirectional and document-masked (packed sequences)."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from hpservice.parallel.context_parallel import positions, ring_attention, shard_sequence, unshard_sequence


def _inputs(seed=0, B=2, H=3, S=48, D=8, docs=False):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, S, D, generator=g) for _ in range(3))
    weight = torch.randn(B, H, S, D, generator=g)  # the loss is (out * weight).sum(): every output counts
    document_ids = None
    if docs:  # packed: documents of uneven lengths, different per batch row
        cuts = [sorted(torch.randperm(S - 1, generator=g)[:3].add(1).tolist()) for _ in range(B)]
        document_ids = torch.stack([torch.bucketize(torch.arange(S), torch.tensor(c), right=True) for c in cuts])
    return q, k, v, weight, document_ids


def _reference(q, k, v, weight, document_ids, is_causal, window=None):
    """One device, torch's SDPA (an explicit mask only for documents and sliding windows)."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    mask, S = None, q.shape[-2]
    if document_ids is not None:
        mask = (document_ids[:, :, None] == document_ids[:, None, :])[:, None]
        if is_causal:
            mask = mask & torch.ones(S, S, dtype=torch.bool).tril()
    if window is not None:  # Mistral's: a query sees its own key and the window - 1 before it
        offset = torch.arange(S)[:, None] - torch.arange(S)[None, :]
        band = (offset >= 0) & (offset < window)
        mask = band if mask is None else mask & band
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal and mask is None)
    (out * weight).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _ring(is_causal, load_balance, rotate, docs, S, window=None):
    rank, cp = dist.get_rank(), dist.get_world_size()
    q, k, v, weight, document_ids = _inputs(S=S, docs=docs)
    expected = _reference(q, k, v, weight, document_ids, is_causal, window)
    shard = lambda t, dim=2: shard_sequence(t, dim, cp, rank, load_balance=load_balance)  # noqa: E731
    lq, lk, lv = (shard(t).requires_grad_() for t in (q, k, v))
    docs_local = shard(document_ids, 1) if document_ids is not None else None
    out = ring_attention(
        lq,
        lk,
        lv,
        is_causal=is_causal,
        document_ids=docs_local,
        load_balance=load_balance,
        rotate=rotate,
        window=window,
    )
    (out * shard(weight)).sum().backward()
    got = [out.detach(), lq.grad, lk.grad, lv.grad]
    whole = [unshard_sequence(t, 2, load_balance=load_balance) for t in got]
    return [(w - e).abs().max().item() for w, e in zip(whole, expected, strict=True)]


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize(
    ("is_causal", "load_balance", "rotate", "docs"),
    [
        (True, True, "ring", False),
        (True, False, "ring", False),
        (False, True, "ring", False),
        (True, True, "allgather", False),
        (True, True, "ring", True),
        (False, False, "allgather", True),
    ],
)
def test_ring_attention_equals_sdpa_on_the_whole_sequence(ranks, cp, is_causal, load_balance, rotate, docs):
    for errors in ranks(cp).run(_ring, is_causal, load_balance, rotate, docs, 48):
        assert max(errors) < 1e-5, errors  # out, dq, dk, dv


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize(
    ("window", "load_balance", "rotate", "docs"),
    [(5, True, "ring", False), (13, False, "ring", True), (6, True, "allgather", True), (1, True, "ring", False),
     (40, True, "ring", False)],
)  # fmt: skip
def test_a_sliding_window_under_ring_attention_equals_sdpa_with_the_window_mask(
    ranks, cp, window, load_balance, rotate, docs
):
    # chunks of 6 (cp 4, load-balanced) or 12 tokens: windows shorter, longer and across several chunks
    for errors in ranks(cp).run(_ring, True, load_balance, rotate, docs, 48, window):
        assert max(errors) < 1e-5, errors  # out, dq, dk, dv


def test_the_load_balanced_layout_gives_each_rank_a_head_and_a_tail_chunk():
    assert positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert positions(16, 2, 1, load_balance=False).tolist() == list(range(8, 16))
    # every position exactly once
    assert sorted(torch.cat([positions(24, 3, r) for r in range(3)]).tolist()) == list(range(24))
    with pytest.raises(ValueError, match=r"sequence length 20 is not divisible by 2 x cp = 8"):
        positions(20, 4, 0)


def _against_torch(rotate):
    """torch's context_parallel (which replaces SDPA inside it, as ours does) on the same shards."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel as torch_context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method

    rank, cp = dist.get_rank(), dist.get_world_size()
    q, k, v, weight, _ = _inputs()
    mesh = init_device_mesh("cpu", (cp,))
    set_rotate_method({"ring": "alltoall", "allgather": "allgather"}[rotate])
    buffers = [t.clone() for t in (q, k, v, weight)]
    try:
        with torch_context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2, 2]):
            tq, tk, tv = (t.clone().requires_grad_() for t in buffers[:3])
            theirs = F.scaled_dot_product_attention(tq, tk, tv, is_causal=True)
            (theirs * buffers[3]).sum().backward()
    except Exception as e:  # what torch says, for the test to show
        return f"torch: {type(e).__name__}: {e}"
    lq, lk, lv = (shard_sequence(t, 2, cp, rank).requires_grad_() for t in (q, k, v))
    ours = ring_attention(lq, lk, lv, rotate=rotate)
    (ours * shard_sequence(weight, 2, cp, rank)).sum().backward()
    pairs = [(ours, theirs), (lq.grad, tq.grad), (lk.grad, tk.grad), (lv.grad, tv.grad)]
    return [(a.detach() - b.detach()).abs().max().item() for a, b in pairs]


@pytest.mark.parametrize("rotate", ["ring", "allgather"])
def test_torchs_context_parallel_does_not_run_on_cpu_so_there_is_nothing_to_compare_here(ranks, rotate):
    """torch 2.13's ring attention has no CPU kernel (its SDPA dispatches to the CPU flash kernel,
    which its DTensor has no rule for). The day it runs, this test fails and says to compare:
    ``_against_torch`` returns the differences of output and gradients then."""
    for result in ranks(2).run(_against_torch, rotate):
        assert isinstance(result, str) and "_scaled_dot_product_flash_attention_for_cpu" in result, (
            f"torch's context_parallel now runs on CPU: compare with it ({result})"
        )


# ---- packed documents on one rank ----------------------------------------------------------------
def test_document_ids_come_from_the_end_of_text_tokens():
    from hpservice.parallel.context_parallel import document_ids_from_eos

    tokens = torch.tensor([[5, 3, 7, 8, 3, 3, 1], [3, 1, 1, 1, 1, 1, 3]])
    assert document_ids_from_eos(tokens, 3).tolist() == [[0, 0, 1, 1, 1, 2, 3], [0, 1, 1, 1, 1, 1, 1]]


@pytest.mark.parametrize("block", [16, 5, 1000])  # many blocks; a block that does not divide; one block
def test_document_attention_on_one_rank_equals_sdpa_with_the_document_mask(monkeypatch, block):
    """document_masking's blockwise attention (what data.document_mask runs without cp) against
    torch's SDPA given the explicit causal document mask: values and q/k/v gradients."""
    from hpservice.parallel import context_parallel as cp_module

    monkeypatch.setattr(cp_module, "LOCAL_BLOCK", block)
    q, k, v, weight, document_ids = _inputs(S=48, docs=True)
    expected = _reference(q, k, v, weight, document_ids, True)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    with cp_module.document_masking(document_ids) as active:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # as a user's model calls it
    (out * weight).sum().backward()
    assert active.calls == 1
    for got, want in zip((out.detach(), q.grad, k.grad, v.grad), expected, strict=True):
        assert (got - want).abs().max().item() < 1e-5


@pytest.mark.parametrize("block", [16, 5])
def test_a_sliding_window_with_document_masks_on_one_rank_equals_sdpa_with_both_masks(monkeypatch, block):
    """What a Mistral with data.document_mask runs: the models' attention entry point with a
    window, inside document_masking, against SDPA given the causal document mask and the window."""
    from hpservice.parallel import context_parallel as cp_module

    monkeypatch.setattr(cp_module, "LOCAL_BLOCK", block)
    q, k, v, weight, document_ids = _inputs(S=48, docs=True)
    expected = _reference(q, k, v, weight, document_ids, True, window=7)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    from hpservice.models.attention import scaled_dot_product_attention

    with cp_module.document_masking(document_ids) as active:
        out = scaled_dot_product_attention(q, k, v, is_causal=True, window=7)
    (out * weight).sum().backward()
    assert active.calls == 1
    for got, want in zip((out.detach(), q.grad, k.grad, v.grad), expected, strict=True):
        assert (got - want).abs().max().item() < 1e-5


def _document_masked_losses(spec):
    from tests._jobs import train

    return [r["loss"] for r in train(spec)]


def test_packed_documents_train_alike_on_one_process_and_with_cp_and_differ_from_unmasked(ranks, tmp_path):
    """data.document_mask on synthetic tokens where 3 ends a document (about one token in eight):
    cp 2 (document ids sharded with the tokens, ring attention) trains like one process (blockwise
    attention on one rank), and both differ from attending across documents."""
    from tests._jobs import tiny_llama_job

    data = {"seq_len": 64, "vocab_size": 8, "document_mask": True, "eos_id": 3}
    sections = {"training": {"steps": 4}}
    one = ranks(1).run(_document_masked_losses, tiny_llama_job(tmp_path / "one", **sections, data=data))[0]
    cp2 = ranks(2).run(
        _document_masked_losses, tiny_llama_job(tmp_path / "cp", **sections, data=data, parallelism={"cp": 2})
    )[0]
    unmasked = {**data, "document_mask": False}
    across = ranks(1).run(_document_masked_losses, tiny_llama_job(tmp_path / "across", **sections, data=unmasked))[0]
    assert cp2 == pytest.approx(one, abs=1e-5), (cp2, one)
    assert abs(across[-1] - one[-1]) > 1e-3, (across, one)


class _OwnAttention(torch.nn.Module):
    """A user's model whose attention is its own softmax: document_mask cannot reach it."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(8, 16)])

    def init_weights(self):
        torch.nn.init.normal_(self.emb.weight)
        self.layers[0].reset_parameters()

    def forward(self, x):
        h = self.emb(x)
        weights = torch.softmax(h @ h.transpose(-2, -1), dim=-1)  # attends across documents
        return self.layers[0](weights @ h)


def own_attention_model():
    return _OwnAttention()


def _first_step_error(spec):
    from hpservice.train import Trainer, TrainingError

    with pytest.raises(TrainingError) as e:
        Trainer(spec, log_to_stdout=False).train()
    return str(e.value)


def test_document_mask_refuses_a_model_whose_attention_it_cannot_reach(ranks, tmp_path):
    from tests._jobs import tiny_llama_job

    spec = tiny_llama_job(
        tmp_path,
        model={"name": "tests.parallel.test_context_parallel:own_attention_model", "flavor": None},
        data={"vocab_size": 16, "document_mask": True, "eos_id": 3},
    )
    message = ranks(1).run(_first_step_error, spec)[0]
    assert message.startswith("data.document_mask: the model's attention never called scaled_dot_product_attention")


def test_document_mask_needs_an_end_of_text_token_it_can_know():
    from hpservice.spec import SpecError, parse_job

    with pytest.raises(SpecError, match=r"data\.document_mask with synthetic tokens needs data\.eos_id"):
        parse_job({"name": "x", "data": {"document_mask": True}})
    with pytest.raises(SpecError, match=r"data\.document_mask with byte-level text needs data\.eos_id"):
        parse_job({"name": "x", "data": {"kind": "text", "path": "a.txt", "document_mask": True}})
    with pytest.raises(SpecError, match=r"evaluation attends as training does; set data\.document_mask"):
        parse_job({"name": "x", "eval": {"interval": 5, "data": {"document_mask": True, "eos_id": 3}}})


# ---- training: a job with context parallelism trains like one process ---------------------------
def _train(spec):
    """Losses and grad norms of every step, and the final weights (whole tensors)."""
    from hpservice.dtensor import DTensor
    from hpservice.train import Trainer

    trainer = Trainer(spec, log_to_stdout=False)
    records = trainer.train()
    weights = {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in trainer.model.state_dict().items()
    }
    return [(r["loss"], r["grad_norm"]) for r in records], weights if dist.get_rank() == 0 else None


@pytest.mark.parametrize(
    ("world", "parallelism", "training"),
    [
        (2, {"cp": 2}, {}),
        (4, {"cp": 4, "cp_rotate": "allgather"}, {}),
        (4, {"dp_shard": 2, "cp": 2}, {"grad_accum": 2, "activation_checkpointing": "full"}),
        (4, {"dp_replicate": 2, "dp_shard": 1, "cp": 2}, {}),
        (4, {"cp": 2, "tp": 2}, {}),
        (4, {"cp": 2, "tp": 2, "sequence_parallel": True}, {}),
        (2, {"cp": 2}, {"compile": True, "activation_checkpointing": "full"}),
    ],
    ids=["cp2", "cp4-allgather", "fsdp2xcp2-accum-ac", "hsdp2xcp2", "cp2xtp2", "cp2xtp2-sp", "cp2-compile-ac"],
)
def test_training_with_context_parallelism_equals_one_process(ranks, tmp_path, world, parallelism, training):
    from tests._jobs import tiny_llama_job

    sections = {"training": {"steps": 8, **training}, "data": {"seq_len": 64}}
    one_spec = tiny_llama_job(tmp_path / "one", **sections)
    cp_spec = tiny_llama_job(tmp_path / "cp", **sections, parallelism=parallelism)
    (one, one_weights), *_ = ranks(1).run(_train, one_spec)
    (ours, weights), *_ = ranks(world).run(_train, cp_spec)
    assert len(ours) == len(one) == 8
    for (loss, norm), (loss1, norm1) in zip(ours, one, strict=True):
        assert loss == pytest.approx(loss1, abs=1e-5) and norm == pytest.approx(norm1, abs=1e-5), (ours, one)
    assert one_weights.keys() == weights.keys()
    # Ring attention merges blocks by their log-sum-exp where one process runs SDPA whole, and the
    # CPU's SDPA kernel rounds by its vector width: after 8 AdamW steps (which divide by sqrt(v))
    # weights differ by up to 2.1e-5 on an AMD EPYC (under 1e-5 elsewhere); losses and norms above
    # stay within 1e-5.
    for k in one_weights:
        assert (weights[k] - one_weights[k]).abs().max().item() < 5e-5, k


def test_context_parallelism_with_bf16_parameters_follows_one_process(ranks, tmp_path):
    """mixed_precision bf16 under cp 2 (attention computes in bf16 on each rank's chunks) against one
    process with the same policy, and against fp32 (the bound test_fsdp_tp.py holds tp to)."""
    from tests._jobs import tiny_llama_job

    sections = {"training": {"steps": 4}, "data": {"seq_len": 64}}
    fp32 = ranks(1).run(_losses, tiny_llama_job(tmp_path / "fp32", **sections))[0]
    one = ranks(1).run(_losses, tiny_llama_job(tmp_path / "one", **sections, parallelism={"mixed_precision": "bf16"}))[0]
    cp2 = ranks(2).run(
        _losses, tiny_llama_job(tmp_path / "cp", **sections, parallelism={"cp": 2, "mixed_precision": "bf16"})
    )[0]
    assert cp2 == pytest.approx(one, abs=1e-3), (cp2, one)  # measured: 9e-5
    assert cp2 == pytest.approx(fp32, abs=5e-3), (cp2, fp32)


def _losses(spec):
    from tests._jobs import train

    return [r["loss"] for r in train(spec)]


def test_a_checkpoint_of_a_cp_job_resumes_at_another_layout_and_continues_the_run(ranks, tmp_path):
    """Saved under dp_shard 2 x cp 2 (parameters sharded over the flattened dp_shard_cp dim),
    resumed on one process and on cp 2: steps 5-8 continue the uninterrupted cp run's losses."""
    from tests._jobs import tiny_llama_job

    sections = {"training": {"steps": 8}, "data": {"seq_len": 64}}
    run = tiny_llama_job(tmp_path, **sections, parallelism={"dp_shard": 2, "cp": 2}, checkpoint={"interval": 4})
    full = ranks(4).run(_losses, run)[0]
    step4 = tmp_path / "ckpt" / "step-00000004"
    for world, parallelism in ((1, {}), (2, {"cp": 2})):
        again = tiny_llama_job(
            tmp_path / f"again-{world}", **sections, parallelism=parallelism, checkpoint={"resume_from": str(step4)}
        )
        resumed = ranks(world).run(_losses, again)[0]
        assert resumed == pytest.approx(full[4:], abs=1e-5), (world, resumed, full[4:])


def test_parallel_dims_with_cp():
    from hpservice.parallel_dims import ParallelDims
    from hpservice.spec import ParallelismSpec, SpecError

    d = ParallelDims.from_spec(ParallelismSpec(cp=2), 4)
    assert (d.dp_shard, d.cp, d.dp_size, d.shard_group_size) == (2, 2, 2, 4)
    assert d.mesh_dims == [("dp_shard", 2), ("cp", 2)] and d.fsdp_dim_names == ("dp_shard", "cp")
    assert ParallelDims.from_spec(ParallelismSpec(cp=4), 4).mesh_dims == [("cp", 4)]
    with pytest.raises(SpecError, match="not divisible by dp_replicate x cp x tp = 4"):
        ParallelDims.from_spec(ParallelismSpec(cp=4), 6)
    both = ParallelDims.from_spec(ParallelismSpec(cp=2, tp=2), 8)
    assert both.mesh_dims == [("dp_shard", 2), ("cp", 2), ("tp", 2)] and both.fsdp_dim_names == ("dp_shard", "cp")
    hsdp = ParallelDims.from_spec(ParallelismSpec(dp_replicate=2, dp_shard=2, cp=2), 8)
    assert hsdp.mesh_dims == [("dp_replicate", 2), ("dp_shard", 2), ("cp", 2)] and hsdp.dp_size == 4
