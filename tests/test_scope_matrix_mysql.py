"""THE scope rule on MySQL / MariaDB (issue 32): the matrix of tests/test_scope_matrix.py (scheme x
scope rule) on the real MariaDB, every command in one case: inventory (shallow and deep), dry run,
the retire gate, the run, then inventory and gate again.

What MySQL adds to the rule: its collations fold case and trailing blanks, so ``--tenant t%1'``
must not take ``T%1'`` (exact bytes, ``scope_text`` / ``exact_text_equal``), and the soft-delete
words are read by ``TRIM`` / ``LOWER`` / ``REGEXP`` rather than PostgreSQL's ``btrim`` / ``~``.
Rows out of scope are never rewritten (every column compared before and after: a rewrite changes
the ciphertext) and are counted EXCLUDED; the gate for the old key is decided over every tenant.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pymysql
import pytest
import sqlalchemy as sa

from pinrotate_core import rotation
from pinrotate_core.commands.mysql.gate import mysql_retire_gate
from pinrotate_core.commands.mysql.inventory import take_mysql_inventory
from pinrotate_core.engines.mysql.connect import make_engine
from pinrotate_core.providers import build_provider
from tests.mariadb_server import MariaDbServer, private_mariadb, private_mysql_database  # noqa: F401 (fixtures)

from .test_scope_matrix import (
    RULES,
    SCHEMES,
    TARGET,
    TENANT,
    WORLDS,
    Spec,
    World,
    assert_on_current_key,
    changed,
    rows_for,
    target_settings,
)

# The gate sweeps the whole server: on the shared MariaDB these cases would hold it alone
# (server_wide) and hold up every other MySQL test meanwhile. They run on a mariadbd of their own
# instead, one worker for the module.
pytestmark = [pytest.mark.mysql, pytest.mark.xdist_group("test_scope_matrix_mysql")]

TABLE = "scoped"
COLUMN_TYPE = {"aesgcm": "VARBINARY(512)", "fpc1": "VARCHAR(512)", "vault-transit": "TEXT"}
CATEGORIES = ("ACTIVE", "HISTORICAL", "NEWER", "LEGACY", "UNKNOWN", "UNKNOWN_KEY", "EXCLUDED", "FAILED", "CONFLICT",
              "BLOCKED")


class MySqlCase:
    def __init__(self, world: World, rule: str, server: MariaDbServer, database: str) -> None:
        self.world, self.rule, self.server, self.database = world, rule, server, database
        self.specs: list[Spec] = rows_for(rule)
        self.plain: dict[tuple[int, str], bytes] = {}
        self.settings = world.settings(server.url(database), target_settings(world.scheme, rule))
        self._build()

    @property
    def tenant(self) -> str | None:
        return TENANT if self.rule == "tenant" else None

    def _build(self) -> None:
        ctype = COLUMN_TYPE[self.world.scheme]
        for s in self.specs:
            for column in ("a", "b") if s.b_present else ("a",):
                self.plain[(s.id, column)] = f"{self.world.scheme} {self.rule} {s.id}{column}".encode()
        old = [k for k in self.plain if self._spec(k[0]).on_old_key]
        cur = [k for k in self.plain if k not in old]
        old_values, cur_values = self.world.encrypt([self.plain[k] for k in old], [self.plain[k] for k in cur])
        stored = dict(zip(old + cur, old_values + cur_values))
        with contextlib.closing(self.server.connect(self.database)) as conn, conn.cursor() as cur_:
            # utf8mb4_general_ci, as an application's tables often are: it folds case and trailing blanks.
            cur_.execute(f"CREATE TABLE {TABLE} (id BIGINT PRIMARY KEY, tenant_id VARCHAR(64), deleted VARCHAR(64),"
                         f" key_version INT, a {ctype}, b {ctype}, note VARCHAR(64) NOT NULL,"
                         " version INT NOT NULL DEFAULT 7,"
                         " updated_at TIMESTAMP NOT NULL DEFAULT '2020-01-02 03:04:05' ON UPDATE CURRENT_TIMESTAMP)"
                         " CHARACTER SET utf8mb4 COLLATE utf8mb4_general_ci")
            cur_.executemany(
                f"INSERT INTO {TABLE} (id, tenant_id, deleted, key_version, a, b, note) VALUES (%s, %s, %s, %s, %s, %s, %s)",
                [(s.id, s.tenant, s.deleted,
                  int(self.world.old_key if s.on_old_key else self.world.current_key)
                  if self.world.scheme == "aesgcm" else None,
                  stored[(s.id, "a")], stored.get((s.id, "b")), f"note {s.id}") for s in self.specs])

    def _spec(self, row_id: int) -> Spec:
        return next(s for s in self.specs if s.id == row_id)

    def snapshot(self) -> dict[int, dict[str, Any]]:
        with contextlib.closing(self.server.connect(self.database)) as conn, \
                conn.cursor(pymysql.cursors.DictCursor) as cur:
            cur.execute(f"SELECT * FROM {TABLE} ORDER BY id")
            return {int(row["id"]): dict(row) for row in cur.fetchall()}

    def ids(self, *, in_scope: bool, old: bool | None = None) -> set[int]:
        return {s.id for s in self.specs if s.in_scope == in_scope and (old is None or s.on_old_key == old)}

    def units(self, *, in_scope: bool, old: bool | None = None, values: bool) -> int:
        chosen = [s for s in self.specs if s.in_scope == in_scope and (old is None or s.on_old_key == old)]
        return sum(1 + s.b_present for s in chosen) if values else len(chosen)

    def run(self, *, dry_run: bool = False, tenant: str | None | bool = True) -> rotation.RunReport:
        report = rotation.run_rotation(self.settings, dry_run=dry_run,
                                       tenant=self.tenant if tenant is True else None,
                                       expected_key=None if dry_run else self.world.expected_key)
        assert report.exit_code == rotation.EXIT_OK, report.as_dict()
        return report

    def inventory(self, *, deep: bool) -> Any:
        engine: sa.Engine = make_engine(self.settings.database.url, pool_size=1)
        try:
            provider = build_provider(self.settings)
            inv = take_mysql_inventory(engine, self.settings, provider.load_keyring(), deep=deep, tenant=self.tenant,
                                       provider=provider)
        finally:
            engine.dispose()
        return inv.targets[TARGET]


@pytest.fixture(params=SCHEMES)
def world(request: pytest.FixtureRequest) -> World:
    return WORLDS[request.param](request)


@pytest.mark.parametrize("rule", RULES)
def test_every_command_keeps_to_the_scope_rule_on_mariadb(world: World, rule: str, mariadb: MariaDbServer,
                                                          mysql_database: str) -> None:
    case = MySqlCase(world, rule, mariadb, mysql_database)  # the module's own server (private_mariadb)
    values = world.inventory_counts_values
    old_in = case.units(in_scope=True, old=True, values=values)
    cur_in = case.units(in_scope=True, old=False, values=values)
    excluded = case.units(in_scope=False, values=values)
    excluded_old = case.units(in_scope=False, old=True, values=values)
    assert excluded_old > 0, "the case needs out-of-scope rows on the old key"
    before = case.snapshot()

    def expect(*, historical: int, active: int) -> dict[str, int]:
        out = dict.fromkeys(CATEGORIES, 0)
        out.update(ACTIVE=active, HISTORICAL=historical, EXCLUDED=excluded)
        return out

    # The inventory, shallow and deep: out-of-scope rows EXCLUDED, by key.
    for deep in (False, True):
        t = case.inventory(deep=deep)
        assert t.counts == expect(historical=old_in, active=cur_in), f"deep={deep}"
        assert t.by_key == {world.old_key: old_in, world.current_key: cur_in}, f"deep={deep}"
        assert t.excluded_by_key == {world.old_key: excluded_old, world.current_key: excluded - excluded_old}

    # The gate before the run: closed, every tenant counted.
    always = dict.fromkeys(("UNKNOWN", "UNKNOWN_KEY", "BLOCKED", "FAILED", "CONFLICT"), 0)
    closed = mysql_retire_gate(case.settings, world.old_key, tenant=case.tenant)
    assert not closed.open
    if rule == "tenant":
        assert closed.blocking == {**always, "EXCLUDED": 0, "HISTORICAL": old_in + excluded_old}
        assert closed.slice is not None and closed.slice["targets"][TARGET]["excluded_on_key"] == excluded_old
    else:
        assert closed.blocking == {**always, "EXCLUDED": excluded_old, "HISTORICAL": old_in}
        assert closed.targets[TARGET]["excluded_by_rule"] == {rule: excluded_old}

    # A dry run writes nothing and counts what the run then does.
    dry = case.run(dry_run=True)
    assert not changed(before, case.snapshot()), "an inventory, a gate or a dry run wrote"
    expected = case.units(in_scope=True, old=True, values=world.run_counts_values)
    assert (dry.targets[TARGET].reencrypted, dry.targets[TARGET].backlog_before) == (expected, expected)

    # The run rewrites exactly the in-scope rows on the old key; only their cipher (and key-version) columns.
    report = case.run()
    after = case.snapshot()
    assert sorted(changed(before, after)) == sorted(case.ids(in_scope=True, old=True))
    for row_id in case.ids(in_scope=True, old=True):
        row, was = after[row_id], before[row_id]
        assert_on_current_key(world, case.plain, row_id, row)
        kept = ("tenant_id", "deleted", "note", "version", "updated_at")
        assert {k: row[k] for k in kept} == {k: was[k] for k in kept}
    r = report.targets[TARGET]
    assert r.reencrypted == expected and (r.failed, r.conflicts, r.backlog_remaining) == ([], 0, 0)
    gate = report.gate[world.old_key]
    if rule == "tenant":
        assert gate["open"] is False and gate["blocking"] == {"HISTORICAL": excluded_old}
    else:
        assert gate == {"open": False, "blocking": {"EXCLUDED": excluded_old}}

    t = case.inventory(deep=False)
    assert t.counts == expect(historical=0, active=old_in + cur_in)
    assert t.excluded_by_key == {world.old_key: excluded_old, world.current_key: excluded - excluded_old}

    # After it: still closed while out-of-scope rows are on the key; erase_excluded opens it
    # (soft delete, require_not_null); a run over every tenant does (tenant).
    for deep in (True, False):
        gate_after = mysql_retire_gate(case.settings, world.old_key, tenant=case.tenant, deep=deep)
        assert not gate_after.open, gate_after.as_dict()
        if rule == "tenant":
            assert gate_after.blocking["HISTORICAL"] == excluded_old and gate_after.blocking["EXCLUDED"] == 0
        else:
            assert {c: n for c, n in gate_after.blocking.items() if n} == {"EXCLUDED": excluded_old}
            erased = mysql_retire_gate(case.settings, world.old_key, deep=deep, erase_excluded=True)
            assert erased.open, erased.as_dict()
            assert erased.as_dict()["excluded_on_key"] == {TARGET: {rule: excluded_old}}
    if rule == "tenant":
        case.run(tenant=False)
        opened = mysql_retire_gate(case.settings, world.old_key, tenant=case.tenant)
        assert opened.open, opened.as_dict()
