"""THE scope rule, one matrix: scheme x scope rule x command, on real PostgreSQL (and OpenBao for Transit).

Every case builds one small table with rows in and out of scope, some on the old key and some on
the current one, and drives one command through the core API as the CLI would (``run``,
``run --dry-run``, ``inventory``, ``gate --retire OLD``). Whatever the command, rows out of scope
are never rewritten (whole rows compared before and after, ``xmin`` included) and they are counted
EXCLUDED. The gate for the old key is decided over every tenant (contract §6): other tenants' rows
keep it closed whatever ``--tenant`` says, and soft-deleted / ``require_not_null`` rows on the key
keep it closed (EXCLUDED, by rule) unless ``erase_excluded`` accepts erasing them. Keys are random
TEST keys made here; nothing is mocked.
"""

from __future__ import annotations

import abc
import base64
import secrets
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from pinrotate_core import rotation
from pinrotate_core.config import Settings, VaultSettings, settings_from_mapping
from pinrotate_core.gate import retire_gate
from pinrotate_core.keyring import Key, Keyring
from pinrotate_core.providers.vault import VaultTransitKeyProvider
from pinrotate_core.schemes.aesgcm import AesGcmCipherSet
from pinrotate_core.schemes.fpc1_values import Fpc1CipherSet

from .transit_helpers import transit_decrypt, transit_encrypt
from .vault_server import BaoAdmin

TARGET = "M"
TABLE = "scoped"
BATCH = 2  # several batches over a dozen rows: keyset paging must keep to the scope too
# Tenants chosen to trip a predicate that is not exact equality: LIKE metacharacters, a quote,
# a case variant, a prefix match, and a pattern match ('t%1''' LIKE-matches 't21''').
TENANT = "t%1'"
OTHER_TENANTS = ("t%1'x", "T%1'", "t21'", "t%")


# -- the rows of one case ------------------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    """One seeded row: where it stands for the scope rule, and which key its values are on."""

    id: int
    on_old_key: bool
    in_scope: bool
    tenant: str | None = TENANT
    deleted: str | None = None
    b_present: bool = True


def rows_for(rule: str) -> list[Spec]:
    """In-scope and out-of-scope rows for ``rule``, on the old and on the current key.

    Columns a rule does not configure vary too (a soft-delete flag under the tenant rule, other
    tenants under the soft-delete rule): only the configured rule may exclude a row.
    """
    specs: list[tuple[bool, bool, str | None, str | None, bool]] = []  # (old, in scope, tenant, deleted, b)
    if rule == "tenant":
        specs += [(True, True, TENANT, None, True), (True, True, TENANT, "yes", True),
                  (True, True, TENANT, None, False), (False, True, TENANT, None, True)]
        specs += [(True, False, t, None, True) for t in OTHER_TENANTS]
        specs += [(True, False, None, None, True), (False, False, OTHER_TENANTS[0], None, True),
                  (True, False, OTHER_TENANTS[1], None, False)]
    elif rule == "soft_delete":
        # Live: NULL, and the false-like texts of the scope rule; deleted: anything else.
        specs += [(True, True, "x", d, True) for d in (None, "false", "0", " No ", "", "off", "0.00")]
        specs += [(False, True, "y", None, True), (True, True, None, "f", False)]
        # "0\n": blanks are spaces; a newline is no blank, and "$" of the zero pattern is the
        # text's end on every engine (PCRE and ICU would match it before the newline).
        specs += [(True, False, "x", d, True) for d in ("true", "yes", "1", "2021-03-04 05:06:07+00", " T ", "0\n")]
        specs += [(False, False, "y", "true", True), (True, False, None, "-1", False)]
    elif rule == "require_not_null":
        specs += [(True, True, "x", None, True), (True, True, None, "yes", True), (True, True, "y", None, True),
                  (False, True, "x", None, True)]
        specs += [(True, False, "x", None, False), (True, False, "y", None, False), (True, False, None, "1", False),
                  (False, False, "x", None, False)]
    else:
        raise AssertionError(rule)
    # Ids interleave in and out of scope, so every batch of BATCH ids mixes them.
    return [Spec(i, old, scoped, tenant, deleted, b)
            for i, (old, scoped, tenant, deleted, b) in enumerate(_interleave(specs), start=1)]


