"""``[forge]`` and the algorithm codes of Forge's ciphertexts (``SM4`` / ``AES``), for the settings."""

from __future__ import annotations

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator

# Settings that no longer exist and are refused by name (the GCM legacy forms they chose are gone).
REMOVED_KEYS_SETTINGS = ("legacy_format", "legacy_plaintext")
FORGE_ALGORITHMS = ("SM4", "AES")


def algorithm_code(code: str) -> str:
    """``SM4`` or ``AES`` (any case, as Forge's ``CryptoAlgorithm.fromCode``), upper-cased."""
    if code.upper() not in FORGE_ALGORITHMS:
        raise ValueError("must be \"SM4\" or \"AES\"")
    return code.upper()


class ForgeSettings(BaseModel):
    """``[forge]``: Forge's own settings that pinrotate follows."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    # Forge's forge.crypto.algorithm: the default algorithm of legacy values (data-connection passwords).
    algorithm: str = Field(default="SM4", validation_alias=AliasChoices("algorithm", "FORGE_CRYPTO_ALGORITHM"))
    # Add Forge's own tables (ai_report_data_connection, every ai_crud_config with encrypt_config) as targets.
    discover_targets: bool = Field(default=False, validation_alias=AliasChoices(
        "discover_targets", "PINROTATE_FORGE_DISCOVER_TARGETS"))

    @field_validator("algorithm")
    @classmethod
    def _algorithm(cls, code: str) -> str:
        return algorithm_code(code)
