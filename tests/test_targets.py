"""Targets resolved against the live catalog: row-level security and UPDATE triggers (issue 9).

Real PostgreSQL only: a real non-superuser role (CREATE ROLE ... LOGIN, then connect as it) for
row-level security, real PL/pgSQL triggers (an ``updated_at`` touch and an audit row per update)
for the ``triggers`` setting. Keys are random TEST keys made here.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from pinrotate_core import rotation
from pinrotate_core.config import Settings, settings_from_mapping
from pinrotate_core.errors import ConfigError
from pinrotate_core.gate import evaluate_gate, retire_gate
from pinrotate_core.key_checks import CREATE_SQL as KEY_CHECKS_SQL
from pinrotate_core.keyring import Key, Keyring
from pinrotate_core.providers.file import FileKeyProvider
from pinrotate_core.schemes.aesgcm import AesGcmCipherSet
from pinrotate_core.schemes.fpc1_values import Fpc1CipherSet

from .helpers import b64, url_as

ROWS = 12
PEOPLE = "People"
TOUCHED_AT = "2020-01-02 03:04:05+00"


# -- the database under test ----------------------------------------------------------------------


def create_people(conn: psycopg.Connection[Any], keys_file: Path) -> FileKeyProvider:
    """``people`` with ROWS rows under key 1 (tenants a and b), then key 2 made current."""
    provider = FileKeyProvider(keys_file, create=True)
    ciphers = AesGcmCipherSet(provider.load_keyring())
    conn.execute(f"""
        CREATE TABLE people (
            id bigint PRIMARY KEY,
            tenant text NOT NULL,
            key_version integer NOT NULL,
            name_cipher bytea,
            note text,
            updated_at timestamptz NOT NULL DEFAULT '{TOUCHED_AT}'
        )""")
    conn.execute("CREATE TABLE people_audit (id bigserial PRIMARY KEY, person_id bigint NOT NULL)")
    conn.cursor().executemany(
        "INSERT INTO people (id, tenant, key_version, name_cipher) VALUES (%s, %s, 1, %s)",
        [(i, "a" if i % 2 else "b", ciphers.encrypt_current(f"name {i}".encode())) for i in range(1, ROWS + 1)])
    provider.add_key()
    provider.promote("2")
    return provider


def add_touch_and_audit_triggers(conn: psycopg.Connection[Any]) -> None:
    conn.execute("""CREATE FUNCTION touch_updated_at() RETURNS trigger LANGUAGE plpgsql AS $$
                    BEGIN NEW.updated_at := now(); RETURN NEW; END $$""")
    conn.execute("""CREATE FUNCTION audit_update() RETURNS trigger LANGUAGE plpgsql AS $$
                    BEGIN INSERT INTO people_audit (person_id) VALUES (NEW.id); RETURN NEW; END $$""")
    conn.execute("CREATE TRIGGER touch_updated_at BEFORE UPDATE ON people FOR EACH ROW EXECUTE FUNCTION "
                 "touch_updated_at()")
    conn.execute("CREATE TRIGGER audit_update AFTER UPDATE ON people FOR EACH ROW EXECUTE FUNCTION audit_update()")


def settings_for(url: str, keys_file: Path, **target: Any) -> Settings:
    return settings_from_mapping({
        "database": {"url": url},
        "keys": {"provider": "file", "file": str(keys_file)},
        "job": {"batch_size": 5, "inter_batch_delay": 0},
        "targets": [{"name": PEOPLE, "table": "people", "key_version": "key_version", "columns": ["name_cipher"],
                     **target}],
    }, env={})


def snapshot(conn: psycopg.Connection[Any]) -> list[tuple[Any, ...]]:
    return conn.execute("SELECT id, xmin::text, key_version, name_cipher, updated_at FROM people ORDER BY id").fetchall()


def key_versions(conn: psycopg.Connection[Any]) -> dict[int, int]:
    return dict(conn.execute("SELECT key_version, count(*) FROM people GROUP BY 1").fetchall())


def audit_rows(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT count(*) FROM people_audit").fetchone()
    assert row is not None
    return int(row[0])


@pytest.fixture
def people(pg_conn: psycopg.Connection[Any], keys_file: Path) -> FileKeyProvider:
    return create_people(pg_conn, keys_file)


@pytest.fixture
def app_role(pg_conn: psycopg.Connection[Any], make_role: Callable[[str], str]) -> str:
    """A role neither superuser nor owner of anything. As the reference says for a role without
    CREATE on the database, pinrotate.key_checks is created ahead and granted."""
    role = make_role("app")
    pg_conn.execute(KEY_CHECKS_SQL)
    pg_conn.execute(sql.SQL("GRANT USAGE ON SCHEMA pinrotate TO {r}; GRANT SELECT, INSERT ON pinrotate.key_checks "
                            "TO {r}").format(r=sql.Identifier(role)))
    return role


def grant_rotation_rights(conn: psycopg.Connection[Any], role: str) -> None:
    conn.execute(sql.SQL("GRANT SELECT, UPDATE ON people TO {}").format(sql.Identifier(role)))


def tenant_a_policy(conn: psycopg.Connection[Any]) -> None:
    """RLS as an application would set it up: the role sees only tenant a's rows."""
    conn.execute("ALTER TABLE people ENABLE ROW LEVEL SECURITY")
    conn.execute("CREATE POLICY tenant_a ON people USING (tenant = 'a')")


