"""A real PostgreSQL server for the store's tests, started and stopped by them (Debian's
``postgresql`` package: ``.ci/run`` installs it; psycopg comes with the test extras).

It runs as the ``postgres`` user when the tests run as root (PostgreSQL refuses root), listens on
a free loopback port with a socket in its own temporary directory, trusts local connections, and
is stopped by its PID; each test gets a database of its own."""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid


def postgres_bindir() -> str | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if found:
        return os.path.dirname(found[-1])
    initdb = shutil.which("initdb")
    return os.path.dirname(initdb) if initdb else None


class PostgresServer:
    def __init__(self, bindir: str):
        self.bindir = bindir
        self.dir = tempfile.mkdtemp(prefix="hp-pg-")
        self._as = {}
        if os.geteuid() == 0:
            pw = pwd.getpwnam("postgres")
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)
            self._as = {"user": pw.pw_uid, "group": pw.pw_gid}
        subprocess.run(
            [f"{bindir}/initdb", "-D", f"{self.dir}/data", "-U", "hp", "--auth=trust", "-E", "UTF8", "--no-sync"],
            check=True, capture_output=True, timeout=120, **self._as,
        )  # fmt: skip
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.process = subprocess.Popen(
            [f"{bindir}/postgres", "-D", f"{self.dir}/data", "-p", str(self.port), "-k", self.dir,
             "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off", "-c", "max_connections=1000"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **self._as,
        )  # fmt: skip
        import psycopg

        deadline = time.monotonic() + 60
        while True:
            try:
                psycopg.connect(self._dsn("postgres"), connect_timeout=2).close()
                return
            except psycopg.OperationalError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"PostgreSQL did not start on port {self.port}") from None
                time.sleep(0.1)

    def _dsn(self, db: str) -> str:
        return f"host=127.0.0.1 port={self.port} user=hp dbname={db}"

    def new_database(self) -> str:
        """A fresh, empty database; its SQLAlchemy URL."""
        import psycopg

        name = f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self._dsn("postgres"), autocommit=True) as c:
            c.execute(f'CREATE DATABASE "{name}"')
        return f"postgresql+psycopg://hp@127.0.0.1:{self.port}/{name}"

    def stop(self) -> None:
        if self.process.poll() is None:
            # fast shutdown of the server this object started, by its PID: it disconnects the
            # clients (the tests' stores keep pooled connections) instead of waiting for them
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        with contextlib.suppress(OSError):
            shutil.rmtree(self.dir)
