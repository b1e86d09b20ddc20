"""Ciphertext formats (contract §2): known-answer vectors, round trips, rejection, JSON paths.

All keys here are TEST keys. The vectors in tests/vectors/ were computed with ``cryptography``
directly (see tests/vectors/generate.py), so they check pinrotate's formats independently.
"""

from __future__ import annotations

import base64
import importlib.util
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pinrotate_core.errors import CiphertextInvalid, ConfigError, KeyUnavailable
from pinrotate_core.keyring import Key, Keyring
from pinrotate_core.schemes._json_paths import (
    extract_json_values,
    get_json_path,
    json_values_in,
    parse_json_path,
    replace_json_values,
    set_json_path,
)
from pinrotate_core.schemes.aesgcm import AesGcmCipherSet, ColumnEncoding
from pinrotate_core.schemes.fpc1_values import (
    Fpc1CipherSet,
    LegacyCipher,
    classify,
    format_fpc1,
    looks_like_legacy,
    parse_fpc1,
)

VECTORS = Path(__file__).parent / "vectors"


def _load(name: str) -> dict[str, Any]:
    document: dict[str, Any] = json.loads((VECTORS / name).read_text(encoding="utf-8"))
    return document


def _vectors(name: str) -> list[Any]:
    return [pytest.param(v, id=v["id"]) for v in _load(name)["vectors"]]


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("pinrotate_test_vectors_generate", VECTORS / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ring(current: str, keys: dict[str, bytes], legacy: bytes | None = None) -> Keyring:
    return Keyring(
        current=current,
        keys={key_id: Key(key_id, material) for key_id, material in keys.items()},
        source="test keyring",
        legacy=Key("legacy", legacy) if legacy is not None else None,
    )


def _assert_no_value_in(message: str, *secrets: str | bytes) -> None:
    for secret in secrets:
        text = secret.hex() if isinstance(secret, bytes) else secret
        if len(text) >= 8:  # shorter strings (e.g. "" or "Ab==") occur in ordinary words
            assert text not in message


KEY_A = bytes(range(16))
KEY_B = bytes(range(16, 32))
UTF8_NAME = "Иванов Пётр 张伟".encode()


# --- the vector files ---------------------------------------------------------------------------


def test_vector_files_are_exactly_what_generate_py_writes() -> None:
    generator = _generator()
    for name, document in generator.build_all().items():
        assert (VECTORS / name).read_text(encoding="utf-8") == generator.render(document), name


def test_vector_files_say_they_hold_test_keys_only() -> None:
    for name in ("aesgcm.json", "fpc1.json", "legacy.json", "fpc1_invalid.json"):
        assert "TEST KEYS ONLY" in _load(name)["notice"]
    assert "TEST KEYS ONLY" in (VECTORS / "generate.py").read_text(encoding="utf-8")


def test_vectors_cover_empty_non_ascii_and_one_kib_plaintexts() -> None:
    for name in ("aesgcm.json", "fpc1.json", "legacy.json"):
        plaintexts = {bytes.fromhex(v["plaintext_hex"]) for v in _load(name)["vectors"]}
        assert b"" in plaintexts
        assert any(len(p) == 1024 for p in plaintexts)
        assert any(not p.isascii() and p.decode("utf-8", "strict") for p in plaintexts if len(p) < 1024)


@pytest.mark.parametrize("vector", _vectors("aesgcm.json"))
def test_aesgcm_vector_decrypts_from_bytea_and_text_and_encrypts_byte_exact(vector: dict[str, Any]) -> None:
    key = bytes.fromhex(vector["key_hex"])
    assert base64.b64decode(vector["key_base64"]) == key
    plaintext = bytes.fromhex(vector["plaintext_hex"])
    ciphers = AesGcmCipherSet(_ring("1", {"1": key}))

    from_bytea = ColumnEncoding.BYTEA.to_bytes(bytes.fromhex(vector["expected_bytea_hex"]))
    from_text = ColumnEncoding.BASE64_TEXT.to_bytes(vector["expected_text"])
    assert ciphers.decrypt("1", from_bytea) == plaintext
    assert ciphers.decrypt("1", from_text) == plaintext

    blob = ciphers.encrypt_current(plaintext, bytes.fromhex(vector["nonce_hex"]))
    assert ColumnEncoding.BYTEA.from_bytes(blob) == bytes.fromhex(vector["expected_bytea_hex"])
    assert ColumnEncoding.BASE64_TEXT.from_bytes(blob) == vector["expected_text"]


@pytest.mark.parametrize("vector", _vectors("fpc1.json"))
def test_fpc1_vector_decrypts_and_encrypts_byte_exact(vector: dict[str, Any]) -> None:
    key = bytes.fromhex(vector["key_hex"])
    plaintext = bytes.fromhex(vector["plaintext_hex"])
    ciphers = Fpc1CipherSet(_ring(vector["key_id"], {vector["key_id"]: key}), algorithm=vector["algorithm"])

    assert ciphers.decrypt(vector["expected"]) == plaintext
    assert ciphers.encrypt_current(plaintext, bytes.fromhex(vector["nonce_hex"])) == vector["expected"]
    found = classify(vector["expected"])
    assert (found.kind, found.key_id, found.algorithm) == ("fpc1", vector["key_id"], vector["algorithm"])
    parsed = parse_fpc1(vector["expected"])
    assert parsed.payload[:12] == bytes.fromhex(vector["nonce_hex"])
    assert parsed.to_stored() == vector["expected"]
    assert parsed.payload.hex() not in str(parsed)


@pytest.mark.parametrize("vector", _vectors("legacy.json"))
def test_legacy_vector_decrypts_under_the_legacy_key(vector: dict[str, Any]) -> None:
    key = bytes.fromhex(vector["key_hex"])
    plaintext = bytes.fromhex(vector["plaintext_hex"])
    ciphers = Fpc1CipherSet(
        _ring("k2", {"k2": KEY_B}, legacy=key),
        legacy_format=vector["legacy_format"],
        legacy_read_enabled=True,
        legacy_plaintext="bytes",  # some vectors hold binary plaintexts
    )
    assert ciphers.decrypt(vector["expected"]) == plaintext
    assert LegacyCipher(Key("legacy", key), vector["legacy_format"], "bytes").decrypt(vector["expected"]) == plaintext
    assert ciphers.classify(vector["expected"]).kind == "legacy-candidate"
    assert looks_like_legacy(vector["expected"], vector["legacy_format"])
    # Re-encryption moves it to FPC1 under the current key: nothing is written in a legacy form.
    rewritten = ciphers.encrypt_current(plaintext)
    assert rewritten.startswith("FPC1:AES-GCM:k2:")
    assert ciphers.decrypt(rewritten) == plaintext


@pytest.mark.parametrize("vector", _vectors("published_gcm.json"))
def test_published_gcm_vector_matches_pinrotate_formats(vector: dict[str, Any]) -> None:
    key = bytes.fromhex(vector["key_hex"])
    nonce = bytes.fromhex(vector["nonce_hex"])
    plaintext = bytes.fromhex(vector["plaintext_hex"])
    stored = nonce + bytes.fromhex(vector["ciphertext_hex"]) + bytes.fromhex(vector["tag_hex"])
    assert vector["source"]

    if vector["algorithm"] == "AES-GCM":
        ciphers = AesGcmCipherSet(_ring("1", {"1": key}))
        assert ciphers.encrypt_current(plaintext, nonce) == stored
        assert ciphers.decrypt("1", stored) == plaintext
    if len(key) == 16:
        fpc1 = Fpc1CipherSet(_ring("pub", {"pub": key}), algorithm=vector["algorithm"])
        expected = format_fpc1(vector["algorithm"], "pub", stored)
        assert fpc1.encrypt_current(plaintext, nonce) == expected
        assert fpc1.decrypt(expected) == plaintext


@pytest.mark.parametrize("vector", _vectors("fpc1_invalid.json"))
def test_malformed_fpc1_value_is_rejected_without_echoing_it(vector: dict[str, Any]) -> None:
    stored = vector["stored"]
    with pytest.raises(CiphertextInvalid) as parse_error:
        parse_fpc1(stored)
    _assert_no_value_in(str(parse_error.value), stored, stored.rsplit(":", 1)[-1])
    assert classify(stored).kind == "unknown"
    ciphers = Fpc1CipherSet(_ring("k2025-01", {"k2025-01": KEY_A}, legacy=KEY_B), legacy_read_enabled=True)
    with pytest.raises(CiphertextInvalid):
        ciphers.decrypt(stored)


def test_the_valid_value_behind_the_invalid_vectors_parses() -> None:
    assert parse_fpc1(_load("fpc1_invalid.json")["valid"]).key_id == "k2025-01"


# --- round trips --------------------------------------------------------------------------------

_settings = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
_aes_keys = st.one_of(st.binary(min_size=16, max_size=16), st.binary(min_size=32, max_size=32))
_fpc1_keys = st.binary(min_size=16, max_size=16)
_key_ids = st.from_regex(r"[A-Za-z0-9_-]{1,32}", fullmatch=True)


@_settings
@given(
    plaintext=st.binary(max_size=2048),
    old=_aes_keys,
    new=_aes_keys,
    encoding=st.sampled_from(list(ColumnEncoding)),
)
def test_aesgcm_rotation_round_trip_keeps_the_plaintext(
    plaintext: bytes, old: bytes, new: bytes, encoding: ColumnEncoding
) -> None:
    stored = encoding.from_bytes(AesGcmCipherSet(_ring("1", {"1": old})).encrypt_current(plaintext))

    rotating = AesGcmCipherSet(_ring("2", {"1": old, "2": new}))
    recovered = rotating.decrypt("1", encoding.to_bytes(stored))
    rotated = encoding.from_bytes(rotating.encrypt_current(recovered))

    assert rotating.decrypt("2", encoding.to_bytes(rotated)) == plaintext
    assert AesGcmCipherSet(_ring("2", {"2": new})).decrypt("2", encoding.to_bytes(rotated)) == plaintext


@_settings
@given(
    plaintext=st.binary(max_size=2048),
    old=_fpc1_keys,
    new=_fpc1_keys,
    ids=st.lists(_key_ids, min_size=2, max_size=2, unique=True),
    old_algorithm=st.sampled_from(["AES-GCM", "SM4-GCM"]),
    new_algorithm=st.sampled_from(["AES-GCM", "SM4-GCM"]),
)
def test_fpc1_rotation_round_trip_keeps_the_plaintext(
    plaintext: bytes, old: bytes, new: bytes, ids: list[str], old_algorithm: str, new_algorithm: str
) -> None:
    old_id, new_id = ids
    stored = Fpc1CipherSet(_ring(old_id, {old_id: old}), algorithm=old_algorithm).encrypt_current(plaintext)
    assert classify(stored).key_id == old_id

    rotating = Fpc1CipherSet(_ring(new_id, {old_id: old, new_id: new}), algorithm=new_algorithm)
    rotated = rotating.encrypt_current(rotating.decrypt(stored))

    assert rotated.startswith(f"FPC1:{new_algorithm}:{new_id}:")
    assert rotating.decrypt(rotated) == plaintext
    assert Fpc1CipherSet(_ring(new_id, {new_id: new})).decrypt(rotated) == plaintext


def test_reencrypt_to_current_moves_fpc1_and_legacy_values_to_the_current_key_verified() -> None:
    legacy = next(v for v in _load("legacy.json")["vectors"] if v["id"] == "legacy-aesgcm-b64-256-utf8")
    old = Fpc1CipherSet(_ring("k1", {"k1": KEY_A}), algorithm="SM4-GCM").encrypt_current(UTF8_NAME)
    ciphers = Fpc1CipherSet(
        _ring("k2", {"k1": KEY_A, "k2": KEY_B}, legacy=bytes.fromhex(legacy["key_hex"])), legacy_read_enabled=True
    )
    for stored, plaintext in ((old, UTF8_NAME), (legacy["expected"], bytes.fromhex(legacy["plaintext_hex"]))):
        rotated = ciphers.reencrypt_to_current(stored)
        assert parse_fpc1(rotated).key_id == "k2"
        assert ciphers.decrypt(rotated) == plaintext
    nonce = bytes(range(12))
    assert ciphers.reencrypt_to_current(old, nonce) == ciphers.encrypt_current(UTF8_NAME, nonce)


def test_empty_plaintext_is_a_value_like_any_other_in_every_format() -> None:
    aes = AesGcmCipherSet(_ring("1", {"1": KEY_A}))
    for encoding in ColumnEncoding:
        stored = encoding.from_bytes(aes.encrypt_current(b""))
        assert len(encoding.to_bytes(stored)) == 28
        assert aes.decrypt("1", encoding.to_bytes(stored)) == b""
    for algorithm in ("AES-GCM", "SM4-GCM"):
        fpc1 = Fpc1CipherSet(_ring("k1", {"k1": KEY_A}), algorithm=algorithm)
        assert fpc1.decrypt(fpc1.encrypt_current(b"")) == b""


def test_a_stored_empty_string_is_not_a_ciphertext() -> None:
    assert classify("").kind == "unknown"
    with pytest.raises(CiphertextInvalid):
        Fpc1CipherSet(_ring("k1", {"k1": KEY_A}), legacy_read_enabled=True).decrypt("")


# --- tampered, truncated, wrong key -------------------------------------------------------------


def _flip(data: bytes, position: int) -> bytes:
    return data[:position] + bytes([data[position] ^ 0x01]) + data[position + 1 :]


@settings(max_examples=40, deadline=None)
@given(
    plaintext=st.binary(max_size=200),
    algorithm=st.sampled_from(["AES-GCM", "SM4-GCM"]),
    where=st.floats(min_value=0, max_value=1, exclude_max=True),
)
def test_tampered_fpc1_value_is_invalid_and_the_error_names_no_value(
    plaintext: bytes, algorithm: str, where: float
) -> None:
    ciphers = Fpc1CipherSet(_ring("k1", {"k1": KEY_A}), algorithm=algorithm)
    value = parse_fpc1(ciphers.encrypt_current(plaintext))
    tampered = format_fpc1(value.algorithm, "k1", _flip(value.payload, int(where * len(value.payload))))
    with pytest.raises(CiphertextInvalid) as error:
        ciphers.decrypt(tampered)
    _assert_no_value_in(str(error.value), tampered, tampered.rsplit(":", 1)[-1], plaintext, KEY_A)


@pytest.mark.parametrize("algorithm", ["AES-GCM", "SM4-GCM"])
@pytest.mark.parametrize("keep", [0, 1, 12, 27, 28, 40])
def test_truncated_fpc1_value_is_invalid(algorithm: str, keep: int) -> None:
    ciphers = Fpc1CipherSet(_ring("k1", {"k1": KEY_A}), algorithm=algorithm)
    payload = parse_fpc1(ciphers.encrypt_current(b"a value of some length")).payload
    truncated = format_fpc1(algorithm, "k1", payload[:keep])  # type: ignore[arg-type]
    with pytest.raises(CiphertextInvalid) as error:
        ciphers.decrypt(truncated)
    _assert_no_value_in(str(error.value), truncated.rsplit(":", 1)[-1], b"a value of some length")


@pytest.mark.parametrize("algorithm", ["AES-GCM", "SM4-GCM"])
def test_fpc1_value_under_other_material_with_the_same_key_id_is_invalid(algorithm: str) -> None:
    stored = Fpc1CipherSet(_ring("k1", {"k1": KEY_A}), algorithm=algorithm).encrypt_current(UTF8_NAME)
    with pytest.raises(CiphertextInvalid) as error:
        Fpc1CipherSet(_ring("k1", {"k1": KEY_B}), algorithm=algorithm).decrypt(stored)
    _assert_no_value_in(str(error.value), stored, UTF8_NAME, KEY_A, KEY_B)


def test_fpc1_value_relabelled_with_the_other_algorithm_is_invalid() -> None:
    ciphers = Fpc1CipherSet(_ring("k1", {"k1": KEY_A}))
    value = parse_fpc1(ciphers.encrypt_current(UTF8_NAME))
    with pytest.raises(CiphertextInvalid):
        ciphers.decrypt(format_fpc1("SM4-GCM", "k1", value.payload))


def test_tampered_truncated_and_wrong_key_aesgcm_values_are_invalid() -> None:
    ciphers = AesGcmCipherSet(_ring("1", {"1": KEY_A, "2": KEY_B}))
    blob = ciphers.encrypt_current(UTF8_NAME)
    for bad_key_id, bad in (("1", _flip(blob, 5)), ("1", _flip(blob, len(blob) - 1)), ("1", blob[:27]), ("2", blob)):
        with pytest.raises(CiphertextInvalid) as error:
            ciphers.decrypt(bad_key_id, bad)
        _assert_no_value_in(str(error.value), bad, UTF8_NAME, base64.b64encode(bad).decode())
    with pytest.raises(CiphertextInvalid) as error:
        ColumnEncoding.BASE64_TEXT.to_bytes("not base64 at all, Иванов")
    assert "Иванов" not in str(error.value)


@pytest.mark.parametrize("legacy_format", ["aesgcm-b64", "aes-ecb-b64"])
def test_legacy_values_under_another_key_or_tampered_are_invalid(legacy_format: str) -> None:
    # Fixed vectors: with these two keys every ECB value fails its padding check (ECB is not
    # authenticated, so a wrong key is caught only by padding, ~255 times in 256).
    wrong = Key("legacy", bytes(16))
    for vector in _load("legacy.json")["vectors"]:
        if vector["legacy_format"] != legacy_format:
            continue
        stored = vector["expected"]
        with pytest.raises(CiphertextInvalid) as error:
            LegacyCipher(wrong, legacy_format).decrypt(stored)
        _assert_no_value_in(str(error.value), stored, vector["plaintext_hex"])
        right = LegacyCipher(Key("legacy", bytes.fromhex(vector["key_hex"])), legacy_format)
        blob = base64.b64decode(stored)
        # For ECB only the last block is checked (its padding); these fixed vectors all fail it.
        for bad in (_flip(blob, len(blob) - 1), blob[:-1]):
            with pytest.raises(CiphertextInvalid):
                right.decrypt(base64.b64encode(bad).decode())


# --- keys: unavailable, misconfigured -----------------------------------------------------------


def test_fpc1_value_on_a_key_the_keyring_lacks_is_key_unavailable() -> None:
    stored = Fpc1CipherSet(_ring("gone", {"gone": KEY_A})).encrypt_current(b"x")
    ciphers = Fpc1CipherSet(_ring("k2", {"k2": KEY_B}))
    found = ciphers.classify(stored)
    assert (found.kind, found.key_id) == ("fpc1", "gone")
    with pytest.raises(KeyUnavailable) as error:
        ciphers.decrypt(stored)
    assert "gone" in str(error.value)
    assert error.value.retryable is False


def test_legacy_value_when_legacy_reading_is_off_or_has_no_key_is_key_unavailable() -> None:
    stored = next(v["expected"] for v in _load("legacy.json")["vectors"] if v["id"] == "legacy-aesgcm-b64-128-ascii")
    switched_off = Fpc1CipherSet(_ring("k2", {"k2": KEY_B}, legacy=KEY_A))
    no_legacy_key = Fpc1CipherSet(_ring("k2", {"k2": KEY_B}), legacy_read_enabled=True)
    for ciphers, reason in ((switched_off, "legacy_read_enabled"), (no_legacy_key, "no legacy key")):
        assert not ciphers.can_read_legacy
        assert ciphers.classify(stored).kind == "legacy-candidate"
        with pytest.raises(KeyUnavailable, match=reason):
            ciphers.decrypt(stored)
    assert Fpc1CipherSet(_ring("k2", {"k2": KEY_B}, legacy=KEY_A), legacy_read_enabled=True).can_read_legacy


@pytest.mark.parametrize("length", [24, 32])
def test_fpc1_key_that_is_not_16_bytes_is_a_config_error_naming_the_key_id(length: int) -> None:
    material = bytes(range(length))
    with pytest.raises(ConfigError) as error:
        Fpc1CipherSet(_ring("k1", {"k1": KEY_A, "big-key": material}))
    assert "big-key" in str(error.value)
    _assert_no_value_in(str(error.value), material, base64.b64encode(material).decode())


@pytest.mark.parametrize("key_id", ["bad.id", "with space", "k" * 33, ""])
def test_keyring_with_a_key_id_fpc1_cannot_write_is_a_config_error(key_id: str) -> None:
    with pytest.raises(ConfigError):
        Fpc1CipherSet(_ring("k1", {"k1": KEY_A, key_id: KEY_B}))


@pytest.mark.parametrize("key_id", ["a", "k2025-01", "test_key-B", "Z" * 32, "0", "123"])
def test_valid_key_ids_round_trip_through_fpc1(key_id: str) -> None:
    ciphers = Fpc1CipherSet(_ring(key_id, {key_id: KEY_A}))
    stored = ciphers.encrypt_current(b"v")
    assert parse_fpc1(stored).key_id == key_id
    assert ciphers.decrypt(stored) == b"v"


def test_unknown_algorithm_legacy_format_or_server_side_keyring_is_a_config_error() -> None:
    ring = _ring("k1", {"k1": KEY_A})
    with pytest.raises(ConfigError):
        Fpc1CipherSet(ring, algorithm="AES-CBC")
    with pytest.raises(ConfigError):
        Fpc1CipherSet(ring, legacy_format="des-b64")
    with pytest.raises(ConfigError):
        Fpc1CipherSet(Keyring(current="k1", keys={}, source="transit", server_side=True))


def test_one_cipher_object_per_algorithm_and_key_id_is_reused_across_values() -> None:
    ciphers = Fpc1CipherSet(_ring("k2", {"k1": KEY_A, "k2": KEY_B}))
    writer = ciphers.cipher("AES-GCM", "k2")
    old = Fpc1CipherSet(_ring("k1", {"k1": KEY_A}), algorithm="SM4-GCM")
    for n in range(20):
        ciphers.decrypt(old.encrypt_current(str(n).encode()))
        ciphers.encrypt_current(b"x")
    assert ciphers.cipher("AES-GCM", "k2") is writer
    assert ciphers.cipher("SM4-GCM", "k1") is ciphers.cipher("SM4-GCM", "k1")


def test_reprs_show_no_payload_or_key() -> None:
    ciphers = Fpc1CipherSet(_ring("k1", {"k1": KEY_A}))
    stored = ciphers.encrypt_current(UTF8_NAME)
    payload_b64 = stored.rsplit(":", 1)[-1]
    for text in (repr(parse_fpc1(stored)), repr(ciphers), repr(ciphers.cipher("AES-GCM", "k1"))):
        _assert_no_value_in(text, payload_b64, KEY_A, UTF8_NAME)


# --- classify -----------------------------------------------------------------------------------


def test_classify_tells_fpc1_legacy_candidates_and_unknown_apart() -> None:
    gcm_legacy = base64.b64encode(bytes(28)).decode()
    ecb_legacy = base64.b64encode(bytes(32)).decode()
    assert classify("FPC1:SM4-GCM:k7:" + gcm_legacy).key_id == "k7"
    assert classify(gcm_legacy).kind == "legacy-candidate"
    assert classify(base64.b64encode(bytes(27)).decode()).kind == "unknown"
    assert classify(ecb_legacy, legacy_format="aes-ecb-b64").kind == "legacy-candidate"
    assert classify(base64.b64encode(bytes(17)).decode(), legacy_format="aes-ecb-b64").kind == "unknown"
    for not_a_ciphertext in ("", "John", "vault:v1:" + gcm_legacy, gcm_legacy + "\n", "FPC1:", "Иванов"):
        assert classify(not_a_ciphertext).kind == "unknown", not_a_ciphertext


# --- JSON paths ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "steps"),
    [
        ("$.password", ("password",)),
        ("$.auth.token", ("auth", "token")),
        ("$.fields[2].secret", ("fields", 2, "secret")),
        ("$[0]", (0,)),
        ("$['odd key.with dot']", ("odd key.with dot",)),
        ('$["x"][10]', ("x", 10)),
        ("$.snake_case-and-dash", ("snake_case-and-dash",)),
    ],
)
def test_json_path_subset_parses(path: str, steps: tuple[object, ...]) -> None:
    assert parse_json_path(path).steps == steps


