"""Shared fixtures: persistent gloo rank pools (one per world size in each pytest process: each
xdist worker has its own), reused across tests.

A multi-rank test calls ``ranks(n).run(fn, *args)``: ``fn`` (a module-level function) runs on
every rank of an ``n``-rank gloo world on free loopback ports; a failing rank fails the test
with its traceback and a hung call is killed after its timeout (see ``hpservice.launch``).
"""

from __future__ import annotations

import pytest

from hpservice.launch import RankPool

pytest_plugins = ["tests._cpu_cost"]  # each test's CPU seconds, its process tree's, listed at the end


class _Pools:
    def __init__(self):
        self._pools: dict[int, RankPool] = {}

    def __call__(self, world_size: int) -> RankPool:
        pool = self._pools.get(world_size)
        if pool is None:
            pool = self._pools[world_size] = RankPool(world_size)
        return pool

    def close(self) -> None:
        for pool in self._pools.values():
            pool.__exit__(None, None, None)


@pytest.fixture(scope="session")
def ranks():
    pools = _Pools()
    yield pools
    pools.close()


# The files that take longest, longest first (from HPSERVICE_TEST_COSTS, on 2 cores). They run
# before the others so that scripts/test's two workers, which take whole files in collection order
# (xdist's --dist loadfile --no-loadscope-reorder), end together; xdist's own reorder (most tests
# first) left 40-second one-test files for the end, with one worker idle. Only speed depends on it.
LONGEST_FIRST = (
    "tests/actors/test_multinode.py",
    "tests/train/test_trainer.py",
    "tests/actors/test_ray_jobs.py",
    "tests/api/test_service_e2e.py",
    "tests/api/test_schemathesis.py",
    "tests/parallel/test_pipeline_training.py",
    "tests/models/test_moe.py",
    "tests/bench/test_bench_service.py",
    "tests/bench/test_bench_trainer.py",
    "tests/test_lora_chat_example.py",
    "tests/test_dpo_example.py",
    "tests/test_cli_run.py",
    "tests/test_finetune_example.py",
    "tests/api/test_serve_restart.py",
    "tests/parallel/test_context_parallel.py",
    "tests/api/test_replicas.py",
    "tests/actors/test_supervisor.py",
    "tests/compat/test_dtensor_recipes.py",
    "tests/test_sft_chat_example.py",
    "tests/models/test_lora.py",
    "tests/memory/test_estimate.py",
    "tests/memory/test_plan.py",
)


@pytest.hookimpl(trylast=True)  # after pytest's own reordering (module-scoped parameters) within files
def pytest_collection_modifyitems(config, items):
    """The files of ``LONGEST_FIRST`` first, in its order, then the rest as collected; each file's
    tests keep their order. ``@pytest.mark.cuda`` tests skip, saying why, on a machine without a
    CUDA GPU."""
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # stable
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none on this machine); scripts/gpu-check runs these on one")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def postgres():
    """A PostgreSQL server for this test session (tests/_postgres.py), stopped at the end."""
    from tests._postgres import PostgresServer, postgres_bindir

    bindir = postgres_bindir()
    try:
        import psycopg  # noqa: F401
    except ImportError:
        bindir = None
    if bindir is None:
        pytest.skip("PostgreSQL is not installed (apt-get install postgresql; pip install psycopg[binary]): .ci/run has both")
    server = PostgresServer(bindir)
    yield server
    server.stop()


DATABASES = ("sqlite", "postgresql")


def pytest_generate_tests(metafunc):
    """A test that needs a database (``database_kind``, or ``store_url`` which takes it) runs on
    each one the store supports, unless marked ``@pytest.mark.databases(...)`` with the ones it
    is about. Module-scoped: a module's tests run on one database, then on the other, so a
    module-scoped server is started once per database."""
    if "database_kind" in metafunc.fixturenames:
        marker = metafunc.definition.get_closest_marker("databases")
        metafunc.parametrize("database_kind", marker.args if marker else DATABASES, indirect=True, scope="module")


@pytest.fixture(scope="module")
def database_kind(request) -> str:
    """``sqlite`` or ``postgresql``: the database this module's tests run on now."""
    return request.param


@pytest.fixture
def store_url(database_kind, request, tmp_path) -> str:
    """The store's database for one test: a SQLite file, or a fresh database on the session's
    PostgreSQL."""
    if database_kind == "sqlite":
        return f"sqlite:///{tmp_path / 'store.db'}"
    return request.getfixturevalue("postgres").new_database()
