"""Forge's FPC1 format (contract §2), value by value: known answers, Forge's classification, the
checks an ECB value has. TEST KEYS ONLY.

The vectors in tests/vectors/fpc1.json were computed by the openssl command line tool
(tests/vectors/generate.py); published_ecb.json holds the GB/T 32907 SM4 example and FIPS-197 /
SP 800-38A AES blocks. Nothing here computes an expected value through pinrotate.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest

from pinrotate_core._primitives import EcbPkcs7, PaddingInvalid
from pinrotate_core.errors import CiphertextInvalid, ConfigError, KeyUnavailable
from pinrotate_core.keyring import Key, Keyring
from pinrotate_core.schemes.fpc1_values import Fpc1CipherSet, classify, classify_value, parse_fpc1, values_of_column

VECTORS = Path(__file__).parent / "vectors"


def _vectors(name: str) -> list[Any]:
    return [pytest.param(v, id=v["id"]) for v in json.loads((VECTORS / name).read_text(encoding="utf-8"))["vectors"]]


def _ring(current: str, keys: dict[str, bytes], legacy: bytes | None = None) -> Keyring:
    return Keyring(current=current, keys={k: Key(k, m) for k, m in keys.items()}, source="test keyring",
                   legacy=Key("legacy", legacy) if legacy is not None else None)


@pytest.mark.parametrize("vector", _vectors("published_ecb.json"))
def test_sm4_and_aes_match_the_published_block_vectors(vector: dict[str, Any]) -> None:
    cipher = EcbPkcs7(vector["algorithm"], bytes.fromhex(vector["key_hex"]))
    plaintext = bytes.fromhex(vector["plaintext_hex"])
    out = cipher.encrypt(plaintext)
    assert len(out) == 32 and out[:16].hex() == vector["ciphertext_hex"]  # one block + a full padding block
    assert cipher.decrypt(out) == plaintext


@pytest.mark.parametrize("vector", _vectors("fpc1.json"))
def test_fpc1_vector_reads_and_is_written_byte_exact(vector: dict[str, Any]) -> None:
    key = bytes.fromhex(vector["key_hex"])
    plaintext = bytes.fromhex(vector["plaintext_hex"])
    ciphers = Fpc1CipherSet(_ring(vector["key_id"], {vector["key_id"]: key}, legacy=key), legacy_read_enabled=True)
    assert ciphers.decrypt(vector["expected"]) == plaintext
    assert ciphers.encrypt_current(vector["algorithm"], plaintext) == vector["expected"]
    # Forge's legacy form: the same payload without the header, base64 or hex, with the column's algorithm.
    assert ciphers.decrypt(vector["legacy"], vector["algorithm"]) == plaintext
    assert ciphers.decrypt(vector["legacy_hex"], vector["algorithm"]) == plaintext
    assert ciphers.reencrypt_to_current(vector["legacy"], vector["algorithm"]) == vector["expected"]
    # Forge reads the algorithm code in any case, and writes it upper case.
    lower = vector["expected"].replace(f":{vector['algorithm']}:", f":{vector['algorithm'].lower()}:", 1)
    assert ciphers.decrypt(lower) == plaintext
    found = classify(vector["expected"])
    assert (found.kind, found.key_id, found.algorithm) == ("fpc1", vector["key_id"], vector["algorithm"])
    assert classify(vector["legacy"]).kind == "legacy-candidate"


@pytest.mark.parametrize("vector", _vectors("fpc1_invalid.json"))
def test_values_forge_calls_unknown_are_unknown_and_never_decrypted(vector: dict[str, Any]) -> None:
    stored = vector["stored"]
    assert classify(stored).kind == "unknown"
    with pytest.raises(CiphertextInvalid) as e:
        parse_fpc1(stored)
    assert stored.rsplit(":", 1)[-1] not in str(e.value) or len(stored.rsplit(":", 1)[-1]) < 8
    ring = _ring("k2025-01", {"k2025-01": bytes(range(16))})
    assert classify_value(stored, ring).category == "UNKNOWN"


def test_the_valid_value_behind_the_invalid_vectors_parses() -> None:
    valid = json.loads((VECTORS / "fpc1_invalid.json").read_text(encoding="utf-8"))["valid"]
    assert parse_fpc1(valid).key_id == "k2025-01"


def test_forge_categories_active_historical_unknown_key_legacy_and_blank() -> None:
    ring = _ring("k2", {"k1": bytes(16), "k2": bytes(range(16))})
    payload = base64.b64encode(EcbPkcs7("SM4", bytes(16)).encrypt(b"pw")).decode()
    assert classify_value(f"FPC1:SM4:k2:{payload}", ring).category == "ACTIVE"
    assert classify_value(f"FPC1:AES:k1:{payload}", ring).category == "HISTORICAL"
    assert classify_value(f"FPC1:SM4:k9:{payload}", ring).category == "UNKNOWN_KEY"
    assert classify_value(payload, ring).category == "LEGACY"
    assert classify_value("plain text someone left", ring).category == "UNKNOWN"
    # NULL and blank strings are no ciphertexts: no value at all.
    for text in (None, "", "   ", "\t\n"):
        assert values_of_column("c", (), text) == []


def test_a_wrong_key_fails_padding_or_utf8_and_says_so() -> None:
    right, wrong = bytes(range(16)), bytes(range(1, 17))
    ciphers = Fpc1CipherSet(_ring("k1", {"k1": wrong}))
    value = "FPC1:SM4:k1:" + base64.b64encode(EcbPkcs7("SM4", right).encrypt("张伟 0123456789".encode())).decode()
    with pytest.raises(PaddingInvalid) as e:
        ciphers.decrypt(value)
    assert "FPC1" not in str(e.value)


def test_a_misshapen_payload_is_invalid_but_not_a_padding_failure() -> None:
    ciphers = Fpc1CipherSet(_ring("k1", {"k1": bytes(16)}))
    for stored in ("FPC1:SM4:k1:QUJD", "FPC1:SM4:k1:abc", "FPC1:AES:k1:!!!!"):
        with pytest.raises(CiphertextInvalid) as e:
            ciphers.decrypt(stored)
        assert not isinstance(e.value, PaddingInvalid)


def test_keys_the_keyring_lacks_or_legacy_reading_off_are_key_unavailable() -> None:
    ciphers = Fpc1CipherSet(_ring("k1", {"k1": bytes(16)}, legacy=bytes(16)))
    payload = base64.b64encode(EcbPkcs7("SM4", bytes(16)).encrypt(b"x")).decode()
    with pytest.raises(KeyUnavailable):
        ciphers.decrypt(f"FPC1:SM4:k9:{payload}")
    with pytest.raises(KeyUnavailable):
        ciphers.decrypt(payload)  # legacy reading is off


def test_an_aes_transport_key_of_32_bytes_reads_aes_legacy_values() -> None:
    transport = bytes(range(32))
    ciphers = Fpc1CipherSet(_ring("k1", {"k1": bytes(16)}, legacy=transport), legacy_read_enabled=True)
    legacy = base64.b64encode(EcbPkcs7("AES", transport).encrypt(b"secret")).decode()
    assert ciphers.decrypt(legacy, "AES") == b"secret"
    with pytest.raises(KeyUnavailable):  # SM4 takes 16-byte keys only
        ciphers.decrypt(legacy, "SM4")


@pytest.mark.parametrize("length", [24, 32])
def test_persistent_fpc1_keys_must_be_16_bytes(length: int) -> None:
    with pytest.raises(ConfigError, match="k1"):
        Fpc1CipherSet(_ring("k1", {"k1": bytes(length)}))


def test_reprs_show_no_key() -> None:
    key = bytes(range(16))
    assert key.hex() not in repr(EcbPkcs7("SM4", key))
    assert "payload=<" in repr(parse_fpc1("FPC1:SM4:k1:" + base64.b64encode(bytes(16)).decode()))
