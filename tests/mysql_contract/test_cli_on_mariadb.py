"""The command line on a MySQL configuration (contract §4): an unreachable server is one line and
exit 4 for every command; ``grants`` prints MySQL GRANT statements and runs none of them.
"""

from __future__ import annotations

import re
import secrets
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.mariadb_server import MariaDbServer, free_port

from .pin_data import CIPHERS, install_pin
from .support import connect, file_keyring, one_line_error, query, rotate, write_toml

pytestmark = pytest.mark.mysql

PASSWORD = "Pw-not-to-be-shown-5c2e"


@pytest.mark.parametrize("scheme", ["mysql", "mariadb"])
def test_an_unreachable_server_is_one_line_and_exit_4_for_inventory_run_and_gate(tmp_path: Path, scheme: str) -> None:
    port = free_port()  # nobody listens there
    keys_file = file_keyring(tmp_path / "keys" / "keys.toml", 2, {1: secrets.token_bytes(32), 2: secrets.token_bytes(32)})
    cfg = write_toml(tmp_path / "pinrotate.toml", {
        "database": {"url": f"{scheme}://pinrotate:{PASSWORD}@127.0.0.1:{port}/forge"},
        "keys": {"provider": "file", "file": str(keys_file)},
        "targets": [{"name": "Person", "table": "persons", "key_version": "key_version",
                     "columns": ["first_name_cipher"], "format": "aesgcm"}],
    })
    runs = [(args, flag) for args in (["inventory"], ["run"], ["gate", "--retire", "1"]) for flag in ([], ["--json"])]
    with ThreadPoolExecutor(max_workers=3) as pool:  # none reaches a database: none changes what another sees
        results = list(pool.map(lambda r: rotate(*r[0], "--config", str(cfg), *r[1]), runs))
    for (args, flag), (code, out, err) in zip(runs, results, strict=True):
        assert PASSWORD not in err and PASSWORD not in str(out), args
        if flag:
            line = one_line_error(code, out, err, expected=4)
        else:
            assert code == 4 and "Traceback" not in err and out == "", (args, err)
            lines = [line for line in err.splitlines() if line.strip()]
            assert len(lines) == 1, (args, lines)
            line = lines[0]
        for part in ("forge", f"127.0.0.1:{port}", "pinrotate"):
            assert part in line, (args, part, line)


def _column_privileges(server: MariaDbServer, grantee: str, database: str) -> dict[str, dict[str, set[str]]]:
    with connect(server, None) as conn:
        found: dict[str, dict[str, set[str]]] = {}
        for table, column, privilege in query(
                conn, "SELECT TABLE_NAME, COLUMN_NAME, PRIVILEGE_TYPE FROM information_schema.COLUMN_PRIVILEGES"
                      " WHERE GRANTEE = %s AND TABLE_SCHEMA = %s", (grantee, database)):
            found.setdefault(table, {}).setdefault(privilege, set()).add(column)
        return found


def _wide_updates(server: MariaDbServer, grantee: str, database: str) -> list[tuple[str, ...]]:
    """UPDATE / INSERT / DELETE granted on a whole table of the database, the database or the server."""
    with connect(server, None) as conn:
        return [*query(conn, "SELECT TABLE_NAME, PRIVILEGE_TYPE FROM information_schema.TABLE_PRIVILEGES"
                             " WHERE GRANTEE = %s AND TABLE_SCHEMA = %s AND PRIVILEGE_TYPE IN ('UPDATE', 'INSERT',"
                             " 'DELETE')", (grantee, database)),
                *query(conn, "SELECT TABLE_SCHEMA, PRIVILEGE_TYPE FROM information_schema.SCHEMA_PRIVILEGES"
                             " WHERE GRANTEE = %s AND TABLE_SCHEMA = %s AND PRIVILEGE_TYPE IN ('UPDATE', 'INSERT',"
                             " 'DELETE')", (grantee, database)),
                *query(conn, "SELECT GRANTEE, PRIVILEGE_TYPE FROM information_schema.USER_PRIVILEGES"
                             " WHERE GRANTEE = %s AND PRIVILEGE_TYPE IN ('UPDATE', 'INSERT', 'DELETE')", (grantee,))]