def _interleave(specs: list[tuple[bool, bool, str | None, str | None, bool]]) -> list[tuple[Any, ...]]:
    inside = [s for s in specs if s[1]]
    outside = [s for s in specs if not s[1]]
    out: list[tuple[Any, ...]] = []
    while inside or outside:
        for group in (outside, inside):
            if group:
                out.append(group.pop(0))
    return out


def target_settings(scheme: str, rule: str) -> dict[str, Any]:
    t: dict[str, Any] = {"name": TARGET, "table": TABLE, "id": "id", "columns": ["a", "b"], "format": scheme}
    if scheme == "aesgcm":
        t["key_version"] = "key_version"
    if rule == "tenant":
        t["tenant"] = "tenant_id"
    elif rule == "soft_delete":
        t["soft_delete"] = "deleted"
    else:
        t["require_not_null"] = ["b"]
    return t


# -- one scheme: its keys, its values, its settings ------------------------------------------------


class World(abc.ABC):
    """What differs between schemes: how values are made and read back, and the keys' names."""

    scheme: str
    old_key: str
    current_key: str
    column_type: str = "text"
    expected_key: str | None = None
    # Reports count rows or values: (run, inventory).
    run_counts_values: bool = False
    inventory_counts_values: bool = False

    @abc.abstractmethod
    def encrypt(self, old: list[bytes], current: list[bytes]) -> tuple[list[Any], list[Any]]:
        """Stored values of the plaintexts: ``old`` on the old key, ``current`` on the current one."""

    @abc.abstractmethod
    def decrypt(self, row: dict[str, Any], column: str) -> bytes:
        """The plaintext of ``row[column]``, read with whatever key it names."""

    @abc.abstractmethod
    def key_of(self, row: dict[str, Any], column: str) -> str:
        """The key that ``row[column]`` is on, as the inventory names it."""

    @abc.abstractmethod
    def settings(self, database_url: str, target: dict[str, Any]) -> Settings:
        """Settings for one target over this scheme's keys."""


def write_keys_file(path: Path, current: str, keys: dict[str, bytes]) -> None:
    quote = (lambda k: k) if current.isdigit() else (lambda k: f'"{k}"')
    lines = [f"current = {quote(current)}", "", "[keys]"]
    lines += [f'{k} = "{base64.b64encode(v).decode()}"' for k, v in keys.items()]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    path.chmod(0o600)


class FileKeysWorld(World):
    def __init__(self, keys_file: Path, key_length: int) -> None:
        self.keys_file = keys_file
        self.material = {self.old_key: secrets.token_bytes(key_length),
                         self.current_key: secrets.token_bytes(key_length)}
        write_keys_file(keys_file, self.current_key, self.material)
        self.ring = Keyring(current=self.current_key, keys={k: Key(k, v) for k, v in self.material.items()},
                            source="test")

    def ring_on(self, key: str) -> Keyring:
        return Keyring(current=key, keys={key: Key(key, self.material[key])}, source="test")

    def settings(self, database_url: str, target: dict[str, Any]) -> Settings:
        return settings_from_mapping({
            "database": {"url": database_url},
            "keys": {"provider": "file", "file": str(self.keys_file)},
            "job": {"batch_size": BATCH, "inter_batch_delay": 0},
            "targets": [target],
        }, env={})


class AesGcmWorld(FileKeysWorld):
    scheme = "aesgcm"
    old_key, current_key = "1", "2"
    column_type = "bytea"

    def __init__(self, keys_file: Path) -> None:
        super().__init__(keys_file, 32)

    def encrypt(self, old: list[bytes], current: list[bytes]) -> tuple[list[Any], list[Any]]:
        return ([AesGcmCipherSet(self.ring).cipher(self.old_key).encrypt(p) for p in old],
                [AesGcmCipherSet(self.ring).encrypt_current(p) for p in current])

    def decrypt(self, row: dict[str, Any], column: str) -> bytes:
        return AesGcmCipherSet(self.ring).decrypt(str(row["key_version"]), bytes(row[column]))

    def key_of(self, row: dict[str, Any], column: str) -> str:
        return str(row["key_version"])


