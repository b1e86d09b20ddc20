"""Test and benchmark data through Transit: encrypt plaintexts, decrypt values to check them.

pinrotate itself never sees the plaintext of a vault-transit value (it only rewraps), so these live
with the tests, on the provider's ``batch_input`` requests (``provider.batches``).
"""

from __future__ import annotations

import base64
from collections.abc import Sequence

from pinrotate_core.errors import KeyUnavailable
from pinrotate_core.providers.vault import VaultTransitKeyProvider, transit_version_or_fail


def transit_encrypt(provider: VaultTransitKeyProvider, plaintexts: Sequence[bytes]) -> list[str]:
    """Encrypt under the latest version; order preserved."""
    if not plaintexts:
        return []
    results = provider.batches.run(
        "encrypt", [{"plaintext": base64.b64encode(p).decode("ascii")} for p in plaintexts], None,
        lambda c, batch: c.secrets.transit.encrypt_data(name=provider.key_name, batch_input=batch,
                                                        mount_point=provider.mount),
    )
    out: list[str] = []
    for pos, result in enumerate(results):
        value = result.get("ciphertext")
        if not isinstance(value, str):
            raise KeyUnavailable(f"{provider.description}: encrypt returned no value at position {pos}", retryable=False)
        transit_version_or_fail(value, provider.description)
        out.append(value)
    return out


def transit_decrypt(provider: VaultTransitKeyProvider, values: Sequence[str]) -> list[bytes]:
    """Decrypt (to check what a run wrote); order preserved."""
    if not values:
        return []
    versions = provider.batches.input_versions(values, "decrypt")
    results = provider.batches.run(
        "decrypt", [{"ciphertext": v} for v in values], versions,
        lambda c, batch: c.secrets.transit.decrypt_data(name=provider.key_name, ciphertext=None, batch_input=batch,
                                                        mount_point=provider.mount),
    )
    # Transit leaves the field out for an empty value; a bad one fails the test with binascii.Error.
    return [base64.b64decode(result.get("plaintext") or "", validate=True) for result in results]
