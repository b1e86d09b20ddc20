"""The catalog of a target table as every engine reports it: columns, primary key, what the
server changes by itself, UPDATE triggers, privileges, read-only. Engine-neutral facts; the
rules over them (BLOCKED or not) stay with the caller (targets.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

Conn_contra = TypeVar("Conn_contra", contravariant=True)


@dataclass(frozen=True)
class CatalogColumn:
    name: str
    sql_type: str  # as the server prints it: "varchar(255)", "bytea", "timestamp"
    type_name: str  # the bare type, lower case: "varchar", "bytea", "longtext", "int"
    char_length: int | None  # declared characters of varchar(n) / char(n); None otherwise
    generated: bool = False  # computed by the server (GENERATED ALWAYS / VIRTUAL / STORED)
    # rewritten by the server on every UPDATE (MySQL ``ON UPDATE CURRENT_TIMESTAMP``)
    auto_updated: bool = False


@dataclass(frozen=True)
class UpdateTrigger:
    name: str
    table: str  # "schema.table" it is defined on
    timing: str  # BEFORE | AFTER


@dataclass(frozen=True)
class TableCatalog:
    schema: str
    table: str
    columns: dict[str, CatalogColumn]
    primary_key: tuple[str, ...]
    update_triggers: tuple[UpdateTrigger, ...]
    role: str  # the connecting user as the server names it ('app'@'%', app)
    # (privilege, column) pairs the role lacks among those asked for
    missing_privileges: tuple[tuple[str, str], ...] = ()
    read_only: tuple[str, ...] = ()  # why the connection cannot write ("@@read_only = 1"); empty: it can
    notes: tuple[str, ...] = field(default=())

    @property
    def auto_updated(self) -> list[CatalogColumn]:
        return [c for c in self.columns.values() if c.auto_updated]


class Catalog(Protocol[Conn_contra]):
    def read_table(self, conn: Conn_contra, schema: str | None, table: str, *, select: Sequence[str] = (),
                   update: Sequence[str] = ()) -> TableCatalog | None:
        """The table's catalog, None when it does not exist (or the role cannot see it);
        ``select`` / ``update``: the columns whose privileges are checked."""
