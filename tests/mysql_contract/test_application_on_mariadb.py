"""A run beside a live application on MariaDB (contract §5 "Selection", "Safe with concurrent
application writes", "A lock race with the application"): rows the application holds locked are
skipped, never waited on past ``lock_timeout``, and moved by the next run; edits the application
makes while a run drains are never overwritten. The application is a PyMySQL session of its own.
"""

from __future__ import annotations

import random
import secrets
import threading
import time
from pathlib import Path

import pytest

from tests.mariadb_server import MariaDbServer

from .pin_data import PERSON_CIPHERS, SEEDED_AT, PinInstall, install_pin
from .support import LockWaitWatch, application, finish, rotate, start_rotate

pytestmark = pytest.mark.mysql

LOCK_TIMEOUT = 1  # seconds ([job] lock_timeout; MySQL's innodb_lock_wait_timeout counts whole seconds)
# The watch reads INNODB_TRX (refreshed every 0.1 s) and trx_wait_started (whole seconds).
WATCH_SLACK = 1.5


def edit(plain_id: str) -> dict[str, bytes | None]:
    return {"first_name_cipher": f"правка {plain_id} {secrets.token_hex(3)}".encode(),
            "last_name_cipher": b"edited by the application", "middle_name_cipher": None,
            "birth_date_cipher": b"2001-02-03"}


UPDATE_PERSON = ("UPDATE persons SET first_name_cipher = %s, last_name_cipher = %s, middle_name_cipher = %s,"
                 " birth_date_cipher = %s, key_version = %s, version = version + 1 WHERE id = %s")


def write_person(cur: object, pin: PinInstall, row_id: str, key_id: int, plain: dict[str, bytes | None]) -> None:
    c = pin.encrypt_person(key_id, plain)
    cur.execute(UPDATE_PERSON, (*(c[k] for k in PERSON_CIPHERS), key_id, row_id))  # type: ignore[attr-defined]


def test_rows_the_application_holds_are_skipped_without_waiting_past_lock_timeout_and_moved_by_the_next_run(
        mariadb: MariaDbServer, mysql_database: str, tmp_path: Path, prefect_api: str) -> None:
    pin = install_pin(mariadb, mysql_database, tmp_path, persons=30, documents=0)
    new = pin.promote_new_key()
    cfg = ("--config", str(pin.config(tables=("persons",), batch_size=5, lock_timeout=LOCK_TIMEOUT)))
    ids = sorted(pin.rows("persons"))
    held = [ids[2], ids[13], ids[27]]  # in three different batches of the keyset order
    versions = {row_id: row["version"] for row_id, row in pin.rows("persons").items()}
    edits = {row_id: edit(row_id) for row_id in held}

    with application(mariadb, mysql_database) as app, app.cursor() as cur:
        cur.execute("BEGIN")
        cur.execute("SELECT id FROM persons WHERE id IN (%s, %s, %s) FOR UPDATE", held)
        for row_id in held:  # the application's own edit, under the old key, not committed yet
            write_person(cur, pin, row_id, pin.old, edits[row_id])
        with LockWaitWatch(mariadb, app.thread_id()) as watch:  # type: ignore[no-untyped-call]
            code, report, err = rotate("run", *cfg, "--json", prefect_api=prefect_api)
        # The run ended while the application still held its rows: it never waited them out.
        assert code == 0, err
        person = report["targets"]["Person"]
        assert (person["reencrypted"], person["failed"], person["backlog_remaining"]) == (27, 0, 3)
        assert watch.samples > 0
        assert watch.longest <= LOCK_TIMEOUT + WATCH_SLACK, f"a session waited {watch.longest:.1f}s on the app's rows"
        cur.execute("COMMIT")  # the application's transaction was intact all along

    read = pin.read("persons", pin.keys)
    for row_id in ids:
        if row_id in held:  # left on the old key, with the application's edit
            assert read[row_id] == (pin.old, edits[row_id])
        else:
            assert read[row_id] == (new, pin.plain[("persons", row_id)])

    code, again, err = rotate("run", *cfg, "--json", prefect_api=prefect_api)
    assert code == 0, err
    assert (again["targets"]["Person"]["reencrypted"], again["targets"]["Person"]["backlog_remaining"]) == (3, 0)
    read = pin.read("persons", {new: pin.keys[new]})
    assert {row_id: plain for row_id, (_, plain) in read.items() if row_id in held} == edits
    rows = pin.rows("persons")
    assert {row_id: rows[row_id]["version"] for row_id in ids} == \
        {row_id: versions[row_id] + (row_id in held) for row_id in ids}
    assert {rows[row_id]["updated_at"] for row_id in ids if row_id not in held} == {SEEDED_AT}


