"""Run a function on N local ranks (gloo on CPU by default) on free loopback ports.

Two ways, same failure model:

- ``run_ranks(fn, world_size, *args)`` spawns fresh processes for one call (demo, benchmarks).
- ``RankPool(world_size)`` keeps the ranks alive and runs many calls on them (the test suite:
  starting 8 Python processes that import torch costs seconds of CPU, so it is paid once).

Ranks are forked from a forkserver that has imported torch and the trainer once (where the
platform has one; else spawned): importing torch costs each fresh Python process about 3 CPU
seconds, which a benchmark or demo that starts several ranks, several times, would pay for each.
A forked rank takes this process's environment and working directory as they are at the call,
as a spawned one would (the forkserver's own are those of its start).

A call returns the per-rank results in rank order. If any rank raises, the call raises
``RankFailure`` with that rank's traceback; if the call does not finish within ``timeout``
seconds (e.g. a rank stuck in a collective), the ranks' Python stacks are dumped to stderr, the
processes are killed and ``RankFailure`` is raised. Nothing can hang the caller.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import multiprocessing as mp
import os
import queue
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

__all__ = ["RankFailure", "RankPool", "free_port", "run_ranks"]

_GRACE_S = 10.0  # after one rank fails, how long the others get to finish (or fail) too
# imported once by the forkserver, before it forks ranks ("__main__": a script's own rank functions)
_PRELOAD = ["__main__", "torch", "torch.distributed", "hpservice.train"]


def _rank_context():
    """The multiprocessing context ranks start in: forkserver (preloaded) where there is one."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # no effect once this process's forkserver runs
    return ctx


class RankFailure(RuntimeError):
    """One or more ranks raised or timed out; the message carries their tracebacks."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free now on ``host`` (loopback by default; ``""``: every interface, for a
    rendezvous other nodes connect to)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def socket_interface(ip: str) -> str | None:
    """The name of this machine's network interface that has address ``ip`` (``lo`` for
    127.0.0.1), or None (no such interface, or not Linux).

    gloo binds to whatever this machine's hostname resolves to unless ``GLOO_SOCKET_IFNAME``
    names an interface; where the hostname resolves to loopback, ranks on other nodes then
    cannot reach it. The interface of the node's own address (the one its peers reach) fixes
    that."""
    try:
        import fcntl
        import struct
    except ImportError:  # not a POSIX system
        return None
    siocgifaddr = 0x8915  # Linux: an interface's IPv4 address
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
            except OSError:  # an interface without an IPv4 address
                continue
            if socket.inet_ntoa(packed[20:24]) == ip:
                return name
    return None


def _worker(
    rank: int, world_size: int, port: int, backend: str, tasks, results, pg_timeout_s: float, env: dict, cwd: str
) -> None:
    os.environ.clear()  # the caller's, not the forkserver's (see module doc)
    os.environ.update(env)
    with contextlib.suppress(OSError):
        os.chdir(cwd)
    import torch
    import torch.distributed as dist

    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank)
    )
    try:
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout_s))
    except BaseException:
        results.put((None, rank, False, traceback.format_exc()))
        return
    # What is alive now (torch, the trainer, the process group) lives as long as the rank: kept
    # out of the collector's generations, the collection after each call (below) walks only what
    # calls made, ~0.1 ms instead of ~100 ms of CPU per rank per call. The same after each call
    # (_destroy_groups_since): what survives it is mostly modules it imported (dynamo, Inductor,
    # transformers: ~250,000 objects), which every later collection would walk again.
    gc.freeze()
    results.put((None, rank, True, "ready"))
    while True:
        task = tasks.get()
        if task is None:
            return  # the process exits; its gloo connections close with it
        call_id, fn, args, kwargs = task
        groups = _process_groups()
        try:
            results.put((call_id, rank, True, fn(*args, **kwargs)))
        except BaseException:
            results.put((call_id, rank, False, traceback.format_exc()))
        _wait_for_every_rank(call_id, world_size)
        _destroy_groups_since(groups)


_END_OF_CALL_WAIT_S = 60.0


def _wait_for_every_rank(call_id: int, world_size: int) -> None:
    """Return once every rank has ended call ``call_id`` (or after ``_END_OF_CALL_WAIT_S``).

    A rank returns from ``new_group`` when its own side of each connection is up; a peer still
    finishing its side (slow on a loaded machine) then reads "Connection closed by peer" if the
    first rank destroys the group meanwhile, which a call that makes groups and never uses them
    does at once. Through the store rather than a collective: a call that failed on some ranks may
    have left the world group's collectives out of step. A rank that never comes (hung, dead)
    fails the call by the caller's timeout; the others go on after the wait."""
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    key = f"hpservice/rank-pool/call-{call_id}"
    with contextlib.suppress(Exception):  # a timeout, or the store gone with rank 0: destroy anyway
        if store.add(key, 1) == world_size:
            store.set(f"{key}/all", "1")
        store.wait([f"{key}/all"], timedelta(seconds=_END_OF_CALL_WAIT_S))


def _process_groups() -> set:
    """The process groups this process has now (torch keeps them until destroyed)."""
    from torch.distributed import distributed_c10d

    return set(distributed_c10d._world.pg_map)


