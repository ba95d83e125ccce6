"""The OpInfo sweep: every op of torch's ``op_db`` on DTensors, ours and torch's, against plain tensors.

PyTorch checks its DTensor by running the ops of the OpInfo database (shipped in the torch wheel,
``torch.testing._internal.common_methods_invocations.op_db``) on sample inputs distributed over a
mesh and comparing with the plain-tensor result (``test/distributed/tensor/test_dtensor_ops.py``).
This module does the same for both engines on the same samples: each tensor argument of a sample
(op_db's own sizes, float32) is distributed ``Replicate()`` or ``Shard(0)`` over a 1-D mesh; the
op runs forward and, where it supports autograd, backward (the gradient of a fixed weighted sum of
its floating outputs); outputs and input gradients are gathered and compared with the plain run.

Each (op, placement) gets one outcome, the worst over its samples:

- ``agree``: values, shapes and dtypes equal the plain result (float tolerance of a reordered sum);
- ``refuse``: ``NotImplementedError``, or the engine's own error naming the op and the operands it
  declines (``REFUSALS``);
- ``crash``: any other exception (an engine bug, never a clear refusal);
- ``silent``: the engine returned something else than the plain op. The worst defect.

The plain result is the truth: where torch's DTensor differs from it, torch is the one off.
Run on its own: ``python -m tests.compat.op_sweep [--ranks 2] [--ops name,...]`` prints the table.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import math
import random
import warnings
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

OUTCOMES = ("agree", "refuse", "crash", "silent")
_WORST = {o: i for i, o in enumerate(("agree", "refuse", "crash", "silent"))}
PLACEMENTS = ("Replicate", "Shard(0)")
SAMPLES_PER_OP = 2

# Ops whose plain result is not a function of their inputs: random draws (DTensor random ops draw
# hpservice.dtensor.random, docs/compat.md), uninitialised memory. Samples of other ops whose result
# changes with the seed are skipped too (check_sample reruns the plain op).
NOT_DETERMINISTIC = (
    "bernoulli", "cauchy", "dropout", "empty", "exponential", "geometric", "log_normal", "multinomial",
    "normal", "poisson", "rand", "uniform", "new_empty", "alpha_dropout", "feature_alpha_dropout", "rrelu",
    "multi_head_attention_forward",  # dropout inside (training=True samples)
)  # fmt: skip


def _deterministic(name: str) -> bool:
    base = name.removeprefix("nn.functional.").removeprefix("_refs.").split(".")[0]
    return not any(base == k or base.startswith(k + "_") or base.startswith(k) for k in NOT_DETERMINISTIC)


def ops(names: set[str] | None = None) -> list:
    """op_db's ops this sweep runs: every one with float32 samples on the CPU and a deterministic
    result, or only ``names``."""
    from torch.testing._internal.common_methods_invocations import op_db

    chosen = []
    for op in op_db:
        key = op_key(op)
        if names is not None and key not in names:
            continue
        if not _deterministic(op.name) or torch.float32 not in op.supported_dtypes("cpu"):
            continue
        chosen.append(op)
    return chosen


def op_key(op) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


class Engine:
    """One DTensor implementation: ours (``hpservice.dtensor``) or torch's."""

    def __init__(self, name: str):
        self.name = name
        if name == "hpservice":
            import hpservice.dtensor as api
        else:
            import torch.distributed.tensor as api
            from torch.distributed.device_mesh import init_device_mesh

            api.init_device_mesh = init_device_mesh
        self.api = api
        self.mesh = api.init_device_mesh("cpu", (dist.get_world_size(),))

    def distribute(self, x: torch.Tensor, placement: str, requires_grad: bool) -> torch.Tensor:
        api = self.api
        shard = placement == "Shard(0)" and x.ndim >= 1
        dt = api.distribute_tensor(x.detach(), self.mesh, [api.Shard(0) if shard else api.Replicate()])
        return dt.requires_grad_(requires_grad) if requires_grad else dt

    def is_dtensor(self, x) -> bool:
        return isinstance(x, self.api.DTensor)


def _floating(x) -> bool:
    return isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())


def _weights(outputs: list) -> list:
    """A fixed, non-uniform cotangent per floating output (a uniform one hides permutations)."""
    weights = []
    for o in outputs:
        if _floating(o) and o.requires_grad:
            n = o.numel()
            w = torch.linspace(0.5, 1.5, n, dtype=torch.float32).reshape(o.shape) if n else torch.zeros(o.shape)
            weights.append(w.to(o.dtype if o.is_complex() else torch.float32))
        else:
            weights.append(None)
    return weights


