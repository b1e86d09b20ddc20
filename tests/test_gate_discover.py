"""The gate sweeps the database for ciphertexts outside the configured targets (issue 22, point 6).

Real PostgreSQL (and OpenBao for Transit): archive tables, copies in other schemas, JSON fields
outside ``json_paths``, partitions, materialized views, tables the role cannot read. Keys are random
TEST keys made here. tests/test_gate_discover_mysql.py runs the ``assert_*`` bodies on MariaDB (which
and why in its docstring).
"""

from __future__ import annotations

import json
import re
import secrets
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from pinrotate_core import rotation
from pinrotate_core.config import Settings, settings_from_mapping
from pinrotate_core.errors import ConfigError
from pinrotate_core.gate import retire_gate
from pinrotate_core.gate.sweep_reads import FPC1_FIND, outside_paths
from pinrotate_core.keyring import Key, Keyring
from pinrotate_core.schemes.aesgcm import AesGcmCipherSet
from pinrotate_core.schemes.fpc1 import Fpc1CipherSet
from tests.pinprofile import cli

from .helpers import b64
from .moment_world import MomentWorld, PgMoment
from .test_targets import app_role, create_people, settings_for, url_as  # noqa: F401  (app_role: a fixture)
from .test_transit_drain import new_transit, seed_people, transit
from .test_transit_drain import settings_for as transit_settings

FPC1_KEYS = {"k1": secrets.token_bytes(16), "k10": secrets.token_bytes(16), "k3": secrets.token_bytes(16)}


@pytest.fixture
def pg_world(database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path) -> PgMoment:
    return PgMoment(database_url, pg_conn, keys_file)


# -- fpc1 set-up ------------------------------------------------------------------------------------------


def fpc1_keyring(current: str) -> Keyring:
    return Keyring(current=current, keys={k: Key(k, v) for k, v in FPC1_KEYS.items()}, source="test keyring")


def fpc1_value(key_id: str, plaintext: bytes = b"a TEST secret") -> str:
    return Fpc1CipherSet(fpc1_keyring(key_id)).encrypt_current("SM4", plaintext)


def fpc1_settings(url: str, keys_file: Path, *, skip: tuple[str, ...] = (), **target: Any) -> Settings:
    keys_file.write_text('current = "k3"\n[keys]\n' + "".join(f'{k} = "{b64(v)}"\n' for k, v in FPC1_KEYS.items()),
                         encoding="utf-8")
    keys_file.chmod(0o600)
    return settings_from_mapping({
        "database": {"url": url}, "keys": {"provider": "file", "file": str(keys_file)},
        "gate": {"discover_skip": list(skip)},
        "targets": [{"name": "Secrets", "table": "secrets", "columns": ["secret"], "format": "fpc1", **target}],
    }, env={})


def create_secrets(conn: psycopg.Connection[Any], rows: int = 5) -> None:
    """The configured target, every value already on the current key k3."""
    conn.execute("CREATE TABLE secrets (id bigint PRIMARY KEY, secret text, doc jsonb)")
    conn.cursor().executemany("INSERT INTO secrets (id, secret) VALUES (%s, %s)",
                              [(i, fpc1_value("k3")) for i in range(1, rows + 1)])