def test_grants_on_a_mysql_configuration_prints_statements_a_dba_can_run_and_runs_none(
        mariadb: MariaDbServer, mysql_database: str, tmp_path: Path,
        prefect_api: str) -> None:
    pin = install_pin(mariadb, mysql_database, tmp_path, persons=2, documents=2)
    pin.promote_new_key()
    cfg = ("--config", str(pin.config()))
    role, auditor = f"pr_{secrets.token_hex(4)}", f"pa_{secrets.token_hex(4)}"
    grantee = {name: f"'{name}'@'%'" for name in (role, auditor)}
    with connect(mariadb, None) as root, root.cursor() as cur:
        for name in (role, auditor):
            cur.execute(f"CREATE USER '{name}'@'%'")
    try:
        shown_before = {name: _show_grants(mariadb, name) for name in grantee}
        code, doc, err = rotate("grants", "--role", role, *cfg, "--json")
        assert code == 0, err
        assert doc["role"] == role and doc["read_only"] is False
        statements = doc["statements"]
        # GRANTs, and the DDL of pinrotate's own bookkeeping for the owner to create ahead (as on
        # PostgreSQL); nothing else.
        verbs = {re.split(r"\s+", s.strip(), maxsplit=1)[0].upper() for s in statements}
        assert "GRANT" in verbs and verbs <= {"GRANT", "CREATE"}, statements
        code, text, err = rotate("grants", "--role", role, *cfg)
        assert code == 0 and text.strip() == "\n".join(statements).strip()
        code, ro, err = rotate("grants", "--role", auditor, "--read-only", *cfg, "--json")
        assert code == 0, err
        assert ro["read_only"] is True
        ro_grants = [s for s in ro["statements"] if s.strip().upper().startswith("GRANT")]
        assert ro_grants and not any(re.search(r"\b(UPDATE|INSERT|DELETE|ALL)\b", s, re.IGNORECASE) for s in ro_grants)
        # Printed, never run.
        assert {name: _show_grants(mariadb, name) for name in grantee} == shown_before

        # Pasted into the mysql client as printed (text, no parameters), they run and grant what a
        # rotation needs: UPDATE on the cipher and key-version columns (and the columns the
        # database maintains, which are kept by setting them to themselves), nothing wider.
        with connect(mariadb, None, multi=True) as root, root.cursor() as cur:
            for statement in [*statements, *ro["statements"]]:
                cur.execute(statement)
                while cur.nextset():
                    pass
        granted = _column_privileges(mariadb, grantee[role], mysql_database)
        for table, ciphers in CIPHERS.items():
            updatable = granted.get(table, {}).get("UPDATE", set())
            assert {*ciphers, "key_version"} <= updatable <= {*ciphers, "key_version", "updated_at"}, (table, updatable)
            if not _table_select(mariadb, grantee[role], mysql_database, table):
                assert {*ciphers, "key_version", "id"} <= granted[table].get("SELECT", set()), table
        assert _wide_updates(mariadb, grantee[role], mysql_database) == []
        assert not any("UPDATE" in p for p in _column_privileges(mariadb, grantee[auditor], mysql_database).values())
        assert _wide_updates(mariadb, grantee[auditor], mysql_database) == []
        # pinrotate's own bookkeeping (the pinrotate database): conflicts replaced run by run, a key's
        # check value only ever added, a run's own heartbeat row stamped and removed; the auditor
        # reads it with its SELECT on *.*.
        with connect(mariadb, None) as conn:
            books = set(query(conn, "SELECT TABLE_NAME, PRIVILEGE_TYPE FROM information_schema.TABLE_PRIVILEGES"
                                    " WHERE GRANTEE = %s AND TABLE_SCHEMA = 'pinrotate'", (grantee[role],)))
        assert books == {*(("conflicts", p) for p in ("SELECT", "INSERT", "UPDATE", "DELETE")),
                         ("key_checks", "SELECT"), ("key_checks", "INSERT"),
                         *(("heartbeat", p) for p in ("SELECT", "INSERT", "UPDATE", "DELETE"))}, books

        # The role, with exactly what was printed, runs the rotation and records its key checks.
        as_role = write_toml(tmp_path / "as-role.toml", {
            **tomllib.loads(pin.config().read_text(encoding="utf-8")),
            "database": {"url": f"mysql://{role}@{mariadb.host}:{mariadb.port}/{mysql_database}"}})
        code, doc, err = rotate("run", "--config", str(as_role), "--json", prefect_api=prefect_api)
        assert code == 0, err
        assert all(r["backlog_remaining"] == 0 for r in doc["targets"].values()), doc
        with connect(mariadb, None) as conn:
            recorded = query(conn, "SELECT key_id FROM pinrotate.key_checks WHERE database_name = %s",
                             (mysql_database,))
        assert {str(k) for k in pin.keys} <= {str(r[0]) for r in recorded}
    finally:
        with connect(mariadb, None) as root, root.cursor() as cur:
            for name in (role, auditor):
                cur.execute(f"DROP USER IF EXISTS '{name}'@'%'")
            cur.execute("DELETE FROM pinrotate.key_checks WHERE database_name = %s", (mysql_database,))


def _table_select(server: MariaDbServer, grantee: str, database: str, table: str) -> bool:
    with connect(server, None) as conn:
        return bool(query(conn, "SELECT 1 FROM information_schema.TABLE_PRIVILEGES WHERE GRANTEE = %s"
                                " AND TABLE_SCHEMA = %s AND TABLE_NAME = %s AND PRIVILEGE_TYPE = 'SELECT'",
                          (grantee, database, table)))


def _show_grants(server: MariaDbServer, name: str) -> list[tuple[object, ...]]:
    with connect(server, None) as conn:
        return query(conn, f"SHOW GRANTS FOR '{name}'@'%'")
