"""The Pin profile (``aesgcm``) on MariaDB through the CLI: keys, inventory, gate and run on a
``mysql://`` configuration (contract §2 aesgcm in text and binary columns, §3-§6), every row read
back by the tests' own AES-GCM code.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from pinrotate_core import rotation
from pinrotate_core.config import load_settings
from tests.mariadb_server import MariaDbServer

from .pin_data import CIPHERS, DOCUMENT_SEEDED_AT, SEEDED_AT, TARGET_OF, PinInstall, install_pin
from .support import one_line_error, rotate

pytestmark = pytest.mark.mysql

UNTOUCHED = {"persons": ("owner_user_id", "gender", "is_deleted", "version", "created_at", "updated_at",
                         "updated_by_user_id"),
             "person_documents": ("person_id", "document_type", "number_hash", "number_mask", "version",
                                  "updated_at", "updated_by_user_id")}


@pytest.fixture
def pin(mariadb: MariaDbServer, mysql_database: str, tmp_path: Path) -> PinInstall:
    return install_pin(mariadb, mysql_database, tmp_path)


def test_pin_profile_on_mariadb_moves_every_row_to_the_new_key_keeping_updated_at_and_version(
        pin: PinInstall, prefect_api: str) -> None:
    cfg = ("--config", str(pin.config()))
    old = str(pin.old)
    # A new key is added read-only, then promoted (contract §4 keys), on a mysql:// configuration.
    code, added, err = rotate("keys", "add", *cfg, "--json")
    assert code == 0, err
    assert added["current"] == old and added["added"] != old
    new = added["added"]
    code, promoted, err = rotate("keys", "promote", new, *cfg, "--json")
    assert code == 0, err
    assert promoted["current"] == new and promoted["previous"] == old
    current, keys = pin.load_keys()
    assert current == new and set(keys) == {pin.old, int(new)} and keys[pin.old] == pin.keys[pin.old]

    code, inv, err = rotate("inventory", *cfg, "--json")
    assert code == 0, err
    assert inv["current_key"] == new
    for table, target in TARGET_OF.items():
        rows = sum(1 for t, _ in pin.plain if t == table)
        counts = inv["targets"][target]
        assert (counts["total"], counts["by_key"], counts["HISTORICAL"], counts["ACTIVE"]) == \
            (rows, {old: rows}, rows, 0), target
    code, doc, err = rotate("gate", "--retire", old, *cfg, "--json")
    assert code == 3 and doc["open"] is False, err
    assert doc["blocking"]["HISTORICAL"] == len(pin.plain)
    one_line_error(*rotate("gate", "--retire", new, *cfg, "--json"), expected=2)  # the current key

    before = {table: pin.rows(table) for table in CIPHERS}
    code, report, err = rotate("run", "--expected-key-version", new, *cfg, "--json", prefect_api=prefect_api)
    assert code == 0, err
    assert report["current_key"] == new and report["dry_run"] is False
    for table, target in TARGET_OF.items():
        rows = sum(1 for t, _ in pin.plain if t == table)
        r = report["targets"][target]
        assert (r["reencrypted"], r["failed"], r["conflicts"], r["backlog_remaining"]) == (rows, 0, 0, 0), target
        assert r["batches"] >= -(-rows // 7)  # batch_size 7: one transaction per batch

    for table in CIPHERS:
        read = pin.read(table, {int(new): keys[int(new)]})  # only the new key: nothing is left on the old one
        assert {row_id: plain for row_id, (_, plain) in read.items()} == \
            {row_id: plain for (t, row_id), plain in pin.plain.items() if t == table}
        after = pin.rows(table)
        for row_id, row in before[table].items():
            assert after[row_id]["key_version"] == int(new)
            assert {c: after[row_id][c] for c in UNTOUCHED[table]} == {c: row[c] for c in UNTOUCHED[table]}, row_id
    assert {r["updated_at"] for r in pin.rows("persons").values()} == {SEEDED_AT}
    assert {r["updated_at"] for r in pin.rows("person_documents").values()} == {DOCUMENT_SEEDED_AT}

    code, doc, err = rotate("gate", "--retire", old, *cfg, "--json")
    assert code == 0, err
    assert doc["open"] is True and not any(doc["blocking"].values())


def test_workers_share_a_targets_drain_on_mariadb_by_text_id_ranges_and_reach_the_same_end(
        pin: PinInstall, caplog: pytest.LogCaptureFixture) -> None:
    """max_degree_of_parallelism workers drain one target by id ranges (the one drain of drain/), the
    Pin profile's ids being UUID texts: the ranges are cut in the server's order of them, so no row
    is drained twice or missed, and every value reads back under the new key alone."""
    new = pin.promote_new_key()
    _, keys = pin.load_keys()
    settings = load_settings(pin.config(max_degree_of_parallelism=3))
    with caplog.at_level(logging.INFO, logger="pinrotate"):
        report = rotation.run_rotation(settings)
    assert report.exit_code == 0
    for table, target in TARGET_OF.items():
        rows = sum(1 for t, _ in pin.plain if t == table)
        r = report.targets[target]
        assert (r.reencrypted, r.failed, r.conflicts, r.backlog_remaining) == (rows, [], 0, 0), target
    workers = set(re.findall(r"event=batch_processed .*target=Person .*worker=(\d+)", caplog.text))
    assert len(workers) > 1, caplog.text[-2000:]  # more than one worker drained Person
    for table in CIPHERS:
        read = pin.read(table, {new: keys[new]})  # only the new key: nothing is left on the old one
        assert {row_id: plain for row_id, (_, plain) in read.items()} == \
            {row_id: plain for (t, row_id), plain in pin.plain.items() if t == table}


LOCK_NAME = "Pin:lock:job:scheduled:profile-reencrypt"  # contract §7


def test_a_run_on_mariadb_that_finds_the_single_instance_lock_held_exits_0_and_touches_nothing(
        pin: PinInstall, mariadb: MariaDbServer, prefect_api: str) -> None:
    cfg = ("--config", str(pin.config(single_instance=True)))
    code, added, err = rotate("keys", "add", *cfg, "--json")
    assert code == 0, err
    new = added["added"]
    assert rotate("keys", "promote", new, *cfg)[0] == 0
    before = {table: pin.rows(table) for table in CIPHERS}
    holder = mariadb.connect()  # another run's session: GET_LOCK is server-wide
    try:
        with holder.cursor() as cur:
            cur.execute("SELECT GET_LOCK(%s, 0)", (LOCK_NAME,))
            assert cur.fetchone() == (1,)
        code, report, err = rotate("run", "--expected-key-version", new, *cfg, "--json", prefect_api=prefect_api)
        assert code == 0, err
        assert LOCK_NAME in report["skipped"] and report["targets"] == {}
        assert {table: pin.rows(table) for table in CIPHERS} == before
    finally:
        holder.close()  # the session's end releases its lock
    code, report, err = rotate("run", "--expected-key-version", new, *cfg, "--json", prefect_api=prefect_api)
    assert code == 0, err
    assert report["targets"]["Person"]["reencrypted"] == sum(1 for t, _ in pin.plain if t == "persons")
