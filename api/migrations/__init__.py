"""The store's schema migrations (Alembic): ``upgrade(engine)`` brings any store to the newest
revision, keeping every job, metric and event.

Revisions live in ``versions/``, one file each, oldest first by ``down_revision``. The first,
``0001``, is the schema of the last server without migrations and is written to be safe on
such a store: it creates only the tables that are missing and adds only the (nullable) columns
a store that old lacks, so a pre-migration store and an empty database both arrive at it. Every
later revision is an ordinary Alembic migration. To change the schema, change the models in
``api/store.py`` and add a revision after the newest; ``tests/api/test_migrations.py`` fails
while the two disagree.

Several replicas may start at once on one database: on PostgreSQL the upgrade holds an advisory
lock, on SQLite the database's write lock (``BEGIN IMMEDIATE``), so one upgrades and the others
find the schema current.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import text
from sqlalchemy.engine import Connection, Engine

HERE = Path(__file__).resolve().parent
_LOCK_KEY = 0x6870_7376  # "hpsv": the PostgreSQL advisory lock the upgrade holds


def config(connection: Connection | None = None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(HERE))
    cfg.attributes["connection"] = connection
    return cfg


@functools.cache
def head() -> str:
    """The newest revision (read from ``versions/`` once per process: every store open asks)."""
    return ScriptDirectory.from_config(config()).get_current_head()


def current(connection: Connection) -> str | None:
    """The revision the database is at (None: empty, or a store from before migrations)."""
    return MigrationContext.configure(connection).get_current_revision()


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Upgrade the database ``engine`` opens to ``revision``, in one transaction."""
    with _locked(engine) as conn:
        if revision == "head" and current(conn) == head():
            return
        command.upgrade(config(conn), revision)


def downgrade(engine: Engine, revision: str) -> None:
    """Take the database back to ``revision`` (to run an older server), in one transaction;
    what the newer revisions stored (their columns) is dropped."""
    with _locked(engine) as conn:
        command.downgrade(config(conn), revision)


@contextmanager
def _locked(engine: Engine) -> Iterator[Connection]:
    """A transaction that holds the migration lock (see the module doc)."""
    with engine.begin() as conn:
        if conn.dialect.name == "sqlite":
            conn.exec_driver_sql("BEGIN IMMEDIATE")
        elif conn.dialect.name == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _LOCK_KEY})
        yield conn
