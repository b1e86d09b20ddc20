"""Generate pinrotate's known-answer vectors (contract §2). TEST KEYS ONLY.

Every key in this file is a fixed, public, made-up TEST key. Never use one for real data.

The expected values are computed straight from ``cryptography`` (AESGCM, Cipher(SM4, GCM),
Cipher(AES, ECB) + PKCS7), deliberately NOT through pinrotate, so the vectors are an independent
check of pinrotate's formats. Deterministic: re-running gives byte-identical files.

    python tests/vectors/generate.py          # (re)write the JSON files next to this script
    python tests/vectors/generate.py --check  # exit 1 if the files differ from what it would write
"""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import padding
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

HERE = Path(__file__).resolve().parent
TEST_KEYS_NOTICE = "TEST KEYS ONLY: every key here is public and made up; never use one for real data."

# --- TEST keys (public, made up) -------------------------------------------------------------
TEST_KEY_128 = bytes(range(0x10))  # 000102...0f
TEST_KEY_256 = bytes(range(0x20))  # 000102...1f
TEST_KEY_128_B = bytes(range(0xF0, 0x100))  # f0f1...ff, a second fpc1 key
TEST_LEGACY_KEY_128 = bytes.fromhex("2b7e151628aed2a6abf7158809cf4f3c")  # FIPS-197 example key
TEST_LEGACY_KEY_256 = bytes(range(0x20, 0x40))

# --- plaintexts ------------------------------------------------------------------------------
ONE_KIB = bytes((i * 7 + 3) % 256 for i in range(1024))  # 1024 bytes, every byte value present

PLAINTEXTS: list[tuple[str, bytes]] = [
    ("empty", b""),
    ("ascii", b"Ivanov"),
    ("one-block", b"0123456789abcdef"),  # exactly 16 bytes: a full PKCS#7 padding block in ECB
    ("utf8", "Иванов Пётр, 张伟, Ærøskøbing 🙂".encode()),
    ("1kib", ONE_KIB),
]


def _nonce(counter: int) -> bytes:
    # A distinct fixed nonce per vector (never reused under one key across the files).
    return bytes.fromhex("cafe0000") + counter.to_bytes(8, "big")


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _aes_gcm(key: bytes, nonce: bytes, plaintext: bytes) -> bytes:
    return nonce + AESGCM(key).encrypt(nonce, plaintext, None)


def _sm4_gcm(key: bytes, nonce: bytes, plaintext: bytes) -> bytes:
    enc = Cipher(algorithms.SM4(key), modes.GCM(nonce)).encryptor()
    body = enc.update(plaintext) + enc.finalize()
    return nonce + body + enc.tag


def _aes_ecb_pkcs7(key: bytes, plaintext: bytes) -> bytes:
    padder = padding.PKCS7(128).padder()
    padded = padder.update(plaintext) + padder.finalize()
    enc = Cipher(algorithms.AES(key), modes.ECB()).encryptor()
    return enc.update(padded) + enc.finalize()


def _header(fmt: str, description: str) -> dict[str, Any]:
    return {"format": fmt, "notice": TEST_KEYS_NOTICE, "description": description}


def aesgcm_vectors() -> dict[str, Any]:
    vectors = []
    counter = 0
    for key_name, key in (("128", TEST_KEY_128), ("256", TEST_KEY_256)):
        for pt_name, plaintext in PLAINTEXTS:
            counter += 1
            nonce = _nonce(counter)
            blob = _aes_gcm(key, nonce, plaintext)
            vectors.append(
                {
                    "id": f"aesgcm-{key_name}-{pt_name}",
                    "key_hex": key.hex(),
                    "key_base64": _b64(key),
                    "nonce_hex": nonce.hex(),
                    "plaintext_hex": plaintext.hex(),
                    "expected_bytea_hex": blob.hex(),
                    "expected_text": _b64(blob),
                }
            )
    return {
        **_header(
            "aesgcm",
            "Row-versioned aesgcm: nonce(12) || ciphertext || tag(16), AES-GCM, no associated data. "
            "expected_bytea_hex is what a bytea column holds; expected_text what a text column holds "
            "(standard base64 with padding of the same bytes).",
        ),
        "vectors": vectors,
    }


