"""Least privilege: the printed GRANTs are enough, column-level grants count, an auditor only reads.

Real roles on a real PostgreSQL: a LOGIN role that is neither superuser nor owner gets exactly what
``python -m flows.rotate grants`` prints, and runs, inventories and gates under it. The first three
tests take the database as a ``RolesDb`` (here PostgreSQL's): tests/test_privileges_mysql.py runs
their bodies on MariaDB.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import psycopg
import pytest
from psycopg import sql

from pinrotate_core import key_checks
from tests.helpers import url_as
from tests.pinprofile import PinProfile, cli, cli_all, seed_profile, write_config


class RolesDb(Protocol):
    """The Pin profile seeded under the old key (the new one current), on one engine, where the test
    may make login roles that are neither superuser nor owner (dropped at the end)."""

    config: Path  # the owner's configuration
    persons: str  # the persons table as the configuration names it
    persons_granted: str  # ... and as a GRANT statement names it
    # An assignment to a business column no GRANT names (MySQL's grants name the ON UPDATE
    # CURRENT_TIMESTAMP columns, which a run keeps by setting them to themselves).
    business_update: str
    old: int
    new: int
    rows: int  # persons

    def make_role(self, prefix: str) -> str: ...

    def account(self, role: str) -> str:
        """The role as a message names it."""

    def as_owner(self, statements: Sequence[str]) -> None: ...

    def config_as(self, role: str) -> str: ...

    def key_versions(self) -> dict[Any, int]:
        """{key version: persons}"""

    def update_refused(self, role: str, assignment: str) -> None:
        """``UPDATE persons SET <assignment>`` as ``role`` is refused for lack of a privilege."""

    def grant_half(self, role: str) -> None:
        """pinrotate's bookkeeping granted, and on persons only SELECT of id and first_name_cipher."""


class PgRolesDb:
    persons, persons_granted, old, new = "profile.persons", '"profile"."persons"', 1, 2
    business_update = "updated_at = now()"

    def __init__(self, profile: PinProfile, tmp: Path, conn: psycopg.Connection[Any],
                 make_role: Callable[[str], str], rows: int) -> None:
        self.profile, self.tmp, self.conn, self._make_role, self.rows = profile, tmp, conn, make_role, rows
        self.config = profile.config_path

    def make_role(self, prefix: str) -> str:
        role = self._make_role(prefix)
        self.conn.execute(sql.SQL("REVOKE CREATE ON SCHEMA public FROM PUBLIC"))
        return role

    def account(self, role: str) -> str:
        return role

    def as_owner(self, statements: Sequence[str]) -> None:
        with psycopg.connect(self.profile.url, autocommit=True) as conn:
            for statement in statements:
                conn.execute(statement)

    def config_as(self, role: str) -> str:
        return str(write_config(self.tmp / f"{role}.toml", url_as(self.profile.url, role), self.profile.keys_file,
                                inter_batch_delay=0))

    def key_versions(self) -> dict[Any, int]:
        return self.profile.key_versions("persons")

    def update_refused(self, role: str, assignment: str) -> None:
        with psycopg.connect(url_as(self.profile.url, role)) as conn, \
                pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute(f"UPDATE {self.persons} SET {assignment}")

    def grant_half(self, role: str) -> None:
        with psycopg.connect(self.profile.url, autocommit=True) as conn:
            # The bookkeeping tables are there and granted: what is missing is on the target alone.
            conn.execute(key_checks.CREATE_SQL)
            conn.execute(sql.SQL("GRANT USAGE ON SCHEMA pinrotate TO {r}; GRANT SELECT, INSERT ON pinrotate.key_checks "
                                 "TO {r}").format(r=sql.Identifier(role)))
            conn.execute(sql.SQL("GRANT USAGE ON SCHEMA profile TO {}").format(sql.Identifier(role)))
            # Half a grant: SELECT on the ciphertexts only, no UPDATE.
            conn.execute(sql.SQL("GRANT SELECT (id, first_name_cipher) ON profile.persons TO {}").format(
                sql.Identifier(role)))


def roles_db(database_url: str, tmp_path: Path, pg_conn: psycopg.Connection[Any], make_role: Callable[[str], str],
             rows: int) -> PgRolesDb:
    return PgRolesDb(seed_profile(database_url, tmp_path, rows=rows), tmp_path, pg_conn, make_role, rows)


def grant(db: RolesDb, role: str, *extra: str) -> list[str]:
    code, doc, err = cli("grants", "--role", role, *extra, "--config", str(db.config), "--json")
    assert code == 0, err
    db.as_owner(doc["statements"])
    return list(doc["statements"])


def test_the_printed_grants_are_enough_to_run_and_name_only_the_configured_columns(
        database_url: str, tmp_path: Path, pg_conn: psycopg.Connection[Any],
        make_role: Callable[[str], str], prefect_api: str) -> None:
    assert_the_printed_grants_are_enough_to_run(roles_db(database_url, tmp_path, pg_conn, make_role, 30), prefect_api)


