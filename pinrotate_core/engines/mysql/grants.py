"""The least privilege on MySQL / MariaDB, as GRANT statements for a database owner to run
(pinrotate never runs them): a rotation role reads its target columns and writes only the cipher
and key-version columns; an auditor (inventory, gate) reads everything and writes nothing."""

from __future__ import annotations

from collections.abc import Sequence

from . import bookkeeping as books
from .operations import OPERATIONS as ops
from .replication import HEARTBEAT_SCHEMA, HEARTBEAT_TABLE, create_heartbeat_sql


def account(user: str, host: str = "%") -> str:
    """``'user'@'host'``, quoted as a MySQL account name (``%`` doubled, as every piece: the
    statements are run with a parameter tuple)."""
    def literal(text: str) -> str:
        return ("'" + text.replace("\\", "\\\\").replace("'", "''") + "'").replace("%", "%%")
    return f"{literal(user)}@{literal(host)}"


def rotation_grants(schema: str, table: str, read: Sequence[str], write: Sequence[str], grantee: str) -> list[str]:
    """Column grants for one target. ``SELECT ... FOR UPDATE SKIP LOCKED`` needs nothing more
    than these on MariaDB (tested); the UPDATE's self-assignment of ``ON UPDATE CURRENT_TIMESTAMP``
    columns needs them in ``write`` too."""
    rel = ops.relation(schema, table)
    cols = list(dict.fromkeys([*read, *write]))
    return [f"GRANT SELECT ({', '.join(map(ops.quote, cols))}) ON {rel} TO {grantee}",
            f"GRANT UPDATE ({', '.join(map(ops.quote, dict.fromkeys(write)))}) ON {rel} TO {grantee}"]


def auditor_grants(grantee: str, flavour: str) -> list[str]:
    """Read everything (the sweep must see every table), see every session's transactions
    (PROCESS), prepared XA transactions and replica status; nothing that writes."""
    if flavour == "mariadb":
        return [f"GRANT SELECT, PROCESS, SLAVE MONITOR ON *.* TO {grantee}"]
    return [f"GRANT SELECT, PROCESS, REPLICATION CLIENT, XA_RECOVER_ADMIN ON *.* TO {grantee}"]


def bookkeeping_ddl() -> list[str]:
    """pinrotate's own ``pinrotate`` database and tables, for the owner to create ahead (then no
    role of pinrotate needs CREATE)."""
    return [books.CREATE_DATABASE, books.CREATE_TABLES[books.CONFLICTS], books.CREATE_TABLES[books.KEY_CHECKS],
            create_heartbeat_sql()]


def bookkeeping_grants(grantee: str) -> list[str]:
    """A rotation role's rights on the bookkeeping: CONFLICT counts are replaced run by run
    (``INSERT ... ON DUPLICATE KEY UPDATE``, ``DELETE``); a key's check value is only ever added;
    a run's throttle stamps its own heartbeat row and removes it at the end."""
    return [f"GRANT SELECT, INSERT, UPDATE, DELETE ON {ops.relation(books.DATABASE, books.CONFLICTS)} TO {grantee}",
            f"GRANT SELECT, INSERT ON {ops.relation(books.DATABASE, books.KEY_CHECKS)} TO {grantee}",
            f"GRANT SELECT, INSERT, UPDATE, DELETE ON {ops.relation(HEARTBEAT_SCHEMA, HEARTBEAT_TABLE)} TO {grantee}"]
