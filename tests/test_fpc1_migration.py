"""The fpc1 migration path on real PostgreSQL: inventory, dry run, compare-and-swap run, retire gate.

Schema and configuration are tests/data/fpc1_generic.sql and tests/data/fpc1_generic.toml. All keys are random TEST
keys made here. Concurrent edits are made deterministic by the drain's ``before_write`` hook
(between a batch's read and its write), never by sleeping.
"""

from __future__ import annotations

import base64
import json
import re
import secrets
import tomllib
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psycopg
import pytest
from cryptography.hazmat.primitives import padding
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from psycopg import sql

from pinrotate_core import rotation
from pinrotate_core.config import Settings, settings_from_mapping
from pinrotate_core.drain import BatchEvent, DrainOptions, DrainResult
from pinrotate_core.errors import ConfigError, RefusedToStart
from pinrotate_core.keyring import Key, Keyring
from pinrotate_core.providers.file import FileKeyProvider
from pinrotate_core.rotation import retire_gate
from pinrotate_core.schemes.base import ValueClass
from pinrotate_core.schemes.fpc1_values import classify_value, length_after, parse_fpc1
from pinrotate_core.scope import live_condition

from .fpc1_db import Fpc1Db, PgFpc1Db
from .helpers import assert_secret_free

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TEST_DATA = Path(__file__).resolve().parent / "data"
K1 = secrets.token_bytes(16)
K2 = secrets.token_bytes(16)
LEGACY = secrets.token_bytes(16)
DC, LC = "DataConnection", "LowcodeConfig"


# --- values and keys ----------------------------------------------------------------------------


def fpc1(key_id: str, material: bytes, plaintext: bytes, algorithm: str = "SM4") -> str:
    """As Forge writes it (SM4 or AES, ECB/PKCS#7, base64), by this file's own ECB code."""
    return f"FPC1:{algorithm}:{key_id}:{ecb(algorithm, material, plaintext)}"


def ecb(algorithm: str, key: bytes, plaintext: bytes) -> str:
    padder = padding.PKCS7(128).padder()
    padded = padder.update(plaintext) + padder.finalize()
    block = algorithms.SM4(key) if algorithm == "SM4" else algorithms.AES(key)
    enc = Cipher(block, modes.ECB()).encryptor()
    return base64.b64encode(enc.update(padded) + enc.finalize()).decode()


def legacy_ecb(plaintext: bytes, key: bytes = LEGACY, algorithm: str = "SM4") -> str:
    """A legacy value as Forge writes it with write-versioned = false: the bare payload."""
    return ecb(algorithm, key, plaintext)


def tampered(value: str) -> str:
    head, payload = value.rsplit(":", 1)
    raw = bytearray(base64.b64decode(payload))
    raw[-1] ^= 0x01
    return f"{head}:{base64.b64encode(bytes(raw)).decode()}"


def write_keys(path: Path, current: str = "k2", keys: dict[str, bytes] | None = None,
               legacy: bytes | None = LEGACY) -> None:
    keys = {"k1": K1, "k2": K2} if keys is None else keys
    lines = [f'current = "{current}"\n']
    if legacy is not None:
        lines.append(f'legacy = "{base64.b64encode(legacy).decode()}"\n')
    lines.append("[keys]\n")
    lines += [f'{k} = "{base64.b64encode(v).decode()}"\n' for k, v in keys.items()]
    path.write_text("".join(lines), encoding="utf-8")
    path.chmod(0o600)


def ring() -> Keyring:
    return Keyring(current="k2", keys={"k1": Key("k1", K1), "k2": Key("k2", K2)}, source="test",
                   legacy=Key("legacy", LEGACY))


def decrypt(value: str, legacy_algorithm: str = "SM4") -> bytes:
    """What Forge reads from ``value`` (its header rules, ECB/PKCS#7), by this file's own code."""
    if value.startswith("FPC1:"):
        _, algorithm, key_id, payload = value.split(":", 3)
        return unecb(algorithm.upper(), {"k1": K1, "k2": K2}[key_id], payload)
    return unecb(legacy_algorithm, LEGACY, value)


def unecb(algorithm: str, key: bytes, payload: str) -> bytes:
    block = algorithms.SM4(key) if algorithm == "SM4" else algorithms.AES(key)
    dec = Cipher(block, modes.ECB()).decryptor()
    padded = dec.update(base64.b64decode(payload, validate=True)) + dec.finalize()
    unpadder = padding.PKCS7(128).unpadder()
    return unpadder.update(padded) + unpadder.finalize()


def forge_settings(database_url: str, keys_file: Path, **keys: Any) -> Settings:
    raw = tomllib.loads((TEST_DATA / "fpc1_generic.toml").read_text(encoding="utf-8"))
    raw["database"] = {"url": database_url}
    raw["keys"]["file"] = str(keys_file)
    raw["keys"].update(keys)
    raw["job"].update(batch_size=2, inter_batch_delay=0)
    return settings_from_mapping(raw, env={})


def custom_settings(database_url: str, keys_file: Path, target: dict[str, Any], **keys: Any) -> Settings:
    raw: dict[str, Any] = {
        "database": {"url": database_url},
        "keys": {"provider": "file", "file": str(keys_file), "legacy_read_enabled": True, **keys},
        "job": {"batch_size": 2, "inter_batch_delay": 0},
        "targets": [{"name": "T", "format": "fpc1", **target}],
    }
    return settings_from_mapping(raw, env={})


