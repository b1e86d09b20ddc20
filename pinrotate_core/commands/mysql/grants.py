"""``grants --role ROLE`` on MySQL / MariaDB: the room's GRANT statements for the configured
targets (``engines/mysql/grants.py``), printed for a database owner to paste into the ``mysql``
client; pinrotate runs none of them.

The server is read (never written) for two facts the statements depend on: its flavour (an
auditor's privileges are named differently on MariaDB and MySQL 8) and each target's
``ON UPDATE CURRENT_TIMESTAMP`` columns, which a run keeps by setting them to themselves and
therefore needs UPDATE on. First, the DDL of pinrotate's own ``pinrotate`` database (key check
values and CONFLICT counts) for the owner to run ahead, then the rotation role's rights on it.
"""

from __future__ import annotations

from ...config import Settings
from ...db import database_url, make_engine
from ...engines.mysql import connect as mysql_connect
from ...engines.mysql.catalog import CATALOG
from ...engines.mysql.grants import account, auditor_grants, bookkeeping_ddl, bookkeeping_grants, rotation_grants
from ...errors import ConfigError
from ...forge_discovery import with_forge_targets
from ...targets import read_columns


def _as_printed(statement: str) -> str:
    """The room composes statements to run with parameters, where ``%`` is written ``%%``; printed
    for the ``mysql`` client (text, no parameters), every ``%`` is itself again."""
    return statement.replace("%%", "%") + ";"


def mysql_grant_statements(settings: Settings, role: str, *, read_only: bool = False) -> list[str]:
    grantee = account(role)
    engine = make_engine(database_url(settings), pool_size=1)
    try:
        settings = with_forge_targets(settings, engine)  # Forge's own tables too, as every command sees them
        with mysql_connect.raw_connection(engine) as conn:
            flavour = mysql_connect.server_info(conn).flavour
            # pinrotate's own bookkeeping (pinrotate.conflicts, pinrotate.key_checks), created ahead by
            # the owner as on PostgreSQL; an auditor reads it with its SELECT on *.*.
            out: list[str] = bookkeeping_ddl()
            if read_only:
                return [_as_printed(s) for s in [*out, *auditor_grants(grantee, flavour)]]
            for t in settings.targets:
                found = CATALOG.read_table(conn, t.schema_name, t.table_name)
                if found is None:
                    raise ConfigError(f"grants: target {t.name}: table {t.table_name} not found in the configured database")
                kept = [c.name for c in found.auto_updated]  # ON UPDATE CURRENT_TIMESTAMP, set to itself
                written = [*t.columns, *([t.key_version] if t.key_version else []), *kept]
                out += rotation_grants(found.schema, found.table, [*read_columns(t), *kept], written, grantee)
            out += bookkeeping_grants(grantee)
            return [_as_printed(s) for s in out]
    finally:
        engine.dispose()
