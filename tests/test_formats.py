"""Ciphertext formats (contract §2): known-answer vectors, round trips, rejection, JSON paths.

All keys here are TEST keys. The vectors in tests/vectors/ were computed with ``cryptography``
directly (see tests/vectors/generate.py), so they check pinrotate's formats independently.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import shutil
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pinrotate_core.errors import CiphertextInvalid, ConfigError
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


@pytest.mark.skipif(shutil.which("openssl") is None, reason="generate.py computes the fpc1 vectors with the openssl CLI")
def test_vector_files_are_exactly_what_generate_py_writes() -> None:
    generator = _generator()
    for name, document in generator.build_all().items():
        assert (VECTORS / name).read_text(encoding="utf-8") == generator.render(document), name


def test_vector_files_say_they_hold_test_keys_only() -> None:
    for name in ("aesgcm.json", "fpc1.json", "fpc1_invalid.json"):
        assert "TEST KEYS ONLY" in _load(name)["notice"]
    assert "TEST KEYS ONLY" in (VECTORS / "generate.py").read_text(encoding="utf-8")


def test_vectors_cover_empty_non_ascii_and_one_kib_plaintexts() -> None:
    for name in ("aesgcm.json", "fpc1.json"):
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


# --- round trips --------------------------------------------------------------------------------

_settings = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
_aes_keys = st.one_of(st.binary(min_size=16, max_size=16), st.binary(min_size=32, max_size=32))
_fpc1_keys = st.binary(min_size=16, max_size=16)
_key_ids = st.from_regex(r"[A-Za-z0-9_-]{1,32}", fullmatch=True)


@pytest.mark.parametrize("vector", _vectors("published_gcm.json"))
def test_published_gcm_vector_matches_the_aesgcm_format(vector: dict[str, Any]) -> None:
    key = bytes.fromhex(vector["key_hex"])
    nonce = bytes.fromhex(vector["nonce_hex"])
    plaintext = bytes.fromhex(vector["plaintext_hex"])
    stored = nonce + bytes.fromhex(vector["ciphertext_hex"]) + bytes.fromhex(vector["tag_hex"])
    assert vector["source"] and vector["algorithm"] == "AES-GCM"
    ciphers = AesGcmCipherSet(_ring("1", {"1": key}))
    assert ciphers.encrypt_current(plaintext, nonce) == stored
    assert ciphers.decrypt("1", stored) == plaintext


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


# --- tampered, truncated, wrong key -------------------------------------------------------------


def _flip(data: bytes, position: int) -> bytes:
    return data[:position] + bytes([data[position] ^ 0x01]) + data[position + 1 :]


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


# --- keys: unavailable, misconfigured -----------------------------------------------------------


# --- classify -----------------------------------------------------------------------------------


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