@pytest.fixture(name="db")
def pg_fpc1_db(database_url: str, pg_conn: psycopg.Connection[Any]) -> PgFpc1Db:
    """The test's database; tests/test_fpc1_migration_mysql.py runs the same bodies on MariaDB."""
    return PgFpc1Db(pg_conn, database_url)


# --- the Forge-like data set ----------------------------------------------------------------------


class Forge:
    """tests/data/fpc1_generic.sql (or its MySQL twin) with a known set of rows; remembers every plaintext by (table, id, field)."""

    def __init__(self, db: Fpc1Db | psycopg.Connection[Any], algorithm: str = "SM4") -> None:
        self.db = PgFpc1Db(db) if isinstance(db, psycopg.Connection) else db
        self.plain: dict[tuple[str, int, str], bytes] = {}
        self.db.create_schema()
        a = algorithm
        self.dc_rows: dict[int, tuple[int, bool, str | None]] = {
            # id: (tenant, deleted, password)
            1: (1, False, self._v("dc", 1, "password", "legacy")),
            2: (1, False, self._v("dc", 2, "password", "k1", a)),
            3: (1, False, self._v("dc", 3, "password", "k2", a)),
            4: (2, False, self._v("dc", 4, "password", "k1", a)),
            5: (1, True, self._v("dc", 5, "password", "k1", a)),
            6: (1, False, None),
            7: (2, False, self._v("dc", 7, "password", "legacy")),
        }
        for row_id, (tenant, deleted, pw) in self.dc_rows.items():
            self.db.execute("INSERT INTO data_connections (id, tenant_id, name, password, deleted, updated_at) "
                            f"VALUES (%s, %s, %s, %s, %s, {self.db.timestamp})",
                            (row_id, tenant, f"conn{row_id}", pw, deleted))
        self.lc_rows: dict[int, tuple[int, bool, dict[str, Any]]] = {
            1: (1, False, {"host": "db1", "password": self._v("lc", 1, "$.password", "k1", a),
                           "token": self._v("lc", 1, "$.token", "legacy"), "port": 5432}),
            2: (2, False, {"password": self._v("lc", 2, "$.password", "k2", a),
                           "token": self._v("lc", 2, "$.token", "k1", a)}),
            3: (1, True, {"password": self._v("lc", 3, "$.password", "k1", a)}),
            4: (1, False, {"host": "plain only"}),
        }
        for row_id, (tenant, deleted, doc) in self.lc_rows.items():
            self.db.execute("INSERT INTO lowcode_configs (id, tenant_id, deleted, config_key, encrypt_config, "
                            f"updated_at) VALUES (%s, %s, %s, %s, %s, {self.db.timestamp})",
                            (row_id, tenant, deleted, f"form{row_id}", json.dumps(doc, indent=1)))

    def _v(self, table: str, row_id: int, field: str, key: str, algorithm: str = "SM4") -> str:
        plaintext = f"secret {table}{row_id}{field} пароль {secrets.token_hex(4)}".encode()
        self.plain[(table, row_id, field)] = plaintext
        if key == "legacy":
            return legacy_ecb(plaintext)
        return fpc1(key, {"k1": K1, "k2": K2}[key], plaintext, algorithm)

    def snapshot(self) -> list[tuple[Any, ...]]:
        rows = self.db.execute("SELECT * FROM data_connections ORDER BY id")
        rows += self.db.execute("SELECT * FROM lowcode_configs ORDER BY id")
        return rows

    def password(self, row_id: int) -> str | None:
        [row] = self.db.execute("SELECT password FROM data_connections WHERE id = %s", (row_id,))
        return row[0]  # type: ignore[no-any-return]

    def config(self, row_id: int) -> str:
        [row] = self.db.execute("SELECT encrypt_config FROM lowcode_configs WHERE id = %s", (row_id,))
        return row[0]  # type: ignore[no-any-return]

    def stored_values(self) -> list[str]:
        out = [pw for _, _, pw in self.dc_rows.values() if pw]
        for _, _, doc in self.lc_rows.values():
            out += [v for k, v in doc.items() if k in ("password", "token")]
        return out


def report_counts(report: rotation.RunReport) -> dict[str, dict[str, Any]]:
    out = {}
    for name, r in report.as_dict()["targets"].items():
        out[name] = {k: v for k, v in r.items() if k != "duration_ms"}
    return out


