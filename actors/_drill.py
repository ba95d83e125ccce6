"""A coordinator fault for the drills that test supervision (the trainer's own hold is
``hpservice.train._hold``).

``HPSERVICE_COORDINATOR_DRILL`` names a file. While it exists, a coordinator reads it at the top
of each state handler and before it acts on its workers' answers:

- a job state's name (``QUEUED``, ``STARTING``, ``RUNNING``, ``CANCELLING``, ``RESTARTING``): the
  handler of that state raises ``DrillFault``, as a bug in it would;
- ``hold``: supervision waits (the workers go on training and reporting), so a test can make a
  stop arrive after the last step and before the coordinator has seen it.

The variable is read from the coordinator process's environment (inherited from its raylet).
Unset, as in every production run, nothing is read.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

DRILL_ENV = "HPSERVICE_COORDINATOR_DRILL"


class DrillFault(RuntimeError):
    pass


def _said() -> str | None:
    name = os.environ.get(DRILL_ENV)
    if not name:
        return None
    try:
        return Path(name).read_text().strip()
    except OSError:
        return None


def fault_in(state: str) -> None:
    """Raise ``DrillFault`` if the drill file names ``state``."""
    if _said() == state:
        raise DrillFault(f"drill: the {state} handler raised")


def wait_while_held(poll_s: float = 0.05) -> None:
    """Return once the drill file no longer says ``hold``."""
    while _said() == "hold":
        time.sleep(poll_s)
