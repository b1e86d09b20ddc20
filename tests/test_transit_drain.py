"""The vault-transit drain and inventory against real PostgreSQL and a real OpenBao (no mocks).

Runs go through ``pinrotate_core.rotation`` as a caller would: ``run_rotation`` where nothing has
to happen mid-run, the step functions (open_run, read_current_key, resolve_all, drain) where a
test must act between batches (stop the server, revoke the token, rotate the key). Plaintexts are
only ever seen by the test, through Transit; no secret may appear in any captured output.
"""

from __future__ import annotations

import base64
import logging
import secrets
import traceback
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import psycopg
import pytest

from pinrotate_core import rotation
from pinrotate_core.config import Settings, VaultSettings, settings_from_mapping
from pinrotate_core.drain import BatchEvent, DrainResult
from pinrotate_core.errors import ConfigError
from pinrotate_core.gate import evaluate_gate
from pinrotate_core.keyring import Keyring
from pinrotate_core.log import LOGGER_NAME
from pinrotate_core.providers.file import FileKeyProvider
from pinrotate_core.providers.vault import VaultTransitKeyProvider
from pinrotate_core.schemes.aesgcm import AesGcmCipherSet
from pinrotate_core.schemes.transit import transit_version, transit_version_or_none

from .helpers import make_keyring
from .transit_helpers import transit_decrypt, transit_encrypt
from .vault_server import BaoAdmin

pytestmark = pytest.mark.vault
bao = BaoAdmin.of

PEOPLE = "People"
NOTES = "Notes"


# -- set-up helpers ---------------------------------------------------------------------------------


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def new_transit(server: Any, *, backup: bool = False) -> tuple[str, str]:
    mount, key = unique("transit"), "pii"
    bao(server).enable_secrets(mount, "transit")
    body: dict[str, object] = {"type": "aes256-gcm96"}
    if backup:  # lets a test carry the key over a restart of the in-memory dev server
        body.update(exportable=True, allow_plaintext_backup=True)
    bao(server).api("POST", f"{mount}/keys/{key}", body)
    return mount, key


def transit(server: Any, mount: str, key: str, token: str | None = None) -> VaultTransitKeyProvider:
    return VaultTransitKeyProvider(VaultSettings(addr=server.addr, token=token or server.token,
                                                 transit_mount=mount, key=key))


def settings_for(database_url: str, server: Any, mount: str, key: str, *, token: str | None = None,
                 batch_size: int = 500, targets: Iterable[str] = (PEOPLE,), workers: int = 1) -> Settings:
    target_defs = {
        PEOPLE: {"name": PEOPLE, "table": "people", "id": "id", "key_version": "key_version",
                 "columns": ["name_cipher", "doc_cipher"], "format": "vault-transit"},
        NOTES: {"name": NOTES, "table": "app.notes", "id": "note_id", "columns": ["body_cipher", "tag_cipher"],
                "format": "vault-transit", "require_not_null": ["body_cipher"]},
    }
    return settings_from_mapping({
        "database": {"url": database_url},
        "keys": {"provider": "vault-transit",
                 "vault": {"addr": server.addr, "token": token or server.token, "transit_mount": mount, "key": key}},
        "job": {"batch_size": batch_size, "inter_batch_delay": 0, "max_degree_of_parallelism": workers},
        "targets": [target_defs[name] for name in targets],
    }, env={})


def create_people(conn: psycopg.Connection[Any]) -> None:
    conn.execute("""
        CREATE TABLE people (
            id bigint PRIMARY KEY,
            key_version integer,
            name_cipher text,
            doc_cipher bytea,
            version integer NOT NULL DEFAULT 7,
            updated_at timestamptz NOT NULL DEFAULT '2020-01-02 03:04:05+00'
        )""")


