"""What a job's coordinator keeps for its clients: the metric records rank 0 reports and every
rank's log lines, each in a bounded buffer with the cursor a follower resumes from.

Both are written by worker calls and read by client calls on other threads of the (threaded)
coordinator actor, so each holds its own lock.
"""

from __future__ import annotations

import threading
import time
from collections import deque

__all__ = ["LOG_LINES_PER_RANK", "METRICS_BUFFER", "LogBuffer", "MetricsBuffer"]

METRICS_BUFFER = 100_000  # records kept for clients that poll late; older ones are dropped and counted
LOG_LINES_PER_RANK = 10_000


class MetricsBuffer:
    """Metric records in arrival order. Reports run on several threads, so steps may arrive out
    of order: a follower's cursor is the arrival number, not the step."""

    def __init__(self, capacity: int = METRICS_BUFFER):
        self._lock = threading.Lock()
        self._records: deque[tuple[int, dict]] = deque(maxlen=capacity)  # (arrival number, record)
        self._arrivals = 0
        self.dropped = 0  # records pushed out by newer ones before a client read them

    def add(self, record: dict) -> None:
        with self._lock:
            if len(self._records) == self._records.maxlen:
                self.dropped += 1
            self._arrivals += 1
            self._records.append((self._arrivals, record))

    def since(self, since_step: int = 0, after: int = 0) -> tuple[list[dict], int]:
        """Every buffered record with step > ``since_step`` that arrived after the ``after``-th,
        in step order, and the cursor to ask with next (the ``after`` that returns only newer
        arrivals)."""
        with self._lock:
            records = [r for n, r in self._records if n > after and r["step"] > since_step]
            cursor = self._arrivals
        return sorted(records, key=lambda r: r["step"]), cursor


class LogBuffer:
    """Log lines per rank, the last ``per_rank`` of each, numbered by one sequence over all ranks
    and attempts (``seq``: the cursor clients resume from; it continues from ``start_seq`` when a
    coordinator replaces a lost one) and by a per-rank offset."""

    def __init__(self, start_seq: int = 0, per_rank: int = LOG_LINES_PER_RANK):
        self._lock = threading.Lock()
        self._lines: dict[int, deque] = {}
        self._offset: dict[int, int] = {}
        self._per_rank = per_rank
        self._seq = start_seq

    def add(self, rank: int, step: int, line: str) -> None:
        with self._lock:
            buf = self._lines.setdefault(rank, deque(maxlen=self._per_rank))
            offset = self._offset.get(rank, 0)
            self._seq += 1
            buf.append(
                {"seq": self._seq, "offset": offset, "rank": rank, "step": step, "time": time.time(), "line": line}
            )
            self._offset[rank] = offset + 1

    def lines(self, rank: int | None = None, tail: int | None = None, since: int = 0, since_seq: int = 0) -> list[dict]:
        """Lines of one rank (or all), from per-rank offset ``since`` and after sequence number
        ``since_seq``, the last ``tail`` of them, in sequence order."""
        with self._lock:
            ranks = [rank] if rank is not None else sorted(self._lines)
            found = [
                entry
                for r in ranks
                for entry in self._lines.get(r, ())
                if entry["offset"] >= since and entry["seq"] > since_seq
            ]
        found.sort(key=lambda e: e["seq"])
        return found[-tail:] if tail else found
