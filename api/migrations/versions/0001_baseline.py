"""The schema of the last server without migrations (stop 23); safe on a store that server wrote.

A store from before migrations has no ``alembic_version`` table, so Alembic runs this revision on
it too: it creates only the tables that are missing and adds only the columns an older store
lacks (every column added before migrations was nullable), then Alembic records the revision.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def _tables() -> sa.MetaData:
    """The baseline's tables, frozen here: the models in api/store.py move on, this does not."""
    md = sa.MetaData()
    sa.Table(
        "jobs", md,
        sa.Column("id", sa.String(80), primary_key=True),
        sa.Column("name", sa.String(80), nullable=False, index=True),
        sa.Column("owner", sa.String(80), nullable=False, index=True),
        sa.Column("state", sa.String(16), nullable=False, index=True),
        sa.Column("message", sa.Text, nullable=False),
        sa.Column("spec_json", sa.Text, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False, index=True),
        sa.Column("updated_at", sa.Float, nullable=False),
        sa.Column("step", sa.Integer, nullable=False),
        sa.Column("total_steps", sa.Integer, nullable=False),
        sa.Column("restarts", sa.Integer, nullable=False),
        sa.Column("restart_reasons_json", sa.Text, nullable=False),
        sa.Column("history_json", sa.Text, nullable=False),
        sa.Column("checkpoints_json", sa.Text, nullable=False),
        sa.Column("idempotency_key", sa.String(200), nullable=True),
        sa.Column("request_hash", sa.String(64), nullable=True),
        sa.Column("submitted_json", sa.Text, nullable=True),
        sa.Column("started", sa.Integer, nullable=False),
        sa.Column("log_time", sa.Float, nullable=False),
        sa.Column("log_seq", sa.Integer, nullable=True),
        sa.Column("placement_json", sa.Text, nullable=True),
        sa.UniqueConstraint("owner", "idempotency_key"),
    )  # fmt: skip
    sa.Table(
        "metrics", md,
        sa.Column("job_id", sa.String(80), primary_key=True),
        sa.Column("step", sa.Integer, primary_key=True),
        sa.Column("record_json", sa.Text, nullable=False),
    )  # fmt: skip
    sa.Table(
        "events", md,
        sa.Column("job_id", sa.String(80), primary_key=True),
        sa.Column("seq", sa.Integer, primary_key=True),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("data_json", sa.Text, nullable=False),
    )  # fmt: skip
    sa.Table(
        "leases", md,
        sa.Column("name", sa.String(40), primary_key=True),
        sa.Column("holder", sa.String(120), nullable=False),
        sa.Column("expires_at", sa.Float, nullable=False),
    )  # fmt: skip
    sa.Table(
        "heartbeat", md,
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("at", sa.Float, nullable=False),
    )  # fmt: skip
    return md


def upgrade() -> None:
    bind = op.get_bind()
    existing = set(sa.inspect(bind).get_table_names())
    for table in _tables().sorted_tables:
        if table.name not in existing:
            table.create(bind)
            continue
        have = {c["name"] for c in sa.inspect(bind).get_columns(table.name)}
        for column in table.columns:
            if column.name not in have:
                if not column.nullable:
                    raise RuntimeError(
                        f"table {table.name} lacks column {column.name}, which no hpservice store ever lacked: "
                        "is this database an hpservice store?"
                    )
                op.add_column(table.name, sa.Column(column.name, column.type, nullable=True))


def downgrade() -> None:
    for table in reversed(_tables().sorted_tables):
        op.drop_table(table.name)