def seed_people(conn: psycopg.Connection[Any], provider: VaultTransitKeyProvider, rows: int,
                *, phases: int = 2) -> dict[int, tuple[bytes, bytes | None]]:
    """``rows`` people spread over key versions 1..phases (rotating in between), then one more rotation:
    every row is behind the current version. Every 7th row has a NULL document. Returns the plaintexts."""
    create_people(conn)
    plain: dict[int, tuple[bytes, bytes | None]] = {
        i: (f"name-{i}-".encode() + secrets.token_bytes(i % 23), None if i % 7 == 0 else secrets.token_bytes(1 + i % 40))
        for i in range(1, rows + 1)
    }
    ids = list(plain)
    for phase in range(phases):
        chunk = ids[phase::phases]
        names = transit_encrypt(provider, [plain[i][0] for i in chunk])
        docs_in = [i for i in chunk if plain[i][1] is not None]
        docs = dict(zip(docs_in, transit_encrypt(provider, [plain[i][1] or b"" for i in docs_in])))
        version = transit_version(names[0])
        with conn.cursor() as cur:
            cur.executemany(
                "INSERT INTO people (id, key_version, name_cipher, doc_cipher) VALUES (%s, %s, %s, %s)",
                [(i, version, n, docs[i].encode() if i in docs else None) for i, n in zip(chunk, names)],
            )
        provider.rotate()
    return plain


def people_rows(conn: psycopg.Connection[Any]) -> list[tuple[Any, ...]]:
    return conn.execute(
        "SELECT id, key_version, name_cipher, convert_from(doc_cipher, 'UTF8'), version, updated_at "
        "FROM people ORDER BY id").fetchall()


def assert_no_row_half_written(rows: list[tuple[Any, ...]]) -> None:
    for row_id, kv, name, doc, *_ in rows:
        versions = {transit_version(v) for v in (name, doc) if v is not None}
        assert versions == {kv}, f"row {row_id}: values and key version disagree"


def assert_people_decrypt(provider: VaultTransitKeyProvider, rows: list[tuple[Any, ...]],
                          plain: dict[int, tuple[bytes, bytes | None]]) -> None:
    names = transit_decrypt(provider, [r[2] for r in rows])
    assert names == [plain[r[0]][0] for r in rows]
    with_doc = [r for r in rows if r[3] is not None]
    assert transit_decrypt(provider, [r[3] for r in with_doc]) == [plain[r[0]][1] for r in with_doc]
    assert all((r[0] % 7 == 0) == (r[3] is None) for r in rows)  # NULL stays NULL


def run_steps(settings: Settings, on_batch: Callable[[BatchEvent], None] | None = None,
              dry_run: bool = False) -> rotation.RunReport:
    """A run through the step functions, so that a test can act between batches."""
    ctx = rotation.open_run(settings, dry_run=dry_run)
    try:
        keyring = rotation.read_current_key(ctx)
        rotation.resolve_all(ctx)
        report = rotation.RunReport(ctx.run_id, keyring.current, dry_run)
        for t in ctx.targets:
            report.targets[t.name] = rotation.drain(ctx, t.name, on_batch=on_batch)
        report.verified = rotation.verify(ctx, report.targets)
        return report
    finally:
        ctx.close()


def outputs(caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str], *extra: object) -> str:
    out = capsys.readouterr()
    texts = [caplog.text, out.out, out.err]
    for item in extra:
        if isinstance(item, BaseException):
            texts += [str(item), repr(item), *traceback.format_exception(item)]
        elif isinstance(item, rotation.RunReport):
            texts.append(repr(item.as_dict()))
        else:
            texts.append(repr(item))
    return "\n".join(texts)


def assert_secret_free(text: str, secret_values: Iterable[str | bytes]) -> None:
    assert "event=batch_processed" in text or "event=batch_failed" in text, "the drain's log lines were not captured"
    for value in secret_values:
        forms = [value] if isinstance(value, str) else [base64.b64encode(value).decode(), value.decode("latin-1"),
                                                        value.hex()]
        for shown in forms:
            assert len(shown) >= 8, "too short to look for"
            assert shown not in text, "a secret value appears in captured output"


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    caplog.set_level(logging.DEBUG)  # also urllib3's and hvac's request lines
    # The CLI's stderr set-up stops "pinrotate" from propagating: listen on it directly as well.
    ours = logging.getLogger(LOGGER_NAME)
    ours.addHandler(caplog.handler)
    try:
        yield caplog
    finally:
        ours.removeHandler(caplog.handler)


