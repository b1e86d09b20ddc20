"""What the discovery sweep reads: every table, partition and materialized view of the database, the
columns that can hold a ciphertext (every type with a text form that can carry one: strings, bytea, json,
xml, arrays, composites, ranges, hstore and other extension types), minus the configured targets' columns
and what ``[gate] discover_skip`` names; which of them the role cannot read (UNREADABLE) and which the sweep
cannot search (UNSWEPT: foreign tables, other sessions' temporary tables); both close every gate. Catalog
reads only (the PostgreSQL room's ``sweep_catalog``), in the gate's snapshot: relations are planned by oid
(``snapshot.hold`` then reads them by identity).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

import psycopg
from psycopg import sql

from ..config import Settings
from ..engines.postgresql.sweep_catalog import (
    Kind,
    ancestors,
    configured_columns,
    lineage_of,
    relations,
    type_kinds,
)
from ..targets import relation_of


@dataclass(frozen=True)
class SweptColumn:
    name: str
    kind: Kind
    array: bool
    json_paths: tuple[str, ...] = ()  # a configured json column: swept outside these paths only

    @property
    def tried(self) -> bool:
        """Its values are tried with the held keys (binary ciphertexts), value by value."""
        return not self.json_paths


@dataclass
class SweptTable:
    schema: str
    table: str
    est_rows: float
    columns: list[SweptColumn] = field(default_factory=list)
    oid: int = 0
    # Its name now (``snapshot.current_name`` after ``snapshot.hold``): a rename after the snapshot is followed.
    name_now: sql.Composable | None = None

    @property
    def label(self) -> str:
        return f"{self.schema}.{self.table}"

    @property
    def relation(self) -> sql.Composable:
        return self.name_now if self.name_now is not None else sql.Identifier(self.schema, self.table)


@dataclass
class SweepPlan:
    tables: list[SweptTable] = field(default_factory=list)
    unreadable: dict[str, str] = field(default_factory=dict)  # schema.table -> one-line reason
    unswept: dict[str, str] = field(default_factory=dict)  # schema.table -> why it cannot be searched (blocks)
    not_swept: dict[str, str] = field(default_factory=dict)  # schema.table[.column] -> discover_skip (never blocks)


def plan_sweep(conn: psycopg.Connection[Any], settings: Settings) -> SweepPlan:
    """The tables and columns to sweep, the ones skipped (and why) and the ones the role cannot read.

    A table the role cannot read in full (no USAGE on its schema, no SELECT on a swept column, row-level
    security that applies to the role) is unreadable: something could hide there, every gate stays closed.
    """
    kinds = type_kinds(conn)
    configured = configured_columns(conn, [(relation_of(t).as_string(conn), t.columns, t.json_paths)
                                           for t in settings.targets])
    parents, parent_names = ancestors(conn)
    skip = settings.gate.discover_skip
    plan = SweepPlan()
    rels = relations(conn)
    for rel in rels.values():
        swept = SweptTable(rel.schema, rel.table, rel.est_rows, oid=rel.oid)
        lineage = list(lineage_of(rel.oid, parents))
        names = [swept.label, *(parent_names[o] for o in lineage[1:] if o in parent_names)]
        skipped_as = next((n for n in names if any(fnmatchcase(n, p) for p in skip if p.count(".") == 1)), None)
        if skipped_as is not None:
            if any(int(typid) in kinds for _, typid, _ in rel.columns):
                plan.not_swept[swept.label] = "[gate] discover_skip" + (
                    f" (through {skipped_as})" if skipped_as != swept.label else "")
            continue
        unreadable_columns = False
        for name, typid, column_select in rel.columns:
            found = kinds.get(typid)
            if found is None:
                continue
            paths: tuple[str, ...] = ()
            covered = [configured[(o, name)] for o in lineage if (o, name) in configured]
            if covered:
                paths = covered[0]
                if not paths:
                    continue  # a configured cipher column: the inventory counts it
            label = f"{swept.label}.{name}"
            if any(fnmatchcase(label, p) for p in skip if p.count(".") == 2):
                plan.not_swept[label] = "[gate] discover_skip"
                continue
            unreadable_columns |= not (rel.select or column_select)
            swept.columns.append(SweptColumn(name, found[0], found[1], paths))
        if not swept.columns:
            continue
        if rel.temp_of is not None:
            plan.unswept[swept.label] = (f"temporary table of another session ({rel.temp_of}): no other session "
                                         "can read it; end that session, or list it in [gate] discover_skip")
        elif rel.relkind == "f":
            plan.unswept[swept.label] = ("foreign table: its rows live on another server, the sweep cannot search "
                                         "them; list it in [gate] discover_skip once that server is checked")
        elif rel.relkind == "m" and not rel.populated:
            plan.not_swept[swept.label] = "materialized view not populated: it holds no rows"
        elif not rel.usage or unreadable_columns:
            plan.unreadable[swept.label] = (f"cannot read {swept.label}: the sweep cannot see it; "
                                            "grant SELECT or list it in [gate] discover_skip")
        elif rel.row_security:
            plan.unreadable[swept.label] = (f"cannot read every row of {swept.label}: row-level security "
                                            "applies to this role; use a role with BYPASSRLS or list it "
                                            "in [gate] discover_skip")
        else:
            plan.tables.append(swept)
    return plan


