"""Masked labels train like one device: the loss divides by the step's global count of valid
labels, so micro-batches, data-parallel ranks, pipeline micro-batches and context-parallel parts
holding different numbers of valid labels still give one process's loss and weights.

The mask is a function of the global batch's tokens alone (every label whose input token is a
multiple of 3 is ``IGNORE_INDEX``), so every layout masks the same labels; rows hold different
numbers of them, so the mean of per-micro-batch means is another number, which the first test
checks, lest the layouts agree only because the mask changed nothing.
"""

import pytest
import torch
import torch.nn.functional as F

from hpservice.data import IGNORE_INDEX, Batch, TokenSource
from hpservice.train import Trainer

from .._jobs import tiny_llama_job

STEPS = 3


class MaskedSource(TokenSource):
    """A source's batches with the labels after every multiple of 3 masked."""

    every_label_valid = False

    def __init__(self, inner: TokenSource):
        self.inner, self.vocab_size, self.num_tokens, self.seed = inner, inner.vocab_size, None, inner.seed

    def batch(self, *args) -> Batch:
        b = self.inner.batch(*args)
        return Batch(b.inputs, b.labels.masked_fill(b.inputs % 3 == 0, IGNORE_INDEX))

    def _rows(self, *args):  # batch() is overridden
        raise AssertionError


def _spec(tmp_path, name, **sections):
    sections["training"] = {"steps": STEPS, **sections.get("training", {})}
    return tiny_llama_job(tmp_path / name, name, data={"global_batch": 8, "seq_len": 32}, **sections)


def _train_masked(spec, with_reference: bool = False):
    trainer = Trainer(spec, log_to_stdout=False)
    trainer.data.source = MaskedSource(trainer.data.source)
    reference = None
    if with_reference:  # torch's own loss of the first batch, before any step (one process)
        b = trainer.data(0)
        with torch.no_grad():
            logits = trainer.model(b.inputs).float()
        reference = {
            "global": F.cross_entropy(logits.flatten(0, 1), b.labels.flatten()).item(),
            "mean_of_micro_means": sum(
                F.cross_entropy(lg.flatten(0, 1), lb.flatten()).item()
                for lg, lb in zip(logits.chunk(2), b.labels.chunk(2), strict=True)
            )
            / 2,
        }
    history = trainer.train()
    weights = {
        name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for part in trainer.model_parts
        for name, p in part.named_parameters()
    }
    return [r["loss"] for r in history], weights, reference


@pytest.fixture(scope="module")
def one_process(ranks, tmp_path_factory):
    return ranks(1).run(_train_masked, _spec(tmp_path_factory.mktemp("one"), "one"), True)[0]


def test_one_process_loss_is_torchs_mean_over_the_valid_labels(one_process):
    losses, _, reference = one_process
    assert losses[0] == pytest.approx(reference["global"], rel=1e-6)
    # the check below has teeth: a mean of per-micro-batch means is another number
    assert abs(reference["mean_of_micro_means"] - reference["global"]) > 1e-3


@pytest.mark.parametrize(
    "world, sections",
    [
        (1, {"training": {"grad_accum": 2}}),
        (2, {"training": {"grad_accum": 2}}),
        (2, {"parallelism": {"pp": 2, "pp_microbatches": 4, "dp_shard": 1}}),
        (2, {"parallelism": {"cp": 2}}),
    ],
    ids=["accum", "dp2-accum", "pp2", "cp2"],
)
def test_masked_labels_train_like_one_process(ranks, tmp_path, one_process, world, sections):
    ref_losses, ref_weights, _ = one_process
    results = ranks(world).run(_train_masked, _spec(tmp_path, "layout", **sections))
    losses = results[0][0]  # the step consensus gives every rank the loss
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-5)
    weights = {k: v for r in results for k, v in r[1].items()}  # each pp rank holds its stage's
    assert weights.keys() == ref_weights.keys()
    for name, w in weights.items():
        torch.testing.assert_close(w, ref_weights[name], rtol=1e-4, atol=1e-5, msg=name)