class Fpc1World(FileKeysWorld):
    scheme = "fpc1"
    old_key, current_key = "k1", "k2"
    expected_key = "k2"
    run_counts_values = inventory_counts_values = True

    def __init__(self, keys_file: Path) -> None:
        super().__init__(keys_file, 16)

    def encrypt(self, old: list[bytes], current: list[bytes]) -> tuple[list[Any], list[Any]]:
        return ([Fpc1CipherSet(self.ring_on(self.old_key)).encrypt_current("SM4", p) for p in old],
                [Fpc1CipherSet(self.ring).encrypt_current("SM4", p) for p in current])

    def decrypt(self, row: dict[str, Any], column: str) -> bytes:
        return Fpc1CipherSet(self.ring).decrypt(row[column])

    def key_of(self, row: dict[str, Any], column: str) -> str:
        return str(row[column]).split(":")[2]  # FPC1:<algorithm>:<key id>:<payload>


class TransitWorld(World):
    scheme = "vault-transit"
    old_key, current_key = "1", "2"
    inventory_counts_values = True  # the drain counts rows, the inventory values (contract §6)

    def __init__(self, server: Any) -> None:
        self.server = server
        self.mount, self.key = f"transit-{uuid.uuid4().hex[:8]}", "pii"
        BaoAdmin.of(server).enable_secrets(self.mount, "transit")
        BaoAdmin.of(server).api("POST", f"{self.mount}/keys/{self.key}", {"type": "aes256-gcm96"})
        self.provider = VaultTransitKeyProvider(VaultSettings(addr=server.addr, token=server.token,
                                                              transit_mount=self.mount, key=self.key))

    def encrypt(self, old: list[bytes], current: list[bytes]) -> tuple[list[Any], list[Any]]:
        before = transit_encrypt(self.provider, old)
        self.provider.rotate()
        return before, transit_encrypt(self.provider, current)

    def decrypt(self, row: dict[str, Any], column: str) -> bytes:
        return transit_decrypt(self.provider, [row[column]])[0]

    def key_of(self, row: dict[str, Any], column: str) -> str:
        return str(row[column]).split(":")[1].removeprefix("v")

    def settings(self, database_url: str, target: dict[str, Any]) -> Settings:
        return settings_from_mapping({
            "database": {"url": database_url},
            "keys": {"provider": "vault-transit", "vault": {"addr": self.server.addr, "token": self.server.token,
                                                            "transit_mount": self.mount, "key": self.key}},
            "job": {"batch_size": BATCH, "inter_batch_delay": 0},
            "targets": [target],
        }, env={})


# -- one case ------------------------------------------------------------------------------------

Snapshot = dict[int, dict[str, Any]]


@dataclass
class Case:
    world: World
    rule: str
    conn: psycopg.Connection[Any]
    settings: Settings
    specs: list[Spec]
    plain: dict[tuple[int, str], bytes]

    @property
    def tenant(self) -> str | None:
        return TENANT if self.rule == "tenant" else None

    def snapshot(self) -> Snapshot:
        """Every row, every column, and ``xmin``: a row rewritten with the same bytes shows too."""
        cur = self.conn.execute(sql.SQL("SELECT xmin::text AS xmin, * FROM {} ORDER BY id").format(
            sql.Identifier(TABLE)))
        names = [d.name for d in cur.description or ()]
        return {row["id"]: row for row in (dict(zip(names, values)) for values in cur.fetchall())}

    def ids(self, *, in_scope: bool, old: bool | None = None) -> set[int]:
        return {s.id for s in self.specs if s.in_scope == in_scope and (old is None or s.on_old_key == old)}

    def units(self, *, in_scope: bool, old: bool | None = None, values: bool) -> int:
        """Rows, or values (a row with both columns set counts twice), of the rows selected."""
        chosen = [s for s in self.specs if s.in_scope == in_scope and (old is None or s.on_old_key == old)]
        return sum(1 + s.b_present for s in chosen) if values else len(chosen)

    def run(self, *, dry_run: bool) -> rotation.RunReport:
        return rotation.run_rotation(self.settings, dry_run=dry_run, tenant=self.tenant,
                                     expected_key=None if dry_run else self.world.expected_key)

    def assert_out_of_scope_untouched(self, before: Snapshot, after: Snapshot) -> None:
        rewritten = changed(before, after) & self.ids(in_scope=False)
        assert not rewritten, f"out-of-scope rows rewritten: {sorted(rewritten)}"


