"""The PostgreSQL room: features, SQL pieces, connections (``connect``), the table catalog
(``catalog``), GRANT statements (``grants``), streamed reads (``stream``), the gate's moment
(``snapshot``) and checks (``in_flight``, ``durability``, ``replicas``, ``sweep_catalog``,
``sweep``, answered as ``base.checks.GateChecks`` by ``gate``), the throttle's signals and the
advisory lock (``signals``), the drain's write guards' statements (``row_versions``,
``guard_cas``, ``stored``), its shard estimates and backlog counts (``estimates``, ``counts``) and
transaction settings (``session``), pinrotate's own bookkeeping tables (``bookkeeping``), and
the room as a whole (``room``). Never imports the drain, gate or flows."""
