"""``hpservice serve``'s own Ray head never takes a port Ray reserves for itself, and a port taken
between the probe and Ray's bind starts the head again on new ports (the collision forced with a
stand-in ``ray`` that refuses the first start as Ray does)."""

import os
import stat
import sys
import textwrap

from hpservice.actors import head
from hpservice.launch import free_port

FAKE_RAY = textwrap.dedent(
    """\
    #!{python}
    # A stand-in for `ray start --head --block`: refuses its first start with Ray's own message
    # for a port conflict, then listens on --port until it is stopped.
    import socket, sys, time
    from pathlib import Path
    calls = Path(__file__).with_name("calls")
    with calls.open("a") as f:
        f.write(" ".join(sys.argv[1:]) + "\\n")
    if len(calls.read_text().splitlines()) == 1:
        print("ValueError: Ray component dashboard_agent_http is trying to use a port number 52365 "
              "that is used by other components.", flush=True)
        sys.exit(1)
    port = int(next(a for a in sys.argv if a.startswith("--port=")).split("=")[1])
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port))
    s.listen()
    time.sleep(600)
    """
)


def test_head_ports_skip_every_port_ray_takes_by_default():
    offered = iter([52365, 6379, 8265, 10001, 15000, 52365, 40001, 40001, 40002, 40003, 40004])
    ports = head.head_ports(probe=lambda: next(offered))
    assert ports == [40001, 40002, 40003, 40004]


def test_a_port_conflict_at_start_starts_the_head_again_on_new_ports(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "ray"
    fake.write_text(FAKE_RAY.format(python=sys.executable))
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    offered = iter([52365])  # the first probe lands on Ray's agent port, as it once did for real
    monkeypatch.setattr(head, "free_port", lambda: next(offered, None) or free_port())
    data = tmp_path / "data"
    try:
        started = head.ensure_head(data, num_cpus=1)
        calls = (bin_dir / "calls").read_text().splitlines()
        assert len(calls) == 2, calls  # refused once, started on new ports
        for call in calls:
            ports = {int(a.split("=")[1]) for a in call.split() if a.split("=")[0].endswith("port")}
            assert len(ports) == 4 and not ports & head.RAY_FIXED_PORTS, call
            assert "--dashboard-agent-listen-port" in call and "--ray-client-server-port" in call
        assert started["address"].endswith(calls[1].split("--port=")[1].split()[0])
        assert "52365 that is used by other components" in (data / "ray" / "head.log").read_text()
    finally:
        assert head.stop_head(data, timeout_s=10)
