"""Rows of a large read streamed from the server (a server-side cursor) rather than held in memory:
the inventory's value-by-value pass. Binary results (bytea as bytes, no text decoding of numbers)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from psycopg import sql

from .connect import PgConnection

FETCH_ROWS = 5000


def stream(conn: PgConnection, query: sql.Composed, name: str,
           fetched: Callable[[int], None] | None = None) -> Iterator[Any]:
    """The rows of ``query`` through the server-side cursor ``name``, ``FETCH_ROWS`` a round trip,
    in a transaction of their own (a named cursor lives in one); ``fetched(n)`` after each fetch's
    ``n`` rows have been handed on."""
    with conn.transaction(), conn.cursor(name=name, binary=True) as cur:
        cur.itersize = FETCH_ROWS
        cur.execute(query)
        while rows := cur.fetchmany(FETCH_ROWS):  # a list per fetch: cheaper than row by row
            yield from rows
            if fetched is not None:
                fetched(len(rows))