def assert_the_printed_grants_are_enough_to_run(db: RolesDb, prefect_api: str) -> None:
    app = db.make_role("app")
    statements = grant(db, app)
    # Column by column, never a table-wide UPDATE: the role may not touch a business column.
    assert any(s.startswith("GRANT UPDATE (") and db.persons_granted in s for s in statements)
    assert not any(s.startswith(("GRANT UPDATE ON", "GRANT ALL")) for s in statements)
    db.update_refused(app, db.business_update)

    config = db.config_as(app)
    # The session's Prefect server: the subject is the role's privileges, not Prefect's temporary
    # server (a run without PREFECT_API_URL is test_readme_walkthrough's and test_flow_orchestrator's).
    code, doc, err = cli("run", "--config", config, "--json", env={"PREFECT_API_URL": prefect_api})
    assert code == 0, err
    assert doc["targets"]["Person"]["reencrypted"] == db.rows and db.key_versions() == {db.new: db.rows}
    code, doc, err = cli("inventory", "--config", config, "--json")
    assert code == 0, err
    assert all(t["BLOCKED"] == 0 for t in doc["targets"].values()), doc


def test_a_read_only_auditor_inventories_and_gates_with_the_owners_answer_and_cannot_run(
        database_url: str, tmp_path: Path, pg_conn: psycopg.Connection[Any],
        make_role: Callable[[str], str]) -> None:
    assert_a_read_only_auditor_reads_as_the_owner_and_cannot_run(
        roles_db(database_url, tmp_path, pg_conn, make_role, 30))


def assert_a_read_only_auditor_reads_as_the_owner_and_cannot_run(db: RolesDb) -> None:
    auditor = db.make_role("audit")
    statements = grant(db, auditor, "--read-only")
    assert not any("UPDATE" in s or "INSERT" in s for s in statements if s.startswith("GRANT"))
    db.update_refused(auditor, "key_version = key_version")
    config = db.config_as(auditor)
    owner = str(db.config)

    # The auditor's and the owner's inventories and gates at once: all of them read only (every row is
    # on the old key, so the gates answer closed without settling).
    (code, inv, err), (_, owner_inv, _), (gate_code, gate, gate_err), (owner_code, owner_gate, _) = cli_all([
        ["inventory", "--config", config, "--json"], ["inventory", "--config", owner, "--json"],
        ["gate", "--retire", str(db.old), "--config", config, "--json"],
        ["gate", "--retire", str(db.old), "--config", owner, "--json"]])
    assert code == 0, err
    assert inv["targets"] == owner_inv["targets"]  # the same counts, nothing BLOCKED for lack of UPDATE
    assert (gate_code, gate["open"], gate["blocking"]) == (owner_code, owner_gate["open"], owner_gate["blocking"]), \
        gate_err

    code, _, err = cli("run", "--config", config)
    assert code == 2
    last = err.strip().splitlines()[-1]
    # The start's check of every target names the first privilege the run lacks (the key check values
    # are recorded by the flow run itself, under its id, after that check).
    assert f"role {db.account(auditor)} lacks UPDATE (" in last and f"on {db.persons}" in last, last
    assert "Traceback" not in err
    assert db.key_versions() == {db.old: db.rows}  # nothing written


def test_a_role_without_grants_gets_one_line_naming_the_missing_privilege(
        database_url: str, tmp_path: Path, pg_conn: psycopg.Connection[Any],
        make_role: Callable[[str], str]) -> None:
    assert_a_role_without_grants_gets_one_line(roles_db(database_url, tmp_path, pg_conn, make_role, 10))


def assert_a_role_without_grants_gets_one_line(db: RolesDb) -> None:
    nobody = db.make_role("none")
    db.grant_half(nobody)
    code, _, err = cli("run", "--config", db.config_as(nobody), "--expected-key-version", str(db.new))
    assert code == 2 and "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert f"role {db.account(nobody)} lacks SELECT (" in last and "key_version" in last and "UPDATE (" in last, last
    assert db.key_versions() == {db.old: db.rows}


def test_a_role_granted_before_row_version_writes_is_told_to_grant_ctid_and_xmin(
        database_url: str, tmp_path: Path, pg_conn: psycopg.Connection[Any],
        make_role: Callable[[str], str]) -> None:
    db = roles_db(database_url, tmp_path, pg_conn, make_role, 10)
    app = db.make_role("old")
    statements = grant(db, app)
    assert any('"ctid", "xmin") ON "profile"."persons"' in s for s in statements if s.startswith("GRANT SELECT ("))
    # The grants of an earlier release: every column but the row version.
    with psycopg.connect(db.profile.url, autocommit=True) as conn:
        conn.execute(sql.SQL("REVOKE SELECT (ctid, xmin) ON profile.persons FROM {}").format(sql.Identifier(app)))
    code, _, err = cli("run", "--config", db.config_as(app), "--expected-key-version", "2")
    assert code == 2 and "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert f"role {app} lacks SELECT (ctid, xmin) on profile.persons" in last, last
    assert db.key_versions() == {1: 10}
