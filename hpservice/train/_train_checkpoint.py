"""The trainer's checkpoints: what a step's checkpoint holds besides the weights and optimizer
state (step, schedule, RNG, data position, what the weights are), resuming exactly, and telling
``on_checkpoint`` of each commit (async saves commit after the step that started them)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn as nn

from hpservice.checkpoint import CheckpointManager, CheckpointReader, step_dir_name, step_of
from hpservice.dtensor import random as dtensor_random
from hpservice.spec import JobSpec

from ._errors import TrainingError

__all__ = ["TrainCheckpoints"]

log = logging.getLogger("hpservice.train")


class TrainCheckpoints:
    """``checkpoint.interval`` / ``resume_from`` of a run: the ``CheckpointManager`` of its
    directory, and the extra state of a training step."""

    def __init__(
        self,
        spec: JobSpec,
        rank: int,
        model_parts: list[nn.Module],
        optimizer: torch.optim.Optimizer,
        scheduler,
        model_record: dict,
        on_checkpoint: Callable[[dict], None] | None,
    ):
        c = spec.checkpoint
        self.spec, self.rank, self.model_parts, self.optimizer, self.scheduler = spec, rank, model_parts, optimizer, scheduler
        self.model_record, self.on_checkpoint = model_record, on_checkpoint
        self.manager = CheckpointManager(c.dir, keep=c.keep, async_save=c.async_, best_metric=c.keep_best)
        # A LoRA run on a pretrained base saves its adapters (and their optimizer state) only: the
        # frozen base is model.init_from's, read again on resume and identified by its fingerprint.
        # A base initialised from the seed is saved with them (a merged export needs its values).
        lora = model_record.get("lora")
        self.adapters_only = lora is not None and lora.get("base_fingerprint") is not None
        self._uncommitted: list[dict] = []  # async checkpoints not yet reported as committed

    def resume(self, resume_from: str) -> int:
        """Continue exactly where a checkpoint left off: model, optimizer, schedule, RNG; returns
        its step (the data position), or 0 for ``latest`` with no checkpoint yet."""
        if resume_from == "latest":
            if self.manager.latest_step() is None:  # rank 0's answer, checked on every rank
                log.info("resume_from: latest, but no checkpoint under %s yet: starting fresh", self.spec.checkpoint.dir)
                return 0
            extra = self.manager.load(self.model_parts, self.optimizer, ignore_frozen_params=self.adapters_only)
            latest = self.manager.latest() if self.rank == 0 else None
            if latest is not None:  # listed again: an earlier attempt's workers may have written it unreported
                self._uncommitted.append({"step": latest["step"], "metrics": latest["metrics"], "time": latest["time"]})
        else:
            name = resume_from.rstrip("/").rpartition("/")[2]  # a path or a URL: .../step-N
            if step_of(name) is None:
                raise TrainingError(
                    f"checkpoint.resume_from: expected 'latest' or a .../step-N directory, got {resume_from!r}"
                )
            # an input (another run's, or a tenant's files): read-only, confined, no code in it runs
            extra = CheckpointReader(resume_from).load(
                self.model_parts, self.optimizer, group=self.manager.group, ignore_frozen_params=self.adapters_only
            )
        self._check_base(extra.get("model") or {})
        self.scheduler.load_state_dict(extra["scheduler"])
        torch.set_rng_state(extra["rng"])
        dtensor_random.set_rng_state(extra["dtensor_rng"])
        return extra["step"]

    def _check_base(self, saved: dict) -> None:
        """Adapters resume on the base they were trained on (the checkpoint does not hold it)."""
        if not self.adapters_only:
            return
        mine, theirs = self.model_record["lora"], saved.get("lora") or {}
        if theirs.get("base_fingerprint") != mine["base_fingerprint"]:
            raise TrainingError(
                f"checkpoint.resume_from: its adapters were trained on the base {theirs.get('base')!r}, which is not "
                f"model.init_from {mine['base']!r} (config.json or weight files differ); resume with that base"
            )

    def save(self, step: int, metrics: dict | None = None) -> None:
        extra = {
            "step": step,
            "scheduler": self.scheduler.state_dict(),
            "rng": torch.get_rng_state(),
            "dtensor_rng": dtensor_random.get_rng_state(),
            "data": {"seed": self.spec.data.seed, "step": step},
            # what the weights are, for exporting the checkpoint without the job spec (hpservice export --format hf)
            "model": dict(self.model_record),
        }
        self.report_committed()  # save() waits for the previous async save: it is committed now
        self.manager.save(
            step, self.model_parts, self.optimizer, extra, metrics=metrics, ignore_frozen_params=self.adapters_only
        )
        self._uncommitted.append({"step": step, "metrics": metrics or {}})
        if not self.spec.checkpoint.async_:
            self.report_committed()

    def report_committed(self) -> None:
        """Tell ``on_checkpoint`` of each newly committed checkpoint, with ``kept``: the steps of
        every checkpoint still on storage (pruning by ``checkpoint.keep`` removed the others)."""
        if self.rank == 0 and self.on_checkpoint is not None and self._uncommitted:
            kept = [c["step"] for c in self.manager.list()]
            for info in self._uncommitted:
                path = f"{self.spec.checkpoint.dir.rstrip('/')}/{step_dir_name(info['step'])}"  # a path or a URL
                self.on_checkpoint({**info, "path": path, "kept": kept})
        self._uncommitted.clear()

    def finish(self) -> None:
        """After the last save: wait for an async one, report it."""
        self.manager.wait()
        self.report_committed()

    def close(self) -> None:
        self.manager.close()
