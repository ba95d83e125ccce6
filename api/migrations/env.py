"""Alembic's environment: migrations run on the connection ``upgrade`` passes (never from a URL in
a config file), inside its transaction."""

from alembic import context

from hpservice.api.store import Base

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