# -- the drain --------------------------------------------------------------------------------------


def test_transit_drain_moves_every_value_to_the_latest_version_and_plaintexts_are_unchanged(
        database_url: str, pg_conn: psycopg.Connection[Any], openbao: Any, logs: pytest.LogCaptureFixture,
        capsys: pytest.CaptureFixture[str]) -> None:
    mount, key = new_transit(openbao)
    provider = transit(openbao, mount, key)
    plain = seed_people(pg_conn, provider, 3000)
    before = people_rows(pg_conn)
    assert {r[1] for r in before} == {1, 2} and provider.current_version() == 3

    report = rotation.run_rotation(settings_for(database_url, openbao, mount, key, batch_size=700))

    assert report.exit_code == rotation.EXIT_OK and report.current_key == "3"
    result = report.targets[PEOPLE]
    assert (result.reencrypted, result.backlog_remaining, len(result.failed), result.stopped) == (3000, 0, 0, None)
    assert result.batches == 5  # 700 a batch: one rewrap call and one UPDATE each
    after = people_rows(pg_conn)
    assert {r[1] for r in after} == {3}
    assert_no_row_half_written(after)
    assert_people_decrypt(provider, after, plain)
    # Only the cipher and key-version columns changed.
    assert [(r[0], r[4], r[5]) for r in after] == [(r[0], r[4], r[5]) for r in before]

    again = rotation.run_rotation(settings_for(database_url, openbao, mount, key))
    assert again.exit_code == 0 and again.targets[PEOPLE].reencrypted == 0

    text = outputs(logs, capsys, report, again)
    assert_secret_free(text, [openbao.token, *(v for r in before[:50] for v in r[2:4] if v),
                              *(v for r in after[:50] for v in r[2:4] if v), *(p[0] for p in list(plain.values())[:50])])


def test_target_without_key_version_column_is_selected_by_the_value_prefix(
        database_url: str, pg_conn: psycopg.Connection[Any], openbao: Any) -> None:
    mount, key = new_transit(openbao)
    provider = transit(openbao, mount, key)
    pg_conn.execute("CREATE SCHEMA app")
    pg_conn.execute("CREATE TABLE app.notes (note_id text PRIMARY KEY, body_cipher varchar(300), tag_cipher text, "
                    "touched integer NOT NULL DEFAULT 0)")
    bodies_v1 = transit_encrypt(provider, [f"body {i}".encode() for i in range(6)])
    provider.rotate()
    tags_v2 = transit_encrypt(provider, [f"tag {i}".encode() for i in range(6)])
    provider.rotate()
    provider.rotate()  # current is 4
    fresh = transit_encrypt(provider, [b"on v4 body", b"on v4 tag"])
    rows = [
        ("n-a", bodies_v1[0], tags_v2[0]),   # both behind
        ("n-b", fresh[0], tags_v2[1]),       # one column behind: selected, only that value rewrapped
        ("n-c", fresh[1], None),             # all current: never selected, never written
        ("n-d", None, tags_v2[2]),           # require_not_null body is NULL: out of scope, never touched
        ("n-e", bodies_v1[1], tags_v2[4]),
        ("n-f", "not a transit value", tags_v2[3]),  # unparseable: the row FAILS, the others go on
    ]
    pg_conn.cursor().executemany("INSERT INTO app.notes (note_id, body_cipher, tag_cipher) VALUES (%s, %s, %s)", rows)
    pg_conn.execute("""CREATE FUNCTION app.count_touch() RETURNS trigger LANGUAGE plpgsql AS $$
                       BEGIN NEW.touched := OLD.touched + 1; RETURN NEW; END $$""")
    pg_conn.execute("CREATE TRIGGER touch BEFORE UPDATE ON app.notes FOR EACH ROW EXECUTE FUNCTION app.count_touch()")

    settings = settings_for(database_url, openbao, mount, key, targets=[NOTES], batch_size=2)
    # The trigger counts the writes: its side effect is accepted explicitly (else the target is BLOCKED).
    settings = settings.model_copy(update={"targets": (settings.targets[0].model_copy(update={"triggers": "fire"}),)})
    dry = rotation.run_rotation(settings, dry_run=True)
    assert dry.targets[NOTES].reencrypted == 3 and [f.id for f in dry.targets[NOTES].failed] == ["n-f"]
    assert pg_conn.execute("SELECT sum(touched) FROM app.notes").fetchone() == (0,)  # a dry run writes nothing

    report = rotation.run_rotation(settings)
    result = report.targets[NOTES]
    assert result.reencrypted == 3 and result.backlog_remaining == 1  # n-f stays behind, reported
    assert [(f.id, f.columns, f.reason) for f in result.failed] == [("n-f", ("body_cipher",), "decrypt_failed")]
    assert report.exit_code == rotation.EXIT_FAIL_CLOSED  # a FAILED row keeps the run fail-closed
    got = {r[0]: r[1:] for r in pg_conn.execute("SELECT note_id, body_cipher, tag_cipher, touched FROM app.notes")}
    for note_id in ("n-a", "n-b", "n-e"):
        assert {transit_version(v) for v in got[note_id][:2]} == {4} and got[note_id][2] == 1
    assert got["n-b"][0] == fresh[0]  # a value already current is kept as it is
    for untouched in ("n-c", "n-d", "n-f"):
        assert got[untouched] == (*next(r[1:] for r in rows if r[0] == untouched), 0)
    assert transit_decrypt(provider, [got["n-a"][0], got["n-a"][1], got["n-e"][0], got["n-e"][1]]) == [
        b"body 0", b"tag 0", b"body 1", b"tag 4"]