def _destroy_groups_since(before: set) -> None:
    """Destroy the groups a call created (a trainer's meshes, its checkpoint group): a rank lives
    on for the next call, and each gloo group keeps its own polling threads, which would pile up
    over a test session (hundreds of threads per rank, a whole core's worth of wakeups). Every
    rank returns from the call after its last collective, so no peer still uses them."""
    import torch.distributed as dist

    from hpservice.dtensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()  # its decisions hold the call's meshes, and so their groups
    _clear_torch_dtensor_caches()  # the same, for calls that ran torch's DTensor (the compat checks)
    for group in _process_groups() - before:
        if group is not dist.GroupMember.WORLD:
            with contextlib.suppress(Exception):  # one the call already destroyed or broke: nothing to free
                dist.destroy_process_group(group)
    gc.collect()  # the groups' threads end when the last reference (a mesh in a reference cycle) goes
    # Survivors out of later collections (see _worker). A frozen object is still freed when its
    # count drops to zero; only a reference cycle of them would stay, and the call's meshes and
    # groups are gone by now.
    gc.freeze()


def _clear_torch_dtensor_caches() -> None:
    """torch's DTensor caches sharding decisions, redistribution plans and mesh topologies keyed
    by specs, and so holds the meshes (and groups) of every call that used it. Private torch
    functions: each is cleared where this torch has it."""
    if "torch.distributed.tensor" not in sys.modules:
        return
    from torch.distributed.tensor import _collective_utils, _redistribute, debug

    with contextlib.suppress(AttributeError, RuntimeError):
        debug._clear_sharding_prop_cache()
    with contextlib.suppress(AttributeError):
        _redistribute.clear_redistribute_planner_cache()
    for cached in (
        getattr(_redistribute, "_gen_transform_infos", None),
        getattr(getattr(_collective_utils, "MeshTopoInfo", None), "build_from_mesh", None),
    ):
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()


class RankPool:
    """``world_size`` long-lived ranks in one gloo (or ``backend``) world; see module doc."""

    def __init__(
        self, world_size: int, *, backend: str = "gloo", pg_timeout_s: float = 60.0, startup_timeout_s: float = 180.0
    ):
        self.world_size = world_size
        self.backend = backend
        self._pg_timeout_s = pg_timeout_s
        self._startup_timeout_s = startup_timeout_s
        self._ctx = _rank_context()
        self._procs: list = []
        self._calls = 0

    def _start(self) -> None:
        port = free_port()
        self._results = self._ctx.Queue()
        self._tasks = [self._ctx.Queue() for _ in range(self.world_size)]
        env, cwd = dict(os.environ), os.getcwd()  # the caller's, as a spawned rank would have them
        self._procs = [
            self._ctx.Process(
                target=_worker,
                args=(
                    r,
                    self.world_size,
                    port,
                    self.backend,
                    self._tasks[r],
                    self._results,
                    self._pg_timeout_s,
                    env,
                    cwd,
                ),
                daemon=True,
            )
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()
        # Wait until every rank has joined the process group, so call timeouts cover calls only.
        ready, errors = set(), {}
        deadline = time.monotonic() + self._startup_timeout_s
        while len(ready) + len(errors) < self.world_size and time.monotonic() < deadline:
            try:
                _, rank, ok, value = self._results.get(timeout=1.0)
            except queue.Empty:
                if not all(p.is_alive() for p in self._procs):
                    break
                continue
            if ok:
                ready.add(rank)
            else:
                errors[rank] = value
        if len(ready) < self.world_size:
            self.close()
            detail = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            raise RankFailure(f"{self.world_size} ranks failed to start ({len(ready)} ready):\n{detail}")

    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def run(self, fn: Callable, *args, timeout: float = 120.0, **kwargs) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return results in rank order."""
        if not self.alive():
            self.close()
            self._start()
        self._calls += 1
        call_id = self._calls
        for q in self._tasks:
            q.put((call_id, fn, args, kwargs))
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(results) + len(errors) < self.world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                cid, rank, ok, value = self._results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                if not all(p.is_alive() for p in self._procs):
                    dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in results]
                    for r in dead:
                        errors.setdefault(r, f"rank {r} process died (exit code {self._procs[r].exitcode})")
                    deadline = min(deadline, time.monotonic() + _GRACE_S)
                continue
            if cid == call_id:
                if ok:
                    results[rank] = value
                else:
                    errors[rank] = value
                    deadline = min(deadline, time.monotonic() + _GRACE_S)
        if len(results) == self.world_size:
            return [results[r] for r in range(self.world_size)]
        missing = [r for r in range(self.world_size) if r not in results and r not in errors]
        if missing:
            self._dump_stacks(missing)
        self.close()  # ranks may be stuck in a collective: start over next time
        parts = [f"--- rank {r} raised ---\n{tb}" for r, tb in sorted(errors.items())]
        if missing:
            parts.append(f"--- ranks {missing} did not finish within {timeout:.0f}s (stacks dumped to stderr) ---")
        raise RankFailure(f"{getattr(fn, '__name__', fn)} failed on {self.world_size} ranks:\n" + "\n".join(parts))

    def _dump_stacks(self, ranks: list[int]) -> None:
        for r in ranks:
            p = self._procs[r]
            if p.is_alive() and p.pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGUSR1)
        time.sleep(0.5)

    def close(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=5)
        self._procs = []

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc) -> None:
        if self.alive():
            for q in self._tasks:
                q.put(None)
            deadline = time.monotonic() + 3.0
            for p in self._procs:
                p.join(timeout=max(0.0, deadline - time.monotonic()))
        self.close()


def run_ranks(
    fn: Callable, world_size: int, *args, timeout: float = 300.0, backend: str = "gloo", **kwargs
) -> list[Any]:
    """Spawn ``world_size`` fresh ranks, run ``fn`` once on each, tear them down."""
    with RankPool(world_size, backend=backend) as pool:
        return pool.run(fn, *args, timeout=timeout, **kwargs)
