"""The PostgreSQL room's streamed read (``ROOM.stream``: a server-side cursor), on real servers."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql

from pinrotate_core.engines.postgresql import stream
from pinrotate_core.engines.postgresql.room import ROOM


def test_stream_hands_every_row_on_in_fetches_binary_and_ends_its_transaction(
        pg_conn: psycopg.Connection[Any]) -> None:
    rows = 2 * stream.FETCH_ROWS + 7
    fetched: list[int] = []
    got = list(ROOM.stream(pg_conn, sql.SQL("SELECT i, int4send(i) FROM generate_series(1, {}) AS i").format(
        sql.Literal(rows)), "pinrotate_stream_test", fetched.append))
    assert [r[0] for r in got] == list(range(1, rows + 1))
    assert got[0][1] == b"\x00\x00\x00\x01"  # bytea as bytes (binary results)
    assert fetched == [stream.FETCH_ROWS, stream.FETCH_ROWS, 7]
    assert pg_conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert list(ROOM.stream(pg_conn, sql.SQL("SELECT 1 WHERE false"), "pinrotate_stream_test")) == []
