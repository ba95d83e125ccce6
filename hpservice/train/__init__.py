"""hpservice.train: the training runtime of a job (also runs alone: torchrun -m hpservice.train job.yaml)."""

from ._trainer import Trainer, TrainingError, apply_fsdp, build_mesh, init_distributed, lr_lambda

__all__ = ["Trainer", "TrainingError", "apply_fsdp", "build_mesh", "init_distributed", "lr_lambda"]