def assert_on_current_key(world: World, plain: dict[tuple[int, str], bytes], row_id: int,
                          row: dict[str, Any]) -> None:
    """Row ``row_id``'s values are on the current key with their plaintexts; a NULL stayed NULL."""
    for column in ("a", "b"):
        if (row_id, column) not in plain:
            assert row[column] is None, f"row {row_id}: NULL {column} did not stay NULL"
            continue
        assert world.key_of(row, column) == world.current_key
        assert world.decrypt(row, column) == plain[(row_id, column)]


def changed(before: Snapshot, after: Snapshot) -> set[int]:
    """Ids of rows that differ in any column or were written at all (ids only: never a value in a message)."""
    assert after.keys() == before.keys(), "rows appeared or disappeared"
    return {i for i in after if after[i] != before[i]}


def build_case(world: World, rule: str, database_url: str, conn: psycopg.Connection[Any]) -> Case:
    ctype = sql.SQL(world.column_type)
    conn.execute(sql.SQL("""
        CREATE TABLE {} (
            id bigint PRIMARY KEY,
            tenant_id text,
            deleted text,
            key_version integer,
            a {ctype},
            b {ctype},
            note text NOT NULL,
            version integer NOT NULL DEFAULT 7,
            updated_at timestamptz NOT NULL DEFAULT '2020-01-02 03:04:05+00'
        )""").format(sql.Identifier(TABLE), ctype=ctype))
    specs = rows_for(rule)
    plain: dict[tuple[int, str], bytes] = {}
    for s in specs:
        for column in ("a", "b") if s.b_present else ("a",):
            plain[(s.id, column)] = f"{world.scheme} {rule} {s.id}{column} ".encode() + secrets.token_hex(5).encode()  # text: Forge encrypts strings
    old = [k for k in plain if next(s for s in specs if s.id == k[0]).on_old_key]
    cur = [k for k in plain if k not in old]
    old_values, cur_values = world.encrypt([plain[k] for k in old], [plain[k] for k in cur])
    stored = dict(zip(old + cur, old_values + cur_values))
    with conn.cursor() as c:
        c.executemany(
            sql.SQL("INSERT INTO {} (id, tenant_id, deleted, key_version, a, b, note) "
                    "VALUES (%s, %s, %s, %s, %s, %s, %s)").format(sql.Identifier(TABLE)),
            [(s.id, s.tenant, s.deleted,
              int(world.old_key if s.on_old_key else world.current_key) if world.scheme == "aesgcm" else None,
              stored[(s.id, "a")], stored.get((s.id, "b")), f"note {s.id}") for s in specs])
    settings = world.settings(database_url, target_settings(world.scheme, rule))
    return Case(world, rule, conn, settings, specs, plain)


WORLDS: dict[str, Callable[[pytest.FixtureRequest], World]] = {
    "aesgcm": lambda request: AesGcmWorld(request.getfixturevalue("keys_file")),
    "fpc1": lambda request: Fpc1World(request.getfixturevalue("keys_file")),
    "vault-transit": lambda request: TransitWorld(request.getfixturevalue("openbao")),
}
SCHEMES = [pytest.param("aesgcm"), pytest.param("fpc1"), pytest.param("vault-transit", marks=pytest.mark.vault)]
RULES = ["tenant", "soft_delete", "require_not_null"]


@pytest.fixture(params=SCHEMES)
def world(request: pytest.FixtureRequest) -> World:
    return WORLDS[request.param](request)


@pytest.fixture(params=RULES)
def case(request: pytest.FixtureRequest, world: World, database_url: str, pg_conn: psycopg.Connection[Any]) -> Case:
    return build_case(world, request.param, database_url, pg_conn)


def counts(report: rotation.RunReport) -> dict[str, Any]:
    """A run's per-target report without its timing."""
    return {k: v for k, v in report.as_dict()["targets"][TARGET].items() if k != "duration_ms"}


# -- the commands ----------------------------------------------------------------------------------


