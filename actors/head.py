"""The local Ray head that ``hpservice serve`` keeps for itself, so running jobs outlive the API.

An embedded ``ray.init()`` ends with the process that started it: restarting the server then
loses every running job. Instead, without ``--ray-address`` the server starts a Ray head as its
own long-lived process (``ray start --head --block`` in a new session, so it survives the
server), records it in ``<data-dir>/ray/head.json`` (address, dashboard, PID), and on the next
start re-attaches to it when it is still alive. ``hpservice serve --stop-ray`` ends it, by the
recorded PID and only if that PID is still that ``ray start`` (a recycled PID is left alone).
The head listens with Ray's token authentication (``RAY_AUTH_MODE=token``) and its dashboard on
127.0.0.1.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from hpservice.launch import free_port

STARTUP_TIMEOUT_S = 120.0
HEAD_START_ATTEMPTS = 3  # a port taken between our probe and Ray's bind: new ports, again

# Ports `ray start --head` takes at fixed defaults unless told otherwise (GCS 6379, dashboard 8265,
# Ray Client 10001, dashboard agent 52365) and its default worker port range: a free-port probe
# may hand out 52365 (it lies in Linux's ephemeral range), and Ray then refuses to start ("a port
# number 52365 that is used by other components"). Every one of them is given explicitly, from
# probes that skip these.
RAY_FIXED_PORTS = frozenset({6379, 8265, 10001, 52365})
RAY_WORKER_PORTS = range(10002, 20000)
_PORT_CONFLICT = ("used by other components", "already in use", "Address already in use")


def _state_file(data_dir: Path) -> Path:
    return Path(data_dir) / "ray" / "head.json"


def _listening(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(2.0)
        return s.connect_ex((host, port)) == 0


def _is_our_head(pid: int) -> bool:
    """Whether ``pid`` is alive and is a ``ray start --head`` (not a recycled PID)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        try:
            os.kill(pid, 0)
        except OSError:
            return False
        return True  # no /proc (macOS): trust the recorded PID
    return any(part.endswith(b"ray") for part in cmdline) and b"start" in cmdline and b"--head" in cmdline


def running_head(data_dir: Path) -> dict | None:
    """The recorded head, if it is still alive and listening."""
    try:
        head = json.loads(_state_file(data_dir).read_text())
    except (OSError, ValueError):
        return None
    host, _, port = head.get("address", "").rpartition(":")
    if not _is_our_head(int(head.get("pid", 0))) or not port.isdigit() or not _listening(host, int(port)):
        return None
    return head


def ensure_head(data_dir: Path, num_cpus: int | None = None, num_gpus: int | None = None) -> dict:
    """The server's Ray head: the recorded one if alive (its resources as they were started),
    else a new one offering ``num_cpus`` CPUs (default: the machine's cores) and ``num_gpus``
    GPUs (default: Ray's own count). Returns ``{"address", "dashboard_url", "pid"}``."""
    os.environ.setdefault("RAY_AUTH_MODE", "token")  # set before ray is imported: Ray reads it once
    head = running_head(data_dir)
    if head is not None:
        return head
    state = _state_file(data_dir)
    state.parent.mkdir(parents=True, exist_ok=True)
    for attempt in range(1, HEAD_START_ATTEMPTS + 1):
        try:
            head = _start_head(state, num_cpus, num_gpus)
            break
        except _PortConflict as e:
            if attempt == HEAD_START_ATTEMPTS:
                raise RuntimeError(f"{e}; tried {attempt} sets of ports") from None
    tmp = state.with_suffix(".tmp")
    tmp.write_text(json.dumps(head))
    tmp.replace(state)
    return head


class _PortConflict(RuntimeError):
    pass


def head_ports(count: int = 4, probe=None) -> list[int]:
    """``count`` distinct free ports (GCS, dashboard, dashboard agent, Ray Client), none of the
    ones Ray would also take by default."""
    ports: list[int] = []
    while len(ports) < count:
        port = (probe or free_port)()
        if port not in RAY_FIXED_PORTS and port not in RAY_WORKER_PORTS and port not in ports:
            ports.append(port)
    return ports


def _start_head(state: Path, num_cpus: int | None, num_gpus: int | None) -> dict:
    port, dashboard_port, agent_port, client_port = head_ports()
    ray_bin = shutil.which("ray") or str(Path(sys.executable).parent / "ray")
    cmd = [
        ray_bin, "start", "--head", f"--port={port}", f"--num-cpus={num_cpus or os.cpu_count() or 1}",
        *([f"--num-gpus={num_gpus}"] if num_gpus is not None else []),
        "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}",
        f"--dashboard-agent-listen-port={agent_port}", f"--ray-client-server-port={client_port}",
        "--disable-usage-stats", "--block",
    ]  # fmt: skip
    log_path = state.parent / "head.log"
    log_start = log_path.stat().st_size if log_path.exists() else 0
    log = open(log_path, "ab")  # noqa: SIM115 - the head's own output, for as long as it runs
    proc = subprocess.Popen(
        cmd,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,  # its own process group: it outlives the server
        # workers at the default priority, as with the embedded Ray (actors.init_local_ray says why);
        # no drain on SIGTERM: only `--stop-ray` sends it, to end the head and its jobs, and Ray's
        # drain waits out its 30 s whenever a lease is still held
        env={
            "RAY_worker_niceness": "0",
            "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
            **os.environ,
            "RAY_AUTH_MODE": os.environ["RAY_AUTH_MODE"],
        },
    )
    log.close()
    host = _node_ip()
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not _listening(host, port):
        if proc.poll() is not None:
            with open(log_path, "rb") as f:
                f.seek(log_start)
                said = f.read().decode(errors="replace")
            why = f"ray start --head exited with {proc.returncode}; see {log_path}"
            if any(c in said for c in _PORT_CONFLICT):
                raise _PortConflict(f"{why} (a port conflict)")
            raise RuntimeError(why)
        if time.monotonic() > deadline:
            _kill_group(proc.pid)
            raise RuntimeError(f"the Ray head did not listen on {host}:{port} within {STARTUP_TIMEOUT_S:g} s")
        time.sleep(0.2)
    return {"address": f"{host}:{port}", "dashboard_url": f"http://127.0.0.1:{dashboard_port}", "pid": proc.pid}


def stop_head(data_dir: Path, timeout_s: float = 60.0) -> bool:
    """End the recorded head (and the Ray processes it started); False if none was running."""
    state = _state_file(data_dir)
    try:
        head = json.loads(state.read_text())
    except (OSError, ValueError):
        return False
    pid = int(head.get("pid", 0))
    if not _is_our_head(pid):
        state.unlink(missing_ok=True)
        return False
    _kill_group(pid, timeout_s)
    state.unlink(missing_ok=True)
    return True


def _kill_group(pid: int, timeout_s: float = 60.0) -> None:
    """SIGTERM to the head's process group (``ray start --block`` stops its daemons on it); once
    the head process itself has exited (or after ``timeout_s``), SIGKILL to whatever is left of
    the group: helpers the dashboard forked outlive a SIGTERM, and waiting for them to go took
    the whole timeout on every stop."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.2)
    settle = time.monotonic() + 2.0  # the daemons the head was stopping: a moment to exit on their own
    while time.monotonic() < settle:
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a child of this process that exited is reaped)."""
    with contextlib.suppress(ChildProcessError):
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _node_ip() -> str:
    """The address Ray gives this node (its own choice, even when asked for 127.0.0.1)."""
    import ray._private.services as services

    return services.get_node_ip_address()
