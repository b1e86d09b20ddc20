"""Forge's own tables as ``fpc1`` targets (``[forge] discover_targets = true``, contract §3).

Read from Forge's metadata in the configured database at every command, so that a low-code config
added since the last run is never outside the gate:

- ``DataConnection``: ``ai_report_data_connection.password_cipher``, legacy algorithm Forge's
  default (``[keys] legacy_algorithm``, i.e. ``forge.crypto.algorithm``);
- ``lowcode:<config_key>``: every ``ai_crud_config`` row whose ``encrypt_config`` is a non-empty
  JSON object, ``{"phone": {"algorithm": "SM4"}, "idCard": {"algorithm": "AES"}}``: its
  ``table_name``, one column per field (camelCase -> snake_case, as Forge maps it), each with its
  field's algorithm for legacy values.

Tenant ``tenant_id`` and soft delete ``del_flag`` where the table has them. A discovered table or
column that is missing or unreadable is not dropped: the target stays, and resolving it says
BLOCKED. Configured ``[[targets]]`` of the same name win. Plain SQL through SQLAlchemy (a table
read with ``SELECT``, columns from SQLAlchemy's inspector): nothing PostgreSQL-only, so that another
engine reuses it as it is.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any, Final

import sqlalchemy as sa

from .config import Settings, TargetSettings
from .config_errors import TARGET_NAME
from .db import database_url, make_engine
from .engines.postgresql.connect import describe_db_error
from .errors import ConfigError, DatabaseError

DATA_CONNECTION_TABLE: Final = "ai_report_data_connection"
DATA_CONNECTION_COLUMN: Final = "password_cipher"
CRUD_CONFIG_TABLE: Final = "ai_crud_config"
TENANT_COLUMN: Final = "tenant_id"
SOFT_DELETE_COLUMN: Final = "del_flag"
LOWCODE_PREFIX: Final = "lowcode:"
_WORD_BOUNDARY = re.compile(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")


def snake_case(field: str) -> str:
    """Forge's column of a camelCase field (hutool ``StrUtil.toUnderlineCase``): ``idCard`` ->
    ``id_card``, ``userIDCard`` -> ``user_id_card``."""
    return _WORD_BOUNDARY.sub("_", field).lower()


def with_forge_targets(settings: Settings, engine: sa.Engine | None = None) -> Settings:
    """``settings`` with Forge's own tables added as targets when ``[forge] discover_targets`` is on
    (else ``settings`` itself). DatabaseError when Forge's metadata cannot be read (exit 4)."""
    if not settings.forge.discover_targets:
        return settings
    own = engine is None
    engine = engine or make_engine(database_url(settings), pool_size=1)
    try:
        with engine.connect() as conn:
            found = discover(conn, settings)
    except sa.exc.DBAPIError as e:
        raise DatabaseError(f"forge discovery: cannot read Forge's metadata ({describe_db_error(e.orig)})") from None
    finally:
        if own:
            engine.dispose()
    configured = {t.name for t in settings.targets}
    added = tuple(t for t in found if t.name not in configured)
    return settings.model_copy(update={"targets": (*settings.targets, *added)})


def discover(conn: sa.Connection, settings: Settings) -> list[TargetSettings]:
    """Forge's targets in the database behind ``conn`` (read only)."""
    inspector = sa.inspect(conn)
    targets = [_target("DataConnection", DATA_CONNECTION_TABLE, [DATA_CONNECTION_COLUMN], None, inspector)]
    if not inspector.has_table(CRUD_CONFIG_TABLE):
        raise ConfigError(f"forge discovery: table {CRUD_CONFIG_TABLE} not found in the configured database;"
                          " is it Forge's metadata database? (or set [forge] discover_targets = false)")
    rows = conn.execute(sa.text(f"SELECT config_key, table_name, encrypt_config FROM {CRUD_CONFIG_TABLE}"
                                " WHERE encrypt_config IS NOT NULL ORDER BY config_key")).fetchall()
    for config_key, table_name, encrypt_config in rows:
        fields = _encrypted_fields(str(config_key), encrypt_config)
        if not fields:
            continue
        name = f"{LOWCODE_PREFIX}{config_key}"
        if not TARGET_NAME.fullmatch(name):
            raise ConfigError(f"forge discovery: {CRUD_CONFIG_TABLE} config_key {str(config_key)[:64]!r} cannot"
                              " name a target (expected [A-Za-z0-9_.:-], at most 56 characters)")
        columns = {snake_case(f): algorithm for f, algorithm in fields.items()}
        targets.append(_target(name, str(table_name), list(columns), columns, inspector))
    return targets


def _encrypted_fields(config_key: str, encrypt_config: Any) -> dict[str, str]:
    """field -> algorithm of one ``encrypt_config`` (a JSON object; empty: none)."""
    where = f"forge discovery: {CRUD_CONFIG_TABLE} {config_key!r}: encrypt_config"
    document = encrypt_config
    if isinstance(encrypt_config, (str, bytes)):
        text = encrypt_config.decode() if isinstance(encrypt_config, bytes) else encrypt_config
        if not text.strip():
            return {}
        try:
            document = json.loads(text)
        except json.JSONDecodeError:
            raise ConfigError(f"{where} is not JSON; Forge could not read it either") from None
    if document is None:
        return {}
    if not isinstance(document, Mapping):
        raise ConfigError(f"{where} is not a JSON object")
    out: dict[str, str] = {}
    for field, spec in document.items():
        code = spec.get("algorithm") if isinstance(spec, Mapping) else None
        code = "SM4" if code is None or (isinstance(code, str) and not code.strip()) else code  # Forge: blank = SM4
        if not isinstance(code, str) or code.upper() not in ("SM4", "AES"):
            raise ConfigError(f"{where}: field {str(field)[:64]!r}: algorithm must be SM4 or AES")
        out[str(field)] = code.upper()
    return out


def _target(name: str, table: str, columns: list[str], algorithms: dict[str, str] | None,
            inspector: sa.Inspector) -> TargetSettings:
    schema, _, bare = table.rpartition(".")
    present: set[str] = set()
    if inspector.has_table(bare, schema=schema or None):
        present = {str(c["name"]) for c in inspector.get_columns(bare, schema=schema or None)}
    return TargetSettings(
        name=name, table=table, id="id", columns=tuple(columns), format="fpc1",
        tenant=TENANT_COLUMN if TENANT_COLUMN in present else None,
        soft_delete=SOFT_DELETE_COLUMN if SOFT_DELETE_COLUMN in present else None,
        legacy_algorithm=algorithms)
