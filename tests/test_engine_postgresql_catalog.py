"""The PostgreSQL room's catalog (``engines/postgresql/catalog.py``): the pieces ``targets.py``
resolves a target over, and ``ROOM.catalog.read_table`` as the engine-neutral ``TableCatalog``,
on real servers. The BLOCKED rules over them are tested in tests/test_targets.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from psycopg import sql

from pinrotate_core.engines.postgresql import catalog
from pinrotate_core.engines.postgresql.room import ROOM
from tests.helpers import url_as


def make_table(conn: psycopg.Connection[Any]) -> None:
    conn.execute("""CREATE TABLE "we%ird" (
                        id bigint PRIMARY KEY,
                        serial_no int GENERATED ALWAYS AS IDENTITY,
                        name_cipher varchar(40),
                        name_len int GENERATED ALWAYS AS (length(name_cipher)) STORED,
                        note text)""")
    conn.execute("CREATE UNIQUE INDEX we_note ON \"we%ird\" (note)")
    conn.execute("""CREATE FUNCTION keep() RETURNS trigger LANGUAGE plpgsql AS $$
                    BEGIN RETURN NEW; END $$""")
    conn.execute('CREATE TRIGGER before_any BEFORE UPDATE ON "we%ird" FOR EACH ROW EXECUTE FUNCTION keep()')
    conn.execute('CREATE TRIGGER after_always AFTER UPDATE ON "we%ird" FOR EACH ROW EXECUTE FUNCTION keep()')
    conn.execute('ALTER TABLE "we%ird" ENABLE ALWAYS TRIGGER after_always')
    conn.execute('CREATE TRIGGER replica_only AFTER UPDATE ON "we%ird" FOR EACH ROW EXECUTE FUNCTION keep()')
    conn.execute('ALTER TABLE "we%ird" ENABLE REPLICA TRIGGER replica_only')
    conn.execute('CREATE TRIGGER of_note AFTER UPDATE OF note ON "we%ird" FOR EACH ROW EXECUTE FUNCTION keep()')
    conn.execute('CREATE RULE no_op AS ON UPDATE TO "we%ird" DO ALSO NOTIFY we')


def test_the_pieces_read_columns_key_kind_triggers_rules_and_unique_indexes(
        pg_conn: psycopg.Connection[Any]) -> None:
    make_table(pg_conn)
    regname = catalog.relation_text(pg_conn, None, "we%ird")
    assert catalog.table(pg_conn, catalog.relation_text(pg_conn, None, "absent")) is None
    found = catalog.table(pg_conn, regname)
    assert found is not None
    assert found.primary_key == ("id",) and found.by_ctid and not found.inherited
    assert not found.in_recovery and not found.read_only
    assert found.columns["name_cipher"].type_name == "varchar"
    assert found.columns["name_cipher"].sql_type == "character varying(40)"
    assert found.columns["name_cipher"].char_length == 40
    assert found.columns["name_len"].generated and not found.columns["note"].generated
    assert set(found.unwritable) == {"serial_no", "name_len"}
    assert "identity" in found.unwritable["serial_no"] and "generated" in found.unwritable["name_len"]

    fired = catalog.update_triggers(pg_conn, found.oid, ["name_cipher"])
    assert [(t.name, t.mode, t.before) for t in fired] == [
        ("after_always", "A", False), ("before_any", "O", True), ("replica_only", "R", False),
        ("rule no_op", "O", False)]
    assert all(t.on_table for t in fired)
    assert "of_note" in [t.name for t in catalog.update_triggers(pg_conn, found.oid, ["note"])]

    assert not catalog.in_unique_index(pg_conn, found.oid, ["name_cipher"])
    assert catalog.in_unique_index(pg_conn, found.oid, ["name_cipher", "note"])
    assert catalog.may_silence_triggers(pg_conn)  # the test server's superuser
    assert catalog.row_security(pg_conn, found.oid) is None


def test_a_least_privilege_role_is_told_what_it_lacks_and_may_not_silence_triggers(
        database_url: str, pg_conn: psycopg.Connection[Any], make_role: Callable[[str], str]) -> None:
    make_table(pg_conn)
    role = make_role("app")
    pg_conn.execute(sql.SQL('GRANT SELECT (id, name_cipher), UPDATE (name_cipher) ON "we%ird" TO {}')
                    .format(sql.Identifier(role)))
    with psycopg.connect(url_as(database_url, role), autocommit=True) as conn:
        found = catalog.table(conn, catalog.relation_text(conn, None, "we%ird"))
        assert found is not None
        missing, who = catalog.missing_privileges(
            conn, found.oid, [("id", "SELECT"), ("note", "SELECT"), ("name_cipher", "UPDATE"), ("note", "UPDATE")])
        assert missing == (("SELECT", "note"), ("UPDATE", "note")) and who == role
        assert catalog.current_role(conn) == role
        assert not catalog.may_silence_triggers(conn)
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE

        read = ROOM.catalog.read_table(conn, None, "we%ird", select=["id", "note"], update=["name_cipher"])
        assert read is not None
        assert (read.schema, read.table, read.role) == ("public", "we%ird", role)
        assert read.primary_key == ("id",) and read.missing_privileges == (("SELECT", "note"),)
        assert read.read_only == ()
        # what an UPDATE of name_cipher fires in the normal mode, BEFORE or AFTER
        assert [(t.name, t.timing) for t in read.update_triggers] == [
            ("after_always", "AFTER"), ("before_any", "BEFORE"), ("rule no_op", "AFTER")]
        assert any("serial_no" in n and "identity" in n for n in read.notes)
        assert ROOM.catalog.read_table(conn, "public", "absent") is None


def test_row_security_names_the_role_it_applies_to(
        database_url: str, pg_conn: psycopg.Connection[Any], make_role: Callable[[str], str]) -> None:
    make_table(pg_conn)
    role = make_role("app")
    pg_conn.execute(sql.SQL('GRANT SELECT ON "we%ird" TO {}').format(sql.Identifier(role)))
    pg_conn.execute('ALTER TABLE "we%ird" ENABLE ROW LEVEL SECURITY')
    with psycopg.connect(url_as(database_url, role), autocommit=True) as conn:
        found = catalog.table(conn, catalog.relation_text(conn, None, "we%ird"))
        assert found is not None
        security = catalog.row_security(conn, found.oid)
        assert security == catalog.RowSecurity(role, owner=False, forced=False)
        read = ROOM.catalog.read_table(conn, None, "we%ird")
        assert read is not None and f"row-level security applies to role {role}" in read.notes


@pytest.mark.parametrize(("disable", "wait", "text"), [
    (False, None, "BEGIN ISOLATION LEVEL READ COMMITTED"),
    (True, 0.05, ("BEGIN ISOLATION LEVEL READ COMMITTED; SET LOCAL lock_timeout = '50ms'; "
                  "SET LOCAL session_replication_role = replica")),
])
def test_a_writing_batch_begins_read_committed_with_its_settings(
        pg_conn: psycopg.Connection[Any], disable: bool, wait: float | None, text: str) -> None:
    assert catalog.writing_batch_begin(disable, wait).as_string(pg_conn) == text
