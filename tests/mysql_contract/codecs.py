"""The tests' own encryptors and readers, written here with ``cryptography`` directly (never
pinrotate's encoders), byte for byte as contract §2 describes the formats. TEST KEYS ONLY.

- ``aesgcm``: nonce(12) || AES-GCM ciphertext || tag(16), no associated data; base64 in text columns.
- Forge: ``FPC1:<SM4|AES>:<keyId>:<payload>``, payload = base64 (or hex) of SM4/AES in ECB mode with
  PKCS#7 padding over the UTF-8 plaintext (hutool's defaults); legacy = the bare payload.
"""

from __future__ import annotations

import base64
import hashlib
import secrets

from cryptography.hazmat.primitives import padding
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM


def fixed_test_key(label: str, length: int = 16) -> bytes:
    """A key that is the same in every test and every run for one label.

    Only for the Forge legacy key, whose id (``legacy``) cannot be made unique per test: pinrotate
    records a check value per key id (contract §6, "Key identity"), and on MySQL its ``pinrotate``
    schema is a database of the whole server, shared by every test database on it.
    """
    return hashlib.sha256(f"pinrotate mysql_contract TEST KEY {label}".encode()).digest()[:length]


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


# --- aesgcm ------------------------------------------------------------------------------------------


def gcm_encrypt(key: bytes, plaintext: bytes) -> bytes:
    nonce = secrets.token_bytes(12)
    return nonce + AESGCM(key).encrypt(nonce, plaintext, None)


def gcm_decrypt(key: bytes, blob: bytes) -> bytes:
    """Raises cryptography's InvalidTag when ``blob`` is not under ``key``."""
    assert len(blob) >= 12 + 16, "shorter than nonce + tag"
    return AESGCM(key).decrypt(blob[:12], blob[12:], None)


def gcm_text(key: bytes, plaintext: bytes) -> str:
    """What an application stores in a text column: standard base64 with padding."""
    return b64(gcm_encrypt(key, plaintext))


def gcm_read_text(key: bytes, text: str) -> bytes:
    return gcm_decrypt(key, base64.b64decode(text, validate=True))


# --- Forge (fpc1 and legacy) -------------------------------------------------------------------------


def _ecb(algorithm: str, key: bytes) -> Cipher[modes.ECB]:
    assert algorithm in ("SM4", "AES"), algorithm
    return Cipher(algorithms.SM4(key) if algorithm == "SM4" else algorithms.AES(key), modes.ECB())


def forge_payload(algorithm: str, key: bytes, text: str) -> bytes:
    padder = padding.PKCS7(128).padder()
    enc = _ecb(algorithm, key).encryptor()
    return enc.update(padder.update(text.encode("utf-8")) + padder.finalize()) + enc.finalize()


def forge_legacy(algorithm: str, key: bytes, text: str) -> str:
    """A value as Forge wrote it before write-versioned: the bare base64 payload."""
    return b64(forge_payload(algorithm, key, text))


def forge_fpc1(algorithm: str, key_id: str, key: bytes, text: str, *, code: str | None = None,
               hex_payload: bool = False) -> str:
    """``FPC1:<code>:<keyId>:<payload>``; ``code`` as Forge may have stored it (e.g. lower case)."""
    raw = forge_payload(algorithm, key, text)
    return f"FPC1:{code or algorithm}:{key_id}:{raw.hex() if hex_payload else b64(raw)}"


def forge_decrypt(algorithm: str, key: bytes, payload: str) -> str:
    """Forge's decryptStr: the payload as base64 (or hex), ECB, PKCS#7, UTF-8; raises on any misfit."""
    # hutool's SecureUtil.decode: hex when every character is a hex digit, else base64.
    if payload and len(payload) % 2 == 0 and all(c in "0123456789abcdefABCDEF" for c in payload):
        raw = bytes.fromhex(payload)
    else:
        raw = base64.b64decode(payload, validate=True)
    dec = _ecb(algorithm, key).decryptor()
    padded = dec.update(raw) + dec.finalize()
    unpadder = padding.PKCS7(128).unpadder()
    return (unpadder.update(padded) + unpadder.finalize()).decode("utf-8")


def forge_reads(stored: str, keys: dict[str, bytes]) -> tuple[str, str, str]:
    """(algorithm, key id, plaintext) as Forge's PersistentCryptoService reads a value that
    pinrotate wrote: it must be a complete FPC1 value with an upper-case algorithm code and a
    base64 payload (what Forge's reencrypt writes), under a key of ``keys``."""
    parts = stored.split(":", 3)
    assert len(parts) == 4 and parts[0] == "FPC1", "not an FPC1 value"
    algorithm, key_id, payload = parts[1], parts[2], parts[3]
    assert algorithm in ("SM4", "AES"), f"algorithm code {algorithm!r} is not what Forge writes"
    assert key_id in keys, f"key id {key_id!r} is not one of {sorted(keys)}"
    base64.b64decode(payload, validate=True)  # written as base64 with padding, never hex
    return algorithm, key_id, forge_decrypt(algorithm, keys[key_id], payload)
