"""Commands that talk to a running control plane (``hpservice serve``) over HTTP, through
``hpservice.client``: ``submit``, ``list``, ``status``, ``watch``, ``logs``, ``cancel``,
``checkpoints``, ``artifacts``, ``resubmit``, ``delete``. Each takes ``--url`` (default ``HPSERVICE_URL``, else
``http://127.0.0.1:8000``), ``--token`` (default ``HPSERVICE_TOKEN``) and ``--json``."""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

from hpservice.jobs import (
    EXIT_CODES_HELP,
    EXIT_FOR_STATE,
    TERMINAL_STATES,
    ExitCode,
    JobState,
)

from ._render import describe_placement, print_summary
from .local import load_launchable

_POLL_INTERVAL_S = 1.0  # watch / logs -f polling when the event stream is unavailable


def add_parsers(sub) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", default=None, help="service URL (default: HPSERVICE_URL, else http://127.0.0.1:8000)")
    common.add_argument("--token", default=None, help="bearer token (default: HPSERVICE_TOKEN)")
    common.add_argument("--json", action="store_true", help="print JSON instead of tables and progress bars")

    def add(name: str, help: str):
        return sub.add_parser(
            name,
            help=help,
            description=help,
            parents=[common],
            epilog=EXIT_CODES_HELP,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )

    p = add("submit", "validate a job file locally, then submit it to the service")
    p.add_argument("job", help="the job's YAML file (docs/jobspec.md)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a spec field")
    p.add_argument("--watch", action="store_true", help="follow the job to its end, like `watch`")
    p.add_argument(
        "--idempotency-key", default=None, metavar="KEY", help="a retry with the same key returns the first job"
    )
    p = add("list", "list jobs, newest first")
    p.add_argument("--state", default=None, help="only jobs in this state (e.g. RUNNING)")
    p.add_argument("--name", default=None, help="only jobs with this name")
    p.add_argument("--owner", default=None, help="only jobs of this owner (admin tokens)")
    p.add_argument("--limit", type=int, default=50, help="page size (default 50)")
    p.add_argument("--cursor", default=None, help="the next_cursor of a previous page")
    p = add("status", "show one job: state, progress, restarts, checkpoints, history")
    p.add_argument("id", help="the job's id (hpservice list shows them)")
    p = add(
        "watch",
        "follow a job with a live progress bar until it ends (--json: one JSON event per line, "
        'then {"event": "job", "data": <final job>})',
    )
    p.add_argument("id", help="the job's id (hpservice list shows them)")
    p = add("logs", "print a job's log lines")
    p.add_argument("id", help="the job's id (hpservice list shows them)")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new lines until the job ends")
    p.add_argument("--rank", type=int, default=None, help="only this rank's lines")
    p.add_argument("--tail", type=int, default=None, help="the last N lines (server default: 100)")
    p = add("cancel", "cancel a job gracefully (finish the step, checkpoint, stop)")
    p.add_argument("id", help="the job's id (hpservice list shows them)")
    p = add("checkpoints", "list a job's committed checkpoints")
    p.add_argument("id", help="the job's id (hpservice list shows them)")
    p = add("artifacts", "list a job's artifacts (profiler traces, memory snapshots), or download them")
    p.add_argument("id", help="the job's id (hpservice list shows them)")
    p.add_argument("--download", action="append", default=[], metavar="NAME", help="download this artifact ('all': every one)")
    p.add_argument("-o", "--out", default=".", help="folder to download into (default: the current one)")
    p = add("resubmit", "submit a new job from a job's spec as it was submitted")
    p.add_argument("id", help="the job's id (hpservice list shows them)")
    p = add("delete", "delete an ended job and its stored metrics and events")
    p.add_argument("id", help="the job's id (hpservice list shows them)")
    handlers = {
        "submit": _cmd_submit, "list": _cmd_list, "status": _cmd_status, "watch": _cmd_watch, "logs": _cmd_logs,
        "cancel": _cmd_cancel, "checkpoints": _cmd_checkpoints, "artifacts": _cmd_artifacts, "delete": _cmd_delete,
        "resubmit": _cmd_resubmit,
    }  # fmt: skip
    for name, handler in handlers.items():
        sub.choices[name].set_defaults(run=functools.partial(_guarded, handler))


def _exit_code(e) -> int:
    if e.code == "bad_url":
        return ExitCode.USAGE
    if e.status == 404:
        return ExitCode.NOT_FOUND
    if e.status in (401, 403):
        return ExitCode.AUTH
    if 400 <= e.status < 500:
        return ExitCode.USAGE
    return ExitCode.SERVER


def _guarded(handler, args) -> int:
    """Run a service command; a client error becomes its message and its exit code."""
    from hpservice.client import ClientError

    try:
        return handler(args)
    except ClientError as e:
        print(f"hpservice {args.command}: {e}", file=sys.stderr)
        return _exit_code(e)


def _client(args):
    from hpservice.client import Client

    return Client(args.url, args.token)


def _console():
    from rich.console import Console

    return Console(highlight=False)


def _print_json(obj, *, compact: bool = False) -> None:
    print(json.dumps(obj, separators=(",", ":")) if compact else json.dumps(obj, indent=2), flush=True)


def _when(t) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if isinstance(t, int | float) else "-"


def _text(value):
    from rich.text import Text

    return Text("-" if value is None else str(value))


def _cmd_submit(args) -> int:
    # the server resolves model names, reads files of its own and plans memory on its cluster's devices
    spec = load_launchable(args, here=False, plan=False)
    if spec is None:
        return ExitCode.USAGE
    with _client(args) as client:
        job = client.submit(spec.model_dump(mode="json", by_alias=True), idempotency_key=args.idempotency_key)
        if args.json:
            _print_json(job, compact=args.watch)
        else:
            print(f"submitted job {job['id']} ({job['state']})", flush=True)
        if not args.watch:
            return ExitCode.OK
        return _watch(client, job["id"], args.json)


def _cmd_watch(args) -> int:
    with _client(args) as client:
        return _watch(client, args.id, args.json)


def _cmd_list(args) -> int:
    from rich.table import Table

    with _client(args) as client:
        page = client.list(state=args.state, name=args.name, owner=args.owner, limit=args.limit, cursor=args.cursor)
    if args.json:
        _print_json(page)
        return ExitCode.OK
    items = page.get("items", [])
    console = _console()
    if not items:
        console.print("no jobs")
    else:
        table = Table(box=None, pad_edge=False)
        table.add_column("ID", no_wrap=True, min_width=max(len(str(j.get("id"))) for j in items))
        for name in ("NAME", "OWNER", "STATE", "STEP", "RESTARTS", "CREATED"):
            table.add_column(name, justify="right" if name in ("STEP", "RESTARTS") else "left")
        for j in items:
            table.add_row(
                _text(j.get("id")),
                _text(j.get("name")),
                _text(j.get("owner")),
                _text(j.get("state")),
                _text(f"{j.get('step', 0)}/{j.get('total_steps', '?')}"),
                _text(j.get("restarts", 0)),
                _text(_when(j.get("created_at"))),
            )
        console.print(table)
    if page.get("next_cursor"):
        print(f"more jobs: --cursor {page['next_cursor']}", file=sys.stderr)
    return ExitCode.OK


def _cmd_status(args) -> int:
    from rich.table import Table

    with _client(args) as client:
        job = client.get(args.id)
    if args.json:
        _print_json(job)
        return ExitCode.OK
    console = _console()
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column()
    grid.add_row("id", _text(job.get("id")))
    grid.add_row("name", _text(job.get("name")))
    grid.add_row("owner", _text(job.get("owner")))
    state = job.get("state")
    grid.add_row("state", _text(f"{state}: {job['message']}" if job.get("message") else state))
    grid.add_row("step", _text(f"{job.get('step', 0)}/{job.get('total_steps', '?')}"))
    restarts = job.get("restarts", 0)
    reasons = job.get("restart_reasons") or []
    grid.add_row("restarts", _text(f"{restarts} ({'; '.join(reasons)})" if reasons else restarts))
    ckpts = job.get("checkpoints") or []
    latest = f" (latest: step {ckpts[-1].get('step')} at {ckpts[-1].get('path')})" if ckpts else ""
    grid.add_row("checkpoints", _text(f"{len(ckpts)}{latest}"))
    if job.get("placement"):
        grid.add_row("placement", _text(describe_placement(job["placement"])))
    grid.add_row("created", _text(_when(job.get("created_at"))))
    grid.add_row("updated", _text(_when(job.get("updated_at"))))
    if job.get("ray_dashboard_url"):
        grid.add_row("dashboard", _text(job["ray_dashboard_url"]))
    console.print(grid)
    history = job.get("history") or []
    if history:
        console.print("[bold]history[/]")
        hist = Table.grid(padding=(0, 2))
        for _ in range(3):
            hist.add_column()
        for h in history:
            hist.add_row(_text(_when(h.get("time"))), _text(h.get("state")), _text(h.get("message") or ""))
        console.print(hist)
    return ExitCode.OK


def _cmd_cancel(args) -> int:
    with _client(args) as client:
        before = client.get(args.id)["state"]
        job = client.cancel(args.id)
    if args.json:
        _print_json(job)
    elif before in TERMINAL_STATES:  # cancelling an ended job changes nothing: say so
        print(f"job {job.get('id', args.id)} had already ended ({before}): nothing to cancel")
    else:
        print(f"cancel requested for job {job.get('id', args.id)} ({job.get('state')})")
    return ExitCode.OK


def _cmd_resubmit(args) -> int:
    with _client(args) as client:
        job = client.resubmit(args.id)
    if args.json:
        _print_json(job)
    else:
        print(f"submitted job {job['id']} ({job['state']}) from {args.id}'s spec", flush=True)
    return ExitCode.OK


def _cmd_delete(args) -> int:
    with _client(args) as client:
        client.delete(args.id)
    if args.json:
        _print_json({"deleted": args.id})
    else:
        print(f"deleted job {args.id}")
    return ExitCode.OK


def _cmd_checkpoints(args) -> int:
    from rich.table import Table

    with _client(args) as client:
        result = client.checkpoints(args.id)
    if args.json:
        _print_json(result)
        return ExitCode.OK
    ckpts = result.get("checkpoints", [])
    console = _console()
    if not ckpts:
        console.print(f"job {args.id} has no committed checkpoints")
        return ExitCode.OK
    table = Table(box=None, pad_edge=False)
    table.add_column("STEP", justify="right")
    table.add_column("TIME", no_wrap=True)
    table.add_column("PATH", overflow="fold")
    table.add_column("METRICS")
    for c in ckpts:
        metrics = c.get("metrics") or {}
        shown = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())
        table.add_row(_text(c.get("step")), _text(_when(c.get("time"))), _text(c.get("path")), _text(shown))
    console.print(table)
    return ExitCode.OK