def _run(op, sample, convert, backward: bool):
    """(flat outputs, flat input grads) of ``op`` on ``sample`` with tensors passed through ``convert``."""
    leaves: list[torch.Tensor] = []

    def prepare(x):
        if isinstance(x, torch.Tensor):
            grad = backward and _floating(x) and x.dtype == torch.float32
            y = convert(x, grad)
            if grad:
                leaves.append(y)
            return y
        return x

    args = pytree.tree_map(prepare, (sample.input, sample.args, sample.kwargs))
    out = op(args[0], *args[1], **args[2])
    flat = pytree.tree_leaves(out)
    grads: list = []
    if backward and leaves:
        gathered = [o for o in flat]
        weights = _weights(gathered)
        terms = [
            (g.full_tensor() if hasattr(g, "full_tensor") else g).mul(w).real.sum()
            for g, w in zip(gathered, weights, strict=True)
            if w is not None
        ]
        if terms:
            grads = list(torch.autograd.grad(torch.stack(terms).sum(), leaves, allow_unused=True))
    return flat, grads


def _plain(x):
    full = getattr(x, "full_tensor", None)
    if full is not None:
        with torch.no_grad():
            return full()
    return x


def _same(expected, got) -> bool:
    if isinstance(expected, torch.Tensor) != isinstance(got, torch.Tensor):
        return False
    if not isinstance(expected, torch.Tensor):
        if isinstance(expected, float) and isinstance(got, float):
            return math.isclose(expected, got, rel_tol=1e-4, abs_tol=1e-5) or (math.isnan(expected) and math.isnan(got))
        return expected == got
    if expected.shape != got.shape or expected.dtype != got.dtype:
        return False
    try:
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5, equal_nan=True, check_device=False)
    except AssertionError:
        return False
    return True


# The engines' own refusals: an op or an operand mix they name and decline, never an internal error.
REFUSALS = (
    "hpservice.dtensor:",  # ours: "hpservice.dtensor: aten.<op> on DTensor placements [...]: <why>"
    "got mixed torch.Tensor and DTensor",  # torch's
    "does not have a sharding strategy registered",  # torch's
)


def _refusal(e: Exception) -> bool:
    return isinstance(e, NotImplementedError) or any(r in str(e) for r in REFUSALS)


class _SeededOps(TorchDispatchMode):
    """Records the aten ops tagged ``nondeterministic_seeded`` (the ones that draw random numbers)."""

    def __init__(self):
        super().__init__()
        self.called: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.called.append(str(func))
        return func(*args, **(kwargs or {}))


def plain_result(op, sample, backward: bool):
    """The truth for one sample: (outputs, input gradients) of the plain op, or a str saying why
    the sample is skipped (sparse operands, an op that raises, a result that depends on the seed)."""
    tensors = [x for x in pytree.tree_leaves((sample.input, sample.args, sample.kwargs)) if isinstance(x, torch.Tensor)]
    if any(x.layout != torch.strided for x in tensors):
        return "sparse operands: DTensors are strided"
    plain = lambda x, g: x.detach().clone().requires_grad_(g)  # noqa: E731
    try:
        _seed(0)
        with _SeededOps() as seeded:
            want_out, want_grads = _run(op, sample, plain, backward)
        # An op that draws random numbers, even one that reseeds inside (op_db wraps SDPA with
        # dropout in torch.manual_seed(42)): its values are each engine's RNG scheme, not the op's math.
        if seeded.called:
            return f"random: {seeded.called[0]} draws from the generator (DTensor random values: docs/compat.md)"
        reruns = []
        for seed in (1, 2, 3):  # a small dropout can keep the same elements under two seeds
            _seed(seed)
            reruns.append(_run(op, sample, plain, False)[0])
    except Exception:
        return "the plain op raises on this sample"
    for again in reruns:
        if len(again) != len(want_out) or not all(_same(w, a) for w, a in zip(want_out, again, strict=True)):
            return "random: the plain op's result depends on the seed"
    return want_out, want_grads


def check_sample(op, sample, engine: Engine, placement: str, backward: bool, want=None) -> tuple[str, str]:
    """(outcome, detail) of one sample on one engine and placement; ``want``: its ``plain_result``."""
    want = plain_result(op, sample, backward) if want is None else want
    if isinstance(want, str):
        return "skip", want
    want_out, want_grads = want
    _seed(0)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got_out, got_grads = _run(op, sample, lambda x, g: engine.distribute(x, placement, g), backward)
            got_out = [_plain(o) for o in got_out]
            got_grads = [_plain(g) for g in got_grads]
    except Exception as e:
        first = (str(e).splitlines() or [""])[0]
        return ("refuse" if _refusal(e) else "crash"), f"{type(e).__name__}: {first}"
    if len(got_out) != len(want_out) or not all(_same(w, g) for w, g in zip(want_out, got_out, strict=True)):
        return "silent", "forward differs from the plain op"
    if len(got_grads) != len(want_grads) or not all(
        (w is None and g is None) or (w is not None and g is not None and _same(w.detach(), g.detach()))
        for w, g in zip(want_grads, got_grads, strict=True)
    ):
        return "silent", "gradient differs from the plain op"
    return "agree", ""