# --- round trips --------------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", ["SM4", "AES"])
def test_legacy_and_historical_values_move_to_the_active_key_and_read_back_the_same(
        db: Fpc1Db, keys_file: Path, algorithm: str) -> None:
    forge = Forge(db, algorithm)
    write_keys(keys_file)
    settings = forge_settings(db.url, keys_file)
    docs_before = {i: forge.config(i) for i in forge.lc_rows}

    report = rotation.run_rotation(settings, expected_key="k2")

    assert report.exit_code == rotation.EXIT_OK
    dc, lc = report.targets[DC], report.targets[LC]
    assert (dc.reencrypted, dc.conflicts, dc.failed, dc.backlog_remaining) == (4, 0, [], 0)
    assert (lc.reencrypted, lc.conflicts, lc.failed, lc.backlog_remaining) == (3, 0, [], 0)
    for row_id in (1, 2, 3, 4, 7):
        value = forge.password(row_id)
        assert value is not None
        parsed = parse_fpc1(value)
        assert parsed.key_id == "k2"
        # An FPC1 value keeps its algorithm; a legacy value takes its column's (Forge's default SM4).
        assert parsed.algorithm == ("SM4" if row_id in (1, 7) else algorithm)
        assert decrypt(value) == forge.plain[("dc", row_id, "password")]
    assert forge.password(6) is None
    assert forge.password(5) == forge.dc_rows[5][2]  # soft-deleted: untouched

    for row_id, fields in ((1, ("$.password", "$.token")), (2, ("$.password", "$.token"))):
        after = forge.config(row_id)
        doc = json.loads(after)
        rewritten = after
        for path in fields:
            name = path[2:]
            assert parse_fpc1(doc[name]).key_id == "k2"
            assert decrypt(doc[name]) == forge.plain[("lc", row_id, path)]
            rewritten = rewritten.replace(doc[name], forge.lc_rows[row_id][2][name])
        # Only the encrypted strings changed: every other byte of the document is as written.
        assert rewritten == docs_before[row_id]
    assert forge.config(3) == docs_before[3] and forge.config(4) == docs_before[4]
    untouched = db.execute(f"SELECT count(*) FROM data_connections WHERE version = 1 AND updated_at = {db.timestamp}")
    assert untouched == [(7,)]

    inv = rotation.inventory(settings).targets
    assert inv[DC].counts["ACTIVE"] == 5 and inv[LC].counts["ACTIVE"] == 4
    for name in (DC, LC):
        assert {c: inv[name].counts[c] for c in ("HISTORICAL", "LEGACY", "UNKNOWN", "UNKNOWN_KEY", "CONFLICT",
                                                  "BLOCKED")} == dict.fromkeys(
            ("HISTORICAL", "LEGACY", "UNKNOWN", "UNKNOWN_KEY", "CONFLICT", "BLOCKED"), 0)
    # The soft-deleted rows (dc 5, lc 3) stay on k1 for ever: they keep its gate closed (EXCLUDED).
    assert report.gate["k1"] == {"open": False, "blocking": {"EXCLUDED": 2}}
    assert report.gate["legacy"]["open"]
    # A second run finds nothing to do: ACTIVE values are skipped.
    again = rotation.run_rotation(settings, expected_key="k2")
    assert again.exit_code == 0 and again.targets[DC].reencrypted == 0 and again.targets[LC].reencrypted == 0


def test_jsonb_column_fields_are_rewritten_with_compare_and_swap(
        db: Fpc1Db, keys_file: Path) -> None:
    db.execute(f"CREATE TABLE forms (id uuid PRIMARY KEY, cfg {db.json_type}, other {db.json_type})")
    plaintext = b"jsonb secret"
    ids = [uuid.uuid4() for _ in range(3)]
    for i in ids:
        doc = {"auth": {"secret": fpc1("k1", K1, plaintext)}, "n": 1.5, "list": [1, 2]}
        db.execute("INSERT INTO forms VALUES (%s, %s, '{\"a\": 1}')", (str(i), json.dumps(doc)))
    write_keys(keys_file)
    settings = custom_settings(db.url, keys_file, {"table": "forms", "columns": ["cfg"],
                                                         "json_paths": {"cfg": ["$.auth.secret"]}})
    report = rotation.run_rotation(settings, expected_key="k2")
    assert report.exit_code == 0 and report.targets["T"].reencrypted == 3
    for (cfg,) in db.execute("SELECT cfg FROM forms"):
        cfg = db.json_value(cfg)
        assert parse_fpc1(cfg["auth"]["secret"]).key_id == "k2"
        assert decrypt(cfg["auth"]["secret"]) == plaintext
        assert cfg["n"] == 1.5 and cfg["list"] == [1, 2]


# --- dry run ------------------------------------------------------------------------------------


def test_dry_run_writes_nothing_and_reports_the_counts_of_the_real_run(
        db: Fpc1Db, keys_file: Path) -> None:
    forge = Forge(db)
    # Make every count non-trivial: an unparseable value, a missing key, a value that does not decrypt.
    db.execute("UPDATE data_connections SET password = 'not a ciphertext' WHERE id = 3")
    db.execute("INSERT INTO data_connections (id, tenant_id, name, password) VALUES "
                    "(8, 1, 'c8', %s), (9, 2, 'c9', %s)",
                    (fpc1("k9", secrets.token_bytes(16), b"gone"), tampered(fpc1("k1", K1, b"broken"))))
    write_keys(keys_file)
    settings = forge_settings(db.url, keys_file)
    before = forge.snapshot()

    dry = rotation.run_rotation(settings, dry_run=True)

    assert forge.snapshot() == before
    assert dry.dry_run and dry.exit_code == rotation.EXIT_FAIL_CLOSED  # the real run would fail closed too
    real = rotation.run_rotation(settings, expected_key="k2")
    assert report_counts(dry) == report_counts(real)
    # The tampered k1 value holds back every k1 value (ECB: no tag); the legacy values move.
    assert report_counts(real)[DC]["reencrypted"] == 2 and report_counts(real)[DC]["failed"] == 2
    assert real.exit_code == rotation.EXIT_FAIL_CLOSED