# -- following a job: the event stream, or polling when it is unavailable -------------------------


def _follow(client, job_id: str, on_event, *, start_step: int = 0, log_poll=None) -> str:
    """Feed ``on_event`` the job's events until a terminal state; returns that state.

    Uses the SSE stream; if it fails (other than on auth), polls ``metrics`` + ``get`` (and
    ``log_poll()``, which returns new log-event dicts) every ``_POLL_INTERVAL_S`` instead.
    """
    from hpservice.client import ClientError

    step = start_step
    try:
        for ev in client.events(job_id):
            if ev["event"] == "metrics" and isinstance(ev["data"].get("step"), int):
                step = max(step, ev["data"]["step"])
            on_event(ev)
            state = ev["data"].get("state") if ev["event"] == "state" else None
            if state in TERMINAL_STATES:
                return state
    except ClientError as e:
        if e.status in (401, 403):
            raise
        print(
            f"hpservice: event stream unavailable ({e.message}); polling every {_POLL_INTERVAL_S:g}s", file=sys.stderr
        )
    seen = None
    while True:
        result = client.metrics(job_id, since_step=step)
        for rec in result.get("records", []):
            on_event({"id": None, "event": "metrics", "data": rec})
        step = max(step, result.get("next_since_step") or step)
        if log_poll is not None:
            for line in log_poll():
                on_event({"id": None, "event": "log", "data": line})
        job = client.get(job_id)
        now = (job.get("state"), job.get("message"), job.get("restarts"))
        if now != seen:
            seen = now
            data = {"state": now[0], "message": now[1], "restarts": now[2], "time": job.get("updated_at")}
            on_event({"id": None, "event": "state", "data": data})
        if job.get("state") in TERMINAL_STATES:
            return job["state"]
        time.sleep(_POLL_INTERVAL_S)