def test_values_transit_refuses_fail_their_rows_and_the_rest_of_the_batch_is_written(
        database_url: str, pg_conn: psycopg.Connection[Any], openbao: Any, logs: pytest.LogCaptureFixture,
        capsys: pytest.CaptureFixture[str]) -> None:
    mount, key = new_transit(openbao)
    provider = transit(openbao, mount, key)
    plain = seed_people(pg_conn, provider, 40, phases=1)
    tampered = "vault:v1:" + base64.b64encode(secrets.token_bytes(40)).decode()
    pg_conn.execute("UPDATE people SET name_cipher = %s WHERE id = 5", (tampered,))
    pg_conn.execute("UPDATE people SET doc_cipher = convert_to('vault:v1:AAAA', 'UTF8') WHERE id = 23")

    report = rotation.run_rotation(settings_for(database_url, openbao, mount, key, batch_size=16))

    result = report.targets[PEOPLE]
    # Numeric ids in numeric order (5 before 23), not as text.
    assert [(f.id, f.columns) for f in result.failed] == [("5", ("name_cipher",)), ("23", ("doc_cipher",))]
    assert result.reencrypted == 38 and result.backlog_remaining == 2 and result.stopped is None
    assert report.exit_code == rotation.EXIT_FAIL_CLOSED
    rows = {r[0]: r for r in people_rows(pg_conn)}
    assert rows[5][1:3] == (1, tampered) and rows[23][1] == 1  # left unchanged
    good = [r for i, r in rows.items() if i not in (5, 23)]
    assert {r[1] for r in good} == {2}
    assert_no_row_half_written(good)
    assert_people_decrypt(provider, good, plain)
    assert_secret_free(outputs(logs, capsys, report), [tampered, openbao.token])


