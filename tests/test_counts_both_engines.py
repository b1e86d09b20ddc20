"""Counts are the same figures on PostgreSQL and on MariaDB.

A drain's backlog is the same figure on PostgreSQL and on MariaDB: every row (``aesgcm``) or
value (``fpc1``) its scheme calls stale, a value under a key the keyring does not hold included
(UNKNOWN_KEY: it is not on the current key, and no run can move it). MariaDB counted only the
HISTORICAL and LEGACY ones, so its run reported nothing left where PostgreSQL's reported the
value that still needs its key. TEST keys only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pinrotate_core import rotation
from pinrotate_core.config import settings_from_mapping

from .test_fpc1_hold_whole_target import Execute, database  # noqa: F401 (the fixture)
from .test_fpc1_migration import K1, custom_settings, fpc1, write_keys
from .test_scope_matrix import AesGcmWorld
from .test_transit_drain import new_transit, transit
from .transit_helpers import transit_encrypt


def test_a_value_under_a_key_the_keyring_lacks_is_still_backlog_on_both_engines(
        database: tuple[str, Execute], tmp_path: Path) -> None:  # noqa: F811
    url, execute = database
    # fpc1: two values under k1 (HISTORICAL), one under k9 (no such key: UNKNOWN_KEY).
    execute("CREATE TABLE creds (id bigint PRIMARY KEY, pw varchar(200))", ())
    for i, v in enumerate([fpc1("k1", K1, b"one"), fpc1("k1", K1, b"two"), fpc1("k9", K1, b"nine")], start=1):
        execute("INSERT INTO creds VALUES (%s, %s)", (i, v))
    keys = tmp_path / "fpc1-keys.toml"
    write_keys(keys)
    report = rotation.run_rotation(custom_settings(url, keys, {"table": "creds", "columns": ["pw"]}),
                                   expected_key="k2")
    result = report.targets["T"]
    assert (result.backlog_before, result.reencrypted, result.backlog_remaining) == (3, 2, 1)

    # aesgcm: two rows under key 1 (HISTORICAL), one under key 0 (UNKNOWN_KEY).
    world = AesGcmWorld(tmp_path / "aes-keys.toml")
    old, _ = world.encrypt([b"a", b"b", b"c"], [])
    blob = "bytea" if url.startswith("postgresql") else "varbinary(200)"
    execute(f"CREATE TABLE people (id bigint PRIMARY KEY, key_version integer, c {blob})", ())
    for i, (version, value) in enumerate(zip([1, 1, 0], old), start=1):
        execute("INSERT INTO people VALUES (%s, %s, %s)", (i, version, value))
    settings = settings_from_mapping({
        "database": {"url": url},
        "keys": {"provider": "file", "file": str(world.keys_file)},
        "job": {"batch_size": 2, "inter_batch_delay": 0},
        "targets": [{"name": "P", "format": "aesgcm", "table": "people", "columns": ["c"],
                     "key_version": "key_version"}]}, env={})
    report = rotation.run_rotation(settings)
    result = report.targets["P"]
    assert (result.backlog_before, result.reencrypted, result.backlog_remaining) == (3, 2, 1)


def test_an_out_of_scope_row_counts_each_value_whose_version_cannot_be_read_as_unknown(
        database: tuple[str, Execute], openbao: Any) -> None:  # noqa: F811
    """An out-of-scope value under no readable key version is UNKNOWN, not EXCLUDED (what it is
    under cannot be told), one count per value as every other category: PostgreSQL counted such a
    row once, however many of its values were unreadable."""
    url, execute = database
    mount, key = new_transit(openbao)
    (v1,) = transit_encrypt(transit(openbao, mount, key), [b"x"])
    execute("CREATE TABLE memo (id bigint PRIMARY KEY, deleted varchar(8), a varchar(300), b varchar(300))", ())
    execute("INSERT INTO memo VALUES (1, 'yes', 'garbage', 'also garbage'), (2, 'yes', %s, 'garbage'),"
            " (3, NULL, %s, NULL)", (v1, v1))
    settings = settings_from_mapping({
        "database": {"url": url},
        "keys": {"provider": "vault-transit",
                 "vault": {"addr": openbao.addr, "token": openbao.token, "transit_mount": mount, "key": key}},
        "targets": [{"name": "Memo", "table": "memo", "id": "id", "columns": ["a", "b"], "format": "vault-transit",
                     "soft_delete": "deleted"}]}, env={})
    counts = rotation.inventory(settings).targets["Memo"].as_dict()
    assert {c: counts[c] for c in ("total", "ACTIVE", "UNKNOWN", "EXCLUDED")} == {
        "total": 5, "ACTIVE": 1, "UNKNOWN": 3, "EXCLUDED": 1}
