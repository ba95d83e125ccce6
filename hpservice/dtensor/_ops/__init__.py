"""Sharding rules for DTensor operators, one file per op family (as torch's ``_ops``).

A rule maps the input specs of one op call to the specs the inputs must have and the spec(s)
of the output; ``_dispatch`` redistributes inputs that differ, runs the op on the local tensors
and wraps the result. Rules are pure functions of (op, specs, non-tensor arguments), so
decisions are cached (``decide``). The registry and the propagation are in ``_registry``.
"""

from . import (  # noqa: F401  (each module registers its family's rules)
    _attention_ops,
    _embedding_ops,
    _math_ops,
    _matrix_ops,
    _pointwise_ops,
    _random_ops,
    _tensor_ops,
    _view_ops,
)
from ._registry import RULES, Decision, LocalShaped, PlainTensor, RuleError, decide, rule_for, written_args

__all__ = ["RULES", "Decision", "LocalShaped", "PlainTensor", "RuleError", "decide", "rule_for", "written_args"]