@pytest.mark.parametrize("path", ["password", "$", "$.", "$..a", "$.a..b", "$[-1]", "$[01]", "$[*]", "$.a[", "$.a b"])
def test_unsupported_json_path_is_a_config_error_naming_it(path: str) -> None:
    with pytest.raises(ConfigError) as error:
        parse_json_path(path)
    assert repr(path) in str(error.value)


def test_get_and_set_json_path_on_a_parsed_document_keep_key_order() -> None:
    document = {"z": 1, "auth": {"user": "u", "token": "old", "a": None}, "fields": [{}, {}, {"secret": "s"}]}
    assert get_json_path(document, "$.auth.token") == "old"
    assert get_json_path(document, "$.fields[2].secret") == "s"
    assert get_json_path(document, "$.fields[9].secret") is None
    assert get_json_path(document, "$.auth.token.deeper") is None
    set_json_path(document, "$.auth.token", "new")
    set_json_path(document, "$.fields[2].secret", "s2")
    assert list(document) == ["z", "auth", "fields"]
    assert list(document["auth"]) == ["user", "token", "a"]  # type: ignore[call-overload]
    assert get_json_path(document, "$.auth.token") == "new"
    with pytest.raises(LookupError):
        set_json_path(document, "$.auth.missing", "x")


def test_json_text_rewrite_changes_only_the_named_strings() -> None:
    text = (
        '{\n  "host": "db",  "port": 5432, "ratio": 1.10, "big": 1e400, "name": "\\u0418\\u0432\\u0430\\u043d",\n'
        '  "password": "FPC1:AES-GCM:k1:AAAA",\n  "auth": {"token": "FPC1:AES-GCM:k1:BBBB", "user": "\\/x"},\n'
        '  "fields": [ {"secret": "C"}, 7, {"secret": "FPC1:AES-GCM:k1:DDDD"} ]\n}'
    )
    paths = ["$.password", "$.auth.token", "$.fields[2].secret", "$.absent", "$.fields[9].secret"]
    found = extract_json_values(text, paths)
    assert found == {
        "$.password": "FPC1:AES-GCM:k1:AAAA",
        "$.auth.token": "FPC1:AES-GCM:k1:BBBB",
        "$.fields[2].secret": "FPC1:AES-GCM:k1:DDDD",
    }
    rewritten = replace_json_values(text, {path: value.replace("k1", "k2") for path, value in found.items()})
    assert rewritten == text.replace(":k1:", ":k2:")
    assert replace_json_values(rewritten, found) == text