def _seed(seed: int) -> None:
    """``torch.manual_seed`` for these CPU-only runs, without its device part: with CUDA, XPU or
    MTIA uninitialised, torch queues each of their seeds with a formatted stack trace, about 1 ms
    a call, and the sweep seeds ~26,000 times."""
    torch.default_generator.manual_seed(seed)


@contextlib.contextmanager
def _cheap_sample_tracking():
    """op_db's sample iterators without their debugging bookkeeping, which cost two thirds of the
    sweep's CPU: ``extract_test_fn`` walks ``inspect.stack()`` (reading every frame's source) to
    find a ``unittest.TestCase`` and finds none here, so it returns None either way; the reseed
    before each sample (``set_rng_seed``) keeps its seeds (torch's, Python's, numpy's) without
    torch's device part (``_seed``). The samples are the same ones."""
    from torch.testing._internal import common_utils
    from torch.testing._internal.opinfo import core

    def set_rng_seed(seed=None):
        seed = common_utils.SEED if seed is None else seed
        _seed(seed)
        random.seed(seed)
        if common_utils.TEST_NUMPY:
            common_utils.np.random.seed(seed)

    saved = common_utils.extract_test_fn, core.extract_test_fn, common_utils.set_rng_seed
    common_utils.extract_test_fn = core.extract_test_fn = lambda: None
    common_utils.set_rng_seed = set_rng_seed
    try:
        yield
    finally:
        common_utils.extract_test_fn, core.extract_test_fn, common_utils.set_rng_seed = saved


def sweep(engine_name: str, names: set[str] | None = None, samples_per_op: int = SAMPLES_PER_OP) -> dict:
    """On every rank of a gloo world: {op key: {placement: (outcome, detail)}} for one engine.
    Every rank runs the same ops in the same order (collectives inside the engines pair up)."""
    engine = Engine(engine_name)
    results: dict[str, dict[str, tuple[str, str]]] = {}
    with _cheap_sample_tracking():
        for op in ops(names):
            _sweep_op(op, engine, samples_per_op, results)
    return results


def _agreed(wants: list) -> list:
    """``wants`` with a sample skipped on every rank where any rank skips it. Each rank judges its
    plain results on its own (an op whose result depends on memory it did not write differs from
    rank to rank); a sample run by one rank and skipped by another would pair one rank's
    collectives with the next sample's of the other."""
    skipped = torch.tensor([isinstance(w, str) for w in wants], dtype=torch.uint8)
    if dist.is_initialized() and len(wants):
        dist.all_reduce(skipped, op=dist.ReduceOp.MAX)
    return [w if isinstance(w, str) or not s else "skipped on another rank" for w, s in zip(wants, skipped.tolist(), strict=True)]


def _sweep_op(op, engine: Engine, samples_per_op: int, results: dict) -> None:
    backward = op.supports_autograd
    try:  # the first samples only: op_db reseeds before each, so they do not depend on how many follow
        samples = list(itertools.islice(op.sample_inputs("cpu", torch.float32, requires_grad=False), samples_per_op))
    except Exception:
        return
    wants = _agreed([plain_result(op, sample, backward) for sample in samples])  # once for both placements
    per_placement = {}
    for placement in PLACEMENTS:
        worst = ("agree", "")
        ran = False
        for sample, want in zip(samples, wants, strict=True):
            outcome, detail = check_sample(op, sample, engine, placement, backward, want)
            if outcome == "skip":
                continue
            ran = True
            if _WORST[outcome] > _WORST[worst[0]]:
                worst = (outcome, detail)
        if ran:
            per_placement[placement] = worst
    if per_placement:
        key = op_key(op)
        n = 1
        while key in results:  # op_db holds a few entries twice under one name
            n += 1
            key = f"{op_key(op)}#{n}"
        results[key] = per_placement


def counts(results: dict) -> dict[str, Counter]:
    """Per placement: how many ops had each outcome."""
    table = {p: Counter() for p in PLACEMENTS}
    for per in results.values():
        for placement, (outcome, _) in per.items():
            table[placement][outcome] += 1
    return table


