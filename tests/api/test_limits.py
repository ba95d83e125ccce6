"""Slow and greedy clients against a real server on real sockets: heads and bodies that never
finish are cut off, one owner's event streams are bounded, and /healthz answers throughout.

The server is the app under uvicorn with ``BoundedH11Protocol`` (what ``hpservice serve`` runs),
in a thread of this process, with short deadlines so the test does not wait long; nothing here
asserts how fast anything is, only that it happens (each wait is generous).
"""

import socket
import threading
import time

import httpx
import pytest
import uvicorn

from hpservice.api import Settings, create_app
from hpservice.api import limits as limits_module
from hpservice.api.limits import BoundedH11Protocol
from hpservice.api.settings import Principal
from hpservice.launch import free_port

pytestmark = pytest.mark.databases("sqlite")  # about connections, not the store

OWNERS = [f"owner{i}" for i in range(5)]
TOKENS = {f"t-{o}-0123456789": Principal(o) for o in OWNERS}
SPEC = {"name": "slow", "model": {"name": "llama", "flavor": "tiny"}, "data": {"kind": "synthetic"}}


class QuickHeads(BoundedH11Protocol):
    header_timeout_s = 1.0


@pytest.fixture
def server(tmp_path, monkeypatch):
    monkeypatch.setattr(limits_module, "BODY_TIMEOUT_S", 1.0)
    settings = Settings(data_dir=tmp_path / "data", tokens=dict(TOKENS), max_streams_per_owner=50)
    port = free_port()
    config = uvicorn.Config(
        create_app(settings, connect_ray=False, supervise=False), host="127.0.0.1", port=port, http=QuickHeads,
        log_level="warning", timeout_graceful_shutdown=1, limit_max_requests=None,
    )  # fmt: skip
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not srv.started:
        assert time.time() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    yield port
    srv.should_exit = True
    thread.join(timeout=30)


def _connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=60)
    return s


def _closed_by_server(s: socket.socket, within_s: float = 60.0) -> bool:
    """Whether the server closes ``s`` (reads reach EOF, or a reset) within ``within_s``."""
    s.settimeout(within_s)
    try:
        while s.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _auth(owner: str) -> dict:
    return {"Authorization": f"Bearer t-{owner}-0123456789"}


def test_a_request_head_that_never_finishes_is_dropped(server):
    half = _connect(server)
    half.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
    drip = _connect(server)
    drip.sendall(b"GE")
    assert _closed_by_server(half)
    assert _closed_by_server(drip)
    # a keep-alive connection whose second request head stalls is dropped too
    kept = _connect(server)
    kept.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert b"200 OK" in _response(kept)
    kept.sendall(b"GET /heal")
    assert _closed_by_server(kept)


def test_a_body_that_trickles_in_gets_408(server):
    s = _connect(server)
    head = (
        "POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        "Authorization: Bearer t-owner0-0123456789\r\nContent-Length: 4000\r\n\r\n"
    )
    s.sendall(head.encode() + b"{")  # the head in full, then one byte of the body
    answer = _response(s)
    assert b" 408 " in answer.split(b"\r\n")[0], answer
    assert b"did not arrive within" in answer
    with httpx.Client(base_url=f"http://127.0.0.1:{server}") as c:
        assert c.get("/v1/jobs", headers=_auth("owner0")).json()["items"] == []  # nothing stored


def _response(s: socket.socket) -> bytes:
    """A response's head, and its body when it declares a length (an event stream's does not)."""
    s.settimeout(60)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(4096)
        assert chunk, f"closed before a response head: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = [int(line.split(b":")[1]) for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:")]
    while length and len(body) < length[0]:
        body += s.recv(4096)
    return head + b"\r\n\r\n" + body


def _open_stream(port: int, job_id: str, owner: str) -> tuple[socket.socket, bytes]:
    s = _connect(port)
    s.sendall(
        f"GET /v1/jobs/{job_id}/events HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer t-{owner}-0123456789\r\n\r\n".encode()
    )
    return s, _response(s)


def test_healthz_answers_while_200_slow_clients_and_200_streams_are_open(server):
    with httpx.Client(base_url=f"http://127.0.0.1:{server}", timeout=60) as c:
        jobs = {o: c.post("/v1/jobs", json=SPEC, headers=_auth(o)).json()["id"] for o in OWNERS[:4]}
        slow = []
        for i in range(200):
            s = _connect(server)
            s.sendall(b"GET /healthz HTTP/1.1\r\n" if i % 2 else b"POST /v1/jobs HTTP/1.1\r\nContent-Length: 9")
            slow.append(s)
        streams = []
        for owner, job_id in jobs.items():  # 4 owners x 50 streams, each owner at its limit
            for _ in range(50):
                s, first = _open_stream(server, job_id, owner)
                assert first.startswith(b"HTTP/1.1 200"), first
                streams.append(s)
        assert c.get("/healthz").status_code == 200
        s, refused = _open_stream(server, jobs["owner0"], "owner0")  # the 51st of one owner
        assert refused.startswith(b"HTTP/1.1 429"), refused
        assert b"event streams open" in refused
        s.close()
        other = c.post("/v1/jobs", json=SPEC, headers=_auth("owner4")).json()["id"]
        s, fine = _open_stream(server, other, "owner4")  # another owner is not affected
        assert fine.startswith(b"HTTP/1.1 200"), fine
        s.close()
        assert all(_closed_by_server(s) for s in slow)  # the slow ones were cut off meanwhile
        assert c.get("/healthz").status_code == 200
        for s in streams[:10]:  # closing streams gives their slots back
            s.close()
        deadline = time.time() + 60
        while True:
            s, answer = _open_stream(server, jobs["owner0"], "owner0")
            s.close()
            if answer.startswith(b"HTTP/1.1 200"):
                break
            assert time.time() < deadline, "a closed stream's slot never came back"
            time.sleep(0.5)
        for s in streams[10:]:
            s.close()
