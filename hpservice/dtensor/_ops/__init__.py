"""Sharding rules for DTensor operators (tensor parallelism).

A rule maps the input specs of one op call to the placements the inputs must have and the spec of
the output; ``_dispatch`` redistributes inputs that differ, runs the op on the local tensors and
wraps the result. Rules are pure functions of (op, specs, non-tensor arguments), so decisions are
cached (``decide``).
"""

from . import (
    _attention_rules,  # noqa: F401  (registers scaled-dot-product attention rules)
    _nn_rules,  # noqa: F401  (registers embedding / norm / softmax rules)
)
from ._rules import RULES, Decision, decide, pointwise_decision

__all__ = ["RULES", "Decision", "decide", "pointwise_decision"]
