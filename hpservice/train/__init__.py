"""hpservice.train: the training runtime of a job (also runs alone: torchrun -m hpservice.train job.yaml)."""

from ._errors import TrainingError
from ._grad_norm import clip_grad_norm_
from ._trainer import Trainer, apply_fsdp, apply_tp, init_distributed, lr_lambda

__all__ = [
    "Trainer",
    "TrainingError",
    "apply_fsdp",
    "apply_tp",
    "clip_grad_norm_",
    "init_distributed",
    "lr_lambda",
]