def test_run_rewrites_only_in_scope_rows_on_the_old_key(case: Case) -> None:
    world = case.world
    before = case.snapshot()

    report = case.run(dry_run=False)

    assert report.exit_code == rotation.EXIT_OK, report.as_dict()
    after = case.snapshot()
    case.assert_out_of_scope_untouched(before, after)
    moved = changed(before, after)
    assert sorted(moved) == sorted(case.ids(in_scope=True, old=True))
    for row_id in moved:
        row, was = after[row_id], before[row_id]
        assert_on_current_key(world, case.plain, row_id, row)
        # Only the cipher columns (and aesgcm's key-version column) change.
        kept = {k: v for k, v in row.items() if k not in ("xmin", "a", "b", "key_version")}
        assert kept == {k: v for k, v in was.items() if k not in ("xmin", "a", "b", "key_version")}
    r = report.targets[TARGET]
    assert r.reencrypted == case.units(in_scope=True, old=True, values=world.run_counts_values)
    assert (r.failed, r.conflicts, r.backlog_remaining) == ([], 0, 0)
    # The run's own gate for the old key is over every tenant: what is left out of scope keeps it closed.
    left = case.units(in_scope=False, old=True, values=world.inventory_counts_values)
    gate = report.gate[world.old_key]
    if case.rule == "tenant":
        # Other tenants' (and NULL-tenant) rows are the backlog of an unfiltered run: HISTORICAL.
        assert gate["open"] is False and gate["blocking"] == {"HISTORICAL": left}
        # The tenant's own slice is shown, empty, and labelled as not deciding.
        assert gate["slice"]["decides"] is False and gate["slice"]["tenant"] == TENANT
        assert gate["slice"]["targets"][TARGET]["on_key"] == 0
    else:
        # No run ever takes them: they stay on the old key until destroying it erases them.
        assert gate == {"open": False, "blocking": {"EXCLUDED": left}}


def test_dry_run_writes_nothing_and_counts_what_the_run_then_does(case: Case) -> None:
    before = case.snapshot()

    dry = case.run(dry_run=True)

    assert dry.exit_code == rotation.EXIT_OK, dry.as_dict()
    assert not changed(before, case.snapshot()), "a dry run wrote"
    expected = case.units(in_scope=True, old=True, values=case.world.run_counts_values)
    assert dry.targets[TARGET].reencrypted == expected
    assert dry.targets[TARGET].backlog_before == expected

    real = case.run(dry_run=False)

    assert real.exit_code == rotation.EXIT_OK, real.as_dict()
    assert counts(dry) == counts(real)
    case.assert_out_of_scope_untouched(before, case.snapshot())


def test_inventory_counts_out_of_scope_rows_as_excluded(case: Case) -> None:
    world = case.world
    values = world.inventory_counts_values
    before = case.snapshot()
    excluded = case.units(in_scope=False, values=values)
    excluded_old = case.units(in_scope=False, old=True, values=values)
    everything = excluded + case.units(in_scope=True, values=values)

    def expect(*, historical: int, active: int) -> dict[str, int]:
        out = dict.fromkeys(("ACTIVE", "HISTORICAL", "NEWER", "LEGACY", "UNKNOWN", "UNKNOWN_KEY", "EXCLUDED",
                             "FAILED", "CONFLICT", "BLOCKED"), 0)
        out.update(ACTIVE=active, HISTORICAL=historical, EXCLUDED=excluded, total=everything)
        return out

    def observed(deep: bool) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
        inv = rotation.inventory(case.settings, deep=deep, tenant=case.tenant)
        t = inv.targets[TARGET]
        return {**t.counts, "total": t.total}, t.by_key, t.excluded_by_key

    old_in = case.units(in_scope=True, old=True, values=values)
    cur_in = case.units(in_scope=True, old=False, values=values)
    for deep in (False, True):
        got, by_key, excluded_by_key = observed(deep)
        assert got == expect(historical=old_in, active=cur_in), f"deep={deep}"
        assert by_key == {world.old_key: old_in, world.current_key: cur_in}
        assert excluded_by_key == {world.old_key: excluded_old, world.current_key: excluded - excluded_old}
    assert not changed(before, case.snapshot()), "an inventory wrote"

    assert case.run(dry_run=False).exit_code == rotation.EXIT_OK

    got, by_key, excluded_by_key = observed(False)
    assert got == expect(historical=0, active=old_in + cur_in)
    assert by_key == {world.current_key: old_in + cur_in}
    assert excluded_by_key == {world.old_key: excluded_old, world.current_key: excluded - excluded_old}


