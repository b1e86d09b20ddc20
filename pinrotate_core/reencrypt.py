"""What to write for one batch, computed without a database (pure functions, testable alone).

Input: the selected rows as the database returned them. Output: the new ciphertexts per column
and the rows that failed. Every new ciphertext is decrypted again and compared with the plaintext
before it is handed back; a mismatch raises, so the batch can never commit a value we cannot read.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import CiphertextInvalid, KeyUnavailable, VerificationFailed
from .formats.aesgcm import AesGcmCipherSet, ColumnEncoding, random_nonces

DECRYPT_FAILED = "decrypt_failed"


@dataclass(frozen=True)
class FailedRow:
    """A row left unchanged. Carries locations only: never a value."""

    target: str
    id: str
    columns: tuple[str, ...]
    reason: str = DECRYPT_FAILED

    def as_dict(self) -> dict[str, Any]:
        return {"target": self.target, "id": self.id, "columns": list(self.columns), "reason": self.reason}


@dataclass
class BatchPlan:
    """Rows to update (``ids`` with one list of new values per cipher column) and failed rows."""

    ids: list[Any] = field(default_factory=list)
    new_values: list[list[Any]] = field(default_factory=list)
    failed: list[FailedRow] = field(default_factory=list)
    skipped: int = 0  # rows already known to fail in this run, not tried again

    @property
    def reencrypted(self) -> int:
        return len(self.ids)


def plan_aesgcm_batch(
    target: str,
    columns: Sequence[str],
    encodings: Sequence[ColumnEncoding],
    rows: Sequence[Sequence[Any]],
    ciphers: AesGcmCipherSet,
    *,
    known_failed: Collection[str] = (),
) -> BatchPlan:
    """Re-encrypt ``rows`` = ``(id, key_version, *cipher_columns)`` under the current key.

    A key missing from the keyring raises KeyUnavailable (the caller rolls the whole batch back);
    a value that does not decrypt marks its row FAILED and leaves it unchanged. NULL stays NULL.
    """
    plan = BatchPlan(new_values=[[] for _ in columns])
    current = ciphers.keyring.current
    target_cipher = ciphers.cipher(current)
    raw = [enc is ColumnEncoding.BYTEA for enc in encodings]
    nonces = random_nonces(len(rows) * len(columns))
    n = 0
    for row in rows:
        row_id = row[0]
        if known_failed and str(row_id) in known_failed:
            plan.skipped += 1
            continue
        source = ciphers.cipher(str(row[1]))  # KeyUnavailable here: the whole batch rolls back
        new_row: list[Any] = []
        bad: list[str] = []
        for j, stored in enumerate(row[2:]):
            if stored is None:
                new_row.append(None)
                continue
            nonce = nonces[n]
            n += 1
            try:
                blob = stored if raw[j] else encodings[j].to_bytes(stored)
                fresh = source.reencrypt_into(target_cipher, blob, nonce)
            except CiphertextInvalid:
                bad.append(columns[j])
                continue
            except VerificationFailed:
                raise KeyUnavailable(
                    f"target {target}: a value re-encrypted under key {current} did not verify", retryable=False
                ) from None
            new_row.append(fresh if raw[j] else encodings[j].from_bytes(fresh))
        if bad:
            plan.failed.append(FailedRow(target, str(row_id), tuple(bad)))
            continue
        plan.ids.append(row_id)
        for values, value in zip(plan.new_values, new_row):
            values.append(value)
    return plan
