"""The training loop of a job. It knows nothing of Ray: it runs under torchrun, in a test's rank
pool, or inside a Ray worker actor, wherever torch.distributed's env:// variables are set.

Read it top to bottom: ``Trainer.__init__`` is a list of builds, each a component of its own
file: the mesh (``ParallelDims``), the model (built on the meta device, split into this rank's
pipeline stages, each laid out by ``_parallelize`` and filled by ``_init_weights`` or the HF
weights), the loss (``_loss``), the optimizer and LR schedule (``_optimizer``), the post-optimizer
hooks the model declares (``_moe``), the data (``_dataset``), evaluation (``_evaluate``),
checkpoints (``_train_checkpoint``) and metrics (``_reporting``). ``train`` loops over
``train_step``: forward-backward (pipelined or not), clip, optimizer step, hooks, metrics.

The model is ``model_parts``: one module, or with pipeline parallelism this rank's stages, whose
parameter names are the whole model's.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from hpservice.inputs import confine
from hpservice.metrics import step_record
from hpservice.parallel import ParallelDims
from hpservice.parallel.context_parallel import positions as cp_positions
from hpservice.spec import JobSpec, new_run_id
from hpservice.spec.composition import refusal

from ._compile import check_compile_available
from ._dataset import build_data
from ._distributed import init_distributed, pick_device
from ._dpo import DPOLoss, PipelineDPOLoss, build_reference, pack_target, pipelined_logps
from ._errors import TrainingError
from ._evaluate import Evaluator
from ._forward import attention, micro_batch_loss
from ._grad_norm import clip_grad_norm_
from ._hold import wait_while_held
from ._loss import TokenLoss
from ._memory import TrainingStateMemory, parameter_counts
from ._model import build_meta_model, build_model_parts, describe_model
from ._optimizer import build_lr_scheduler, build_optimizer
from ._profile import StepProfiler
from ._reporting import Reporter
from ._storage import EVERY_STEPS as STORAGE_EVERY_STEPS
from ._storage import StorageBudget
from ._train_checkpoint import TrainCheckpoints

log = logging.getLogger("hpservice.train")

MetricsCallback = Callable[[dict], None]


def _step_consensus(loss: torch.Tensor, stop_requested: bool, holders: int) -> tuple[float, bool]:
    """One all-reduce per step: the loss summed over the ``holders`` ranks that computed a share
    (all, or the last pipeline stage's; the others add zero) and divided by them, and whether any
    rank was asked to stop.

    A stop request reaches each rank's thread at its own moment; deciding on it together, after
    the same step, keeps every rank issuing the same collectives (one rank checkpointing while
    another starts a step would hang both)."""
    flag = torch.tensor(float(stop_requested), dtype=torch.float64, device=loss.device)
    t = torch.stack([loss.detach().to(torch.float64).reshape(()), flag])  # on the loss's device (nccl needs cuda)
    dist.all_reduce(t)
    return t[0].item() / holders, t[1].item() > 0


class Trainer:
    """One training job on the ranks of the current torch.distributed world."""

    def __init__(
        self,
        spec: JobSpec,
        *,
        on_metrics: MetricsCallback | None = None,
        on_checkpoint: MetricsCallback | None = None,
        log_fn: Callable[[str], None] | None = None,
        log_to_stdout: bool = True,
        reported_up_to: int | None = None,
    ):
        """``on_metrics(record)`` and ``on_checkpoint(info)`` run on rank 0 after each step / commit;
        ``log_fn(line)`` receives progress lines (default: print, unless ``log_to_stdout`` is False).
        ``reported_up_to``: the last step whose metrics ``on_metrics``' listener already has; a
        run resuming past it first reports the steps between from its ``metrics.jsonl`` (an
        earlier attempt trained them, but its reports were lost with its coordinator)."""
        confine(spec.input_roots)  # inputs are checked again on each file as it is opened
        if spec.parallelism.auto:  # every rank must build the same layout: it is chosen once, before
            raise TrainingError(
                "parallelism: auto is resolved where the job is handed over (hpservice validate / run / submit, or "
                "hpservice.preflight.plan_memory), not by each rank: pass the spec it returns"
            )
        self._stop = threading.Event()  # set by request_stop, from another thread, on this rank
        self._stopping = False  # agreed by all ranks after a step
        self.device = pick_device(spec)
        if spec.training.compile and (reason := check_compile_available(self.device.type)):
            raise TrainingError(reason)  # before any work: not a crash at the first step
        self._owns_group = init_distributed(self.device.type)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.spec = spec = self._name_run(spec)
        self.step = 0
        self.output_dir = Path(spec.run_dir())

        # the mesh (pp x dp_replicate x dp_shard x cp x tp): the one source of layout facts
        self.parallel_dims = dims = ParallelDims.from_spec(spec.parallelism, self.world)
        self.mesh = dims.build_mesh(self.device.type)
        bundle, whole, frozen = build_meta_model(spec, dims)  # the family's ModelSpec
        counts = parameter_counts(whole, frozen)  # before the layout splits (or quantises) anything
        self.model_name = bundle.name
        self.loss = TokenLoss(
            ranks=dims.dp_size * dims.cp, batch_mesh=lambda: dims.batch_mesh, compile=spec.training.compile
        )
        self.dpo, self.pipeline_loss = self._build_dpo_loss(dims)
        stage_loss = self.pipeline_loss or self.loss  # the pipeline's last stage computes it
        self.model_parts, self.pipeline = build_model_parts(bundle, whole, frozen, dims, spec, self.device, stage_loss)
        self.reference = self._build_reference(bundle, dims)  # before a resume: the reference is the start
        self.optimizer = build_optimizer(self.model_parts, spec)
        self.scheduler = build_lr_scheduler(self.optimizer, spec)
        self.memory = TrainingStateMemory(self.model_parts, self.optimizer, counts)
        facts = describe_model(bundle, whole, spec, self.device, self.rank)
        self.model_record, self.utilisation = facts.record, facts.utilisation
        self.post_optimizer_hooks = bundle.post_optimizer_hooks(
            whole,
            self.model_parts,
            dims,
            microbatches=1 if dims.pp > 1 else spec.training.grad_accum,  # the pipeline divides its own
            bias_update_rate=(facts.record["config"] or {}).get("bias_update_rate", 0.0),
        )
        self.storage = StorageBudget(spec.storage_limit_bytes, [str(self.output_dir), spec.checkpoint.dir])
        self.data, eval_data = build_data(spec, dims, facts.vocab_size, self.output_dir, self.device)
        self.evaluate = None
        if eval_data is not None:
            self.evaluate = Evaluator(eval_data, spec.eval.steps, self.model_parts, dims, self.loss, self.pipeline)
        self.reporter = Reporter(
            spec, self.rank, self.output_dir, on_metrics=on_metrics, log_fn=log_fn, log_to_stdout=log_to_stdout
        )
        if self.rank == 0 and (lora := self.model_record.get("lora")) is not None:
            share = lora["trainable"] / max(lora["total"], 1)
            self.reporter.line(f"[{spec.name}] LoRA r={lora['r']} on {len(lora['modules'])} layers: "
                               f"{lora['trainable']:,} trainable parameters of {lora['total']:,} ({share:.2%})")  # fmt: skip
        if self.rank == 0 and (described := getattr(self.data.source, "describe", None)) is not None:
            self.reporter.line(f"[{spec.name}] data: {described()}")  # what encoding kept, dropped, cut
        if hasattr(self.reference, "fill"):  # reference: precomputed, from the policy as it starts (before a resume)
            pipelined = (lambda b: pipelined_logps(self.pipeline, self.pipeline_loss, b)) if self.pipeline else None
            self.reference.fill(self.data, spec.training.steps, spec.training.grad_accum, self._dpo_forward_alone, pipelined)
        self.checkpoints = self._build_checkpoints(on_checkpoint)
        if reported_up_to is not None:
            self.reporter.report_earlier_steps(reported_up_to, self.step)
        self.reporter.open_sinks()
        if self.checkpoints is not None:
            self.checkpoints.report_committed()  # the resumed checkpoint, listed again
        self._profiler = None
        if spec.metrics.profile is not None:
            self._profiler = StepProfiler(spec.metrics.profile, spec.artifacts_dir(), self.rank, self.device)

    # ---- builds -------------------------------------------------------------------------------
    def _build_dpo_loss(self, dims: ParallelDims):
        """DPO's loss (``objective.kind: dpo``) and, under pipeline parallelism, the last stage's
        ``loss_fn`` over it; else (None, None)."""
        spec = self.spec
        if spec.objective.kind != "dpo":
            return None, None
        k = spec.parallelism.microbatches(spec.training.grad_accum) if dims.pp > 1 else 1
        loss = DPOLoss(spec.objective, ranks=dims.dp_size * dims.cp, batch_mesh=lambda: dims.batch_mesh, microbatches=k)
        return loss, (PipelineDPOLoss(loss) if dims.pp > 1 else None)

    def _build_reference(self, bundle, dims: ParallelDims):
        """DPO's reference model (``_dpo.build_reference``), None for SFT."""
        spec = self.spec
        if self.dpo is None:
            return None

        def frozen_copy():
            _, whole, _ = build_meta_model(spec, dims)
            everything = {n for n, _ in whole.named_parameters()}
            return build_model_parts(bundle, whole, everything, dims, spec, self.device, self.pipeline_loss or self.loss)

        return build_reference(spec.objective, spec, self.model_parts, frozen_copy)

    def _name_run(self, spec: JobSpec) -> JobSpec:
        """Run directly (torchrun, tests), a spec has no run id: rank 0 names the run for all."""
        if spec.run_id is not None:
            return spec
        run_id = [new_run_id(spec.name) if self.rank == 0 else None]
        dist.broadcast_object_list(run_id, src=0)
        return spec.with_run(run_id[0])

    def _build_checkpoints(self, on_checkpoint) -> TrainCheckpoints | None:
        c = self.spec.checkpoint
        if not (c.interval or c.resume_from):
            return None
        checkpoints = TrainCheckpoints(
            self.spec, self.rank, self.model_parts, self.optimizer, self.scheduler, self.model_record, on_checkpoint
        )
        if c.resume_from:
            self.step = checkpoints.resume(c.resume_from)
        return checkpoints

    @property
    def model(self) -> nn.Module:
        """This rank's model: the whole model, or its one pipeline stage (``model_parts`` holds
        a rank's several stages under ``pp_virtual_stages``)."""
        if len(self.model_parts) != 1:
            raise AttributeError(f"this rank holds {len(self.model_parts)} pipeline stages: use Trainer.model_parts")
        return self.model_parts[0]

    @property
    def on_metrics(self) -> MetricsCallback | None:
        """Rank 0's callback of each step's record (``Reporter``)."""
        return self.reporter.on_metrics

    @on_metrics.setter
    def on_metrics(self, callback: MetricsCallback | None) -> None:
        self.reporter.on_metrics = callback

    def save_checkpoint(self, metrics: dict | None = None) -> None:
        self.checkpoints.save(self.step, metrics)

    def request_stop(self) -> None:
        """Stop after the step in which every rank has learned of the request (the ranks agree on it
        in that step's loss all-reduce), checkpoint (if configured), and return from train()."""
        self._stop.set()

    # ---- the loop -----------------------------------------------------------------------------
    def train(self) -> list[dict]:
        history = []
        interval = self.spec.checkpoint.interval
        saved_at = None
        try:
            while self.step < self.spec.training.steps and not self._stopping:
                wait_while_held(self.step, self._stop)  # a drill's hold (HPSERVICE_HOLD_FILE); unset: nothing
                record = self.train_step()
                history.append(record)
                if interval and (self.step % interval == 0 or self.step == self.spec.training.steps):
                    self.save_checkpoint({k: record[k] for k in ("loss", "val_loss") if k in record})
                    saved_at = self.step
                if self.rank == 0 and (saved_at == self.step or self.step % STORAGE_EVERY_STEPS == 0):
                    self.storage.check()
            if self._stopping and self.checkpoints is not None and history and saved_at != self.step:
                self.save_checkpoint({"loss": history[-1]["loss"]})
            if self.checkpoints is not None:
                self.checkpoints.finish()
        finally:
            self.close()
        return history

    def train_step(self) -> dict:
        """One optimizer step (inside the profiler's range when ``metrics.profile`` covers it)."""
        if self._profiler is None:
            return self._train_step()
        with self._profiler.step(self.step + 1):
            record = self._train_step()
        if self._profiler.written and not self._profiler.reported:
            self._profiler.reported = True
            written = ", ".join(p.name for p in self._profiler.written)
            self.reporter.line(f"[{self.spec.name}] profiler: wrote {written} (rank 0) under {self._profiler.out_dir}")
        return record

    def _forward_backward(self, batch) -> torch.Tensor:
        """This rank's share of the step's loss, its gradients accumulated: the micro-batches
        through the pipeline's stages (the loss on the last), or one after another."""
        spec, dims = self.spec, self.parallel_dims
        n_micro = spec.parallelism.microbatches(spec.training.grad_accum) if self.pipeline else 1
        if self.dpo is not None:
            return self._dpo_forward_backward(batch)
        self.loss.begin(
            batch,
            global_tokens=self.data.global_tokens,
            every_label_valid=self.data.every_label_valid,
            microbatches=n_micro,
        )
        loss_sum = torch.zeros((), device=self.device)
        if self.pipeline is not None:
            if batch.document_ids is not None:  # a job built in code, past the spec's check
                raise TrainingError(f"parallelism.pp: {refusal('documents_with_pp')}")
            losses: list[torch.Tensor] = []
            self.pipeline.step(batch.inputs, target=batch.labels, losses=losses, return_outputs=False)
            if losses:
                loss_sum += torch.stack(losses).mean()
            return loss_sum
        accum = spec.training.grad_accum
        for micro, part in enumerate(batch.chunk(accum)):
            if dims.dp_mesh is not None:
                self.model.set_requires_gradient_sync(micro == accum - 1 or spec.parallelism.sync_every_micro_batch)
            with attention(part, dims):  # backward too: checkpointing recomputes there
                loss = micro_batch_loss(self.model, part, dims, self.loss)
                loss.backward()
            loss_sum += loss.detach()
        return loss_sum

    def _dpo_forward_backward(self, batch) -> torch.Tensor:
        """DPO: each micro-batch's pairs through the reference (no gradients) and the policy."""
        self.dpo.begin(batch)
        loss_sum = torch.zeros((), device=self.device)
        if self.pipeline is not None:
            return self._dpo_pipelined(batch)
        accum = self.spec.training.grad_accum
        for micro, part in enumerate(batch.chunk(accum)):  # rows [c0, r0, ...]: an even split keeps pairs whole
            if self.parallel_dims.dp_mesh is not None:
                self.model.set_requires_gradient_sync(micro == accum - 1 or self.spec.parallelism.sync_every_micro_batch)
            with attention(part, self.parallel_dims):  # cp: ring attention over this rank's positions
                ref = self.reference.logps(lambda model, part=part: self._dpo_forward(model, part), self.step, micro)
                logits, labels, cp_group = self._dpo_forward(self.model, part)
                loss = self.dpo(logits, labels, ref, cp_group)
                loss.backward()
            # every cp rank holds its pairs' whole loss (TokenLoss's shares are parts): counted once
            loss_sum += loss.detach() / self.parallel_dims.cp
        return loss_sum

    def _dpo_pipelined(self, batch) -> torch.Tensor:
        """DPO through the pipeline: the reference's rows by its forwards (or precomputed), packed
        into the target the last stage's loss reads, then the schedule's step."""
        micro = self.spec.parallelism.microbatches(self.spec.training.grad_accum)
        if (batch.shape[0] // 2) % micro:
            raise TrainingError(
                f"parallelism.pp_microbatches x training.grad_accum = {micro} must divide this rank's "
                f"{batch.shape[0] // 2} preference pairs a step (a pair's two rows travel in one micro-batch)"
            )
        ref = self.reference
        if hasattr(ref, "values"):  # precomputed
            ref_rows = ref.values[(self.step, 0)]
        else:
            with ref.model():
                ref_rows = pipelined_logps(getattr(ref, "pipeline", None) or self.pipeline, self.pipeline_loss, batch)
        losses: list[torch.Tensor] = []
        self.pipeline.step(batch.inputs, target=pack_target(batch.labels, ref_rows), losses=losses, return_outputs=False)
        return torch.stack(losses).mean() if losses else torch.zeros((), device=self.device)

    def _dpo_forward(self, model: nn.Module, part) -> tuple:
        """(logits, labels, cp group) of a micro-batch of pairs: under context parallelism, this
        rank's positions of each row (the head and tail chunks), the model told their positions."""
        dims = self.parallel_dims
        if dims.cp == 1:
            return model(part.inputs), part.labels, None
        pos = cp_positions(part.shape[1], dims.cp, dims.cp_rank, device=part.inputs.device)
        logits = model(part.inputs.index_select(1, pos), positions=pos)
        return logits, part.labels.index_select(1, pos), dims.cp_mesh.get_group()

    def _dpo_forward_alone(self, model: nn.Module, part) -> tuple:
        """``_dpo_forward`` in its own attention context (a forward with no backward after it)."""
        with attention(part, self.parallel_dims):
            return self._dpo_forward(model, part)

    def _train_step(self) -> dict:
        spec = self.spec
        self.utilisation.start_step()
        start = time.perf_counter()
        loss_sum = self._forward_backward(self.data(self.step))
        loss_value, self._stopping = _step_consensus(loss_sum, self._stop.is_set(), self.world // self.parallel_dims.pp)
        if not math.isfinite(loss_value):
            self.optimizer.zero_grad()
            if not spec.training.skip_nonfinite:
                raise TrainingError(f"non-finite loss ({loss_value}) at step {self.step + 1}")
            log.warning("step %d: non-finite loss, step skipped", self.step + 1)
        max_norm = spec.training.max_grad_norm or float("inf")
        params = [p for part in self.model_parts for p in part.parameters()]
        pp_group = self.parallel_dims.pp_mesh.get_group() if self.parallel_dims.pp > 1 else None
        grad_norm = clip_grad_norm_(params, max_norm, pp_group=pp_group)
        lr = self.scheduler.get_last_lr()[0]
        if math.isfinite(loss_value):
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad()
        self.step += 1
        elapsed = time.perf_counter() - start
        tokens = self.data.global_tokens
        values = {
            "loss": loss_value,
            **({} if self.data.every_label_valid else {"trained_tokens": self.loss.global_valid}),
            **self.data.facts(self.step - 1),
            "lr": lr,
            "grad_norm": float(grad_norm),
            "tokens_per_s": tokens / elapsed,
            "step_time_s": elapsed,
            **self.utilisation.record(tokens / elapsed / self.world),
            **self.memory.record(),
        }
        values.update(self._peaks_per_rank(values))
        if self.dpo is not None:
            pp_group = self.parallel_dims.pp_mesh.get_group() if self.parallel_dims.pp > 1 else None
            values.update(self.dpo.metrics(pp_group), reference_gib=self.reference.held_bytes() / 2**30)
        for hook in self.post_optimizer_hooks:
            values.update(hook())
        interval = spec.eval.interval
        if interval and (self.step % interval == 0 or self.step == spec.training.steps):
            values.update(self.evaluate())
        record = step_record(self.step, time.time(), values)  # time: the wall clock at the end of the step
        self.reporter.report(record)
        return record

    def _peaks_per_rank(self, values: dict) -> dict:
        """Every rank's measured peak of the step beside its estimate (``spec.memory_estimate``:
        one entry per pp rank): one all-reduce of a number per rank."""
        peaks = torch.zeros(self.world, dtype=torch.float64, device=self.device)
        peaks[self.rank] = values.get("peak_memory_allocated_gib", values["peak_rss_gib"])
        dist.all_reduce(peaks)  # each rank's own entry, the others zero
        estimate = self.spec.memory_estimate
        per_pp = [r["peak_gib"] for r in estimate["ranks"]] if estimate else []
        pp_of = self.parallel_dims.pp_rank_of if per_pp else None
        out = {"peak_memory_per_rank_gib": {  # [measured], and its estimate where the job was planned
            str(r): [round(float(p), 4), *([per_pp[pp_of(r)]] if pp_of else [])] for r, p in enumerate(peaks.tolist())
        }}  # fmt: skip
        if per_pp:
            out["estimated_peak_gib"] = per_pp[pp_of(self.rank)]
        return out

    def close(self) -> None:
        if self._profiler is not None:
            self._profiler.finish()  # a run that ended inside the profiled steps still gets its trace
        if self.checkpoints is not None:
            self.checkpoints.close()
        self.reporter.close()
        if self._owns_group:
            dist.destroy_process_group()
            self._owns_group = False
