"""What each test costs the machine: CPU seconds of every process (from /proc/stat), not only
pytest's own, since Ray heads, raylets, servers and rank pools run outside pytest's process tree
(``--durations`` counts wall time only, and ``time pytest`` misses the daemons).

At the end of a run, the 20 tests that used the most CPU, and how busy the machine was over the
session: the suite's time can only fall below (CPU seconds used) / (cores) by spending fewer. Linux
only (elsewhere this records nothing); meaningful when tests run one at a time, as scripts/test
runs them. With ``HPSERVICE_TEST_COSTS=path``, every test's line is also written there (CPU
seconds, wall seconds, node id; tab-separated), to see where a whole run goes.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

_STAT = Path("/proc/stat")
_costs: list[tuple[float, float, str]] = []
_session: list[float] = []


def _busy_seconds() -> float | None:
    """CPU seconds the whole machine spent busy since boot (all cores, every process)."""
    try:
        fields = [int(v) for v in _STAT.read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def pytest_sessionstart(session):
    busy = _busy_seconds()
    if busy is not None:
        _session[:] = [busy, time.monotonic()]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    before, start = _busy_seconds(), time.monotonic()
    yield
    after = _busy_seconds()
    if before is not None and after is not None:
        _costs.append((after - before, time.monotonic() - start, item.nodeid))


def pytest_terminal_summary(terminalreporter):
    if not _costs or not _session:
        return
    busy, wall = _busy_seconds() - _session[0], time.monotonic() - _session[1]
    cores = os.cpu_count() or 1
    write = terminalreporter.write_line
    terminalreporter.section("CPU cost (every process on the machine, tests/_cpu_cost.py)")
    write(f"session: {busy:.0f} CPU s in {wall:.0f} s on {cores} cores ({busy / max(wall, 1e-9) / cores:.0%} busy)")
    for cpu, seconds, nodeid in sorted(_costs, reverse=True)[:20]:
        write(f"{cpu:7.1f} CPU s {seconds:7.1f} s  {nodeid}")
    record = os.environ.get("HPSERVICE_TEST_COSTS")
    if record:
        lines = (f"{cpu:.2f}\t{seconds:.2f}\t{nodeid}\n" for cpu, seconds, nodeid in _costs)
        Path(record).write_text("".join(lines))
        write(f"every test's cost: {record}")