def fpc1_vectors() -> dict[str, Any]:
    vectors = []
    counter = 100
    for algorithm, encrypt in (("AES-GCM", _aes_gcm), ("SM4-GCM", _sm4_gcm)):
        for key_id, key in (("k2025-01", TEST_KEY_128), ("test_key-B", TEST_KEY_128_B)):
            for pt_name, plaintext in PLAINTEXTS:
                counter += 1
                nonce = _nonce(counter)
                payload = encrypt(key, nonce, plaintext)
                vectors.append(
                    {
                        "id": f"fpc1-{algorithm.lower()}-{key_id}-{pt_name}",
                        "algorithm": algorithm,
                        "key_id": key_id,
                        "key_hex": key.hex(),
                        "key_base64": _b64(key),
                        "nonce_hex": nonce.hex(),
                        "plaintext_hex": plaintext.hex(),
                        "expected": f"FPC1:{algorithm}:{key_id}:{_b64(payload)}",
                    }
                )
    return {
        **_header(
            "fpc1",
            "Self-describing FPC1:<algorithm>:<keyId>:<payload>, payload = standard base64 (with "
            "padding) of nonce(12) || ciphertext || tag(16), no associated data, 16-byte keys.",
        ),
        "vectors": vectors,
    }


def fpc1_invalid_vectors() -> dict[str, Any]:
    good = f"FPC1:AES-GCM:k2025-01:{_b64(_aes_gcm(TEST_KEY_128, _nonce(999), b'x'))}"
    payload = good.rsplit(":", 1)[1]
    short = _b64(bytes(27))
    cases = [
        ("lowercase-prefix", "fpc1:AES-GCM:k2025-01:" + payload),
        ("other-version", "FPC2:AES-GCM:k2025-01:" + payload),
        ("missing-payload", "FPC1:AES-GCM:k2025-01"),
        ("empty-payload", "FPC1:AES-GCM:k2025-01:"),
        ("unknown-algorithm", "FPC1:AES-CBC:k2025-01:" + payload),
        ("lowercase-algorithm", "FPC1:aes-gcm:k2025-01:" + payload),
        ("empty-key-id", "FPC1:AES-GCM::" + payload),
        ("key-id-33-chars", "FPC1:AES-GCM:" + "k" * 33 + ":" + payload),
        ("key-id-with-dot", "FPC1:AES-GCM:k2025.01:" + payload),
        ("key-id-with-space", "FPC1:AES-GCM:k 1:" + payload),
        ("payload-without-padding", "FPC1:AES-GCM:k2025-01:" + payload.rstrip("=")),
        ("payload-url-safe-alphabet", "FPC1:AES-GCM:k2025-01:" + base64.urlsafe_b64encode(bytes.fromhex("fbffbf") * 10).decode()),
        ("payload-with-newline", "FPC1:AES-GCM:k2025-01:" + payload + "\n"),
        ("payload-with-colon", "FPC1:AES-GCM:k2025-01:" + payload + ":AAAA"),
        ("payload-shorter-than-nonce-and-tag", "FPC1:AES-GCM:k2025-01:" + short),
        ("no-prefix-at-all", "AES-GCM:k2025-01:" + payload),
    ]
    return {
        **_header(
            "fpc1",
            "Strings that must NOT parse as FPC1 (reader must reject them before any decryption). "
            "'valid' is one well-formed value they were derived from.",
        ),
        "valid": good,
        "vectors": [{"id": name, "stored": stored} for name, stored in cases],
    }


def legacy_vectors() -> dict[str, Any]:
    vectors: list[dict[str, Any]] = []
    counter = 200
    for key_name, key in (("128", TEST_LEGACY_KEY_128), ("256", TEST_LEGACY_KEY_256)):
        for pt_name, plaintext in PLAINTEXTS:
            counter += 1
            nonce = _nonce(counter)
            vectors.append(
                {
                    "id": f"legacy-aesgcm-b64-{key_name}-{pt_name}",
                    "legacy_format": "aesgcm-b64",
                    "key_hex": key.hex(),
                    "key_base64": _b64(key),
                    "nonce_hex": nonce.hex(),
                    "plaintext_hex": plaintext.hex(),
                    "expected": _b64(_aes_gcm(key, nonce, plaintext)),
                }
            )
            vectors.append(
                {
                    "id": f"legacy-aes-ecb-b64-{key_name}-{pt_name}",
                    "legacy_format": "aes-ecb-b64",
                    "key_hex": key.hex(),
                    "key_base64": _b64(key),
                    "nonce_hex": None,
                    "plaintext_hex": plaintext.hex(),
                    "expected": _b64(_aes_ecb_pkcs7(key, plaintext)),
                }
            )
    return {
        **_header(
            "legacy",
            "Read-only legacy values of fpc1 targets, under the legacy key. aesgcm-b64: base64 of "
            "nonce(12) || ciphertext || tag(16), AES-GCM sized by the key. aes-ecb-b64: base64 of "
            "AES-ECB with PKCS#7 padding (no nonce). pinrotate only ever decrypts these.",
        ),
        "vectors": vectors,
    }


