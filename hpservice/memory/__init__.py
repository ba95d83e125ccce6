"""Per-rank memory of a job: estimated before it runs, measured while it does.

- ``estimate``: the per-rank peak by component, from the spec and the model's meta build
  (``estimate.py``);
- ``TensorMemoryTracker`` / ``measure``: the measured peak of a step, per rank, on CPU
  (``_tracker.py``, ``measure.py``).
"""

from .estimate import COMPONENTS, MemoryEstimate, RankMemory, estimate

__all__ = ["COMPONENTS", "MemoryEstimate", "RankMemory", "estimate"]
