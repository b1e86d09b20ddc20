"""The least privilege a rotation needs, as GRANT statements for the configured targets.

A run reads the id, key-version, cipher and scope columns of each target and writes only the cipher
and key-version columns; it keeps its own facts in the ``pinrotate`` bookkeeping schema. An
inventory or a gate (an auditor) reads the same columns and writes nothing. These statements grant
exactly that, column by column. Printed for a database owner to run; pinrotate never runs them.
"""

from __future__ import annotations

from psycopg import sql

from .config import Settings
from .state import CREATE_SQL, QUALIFIED, SCHEMA
from .targets import read_columns, relation_of


def _ident_list(names: list[str]) -> sql.Composable:
    return sql.SQL(", ").join(sql.Identifier(n) for n in names)


def grant_statements(settings: Settings, role: str, *, read_only: bool = False) -> list[str]:
    """SQL for a role that may run rotations (or, ``read_only``, only inventory and gate).

    The bookkeeping table is created ahead by the owner, so the role needs no CREATE on the
    database; a read-only role may read it (CONFLICTs a run left keep the gate closed).
    """
    grantee = sql.Identifier(role)
    out: list[sql.Composable] = [CREATE_SQL]
    schemas = sorted({t.schema_name for t in settings.targets if t.schema_name})
    out += [sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(sql.Identifier(s), grantee) for s in schemas]
    for t in settings.targets:
        reads = read_columns(t)
        grant = sql.SQL("GRANT SELECT ({}) ON {} TO {}").format(_ident_list(reads), relation_of(t), grantee)
        out.append(grant)
        if not read_only:
            written = [*t.columns, *([t.key_version] if t.key_version else [])]
            out.append(sql.SQL("GRANT UPDATE ({}) ON {} TO {}").format(_ident_list(written), relation_of(t), grantee))
    out.append(sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(sql.Identifier(SCHEMA), grantee))
    table = sql.Identifier(*QUALIFIED.split("."))
    privileges = sql.SQL("SELECT") if read_only else sql.SQL("SELECT, INSERT, UPDATE, DELETE")
    out.append(sql.SQL("GRANT {} ON {} TO {}").format(privileges, table, grantee))
    return [s.as_string() + ";" for s in out]