def test_server_stopped_mid_run_rolls_the_batch_back_and_a_later_run_completes(
        database_url: str, pg_conn: psycopg.Connection[Any], openbao_factory: Callable[[], Any],
        logs: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]) -> None:
    server = openbao_factory()
    mount, key = new_transit(server, backup=True)
    provider = transit(server, mount, key)
    plain = seed_people(pg_conn, provider, 2000)
    backup = bao(server).api("GET", f"{mount}/backup/{key}")["data"]["backup"]
    settings = settings_for(database_url, server, mount, key, batch_size=300)

    def stop_after_second_batch(event: BatchEvent) -> None:
        if event.batch == 2:
            server.stop()

    report = run_steps(settings, on_batch=stop_after_second_batch)

    result = report.targets[PEOPLE]
    assert result.stopped == "key_unavailable" and result.retryable is True
    # The drain is pipelined: the batch after the second may already have been rewrapped when the
    # server stopped, and then commits whole; the first batch that needed the server rolls back.
    moved = result.reencrypted
    assert moved in (600, 900) and result.batches == moved // 300 and result.backlog_remaining == 2000 - moved
    assert "cannot connect" in (result.error or "") and server.addr in (result.error or "")
    assert report.exit_code == rotation.EXIT_FAIL_CLOSED
    rows = people_rows(pg_conn)
    assert_no_row_half_written(rows)  # the batch in flight rolled back whole
    assert sorted(r[0] for r in rows if r[1] == 3) == list(range(1, moved + 1))

    # The server comes back (in-memory dev server: same port and token, the key restored).
    server.start()
    bao(server).enable_secrets(mount, "transit")
    bao(server).api("POST", f"{mount}/restore/{key}", {"backup": backup})
    later = rotation.run_rotation(settings)
    assert later.exit_code == rotation.EXIT_OK
    assert later.targets[PEOPLE].reencrypted == 2000 - moved and later.targets[PEOPLE].backlog_remaining == 0
    rows = people_rows(pg_conn)
    assert {r[1] for r in rows} == {3}
    assert_no_row_half_written(rows)
    assert_people_decrypt(provider, rows, plain)
    assert_secret_free(outputs(logs, capsys, report, later, result),
                       [server.token, backup, *(p[0] for p in list(plain.values())[:100]),
                        *(v for r in rows[:100] for v in r[2:4] if v)])


def test_revoked_token_mid_run_stops_the_target_and_is_not_retryable(
        database_url: str, pg_conn: psycopg.Connection[Any], openbao: Any, logs: pytest.LogCaptureFixture,
        capsys: pytest.CaptureFixture[str]) -> None:
    mount, key = new_transit(openbao)
    provider = transit(openbao, mount, key)
    seed_people(pg_conn, provider, 300)
    policy = unique("drain")
    bao(openbao).put_policy(policy, f'path "{mount}/*" {{ capabilities = ["read", "update"] }}')
    token = bao(openbao).create_token([policy])

    def revoke_after_first_batch(event: BatchEvent) -> None:
        if event.batch == 1:
            bao(openbao).revoke_token(token)

    report = run_steps(settings_for(database_url, openbao, mount, key, token=token, batch_size=100),
                       on_batch=revoke_after_first_batch)

    result = report.targets[PEOPLE]
    assert result.stopped == "key_unavailable" and result.retryable is False
    assert "HTTP 403" in (result.error or "")
    # Pipelined drain: the second batch may have been rewrapped before the revocation; it then commits.
    assert result.reencrypted in (100, 200) and result.backlog_remaining == 300 - result.reencrypted
    assert report.exit_code == rotation.EXIT_FAIL_CLOSED
    assert_no_row_half_written(people_rows(pg_conn))
    assert_secret_free(outputs(logs, capsys, report, result), [token, openbao.token])


def test_key_rotated_during_the_run_writes_nothing_under_a_version_the_run_did_not_start_with(
        database_url: str, pg_conn: psycopg.Connection[Any], openbao: Any) -> None:
    mount, key = new_transit(openbao)
    provider = transit(openbao, mount, key)
    seed_people(pg_conn, provider, 200)

    def rotate_after_first_batch(event: BatchEvent) -> None:
        if event.batch == 1:
            provider.rotate()  # latest is 4 now; the run works towards 3

    report = run_steps(settings_for(database_url, openbao, mount, key, batch_size=50), on_batch=rotate_after_first_batch)

    result = report.targets[PEOPLE]
    # Pipelined drain: the second batch may have been rewrapped (under 3) before the rotation.
    moved = result.reencrypted
    assert result.stopped == "key_unavailable" and moved in (50, 100)
    assert "rotated during the run" in (result.error or "")
    rows = people_rows(pg_conn)
    assert {r[1] for r in rows} == {1, 2, 3} and [r[1] for r in rows].count(3) == moved
    assert 4 not in {r[1] for r in rows}  # nothing under a version the run did not start with
    assert_no_row_half_written(rows)
    # The next run works towards version 4, and moves the rows already on 3 too.
    later = rotation.run_rotation(settings_for(database_url, openbao, mount, key))
    assert later.exit_code == 0 and later.current_key == "4" and later.targets[PEOPLE].reencrypted == 200