def test_a_dry_run_needs_no_expected_key_version_and_runs_read_only(
        db: Fpc1Db, keys_file: Path) -> None:
    forge = Forge(db)
    write_keys(keys_file)
    settings = forge_settings(db.url, keys_file, write_versioned=False)
    before = forge.snapshot()
    report = rotation.run_rotation(settings, dry_run=True)
    assert report.exit_code == 0 and report.targets[DC].reencrypted == 4
    assert forge.snapshot() == before
    [stats] = db.execute("SELECT sum(n_tup_upd) FROM pg_stat_user_tables")
    assert not stats[0]


def test_fpc1_targets_drain_with_several_workers_like_the_others(
        db: Fpc1Db, keys_file: Path) -> None:
    """max_degree_of_parallelism splits an fpc1 backlog into id ranges, one worker each, as for the
    row-locked schemes: the same counts as one worker, every value on the active key."""
    forge = Forge(db)
    write_keys(keys_file)
    raw = tomllib.loads((TEST_DATA / "fpc1_generic.toml").read_text(encoding="utf-8"))
    raw["database"] = {"url": db.url}
    raw["keys"]["file"] = str(keys_file)
    raw["job"].update(batch_size=1, inter_batch_delay=0, max_degree_of_parallelism=3)
    settings = settings_from_mapping(raw, env={})
    events: list[BatchEvent] = []
    ctx = rotation.open_run(settings, expected_key="k2")
    try:
        rotation.read_current_key(ctx)
        rotation.resolve_all(ctx)
        dc = rotation.drain(ctx, DC, on_batch=events.append)
    finally:
        ctx.close()
    assert (dc.reencrypted, dc.conflicts, dc.failed, dc.backlog_remaining) == (4, 0, [], 0)
    assert len({e.worker for e in events if e.target == DC}) > 1  # more than one worker drained
    for row_id in (1, 2, 3, 4, 7):
        value = forge.password(row_id)
        assert value is not None and parse_fpc1(value).key_id == "k2"


# --- conflicts ----------------------------------------------------------------------------------


def drain_with_hook(settings: Settings, target: str, hook: Callable[[int, Sequence[Any]], None],
                    tenant: str | None = None) -> DrainResult:
    """Run one fpc1 drain through the run's own steps, with ``hook`` between read and write."""
    ctx = rotation.open_run(settings, target_names=[target], expected_key="k2", tenant=tenant)
    try:
        rotation.read_current_key(ctx)
        rotation.resolve_all(ctx)
        options = DrainOptions(batch_size=settings.job.batch_size, run_id=ctx.run_id, tenant=tenant,
                               before_write=hook)
        return ctx.commands.drain(ctx.engine, ctx.schemes[target], options)
    finally:
        ctx.close()


def test_an_edit_between_read_and_write_is_a_conflict_and_the_edit_is_kept(
        db: Fpc1Db, keys_file: Path, pinrotate_home: Path) -> None:
    forge = Forge(db)
    write_keys(keys_file)
    settings = forge_settings(db.url, keys_file)
    app_value = fpc1("k2", K2, b"the user's new password")

    def application_edits(batch: int, ids: Sequence[Any]) -> None:
        if batch == 1:
            assert 2 in ids
            db.execute("UPDATE data_connections SET password = %s WHERE id = 2", (app_value,))

    result = drain_with_hook(settings, DC, application_edits)

    assert result.conflicts == 1 and result.conflicts_by_tenant == {"1": 1}
    assert result.reencrypted == 3 and result.fail_closed
    assert forge.password(2) == app_value  # never overwritten
    assert parse_fpc1(forge.password(1) or "").key_id == "k2"

    # The gate sees the last run's conflict, though every value is now on k2.
    inv = rotation.inventory(settings)
    assert inv.targets[DC].counts["CONFLICT"] == 1 and inv.targets[DC].counts["HISTORICAL"] == 0
    assert rotation.inventory(settings, tenant="2").targets[DC].counts["CONFLICT"] == 0
    rotation.run_rotation(settings, target_names=[LC], expected_key="k2")
    gate = retire_gate(settings, "k1")
    assert not gate.open and gate.blocking["CONFLICT"] == 1
    assert {c: n for c, n in gate.blocking.items() if n} == {"CONFLICT": 1, "EXCLUDED": 2}  # + soft-deleted

    # The record lives in the database (pinrotate.conflicts), counts and names only; no file.
    rows = db.conflict_rows()
    assert [r[:3] for r in rows] == [(DC, "1", 1)]
    text = repr(rows)
    assert not list(pinrotate_home.glob("state/*"))
    assert_secret_free(text, app_value, db.url, *forge.stored_values(),
                       *(p.decode() for p in forge.plain.values()), K1, K2, LEGACY)

    # A later clean run clears it, and the gate opens.
    clean = rotation.run_rotation(settings, expected_key="k2")
    assert clean.exit_code == 0 and clean.targets[DC].conflicts == 0
    assert rotation.inventory(settings).targets[DC].counts["CONFLICT"] == 0
    assert retire_gate(settings, "k1", erase_excluded=True).open  # only the soft-deleted rows were left


