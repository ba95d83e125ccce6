"""The API suite runs on each database the store supports: every test here runs once on SQLite
and once on a fresh database of the session's PostgreSQL (``HPSERVICE_DATABASE_URL``, which
``Settings`` and the ``hpservice serve`` processes the tests start read), unless it is marked
``@pytest.mark.databases(...)`` with the ones it is about, or takes ``store_url`` itself."""

from __future__ import annotations

import pytest

DATABASES = ("sqlite", "postgresql")


def pytest_generate_tests(metafunc):
    if "store_url" in metafunc.fixturenames:
        return  # parametrized by its own fixture
    marker = metafunc.definition.get_closest_marker("databases")
    metafunc.parametrize("database", marker.args if marker else DATABASES, indirect=True)


@pytest.fixture(autouse=True)
def database(request, monkeypatch):
    """The database this test's servers use by default: ``sqlite`` (a file in their data dir) or
    ``postgresql``."""
    kind = getattr(request, "param", "sqlite")
    if kind == "postgresql":
        monkeypatch.setenv("HPSERVICE_DATABASE_URL", request.getfixturevalue("postgres").new_database())
    else:
        monkeypatch.delenv("HPSERVICE_DATABASE_URL", raising=False)
    return kind
