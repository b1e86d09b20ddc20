"""The least privilege a rotation needs, as GRANT statements for the configured targets.

A run reads the id, key-version, cipher and scope columns of each target (and, where its scheme
writes by row version, each row's ``ctid`` and ``xmin``) and writes only the cipher and key-version
columns; it keeps its own facts in the ``pinrotate`` bookkeeping schema. An
inventory or a gate (an auditor) writes nothing but must read everything: the gate sweeps every
table for ciphertexts outside the targets. These statements grant exactly that. Printed for a database owner to run; pinrotate never runs them.
"""

from __future__ import annotations

from . import conflicts, key_checks
from .config import Settings
from .engines.postgresql import grants as pg_grants
from .forge_discovery import with_forge_targets
from .schemes.registry import reads_row_versions
from .targets import ROW_VERSION_COLUMNS, read_columns


def grant_statements(settings: Settings, role: str, *, read_only: bool = False) -> list[str]:
    """SQL for a role that may run rotations, or (``read_only``) an auditor for inventory and gate
    (the statements are the PostgreSQL room's ``grants``; this keeps which columns).

    The bookkeeping table is created ahead by the owner, so neither role needs CREATE on the
    database. The auditor reads everything: the gate's answer rests on a sweep of every table for
    ciphertexts outside the targets and on seeing every session in flight, so it is granted
    PostgreSQL's predefined ``pg_read_all_data`` and ``pg_read_all_stats`` (PostgreSQL 14+) and
    nothing that writes.
    """
    out: list[str] = [conflicts.CREATE_SQL.as_string(), key_checks.CREATE_SQL.as_string()]
    if read_only:
        out += pg_grants.auditor_grants(role)
        return [s + ";" for s in out]
    settings = with_forge_targets(settings)  # Forge's own tables too, as every command sees them
    schemas = sorted({t.schema_name for t in settings.targets if t.schema_name})
    out += [pg_grants.schema_usage(s, role) for s in schemas]
    for t in settings.targets:
        # A scheme written by row version also reads each row's ctid and xmin (system columns).
        versions = list(ROW_VERSION_COLUMNS) if reads_row_versions(t.format) else []
        written = [*t.columns, *([t.key_version] if t.key_version else [])]
        out += pg_grants.rotation_grants(t.schema_name, t.table_name, [*read_columns(t), *versions], written, role)
    out += pg_grants.bookkeeping_grants(conflicts.SCHEMA, conflicts.TABLE, key_checks.TABLE, role)
    return [s + ";" for s in out]
