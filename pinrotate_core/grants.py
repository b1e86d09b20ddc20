"""The least privilege a rotation needs, as GRANT statements for the configured targets.

A run reads the id, key-version, cipher and scope columns of each target (and, where its scheme
writes by row version, each row's ``ctid`` and ``xmin``) and writes only the cipher and key-version
columns; it keeps its own facts in the ``pinrotate`` bookkeeping schema. An
inventory or a gate (an auditor) writes nothing but must read everything: the gate sweeps every
table for ciphertexts outside the targets. These statements grant exactly that. Printed for a database owner to run; pinrotate never runs them.
"""

from __future__ import annotations

from psycopg import sql

from . import bookkeeping, conflicts, key_checks
from .config import Settings
from .forge_discovery import with_forge_targets
from .schemes.registry import reads_row_versions
from .targets import ROW_VERSION_COLUMNS, read_columns, relation_of


def _ident_list(names: list[str]) -> sql.Composable:
    return sql.SQL(", ").join(sql.Identifier(n) for n in names)


def grant_statements(settings: Settings, role: str, *, read_only: bool = False) -> list[str]:
    """SQL for a role that may run rotations, or (``read_only``) an auditor for inventory and gate.

    The bookkeeping table is created ahead by the owner, so neither role needs CREATE on the
    database. The auditor reads everything: the gate's answer rests on a sweep of every table for
    ciphertexts outside the targets and on seeing every session in flight, so it is granted
    PostgreSQL's predefined ``pg_read_all_data`` and ``pg_read_all_stats`` (PostgreSQL 14+) and
    nothing that writes.
    """
    grantee = sql.Identifier(role)
    out: list[sql.Composable] = [conflicts.CREATE_SQL, key_checks.CREATE_SQL]
    if read_only:
        out.append(sql.SQL("GRANT pg_read_all_data, pg_read_all_stats TO {}").format(grantee))
        return [s.as_string() + ";" for s in out]
    settings = with_forge_targets(settings)  # Forge's own tables too, as every command sees them
    schemas = sorted({t.schema_name for t in settings.targets if t.schema_name})
    out += [sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(sql.Identifier(s), grantee) for s in schemas]
    for t in settings.targets:
        # A scheme written by row version also reads each row's ctid and xmin (system columns).
        versions = list(ROW_VERSION_COLUMNS) if reads_row_versions(t.format) else []
        out.append(sql.SQL("GRANT SELECT ({}) ON {} TO {}").format(_ident_list([*read_columns(t), *versions]),
                                                                    relation_of(t), grantee))
        written = [*t.columns, *([t.key_version] if t.key_version else [])]
        out.append(sql.SQL("GRANT UPDATE ({}) ON {} TO {}").format(_ident_list(written), relation_of(t), grantee))
    out.append(sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(sql.Identifier(bookkeeping.SCHEMA), grantee))
    # Conflicts are replaced run by run; a key's check value is only ever added (key_checks).
    out.append(sql.SQL("GRANT SELECT, INSERT, UPDATE, DELETE ON {} TO {}").format(
        sql.Identifier(bookkeeping.SCHEMA, conflicts.TABLE), grantee))
    out.append(sql.SQL("GRANT SELECT, INSERT ON {} TO {}").format(
        sql.Identifier(bookkeeping.SCHEMA, key_checks.TABLE), grantee))
    return [s.as_string() + ";" for s in out]
