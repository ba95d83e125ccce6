"""Where a job spec's validation runs: its own threads, a few per owner, each within a deadline.

Validating a spec costs what its tenant chooses: it reads the files the spec names (a model's
config.json, after admission) and computes on the sizes in it. Run on the threads every request
shares (``asyncio.to_thread``'s pool, FastAPI's), a few costly or stuck validations would leave
another owner's submit, and ``/healthz``, without a thread. So validation has a pool of its own:

- at most ``per_owner`` validations of one owner run at once; more wait for a slot (without a
  thread) up to the deadline, and past ``queued_per_owner`` waiting ones are refused with 429 at
  once (a slot is held until the validation's thread really ends, so abandoned work still counts);
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
    def __init__(self, threads: int = 8, per_owner: int = 2, timeout_s: float = 30.0, queued_per_owner: int = 64):
        self.threads, self.per_owner, self.timeout_s = threads, per_owner, timeout_s
        self.queued_per_owner = queued_per_owner
        self._pool: ThreadPoolExecutor | None = None
        self._running: Counter[str] = Counter()
        self._waiting: Counter[str] = Counter()
        self._lock = threading.Lock()

    async def run(self, owner: str, fn: Callable[..., T], *args) -> T:
        """``fn(*args)`` on the pool for ``owner``: its result, its exception, 429 past the
        owner's waiting room, or 422 past the deadline (waiting for a slot included)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        await self._take_slot(owner, deadline)
        try:
            future = self._executor().submit(fn, *args)
        except BaseException:
            self._release(owner)
            raise
        future.add_done_callback(lambda _: self._release(owner))
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), max(0.0, deadline - loop.time()))
        except TimeoutError:
            raise self._too_long() from None

    async def _take_slot(self, owner: str, deadline: float) -> None:
        """Wait (polling, no thread held) until ``owner`` has fewer than ``per_owner`` running."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._running[owner] < self.per_owner:
                self._running[owner] += 1
                return
            if self._waiting[owner] >= self.queued_per_owner:
                raise APIError(
                    429, f"owner {owner} has {self._running[owner] + self._waiting[owner]} job specs being validated or "
                    "waiting for it, the most this server holds for one owner; wait for their answers"
                )  # fmt: skip
            self._waiting[owner] += 1
        try:
            while True:
                await asyncio.sleep(0.02)
                with self._lock:
                    if self._running[owner] < self.per_owner:
                        self._running[owner] += 1
                        return
                if loop.time() >= deadline:
                    raise self._too_long()
        finally:
            with self._lock:
                self._waiting[owner] -= 1
                if self._waiting[owner] <= 0:
                    del self._waiting[owner]

    def _too_long(self) -> APIError:
        return APIError(
            422, f"job spec: validating it took longer than {self.timeout_s:g} s, the most this server spends on one "
            "(--validation-timeout); check the sizes and files it names"
        )  # fmt: skip

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:  # first use, or after a shutdown (an app served again)
                self._pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="hpservice-validate")
            return self._pool

    def running(self, owner: str) -> int:
        with self._lock:
            return self._running[owner]

    def _release(self, owner: str) -> None:
        with self._lock:
            self._running[owner] -= 1
            if self._running[owner] <= 0:
                del self._running[owner]

    def shutdown(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