def per_op(results: dict) -> Counter:
    """torch's ``test_dtensor_ops`` count: an op's outcome is its worst over both placements (it
    agrees only when every sample agrees on each)."""
    worst = Counter()
    for per in results.values():
        worst[max((o for o, _ in per.values()), key=_WORST.__getitem__)] += 1
    return worst


def headline(results: dict) -> str:
    c = per_op(results)
    return f"{len(results)} ops: " + ", ".join(f"{o} {c[o]}" for o in OUTCOMES)


def table(ours: dict, theirs: dict) -> str:
    lines = ["| engine | placement | " + " | ".join(OUTCOMES) + " |", "|---|---|" + "---|" * len(OUTCOMES)]
    for name, results in (("hpservice", ours), ("torch", theirs)):
        for placement, c in counts(results).items():
            lines.append(f"| {name} | {placement} | " + " | ".join(str(c[o]) for o in OUTCOMES) + " |")
    return "\n".join(lines)


def _both(names, samples_per_op):
    return sweep("hpservice", names, samples_per_op), sweep("torch", names, samples_per_op)


# torch's side of the sweep, recorded by --write for the torch it ran with: torch's DTensor does
# not change until torch does, so CI runs only ours against it (and runs torch's again, live,
# under any other torch version).
TORCH_RECORD = Path(__file__).with_name("torch_dtensor_ops.json")


def record_torch(theirs: dict, world: int, samples_per_op: int) -> str:
    return json.dumps({"torch": torch.__version__, "world": world, "samples_per_op": samples_per_op, "results": theirs},
                      indent=0, sort_keys=True) + "\n"  # fmt: skip


def recorded_torch(world: int, samples_per_op: int) -> dict | None:
    """torch's results from ``TORCH_RECORD`` if they were recorded with this torch and these
    settings, else None (run them)."""
    if not TORCH_RECORD.is_file():
        return None
    data = json.loads(TORCH_RECORD.read_text())
    if (data["torch"], data["world"], data["samples_per_op"]) != (torch.__version__, world, samples_per_op):
        return None
    return {op: {p: tuple(r) for p, r in per.items()} for op, per in data["results"].items()}


def listed(results: dict, outcome: str) -> dict[tuple[str, str], str]:
    """{(op key, placement): detail} of one outcome."""
    return {(k, p): d for k, per in results.items() for p, (o, d) in per.items() if o == outcome}


def _reason(detail: str) -> str:
    return detail.split(": ", 1)[1].removeprefix("hpservice.dtensor: ").replace("|", "\\|")


# Ours on every sample of every op (``--ours-only --samples 1000 --save``: 15-25 minutes on 2
# cores, too long for CI, which runs the first SAMPLES_PER_OP): the count torch's own test makes.
FULL_RECORD = Path(__file__).with_name("ops_full_sweep.json")


def _full_sweep_lines(theirs: dict) -> list[str]:
    if not FULL_RECORD.is_file():
        return []
    data = json.loads(FULL_RECORD.read_text())
    ours = {op: {p: tuple(r) for p, r in per.items()} for op, per in data["results"].items()}
    crashes = sorted({k for (k, _), _ in listed(ours, "crash").items()})
    return [
        f"Counted as torch's `test_dtensor_ops.py` counts (an op agrees only when every sample of both placements "
        f"does), on every sample (`python -m tests.compat.op_sweep --ours-only --samples 1000 --save "
        f"tests/compat/ops_full_sweep.json`, torch {data['torch']}, {data['world']} ranks): hpservice "
        f"{headline(ours)}. torch's DTensor on the same count, as measured for issue 49: 488 of 624 agree. "
        f"The crash{'es' if len(crashes) != 1 else ''} ({', '.join(f'`{c}`' for c in crashes)}): a DTensor passed "
        "where torch's C++ reads a host tensor's values (`tensor_split`'s index tensor) fails before any dispatch, "
        "in torch's DTensor the same way.",
        "",
    ]