def _watch(client, job_id: str, as_json: bool) -> int:
    """Follow ``job_id`` to its end (progress bar, or JSON lines); the exit code of its final state."""
    job = client.get(job_id)
    if job["state"] in TERMINAL_STATES:
        if as_json:
            _print_json({"id": None, "event": "job", "data": job}, compact=True)
        else:
            print_summary(_console(), job, client.metrics(job_id).get("records", []))
        return EXIT_FOR_STATE[job["state"]]
    try:
        if as_json:

            def on_event(ev):
                _print_json(ev, compact=True)

            state = _follow(client, job_id, on_event)
            records = []
        else:
            state, records = _watch_progress(client, job, _console())
    except KeyboardInterrupt:
        print(f"\nstopped watching job {job_id}; it goes on (`hpservice cancel {job_id}` stops it)", file=sys.stderr)
        return ExitCode.CANCELLED
    final = client.get(job_id)
    if final.get("state") not in TERMINAL_STATES:
        final["state"] = state
    if as_json:
        _print_json({"id": None, "event": "job", "data": final}, compact=True)
    else:
        print_summary(_console(), final, records)
    return EXIT_FOR_STATE[final["state"]]


def _watch_progress(client, job: dict, console):
    from rich.text import Text

    from hpservice._progress import job_progress

    records: dict[int, dict] = {}  # by step: a restart's replayed steps replace the earlier ones
    with job_progress(console) as progress:
        task = progress.add_task(
            "watch",
            total=job.get("total_steps") or None,
            completed=job.get("step", 0),
            state=job["state"],
            loss="-",
            tps="-",
            restarts=job.get("restarts", 0),
        )

        def on_event(ev):
            data, kind = ev["data"], ev["event"]
            if kind == "metrics":
                if isinstance(data.get("step"), int):
                    records[data["step"]] = data
                loss, tps = data.get("loss"), data.get("tokens_per_s")
                progress.update(
                    task,
                    completed=data.get("step", 0),
                    loss=f"{loss:.4f}" if isinstance(loss, int | float) else "-",
                    tps=f"{tps:,.0f}" if isinstance(tps, int | float) else "-",
                )
            elif kind == "state":
                progress.update(task, state=data.get("state", "?"), restarts=data.get("restarts", 0))
                if data.get("state") == JobState.RESTARTING and data.get("message"):
                    progress.console.print(Text(f"restarting: {data['message']}"))
            elif kind == "checkpoint":
                progress.console.print(Text(f"checkpoint at step {data.get('step')}: {data.get('path')}"))

        state = _follow(client, job["id"], on_event, start_step=job.get("step", 0))
    return state, [records[k] for k in sorted(records)]


