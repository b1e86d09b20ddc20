"""Planning one aesgcm batch without a database: what ``plan_aesgcm_batch`` decides to write.

Rows go in as the database returns them, ``(id, key_version, *cipher_columns)``; out come the new
ciphertexts per column and the rows that failed. These tests read every planned value back.
"""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pinrotate_core.errors import CiphertextInvalid, KeyUnavailable
from pinrotate_core.keyring import Keyring
from pinrotate_core.schemes.aesgcm import AesGcmCipherSet, ColumnEncoding, plan_aesgcm_batch
from pinrotate_core.schemes.base import BatchPlan, FailedRow

from .helpers import assert_secret_free, make_keyring

BYTEA = ColumnEncoding.BYTEA
TEXT = ColumnEncoding.BASE64_TEXT
COLUMNS = ("first_name_cipher", "last_name_cipher", "middle_name_cipher")


def stored(ciphers: AesGcmCipherSet, key_id: str, plaintext: bytes | None, encoding: ColumnEncoding) -> Any:
    """What the database hands back for ``plaintext`` written under ``key_id`` in a column of ``encoding``."""
    if plaintext is None:
        return None
    return encoding.from_bytes(ciphers.cipher(key_id).encrypt(plaintext))


def make_rows(ciphers: AesGcmCipherSet, key_id: str, plaintexts: Sequence[Sequence[bytes | None]],
              encodings: Sequence[ColumnEncoding]) -> list[tuple[Any, ...]]:
    return [(uuid.uuid4(), int(key_id), *(stored(ciphers, key_id, p, e) for p, e in zip(row, encodings)))
            for row in plaintexts]


def read_back(plan: BatchPlan, ciphers: AesGcmCipherSet,
              encodings: Sequence[ColumnEncoding]) -> dict[Any, list[bytes | None]]:
    """Every planned value decrypted under the current key, per row id."""
    out: dict[Any, list[bytes | None]] = {}
    for i, row_id in enumerate(plan.ids):
        values: list[bytes | None] = []
        for j, enc in enumerate(encodings):
            value = plan.writes[0].new[j][i]
            values.append(None if value is None else ciphers.decrypt(ciphers.keyring.current, enc.to_bytes(value)))
        out[row_id] = values
    return out


@pytest.fixture
def keyring() -> Keyring:
    return make_keyring("1", "2", current="2")


@pytest.fixture
def ciphers(keyring: Keyring) -> AesGcmCipherSet:
    return AesGcmCipherSet(keyring)


def test_every_planned_ciphertext_decrypts_under_the_current_key_to_the_original_plaintext(
        ciphers: AesGcmCipherSet) -> None:
    plaintexts = [[f"First-{n}".encode(), f"Last-{n}".encode(), f"Middle-{n}".encode()] for n in range(50)]
    rows = make_rows(ciphers, "1", plaintexts, [BYTEA] * 3)

    plan = plan_aesgcm_batch("Person", COLUMNS, [BYTEA] * 3, rows, ciphers)

    assert plan.ids == [r[0] for r in rows]
    assert plan.planned == 50 and plan.failed == [] and plan.skipped == 0
    assert len(plan.writes[0].new) == 3 and all(len(v) == 50 for v in plan.writes[0].new)
    assert read_back(plan, ciphers, [BYTEA] * 3) == {r[0]: p for r, p in zip(rows, plaintexts)}
    # The old key no longer reads them: they really are under key 2 now.
    for column in plan.writes[0].new:
        for value in column:
            with pytest.raises(CiphertextInvalid):
                ciphers.decrypt("1", value)


