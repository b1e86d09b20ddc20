"""Generate pinrotate's known-answer vectors (contract §2). TEST KEYS ONLY.

Every key in this file is a fixed, public, made-up TEST key. Never use one for real data.

The aesgcm values are computed straight from ``cryptography`` (AESGCM), the fpc1 values (SM4 and
AES in ECB with PKCS#7, Forge's format) by the ``openssl`` command line tool, deliberately NOT
through pinrotate, so the vectors are an independent check of pinrotate's formats. Deterministic: re-running gives byte-identical files.

    python tests/vectors/generate.py          # (re)write the JSON files next to this script
    python tests/vectors/generate.py --check  # exit 1 if the files differ from what it would write
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

HERE = Path(__file__).resolve().parent
TEST_KEYS_NOTICE = "TEST KEYS ONLY: every key here is public and made up; never use one for real data."

# --- TEST keys (public, made up) -------------------------------------------------------------
TEST_KEY_128 = bytes(range(0x10))  # 000102...0f
TEST_KEY_256 = bytes(range(0x20))  # 000102...1f
TEST_KEY_128_B = bytes(range(0xF0, 0x100))  # f0f1...ff, a second fpc1 key

# --- plaintexts ------------------------------------------------------------------------------
ONE_KIB = bytes((i * 7 + 3) % 256 for i in range(1024))  # 1024 bytes, every byte value present

# fpc1 plaintexts are text (Forge encrypts strings): every one valid UTF-8.
TEXT_PLAINTEXTS: list[tuple[str, bytes]] = [
    ("empty", b""),
    ("ascii", b"Ivanov"),
    ("one-block", b"0123456789abcdef"),  # exactly 16 bytes: a full PKCS#7 padding block in ECB
    ("utf8", "Иванов Пётр, 张伟, Ærøskøbing 🙂".encode()),
    ("1kib", ("jdbc-password-" * 80)[:1024].encode()),
]

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


def openssl_ecb(algorithm: str, key: bytes, plaintext: bytes) -> bytes:
    """SM4 or AES in ECB with PKCS#7 padding, computed by the openssl command line tool (its
    default padding is PKCS#7): an implementation independent of pinrotate's code."""
    cipher = {"SM4": "-sm4-ecb", "AES": f"-aes-{len(key) * 8}-ecb"}[algorithm]
    done = subprocess.run(["openssl", "enc", "-e", cipher, "-K", key.hex(), "-nosalt"], input=plaintext,
                          capture_output=True, check=True)
    return done.stdout


def fpc1_vectors() -> dict[str, Any]:
    vectors = []
    for algorithm in ("SM4", "AES"):
        for key_id, key in (("k2025-01", TEST_KEY_128), ("test_key-B", TEST_KEY_128_B)):
            for pt_name, plaintext in TEXT_PLAINTEXTS:
                payload = openssl_ecb(algorithm, key, plaintext)
                vectors.append(
                    {
                        "id": f"fpc1-{algorithm.lower()}-{key_id}-{pt_name}",
                        "algorithm": algorithm,
                        "key_id": key_id,
                        "key_hex": key.hex(),
                        "key_base64": _b64(key),
                        "plaintext_hex": plaintext.hex(),
                        "expected": f"FPC1:{algorithm}:{key_id}:{_b64(payload)}",
                        "legacy": _b64(payload),
                        "legacy_hex": payload.hex(),
                    }
                )
    return {
        **_header(
            "fpc1",
            "Forge's FPC1:<SM4|AES>:<keyId>:<payload>, payload = standard base64 (with padding) of "
            "SM4 or AES in ECB mode with PKCS#7 padding over the UTF-8 plaintext, 16-byte keys; "
            "'legacy' is the same value as Forge writes it without the header (write-versioned = "
            "false), 'legacy_hex' its hex form (Forge's decryptStr reads both). Computed with the "
            "openssl command line tool.",
        ),
        "vectors": vectors,
    }


