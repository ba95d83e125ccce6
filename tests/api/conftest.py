"""The API suite runs on each database the store supports (``database_kind``, tests/conftest.py):
every test here runs once on SQLite and once on a fresh database of the session's PostgreSQL
(``HPSERVICE_DATABASE_URL``, which ``Settings`` and the ``hpservice serve`` processes the tests
start read), unless it is marked ``@pytest.mark.databases(...)`` with the ones it is about."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def database(database_kind, request, monkeypatch) -> str:
    """The database this test's servers use by default: a SQLite file in their data dir, or a
    fresh database on the session's PostgreSQL (a test taking ``store_url`` opens its own)."""
    if database_kind == "postgresql" and "store_url" not in request.fixturenames:
        monkeypatch.setenv("HPSERVICE_DATABASE_URL", request.getfixturevalue("postgres").new_database())
    else:
        monkeypatch.delenv("HPSERVICE_DATABASE_URL", raising=False)
    return database_kind
