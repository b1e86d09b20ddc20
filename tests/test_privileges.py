"""Least privilege: the printed GRANTs are enough, column-level grants count, an auditor only reads.

Real roles on a real PostgreSQL: a LOGIN role that is neither superuser nor owner gets exactly what
``python -m flows.rotate grants`` prints, and runs, inventories and gates under it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from pinrotate_core import key_checks
from tests.helpers import url_as
from tests.pinprofile import PinProfile, cli, cli_all, seed_profile, write_config


def new_role(pg_conn: psycopg.Connection[Any], make_role: Callable[[str], str], prefix: str) -> str:
    role = make_role(prefix)
    pg_conn.execute(sql.SQL("REVOKE CREATE ON SCHEMA public FROM PUBLIC"))
    return role


def config_as(profile: PinProfile, tmp: Path, role: str) -> str:
    return str(write_config(tmp / f"{role}.toml", url_as(profile.url, role), profile.keys_file,
                            inter_batch_delay=0))


def grant(profile: PinProfile, role: str, *extra: str) -> list[str]:
    code, doc, err = cli("grants", "--role", role, *extra, "--config", str(profile.config_path), "--json")
    assert code == 0, err
    with psycopg.connect(profile.url, autocommit=True) as conn:
        for statement in doc["statements"]:
            conn.execute(statement)
    return list(doc["statements"])


def key_versions(profile: PinProfile) -> dict[Any, int]:
    return profile.key_versions("persons")


def test_the_printed_grants_are_enough_to_run_and_name_only_the_configured_columns(
        database_url: str, tmp_path: Path, pg_conn: psycopg.Connection[Any],
        make_role: Callable[[str], str], prefect_api: str) -> None:
    profile = seed_profile(database_url, tmp_path, rows=30)
    app = new_role(pg_conn, make_role, "app")
    statements = grant(profile, app)
    # Column by column, never a table-wide UPDATE: the role may not touch a business column.
    assert any(s.startswith("GRANT UPDATE (") and '"profile"."persons"' in s for s in statements)
    assert not any(s.startswith(("GRANT UPDATE ON", "GRANT ALL")) for s in statements)
    with psycopg.connect(url_as(profile.url, app)) as conn, pytest.raises(psycopg.errors.InsufficientPrivilege):
        conn.execute("UPDATE profile.persons SET updated_at = now()")

    config = config_as(profile, tmp_path, app)
    # The session's Prefect server: the subject is the role's privileges, not Prefect's temporary
    # server (a run without PREFECT_API_URL is test_readme_walkthrough's and test_flow_orchestrator's).
    code, doc, err = cli("run", "--config", config, "--json", env={"PREFECT_API_URL": prefect_api})
    assert code == 0, err
    assert doc["targets"]["Person"]["reencrypted"] == 30 and key_versions(profile) == {2: 30}
    code, doc, err = cli("inventory", "--config", config, "--json")
    assert code == 0, err
    assert all(t["BLOCKED"] == 0 for t in doc["targets"].values()), doc


def test_a_read_only_auditor_inventories_and_gates_with_the_owners_answer_and_cannot_run(
        database_url: str, tmp_path: Path, pg_conn: psycopg.Connection[Any],
        make_role: Callable[[str], str]) -> None:
    profile = seed_profile(database_url, tmp_path, rows=30)
    auditor = new_role(pg_conn, make_role, "audit")
    statements = grant(profile, auditor, "--read-only")
    assert not any("UPDATE" in s or "INSERT" in s for s in statements if s.startswith("GRANT"))
    with psycopg.connect(url_as(profile.url, auditor)) as conn, pytest.raises(psycopg.errors.InsufficientPrivilege):
        conn.execute("UPDATE profile.persons SET key_version = key_version")
    config = config_as(profile, tmp_path, auditor)

    # The auditor's and the owner's inventories and gates at once: all of them read only (every row is
    # on key 1, so the gates answer closed without settling).
    (code, inv, err), (_, owner_inv, _), (gate_code, gate, gate_err), (owner_code, owner_gate, _) = cli_all([
        ["inventory", "--config", config, "--json"], ["inventory", "--config", str(profile.config_path), "--json"],
        ["gate", "--retire", "1", "--config", config, "--json"],
        ["gate", "--retire", "1", "--config", str(profile.config_path), "--json"]])
    assert code == 0, err
    assert inv["targets"] == owner_inv["targets"]  # the same counts, nothing BLOCKED for lack of UPDATE
    assert (gate_code, gate["open"], gate["blocking"]) == (owner_code, owner_gate["open"], owner_gate["blocking"]), \
        gate_err

    code, _, err = cli("run", "--config", config)
    assert code == 2
    last = err.strip().splitlines()[-1]
    # The start's check of every target names the first privilege the run lacks (the key check values
    # are recorded by the flow run itself, under its id, after that check).
    assert f"role {auditor} lacks UPDATE (" in last and "on profile.persons" in last and "Traceback" not in err
    assert key_versions(profile) == {1: 30}  # nothing written


def test_a_role_without_grants_gets_one_line_naming_the_missing_privilege(
        database_url: str, tmp_path: Path, pg_conn: psycopg.Connection[Any],
        make_role: Callable[[str], str]) -> None:
    profile = seed_profile(database_url, tmp_path, rows=10)
    nobody = new_role(pg_conn, make_role, "none")
    with psycopg.connect(profile.url, autocommit=True) as conn:
        # The bookkeeping tables are there and granted: what is missing is on the target alone.
        conn.execute(key_checks.CREATE_SQL)
        conn.execute(sql.SQL("GRANT USAGE ON SCHEMA pinrotate TO {r}; GRANT SELECT, INSERT ON pinrotate.key_checks "
                             "TO {r}").format(r=sql.Identifier(nobody)))
        conn.execute(sql.SQL("GRANT USAGE ON SCHEMA profile TO {}").format(sql.Identifier(nobody)))
        # Half a grant: SELECT on the ciphertexts only, no UPDATE.
        conn.execute(sql.SQL("GRANT SELECT (id, first_name_cipher) ON profile.persons TO {}").format(
            sql.Identifier(nobody)))
    code, _, err = cli("run", "--config", config_as(profile, tmp_path, nobody), "--expected-key-version", "2")
    assert code == 2 and "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert f"role {nobody} lacks SELECT (" in last and "key_version" in last and "UPDATE (" in last
    assert key_versions(profile) == {1: 10}


def test_a_role_granted_before_row_version_writes_is_told_to_grant_ctid_and_xmin(
        database_url: str, tmp_path: Path, pg_conn: psycopg.Connection[Any],
        make_role: Callable[[str], str]) -> None:
    profile = seed_profile(database_url, tmp_path, rows=10)
    app = new_role(pg_conn, make_role, "old")
    statements = grant(profile, app)
    assert any('"ctid", "xmin") ON "profile"."persons"' in s for s in statements if s.startswith("GRANT SELECT ("))
    # The grants of an earlier release: every column but the row version.
    with psycopg.connect(profile.url, autocommit=True) as conn:
        conn.execute(sql.SQL("REVOKE SELECT (ctid, xmin) ON profile.persons FROM {}").format(sql.Identifier(app)))
    code, _, err = cli("run", "--config", config_as(profile, tmp_path, app), "--expected-key-version", "2")
    assert code == 2 and "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert f"role {app} lacks SELECT (ctid, xmin) on profile.persons" in last, last
    assert key_versions(profile) == {1: 10}