_json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10)
_json_values = st.recursive(
    _json_scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=10,
)
_stored = st.from_regex(r"FPC1:(AES|SM4)-GCM:[A-Za-z0-9_-]{1,8}:[A-Za-z0-9+/]{4,40}={0,2}", fullmatch=True)


@_settings
@given(
    before=_json_values,
    between=_json_values,
    token=_stored,
    secret=_stored,
    new_token=_stored,
    indent=st.sampled_from([None, 0, 2, "\t"]),
    ensure_ascii=st.booleans(),
)
def test_json_text_rewrite_round_trips_for_any_surrounding_document(
    before: Any, between: Any, token: str, secret: str, new_token: str, indent: Any, ensure_ascii: bool
) -> None:
    document = {"before": before, "auth": {"token": token, "other": between}, "fields": [between, {"secret": secret}]}
    text = json.dumps(document, indent=indent, ensure_ascii=ensure_ascii)
    paths = ["$.auth.token", "$.fields[1].secret"]
    assert extract_json_values(text, paths) == {"$.auth.token": token, "$.fields[1].secret": secret}

    rewritten = replace_json_values(text, {"$.auth.token": new_token})
    expected = json.loads(text)
    expected["auth"]["token"] = new_token
    assert json.loads(rewritten) == expected
    assert extract_json_values(rewritten, paths)["$.auth.token"] == new_token
    assert replace_json_values(rewritten, {"$.auth.token": token}) == text