def fpc1_invalid_vectors() -> dict[str, Any]:
    """Strings Forge classifies UNKNOWN (``PersistentCiphertext.inspect``): never decrypted."""
    payload = _b64(openssl_ecb("SM4", TEST_KEY_128, b"x"))
    good = f"FPC1:SM4:k2025-01:{payload}"
    cases = [
        ("missing-payload", "FPC1:SM4:k2025-01"),
        ("empty-payload", "FPC1:SM4:k2025-01:"),
        ("blank-payload", "FPC1:SM4:k2025-01:   "),
        ("gcm-algorithm", "FPC1:AES-GCM:k2025-01:" + payload),
        ("sm4-gcm-algorithm", "FPC1:SM4-GCM:k2025-01:" + payload),
        ("unknown-algorithm", "FPC1:DES:k2025-01:" + payload),
        ("empty-algorithm", "FPC1::k2025-01:" + payload),
        ("empty-key-id", "FPC1:SM4::" + payload),
        ("key-id-33-chars", "FPC1:SM4:" + "k" * 33 + ":" + payload),
        ("key-id-with-dot", "FPC1:SM4:k2025.01:" + payload),
        ("key-id-with-space", "FPC1:SM4:k 1:" + payload),
        ("header-only", "FPC1:"),
        ("three-parts", "FPC1:SM4:" + payload),
    ]
    return {
        **_header(
            "fpc1",
            "Strings Forge classifies UNKNOWN (another algorithm, an illegal key id, an empty "
            "payload, an incomplete header): never decrypted, never rewritten. 'valid' is one "
            "well-formed value they were derived from.",
        ),
        "valid": good,
        "vectors": [{"id": name, "stored": stored} for name, stored in cases],
    }


# Published vectors with a 96-bit IV and NO associated data, copied from their sources (not
# computed here); the tests check them against pinrotate's formats too.
PUBLISHED: dict[str, Any] = {
    "format": "published",
    "description": (
        "Published AES-GCM test vectors with a 96-bit IV and empty AAD. As stored values: "
        "aesgcm bytea = iv || ciphertext || tag."
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
    ],
}


# Published single-block vectors of the two block ciphers fpc1 uses, copied from their standards
# (not computed here). ECB of one block is the raw cipher: pinrotate's PKCS#7 output for such a
# plaintext starts with these 16 bytes.
PUBLISHED_ECB: dict[str, Any] = {
    "format": "published",
    "description": "Published SM4 and AES block cipher vectors (one block, ECB, no padding).",
    "vectors": [
        {"id": "gbt-32907-sm4-example-1", "source": "GB/T 32907-2016, Appendix A, example 1",
         "algorithm": "SM4", "key_hex": "0123456789abcdeffedcba9876543210",
         "plaintext_hex": "0123456789abcdeffedcba9876543210", "ciphertext_hex": "681edf34d206965e86b3e94f536e4246"},
        {"id": "fips-197-c1-aes-128", "source": "FIPS-197, Appendix C.1", "algorithm": "AES",
         "key_hex": "000102030405060708090a0b0c0d0e0f", "plaintext_hex": "00112233445566778899aabbccddeeff",
         "ciphertext_hex": "69c4e0d86a7b0430d8cdb78070b4c55a"},
        {"id": "fips-197-c2-aes-192", "source": "FIPS-197, Appendix C.2", "algorithm": "AES",
         "key_hex": "000102030405060708090a0b0c0d0e0f1011121314151617",
         "plaintext_hex": "00112233445566778899aabbccddeeff", "ciphertext_hex": "dda97ca4864cdfe06eaf70a0ec0d7191"},
        {"id": "fips-197-c3-aes-256", "source": "FIPS-197, Appendix C.3", "algorithm": "AES",
         "key_hex": "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f",
         "plaintext_hex": "00112233445566778899aabbccddeeff", "ciphertext_hex": "8ea2b7ca516745bfeafc49904b496089"},
        {"id": "sp-800-38a-f11-ecb-aes128-block1", "source": "NIST SP 800-38A, F.1.1 ECB-AES128.Encrypt, block 1",
         "algorithm": "AES", "key_hex": "2b7e151628aed2a6abf7158809cf4f3c",
         "plaintext_hex": "6bc1bee22e409f96e93d7e117393172a", "ciphertext_hex": "3ad77bb40d7a3660a89ecaf32466ef97"},
        {"id": "sp-800-38a-f11-ecb-aes128-block2", "source": "NIST SP 800-38A, F.1.1 ECB-AES128.Encrypt, block 2",
         "algorithm": "AES", "key_hex": "2b7e151628aed2a6abf7158809cf4f3c",
         "plaintext_hex": "ae2d8a571e03ac9c9eb76fac45af8e51", "ciphertext_hex": "f5d3d58503b9699de785895a96fdbaaf"},
    ],
}


def build_all() -> dict[str, dict[str, Any]]:
    """File name -> document, exactly as written to disk."""
    return {
        "aesgcm.json": aesgcm_vectors(),
        "fpc1.json": fpc1_vectors(),
        "fpc1_invalid.json": fpc1_invalid_vectors(),
        "published_gcm.json": PUBLISHED,
        "published_ecb.json": PUBLISHED_ECB,
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
