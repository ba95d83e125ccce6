"""``python -m hpservice.bench ARGS`` run in the test process.

A benchmark's own interpreter imports torch, the trainer and every benchmark, then its ranks'
forkserver imports them again: about 7 CPU seconds before the first rank starts. In the test
process its ranks fork from the session's forkserver, which has them already. The benchmarks
that start Ray, torchrun or set what glibc reads at process start (service, overhead, ac) stay
in a process of their own, which also keeps ``python -m hpservice.bench`` itself tested.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess

import torch


def bench(*args: str) -> subprocess.CompletedProcess:
    """Run the benchmark with ``args`` (``--json`` included by the caller) and return its exit
    status and output as ``subprocess.run`` would. What a benchmark may change in the calling
    process is put back: the environment, torch's RNG state and thread count."""
    from hpservice.bench.__main__ import main

    env, rng, threads = dict(os.environ), torch.get_rng_state(), torch.get_num_threads()
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as e:  # argparse's errors and --help
                code = e.code if isinstance(e.code, int) else 1
    finally:
        os.environ.clear()
        os.environ.update(env)
        torch.set_rng_state(rng)
        torch.set_num_threads(threads)
    return subprocess.CompletedProcess(
        ["python", "-m", "hpservice.bench", *args], code or 0, out.getvalue(), err.getvalue()
    )
