"""What each test costs the machine: CPU seconds of the test process and of every process it
started, not only pytest's own, since Ray heads, raylets, servers and rank pools run in processes
of their own (``--durations`` counts wall time only, and ``time pytest`` misses the daemons).

A test's CPU is that of the pytest process's tree (``/proc``): each live descendant's CPU, plus
what the ones that ended and were waited for left in their parents' counts. With several
pytest-xdist workers each worker counts its own tree, so a test is not charged for what the other
worker ran meanwhile; the workers hand their lines to the controller, which prints them. It is a
lower bound: a process whose parent ends before waiting for it (the Ray workers of a raylet a
test kills) takes its CPU out of the tree. The session line, machine-wide, misses nothing.

At the end, the 20 tests that used the most CPU, and how busy the machine was over the session:
the suite's time can only fall below (CPU seconds used) / (cores) by spending fewer. Linux only
(elsewhere this records nothing). With ``HPSERVICE_TEST_COSTS=path``, every test's line is also
written there (CPU seconds, wall seconds, node id; tab-separated), to see where a whole run goes.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

_STAT = Path("/proc/stat")
_PROC = Path("/proc")
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_costs: list[tuple[float, float, str]] = []
_session: list[float] = []
_WORKER_OUTPUT_KEY = "hpservice_test_costs"


def _busy_seconds() -> float | None:
    """CPU seconds the whole machine spent busy since boot (all cores, every process)."""
    try:
        fields = [int(v) for v in _STAT.read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / _TICK


def _tree_seconds(root: int) -> float | None:
    """CPU seconds of ``root`` and its live descendants, each with what its waited-for children
    used (utime + stime + cutime + cstime). A descendant that ended without being waited for by
    one of them (an orphan) is missed, and one that ends between two readings moves its seconds
    from its own line to its parent's: the totals stay right."""
    stats: dict[int, tuple[int, float]] = {}
    try:
        entries = [p for p in os.listdir(_PROC) if p.isdigit()]
    except OSError:
        return None
    for pid in entries:
        try:
            text = (_PROC / pid / "stat").read_text()
        except OSError:  # ended meanwhile
            continue
        fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) ": state, ppid, ...
        ppid = int(fields[1])
        stats[int(pid)] = (ppid, sum(int(v) for v in fields[11:15]) / _TICK)
    if root not in stats:
        return None
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        total += stats[pid][1]
        todo.extend(children.get(pid, ()))
    return total


def pytest_sessionstart(session):
    busy = _busy_seconds()
    if busy is not None:
        _session[:] = [busy, time.monotonic()]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    before, start = _tree_seconds(os.getpid()), time.monotonic()
    yield
    after = _tree_seconds(os.getpid())
    if before is not None and after is not None:
        _costs.append((max(after - before, 0.0), time.monotonic() - start, item.nodeid))


def pytest_sessionfinish(session):
    output = getattr(session.config, "workeroutput", None)  # set on a pytest-xdist worker
    if output is not None:
        output[_WORKER_OUTPUT_KEY] = [list(cost) for cost in _costs]


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """On the xdist controller: a worker's lines, when it ends."""
    _costs.extend(tuple(cost) for cost in getattr(node, "workeroutput", {}).get(_WORKER_OUTPUT_KEY, ()))


def pytest_terminal_summary(terminalreporter):
    if not _session or hasattr(terminalreporter.config, "workeroutput"):
        return
    busy, wall = _busy_seconds() - _session[0], time.monotonic() - _session[1]
    cores = os.cpu_count() or 1
    write = terminalreporter.write_line
    terminalreporter.section("CPU cost (each test's process tree, tests/_cpu_cost.py)")
    share = busy / max(wall, 1e-9) / cores
    write(f"session, machine-wide: {busy:.0f} CPU s in {wall:.0f} s on {cores} cores ({share:.0%} busy)")
    if not _costs:
        return
    write(f"the tests' own: {sum(c for c, _, _ in _costs):.0f} CPU s")
    for cpu, seconds, nodeid in sorted(_costs, reverse=True)[:20]:
        write(f"{cpu:7.1f} CPU s {seconds:7.1f} s  {nodeid}")
    record = os.environ.get("HPSERVICE_TEST_COSTS")
    if record:
        lines = (f"{cpu:.2f}\t{seconds:.2f}\t{nodeid}\n" for cpu, seconds, nodeid in _costs)
        Path(record).write_text("".join(lines))
        write(f"every test's cost: {record}")
