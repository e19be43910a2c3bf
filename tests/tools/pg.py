"""PostgreSQL for the tool tests: the machine's server (127.0.0.1:5432, trust auth, user
``postgres``), a fresh database per test module (``ratchet_t_<random>``, dropped after),
and a fresh schema per test inside it, holding the refunds table the effects write.

When the server (or the psycopg driver) is missing the tests skip, saying why, unless
RATCHET_REQUIRE_POSTGRES=1, where they fail instead.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest

HOST, PORT, USER = "127.0.0.1", 5432, "postgres"


def _required() -> bool:
    return os.environ.get("RATCHET_REQUIRE_POSTGRES") == "1"


def require_driver() -> None:
    """Skip the calling test module when psycopg is not installed (fail when required)."""
    try:
        import psycopg  # noqa: F401
    except ImportError:
        if _required():
            pytest.fail("psycopg is required here (RATCHET_REQUIRE_POSTGRES=1)", pytrace=False)
        pytest.skip(
            "the PostgreSQL tool tests need psycopg (pip install psycopg[binary])",
            allow_module_level=True,
        )


def dsn(dbname: str) -> str:
    return f"host={HOST} port={PORT} user={USER} dbname={dbname} connect_timeout=5"


@contextmanager
def fresh_database() -> Iterator[str]:
    """A fresh database (its connection string), dropped after; skips or fails (see the
    module docstring) when the server cannot be reached. A test module's fixture wraps it
    (scope="module")."""
    import psycopg
    from psycopg import sql

    try:
        admin = psycopg.connect(dsn("postgres"), autocommit=True)
    except psycopg.OperationalError as exc:
        reason = f"PostgreSQL at {HOST}:{PORT} is unreachable ({type(exc).__name__})"
        if _required():
            pytest.fail(f"{reason}; it is required here (RATCHET_REQUIRE_POSTGRES=1)")
        pytest.skip(reason)
    name = f"ratchet_t_{secrets.token_hex(6)}"
    admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield dsn(name)
    finally:
        admin.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))
        admin.close()


@dataclass
class Db:
    """One test's schema in the module's database, and what the tests read from it."""

    dsn: str
    schema: str

    def query(self, text: str, *params: Any) -> list[tuple[Any, ...]]:
        import psycopg

        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute(f"SET search_path TO {self.schema}")
            return list(conn.execute(text, params).fetchall())

    def count(self, table: str) -> int:
        return int(self.query(f"SELECT count(*) FROM {table}")[0][0])

    @property
    def refunds(self) -> int:
        return self.count("refunds")

    def fences(self, run_id: str) -> dict[str, Any]:
        rows = self.query(
            "SELECT lease_version, state_version, store_epoch, refused_stale, refused_epoch "
            "FROM ratchet_fences WHERE run_id = %s",
            run_id,
        )
        if not rows:
            return {}
        lv, sv, epoch, stale, refused_epoch = rows[0]
        return {
            "lease_version": lv,
            "state_version": sv,
            "store_epoch": epoch,
            "refused_stale": stale,
            "refused_epoch": refused_epoch,
        }


def fresh_schema(database: str) -> Db:
    """A fresh schema in ``database`` with an empty ``refunds`` table (the tool's own
    tables are created there by the tool, on first use)."""
    import psycopg

    schema = f"t_{secrets.token_hex(4)}"
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
        conn.execute(
            f"CREATE TABLE {schema}.refunds (id bigserial PRIMARY KEY, "
            "order_id text NOT NULL, amount_cents bigint NOT NULL, idempotency_key text)"
        )
    return Db(database, schema)
