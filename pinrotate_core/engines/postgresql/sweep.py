"""The sweep's reads on PostgreSQL: values by key id in a table's text and bytea columns, counted in
the server (``regexp_matches`` over the values holding a marker, one sequential scan for every
column and every key at once). Counts only: no value leaves the server. Run inside the gate's
snapshot for one moment of the whole database."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from psycopg import sql

from .connect import PgConnection


def pattern_counts(conn: PgConnection, relation: sql.Composable, columns: Sequence[tuple[str, bool]],
                   marker: str, pattern: str) -> dict[str, Counter[str]]:
    """Values per key id (``pattern``'s first group) in each of ``columns`` ((name, is bytea)) of
    ``relation`` (``ONLY``: its children are swept on their own), among the values holding
    ``marker``; a bytea value holding the marker's bytes is read as text by ``encode(.., 'escape')``
    (ASCII kept as it is)."""
    if not columns:
        return {}
    values = []
    for i, (name, is_bytea) in enumerate(columns):
        ref = sql.Identifier("t", name)
        if is_bytea:
            # Only values holding the marker's bytes are turned into text (escape keeps ASCII as it is).
            text = sql.SQL("CASE WHEN position({m} IN {c}) > 0 THEN encode({c}, 'escape') END").format(
                m=sql.Literal(marker.encode("ascii")), c=ref)
        else:
            text = sql.SQL("{}::text").format(ref)
        values.append(sql.SQL("({}, {})").format(sql.Literal(i), text))
    query = sql.SQL(
        "SELECT s.i, m[1], count(*) FROM (SELECT v.i, v.txt FROM ONLY {rel} AS t "
        "CROSS JOIN LATERAL (VALUES {values}) AS v(i, txt) WHERE strpos(v.txt, {marker}) > 0) AS s "
        "CROSS JOIN LATERAL regexp_matches(s.txt, {pattern}, 'g') AS m GROUP BY 1, 2"
    ).format(rel=relation, values=sql.SQL(", ").join(values), marker=sql.Literal(marker),
             pattern=sql.Literal(pattern))
    out: dict[str, Counter[str]] = {}
    for i, key, n in conn.execute(query).fetchall():
        out.setdefault(columns[int(i)][0], Counter())[str(key)] += int(n)
    return out
