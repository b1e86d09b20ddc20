"""The sweep's reads on MySQL / MariaDB: every value of a table's candidate columns, or only those
holding a marker (``FPC1:``, ``vault:v``), streamed from the server without holding the table in
memory. The server filters with ``LOCATE`` (a superset: a ``_ci`` collation also matches another
case); the caller decides exactly, with its own patterns, as ``regexp_matches`` does on
PostgreSQL. Run inside ``GateChecks.snapshot`` for one moment of the whole server."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pymysql
from pymysql.cursors import SSCursor

from ...errors import DatabaseError
from ..base.checks import CandidateColumn
from .connect import MySqlConnection, describe_db_error
from .gate import changed_since_snapshot
from .operations import OPERATIONS as ops

FETCH_ROWS = 1000


def stream_values(conn: MySqlConnection, columns: Sequence[CandidateColumn], marker: str | None = None,
                  ) -> Iterator[tuple[int, str | bytes]]:
    """(index into ``columns``, value) for every non-NULL value of ``columns`` (all of one table),
    or only for values holding ``marker``. Unbuffered: the connection runs nothing else until the
    iterator is exhausted or closed."""
    if not columns:
        return
    schema, table = columns[0].schema, columns[0].table
    if any((c.schema, c.table) != (schema, table) for c in columns):
        raise ValueError("stream_values reads the columns of one table at a time")
    refs = [ops.quote(c.column) for c in columns]
    params: tuple[object, ...] = ()
    if marker is None:
        where = " OR ".join(f"{r} IS NOT NULL" for r in refs)
    else:
        # A binary column is searched for the marker's bytes, a text column for its characters.
        where = " OR ".join(f"LOCATE(%s, {r}) > 0" for r in refs)
        params = tuple(marker.encode() if c.binary else marker for c in columns)
    statement = f"SELECT {', '.join(refs)} FROM {ops.relation(schema, table)} WHERE {where}"
    cursor = conn.cursor(SSCursor)
    try:
        cursor.execute(statement, params)
        while True:
            rows = cursor.fetchmany(FETCH_ROWS)
            if not rows:
                return
            for row in rows:
                for i, value in enumerate(row):
                    if value is None:
                        continue
                    if marker is not None and (marker.encode() if isinstance(value, bytes) else marker).lower() \
                            not in value.lower():
                        continue
                    yield i, value
    except pymysql.err.MySQLError as e:
        changed = changed_since_snapshot(e)
        if changed is not None:
            raise DatabaseError(f"{schema}.{table} was {changed}: what it held at the snapshot cannot be read; "
                                "look again") from None
        raise DatabaseError(f"cannot read {schema}.{table} for the sweep ({describe_db_error(e)})") from None
    finally:
        cursor.close()
