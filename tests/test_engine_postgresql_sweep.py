"""The PostgreSQL room's sweep read (``engines/postgresql/sweep.py``): key ids counted in the server
in text and bytea columns, on real servers. The gate's use of it: tests/test_gate_discover.py."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql

from pinrotate_core.engines.postgresql import sweep
from pinrotate_core.gate.sweep_reads import FPC1_FIND, TRANSIT_FIND


def test_pattern_counts_counts_every_match_per_key_in_text_and_bytea_and_only_this_table(
        pg_conn: psycopg.Connection[Any]) -> None:
    pg_conn.execute('CREATE TABLE "co%py" (id int PRIMARY KEY, t text, b bytea, other text)')
    pg_conn.execute('CREATE TABLE "co%py_child" () INHERITS ("co%py")')
    pg_conn.execute('INSERT INTO "co%py" VALUES '
                    "(1, 'FPC1:SM4:k1:abc', convert_to('x FPC1:AES:k2:zz', 'UTF8'), 'FPC1:SM4:k9:'), "
                    "(2, '[\"FPC1:SM4:k1:a\", \"FPC1:SM4:k2:b\"]', NULL, NULL), "
                    "(3, 'vault:v1:abc', convert_to('FPC1 no key', 'UTF8'), NULL)")
    pg_conn.execute("""INSERT INTO "co%py_child" VALUES (4, 'FPC1:SM4:k1:in_child', NULL, NULL)""")
    relation = sql.Identifier("public", "co%py")
    counts = sweep.pattern_counts(pg_conn, relation, [("t", False), ("b", True)], "FPC1:", FPC1_FIND)
    assert counts == {"t": {"k1": 2, "k2": 1}, "b": {"k2": 1}}  # "other" not asked; the child not read
    assert sweep.pattern_counts(pg_conn, relation, [("t", False)], "vault:v", TRANSIT_FIND) == {"t": {"1": 1}}
    assert sweep.pattern_counts(pg_conn, relation, [], "FPC1:", FPC1_FIND) == {}