def test_values_below_min_decryption_version_stop_the_target_as_key_unavailable(
        database_url: str, pg_conn: psycopg.Connection[Any], openbao: Any) -> None:
    mount, key = new_transit(openbao)
    provider = transit(openbao, mount, key)
    seed_people(pg_conn, provider, 60)
    bao(openbao).api("POST", f"{mount}/keys/{key}/config", {"min_decryption_version": 2})

    report = rotation.run_rotation(settings_for(database_url, openbao, mount, key, batch_size=1000))

    result = report.targets[PEOPLE]
    assert result.stopped == "key_unavailable" and result.retryable is False and result.reencrypted == 0
    assert "below the key's min_decryption_version" in (result.error or "")
    assert report.exit_code == rotation.EXIT_FAIL_CLOSED
    assert {r[1] for r in people_rows(pg_conn)} == {1, 2}  # the batch rolled back


def test_parallel_workers_drain_disjoint_ranges_to_the_latest_version(
        database_url: str, pg_conn: psycopg.Connection[Any], openbao: Any) -> None:
    mount, key = new_transit(openbao)
    provider = transit(openbao, mount, key)
    plain = seed_people(pg_conn, provider, 1200)

    report = rotation.run_rotation(settings_for(database_url, openbao, mount, key, batch_size=100, workers=3))

    assert report.exit_code == 0 and report.targets[PEOPLE].reencrypted == 1200
    rows = people_rows(pg_conn)
    assert {r[1] for r in rows} == {3}
    assert_people_decrypt(provider, rows, plain)


# -- inventory and gate ---------------------------------------------------------------------------------


def test_inventory_reads_versions_from_the_prefix_and_reports_min_decryption_version(
        database_url: str, pg_conn: psycopg.Connection[Any], openbao: Any) -> None:
    mount, key = new_transit(openbao)
    provider = transit(openbao, mount, key)
    pg_conn.execute("CREATE SCHEMA app")
    pg_conn.execute("CREATE TABLE app.notes (note_id text PRIMARY KEY, body_cipher text, tag_cipher text)")
    v1 = transit_encrypt(provider, [b"a", b"b", b"c"])
    provider.rotate()
    v2 = transit_encrypt(provider, [b"d", b"e"])
    provider.rotate()
    v3 = transit_encrypt(provider, [b"f", b"g"])
    bao(openbao).api("POST", f"{mount}/keys/{key}/config", {"min_decryption_version": 2})
    pg_conn.cursor().executemany("INSERT INTO app.notes VALUES (%s, %s, %s)", [
        ("a", v1[0], v2[0]),           # UNKNOWN_KEY (v1 < min 2) + HISTORICAL
        ("b", v3[0], v3[1]),           # ACTIVE x2
        ("c", v2[1], "garbage"),       # HISTORICAL + UNKNOWN
        ("d", None, v1[1]),            # out of scope (body NULL): EXCLUDED, still on v1
        ("e", v1[2], None),            # UNKNOWN_KEY; NULL is not a value
    ])
    settings = settings_for(database_url, openbao, mount, key, targets=[NOTES])

    inv = rotation.inventory(settings)
    notes = inv.targets[NOTES]
    counts = notes.as_dict()
    assert inv.current_key == "3"
    assert {c: counts[c] for c in ("total", "ACTIVE", "HISTORICAL", "UNKNOWN", "UNKNOWN_KEY", "EXCLUDED", "FAILED")} == {
        "total": 8, "ACTIVE": 2, "HISTORICAL": 2, "UNKNOWN": 1, "UNKNOWN_KEY": 2, "EXCLUDED": 1, "FAILED": 0}
    assert counts["by_key"] == {"1": 2, "2": 2, "3": 2} and notes.excluded_by_key == {"1": 1}
    assert counts["transit_min_decryption_version"] == 2 and counts["transit_latest_version"] == 3
    assert rotation.inventory(settings, deep=True).targets[NOTES].counts == notes.counts  # deep decrypts nothing

    gate = evaluate_gate(inv, "1")
    assert not gate.open and gate.blocking["UNKNOWN_KEY"] == 2 and gate.blocking["UNKNOWN"] == 1
    assert gate.targets[NOTES]["transit_min_decryption_version"] == 2 and gate.targets[NOTES]["excluded_on_key"] == 1