# -- logs ------------------------------------------------------------------------------------------


def _log_text(line: dict) -> str:
    step = line.get("step")
    return f"[rank {line.get('rank', '?')} step {'-' if step is None else step}] {line.get('line', '')}"


def _cmd_logs(args) -> int:
    """Print the job's lines; with ``-f`` follow it, printing each line once: lines carry their
    event sequence number (``seq``, the SSE id), and only lines after the last printed one are
    printed, whether they come from the event stream or from polling ``?since=``."""
    with _client(args) as client:
        page = client.logs(args.id, rank=args.rank, tail=args.tail)
        for line in page.get("lines", []):
            print(_json_or_text(line, args.json), flush=True)
        if not args.follow:
            _note_artifacts(client, args.id)
            return ExitCode.OK
        cursor = polled_to = page.get("next_since", 0)

        def log_poll():  # only when the stream is unavailable; on_event prints what it returns
            nonlocal polled_to
            got = client.logs(args.id, rank=args.rank, since=max(cursor, polled_to))
            polled_to = got.get("next_since", polled_to)
            return got.get("lines", [])

        def on_event(ev):
            nonlocal cursor
            if ev["event"] != "log":
                return
            line = ev["data"]
            seq = ev["id"] if ev["id"] is not None else line.get("seq")
            if seq is not None and seq <= cursor:
                return  # the stream replays the history first: printed already
            cursor = max(cursor, seq or 0)
            if args.rank is None or line.get("rank") == args.rank:
                print(_json_or_text(line, args.json), flush=True)

        try:
            _follow(client, args.id, on_event, log_poll=log_poll)
        except KeyboardInterrupt:
            return ExitCode.CANCELLED
    return ExitCode.OK


def _note_artifacts(client, job_id: str) -> None:
    """After the log lines, on stderr (stdout stays the log): the run's artifacts, if any."""
    from hpservice.client import ClientError

    try:
        found = client.artifacts(job_id).get("artifacts", [])
    except ClientError:  # a server without artifacts: the log lines are what was asked for
        return
    if found:
        names = ", ".join(a["name"] for a in found)
        print(f"artifacts: {names} (hpservice artifacts {job_id} --download NAME)", file=sys.stderr)


# -- artifacts -------------------------------------------------------------------------------------


def _cmd_artifacts(args) -> int:
    with _client(args) as client:
        found = client.artifacts(args.id).get("artifacts", [])
        if not args.download:
            if args.json:
                print(json.dumps(found))
            for a in [] if args.json else found:
                print(f"{a['name']}  {a['size']:,} bytes")
            if not found and not args.json:
                print(f"job {args.id} has no artifacts (a job with metrics.profile writes its traces there)")
            return ExitCode.OK
        names = [a["name"] for a in found] if "all" in args.download else args.download
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        for name in names:
            print(client.download_artifact(args.id, name, out))
    return ExitCode.OK


def _json_or_text(line: dict, as_json: bool) -> str:
    return json.dumps(line, separators=(",", ":")) if as_json else _log_text(line)