def test_an_edit_inside_a_json_document_is_a_conflict_and_the_document_is_kept(
        db: Fpc1Db, keys_file: Path) -> None:
    forge = Forge(db)
    write_keys(keys_file)
    settings = forge_settings(db.url, keys_file)
    edited: dict[str, str] = {}

    def application_edits(batch: int, ids: Sequence[Any]) -> None:
        if batch == 1:
            doc = json.loads(forge.config(1))
            doc["host"] = "db1-new"  # a clear field: the whole document's CAS must still fail
            edited["text"] = json.dumps(doc)
            db.execute("UPDATE lowcode_configs SET encrypt_config = %s WHERE id = 1", (edited["text"],))

    result = drain_with_hook(settings, LC, application_edits)
    assert result.conflicts == 2  # both stale fields of that document
    assert forge.config(1) == edited["text"]
    assert result.reencrypted == 1  # row 2's token


def test_deleting_a_row_between_read_and_write_is_a_conflict_and_it_stays_untouched(
        db: Fpc1Db, keys_file: Path) -> None:
    forge = Forge(db)
    write_keys(keys_file)
    settings = forge_settings(db.url, keys_file)

    def application_deletes(batch: int, ids: Sequence[Any]) -> None:
        if batch == 1:
            db.execute("UPDATE data_connections SET deleted = true WHERE id = 1")

    result = drain_with_hook(settings, DC, application_deletes)
    assert result.conflicts == 1 and forge.password(1) == forge.dc_rows[1][2]


# --- scope --------------------------------------------------------------------------------------


def test_a_tenant_run_changes_only_that_tenant_and_the_gate_counts_every_tenant(
        db: Fpc1Db, keys_file: Path) -> None:
    forge = Forge(db)
    write_keys(keys_file)
    settings = forge_settings(db.url, keys_file)
    other_before = db.execute("SELECT * FROM data_connections WHERE tenant_id = 2 ORDER BY id")

    report = rotation.run_rotation(settings, expected_key="k2", tenant="1")

    assert report.exit_code == 0
    assert report.targets[DC].reencrypted == 2 and report.targets[LC].reencrypted == 2
    assert db.execute("SELECT * FROM data_connections WHERE tenant_id = 2 ORDER BY id") == other_before
    assert parse_fpc1(json.loads(forge.config(2))["token"]).key_id == "k1"

    scoped = rotation.inventory(settings, tenant="1").targets[DC]
    assert scoped.counts["HISTORICAL"] == 0 and scoped.counts["LEGACY"] == 0
    assert scoped.counts["EXCLUDED"] == 3  # tenant 2 (rows 4, 7) and the deleted row 5
    # Tenant 1 is done, but the keyring is shared: tenant 2's rows keep k1's gate closed, --tenant or not.
    sliced = retire_gate(settings, "k1", tenant="1")
    assert not sliced.open and sliced.blocking["HISTORICAL"] == 2  # row 4 and lowcode row 2
    assert sliced.slice is not None and sliced.slice["decides"] is False
    assert {name: t["on_key"] for name, t in sliced.slice["targets"].items()} == {DC: 0, LC: 0}
    everyone = retire_gate(settings, "k1")
    assert not everyone.open and everyone.blocking["HISTORICAL"] == 2
    assert everyone.slice is None
    assert not retire_gate(settings, "legacy").open


def test_soft_deleted_rows_are_never_touched_and_are_counted_as_excluded(
        db: Fpc1Db, keys_file: Path) -> None:
    forge = Forge(db)
    write_keys(keys_file)
    settings = forge_settings(db.url, keys_file)
    deleted_before = forge.password(5), forge.config(3)

    rotation.run_rotation(settings, expected_key="k2")

    assert (forge.password(5), forge.config(3)) == deleted_before
    inv = rotation.inventory(settings).targets
    assert inv[DC].counts["EXCLUDED"] == 1 and inv[DC].excluded_by_key == {"k1": 1}
    assert inv[LC].excluded_by_key == {"k1": 1}
    gate = retire_gate(settings, "k1")
    # Soft-deleted rows on k1 keep its gate closed: destroying k1 would erase them (restore would fail).
    assert not gate.open and {c: n for c, n in gate.blocking.items() if n} == {"EXCLUDED": 2}
    assert gate.targets[DC]["excluded_by_rule"] == {"soft_delete": 1}
    erased = retire_gate(settings, "k1", erase_excluded=True)
    assert erased.open and erased.as_dict()["excluded_on_key"] == {DC: {"soft_delete": 1}, LC: {"soft_delete": 1}}


def test_soft_delete_rule_reads_booleans_numbers_timestamps_and_text(
        pg_conn: psycopg.Connection[Any], keys_file: Path, database_url: str) -> None:
    pg_conn.execute("CREATE TABLE flags (id int PRIMARY KEY, b boolean, i numeric, ts timestamptz, t text)")
    pg_conn.execute("""INSERT INTO flags VALUES
        (1, NULL, NULL, NULL, NULL), (2, false, 0.00, NULL, '0'), (3, true, 1, now(), ' FALSE '),
        (4, true, 2, now(), 'n'), (5, true, -1, now(), ''), (6, true, 1, now(), 'yes'), (7, true, 1, now(), '1')""")
    # Live (in scope) ids per soft-delete column: NULL and false-like values are live, the rest deleted.
    expected = {"b": [1, 2], "i": [1, 2], "ts": [1, 2], "t": [1, 2, 3, 4, 5]}
    for column, live_ids in expected.items():
        settings = custom_settings(database_url, keys_file, {"table": "flags", "columns": ["t"], "soft_delete": column})
        query = sql.SQL("SELECT id FROM flags WHERE {} ORDER BY id").format(live_condition(settings.targets[0]))
        assert [r[0] for r in pg_conn.execute(query).fetchall()] == live_ids, column


