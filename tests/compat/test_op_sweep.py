"""The OpInfo sweep in CI (tests/compat/op_sweep.py): every op of torch's op_db through our DTensor
and torch's on 2 gloo ranks, against the plain-tensor result.

Ours must never be silently wrong, and what it refuses or crashes on is the list in
docs/dtensor-ops.md: a rule that changes it (an op newly supported, or newly refused) changes that
file, regenerated with ``python -m tests.compat.op_sweep --write docs/dtensor-ops.md``.
"""

import re
from pathlib import Path

from hpservice.launch import run_ranks
from tests.compat import op_sweep

DOC = Path(__file__).resolve().parents[2] / "docs" / "dtensor-ops.md"
ROW = re.compile(r"^\| `([^`]+)` \| (Replicate|Shard\(0\)) \|")


def _documented(section: str) -> set[tuple[str, str]]:
    text = DOC.read_text()
    body = text.split(section, 1)[1].split("\n## ", 1)[0]
    return {m.groups() for line in body.splitlines() if (m := ROW.match(line))}


def test_no_op_is_silently_wrong_and_the_refusals_are_the_documented_ones():
    # Ranks of its own, torn down after: an op that fails on one rank mid-collective must not leave
    # the shared rank pool's process groups out of step for the tests after it. torch's side as
    # recorded for this torch version (op_sweep.TORCH_RECORD), else run too.
    theirs = op_sweep.recorded_torch(2, op_sweep.SAMPLES_PER_OP)
    if theirs is None:
        ours, theirs = run_ranks(op_sweep._both, 2, None, op_sweep.SAMPLES_PER_OP, timeout=1800)[0]
    else:
        ours = run_ranks(op_sweep.sweep, 2, "hpservice", None, op_sweep.SAMPLES_PER_OP, timeout=1800)[0]
    print(op_sweep.table(ours, theirs))  # the side-by-side counts, in the test's output
    silent = op_sweep.listed(ours, "silent")
    assert not silent, f"hpservice's DTensor is silently wrong on: {silent}"
    regenerate = "regenerate it: python -m tests.compat.op_sweep --write docs/dtensor-ops.md"
    for outcome, section in (("refuse", "## Ops hpservice refuses"), ("crash", "## Ops hpservice crashes on")):
        found, documented = set(op_sweep.listed(ours, outcome)), _documented(section)
        assert found == documented, (
            f"{outcome}: not in docs/dtensor-ops.md: {sorted(found - documented)}; "
            f"listed there but no longer {outcome}: {sorted(documented - found)}; {regenerate}"
        )
    # Every op torch's DTensor computes right, ours computes right or refuses by name: never a crash.
    agreed_by_torch = set(op_sweep.listed(theirs, "agree"))
    assert not agreed_by_torch & set(op_sweep.listed(ours, "crash"))


def test_the_recorded_full_sample_sweep_has_no_silent_op():
    # The every-sample run (too long for CI) that docs/dtensor-ops.md's headline counts.
    import json

    data = json.loads(op_sweep.FULL_RECORD.read_text())
    results = {op: {p: tuple(r) for p, r in per.items()} for op, per in data["results"].items()}
    assert not op_sweep.listed(results, "silent")
    assert op_sweep.per_op(results)["agree"] > 488  # torch's DTensor's count on the same sweep

