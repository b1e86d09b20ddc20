"""One small error tree for pinrotate.

Library errors (psycopg, hvac, cryptography, pydantic) are translated at the boundary into these,
chained with ``raise ... from``. Messages name settings, targets, ids and columns, never a value.
"""

from __future__ import annotations

from collections.abc import Sequence


class PinrotateError(Exception):
    """Base of every error pinrotate raises on purpose."""


class ConfigError(PinrotateError):
    """A setting is missing or invalid, or a start was refused (exit code 2)."""


class RefusedToStart(ConfigError):
    """The run may not start as asked (write_versioned off, wrong expected key, ...)."""


class KeyUnavailable(PinrotateError):
    """A key could not be had from the provider: fail closed, roll back, stop the target.

    ``retryable`` tells the orchestrator whether trying again later can help (an outage, a
    timeout, a sealed server) or not (permission denied, a key version that does not exist).
    """

    def __init__(self, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


class CiphertextInvalid(PinrotateError):
    """A stored value does not decrypt (wrong key, tampered, truncated). Deliberately opaque."""


class TransitValuesInvalid(CiphertextInvalid):
    """Some values of a batch were refused by Transit (or are not ``vault:v<N>:`` at all).

    ``failed_positions`` are indexes into the batch given, so the caller can record those rows as
    FAILED and send the others again. The message holds counts and positions, never a value.
    """

    def __init__(self, message: str, failed_positions: Sequence[int]) -> None:
        super().__init__(message)
        self.failed_positions = tuple(failed_positions)


class VerificationFailed(PinrotateError):
    """A freshly written ciphertext did not decrypt to the same plaintext: nothing may be committed."""


class ConflictError(PinrotateError):
    """The application changed a value between our read and our write."""


class DatabaseError(PinrotateError):
    """The database failed in a way that rolled the open batch back."""


class DatabaseUnavailable(DatabaseError):
    """No connection to the database (down, unreachable, wrong user or database): exit code 4.

    ``retryable``: an outage may pass; a wrong user, password or database name will not.
    """

    def __init__(self, message: str, *, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable


class TargetBlocked(PinrotateError):
    """A target cannot be migrated as configured (missing table or column, no single key, ...)."""

    def __init__(self, target: str, reason: str) -> None:
        super().__init__(f"target {target}: {reason}")
        self.target = target
        self.reason = reason


class ThrottleCritical(PinrotateError):
    """A ``critical_*`` limit of the database's health was exceeded: the run stops fail-safe (exit 4).

    Raised between batches, so the open batch has committed or rolled back already.
    """
