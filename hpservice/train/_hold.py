"""Holding a run at a step boundary, for failure drills and the tests that stage them.

A drill (kill a node mid-job, preempt a running job, lose a coordinator twice) needs the job to be
*between* two known steps when the fault comes, and to finish soon after. Without a hold, a
test runs hundreds of steps so that the fault surely lands mid-job, and waits for all of them.

``HPSERVICE_HOLD_FILE`` names a file holding a step number ``N``. While the file exists, every
rank waits before starting any step after ``N`` (after step ``N`` and its checkpoint); rewriting
the file with a larger number lets the run go on to that step, removing it lets the run finish.
A stop request (cancel, preemption) ends the wait, so a held job still stops when asked. The
variable is read from the environment of the process that trains: a Ray worker inherits it from
its raylet. Unset (every production run), nothing is read.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

HOLD_FILE_ENV = "HPSERVICE_HOLD_FILE"


def held_at(path: Path) -> int | None:
    """The step the hold file stops runs after, or None when there is no hold (no file, or not a
    number: being rewritten)."""
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def wait_while_held(step: int, stop: threading.Event, poll_s: float = 0.05) -> None:
    """Return when a run that has finished ``step`` steps may start the next one (see the module
    doc), or when ``stop`` is set."""
    name = os.environ.get(HOLD_FILE_ENV)
    if not name:
        return
    path = Path(name)
    while not stop.is_set():
        until = held_at(path)
        if until is None or step < until:
            return
        time.sleep(poll_s)