def test_null_stays_null_and_consumes_no_ciphertext(ciphers: AesGcmCipherSet) -> None:
    plaintexts = [[b"a", None, None], [None, None, None], [b"c", b"d", None], [None, b"", b"f"]]
    rows = make_rows(ciphers, "1", plaintexts, [BYTEA] * 3)

    plan = plan_aesgcm_batch("Person", COLUMNS, [BYTEA] * 3, rows, ciphers)

    assert plan.planned == 4  # a row of NULLs still moves: its key version changes
    for j in range(3):
        assert [v is None for v in plan.writes[0].new[j]] == [row[j] is None for row in plaintexts]
    assert read_back(plan, ciphers, [BYTEA] * 3) == {r[0]: p for r, p in zip(rows, plaintexts)}


def test_the_empty_plaintext_is_a_value_like_any_other(ciphers: AesGcmCipherSet) -> None:
    rows = make_rows(ciphers, "1", [[b"", b"", b""]], [BYTEA, TEXT, BYTEA])
    plan = plan_aesgcm_batch("Person", COLUMNS, [BYTEA, TEXT, BYTEA], rows, ciphers)
    assert read_back(plan, ciphers, [BYTEA, TEXT, BYTEA]) == {rows[0][0]: [b"", b"", b""]}
    assert len(plan.writes[0].new[0][0]) == len(base64.b64decode(plan.writes[0].new[1][0])) == 12 + 16  # nonce + tag


def test_bytea_columns_get_raw_bytes_and_text_columns_get_padded_standard_base64(ciphers: AesGcmCipherSet) -> None:
    encodings = [BYTEA, TEXT, TEXT]
    plaintexts = [[b"raw", b"base64 \xff\x00 text", b"?" * 5]]
    rows = make_rows(ciphers, "1", plaintexts, encodings)
    assert isinstance(rows[0][2], bytes) and isinstance(rows[0][3], str)

    plan = plan_aesgcm_batch("Person", COLUMNS, encodings, rows, ciphers)

    raw, text_a, text_b = (plan.writes[0].new[j][0] for j in range(3))
    assert isinstance(raw, bytes)
    assert isinstance(text_a, str) and isinstance(text_b, str)
    for text in (text_a, text_b):
        assert base64.b64encode(base64.b64decode(text, validate=True)).decode() == text  # canonical, padded
        assert len(text) % 4 == 0
    assert read_back(plan, ciphers, encodings) == {rows[0][0]: plaintexts[0]}


def test_a_text_column_may_arrive_as_bytes_or_str(ciphers: AesGcmCipherSet) -> None:
    blob = ciphers.cipher("1").encrypt(b"either way")
    as_str = base64.b64encode(blob).decode()
    rows = [(1, 1, as_str), (2, 1, as_str.encode())]
    plan = plan_aesgcm_batch("T", ["c"], [TEXT], rows, ciphers)
    assert plan.ids == [1, 2]
    assert read_back(plan, ciphers, [TEXT]) == {1: [b"either way"], 2: [b"either way"]}


def test_a_corrupt_value_fails_its_row_naming_only_the_bad_columns_and_the_other_rows_proceed(
        ciphers: AesGcmCipherSet) -> None:
    encodings = [BYTEA, TEXT, BYTEA]
    plaintexts = [[b"First-1", b"Last-1", b"Middle-1"], [b"First-2", b"Last-2", b"Middle-2"],
                  [b"First-3", b"Last-3", None]]
    rows = make_rows(ciphers, "1", plaintexts, encodings)
    tampered = bytearray(rows[1][2 + 0])
    tampered[-1] ^= 0x80  # the tag
    bad_text = "not base64 at all!"
    rows[1] = (rows[1][0], 1, bytes(tampered), bad_text, rows[1][4])

    plan = plan_aesgcm_batch("Person", COLUMNS, encodings, rows, ciphers)

    assert plan.failed == [FailedRow("Person", str(rows[1][0]), ("first_name_cipher", "last_name_cipher"))]
    assert plan.failed[0].reason == "decrypt_failed"
    assert plan.ids == [rows[0][0], rows[2][0]]
    assert read_back(plan, ciphers, encodings) == {rows[0][0]: plaintexts[0], rows[2][0]: plaintexts[2]}
    report = json.dumps([f.as_dict() for f in plan.failed])
    assert json.loads(report) == [{"target": "Person", "id": str(rows[1][0]),
                                   "columns": ["first_name_cipher", "last_name_cipher"], "reason": "decrypt_failed"}]
    assert_secret_free(report + repr(plan.failed), bytes(tampered), bad_text, b"First-2", b"Last-2", b"Middle-2")


