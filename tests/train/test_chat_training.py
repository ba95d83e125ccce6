"""Fine-tuning on chat data trains like transformers + torch.optim.AdamW in one process on the same
conversations, unpacked and padded, with labels -100 outside the assistant mask and the loss the
sum over the global batch's trained tokens over their count (not a mean of per-micro-batch means).

The model: a tiny Qwen3 saved by transformers (``model.init_from``), its tokenizer carrying Qwen3's
training template (TRL's copy, with generation blocks: multi-turn masks without refusals). Ours on 2
gloo ranks with fully_shard, gradient accumulation 2 and packing; then tensor parallelism; context
parallelism over packed rows; pipeline parallelism (padded: packing under pp is refused); packed
against unpacked in one process.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from hpservice.spec import SpecError, parse_job
from tests.data.chat_fixtures import CONVERSATIONS, tokenizer_dir

STEPS = 5


def _conversations() -> list[dict]:
    """16 conversations of different lengths (so packing and micro-batches hold different counts)."""
    base = list(CONVERSATIONS.values())
    out = []
    for i in range(16):
        msgs = [dict(m) for m in base[i % len(base)] if "tool_calls" not in m and m["role"] != "tool"]
        if msgs[-1]["role"] != "assistant":
            msgs = msgs[:-1]
        msgs[-1] = {**msgs[-1], "content": msgs[-1]["content"] + " More." * (i % 5)}
        out.append({"messages": msgs})
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    import transformers
    from tokenizers import Tokenizer

    tmp = tmp_path_factory.mktemp("chat-model")
    tok = tokenizer_dir(tmp, "qwen3", training=True)
    vocab = Tokenizer.from_file(str(tok / "tokenizer.json")).get_vocab_size()
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=vocab, max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=10000.0,
        tie_word_embeddings=False,
    )  # fmt: skip
    out = tmp / "qwen3"
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok / f, out / f)
    data = tmp / "chats.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in _conversations()))
    return out, data


def _job(tmp, model_dir, data, *, parallelism=None, packing="best_fit", grad_accum=2):
    return parse_job({
        "name": "sft",
        "model": {"init_from": str(model_dir)},
        "data": {"kind": "chat", "path": str(data), "seq_len": 96, "global_batch": 4, "packing": packing, "seed": 3},
        "training": {"steps": STEPS, "grad_accum": grad_accum, "max_grad_norm": None},
        "optimizer": {"lr": 2e-3, "weight_decay": 0.0, "betas": [0.9, 0.95], "eps": 1e-8},
        "lr_scheduler": {"warmup_steps": 0, "decay": "constant"},
        "parallelism": parallelism or {},
        "metrics": {"dir": str(tmp)},
        "checkpoint": {"dir": str(tmp / "ckpt"), "interval": 0},
    })  # fmt: skip


def _train(spec):
    """Every step's record, the step records of the source, and the final weights (HF names)."""
    from hpservice.dtensor import DTensor
    from hpservice.models.hf import config_from_hf, hf_tensors
    from hpservice.train import Trainer

    trainer = Trainer(spec, log_to_stdout=False)
    records = trainer.train()
    cfg = config_from_hf(spec.model.init_from)
    weights = {}
    for part in trainer.model_parts:
        for k, v in part.state_dict().items():
            full = (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            weights.update(hf_tensors(k, full, cfg))
    source = trainer.data.source
    steps = [source.step_records(s, spec.data.global_batch) for s in range(STEPS)]
    return records, steps, weights, source.corpus


def _reference(model_dir, steps, corpus):
    """transformers + AdamW, one process: each step's conversations padded, one batch."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    losses = []
    for records in steps:
        seqs = [(np.asarray(corpus.tokens[corpus.starts[r] : corpus.starts[r + 1]]),
                 np.asarray(corpus.mask[corpus.starts[r] : corpus.starts[r + 1]])) for r in records]  # fmt: skip
        width = max(len(ids) for ids, _ in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.int64)
        labels = torch.full((len(seqs), width), -100, dtype=torch.int64)
        attn = torch.zeros(len(seqs), width, dtype=torch.int64)
        for b, (t, m) in enumerate(seqs):
            ids[b, : len(t)] = torch.from_numpy(t.astype(np.int64))
            labels[b, : len(t)] = torch.where(torch.from_numpy(m), ids[b, : len(t)], -100)
            attn[b, : len(t)] = 1
        logits = model(input_ids=ids, attention_mask=attn).logits.float()
        shift, target = logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten()
        loss = torch.nn.functional.cross_entropy(shift, target, ignore_index=-100, reduction="sum") / (target != -100).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach() for k, v in model.state_dict().items()}


def _assert_equal_to_transformers(result, model_dir, *, weights_tol=1e-5):
    records, steps, weights, corpus = result
    losses, ref_weights = _reference(model_dir, steps, corpus)
    assert [r["loss"] for r in records] == pytest.approx(losses, abs=1e-5), ([r["loss"] for r in records], losses)
    for r, recs in zip(records, steps, strict=True):  # the trained-token count: the step's masked labels
        assert r["trained_tokens"] == sum(int(np.asarray(corpus.mask[corpus.starts[i] + 1 : corpus.starts[i + 1]]).sum()) for i in recs)
    for k, v in weights.items():
        assert (v - ref_weights[k]).abs().max().item() < weights_tol, k


def test_chat_fine_tuning_with_fully_shard_accumulation_and_packing_equals_transformers(ranks, tmp_path, model_dir):
    model, data = model_dir
    spec = _job(tmp_path, model, data, parallelism={"dp_shard": 2})
    result = ranks(2).run(_train, spec)[0]
    _assert_equal_to_transformers(result, model)
    records = result[0]
    assert all(0 < r["packing_efficiency"] <= 1 for r in records) and records[-1]["epoch"] > 0


def test_chat_fine_tuning_with_tensor_parallelism_equals_transformers(ranks, tmp_path, model_dir):
    model, data = model_dir
    result = ranks(2).run(_train, _job(tmp_path, model, data, parallelism={"tp": 2}, packing="first_fit"))[0]
    _assert_equal_to_transformers(result, model)


def test_chat_fine_tuning_with_context_parallelism_and_packing_equals_transformers(ranks, tmp_path, model_dir):
    # ring attention over packed rows: each conversation's attention and positions kept across the cp ranks
    model, data = model_dir
    result = ranks(2).run(_train, _job(tmp_path, model, data, parallelism={"cp": 2}))[0]
    _assert_equal_to_transformers(result, model)


def test_compiled_packing_on_one_rank_is_refused_naming_the_field(tmp_path, model_dir):
    # torch.compile does not trace the one-rank document-masked attention (it failed at step 1,
    # for data.document_mask as well): refused before start until it does; cp > 1 compiles
    model, data = model_dir
    spec = _job(tmp_path, model, data, grad_accum=1).model_dump()
    spec["training"]["compile"] = True
    with pytest.raises(SpecError, match=r"training\.compile"):
        parse_job(spec)
    spec["data"]["packing"] = "none"
    parse_job(spec)


def test_chat_fine_tuning_with_pipeline_parallelism_equals_transformers(ranks, tmp_path, model_dir):
    model, data = model_dir
    spec = _job(tmp_path, model, data, parallelism={"pp": 2}, packing="none")
    outs = ranks(2).run(_train, spec)
    records = outs[1][0]  # the last stage reports the loss
    weights = {k: v for o in outs for k, v in o[2].items()}
    _assert_equal_to_transformers((records, outs[0][1], weights, outs[0][3]), model)


def test_packing_under_pipeline_parallelism_is_refused_naming_the_field(tmp_path, model_dir):
    model, data = model_dir
    with pytest.raises(SpecError, match=r"data\.packing"):
        _job(tmp_path, model, data, parallelism={"pp": 2}, packing="best_fit")


def test_packed_rows_train_as_the_same_conversations_unpacked(ranks, tmp_path, model_dir):
    # One process, one step, the same records: packed into rows with per-document attention and
    # positions, or one per row, padded: the same loss and gradients.
    model, data = model_dir
    packed = ranks(1).run(_gradients, _job(tmp_path / "p", model, data, grad_accum=1))[0]
    assert packed["rows"] < packed["records"]  # it did pack
    unpacked = ranks(1).run(_gradients, _job(tmp_path / "u", model, data, grad_accum=1), packed["step_records"])[0]
    assert packed["loss"] == pytest.approx(unpacked["loss"], abs=1e-6)
    for k, g in packed["grads"].items():
        assert (g - unpacked["grads"][k]).abs().max().item() < 1e-6, k


def _gradients(spec, records=None):
    """The loss and gradients of step 0's records: packed as the spec says, or (``records``) those
    records one per row."""
    from hpservice.data.chat import ChatSource
    from hpservice.train import Trainer
    from hpservice.train._forward import attention, micro_batch_loss

    trainer = Trainer(spec, log_to_stdout=False)
    source = trainer.data.source
    if records is not None:
        source = ChatSource(source.corpus, seq_len=spec.data.seq_len, packing="none", pad_id=source.pad_id)
        source._epochs[0] = [np.asarray([r]) for r in records] + [np.asarray([r]) for r in range(source.corpus.num_records)]
        source._ends = []
        batch = source.batch(0, 0, 1, len(records), spec.data.seq_len)
    else:
        batch = source.batch(0, 0, 1, spec.data.global_batch, spec.data.seq_len)
    dims = trainer.parallel_dims
    trainer.loss.begin(batch, global_tokens=batch.inputs.numel(), every_label_valid=False)
    with attention(batch, dims):
        loss = micro_batch_loss(trainer.model, batch, dims, trainer.loss)
        loss.backward()
    from hpservice.dtensor import DTensor

    grads = {k: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
             for k, p in trainer.model.named_parameters()}  # fmt: skip
    step_records = trainer.data.source.step_records(0, spec.data.global_batch)
    return {"loss": loss.item(), "grads": grads, "rows": batch.inputs.shape[0], "records": len(step_records),
            "step_records": step_records}  # fmt: skip


def test_each_row_of_a_packed_batch_gets_its_own_positions():
    # rotary angles per row ([B, S] positions): row b as if it ran alone with its positions
    from hpservice.models import build_model

    torch.manual_seed(0)
    model = build_model("llama", flavor="tiny")
    tokens = torch.randint(0, 100, (2, 16))
    positions = torch.stack([torch.arange(16), torch.cat([torch.arange(6), torch.arange(10)])])
    together = model(tokens, positions=positions)
    for b in range(2):
        alone = model(tokens[b : b + 1], positions=positions[b])
        assert torch.equal(together[b], alone[0])
    assert not torch.allclose(together[1], model(tokens)[1])  # restarted positions rotate otherwise


def _losses(spec):
    from hpservice.train import Trainer

    return [(r["step"], r["loss"]) for r in Trainer(spec, log_to_stdout=False).train()]


def test_a_chat_job_resumed_mid_epoch_and_resized_trains_on_the_same_rows(ranks, tmp_path, model_dir):
    # 16 conversations packed: an epoch is a few steps, so step 3 is mid-epoch; resumed on 1 rank
    # (the world resized) the remaining steps' losses are the uninterrupted run's
    model, data = model_dir
    full = _job(tmp_path / "a", model, data, parallelism={"dp_shard": 2}, grad_accum=1)
    full = full.model_copy(update={"training": full.training.model_copy(update={"steps": 6}),
                                   "checkpoint": full.checkpoint.model_copy(update={"interval": 3})})  # fmt: skip
    uninterrupted = ranks(2).run(_losses, full)[0]
    step3 = tmp_path / "a" / "ckpt" / "step-00000003"
    resumed_spec = full.model_copy(update={
        "metrics": full.metrics.model_copy(update={"dir": str(tmp_path / "b")}),
        "parallelism": full.parallelism.model_copy(update={"dp_shard": 1}),
        "checkpoint": full.checkpoint.model_copy(update={"dir": str(tmp_path / "b" / "ckpt"), "resume_from": str(step3)}),
    })  # fmt: skip
    resumed = ranks(1).run(_losses, resumed_spec)[0]
    assert [s for s, _ in resumed] == [4, 5, 6]
    assert [loss for _, loss in resumed] == pytest.approx([loss for _, loss in uninterrupted[3:]], abs=1e-5)
