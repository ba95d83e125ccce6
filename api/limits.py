"""Bounds on what one client can hold open: a request's headers, its body, its event streams.

uvicorn drops a keep-alive connection that stays idle between requests, but a connection that
sends half a request line, or headers a byte at a time, is never dropped, and neither is a body
that trickles in: each holds a socket (and a task) until the process runs out. So:

- ``BoundedH11Protocol``: uvicorn's h11 protocol with a deadline on a request's head. From the
  moment a connection is made, or its previous response ends, the request line and headers must
  arrive within ``HEADER_TIMEOUT_S``, or the connection is closed (no response: there is no
  request to answer).
- ``read_body_within``: a route's body read with a deadline (``BODY_TIMEOUT_S``), 408 past it.
- ``StreamSlots``: at most ``Settings.max_streams_per_owner`` open event streams per owner
  (429 beyond), so one tenant cannot hold every connection and thread of the server.
- ``Exports``: one export per output directory at a time (a second request waits for the
  first's result), at most ``Bounds.exports_per_owner`` per owner (429 beyond).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
from collections import Counter
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .errors import APIError

__all__ = ["BODY_TIMEOUT_S", "HEADER_TIMEOUT_S", "BoundedH11Protocol", "Exports", "StreamSlots", "read_body_within"]

HEADER_TIMEOUT_S = 10.0  # a request line and headers: a few hundred bytes, over any link that can train
BODY_TIMEOUT_S = 30.0  # a job spec body, at most MAX_BODY (1 MiB)


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request head is not complete within
    ``HEADER_TIMEOUT_S`` (see the module docstring)."""

    header_timeout_s = HEADER_TIMEOUT_S

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self._head_deadline: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._watch_head()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch_head()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_deadline()
        super().connection_lost(exc)

    def _watch_head(self) -> None:
        """Arm the deadline while the peer owes us a request head; disarm it once it came."""
        waiting = self.conn.their_state is h11.IDLE and not self.transport.is_closing()
        if waiting and self._head_deadline is None:
            self._head_deadline = self.loop.call_later(self.header_timeout_s, self._head_timed_out)
        elif not waiting:
            self._cancel_head_deadline()

    def _cancel_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_timed_out(self) -> None:
        self._head_deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


async def read_body_within(chunks: AsyncIterator[bytes], limit: int, timeout_s: float | None = None) -> bytes:
    """The body from ``chunks``, refused past ``limit`` bytes (413) or ``timeout_s`` seconds (408;
    default ``BODY_TIMEOUT_S``)."""
    timeout_s = BODY_TIMEOUT_S if timeout_s is None else timeout_s
    parts, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in chunks:
                size += len(chunk)
                if size > limit:
                    raise APIError(413, f"job spec larger than {limit} bytes")
                parts.append(chunk)
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout_s:g} s") from None
    return b"".join(parts)


class StreamSlots:
    """Open event streams per owner, at most ``per_owner`` each."""

    def __init__(self, per_owner: int):
        self.per_owner = per_owner
        self._open: Counter[str] = Counter()
        self._lock = threading.Lock()  # taken in the thread pool (dependencies) and on the loop

    def take(self, owner: str) -> Callable[[], None]:
        """A slot of ``owner``'s, or 429; returns the function that gives it back (once, however
        often it is called)."""
        with self._lock:
            if self._open[owner] >= self.per_owner:
                raise APIError(
                    429, f"owner {owner} has {self._open[owner]} event streams open, the most this server allows; "
                    "close one first"
                )  # fmt: skip
            self._open[owner] += 1
        given = threading.Event()

        def give_back() -> None:
            with self._lock:
                if given.is_set():
                    return
                given.set()
                self._open[owner] -= 1
                if self._open[owner] <= 0:
                    del self._open[owner]

        return give_back

    def open_for(self, owner: str) -> int:
        with self._lock:
            return self._open[owner]


class Exports:
    """Exports in flight: one per output directory (a second request for it waits for the first's
    result: one checkpoint is never written twice at once), at most ``per_owner`` per owner, each
    waited on by a thread off the event loop while its work runs in an export worker process
    (``in_worker_process``): a checkpoint's tensors never load into the web process, and an export
    that dies (out of memory) takes only its worker with it."""

    def __init__(self, per_owner: int, processes: int = 2):
        self.per_owner = per_owner
        self._running: dict[str, asyncio.Future] = {}
        self._owners: dict[str, int] = {}
        self._processes = processes
        self._pool: ProcessPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    def in_worker_process(self, fn, *args):
        """``fn(*args)`` in an export worker process (spawned on first use, kept for the next
        exports); blocks the calling thread. Its exception is raised here; a worker that died
        raises ``BrokenProcessPool`` and the next call starts new workers."""
        with self._pool_lock:
            if self._pool is None:
                self._pool = ProcessPoolExecutor(self._processes, mp_context=multiprocessing.get_context("spawn"))
            pool = self._pool
        try:
            return pool.submit(fn, *args).result()
        except BrokenProcessPool:
            with self._pool_lock:
                if self._pool is pool:
                    self._pool = None
            pool.shutdown(wait=False)
            raise

    def shutdown(self) -> None:
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    async def run(self, owner: str, key: str, fn) -> dict:
        running = self._running.get(key)
        if running is not None:  # the same export: its result (or its error)
            return await asyncio.shield(running)
        if self._owners.get(owner, 0) >= self.per_owner:
            raise APIError(429, f"owner {owner} has {self._owners[owner]} exports running, the most this server runs "
                           "at once for one owner (--exports-per-owner); wait for one to finish")  # fmt: skip
        self._owners[owner] = self._owners.get(owner, 0) + 1
        future = asyncio.ensure_future(asyncio.to_thread(fn))
        self._running[key] = future

        def done(_):
            self._running.pop(key, None)
            self._owners[owner] -= 1
            if not self._owners[owner]:
                del self._owners[owner]

        future.add_done_callback(done)
        return await asyncio.shield(future)