def test_application_edits_made_while_a_run_drains_are_never_overwritten(
        mariadb: MariaDbServer, mysql_database: str, tmp_path: Path, prefect_api: str) -> None:
    pin = install_pin(mariadb, mysql_database, tmp_path, persons=60, documents=0)
    new = pin.promote_new_key()
    # 12 batches with a pause between them: the application edits while most of them are ahead.
    cfg = ("--config", str(pin.config(tables=("persons",), batch_size=5, inter_batch_delay=0.2)))
    ids = sorted(pin.rows("persons"))
    versions = {row_id: row["version"] for row_id, row in pin.rows("persons").items()}
    last: dict[str, dict[str, bytes | None]] = {}  # row -> plaintext of the application's last edit
    writes: dict[str, int] = dict.fromkeys(ids, 0)
    stop = threading.Event()
    rng = random.Random(secrets.randbits(32))

    def application_writer() -> None:
        # Most edits write under the current key, as an up-to-date application does; every third
        # under the old key, as an instance not restarted yet does (those stay in the backlog).
        with application(mariadb, mysql_database) as app, app.cursor() as cur:
            n = 0
            while not stop.is_set():
                row_id = rng.choice(ids)
                plain = edit(row_id)
                write_person(cur, pin, row_id, pin.old if n % 3 == 2 else new, plain)
                last[row_id], writes[row_id], n = plain, writes[row_id] + 1, n + 1
                time.sleep(0.02)

    proc = start_rotate("run", *cfg, "--json", prefect_api=prefect_api)
    writer = threading.Thread(target=application_writer, name="application", daemon=True)
    try:
        deadline = time.monotonic() + 240
        while (moved := pin.key_versions("persons").get(new, 0)) == 0:  # until the first batch is committed
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended before its first batch"
            time.sleep(0.05)
        writer.start()
        code, report, err = finish(proc)
    finally:
        stop.set()
        if writer.is_alive():
            writer.join(timeout=30)
        if proc.poll() is None:
            proc.kill()
    assert code == 0, err
    assert moved < len(ids), "the run had drained everything before the application began: nothing was tested"
    person = report["targets"]["Person"]
    assert person["failed"] == 0 and person["reencrypted"] > 0
    assert sum(writes.values()) > 0

    # Every row reads back under the key its key_version names, with the application's last edit
    # where it made one; a second run moves what the application left on the old key.
    expected = {row_id: last.get(row_id, pin.plain[("persons", row_id)]) for row_id in ids}
    read = pin.read("persons", pin.keys)
    assert {row_id: plain for row_id, (_, plain) in read.items()} == expected
    code, again, err = rotate("run", *cfg, "--json", prefect_api=prefect_api)
    assert code == 0, err
    assert (again["targets"]["Person"]["failed"], again["targets"]["Person"]["backlog_remaining"]) == (0, 0)
    read = pin.read("persons", {new: pin.keys[new]})
    assert {row_id: plain for row_id, (_, plain) in read.items()} == expected
    rows = pin.rows("persons")
    assert {row_id: rows[row_id]["version"] for row_id in ids} == {i: versions[i] + writes[i] for i in ids}