def test_gate_opens_for_old_versions_once_the_drain_is_done(
        database_url: str, pg_conn: psycopg.Connection[Any], openbao: Any) -> None:
    mount, key = new_transit(openbao)
    provider = transit(openbao, mount, key)
    seed_people(pg_conn, provider, 100)
    settings = settings_for(database_url, openbao, mount, key)
    before = rotation.inventory(settings).targets[PEOPLE]
    assert before.counts["HISTORICAL"] == before.total and before.by_key.keys() == {"1", "2"}
    assert not evaluate_gate(rotation.inventory(settings), "1").open

    pg_conn.execute("UPDATE people SET key_version = 3 WHERE id <= 10")  # a lying key-version column
    assert rotation.run_rotation(settings).exit_code == 0
    inv = rotation.inventory(settings)
    assert inv.targets[PEOPLE].extra["transit_rows_behind_key_version"] == 10  # the drain did not select them
    assert not evaluate_gate(inv, "1").open and not evaluate_gate(inv, "2").open

    pg_conn.execute("UPDATE people SET key_version = 1 WHERE id <= 10")
    final = rotation.run_rotation(settings)
    assert final.exit_code == 0
    # The run's own gate report covers every older Transit version, as `gate --retire` would.
    assert final.gate == {"1": {"open": True, "blocking": {}}, "2": {"open": True, "blocking": {}}}
    inv = rotation.inventory(settings)
    people = inv.targets[PEOPLE]
    assert people.counts["ACTIVE"] == people.total and people.extra["transit_rows_behind_key_version"] == 0
    assert evaluate_gate(inv, "1").open and evaluate_gate(inv, "2").open


def test_other_tenants_and_soft_deleted_rows_are_out_of_scope(
        database_url: str, pg_conn: psycopg.Connection[Any], openbao: Any) -> None:
    mount, key = new_transit(openbao)
    provider = transit(openbao, mount, key)
    pg_conn.execute("CREATE SCHEMA app")
    pg_conn.execute("CREATE TABLE app.notes (note_id text PRIMARY KEY, tenant text, deleted boolean, "
                    "body_cipher text, tag_cipher text)")
    old = transit_encrypt(provider, [f"body {i}".encode() for i in range(4)])
    provider.rotate()
    pg_conn.cursor().executemany("INSERT INTO app.notes VALUES (%s, %s, %s, %s, NULL)", [
        ("a", "t%s1", False, old[0]), ("b", "t%s1", True, old[1]), ("c", "t2", False, old[2]),
        ("d", "t%s1", None, old[3])])
    settings = settings_for(database_url, openbao, mount, key, targets=[NOTES])
    settings = settings.model_copy(update={"targets": (settings.targets[0].model_copy(
        update={"tenant": "tenant", "soft_delete": "deleted"}),)})

    inv = rotation.inventory(settings, tenant="t%s1").targets[NOTES]
    assert (inv.counts["HISTORICAL"], inv.counts["EXCLUDED"], inv.excluded_by_key) == (2, 2, {"1": 2})
    report = rotation.run_rotation(settings, tenant="t%s1")  # '%' is data, never a placeholder

    assert report.exit_code == 0 and report.targets[NOTES].reencrypted == 2
    versions = dict(pg_conn.execute("SELECT note_id, substring(body_cipher from 'vault:v([0-9]+):') FROM app.notes"))
    assert versions == {"a": "2", "b": "1", "c": "1", "d": "2"}  # b deleted, c another tenant: untouched


