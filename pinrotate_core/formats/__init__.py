"""Ciphertext formats, byte-exact (contract §2): other programs write and read these values.

- ``aesgcm``: nonce(12) || ciphertext || tag(16); raw in ``bytea``, base64 in text columns;
  the key is named by the row's key-version column.
- ``fpc1`` (self-describing) and the read-only legacy forms: see ``formats.fpc1``.
- ``vault-transit``: ``vault:v<N>:<base64>``, see ``formats.transit``.
"""

from .aesgcm import AesGcmCipherSet, ColumnEncoding

__all__ = ["AesGcmCipherSet", "ColumnEncoding"]
