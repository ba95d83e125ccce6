"""hpservice.train: the training runtime of a job (also runs alone: torchrun -m hpservice.train job.yaml)."""

from ._distributed import init_distributed, pick_device
from ._errors import TrainingError
from ._grad_norm import clip_grad_norm_
from ._optimizer import lr_lambda
from ._parallelize import apply_fsdp, apply_tp
from ._trainer import Trainer

__all__ = [
    "Trainer",
    "TrainingError",
    "apply_fsdp",
    "apply_tp",
    "clip_grad_norm_",
    "init_distributed",
    "lr_lambda",
    "pick_device",
]