# Published vectors with a 96-bit IV and NO associated data, copied from their sources (not
# computed here); the tests check them against pinrotate's formats too.
PUBLISHED: dict[str, Any] = {
    "format": "published",
    "description": (
        "Published AES-GCM and SM4-GCM test vectors with a 96-bit IV and empty AAD. As stored "
        "values: aesgcm bytea = iv || ciphertext || tag; fpc1 payload = the same bytes (16-byte "
        "keys only)."
    ),
    "vectors": [
        {
            "id": "gcm-spec-test-case-1",
            "source": "McGrew & Viega, The Galois/Counter Mode of Operation (GCM), 2005, Appendix B, Test Case 1",
            "algorithm": "AES-GCM",
            "key_hex": "00000000000000000000000000000000",
            "nonce_hex": "000000000000000000000000",
            "plaintext_hex": "",
            "ciphertext_hex": "",
            "tag_hex": "58e2fccefa7e3061367f1d57a4e7455a",
        },
        {
            "id": "gcm-spec-test-case-2",
            "source": "McGrew & Viega, The Galois/Counter Mode of Operation (GCM), 2005, Appendix B, Test Case 2",
            "algorithm": "AES-GCM",
            "key_hex": "00000000000000000000000000000000",
            "nonce_hex": "000000000000000000000000",
            "plaintext_hex": "00000000000000000000000000000000",
            "ciphertext_hex": "0388dace60b6a392f328c2b971b2fe78",
            "tag_hex": "ab6e47d42cec13bdf53a67b21257bddf",
        },
        {
            "id": "gcm-spec-test-case-3",
            "source": "McGrew & Viega, The Galois/Counter Mode of Operation (GCM), 2005, Appendix B, Test Case 3",
            "algorithm": "AES-GCM",
            "key_hex": "feffe9928665731c6d6a8f9467308308",
            "nonce_hex": "cafebabefacedbaddecaf888",
            "plaintext_hex": (
                "d9313225f88406e5a55909c5aff5269a86a7a9531534f7da2e4c303d8a318a72"
                "1c3c0c95956809532fcf0e2449a6b525b16aedf5aa0de657ba637b391aafd255"
            ),
            "ciphertext_hex": (
                "42831ec2217774244b7221b784d0d49ce3aa212f2c02a4e035c17e2329aca12e"
                "21d514b25466931c7d8f6a5aac84aa051ba30b396a0aac973d58e091473f5985"
            ),
            "tag_hex": "4d5c2af327cd64a62cf35abd2ba6fab4",
        },
        {
            "id": "gcm-spec-test-case-13",
            "source": "McGrew & Viega, The Galois/Counter Mode of Operation (GCM), 2005, Appendix B, Test Case 13",
            "algorithm": "AES-GCM",
            "key_hex": "0000000000000000000000000000000000000000000000000000000000000000",
            "nonce_hex": "000000000000000000000000",
            "plaintext_hex": "",
            "ciphertext_hex": "",
            "tag_hex": "530f8afbc74536b9a963b4f1c4cb738b",
        },
        {
            "id": "gcm-spec-test-case-14",
            "source": "McGrew & Viega, The Galois/Counter Mode of Operation (GCM), 2005, Appendix B, Test Case 14",
            "algorithm": "AES-GCM",
            "key_hex": "0000000000000000000000000000000000000000000000000000000000000000",
            "nonce_hex": "000000000000000000000000",
            "plaintext_hex": "00000000000000000000000000000000",
            "ciphertext_hex": "cea7403d4d606b6e074ec5d3baf39d18",
            "tag_hex": "d0d1c8a799996bf0265b98b5d48ab919",
        },
        {
            "id": "gcm-spec-test-case-15",
            "source": "McGrew & Viega, The Galois/Counter Mode of Operation (GCM), 2005, Appendix B, Test Case 15",
            "algorithm": "AES-GCM",
            "key_hex": "feffe9928665731c6d6a8f9467308308feffe9928665731c6d6a8f9467308308",
            "nonce_hex": "cafebabefacedbaddecaf888",
            "plaintext_hex": (
                "d9313225f88406e5a55909c5aff5269a86a7a9531534f7da2e4c303d8a318a72"
                "1c3c0c95956809532fcf0e2449a6b525b16aedf5aa0de657ba637b391aafd255"
            ),
            "ciphertext_hex": (
                "522dc1f099567d07f47f37a32a84427d643a8cdcbfe5c0c97598a2bd2555d1aa"
                "8cb08e48590dbb3da7b08b1056828838c5f61e6393ba7a0abcc9f662898015ad"
            ),
            "tag_hex": "b094dac5d93471bdec1a502270e3cc6c",
        },
        {
            "id": "wycheproof-sm4-gcm-tc2",
            "source": "Wycheproof testvectors_v1/sm4_gcm_test.json, tcId 2 (empty message, empty AAD)",
            "algorithm": "SM4-GCM",
            "key_hex": "bedcfb5a011ebc84600fcb296c15af0d",
            "nonce_hex": "438a547a94ea88dce46c6c85",
            "plaintext_hex": "",
            "ciphertext_hex": "",
            "tag_hex": "a486a45596cb92cf529de2038583707d",
        },
        {
            "id": "wycheproof-sm4-gcm-tc3",
            "source": "Wycheproof testvectors_v1/sm4_gcm_test.json, tcId 3 (1-byte message, empty AAD)",
            "algorithm": "SM4-GCM",
            "key_hex": "384ea416ac3c2f51a76e7d8226346d4e",
            "nonce_hex": "b30c084727ad1c592ac21d12",
            "plaintext_hex": "35",
            "ciphertext_hex": "a3",
            "tag_hex": "a06f50a378b116e9dd2363a6e8babd88",
        },
        {
            "id": "wycheproof-sm4-gcm-tc6",
            "source": "Wycheproof testvectors_v1/sm4_gcm_test.json, tcId 6 (16-byte message, empty AAD)",
            "algorithm": "SM4-GCM",
            "key_hex": "ffdf4228361ea1f8165852136b3480f7",
            "nonce_hex": "0e1666f2dc652f7708fb8f0d",
            "plaintext_hex": "25b12e28ac0ef6ead0226a3b2288c800",
            "ciphertext_hex": "f18ce821bdf23c0e74e84a235ae15926",
            "tag_hex": "dd82022d2589c111d2f780965bd4b7ea",
        },
        {
            "id": "wycheproof-sm4-gcm-tc13",
            "source": "Wycheproof testvectors_v1/sm4_gcm_test.json, tcId 13 (63-byte message, empty AAD)",
            "algorithm": "SM4-GCM",
            "key_hex": "bb571c160132b0c8d5d190d0bc356ddc",
            "nonce_hex": "2596c440cf0232950ec66bc4",
            "plaintext_hex": (
                "053be1b6190a717fc74c879e6fd62dc44628495507e50d662271dee795a4ad26"
                "e0c4f86cb6b20ac6bd9d682d2d8a05c9dad875a6911b49ea0af4f17c97a5f2"
            ),
            "ciphertext_hex": (
                "d02d6f100875eb876a1218e2282c7af496f9737e3653057074e28221b310d31a"
                "bb705c01c03133171615e19b658edb9cf7bcfd37c5ff3ff53d88f854b7ff01"
            ),
            "tag_hex": "9cc97f0b5ed2f18cb703f9f791fb77b5",
        },
    ],
}


def build_all() -> dict[str, dict[str, Any]]:
    """File name -> document, exactly as written to disk."""
    return {
        "aesgcm.json": aesgcm_vectors(),
        "fpc1.json": fpc1_vectors(),
        "fpc1_invalid.json": fpc1_invalid_vectors(),
        "legacy.json": legacy_vectors(),
        "published_gcm.json": PUBLISHED,
    }


def render(document: dict[str, Any]) -> str:
    return json.dumps(document, indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str]) -> int:
    check = "--check" in argv
    stale = []
    for name, document in build_all().items():
        path = HERE / name
        text = render(document)
        if check:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                stale.append(name)
        else:
            path.write_text(text, encoding="utf-8")
    if stale:
        print("out of date: " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
