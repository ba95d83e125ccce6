"""A synchronous HTTP client for the ``hpservice`` REST control plane (``docs/api.md``).

It talks only to the URL it is given (default ``HPSERVICE_URL``, else ``http://127.0.0.1:8000``)
and sends ``Authorization: Bearer TOKEN`` when a token is set (default ``HPSERVICE_TOKEN``)::

    from hpservice.client import Client, ClientError

    with Client() as c:
        job = c.submit(open("job.yaml").read())
        for ev in c.events(job["id"]):
            print(ev["event"], ev["data"])

Every request has a timeout. An HTTP error raises ``ClientError`` built from the server's JSON
error body (``{"error": {"code", "message", "details"}}``); a connection failure raises
``ClientError`` with ``status == 0`` and a message naming the URL.
"""

from __future__ import annotations

import codecs
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

from hpservice.jobs import TERMINAL_STATES  # re-exported: callers of the client use it

__all__ = ["DEFAULT_URL", "TERMINAL_STATES", "Client", "ClientError"]

DEFAULT_URL = "http://127.0.0.1:8000"


class ClientError(Exception):
    """A failed request: ``status`` is the HTTP status (0 when the server could not be reached),
    ``code`` / ``message`` / ``details`` come from the server's error body."""

    def __init__(self, status: int, code: str, message: str, details: Any = None):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.details = details if details is not None else []

    def __str__(self) -> str:
        head = f"{self.message} ({self.code})" if self.status == 0 else f"{self.status} {self.code}: {self.message}"
        lines = [head]
        if isinstance(self.details, list):
            for d in self.details:
                if isinstance(d, dict) and "message" in d:
                    lines.append(f"  {d.get('path') or '<root>'}: {d['message']}")
                else:
                    lines.append(f"  {d}")
        elif self.details:
            lines.append(f"  {self.details}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"ClientError(status={self.status!r}, code={self.code!r}, message={self.message!r})"


def _error_from_response(resp: httpx.Response) -> ClientError:
    """A ClientError from an error response; tolerates non-JSON and FastAPI ``{"detail": ...}`` bodies."""
    try:
        body = resp.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        err = body["error"]
        return ClientError(
            resp.status_code,
            str(err.get("code") or f"http_{resp.status_code}"),
            str(err.get("message") or resp.reason_phrase),
            err.get("details"),
        )
    if isinstance(body, dict) and "detail" in body:
        detail = body["detail"]
        message = detail if isinstance(detail, str) else resp.reason_phrase
        return ClientError(
            resp.status_code, f"http_{resp.status_code}", message, None if isinstance(detail, str) else detail
        )
    text = resp.text.strip()[:200]
    return ClientError(resp.status_code, f"http_{resp.status_code}", text or resp.reason_phrase or "error")


class Client:
    """A synchronous client for one control plane.

    ``timeout`` bounds every plain request (seconds); ``stream_timeout`` is the longest silence
    tolerated on an event stream (the server sends a keep-alive every 15 s) before it counts as
    dropped. ``max_reconnects`` / ``reconnect_delay`` govern ``events`` after a dropped stream.
    """

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        timeout: float = 10.0,
        stream_timeout: float = 60.0,
        max_reconnects: int = 3,
        reconnect_delay: float = 0.5,
        transport: httpx.BaseTransport | None = None,
    ):
        self.url = (url or os.environ.get("HPSERVICE_URL") or DEFAULT_URL).rstrip("/")
        self.token = token if token is not None else os.environ.get("HPSERVICE_TOKEN") or None
        self.timeout = timeout
        self.stream_timeout = stream_timeout
        self.max_reconnects = max_reconnects
        self.reconnect_delay = reconnect_delay
        headers = {"Accept": "application/json", "User-Agent": "hpservice-client"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        try:
            parsed = httpx.URL(self.url)
            if parsed.scheme not in ("http", "https") or not parsed.host:
                raise ValueError("expected http(s)://HOST[:PORT]")
            # trust_env=False: no proxy from the environment; requests go to self.url only.
            self._http = httpx.Client(
                base_url=self.url, headers=headers, timeout=timeout, transport=transport, trust_env=False
            )
        except (httpx.InvalidURL, httpx.UnsupportedProtocol, ValueError) as e:
            raise ClientError(0, "bad_url", f"invalid service URL {self.url!r}: {e}") from None

    # -- plumbing ---------------------------------------------------------------------------------

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _transport_error(self, e: Exception) -> ClientError:
        if isinstance(e, httpx.TimeoutException):
            return ClientError(0, "timeout", f"no answer from {self.url} within the timeout ({type(e).__name__})")
        return ClientError(0, "connection_error", f"cannot reach {self.url}: {e or type(e).__name__}")

    def _request(self, method: str, path: str, *, params: dict | None = None, **kw) -> Any:
        if params:
            params = {k: v for k, v in params.items() if v is not None}
        try:
            resp = self._http.request(method, path, params=params or None, **kw)
        except (httpx.TransportError, httpx.InvalidURL, httpx.UnsupportedProtocol) as e:
            raise self._transport_error(e) from None
        if resp.status_code >= 400:
            raise _error_from_response(resp)
        if resp.status_code == 204 or not resp.content:
            return None
        try:
            return resp.json()
        except ValueError:
            raise ClientError(
                resp.status_code, "bad_response", f"{method} {path}: the server did not answer JSON"
            ) from None

    @staticmethod
    def _job_path(job_id: str, suffix: str = "") -> str:
        return f"/v1/jobs/{quote(str(job_id), safe='')}{suffix}"

    # -- jobs -------------------------------------------------------------------------------------

    def submit(self, spec: dict | str | bytes, *, idempotency_key: str | None = None) -> dict:
        """Submit a job spec (a mapping sent as JSON, or YAML text); returns the ``JobOut``."""
        headers = {}
        if idempotency_key:
            headers["Idempotency-Key"] = idempotency_key
        if isinstance(spec, str | bytes):
            headers["Content-Type"] = "application/yaml"
            return self._request("POST", "/v1/jobs", content=spec, headers=headers)
        return self._request("POST", "/v1/jobs", json=spec, headers=headers)

    def list(
        self,
        state: str | None = None,
        name: str | None = None,
        owner: str | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> dict:
        """One page of jobs, newest first: ``{"items": [JobOut], "next_cursor": str | None}``."""
        params = {"state": state, "name": name, "owner": owner, "limit": limit, "cursor": cursor}
        return self._request("GET", "/v1/jobs", params=params)

    def list_all(
        self, state: str | None = None, name: str | None = None, owner: str | None = None, limit: int = 50
    ) -> Iterator[dict]:
        """Every matching job, following ``next_cursor`` page by page (``limit`` is the page size)."""
        cursor = None
        while True:
            page = self.list(state=state, name=name, owner=owner, limit=limit, cursor=cursor)
            yield from page.get("items", [])
            cursor = page.get("next_cursor")
            if not cursor:
                return

    def get(self, job_id: str) -> dict:
        return self._request("GET", self._job_path(job_id))

    def cancel(self, job_id: str) -> dict:
        """Ask for a graceful cancel (a no-op on ended jobs); returns the ``JobOut``."""
        return self._request("POST", self._job_path(job_id, "/cancel"))

    def resubmit(self, job_id: str) -> dict:
        """A new job from this job's submitted spec (admitted again); returns its ``JobOut``."""
        return self._request("POST", self._job_path(job_id, "/resubmit"))

    def delete(self, job_id: str) -> None:
        """Delete an ended job (409 ``ClientError`` if it has not ended)."""
        self._request("DELETE", self._job_path(job_id))

    def metrics(self, job_id: str, since_step: int = 0) -> dict:
        """``{"records": [...], "next_since_step": N}``: records with ``step > since_step``, ascending."""
        return self._request("GET", self._job_path(job_id, "/metrics"), params={"since_step": since_step})

    def logs(
        self, job_id: str, rank: int | None = None, tail: int | None = None, since: int = 0, limit: int | None = None
    ) -> dict:
        """``{"lines": [{"seq", "rank", "step", "time", "line"}], "next_since": N}``: lines after event
        ``since`` (pass ``next_since`` back to get only newer ones; ``seq`` is the SSE id); at most
        ``limit`` of them (a page), or the last ``tail``."""
        params = {"rank": rank, "tail": tail, "since": since or None, "limit": limit}
        return self._request("GET", self._job_path(job_id, "/logs"), params=params)

    def checkpoints(self, job_id: str) -> dict:
        """``{"checkpoints": [{"step", "path", "time", "metrics"}]}``."""
        return self._request("GET", self._job_path(job_id, "/checkpoints"))

    def artifacts(self, job_id: str) -> dict:
        """``{"artifacts": [{"name", "size", "rank", "url"}]}``: profiler traces and memory snapshots."""
        return self._request("GET", self._job_path(job_id, "/artifacts"))

    def download_artifact(self, job_id: str, name: str, dest: str | Path) -> Path:
        """Stream one artifact to ``dest`` (a file, or a folder to put ``name`` in); returns the file."""
        dest = Path(dest)
        if dest.is_dir():
            dest = dest / name
        path = self._job_path(job_id, f"/artifacts/{quote(name, safe='')}")
        try:
            with self._http.stream("GET", path) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    raise _error_from_response(resp)
                part = dest.with_name(dest.name + ".part")
                with open(part, "wb") as f:
                    for chunk in resp.iter_bytes():
                        f.write(chunk)
                part.replace(dest)
        except (httpx.TransportError, httpx.InvalidURL, httpx.UnsupportedProtocol) as e:
            raise self._transport_error(e) from None
        return dest

    def health(self) -> dict:
        return self._request("GET", "/healthz")

    def ready(self) -> dict:
        """``{"status": "ready"}``; a 503 ``ClientError`` when the store or Ray is unreachable."""
        return self._request("GET", "/readyz")

    # -- events (SSE) -----------------------------------------------------------------------------

    def events(self, job_id: str, last_event_id: int | None = None) -> Iterator[dict]:
        """Yield the job's events ``{"id": int, "event": str, "data": dict}`` in order.

        The stream ends after the ``state`` event of a terminal state. A dropped connection (a
        network error, a 5xx, a silence longer than ``stream_timeout``, or the stream closing
        before a terminal state) is resumed with ``Last-Event-ID``; after ``max_reconnects``
        consecutive failures without a new event, ``ClientError`` is raised. A 4xx answer
        (unknown job, bad token) raises at once.
        """
        last_id = last_event_id
        failures = 0
        timeout = httpx.Timeout(self.timeout, read=self.stream_timeout)
        while True:
            headers = {"Accept": "text/event-stream", "Cache-Control": "no-cache"}
            if last_id is not None:
                headers["Last-Event-ID"] = str(last_id)
            progressed = False
            try:
                with self._http.stream(
                    "GET", self._job_path(job_id, "/events"), headers=headers, timeout=timeout
                ) as resp:
                    if resp.status_code >= 400:
                        resp.read()
                        raise _error_from_response(resp)
                    ctype = resp.headers.get("content-type", "")
                    if not ctype.startswith("text/event-stream"):
                        raise ClientError(
                            resp.status_code,
                            "bad_stream",
                            f"events of job {job_id}: expected text/event-stream, got {ctype!r}",
                        )
                    for ev in _parse_sse(resp.iter_bytes()):
                        if ev["id"] is not None:
                            last_id = ev["id"]
                        progressed = True
                        failures = 0
                        yield ev
                        if ev["event"] == "state" and ev["data"].get("state") in TERMINAL_STATES:
                            return
                error = ClientError(0, "stream_closed", f"the event stream of job {job_id} closed before the job ended")
            except ClientError as e:
                if e.status < 500:
                    raise
                error = e
            except (httpx.TransportError, httpx.StreamError) as e:
                error = self._transport_error(e)
            if not progressed:
                failures += 1
            if failures > self.max_reconnects:
                raise ClientError(
                    error.status,
                    error.code,
                    f"{error.message} (gave up after {self.max_reconnects} reconnects)",
                    error.details,
                )
            time.sleep(min(self.reconnect_delay * 2 ** max(failures - 1, 0), 5.0))


def _sse_lines(chunks: Iterator[bytes]) -> Iterator[str]:
    """Split a byte stream into SSE lines (CRLF, LF or CR end a line; nothing else does)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    buf = ""
    for chunk in chunks:
        buf += decoder.decode(chunk)
        while True:
            i_n, i_r = buf.find("\n"), buf.find("\r")
            if i_n == -1 and i_r == -1:
                break
            if i_r != -1 and (i_n == -1 or i_r < i_n):
                if i_r == len(buf) - 1:  # a CR at the end may be half of a CRLF: wait for more
                    break
                yield buf[:i_r]
                buf = buf[i_r + 2 :] if buf[i_r + 1] == "\n" else buf[i_r + 1 :]
            else:
                yield buf[:i_n]
                buf = buf[i_n + 1 :]
    buf += decoder.decode(b"", final=True)
    if buf.endswith("\r"):
        yield buf[:-1]
    # An unterminated last line is an incomplete event: dropped, as the SSE spec says.


def _parse_sse(chunks: Iterator[bytes]) -> Iterator[dict]:
    """Parse Server-Sent Events into ``{"id", "event", "data"}`` dicts (``data`` JSON-decoded)."""
    event, data, ev_id = "", [], None
    for line in _sse_lines(chunks):
        if not line:
            if data:
                text = "\n".join(data)
                try:
                    payload = json.loads(text)
                except ValueError:
                    payload = {"text": text}
                if not isinstance(payload, dict):
                    payload = {"value": payload}
                yield {"id": ev_id, "event": event or "message", "data": payload}
            event, data = "", []
            continue
        if line.startswith(":"):  # a comment (keep-alive)
            continue
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "event":
            event = value
        elif name == "data":
            data.append(value)
        elif name == "id" and "\0" not in value:
            try:
                ev_id = int(value)
            except ValueError:
                ev_id = value or None
