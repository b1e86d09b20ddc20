"""What the retire gate asks of PostgreSQL (``base.checks.GateChecks``), answered from the room's
pieces: ``in_flight`` and ``prepared`` (``in_flight.py``), ``durability`` and ``primary_position``
(``durability.py``), ``replica_positions`` (``replicas.py``), ``candidate_columns``
(``sweep_catalog.py``). These are the engine-neutral answers of the same reads; PostgreSQL's own
gate (``gate/``) asks the richer pieces directly (the ``ReadMark``, the standbys' flush positions,
the catalog's relations by oid), as it did before they moved here. Reads only; a read that fails
is a DatabaseError naming what was missing (fail closed).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import psycopg

from ...errors import DatabaseError
from ..base.checks import CandidateColumn, Durability, OpenTransaction, ReplicaPosition
from .connect import PgConnection, describe_db_error
from .durability import confirm_flushed, insert_position
from .in_flight import STATS_PRIVILEGE, mark_read_start, prepared_transactions
from .replicas import discovered_standbys
from .sweep_catalog import relations, type_kinds


class PostgresGateChecks:
    @contextlib.contextmanager
    def snapshot(self, conn: PgConnection) -> Iterator[None]:
        """One ``REPEATABLE READ READ ONLY`` transaction on ``conn`` (in autocommit, as
        ``raw_connection`` hands it out): every read inside sees the moment of its first query,
        nothing can be written through it; rolled back at the end. The gate's own look
        (``snapshot.py``) opens the same transaction and keeps the xids in flight at it."""
        try:
            conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
        except psycopg.Error as e:
            raise DatabaseError(f"cannot open the gate's snapshot ({describe_db_error(e)})") from None
        try:
            yield
        finally:
            if not conn.closed:
                with contextlib.suppress(psycopg.Error):  # a broken connection: the pool invalidates it
                    conn.execute("ROLLBACK")

    def candidate_columns(self, conn: PgConnection) -> list[CandidateColumn]:
        """Every column that can carry a ciphertext (``sweep_catalog.type_kinds``: strings, bytea, json,
        arrays, composites, ...) of every table, partition, materialized view and foreign table outside
        the system schemas. ``type_name`` is the kind (``text``, ``json``, ``bytea``, ``container``,
        ``[]`` appended for an array). Unreadable: no USAGE on the schema, no SELECT on the column, or
        row-level security that applies to the role. Outside the snapshot (``transactional`` False): a
        foreign table, another session's temporary table. Partitions are listed beside their parents
        (the gate's plan reads them through the parents)."""
        kinds = type_kinds(conn)
        found: list[CandidateColumn] = []
        for rel in relations(conn).values():
            for name, typid, column_select in rel.columns:
                kind = kinds.get(typid)
                if kind is None:
                    continue
                found.append(CandidateColumn(
                    rel.schema, rel.table, name, kind[0] + ("[]" if kind[1] else ""),
                    binary=kind == ("bytea", False),
                    readable=rel.usage and (rel.select or column_select) and not rel.row_security,
                    transactional=rel.relkind != "f" and rel.temp_of is None))
        return found

    def in_flight(self, conn: PgConnection) -> list[OpenTransaction]:
        """The sessions of this database in a transaction now (``in_flight.mark_read_start``), this
        one aside; ``transaction`` names the session and the start of its transaction, which is how
        ``in_flight.still_open`` tells that it has ended. Fail closed: on a standby (the primary's
        transactions are not visible there), or when a session's state is hidden from the role."""
        mark = mark_read_start(conn)
        if mark.standby:
            raise DatabaseError("cannot read the transactions in flight: this is a standby (pg_is_in_recovery()"
                                " is true), the primary's are not visible here")
        unseen = [*mark.hidden, *mark.untracked]
        if unseen:
            raise DatabaseError(f"cannot read the transactions in flight: {len(unseen)} session(s) not visible to"
                                f" role {mark.role} (pid {', '.join(str(s.pid) for s in unseen[:20])}); grant"
                                f" {STATS_PRIVILEGE}, and keep track_activities on")
        return [OpenTransaction(s.pid, f"pid {s.pid} since {s.xact_start.isoformat() if s.xact_start else '?'}",
                                s.role, s.state, s.open_s) for s in mark.in_flight]

    def prepared(self, conn: PgConnection) -> list[str]:
        """gids of the prepared transactions of this database (``pg_prepared_xacts``)."""
        return prepared_transactions(conn)

    def durability(self, conn: PgConnection) -> Durability:
        """Waits (``durability.FLUSH_WAIT_S`` at most) until every commit visible now is flushed
        (``confirm_flushed``: call it AFTER the reads); the positions compared are the settings.
        Batches commit with ``synchronous_commit = off``, so no setting makes PostgreSQL durable at
        every commit: the flush is confirmed instead, and a flush that cannot be confirmed is a
        DatabaseError."""
        flushed = confirm_flushed(conn)
        return Durability(bool(flushed.get("flushed")), flushed)

    def primary_position(self, conn: PgConnection) -> str | None:
        """The WAL insert position (an LSN); None on a standby."""
        return insert_position(conn)

    def replica_positions(self, conn: PgConnection) -> list[ReplicaPosition]:
        """The primary's physical standbys and slots as the primary sees them
        (``replicas.discovered_standbys``): ``position`` is the LSN each has flushed, ``running`` False
        for a slot or walsender whose position is not known (``problem`` says why); no lag in seconds.
        Empty on a standby. Logical walsenders, base backups and WAL archivers are no replicas."""
        target = insert_position(conn)
        if target is None:
            return []
        found, _left_out = discovered_standbys(conn, target)
        return [ReplicaPosition(p.name, None, p.flushed_lsn, p.problem is None and p.flushed_lsn is not None,
                                p.problem) for p in found]


GATE_CHECKS = PostgresGateChecks()
