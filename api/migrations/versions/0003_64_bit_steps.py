"""Steps, restart counts and event sequence numbers as 64-bit integers: a job spec may ask for up
to 2^63 - 1 steps and the API takes cursors that large, which PostgreSQL's 32-bit ``integer``
refused (SQLite's integers were 64-bit already; its tables are rebuilt to match the models).

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

COLUMNS = {
    "jobs": ("step", "total_steps", "restarts", "log_seq"),
    "metrics": ("step",),
    "events": ("seq",),
}


def upgrade() -> None:
    for table, columns in COLUMNS.items():
        with op.batch_alter_table(table) as batch:
            for column in columns:
                batch.alter_column(column, type_=sa.BigInteger, existing_type=sa.Integer)


def downgrade() -> None:
    for table, columns in COLUMNS.items():
        with op.batch_alter_table(table) as batch:
            for column in columns:
                batch.alter_column(column, type_=sa.Integer, existing_type=sa.BigInteger)