@pytest.mark.parametrize("bad", [b"", b"\x00" * 27, b"short"])
def test_a_truncated_value_is_a_failed_row_not_an_error(ciphers: AesGcmCipherSet, bad: bytes) -> None:
    plan = plan_aesgcm_batch("T", ["c"], [BYTEA], [(7, 1, bad)], ciphers)
    assert plan.ids == [] and plan.failed == [FailedRow("T", "7", ("c",))]


def test_a_key_version_missing_from_the_keyring_raises_key_unavailable_for_the_whole_batch(
        keyring: Keyring, ciphers: AesGcmCipherSet) -> None:
    rows = make_rows(ciphers, "1", [[b"a", b"b", b"c"]] * 3, [BYTEA] * 3)
    rows.insert(2, (uuid.uuid4(), 5, b"\x00" * 40, None, None))

    with pytest.raises(KeyUnavailable) as err:
        plan_aesgcm_batch("Person", COLUMNS, [BYTEA] * 3, rows, ciphers)

    assert "key 5" in str(err.value)
    assert err.value.retryable is False
    assert_secret_free(err.value, *(k.material for k in keyring.keys.values()))


def test_an_old_key_missing_from_a_keyring_that_lost_it_raises_key_unavailable() -> None:
    full = make_keyring("1", "2", current="2")
    rows = make_rows(AesGcmCipherSet(full), "1", [[b"a", None, None]], [BYTEA] * 3)
    without_1 = Keyring(current="2", keys={"2": full.keys["2"]}, source="test keyring")
    with pytest.raises(KeyUnavailable, match="key 1 is not in the keyring"):
        plan_aesgcm_batch("Person", COLUMNS, [BYTEA] * 3, rows, AesGcmCipherSet(without_1))


def test_rows_already_known_to_fail_are_skipped_and_not_tried_again(ciphers: AesGcmCipherSet) -> None:
    rows = make_rows(ciphers, "1", [[b"a"], [b"b"], [b"c"]], [BYTEA])
    rows[1] = (rows[1][0], 1, b"\x01" * 40)  # would fail again

    plan = plan_aesgcm_batch("T", ["c"], [BYTEA], rows, ciphers, known_failed={str(rows[1][0])})

    assert plan.skipped == 1
    assert plan.failed == []  # reported once, in the batch that found it
    assert plan.ids == [rows[0][0], rows[2][0]]


def test_rows_already_on_the_current_key_are_rewritten_under_a_fresh_nonce(ciphers: AesGcmCipherSet) -> None:
    # Selection never hands these over; if it did, the result must still read back.
    rows = make_rows(ciphers, "2", [[b"same"]], [BYTEA])
    plan = plan_aesgcm_batch("T", ["c"], [BYTEA], rows, ciphers)
    assert plan.writes[0].new[0][0] != rows[0][2]
    assert read_back(plan, ciphers, [BYTEA]) == {rows[0][0]: [b"same"]}


def test_an_aes128_old_key_moves_to_an_aes256_current_key() -> None:
    keyring = Keyring(current="2", keys={**make_keyring("1", length=16).keys, **make_keyring("2").keys},
                      source="test keyring")
    ciphers = AesGcmCipherSet(keyring)
    rows = make_rows(ciphers, "1", [[b"sixteen-byte key"]], [TEXT])
    plan = plan_aesgcm_batch("T", ["c"], [TEXT], rows, ciphers)
    assert read_back(plan, ciphers, [TEXT]) == {rows[0][0]: [b"sixteen-byte key"]}