def test_json_values_that_are_not_strings_or_not_json_are_invalid_without_the_value() -> None:
    assert extract_json_values('{"password": null}', ["$.password"]) == {}
    with pytest.raises(CiphertextInvalid, match=r"\$\.password holds a number"):
        extract_json_values('{"password": 123456}', ["$.password"])
    with pytest.raises(CiphertextInvalid) as error:
        extract_json_values("password=hunter2-secret", ["$.password"])
    assert "hunter2" not in str(error.value)
    assert json_values_in({"a": {"b": "FPC1:x"}}, ["$.a.b"]) == {"$.a.b": "FPC1:x"}


def test_json_rewrite_refuses_duplicate_keys_and_missing_paths() -> None:
    with pytest.raises(CiphertextInvalid, match="twice"):
        replace_json_values('{"password": "a", "password": "b"}', {"$.password": "c"})
    with pytest.raises(LookupError):
        replace_json_values('{"other": "a"}', {"$.password": "c"})
    with pytest.raises(LookupError):
        replace_json_values('{"password": 5}', {"$.password": "c"})


def test_ecb_legacy_values_under_another_key_are_refused_unless_their_plaintext_is_utf8() -> None:
    """AES-ECB has no tag: about 1 in 256 foreign values pass the PKCS#7 padding check alone.
    With legacy_plaintext = "utf8" (the default) such a value must also decrypt to UTF-8 text."""
    import secrets

    from pinrotate_core._primitives import AesEcbPkcs7

    legacy_key, foreign_key = secrets.token_bytes(16), secrets.token_bytes(16)
    # Binary plaintexts (as a foreign value decrypted under the wrong key looks), written under another key.
    foreign = [base64.b64encode(AesEcbPkcs7(foreign_key).encrypt(secrets.token_bytes(24))).decode() for _ in range(4000)]
    strict = LegacyCipher(Key("legacy", legacy_key), "aes-ecb-b64")
    lax = LegacyCipher(Key("legacy", legacy_key), "aes-ecb-b64", "bytes")

    def accepted(cipher: LegacyCipher) -> int:
        n = 0
        for value in foreign:
            try:
                cipher.decrypt(value)
                n += 1
            except CiphertextInvalid:
                pass
        return n

    assert accepted(lax) > 0  # the padding check alone lets some through (expected ~16 of 4000)
    assert accepted(strict) <= accepted(lax) // 4  # UTF-8 decoding refuses nearly all of them
    text = "Zoë Müller, 1990-01-01"
    own = base64.b64encode(AesEcbPkcs7(legacy_key).encrypt(text.encode())).decode()
    assert strict.decrypt(own).decode() == text
