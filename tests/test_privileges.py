"""Least privilege: the printed GRANTs are enough, column-level grants count, an auditor only reads.

Real roles on a real PostgreSQL: a LOGIN role that is neither superuser nor owner gets exactly what
``python -m flows.rotate grants`` prints, and runs, inventories and gates under it.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from psycopg import sql

from pinrotate_core import key_checks
from tests.pinprofile import PinProfile, cli, seed_profile, write_config


def as_user(url: str, user: str) -> str:
    parts = urlsplit(url)
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit((parts.scheme, f"{user}@{host}", parts.path, parts.query, parts.fragment))


@pytest.fixture
def roles(database_url: str) -> Iterator[list[str]]:
    """Make LOGIN roles on demand (neither superuser nor owner); all dropped afterwards."""
    made: list[str] = []
    yield made
    with psycopg.connect(database_url, autocommit=True) as conn:
        for role in made:
            conn.execute(sql.SQL("REASSIGN OWNED BY {} TO CURRENT_USER").format(sql.Identifier(role)))
            conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def new_role(database_url: str, roles: list[str], prefix: str) -> str:
    role = f"pinrotate_{prefix}_{secrets.token_hex(3)}"
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
        conn.execute(sql.SQL("REVOKE CREATE ON SCHEMA public FROM PUBLIC"))
    roles.append(role)
    return role


def config_as(profile: PinProfile, tmp: Path, role: str) -> str:
    return str(write_config(tmp / f"{role}.toml", as_user(profile.url, role), profile.keys_file,
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
        database_url: str, tmp_path: Path, roles: list[str]) -> None:
    profile = seed_profile(database_url, tmp_path, rows=30)
    app = new_role(database_url, roles, "app")
    statements = grant(profile, app)
    # Column by column, never a table-wide UPDATE: the role may not touch a business column.
    assert any(s.startswith("GRANT UPDATE (") and '"profile"."persons"' in s for s in statements)
    assert not any(s.startswith(("GRANT UPDATE ON", "GRANT ALL")) for s in statements)
    with psycopg.connect(as_user(profile.url, app)) as conn, pytest.raises(psycopg.errors.InsufficientPrivilege):
        conn.execute("UPDATE profile.persons SET updated_at = now()")

    config = config_as(profile, tmp_path, app)
    code, doc, err = cli("run", "--config", config, "--json")
    assert code == 0, err
    assert doc["targets"]["Person"]["reencrypted"] == 30 and key_versions(profile) == {2: 30}
    code, doc, err = cli("inventory", "--config", config, "--json")
    assert code == 0, err
    assert all(t["BLOCKED"] == 0 for t in doc["targets"].values()), doc


def test_a_read_only_auditor_inventories_and_gates_with_the_owners_answer_and_cannot_run(
        database_url: str, tmp_path: Path, roles: list[str]) -> None:
    profile = seed_profile(database_url, tmp_path, rows=30)
    auditor = new_role(database_url, roles, "audit")
    statements = grant(profile, auditor, "--read-only")
    assert not any("UPDATE" in s or "INSERT" in s for s in statements if s.startswith("GRANT"))
    with psycopg.connect(as_user(profile.url, auditor)) as conn, pytest.raises(psycopg.errors.InsufficientPrivilege):
        conn.execute("UPDATE profile.persons SET key_version = key_version")
    config = config_as(profile, tmp_path, auditor)

    code, inv, err = cli("inventory", "--config", config, "--json")
    assert code == 0, err
    _, owner_inv, _ = cli("inventory", "--config", str(profile.config_path), "--json")
    assert inv["targets"] == owner_inv["targets"]  # the same counts, nothing BLOCKED for lack of UPDATE
    code, gate, err = cli("gate", "--retire", "1", "--config", config, "--json")
    owner_code, owner_gate, _ = cli("gate", "--retire", "1", "--config", str(profile.config_path), "--json")
    assert (code, gate["open"], gate["blocking"]) == (owner_code, owner_gate["open"], owner_gate["blocking"]), err

    code, _, err = cli("run", "--config", config)
    assert code == 2
    last = err.strip().splitlines()[-1]
    # The first write a run would make is its key check values (pinrotate.key_checks): refused, named.
    assert f"role {auditor} may not write pinrotate.key_checks" in last and "Traceback" not in err
    assert key_versions(profile) == {1: 30}  # nothing written


def test_a_role_without_grants_gets_one_line_naming_the_missing_privilege(
        database_url: str, tmp_path: Path, roles: list[str]) -> None:
    profile = seed_profile(database_url, tmp_path, rows=10)
    nobody = new_role(database_url, roles, "none")
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
