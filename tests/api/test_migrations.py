"""The store's schema migrations (api/migrations), on SQLite and PostgreSQL: a store written by
the last server without migrations, and one at each earlier revision, is upgraded keeping every
job, metric and event; the newest revision is exactly the models; replicas starting together
upgrade once."""

import threading
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.exc import DataError, OperationalError

from hpservice.api import migrations
from hpservice.api.store import Base, Store

OLD_STORE = Path(__file__).parent / "data" / "store_before_migrations.sql"


def _load_script(url: str, script: str) -> None:
    engine = create_engine(url)
    raw = engine.raw_connection()
    try:
        if url.startswith("sqlite"):
            raw.driver_connection.executescript(script)
        else:
            with raw.cursor() as cur:
                cur.execute(script)
        raw.commit()
    finally:
        raw.close()
        engine.dispose()


def _revision(url: str) -> str | None:
    engine = create_engine(url)
    with engine.connect() as conn:
        found = migrations.current(conn)
    engine.dispose()
    return found


def test_a_store_from_before_migrations_keeps_every_job_metric_and_event(store_url):
    """The fixture is a store that the stop-23 server (api/store.py at c23c5c7) wrote: a finished
    job with metrics, log lines, a checkpoint and its placement, a queued one, a lease."""
    _load_script(store_url, OLD_STORE.read_text())
    assert _revision(store_url) is None  # no alembic_version: from before migrations
    store = Store(store_url)
    assert _revision(store_url) == migrations.head()
    old = store.get_job("old-0001")
    assert old.state == "SUCCEEDED" and old.owner == "alice" and old.step == 5
    assert [h["state"] for h in old.history] == ["QUEUED", "STARTING", "RUNNING", "SUCCEEDED"]
    assert old.checkpoints == [{"step": 5, "path": "/data/old-0001/ckpt/step-5", "time": 1999.0}]
    assert old.placement == [{"rank": 0, "node": "abc", "ip": "127.0.0.1"}]
    assert [r["loss"] for r in store.metrics("old-0001", 0)] == [9.0, 8.0, 7.0, 6.0, 5.0]
    lines, _ = store.logs("old-0001", None, None)
    assert [line["line"] for line in lines] == ["step 1", "step 2", "step 3"]
    events = store.events("old-0001", 0)
    assert [seq for seq, _, _ in events] == list(range(1, len(events) + 1)) and len(events) == 13
    assert store.submitted_spec("old-0001")["name"] == "old"
    assert store.create_job("x", "old", "alice", {}, 5, "key-1")[0].id == "old-0001"  # its idempotency key holds
    # What the new revision added works on the old rows.
    assert store.jobs_in(("QUEUED",))[0].cancel_requested is False
    assert store.request_cancel("old-0002") == "cancelled"
    assert store.get_job("old-0002").state == "CANCELLED"
    assert store.events("old-0001", 13) == [] and store.events("old-0002", 1)[0][2]["state"] == "CANCELLED"


def test_a_store_at_the_previous_revision_upgrades_keeping_its_rows(store_url):
    engine = create_engine(store_url)
    migrations.upgrade(engine, "0001")
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO jobs (id, name, owner, state, message, spec_json, created_at, updated_at, step, "
                "total_steps, restarts, restart_reasons_json, history_json, checkpoints_json, started, log_time) "
                "VALUES ('j', 'n', 'alice', 'RUNNING', 'm', '{}', 1.0, 2.0, 3, 10, 0, '[]', '[]', '[]', 1, 0.0)"
            )
        )
        conn.execute(text("INSERT INTO metrics VALUES ('j', 3, '{\"step\": 3}')"))
    engine.dispose()
    store = Store(store_url)
    assert _revision(store_url) == migrations.head() != "0001"
    job = store.get_job("j")
    assert job.state == "RUNNING" and job.step == 3 and store.metrics("j", 0) == [{"step": 3}]
    assert store.jobs_in(("RUNNING",))[0].cancel_requested is False  # the new column's default
    assert store.request_cancel("j") == "requested"  # launched: the request is stored
    assert store.jobs_in(("RUNNING",))[0].cancel_requested is True


def test_a_downgrade_to_the_baseline_keeps_the_rows_and_refuses_values_it_cannot_hold(store_url):
    store = Store(store_url)
    store.create_job("j", "n", "alice", {"name": "n"}, 100, None)
    store.add_metrics("j", [{"step": 7, "loss": 1.0}])
    store.engine.dispose()
    engine = create_engine(store_url)
    migrations.downgrade(engine, "0001")
    assert _revision(store_url) == "0001"
    store = Store(store_url)  # and up again
    assert store.get_job("j").total_steps == 100 and store.metrics("j", 0) == [{"step": 7, "loss": 1.0}]
    assert _revision(store_url) == migrations.head()
    if store_url.startswith("postgresql"):  # 32-bit integers there before 0003: refused, nothing lost
        store.create_job("big", "n", "alice", {"name": "n"}, 2**40, None)
        with pytest.raises(DataError):
            migrations.downgrade(engine, "0001")
        assert _revision(store_url) == migrations.head() and store.get_job("big").total_steps == 2**40
    engine.dispose()


def test_the_newest_revision_is_exactly_the_models(store_url):
    """A model change without a revision fails here (Alembic's autogenerate comparison)."""
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    Store(store_url)
    engine = create_engine(store_url)
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    engine.dispose()
    assert diff == []


def test_replicas_starting_together_upgrade_once(store_url):
    errors, stores = [], []

    def open_store():
        try:
            stores.append(Store(store_url))
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=open_store) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == [] and len(stores) == 4
    assert _revision(store_url) == migrations.head()
    stores[0].create_job("a", "n", "alice", {}, 1, None)
    assert stores[3].get_job("a").state == "QUEUED"


def test_a_database_that_is_not_a_store_is_refused_not_altered(store_url):
    engine = create_engine(store_url)
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE jobs (id VARCHAR(80) PRIMARY KEY, payload TEXT)"))
    engine.dispose()
    with pytest.raises((RuntimeError, OperationalError), match="is this database an hpservice store"):
        Store(store_url)
    assert _revision(store_url) is None