def test_vault_transit_target_with_another_provider_is_blocked_and_refused(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Any) -> None:
    create_people(pg_conn)
    pg_conn.execute("INSERT INTO people (id, key_version, name_cipher) VALUES (1, 1, 'vault:v1:QUJD')")
    FileKeyProvider(keys_file, create=True).load_keyring()  # a keyring of the wrong kind, but one that exists
    settings = settings_from_mapping({
        "database": {"url": database_url}, "keys": {"provider": "file", "file": str(keys_file)},
        "targets": [{"name": PEOPLE, "table": "people", "key_version": "key_version", "columns": ["name_cipher"],
                     "format": "vault-transit"}]}, env={})
    inv = rotation.inventory(settings)
    assert inv.targets[PEOPLE].counts["BLOCKED"] == 1
    with pytest.raises(ConfigError, match="format vault-transit needs keys.provider = vault-transit"):
        rotation.run_rotation(settings)


# -- vault-kv keyrings with the aesgcm drain ------------------------------------------------------------


def test_kv_keyring_missing_a_key_version_stops_the_aesgcm_drain_naming_path_and_version(
        database_url: str, pg_conn: psycopg.Connection[Any], openbao: Any, logs: pytest.LogCaptureFixture,
        capsys: pytest.CaptureFixture[str]) -> None:
    old = make_keyring("1", "2", current="1")
    on_two = Keyring(current="2", keys=old.keys, source="test keyring")
    pg_conn.execute("CREATE TABLE persons (id bigint PRIMARY KEY, key_version int NOT NULL, first_name_cipher bytea)")
    rows = [(i, 2 if i <= 50 else 1,
             AesGcmCipherSet(on_two if i <= 50 else old).encrypt_current(f"person {i}".encode())) for i in range(1, 121)]
    pg_conn.cursor().executemany("INSERT INTO persons VALUES (%s, %s, %s)", rows)
    mount, path = unique("kv"), "pinrotate/keys"
    bao(openbao).enable_secrets(mount, "kv", {"version": "2"})
    k2, k3 = (base64.b64encode(old.keys["2"].material).decode(), base64.b64encode(secrets.token_bytes(32)).decode())
    bao(openbao).kv_put(mount, path, {"current": "3", "2": k2, "3": k3})  # version 1 is missing
    settings = settings_from_mapping({
        "database": {"url": database_url},
        "keys": {"provider": "vault-kv", "vault": {"addr": openbao.addr, "token": openbao.token, "mount": mount,
                                                    "path": path}},
        "job": {"batch_size": 40, "inter_batch_delay": 0},
        "targets": [{"name": "Person", "table": "persons", "key_version": "key_version",
                     "columns": ["first_name_cipher"]}]}, env={})

    report = rotation.run_rotation(settings)

    result: DrainResult = report.targets["Person"]
    assert result.stopped == "key_unavailable" and result.retryable is False
    assert "key 1 is not in the keyring" in (result.error or "") and f"{mount}/{path}" in (result.error or "")
    assert result.reencrypted == 40  # the first batch (all on key 2) committed; the second rolled back
    assert report.exit_code == rotation.EXIT_FAIL_CLOSED
    versions = dict(pg_conn.execute("SELECT key_version, count(*) FROM persons GROUP BY 1").fetchall())
    assert versions == {3: 40, 2: 10, 1: 70}
    assert_secret_free(outputs(logs, capsys, report, result),
                       [openbao.token, k2, k3, base64.b64encode(old.keys["1"].material).decode()])


def test_transit_version_helpers_agree_with_the_sql_pattern(pg_conn: psycopg.Connection[Any]) -> None:
    from pinrotate_core.schemes.transit import TRANSIT_VALUE_PATTERN

    samples = ["vault:v1:QUJD", "vault:v12:QUJDRA==", "vault:v3:QUI=", "vault:v0:QUJD", "vault:v01:QUJD",
               "vault:v1:QUJ", "vault:v1:", "vault:v1:QUJD\n", " vault:v1:QUJD", "VAULT:v1:QUJD",
               "vault:v1:QU=D", "vault:v99999999999:QUJD", "vault:v9999999999:QUJD", "plain"]
    got = pg_conn.execute("SELECT (substring(s from %s))::int8 FROM unnest(%s::text[]) WITH ORDINALITY AS u(s, n) "
                          "ORDER BY n", (TRANSIT_VALUE_PATTERN, samples)).fetchall()
    assert [g[0] for g in got] == [transit_version_or_none(s) for s in samples]