def test_every_nonce_of_a_batch_is_distinct(ciphers: AesGcmCipherSet) -> None:
    rows = make_rows(ciphers, "1", [[b"v", b"v", b"v"]] * 100, [BYTEA] * 3)
    plan = plan_aesgcm_batch("Person", COLUMNS, [BYTEA] * 3, rows, ciphers)
    nonces = [value[:12] for column in plan.writes[0].new for value in column]
    assert len(set(nonces)) == len(nonces) == 300


def test_a_batch_of_rows_on_several_keys_keeps_each_row_with_its_own_values_and_failures() -> None:
    # The plan works column by column and key by key: rows interleaved across keys must come out
    # in their own order, each with its own values, and a bad value fails only its own row.
    keyring = make_keyring("1", "2", "3", current="3")
    ciphers = AesGcmCipherSet(keyring)
    encodings = [BYTEA, TEXT]
    plaintexts = [[f"first-{n}".encode(), None if n % 3 == 0 else f"last-{n}".encode()] for n in range(12)]
    rows: list[tuple[Any, ...]] = []
    for n, p in enumerate(plaintexts):
        rows += make_rows(ciphers, "1" if n % 2 else "2", [p], encodings)
    rows[5] = (rows[5][0], rows[5][1], rows[5][2], "not base64 at all!")
    tampered = bytearray(rows[8][2])
    tampered[0] ^= 1
    rows[8] = (rows[8][0], rows[8][1], bytes(tampered), rows[8][3])

    plan = plan_aesgcm_batch("T", ["a", "b"], encodings, rows, ciphers)

    assert plan.failed == [FailedRow("T", str(rows[5][0]), ("b",)), FailedRow("T", str(rows[8][0]), ("a",))]
    kept = [n for n in range(12) if n not in (5, 8)]
    assert plan.ids == [rows[n][0] for n in kept]
    assert read_back(plan, ciphers, encodings) == {rows[n][0]: plaintexts[n] for n in kept}


def test_an_empty_batch_plans_nothing(ciphers: AesGcmCipherSet) -> None:
    plan = plan_aesgcm_batch("Person", COLUMNS, [BYTEA] * 3, [], ciphers)
    assert (plan.ids, plan.writes[0].new, plan.failed, plan.skipped) == ([], [[], [], []], [], 0)


# -- property: any plaintexts, any encodings, any key pair ---------------------------------------

plaintext_or_null = st.one_of(st.none(), st.binary(max_size=200))
encodings_st = st.lists(st.sampled_from([BYTEA, TEXT]), min_size=1, max_size=4)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), encodings=encodings_st, old_len=st.sampled_from([16, 24, 32]),
       new_len=st.sampled_from([16, 24, 32]))
def test_round_trip_of_random_plaintexts_through_a_planned_batch(data: st.DataObject, encodings: list[ColumnEncoding],
                                                                 old_len: int, new_len: int) -> None:
    keyring = Keyring(current="9", keys={**make_keyring("3", length=old_len).keys,
                                         **make_keyring("9", length=new_len).keys}, source="test keyring")
    ciphers = AesGcmCipherSet(keyring)
    plaintexts = data.draw(st.lists(st.lists(plaintext_or_null, min_size=len(encodings), max_size=len(encodings)),
                                    max_size=20))
    rows = make_rows(ciphers, "3", plaintexts, encodings)
    columns = [f"c{j}" for j in range(len(encodings))]

    plan = plan_aesgcm_batch("T", columns, encodings, rows, ciphers)

    assert plan.failed == [] and plan.ids == [r[0] for r in rows]
    assert read_back(plan, ciphers, encodings) == {r[0]: list(p) for r, p in zip(rows, plaintexts)}
    for j, enc in enumerate(encodings):
        for value in plan.writes[0].new[j]:
            assert value is None or isinstance(value, bytes if enc is BYTEA else str)
