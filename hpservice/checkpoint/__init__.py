"""hpservice.checkpoint: sharded, atomic, resharding checkpoints on torch.distributed.checkpoint.

manager = CheckpointManager("ckpt", keep=3, async_save=True)
manager.save(step, model, optimizer, extra={"step": step})
extra = manager.load(model, optimizer)           # any world size / mesh
extra = CheckpointReader("other/step-00000100").load(model, optimizer)  # an input: read-only, no code runs
export_safetensors(manager.latest()["path"], "model.safetensors")

The root is a local directory (a path or a ``file://`` URL) or any fsspec URL, e.g.
``CheckpointManager("s3://bucket/run")`` (object stores commit by writing the manifest last;
see ``_storage``).
"""

from ._errors import CheckpointError, CheckpointStorageError, UnsafeCheckpointError
from ._export import export_safetensors, load_full_state_dict
from ._manager import CheckpointInfo, CheckpointManager
from ._names import step_dir_name, step_of
from ._reader import CheckpointReader, verify_files
from ._state import load_optimizer_state_dict, optimizer_state_dict

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointReader",
    "CheckpointStorageError",
    "UnsafeCheckpointError",
    "export_safetensors",
    "load_full_state_dict",
    "load_optimizer_state_dict",
    "optimizer_state_dict",
    "step_dir_name",
    "step_of",
    "verify_files",
]