# -- row-level security -----------------------------------------------------------------------------


def test_a_role_subject_to_row_level_security_gets_a_blocked_target_a_closed_gate_and_no_run(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path, people: FileKeyProvider,
        app_role: str) -> None:
    grant_rotation_rights(pg_conn, app_role)
    tenant_a_policy(pg_conn)
    settings = settings_for(url_as(database_url, app_role), keys_file)
    with psycopg.connect(url_as(database_url, app_role)) as conn:  # the policy really hides half the rows
        assert conn.execute("SELECT count(*) FROM people").fetchone() == (ROWS // 2,)
    before = snapshot(pg_conn)

    inv = rotation.inventory(settings).targets[PEOPLE]
    assert inv.counts["BLOCKED"] == 1 and inv.counts["HISTORICAL"] == 0
    assert inv.blocked_reason is not None
    assert "row-level security" in inv.blocked_reason and app_role in inv.blocked_reason
    gate = retire_gate(settings, "1")
    assert not gate.open and gate.blocking["BLOCKED"] == 1
    assert "row-level security" in gate.targets[PEOPLE]["blocked_reason"]
    with pytest.raises(ConfigError, match=f"target {PEOPLE}: row-level security on people applies to role "
                                          f"{app_role}.*nothing was touched"):
        rotation.run_rotation(settings)
    assert snapshot(pg_conn) == before


def test_an_owner_is_blocked_only_when_row_level_security_is_forced(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path, people: FileKeyProvider,
        app_role: str) -> None:
    tenant_a_policy(pg_conn)
    pg_conn.execute(sql.SQL("ALTER TABLE people OWNER TO {}").format(sql.Identifier(app_role)))
    pg_conn.execute("ALTER TABLE people FORCE ROW LEVEL SECURITY")
    settings = settings_for(url_as(database_url, app_role), keys_file)

    forced = rotation.inventory(settings).targets[PEOPLE]
    assert forced.counts["BLOCKED"] == 1 and "FORCE ROW LEVEL SECURITY" in (forced.blocked_reason or "")

    pg_conn.execute("ALTER TABLE people NO FORCE ROW LEVEL SECURITY")  # the owner bypasses its policies
    inv = rotation.inventory(settings).targets[PEOPLE]
    assert inv.counts["BLOCKED"] == 0 and inv.counts["HISTORICAL"] == ROWS
    assert rotation.run_rotation(settings).exit_code == 0
    assert key_versions(pg_conn) == {2: ROWS}


def test_bypassrls_and_superuser_roles_see_every_row_and_drain_them(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path, people: FileKeyProvider,
        app_role: str) -> None:
    grant_rotation_rights(pg_conn, app_role)
    tenant_a_policy(pg_conn)
    pg_conn.execute("ALTER TABLE people FORCE ROW LEVEL SECURITY")  # binds owners, never BYPASSRLS/superusers
    superuser = settings_for(database_url, keys_file)
    assert rotation.inventory(superuser).targets[PEOPLE].counts["HISTORICAL"] == ROWS

    pg_conn.execute(sql.SQL("ALTER ROLE {} BYPASSRLS").format(sql.Identifier(app_role)))
    # The run's gate must see every session of the database (other roles' too) to know none is in flight.
    pg_conn.execute(sql.SQL("GRANT pg_read_all_stats TO {}").format(sql.Identifier(app_role)))
    settings = settings_for(url_as(database_url, app_role), keys_file)
    inv = rotation.inventory(settings).targets[PEOPLE]
    assert inv.counts["BLOCKED"] == 0 and inv.counts["HISTORICAL"] == ROWS
    report = rotation.run_rotation(settings)
    assert report.exit_code == 0 and report.targets[PEOPLE].reencrypted == ROWS
    assert key_versions(pg_conn) == {2: ROWS}
    assert report.gate["1"]["open"] is True


# -- UPDATE triggers ----------------------------------------------------------------------------------


def test_update_triggers_block_the_target_by_default_and_nothing_is_written(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path, people: FileKeyProvider) -> None:
    add_touch_and_audit_triggers(pg_conn)
    settings = settings_for(database_url, keys_file)
    before = snapshot(pg_conn)

    inv = rotation.inventory(settings).targets[PEOPLE]
    assert inv.counts["BLOCKED"] == 1
    assert "UPDATE triggers" in (inv.blocked_reason or "")
    assert "audit_update" in (inv.blocked_reason or "") and "touch_updated_at" in (inv.blocked_reason or "")
    assert not evaluate_gate(rotation.inventory(settings), "1").open
    with pytest.raises(ConfigError, match="audit_update, touch_updated_at.*triggers = \"disable\" or \"fire\""):
        rotation.run_rotation(settings)
    with pytest.raises(ConfigError, match="UPDATE triggers"):
        rotation.run_rotation(settings, dry_run=True)
    assert snapshot(pg_conn) == before and audit_rows(pg_conn) == 0


def test_triggers_disable_moves_every_row_without_touching_updated_at_or_writing_audit_rows(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path, people: FileKeyProvider) -> None:
    add_touch_and_audit_triggers(pg_conn)
    settings = settings_for(database_url, keys_file, triggers="disable")
    before = {r[0]: r[4] for r in snapshot(pg_conn)}

    assert rotation.inventory(settings).targets[PEOPLE].counts["BLOCKED"] == 0
    report = rotation.run_rotation(settings)

    assert report.exit_code == 0 and report.targets[PEOPLE].reencrypted == ROWS
    assert report.targets[PEOPLE].batches == 3  # several transactions, each with the setting
    assert key_versions(pg_conn) == {2: ROWS}
    assert {r[0]: r[4] for r in snapshot(pg_conn)} == before  # updated_at untouched
    assert audit_rows(pg_conn) == 0
    # The triggers are still there and still fire for the application's own updates.
    pg_conn.execute("UPDATE people SET note = 'edited' WHERE id = 1")
    assert audit_rows(pg_conn) == 1


def test_triggers_fire_accepts_the_side_effects(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path, people: FileKeyProvider) -> None:
    add_touch_and_audit_triggers(pg_conn)
    settings = settings_for(database_url, keys_file, triggers="fire")

    report = rotation.run_rotation(settings)

    assert report.exit_code == 0 and report.targets[PEOPLE].reencrypted == ROWS
    assert key_versions(pg_conn) == {2: ROWS}
    assert audit_rows(pg_conn) == ROWS  # one audit row per re-encrypted row
    touched = pg_conn.execute("SELECT count(*) FROM people WHERE updated_at <> %s", (TOUCHED_AT,)).fetchone()
    assert touched == (ROWS,)


def test_triggers_that_cannot_fire_on_a_reencryption_do_not_block(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path, people: FileKeyProvider) -> None:
    add_touch_and_audit_triggers(pg_conn)
    pg_conn.execute("DROP TRIGGER touch_updated_at ON people")
    pg_conn.execute("ALTER TABLE people DISABLE TRIGGER audit_update")  # disabled
    # UPDATE OF a column pinrotate never writes, INSERT only, and a replica-only trigger.
    pg_conn.execute("CREATE TRIGGER note_changed AFTER UPDATE OF note ON people FOR EACH ROW "
                    "EXECUTE FUNCTION audit_update()")
    pg_conn.execute("CREATE TRIGGER on_insert AFTER INSERT ON people FOR EACH ROW EXECUTE FUNCTION audit_update()")
    pg_conn.execute("CREATE TRIGGER replica_only AFTER UPDATE ON people FOR EACH ROW EXECUTE FUNCTION audit_update()")
    pg_conn.execute("ALTER TABLE people ENABLE REPLICA TRIGGER replica_only")
    settings = settings_for(database_url, keys_file)

    assert rotation.inventory(settings).targets[PEOPLE].counts["BLOCKED"] == 0
    assert rotation.run_rotation(settings).exit_code == 0
    assert key_versions(pg_conn) == {2: ROWS} and audit_rows(pg_conn) == 0

    # An UPDATE OF a column it does write does fire: blocked.
    pg_conn.execute("CREATE TRIGGER cipher_changed AFTER UPDATE OF name_cipher ON people FOR EACH ROW "
                    "EXECUTE FUNCTION audit_update()")
    inv = rotation.inventory(settings).targets[PEOPLE]
    assert inv.counts["BLOCKED"] == 1 and "cipher_changed" in (inv.blocked_reason or "")
    assert "note_changed" not in (inv.blocked_reason or "")


def test_an_update_rule_blocks_like_a_trigger_and_disable_silences_it(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path, people: FileKeyProvider) -> None:
    pg_conn.execute("CREATE RULE log_update AS ON UPDATE TO people DO ALSO "
                    "INSERT INTO people_audit (person_id) VALUES (NEW.id)")
    blocked = rotation.inventory(settings_for(database_url, keys_file)).targets[PEOPLE]
    assert blocked.counts["BLOCKED"] == 1
    assert "UPDATE triggers or rules that re-encryption would fire: rule log_update" in (blocked.blocked_reason or "")

    report = rotation.run_rotation(settings_for(database_url, keys_file, triggers="disable"))
    assert report.exit_code == 0 and key_versions(pg_conn) == {2: ROWS} and audit_rows(pg_conn) == 0


def test_triggers_disable_refuses_triggers_that_replica_mode_does_not_silence(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path, people: FileKeyProvider) -> None:
    add_touch_and_audit_triggers(pg_conn)
    pg_conn.execute("ALTER TABLE people ENABLE ALWAYS TRIGGER audit_update")
    settings = settings_for(database_url, keys_file, triggers="disable")
    before = snapshot(pg_conn)

    inv = rotation.inventory(settings).targets[PEOPLE]
    assert inv.counts["BLOCKED"] == 1 and "cannot silence audit_update" in (inv.blocked_reason or "")
    with pytest.raises(ConfigError, match="ENABLE ALWAYS"):
        rotation.run_rotation(settings)
    assert snapshot(pg_conn) == before and audit_rows(pg_conn) == 0


def test_triggers_disable_needs_a_role_that_may_set_session_replication_role(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path, people: FileKeyProvider,
        app_role: str) -> None:
    add_touch_and_audit_triggers(pg_conn)
    grant_rotation_rights(pg_conn, app_role)
    pg_conn.execute(sql.SQL("GRANT INSERT ON people_audit TO {}").format(sql.Identifier(app_role)))
    pg_conn.execute(sql.SQL("GRANT USAGE ON SEQUENCE people_audit_id_seq TO {}").format(sql.Identifier(app_role)))
    settings = settings_for(url_as(database_url, app_role), keys_file, triggers="disable")
    before = snapshot(pg_conn)

    # An inventory only reads: whether this role may silence triggers matters to a run alone.
    inv = rotation.inventory(settings).targets[PEOPLE]
    assert inv.counts["BLOCKED"] == 0 and inv.counts["HISTORICAL"] == ROWS
    with pytest.raises(ConfigError, match=f"role {app_role} may not set session_replication_role"):
        rotation.run_rotation(settings, dry_run=True)  # a dry run foretells the refusal
    with pytest.raises(ConfigError, match="may not set session_replication_role") as refused:
        rotation.run_rotation(settings)
    assert "\n" not in str(refused.value)
    assert snapshot(pg_conn) == before and audit_rows(pg_conn) == 0

    # PostgreSQL 15+: the right can be granted without superuser; then the run goes through silently.
    if pg_conn.info.server_version < 150000:
        return
    pg_conn.execute(sql.SQL("GRANT SET ON PARAMETER session_replication_role TO {}").format(sql.Identifier(app_role)))
    try:
        report = rotation.run_rotation(settings)
        assert report.exit_code == 0 and key_versions(pg_conn) == {2: ROWS} and audit_rows(pg_conn) == 0
    finally:
        pg_conn.execute(sql.SQL("REVOKE SET ON PARAMETER session_replication_role FROM {}").format(
            sql.Identifier(app_role)))


def test_triggers_disable_also_holds_for_the_fpc1_compare_and_swap_writes(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path) -> None:
    k1, k2 = secrets.token_bytes(16), secrets.token_bytes(16)
    keys_file.write_text(f'current = "k2"\n[keys]\nk1 = "{b64(k1)}"\nk2 = "{b64(k2)}"\n', encoding="utf-8")
    keys_file.chmod(0o600)
    old = Fpc1CipherSet(Keyring(current="k1", keys={"k1": Key("k1", k1)}, source="test"))
    pg_conn.execute(f"CREATE TABLE people (id bigint PRIMARY KEY, secret text, note text, "
                    f"updated_at timestamptz NOT NULL DEFAULT '{TOUCHED_AT}')")
    pg_conn.execute("CREATE TABLE people_audit (id bigserial PRIMARY KEY, person_id bigint NOT NULL)")
    pg_conn.cursor().executemany("INSERT INTO people (id, secret) VALUES (%s, %s)",
                                 [(i, old.encrypt_current("SM4", f"s{i}".encode())) for i in range(1, ROWS + 1)])
    add_touch_and_audit_triggers(pg_conn)
    raw = {"database": {"url": database_url}, "keys": {"provider": "file", "file": str(keys_file)},
           "job": {"batch_size": 5, "inter_batch_delay": 0},
           "targets": [{"name": PEOPLE, "table": "people", "columns": ["secret"], "format": "fpc1"}]}
    with pytest.raises(ConfigError, match="UPDATE triggers"):
        rotation.run_rotation(settings_from_mapping(raw, env={}), expected_key="k2")

    raw["targets"][0]["triggers"] = "disable"  # type: ignore[index]
    report = rotation.run_rotation(settings_from_mapping(raw, env={}), expected_key="k2")

    assert report.exit_code == 0 and report.targets[PEOPLE].reencrypted == ROWS
    assert pg_conn.execute("SELECT count(*) FROM people WHERE secret LIKE 'FPC1:SM4:k2:%%'").fetchone() == (ROWS,)
    assert pg_conn.execute("SELECT count(*) FROM people WHERE updated_at = %s", (TOUCHED_AT,)).fetchone() == (ROWS,)
    assert audit_rows(pg_conn) == 0


def test_a_percent_sign_in_a_name_blocks_a_run_on_postgresql_naming_it_and_nothing_is_written(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path, people: FileKeyProvider) -> None:
    # psycopg reads a '%' in a quoted name as a placeholder in a statement with parameters: the run
    # would fail in its first batch with an error naming nothing (found by hand: exit 4,
    # "cannot split the backlog (ProgrammingError)"). It is BLOCKED before anything runs.
    pg_conn.execute('ALTER TABLE people RENAME COLUMN name_cipher TO "name%cipher"')
    settings = settings_for(database_url, keys_file, columns=["name%cipher"])
    before = pg_conn.execute('SELECT id, xmin::text, key_version, "name%cipher" FROM people ORDER BY id').fetchall()
    for dry_run in (False, True):
        with pytest.raises(ConfigError, match=r"a '%' in a name is not supported on PostgreSQL yet: name%cipher"):
            rotation.run_rotation(settings, dry_run=dry_run)
    after = pg_conn.execute('SELECT id, xmin::text, key_version, "name%cipher" FROM people ORDER BY id').fetchall()
    assert after == before
    assert rotation.inventory(settings).targets[PEOPLE].counts["HISTORICAL"] == ROWS  # reading is not refused
