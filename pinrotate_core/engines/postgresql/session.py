"""The settings of every transaction a drain runs on PostgreSQL (its reads and its writes), as
``SET LOCAL``s: the bounds on lock waits, statements and idle time, the join choice that keeps a
batch on its primary key, and asynchronous commit for writes. (MySQL's are session variables set
and reset around each batch: ``mysql/guard.batch_limits``.)"""

from __future__ import annotations

from psycopg import sql


def batch_settings(lock_timeout: float, statement_timeout: float, idle_timeout: float, *,
                   dry_run: bool) -> list[sql.Composable]:
    """The ``SET LOCAL``s of every transaction of a drain (its reads and its writes), never session
    settings: behind a transaction pooler (PgBouncer ``pool_mode = transaction``) a server
    connection goes to the application's next transaction, and nothing pinrotate sets may reach it.
    """
    # Never wait long for a lock an application holds, never run away, and never hold rows for
    # ever: the server ends a transaction left idle longer than idle_timeout (a frozen process),
    # which rolls it back.
    out: list[sql.Composable] = [
        sql.SQL("SET LOCAL {} = {}").format(sql.Identifier(name), sql.Literal(f"{max(1, int(seconds * 1000))}ms"))
        for name, seconds in (("lock_timeout", lock_timeout),
                              ("statement_timeout", statement_timeout),
                              ("idle_in_transaction_session_timeout", idle_timeout))]
    # Keep each batch on the primary key: on small tables the planner may otherwise hash-join
    # the batch against a sequential scan of the whole table.
    out += [sql.SQL("SET LOCAL enable_hashjoin = off"), sql.SQL("SET LOCAL enable_mergejoin = off")]
    if not dry_run:
        # A commit lost in a crash only leaves its rows on the old key, which is still in the
        # keyring: the next run takes them again. So batches need not wait for each WAL flush;
        # the drain ends with durability.force_flush() before it reports.
        out.append(sql.SQL("SET LOCAL synchronous_commit = off"))
    return out
