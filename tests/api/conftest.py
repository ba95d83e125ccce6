"""The API suite runs on each database the store supports: every test here runs once on SQLite
and once on a fresh database of the session's PostgreSQL (``HPSERVICE_DATABASE_URL``, which
``Settings`` and the ``hpservice serve`` processes the tests start read), unless it is marked
``@pytest.mark.databases(...)`` with the ones it is about, or takes ``store_url`` itself.

The kind is a module-scoped parameter (``database_kind``), so a module's tests run on one
database and then on the other, and a module-scoped server (test_service_e2e's) is started once
per kind, on a database of its own."""

from __future__ import annotations

import pytest

DATABASES = ("sqlite", "postgresql")


def pytest_generate_tests(metafunc):
    if "store_url" in metafunc.fixturenames:
        return  # parametrized by its own fixture
    marker = metafunc.definition.get_closest_marker("databases")
    metafunc.parametrize("database_kind", marker.args if marker else DATABASES, indirect=True, scope="module")


@pytest.fixture(scope="module")
def database_kind(request) -> str:
    """``sqlite`` or ``postgresql``: the database this module's tests run on now."""
    return getattr(request, "param", "sqlite")


@pytest.fixture(autouse=True)
def database(database_kind, request, monkeypatch) -> str:
    """The database this test's servers use by default: a SQLite file in their data dir, or a
    fresh database on the session's PostgreSQL."""
    if database_kind == "postgresql":
        monkeypatch.setenv("HPSERVICE_DATABASE_URL", request.getfixturevalue("postgres").new_database())
    else:
        monkeypatch.delenv("HPSERVICE_DATABASE_URL", raising=False)
    return database_kind