def by_column(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {f["column"]: f for f in report["discovery"]["discovered"]}


# -- fpc1: pattern sweep ----------------------------------------------------------------------------------


def assert_an_archive_copy_closes_the_gate_for_its_key_only_until_vouched_for(world: MomentWorld) -> None:
    world.create_secrets()
    settings = fpc1_settings(world.url, world.keys_file)
    assert rotation.retire_gate(settings, "k1").open and rotation.retire_gate(settings, "k10").open

    world.execute(world.schema("archive", create=True))
    world.execute(f"CREATE TABLE archive.secrets_2023 (id bigint, secret {world.sealed('archive')}, note text)")
    world.execute("INSERT INTO archive.secrets_2023 VALUES " + ", ".join(["(%s, %s, %s)"] * 3),
                  tuple(x for i in range(3) for x in (i, fpc1_value("k1"), f"moved from k10: {fpc1_value('k10')}")))
    report = rotation.retire_gate(settings, "k1")

    assert not report.open
    assert report.blocking["OUTSIDE_TARGETS"] == 3 and report.blocking.get("HISTORICAL", 0) == 0
    found = by_column(report.as_dict())
    assert found == {"archive.secrets_2023.secret": {"column": "archive.secrets_2023.secret", "by_key": {"k1": 3},
                                                     "method": "pattern"}}
    # k10 is another key (not a prefix match of k1); its values sit inside free text.
    k10 = rotation.retire_gate(settings, "k10")
    assert not k10.open and k10.blocking["OUTSIDE_TARGETS"] == 3
    assert list(by_column(k10.as_dict())) == ["archive.secrets_2023.note"]
    text = json.dumps(report.as_dict())
    assert "FPC1:" not in text and b64(FPC1_KEYS["k1"]) not in text

    # The operator vouches for the archive: not swept, listed as such, the gate opens.
    skipped = rotation.retire_gate(fpc1_settings(world.url, world.keys_file, skip=("archive.*",)), "k1")
    assert skipped.open
    assert skipped.discovery["not_swept"] == {"archive.secrets_2023": "[gate] discover_skip"}
    column_skip = rotation.retire_gate(fpc1_settings(world.url, world.keys_file, skip=("archive.secrets_2023.sec*",)),
                                       "k10")
    assert not column_skip.open and "archive.secrets_2023.secret" in column_skip.discovery["not_swept"]


def test_an_archive_copy_of_an_fpc1_target_closes_the_gate_for_its_key_only_and_names_the_column(
        pg_world: PgMoment) -> None:
    assert_an_archive_copy_closes_the_gate_for_its_key_only_until_vouched_for(pg_world)


def test_an_fpc1_value_in_a_jsonb_field_outside_json_paths_closes_the_gate_and_configured_paths_count_once(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path) -> None:
    create_secrets(pg_conn, rows=2)
    settings = fpc1_settings(database_url, keys_file, columns=["secret", "doc"], json_paths={"doc": ["$.password"]})
    pg_conn.execute("UPDATE secrets SET doc = jsonb_build_object('password', %s::text, 'theme', 'dark')",
                    (fpc1_value("k3"),))
    assert retire_gate(settings, "k1").open

    # The configured field on k1 is the target's backlog (HISTORICAL), not a find outside the targets.
    pg_conn.execute("UPDATE secrets SET doc = jsonb_set(doc, '{password}', to_jsonb(%s::text)) WHERE id = 1",
                    (fpc1_value("k1"),))
    report = retire_gate(settings, "k1")
    assert not report.open and report.blocking["HISTORICAL"] == 1 and "OUTSIDE_TARGETS" not in report.blocking

    # A field nobody configured, nested, on k1: a find in the configured column, counted once.
    pg_conn.execute("UPDATE secrets SET doc = jsonb_set(doc, '{password}', to_jsonb(%s::text)) WHERE id = 1",
                    (fpc1_value("k3"),))
    pg_conn.execute("UPDATE secrets SET doc = doc || jsonb_build_object('old', jsonb_build_array(%s::text)) "
                    "WHERE id = 2", (fpc1_value("k1"),))
    report = retire_gate(settings, "k1")
    assert not report.open and report.blocking["OUTSIDE_TARGETS"] == 1 and report.blocking.get("HISTORICAL", 0) == 0
    assert by_column(report.as_dict())["public.secrets.doc"]["by_key"] == {"k1": 1}


def test_outside_paths_sees_duplicate_members_and_escaped_values_but_not_the_configured_field() -> None:
    pattern = re.compile(FPC1_FIND)
    old, new = fpc1_value("k1"), fpc1_value("k3")
    escaped = "\\u0046" + old[1:]  # "F" written as a JSON escape
    # json.loads (like the inventory) reads the last "password": the first one is outside the path.
    doc = f'{{"password": "{old}", "a": {{"b": ["{escaped}"]}}, "password": "{new}"}}'
    assert outside_paths(doc, ("$.password",), pattern) == {"k1": 2}
    assert outside_paths(f'{{"password": "{old}"}}', ("$.password",), pattern) == {}
    assert outside_paths(f'not json {old}', ("$.password",), pattern) == {"k1": 1}


def test_partitions_are_swept_once_materialized_views_are_copies_and_a_configured_parent_covers_its_leaves(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path) -> None:
    pg_conn.execute("CREATE TABLE secrets (id bigint PRIMARY KEY, secret text) PARTITION BY RANGE (id)")
    pg_conn.execute("CREATE TABLE secrets_low PARTITION OF secrets FOR VALUES FROM (0) TO (100)")
    pg_conn.execute("CREATE TABLE secrets_high PARTITION OF secrets FOR VALUES FROM (100) TO (200)")
    pg_conn.cursor().executemany("INSERT INTO secrets VALUES (%s, %s)", [(i, fpc1_value("k1")) for i in (1, 2, 150)])
    pg_conn.execute("CREATE TABLE log (id bigint, entry text) PARTITION BY LIST (id)")
    pg_conn.execute("CREATE TABLE log_all PARTITION OF log DEFAULT")
    pg_conn.execute("INSERT INTO log VALUES (1, %s), (2, %s)", (fpc1_value("k1"), fpc1_value("k1")))
    pg_conn.execute("CREATE MATERIALIZED VIEW report_secrets AS SELECT id, secret FROM secrets")
    pg_conn.execute("CREATE MATERIALIZED VIEW later AS SELECT secret FROM secrets WITH NO DATA")
    settings = fpc1_settings(database_url, keys_file)

    report = retire_gate(settings, "k1")

    assert report.blocking["HISTORICAL"] == 3  # the target, through its parent
    assert {c: f["by_key"] for c, f in by_column(report.as_dict()).items()} == {
        "public.log_all.entry": {"k1": 2}, "public.report_secrets.secret": {"k1": 3}}
    assert report.blocking["OUTSIDE_TARGETS"] == 5
    assert report.discovery["not_swept"] == {"public.later": "materialized view not populated: it holds no rows"}
    # Skipping a partitioned table skips its partitions, each listed.
    skipped = retire_gate(fpc1_settings(database_url, keys_file, skip=("public.log", "public.report_*")), "k1")
    assert "OUTSIDE_TARGETS" not in skipped.blocking
    assert skipped.discovery["not_swept"]["public.log_all"] == "[gate] discover_skip (through public.log)"


# -- aesgcm: sampling -------------------------------------------------------------------------------------


def assert_binary_copies_elsewhere_close_the_gate_by_trying_every_value(world: MomentWorld) -> None:
    world.create_people()  # 12 rows on key 1, key 2 current
    world.execute(world.schema("backup", create=True))
    world.execute("CREATE TABLE backup.people AS SELECT id, name_cipher FROM people")
    world.execute("CREATE TABLE exported (id bigint, name_b64 text)")
    world.execute(f"INSERT INTO exported SELECT id, {world.base64('name_cipher')} FROM people WHERE id <= 5")
    settings = settings_for(world.url, world.keys_file)
    assert rotation.run_rotation(settings).exit_code == 0

    report = rotation.retire_gate(settings, "1")

    assert not report.open and report.blocking.get("HISTORICAL", 0) == 0
    assert report.blocking["OUTSIDE_TARGETS"] == 12 + 5
    exported = world.label("exported") + ".name_b64"
    assert by_column(report.as_dict()) == {
        "backup.people.name_cipher": {"column": "backup.people.name_cipher", "by_key": {"1": 12},
                                      "method": "trial", "tried": 12},
        exported: {"column": exported, "by_key": {"1": 5}, "method": "trial", "tried": 5}}
    world.execute(world.schema("backup", create=False))
    world.execute("DROP TABLE exported")
    assert rotation.retire_gate(settings, "1").open


def test_an_aesgcm_bytea_copy_in_another_schema_and_a_base64_text_copy_close_the_gate_by_trying_every_value(
        pg_world: PgMoment) -> None:
    assert_binary_copies_elsewhere_close_the_gate_by_trying_every_value(pg_world)


def test_a_large_copy_is_tried_value_by_value_and_every_value_under_the_key_is_counted(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path) -> None:
    provider = create_people(pg_conn, keys_file)
    ciphers = AesGcmCipherSet(provider.load_keyring())
    row = pg_conn.execute("SELECT name_cipher FROM people WHERE id = 1").fetchone()
    assert row is not None
    pg_conn.execute("CREATE TABLE big_copy (id bigint, blob bytea)")
    with pg_conn.cursor().copy("COPY big_copy FROM STDIN") as copy:
        for i in range(6000):  # every other row on key 1, the others on key 2 (current)
            copy.write_row((i, row[0] if i % 2 else ciphers.encrypt_current(b"x")))
    pg_conn.execute("ANALYZE big_copy")
    settings = settings_for(database_url, keys_file)
    assert rotation.run_rotation(settings).exit_code == 0

    # discover_sample no longer bounds anything: every value is tried.
    report = retire_gate(settings.model_copy(update={"gate": settings.gate.model_copy(
        update={"discover_sample": 50})}), "1")

    found = by_column(report.as_dict())["public.big_copy.blob"]
    assert found["tried"] == 6000 and found["by_key"] == {"1": 3000} and not report.open


def assert_the_runs_gate_section_sweeps_too_and_names_the_column(world: MomentWorld) -> None:
    world.create_people()
    world.execute("CREATE TABLE people_archive AS SELECT id, name_cipher FROM people")
    report = rotation.run_rotation(settings_for(world.url, world.keys_file))
    assert report.gate["1"] == {"open": False, "blocking": {"OUTSIDE_TARGETS": 12},
                                "outside_targets": [world.label("people_archive") + ".name_cipher"]}


def test_the_runs_gate_section_sweeps_too_and_names_the_column(pg_world: PgMoment) -> None:
    assert_the_runs_gate_section_sweeps_too_and_names_the_column(pg_world)


# -- tables the sweep cannot read ------------------------------------------------------------------------


def test_a_table_the_role_cannot_read_closes_the_gate_named_and_discover_skip_opens_it_listed_as_not_swept(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path, app_role: str) -> None:  # noqa: F811
    create_people(pg_conn, keys_file)
    assert rotation.run_rotation(settings_for(database_url, keys_file)).exit_code == 0
    pg_conn.execute(sql.SQL("GRANT SELECT, UPDATE ON people TO {}").format(sql.Identifier(app_role)))
    # An open gate waits for every session in flight, which the role must be able to see (gate.settle).
    pg_conn.execute(sql.SQL("GRANT pg_read_all_stats TO {}").format(sql.Identifier(app_role)))
    pg_conn.execute("CREATE TABLE hr_notes (id bigint, note text)")
    as_app = settings_for(url_as(database_url, app_role), keys_file)

    report = retire_gate(as_app, "1")

    assert not report.open and report.blocking["UNREADABLE"] == 1
    assert report.discovery["unreadable"] == {
        "public.hr_notes": "cannot read public.hr_notes: the sweep cannot see it; grant SELECT or list it in "
                           "[gate] discover_skip"}
    skipping = as_app.model_copy(update={"gate": as_app.gate.model_copy(update={"discover_skip": ("public.hr_*",)})})
    report = retire_gate(skipping, "1")
    assert report.open and report.discovery["not_swept"] == {"public.hr_notes": "[gate] discover_skip"}
    # Column privileges on every swept column are enough.
    pg_conn.execute(sql.SQL("GRANT SELECT (note) ON hr_notes TO {}").format(sql.Identifier(app_role)))
    assert retire_gate(as_app, "1").open


def assert_a_table_locked_by_ddl_past_the_lock_timeout_closes_the_gate_named(
        world: MomentWorld, monkeypatch: pytest.MonkeyPatch) -> None:
    world.create_secrets()
    world.execute("CREATE TABLE being_altered (id bigint, note text)")
    settings = fpc1_settings(world.url, world.keys_file)
    with world.locked_by_ddl("being_altered", monkeypatch) as refusal:
        report = rotation.retire_gate(settings, "k1")
    assert not report.open and report.blocking["UNREADABLE"] == 1
    assert report.discovery["unreadable"][world.label("being_altered")].startswith(refusal)
    assert rotation.retire_gate(settings, "k1").open


def test_a_table_locked_by_ddl_past_the_lock_timeout_closes_the_gate_named(
        pg_world: PgMoment, monkeypatch: pytest.MonkeyPatch) -> None:
    assert_a_table_locked_by_ddl_past_the_lock_timeout_closes_the_gate_named(pg_world, monkeypatch)


def test_discover_skip_entries_are_validated() -> None:
    raw = {"targets": [{"name": "T", "table": "t", "key_version": "kv", "columns": ["c"]}]}
    with pytest.raises(ConfigError, match=r'gate.discover_skip: entry 1 must be "schema.table" or '
                                          r'"schema.table.column"'):
        settings_from_mapping({**raw, "gate": {"discover_skip": ["a.b", "nodot"]}}, env={})


# -- inventory --discover ---------------------------------------------------------------------------------


def test_inventory_discover_lists_every_find_with_counts_per_key(primary_database_url: str, tmp_path: Path) -> None:
    keys_file = tmp_path / "keys.toml"
    with psycopg.connect(primary_database_url, autocommit=True) as conn:
        create_people(conn, keys_file)
        conn.execute("CREATE TABLE people_copy AS SELECT id, name_cipher FROM people")
        conn.execute("CREATE TABLE free_text (id bigint, body jsonb)")
        conn.execute("INSERT INTO free_text VALUES (1, jsonb_build_object('x', 'FPC1:AES-GCM:7:' || repeat('A', 40)))")
    config = tmp_path / "pinrotate.toml"
    config.write_text(f'[database]\nurl = "{primary_database_url}"\n[keys]\nprovider = "file"\nfile = "{keys_file}"\n'
                      '[[targets]]\nname = "People"\ntable = "people"\nkey_version = "key_version"\n'
                      'columns = ["name_cipher"]\n', encoding="utf-8")

    code, doc, err = cli("inventory", "--discover", "--json", "--config", str(config))

    assert code == 0, err
    assert doc["targets"]["People"]["by_key"] == {"1": 12}
    assert doc["discovered"] == [
        {"column": "public.free_text.body", "by_key": {"7": 1}, "method": "pattern"},
        {"column": "public.people_copy.name_cipher", "by_key": {"1": 12}, "method": "trial", "tried": 12}]
    assert doc["discovery"]["unreadable"] == {} and doc["discovery"]["tables_swept"] >= 2
    code, human, err = cli("inventory", "--discover", "--config", str(config))
    assert code == 0 and "public.people_copy.name_cipher" in human and "1: 12 (of 12 values tried)" in human
    code, human, err = cli("gate", "--retire", "1", "--config", str(config))
    assert code == 3 and "OUTSIDE_TARGETS=12" in human and "public.people_copy.name_cipher" in human, err


# -- Transit ------------------------------------------------------------------------------------------------


@pytest.mark.vault
def test_a_vault_v1_copy_outside_the_targets_blocks_retiring_v2(
        database_url: str, pg_conn: psycopg.Connection[Any], openbao: Any) -> None:
    mount, key = new_transit(openbao)
    seed_people(pg_conn, transit(openbao, mount, key), 6, phases=2)  # v1 and v2; latest is v3
    pg_conn.execute("CREATE TABLE people_archive AS SELECT id, jsonb_build_object('name', name_cipher) AS doc "
                    "FROM people WHERE key_version = 1")
    settings = transit_settings(database_url, openbao, mount, key)
    assert rotation.run_rotation(settings).exit_code == 0

    report = retire_gate(settings, "2")

    assert not report.open and report.blocking.get("HISTORICAL", 0) == 0 and report.blocking["OUTSIDE_TARGETS"] == 3
    assert by_column(report.as_dict())["public.people_archive.doc"]["by_key"] == {"1": 3}
    assert not retire_gate(settings, "1").open
    pg_conn.execute("DROP TABLE people_archive")
    assert retire_gate(settings, "2").open
