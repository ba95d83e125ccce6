"""The live job progress bar shared by `hpservice run` and `hpservice watch`."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


def job_progress(console: Console) -> Progress:
    """State, bar, step/total, loss, tokens/s, restarts, ETA; task fields: state, loss, tps, restarts."""
    return Progress(
        TextColumn("[bold]{task.fields[state]:<10}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}  {task.fields[tps]} tok/s  restarts {task.fields[restarts]}"),
        TimeRemainingColumn(),
        console=console,
        transient=False,
        refresh_per_second=2,  # steps take longer than that; rich's default 10 Hz redraw costs the ranks CPU
    )