# --- BLOCKED ------------------------------------------------------------------------------------


BLOCKED_CASES = {
    "missing table": ("CREATE TABLE other (id bigint PRIMARY KEY, pw text)",
                      {"table": "creds"}, "does not exist"),
    "no primary key": ("CREATE TABLE creds (id bigint, pw text)", {}, "no single-column primary key"),
    "composite primary key": ("CREATE TABLE creds (id bigint, k int, pw text, PRIMARY KEY (id, k))", {},
                              "no single-column primary key"),
    "missing tenant column": ("CREATE TABLE creds (id bigint PRIMARY KEY, pw text)", {"tenant": "tenant_id"},
                              "tenant column tenant_id does not exist"),
    "missing soft-delete column": ("CREATE TABLE creds (id bigint PRIMARY KEY, pw text)", {"soft_delete": "deleted"},
                                   "soft_delete column deleted does not exist"),
    "column too narrow": ("CREATE TABLE creds (id bigint PRIMARY KEY, pw varchar(75))", {}, "too narrow"),
}


@pytest.mark.parametrize("cause", list(BLOCKED_CASES))
def test_each_blocked_cause_blocks_the_inventory_and_the_gate_and_refuses_the_run(
        db: Fpc1Db, keys_file: Path, cause: str) -> None:
    ddl, target, reason = BLOCKED_CASES[cause]
    db.execute(ddl)
    if cause != "missing table":
        # 40 bytes of plaintext: 48 padded bytes, 64 base64 characters as legacy, 76 once FPC1:SM4 under "k2".
        db.execute("INSERT INTO creds (id, pw) VALUES (1, %s), (2, %s)" if "composite" not in cause else
                        "INSERT INTO creds (id, k, pw) VALUES (1, 1, %s), (2, 1, %s)",
                        (legacy_ecb(b"x" * 40), fpc1("k1", K1, b"short")))
    write_keys(keys_file)
    settings = custom_settings(db.url, keys_file, {"table": "creds", "columns": ["pw"], **target})
    before = db.execute("SELECT * FROM other" if cause == "missing table" else "SELECT * FROM creds")

    inv = rotation.inventory(settings).targets["T"]
    assert inv.counts["BLOCKED"] == 1 and reason in (inv.blocked_reason or "")
    gate = retire_gate(settings, "k1")
    assert not gate.open and gate.blocking["BLOCKED"] == 1
    with pytest.raises(ConfigError, match=re.escape(reason)):
        rotation.run_rotation(settings, expected_key="k2")
    with pytest.raises(ConfigError):
        rotation.run_rotation(settings, dry_run=True)
    after = db.execute("SELECT * FROM other" if cause == "missing table" else "SELECT * FROM creds")
    assert after == before


def test_a_read_only_connection_refuses_the_run_but_inventory_and_gate_read_through_it(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path) -> None:
    pg_conn.execute("CREATE TABLE creds (id bigint PRIMARY KEY, pw text)")
    pg_conn.execute("INSERT INTO creds (id, pw) VALUES (1, %s), (2, %s)",
                    (legacy_ecb(b"x" * 40), fpc1("k1", K1, b"short")))
    pg_conn.execute(sql.SQL("ALTER DATABASE {} SET default_transaction_read_only = on").format(
        sql.Identifier(pg_conn.info.dbname)))
    write_keys(keys_file)
    settings = custom_settings(database_url, keys_file, {"table": "creds", "columns": ["pw"]})
    before = pg_conn.execute("SELECT * FROM creds").fetchall()

    # Reading needs no writable connection (an auditor, a standby): counted, not BLOCKED.
    inv = rotation.inventory(settings).targets["T"]
    assert inv.counts["BLOCKED"] == 0 and inv.counts["LEGACY"] == 1 and inv.by_key == {"legacy": 1, "k1": 1}
    assert not retire_gate(settings, "k1").open  # closed by the value still on k1
    with pytest.raises(ConfigError, match="read-only"):
        rotation.run_rotation(settings, expected_key="k2")
    assert pg_conn.execute("SELECT * FROM creds").fetchall() == before


def test_a_column_wide_enough_for_every_new_value_is_not_blocked(
        db: Fpc1Db, keys_file: Path) -> None:
    db.execute("CREATE TABLE creds (id bigint PRIMARY KEY, pw varchar(76))")
    db.execute("INSERT INTO creds VALUES (1, %s)", (legacy_ecb(b"x" * 40),))
    write_keys(keys_file)
    settings = custom_settings(db.url, keys_file, {"table": "creds", "columns": ["pw"]})
    assert rotation.inventory(settings).targets["T"].counts["BLOCKED"] == 0
    report = rotation.run_rotation(settings, expected_key="k2")
    assert report.exit_code == 0 and report.targets["T"].reencrypted == 1
    assert db.execute("SELECT length(pw) FROM creds") == [(76,)]


