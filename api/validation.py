"""Where a job spec's validation runs: its own threads, a few per owner, each within a deadline.

Validating a spec costs what its tenant chooses: it reads the files the spec names (a model's
config.json, after admission) and computes on the sizes in it. Run on the threads every request
shares (``asyncio.to_thread``'s pool, FastAPI's), a few costly or stuck validations would leave
another owner's submit, and ``/healthz``, without a thread. So validation has a pool of its own:

- at most ``per_owner`` validations of one owner run at once; more are refused with 429 at once
  (the slot is held until the validation's thread really ends, so abandoned work still counts);
- a validation that has not ended within ``timeout_s`` is answered with 422 naming the bound
  (its thread finishes in the background; every read it does is bounded, see ``hpservice.inputs``);
- the pool has ``threads`` threads, more than one owner may use, so one owner never fills it.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from .errors import APIError

__all__ = ["ValidationPool"]

T = TypeVar("T")


class ValidationPool:
    def __init__(self, threads: int = 8, per_owner: int = 2, timeout_s: float = 30.0):
        self.per_owner, self.timeout_s = per_owner, timeout_s
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="hpservice-validate")
        self._running: Counter[str] = Counter()
        self._lock = threading.Lock()

    async def run(self, owner: str, fn: Callable[..., T], *args) -> T:
        """``fn(*args)`` on the pool for ``owner``: its result, its exception, 429 past the
        owner's slots, or 422 past the deadline."""
        with self._lock:
            if self._running[owner] >= self.per_owner:
                raise APIError(
                    429, f"owner {owner} has {self._running[owner]} job specs being validated, the most this server "
                    "runs at once for one owner; wait for their answers"
                )  # fmt: skip
            self._running[owner] += 1
        try:
            future = self._pool.submit(fn, *args)
        except BaseException:
            self._release(owner)
            raise
        future.add_done_callback(lambda _: self._release(owner))
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), self.timeout_s)
        except TimeoutError:
            raise APIError(
                422, f"job spec: validating it took longer than {self.timeout_s:g} s, the most this server spends on one "
                "(--validation-timeout); check the sizes and files it names"
            ) from None  # fmt: skip

    def running(self, owner: str) -> int:
        with self._lock:
            return self._running[owner]

    def _release(self, owner: str) -> None:
        with self._lock:
            self._running[owner] -= 1
            if self._running[owner] <= 0:
                del self._running[owner]

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