def document(ours: dict, theirs: dict, world: int, samples_per_op: int) -> str:
    """docs/dtensor-ops.md: the table, then every op ours refuses or crashes on, with the reason."""
    lines = [
        "# DTensor ops: what the OpInfo sweep finds",
        "",
        "Written by `python -m tests.compat.op_sweep --write docs/dtensor-ops.md`; "
        "`tests/compat/test_op_sweep.py` checks that it is current. Every op of torch's OpInfo "
        f"database with float32 CPU samples runs on {world} gloo ranks (the first {samples_per_op} samples, "
        "each tensor operand `Replicate()` or `Shard(0)`), forward and backward, through hpservice's "
        "DTensor and torch's, and is compared with the plain-tensor result (how: `tests/compat/op_sweep.py`).",
        "",
        table(ours, theirs),
        "",
        *_full_sweep_lines(theirs),
        "`silent` is a value, shape or dtype other than the plain op's: hpservice must have none. Where "
        "torch's DTensor is silent, torch is the one off the single-device math.",
        "",
        "## Ops hpservice refuses, and why",
        "",
        "An op without a rule for these placements raises `NotImplementedError` naming the op and the "
        "placements; fully replicated operands run locally. The list, one row per op and placement:",
        "",
        "| op | placement | reason |",
        "|---|---|---|",
    ]
    lines += [f"| `{k}` | {p} | {_reason(d)} |" for (k, p), d in sorted(listed(ours, "refuse").items())]
    lines += ["", "## Ops hpservice crashes on (an error that is not a clear refusal)", ""]
    crashes = sorted(listed(ours, "crash").items())
    lines += ["| op | placement | error |", "|---|---|---|"] + [
        f"| `{k}` | {p} | {d.replace('|', '/')} |" for (k, p), d in crashes
    ]
    lines += ["", "## Where torch's DTensor is silently off the plain op", ""]
    lines += [f"- `{k}` on {p}: {d}" for (k, p), d in sorted(listed(theirs, "silent").items())]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    import argparse
    from pathlib import Path

    from hpservice.launch import RankPool

    def run_ranks(fn, world, *args, timeout):
        # a long process-group timeout: one rank's slow sample (a loaded machine) must not fail the
        # other's next collective
        with RankPool(world, pg_timeout_s=900) as pool:
            return pool.run(fn, *args, timeout=timeout)

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--ops", default=None, help="comma-separated op keys (default: all)")
    parser.add_argument("--samples", type=int, default=SAMPLES_PER_OP)
    parser.add_argument("--show", default="silent,crash", help="outcomes to list per op")
    parser.add_argument("--write", type=Path, default=None, help="write the document (docs/dtensor-ops.md)")
    parser.add_argument("--ours-only", action="store_true", help="hpservice's engine only (half the time)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds for the whole sweep")
    parser.add_argument("--save", type=Path, default=None, help="write ours' results as JSON (with --ours-only)")
    parser.add_argument("--rerun-torch", action="store_true", help="with --write: run torch's engine again, not its record")
    a = parser.parse_args()
    names = set(a.ops.split(",")) if a.ops else None
    recorded = None if a.rerun_torch or names else recorded_torch(a.ranks, a.samples)
    if a.write and recorded is not None:
        # torch's DTensor changes only with torch: its record for this version stands (rerunning it
        # can leave a rank waiting for good where torch's engine fails on one rank only)
        ours = run_ranks(functools.partial(sweep, "hpservice"), a.ranks, names, a.samples, timeout=a.timeout)[0]
        theirs = {k: v for k, v in recorded.items() if k in ours}  # ops now skipped whole (random) drop out
        engines = (("hpservice", ours), ("torch", theirs))
        print(table(ours, theirs))
    elif a.ours_only:
        if a.write:
            parser.error("--write needs both engines")
        ours = run_ranks(functools.partial(sweep, "hpservice"), a.ranks, names, a.samples, timeout=a.timeout)[0]
        engines = (("hpservice", ours),)
        for placement in PLACEMENTS:
            counts = Counter(per[placement][0] for per in ours.values() if placement in per)
            print(f"hpservice {placement:9s} " + " ".join(f"{o} {counts.get(o, 0)}" for o in OUTCOMES))
        print(f"hpservice per op (both placements): {headline(ours)}")
        if a.save:
            a.save.write_text(json.dumps({"torch": torch.__version__, "world": a.ranks, "samples_per_op": a.samples,
                                          "results": ours}, indent=0, sort_keys=True) + "\n")  # fmt: skip
    else:
        ours, theirs = run_ranks(_both, a.ranks, names, a.samples, timeout=a.timeout)[0]
        engines = (("hpservice", ours), ("torch", theirs))
        print(table(ours, theirs))
    show = set(a.show.split(","))
    for name, results in engines:
        for key, per in sorted(results.items()):
            for placement, (outcome, detail) in per.items():
                if outcome in show:
                    print(f"{name:9s} {outcome:6s} {key:40s} {placement:9s} {detail}")
    if a.write:
        a.write.write_text(document(ours, theirs, a.ranks, a.samples))
        if recorded is None:
            TORCH_RECORD.write_text(record_torch(theirs, a.ranks, a.samples))