@pytest.mark.parametrize("algorithm", ["SM4", "AES"])
@pytest.mark.parametrize("size", [0, 1, 15, 16, 17, 40, 255])
def test_length_after_migration_is_known_from_the_stored_value(algorithm: str, size: int) -> None:
    keyring = ring()
    plaintext = ("я" * size).encode()[:size] if size % 2 == 0 else b"a" * size
    for stored in (legacy_ecb(plaintext, algorithm=algorithm), fpc1("k1", K1, plaintext, algorithm),
                   "FPC1:" + algorithm + ":k1:" + base64.b64decode(ecb(algorithm, K1, plaintext)).hex()):
        value = classify_value(stored, keyring)
        predicted = length_after(stored, value, "k2")
        # What Forge's reencrypt writes: FPC1, the value's algorithm, the active key, base64.
        actual = len(fpc1("k2", K2, plaintext, algorithm))
        assert predicted == actual
    assert length_after("garbage", ValueClass("UNKNOWN"), "k2") is None


# --- UNKNOWN, UNKNOWN_KEY, FAILED ---------------------------------------------------------------


def test_unknown_and_unknown_key_values_are_counted_left_alone_and_the_run_fails_closed(
        db: Fpc1Db, keys_file: Path) -> None:
    forge = Forge(db)
    missing_key_value = fpc1("k9", secrets.token_bytes(16), b"under a key we lost")
    broken = tampered(fpc1("k1", K1, b"bit rot"))
    db.execute("INSERT INTO data_connections (id, tenant_id, name, password) VALUES "
                    "(10, 1, 'c10', 'plain text password'), (11, 1, 'c11', %s), (12, 1, 'c12', %s)",
                    (missing_key_value, broken))
    db.execute("INSERT INTO lowcode_configs (id, tenant_id, config_key, encrypt_config) VALUES "
                    "(10, 1, 'f10', 'not json'), (11, 1, 'f11', '{\"password\": 42}')")
    write_keys(keys_file)
    settings = forge_settings(db.url, keys_file)

    inv = rotation.inventory(settings, deep=True).targets
    assert inv[DC].counts["UNKNOWN"] == 1 and inv[DC].counts["UNKNOWN_KEY"] == 1
    assert inv[DC].by_key["k9"] == 1 and inv[DC].counts["FAILED"] == 1 and inv[DC].failed_by_key == {"k1": 1}
    assert inv[LC].counts["UNKNOWN"] == 2
    assert inv[DC].counts["LEGACY"] == 2 and inv[DC].by_key["legacy"] == 2

    report = rotation.run_rotation(settings, expected_key="k2")

    assert report.exit_code == rotation.EXIT_FAIL_CLOSED
    dc = report.targets[DC]
    assert isinstance(dc, DrainResult)
    # ECB has no tag: the k1 value whose padding fails holds back every k1 value (2 and 4 stay on
    # k1, counted key_held); the legacy values (1, 7) move.
    assert (dc.unknown, dc.unknown_key, dc.reencrypted, dc.counts["key_held"]) == (1, 1, 2, 2)
    assert forge.password(2) == forge.dc_rows[2][2] and forge.password(4) == forge.dc_rows[4][2]
    assert [(f.id, f.columns, f.reason) for f in dc.failed] == [
        ("11", ("password",), "unknown_key"), ("12", ("password",), "decrypt_failed")]
    assert forge.password(10) == "plain text password"
    assert forge.password(11) == missing_key_value and forge.password(12) == broken
    text = json.dumps(report.as_dict())
    assert_secret_free(text, missing_key_value, broken, "plain text password", *forge.stored_values(),
                       *(p.decode() for p in forge.plain.values()))
    gate = retire_gate(settings, "k1")
    assert not gate.open
    assert gate.blocking["UNKNOWN"] == 3 and gate.blocking["UNKNOWN_KEY"] == 1 and gate.blocking["FAILED"] == 1


def test_in_a_row_with_two_stale_fields_each_value_is_decided_on_its_own(
        db: Fpc1Db, keys_file: Path) -> None:
    """Each value alone: the good one (legacy) moves, the bad one (k1, its padding fails) is FAILED.
    (Its key k1 is held back for the run: no k1 value would move; the legacy key is not.)"""
    db.execute("CREATE TABLE creds (id bigint PRIMARY KEY, a text, b text)")
    good = legacy_ecb(b"fine")
    bad = tampered(fpc1("k1", K1, b"broken"))
    db.execute("INSERT INTO creds VALUES (1, %s, %s)", (good, bad))
    write_keys(keys_file)
    settings = custom_settings(db.url, keys_file, {"table": "creds", "columns": ["a", "b"]})
    report = rotation.run_rotation(settings, expected_key="k2")
    result = report.targets["T"]
    assert result.reencrypted == 1 and [(f.columns, f.reason) for f in result.failed] == [(("b",), "decrypt_failed")]
    [row] = db.execute("SELECT a, b FROM creds")
    assert parse_fpc1(row[0]).key_id == "k2" and decrypt(row[0]) == b"fine" and row[1] == bad


def test_legacy_values_are_counted_but_not_migrated_while_legacy_reading_is_off(
        db: Fpc1Db, keys_file: Path) -> None:
    forge = Forge(db)
    write_keys(keys_file)
    settings = forge_settings(db.url, keys_file, legacy_read_enabled=False)
    report = rotation.run_rotation(settings, expected_key="k2")
    dc = report.targets[DC]
    assert report.exit_code == 0
    assert isinstance(dc, DrainResult) and dc.legacy_left == 2 and dc.reencrypted == 2
    assert forge.password(1) == forge.dc_rows[1][2] and forge.password(7) == forge.dc_rows[7][2]
    assert report.gate["k1"] == {"open": False, "blocking": {"EXCLUDED": 2}}  # only the soft-deleted rows
    assert not report.gate["legacy"]["open"]
    assert report.gate["legacy"]["blocking"] == {"LEGACY": 3}


