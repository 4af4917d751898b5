"""The ledger: one SQLite file (apsw, WAL) with versioned schema migrations.

These functions are blocking; only the Ledger actor calls them, through `trio.to_thread`.
`PRAGMA user_version` holds the schema version; `open_ledger` applies every missing migration in
one transaction each, so an old ledger is upgraded at boot and a failed step leaves it as it was.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import apsw

MIGRATIONS: list[tuple[str, str]] = [
    (
        "events: what happened to the daemon and its engines",
        """
        CREATE TABLE events (
            id     INTEGER PRIMARY KEY,
            ts     REAL NOT NULL,
            kind   TEXT NOT NULL,
            model  TEXT,
            detail TEXT NOT NULL DEFAULT '{}'
        );
        """,
    ),
    (
        "per-key daily usage, and events queried by kind",
        """
        CREATE INDEX events_kind_ts ON events(kind, ts);
        CREATE TABLE key_usage (
            key_name TEXT NOT NULL,
            day      TEXT NOT NULL,
            requests INTEGER NOT NULL DEFAULT 0,
            tokens   INTEGER NOT NULL DEFAULT 0,
            PRIMARY KEY (key_name, day)
        );
        """,
    ),
    (
        "benchmark results (bench, engine update gate)",
        """
        CREATE TABLE benchmarks (
            id         INTEGER PRIMARY KEY,
            ts         REAL NOT NULL,
            model      TEXT NOT NULL,
            engine_tag TEXT NOT NULL,
            pp_tps     REAL,
            tg_tps     REAL,
            detail     TEXT NOT NULL DEFAULT '{}'
        );
        CREATE INDEX benchmarks_model ON benchmarks(model, ts);
        """,
    ),
    (
        "the durable job plane: jobs, their event trails, uploaded files, batch items, stored responses",
        """
        CREATE TABLE jobs (
            id       TEXT PRIMARY KEY,
            kind     TEXT NOT NULL,
            model    TEXT,
            state    TEXT NOT NULL,
            key_name TEXT,
            created  REAL NOT NULL,
            updated  REAL NOT NULL,
            started  REAL,
            finished REAL,
            request  TEXT NOT NULL DEFAULT '{}',
            result   TEXT,
            artifact TEXT,
            error    TEXT,
            progress TEXT,
            archived REAL
        );
        CREATE INDEX jobs_updated ON jobs(updated);
        CREATE TABLE job_events (
            job_id TEXT NOT NULL,
            seq    INTEGER NOT NULL,
            ts     REAL NOT NULL,
            kind   TEXT NOT NULL,
            detail TEXT NOT NULL DEFAULT '{}',
            PRIMARY KEY (job_id, seq)
        );
        CREATE TABLE files (
            id       TEXT PRIMARY KEY,
            purpose  TEXT NOT NULL,
            filename TEXT NOT NULL,
            bytes    INTEGER NOT NULL,
            created  REAL NOT NULL,
            key_name TEXT,
            path     TEXT NOT NULL
        );
        CREATE TABLE batch_items (
            job_id    TEXT NOT NULL,
            idx       INTEGER NOT NULL,
            custom_id TEXT NOT NULL,
            outcome   TEXT NOT NULL,
            body      TEXT NOT NULL,
            PRIMARY KEY (job_id, idx)
        );
        CREATE TABLE responses (
            id           TEXT PRIMARY KEY,
            created      REAL NOT NULL,
            expires      REAL NOT NULL,
            key_name     TEXT,
            conversation TEXT,
            previous_id  TEXT,
            body         TEXT NOT NULL,
            messages     TEXT NOT NULL
        );
        CREATE INDEX responses_conversation ON responses(conversation, created);
        """,
    ),
]

SCHEMA_VERSION = len(MIGRATIONS)


class LedgerTooNew(Exception):
    pass


def schema_version(connection: apsw.Connection) -> int:
    row = connection.execute("PRAGMA user_version").fetchone()
    assert row is not None  # the pragma always answers one row
    return int(row[0])


def migrate(connection: apsw.Connection, target: int = SCHEMA_VERSION) -> list[int]:
    """Apply migrations up to `target`; returns the versions applied."""
    current = schema_version(connection)
    if current > SCHEMA_VERSION:
        raise LedgerTooNew(
            f"the ledger is at schema v{current}, newer than this Blazar knows (v{SCHEMA_VERSION}); "
            "upgrade Blazar, or move ledger.sqlite aside to start a fresh one"
        )
    applied = []
    for version in range(current + 1, target + 1):
        _purpose, sql = MIGRATIONS[version - 1]
        with connection:
            connection.execute(sql)
            connection.execute(f"PRAGMA user_version = {version}")
        applied.append(version)
    return applied


def open_ledger(path: Path) -> apsw.Connection:
    path.parent.mkdir(parents=True, exist_ok=True)
    connection = apsw.Connection(str(path))
    connection.execute("PRAGMA journal_mode = WAL")
    connection.execute("PRAGMA synchronous = NORMAL")
    connection.execute("PRAGMA foreign_keys = ON")
    connection.set_busy_timeout(5000)
    migrate(connection)
    return connection


def execute(connection: apsw.Connection, sql: str, params: tuple[Any, ...] = ()) -> int:
    with connection:
        connection.execute(sql, params)
    return connection.last_insert_rowid()


def query(connection: apsw.Connection, sql: str, params: tuple[Any, ...] = ()) -> list[dict[str, Any]]:
    cursor = connection.execute(sql, params)
    try:
        names = [d[0] for d in cursor.getdescription()]
    except apsw.ExecutionCompleteError:
        return []
    return [dict(zip(names, row, strict=True)) for row in cursor]
