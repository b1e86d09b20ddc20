"""Ciphertext formats, byte-exact (contract §2): other programs write and read these values.

- ``aesgcm``: nonce(12) || ciphertext || tag(16); raw in ``bytea``, base64 in text columns;
  the key is named by the row's key-version column.
- ``fpc1`` (self-describing) and the read-only legacy forms: see ``formats.fpc1``.
- ``vault-transit``: ``vault:v<N>:<base64>``, see ``formats.transit``.
"""

from .aesgcm import AesGcmCipherSet, ColumnEncoding

__all__ = ["AesGcmCipherSet", "ColumnEncoding"]

from .fpc1 import (
    ALGORITHMS,
    Classification,
    Fpc1CipherSet,
    Fpc1Value,
    JsonPath,
    classify,
    extract_json_values,
    format_fpc1,
    get_json_path,
    json_values_in,
    parse_fpc1,
    parse_json_path,
    replace_json_values,
    set_json_path,
)
from .legacy import LEGACY_FORMATS, LegacyCipher, looks_like_legacy

__all__ += [
    "ALGORITHMS",
    "LEGACY_FORMATS",
    "Classification",
    "Fpc1CipherSet",
    "Fpc1Value",
    "JsonPath",
    "LegacyCipher",
    "classify",
    "extract_json_values",
    "format_fpc1",
    "get_json_path",
    "json_values_in",
    "looks_like_legacy",
    "parse_fpc1",
    "parse_json_path",
    "replace_json_values",
    "set_json_path",
]