# --- the gate -----------------------------------------------------------------------------------


def test_the_gate_opens_only_when_every_blocking_count_is_zero(
        db: Fpc1Db, keys_file: Path) -> None:
    forge = Forge(db)
    write_keys(keys_file)
    settings = forge_settings(db.url, keys_file)
    first = retire_gate(settings, "k1")
    assert not first.open and first.blocking["HISTORICAL"] == 4
    legacy = retire_gate(settings, "legacy")
    assert not legacy.open and legacy.blocking["LEGACY"] == 3
    with pytest.raises(ConfigError, match="key k2 is the current key"):  # the active key is never free to go
        retire_gate(settings, "k2")

    db.execute("UPDATE data_connections SET password = 'garbage' WHERE id = 3")
    rotation.run_rotation(settings, expected_key="k2")
    for key, also in (("k1", {"EXCLUDED": 2}), ("legacy", {})):  # k1: + the soft-deleted rows
        gate = retire_gate(settings, key, erase_excluded=True)
        assert not gate.open and {c: n for c, n in gate.blocking.items() if n} == {"UNKNOWN": 1}
        gate = retire_gate(settings, key)
        assert not gate.open and {c: n for c, n in gate.blocking.items() if n} == {"UNKNOWN": 1, **also}

    # The application rewrites the bad value; now nothing is left and nothing could be hiding.
    db.execute("UPDATE data_connections SET password = %s WHERE id = 3", (fpc1("k2", K2, b"fixed"),))
    for key in ("k1", "legacy"):
        gate = retire_gate(settings, key, erase_excluded=True)  # k1: the soft-deleted rows are accepted lost
        assert gate.open and not any(gate.blocking.values())
    # The report is evidence for the change ticket: tenants covered and what produced it, no value.
    report = gate.as_dict()
    assert report["tenants"] and all(isinstance(t, str) for t in report["tenants"])
    assert report["application_version"].startswith("pinrotate ")
    assert forge.password(5) is not None


# --- refusals -----------------------------------------------------------------------------------


def test_write_versioned_false_refuses_a_real_run_and_touches_nothing(
        db: Fpc1Db, keys_file: Path) -> None:
    forge = Forge(db)
    write_keys(keys_file)
    settings = forge_settings(db.url, keys_file, write_versioned=False)
    before = forge.snapshot()
    with pytest.raises(RefusedToStart, match="write_versioned"):
        rotation.run_rotation(settings, expected_key="k2")
    assert forge.snapshot() == before


def test_a_wrong_or_missing_expected_key_version_refuses_and_touches_nothing(
        db: Fpc1Db, keys_file: Path) -> None:
    forge = Forge(db)
    write_keys(keys_file)
    settings = forge_settings(db.url, keys_file)
    before = forge.snapshot()
    for expected in ("k1", "K2", None):
        with pytest.raises(RefusedToStart, match="expected-key-version"):
            rotation.run_rotation(settings, expected_key=expected)
    assert forge.snapshot() == before


def test_a_keyring_fpc1_cannot_use_stops_the_start_and_touches_nothing(
        db: Fpc1Db, keys_file: Path) -> None:
    forge = Forge(db)
    write_keys(keys_file, keys={"k1": K1, "k2": secrets.token_bytes(32)})  # fpc1 keys are 16 bytes
    settings = forge_settings(db.url, keys_file)
    before = forge.snapshot()
    for dry_run in (True, False):
        with pytest.raises(ConfigError, match="key k2: fpc1 keys must be 16 bytes"):
            rotation.run_rotation(settings, dry_run=dry_run, expected_key="k2")
    assert forge.snapshot() == before


# --- bootstrap ----------------------------------------------------------------------------------


def test_first_run_of_the_file_provider_bootstraps_one_16_byte_fpc1_key_and_inventory_never_does(
        db: Fpc1Db, keys_file: Path) -> None:
    Forge(db)
    db.execute("DELETE FROM data_connections")
    db.execute("DELETE FROM lowcode_configs")
    settings = forge_settings(db.url, keys_file)
    assert not keys_file.exists()
    # A read never makes up a keyring: inventory refuses, naming the file.
    with pytest.raises(ConfigError, match="does not exist"):
        rotation.inventory(settings)
    assert not keys_file.exists()

    first = rotation.run_rotation(settings, dry_run=True)  # a first run's start creates it (contract §3)

    assert first.exit_code == 0
    assert keys_file.exists() and (keys_file.stat().st_mode & 0o777) == 0o600
    keyring = FileKeyProvider(keys_file, style="named").load_keyring()
    inv = rotation.inventory(settings)
    assert re.fullmatch(r"bootstrap-[0-9a-f]{12}", keyring.current) and inv.current_key == keyring.current
    assert [len(k.material) for k in keyring.keys.values()] == [16]
    value = fpc1(keyring.current, keyring.keys[keyring.current].material, b"first password")
    db.execute("INSERT INTO data_connections (id, tenant_id, name, password) VALUES (1, 1, 'c', %s)", (value,))
    report = rotation.run_rotation(settings, expected_key=keyring.current)
    assert report.exit_code == 0 and report.targets[DC].reencrypted == 0
    assert rotation.inventory(settings).targets[DC].counts["ACTIVE"] == 1
