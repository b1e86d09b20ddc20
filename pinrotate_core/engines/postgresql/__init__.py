"""The PostgreSQL room: features, SQL pieces, connections (``connect``), the table catalog
(``catalog``), GRANT statements (``grants``), streamed reads (``stream``), the gate's moment
(``snapshot``) and checks (``in_flight``, ``durability``, ``replicas``, ``sweep_catalog``,
``sweep``, answered as ``base.checks.GateChecks`` by ``gate``), the throttle's signals and the
advisory lock (``signals``) and the room as a whole (``room``). The write guards still live where
they were written (drain/) and move here as docs/engines.md plans. Never imports the drain, gate or
flows."""