def test_gate_stays_closed_while_rows_out_of_scope_are_on_the_key(case: Case) -> None:
    world = case.world
    values = world.inventory_counts_values
    excluded_old = case.units(in_scope=False, old=True, values=values)
    assert excluded_old > 0, "the case needs out-of-scope rows on the old key"
    before = case.snapshot()
    always = dict.fromkeys(("UNKNOWN", "UNKNOWN_KEY", "BLOCKED", "FAILED", "CONFLICT"), 0)

    closed = retire_gate(case.settings, world.old_key, tenant=case.tenant)

    assert not closed.open
    if case.rule == "tenant":
        # The verdict counts every tenant: the other tenants' rows are on the key (HISTORICAL).
        assert closed.blocking == {**always, "EXCLUDED": 0,
                                   "HISTORICAL": case.units(in_scope=True, old=True, values=values) + excluded_old}
        assert closed.targets[TARGET]["excluded_on_key"] == 0
        assert closed.slice is not None and closed.slice["targets"][TARGET]["excluded_on_key"] == excluded_old
    else:
        assert closed.blocking == {**always, "EXCLUDED": excluded_old,
                                   "HISTORICAL": case.units(in_scope=True, old=True, values=values)}
        assert closed.targets[TARGET]["excluded_by_rule"] == {case.rule: excluded_old}
    assert not changed(before, case.snapshot()), "a gate wrote"

    assert case.run(dry_run=False).exit_code == rotation.EXIT_OK

    for deep in (True, False):
        gate = retire_gate(case.settings, world.old_key, tenant=case.tenant, deep=deep)
        assert not gate.open, gate.as_dict()
        if case.rule == "tenant":
            assert gate.blocking["HISTORICAL"] == excluded_old and gate.blocking["EXCLUDED"] == 0
            assert gate.slice is not None and gate.slice["targets"][TARGET]["on_key"] == 0
            assert gate.slice["decides"] is False
        else:
            assert {c: n for c, n in gate.blocking.items() if n} == {"EXCLUDED": excluded_old}
            assert gate.targets[TARGET]["on_key"] == 0
            erased = retire_gate(case.settings, world.old_key, deep=deep, erase_excluded=True)
            assert erased.open, erased.as_dict()
            assert erased.as_dict()["excluded_on_key"] == {TARGET: {case.rule: excluded_old}}
            assert erased.as_dict()["erase_excluded"] is True
    if case.rule == "tenant":
        # Only a run over every tenant takes the other tenants' rows; then the gate opens.
        assert rotation.run_rotation(case.settings, expected_key=world.expected_key).exit_code == rotation.EXIT_OK
        gate = retire_gate(case.settings, world.old_key, tenant=case.tenant)
        assert gate.open, gate.as_dict()
        assert gate.as_dict()["excluded_on_key"] == {}


def test_a_tenant_column_under_a_case_insensitive_collation_scopes_exactly(
        database_url: str, pg_conn: psycopg.Connection[Any], keys_file: Path) -> None:
    """``--tenant acme`` takes 'acme' and never 'ACME', whatever the column's collation: the tenant
    is compared byte for byte (COLLATE "C"). Under a nondeterministic ICU collation the comparison
    once failed outright (a collation conflict with the inlined literal), and a plain comparison
    would take both."""
    try:
        pg_conn.execute("CREATE COLLATION pr_case_insensitive (provider = icu, locale = 'und-u-ks-level2', "
                        "deterministic = false)")
    except psycopg.errors.FeatureNotSupported:
        pytest.skip("this server has no ICU collations")
    world = AesGcmWorld(keys_file)
    old, _current = world.encrypt([b"a", b"b", b"c"], [])
    pg_conn.execute("CREATE TABLE scoped (id bigint PRIMARY KEY, key_version integer, c bytea, "
                    "tenant text COLLATE pr_case_insensitive)")
    for i, (value, tenant) in enumerate(zip(old, ("acme", "ACME", "Acme"), strict=True)):
        pg_conn.execute("INSERT INTO scoped VALUES (%s, 1, %s, %s)", (i, value, tenant))
    settings = world.settings(database_url, {"name": TARGET, "table": TABLE, "key_version": "key_version",
                                             "columns": ["c"], "tenant": "tenant"})
    inv = rotation.inventory(settings, tenant="acme").targets[TARGET]
    assert inv.counts.get("HISTORICAL") == 1 and inv.excluded_by_rule == {"tenant": {"1": 2}}, inv.as_dict()
    report = rotation.run_rotation(settings, tenant="acme")
    assert report.targets[TARGET].reencrypted == 1
    rows = dict(pg_conn.execute("SELECT tenant, key_version FROM scoped").fetchall())
    assert rows == {"acme": 2, "ACME": 1, "Acme": 1}, rows
