"""The retire gate's verdict is whole (issue 22, contract §6), on real PostgreSQL and a real OpenBao
(tests/test_gate_whole_mysql.py runs them on MariaDB, which and why in its docstring: ``db`` names the engine).

1. One verdict over everything configured: a tenant or target filter (``gate --tenant``, a run's
   ``--target``/``--tenant``) shows a slice but never answers open while another tenant or target
   still references the key.
2. Rows no run takes (soft-deleted, ``require_not_null`` unset) keep the gate closed (EXCLUDED, per
   rule) unless ``--erase-excluded`` accepts that destroying the key erases them.
3. ``vault-transit``: retiring version N retires every older one, so a value on any version <= N
   blocks N.

Keys are random TEST keys made here; nothing is mocked.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import psycopg
import pytest

from flows import reports
from pinrotate_core import rotation
from pinrotate_core.config import Settings, settings_from_mapping
from pinrotate_core.conflicts import NO_TENANT, record_conflicts
from pinrotate_core.keyring import Key, Keyring
from pinrotate_core.schemes.aesgcm import AesGcmCipherSet
from tests.pinprofile import cli, cli_all

from .helpers import assert_secret_free
from .test_fpc1_migration import K1, K2, fpc1, write_keys
from .test_scope_matrix import write_keys_file
from .test_transit_drain import new_transit, transit
from .transit_helpers import transit_encrypt
from .vault_server import BaoAdmin

ALPHA, BETA = "Alpha", "Beta"


class Database(Protocol):
    """The test's own database on either engine: what the tests below ask of it beyond pinrotate."""

    url: str
    binary: str  # the column type of raw bytes

    def execute(self, statement: str, params: Sequence[object] = ()) -> None: ...

    def executemany(self, statement: str, rows: Sequence[Sequence[object]]) -> None: ...

    def record_conflicts(self, target: str, by_tenant: Mapping[str, int], *, run_id: str) -> None:
        """What a complete run of ``target`` on another host recorded (pinrotate's own records)."""


class PgDatabase:
    """``Database`` on the test's PostgreSQL database (psycopg, autocommit)."""

    binary = "bytea"

    def __init__(self, conn: psycopg.Connection[Any], url: str) -> None:
        self.conn, self.url = conn, url

    def execute(self, statement: str, params: Sequence[object] = ()) -> None:
        self.conn.execute(statement, params)

    def executemany(self, statement: str, rows: Sequence[Sequence[object]]) -> None:
        self.conn.cursor().executemany(statement, rows)

    def record_conflicts(self, target: str, by_tenant: Mapping[str, int], *, run_id: str) -> None:
        record_conflicts(self.conn, target, by_tenant, tenant_scope=None, complete=True, run_id=run_id)


@pytest.fixture
def db(database_url: str, pg_conn: psycopg.Connection[Any]) -> Database:
    return PgDatabase(pg_conn, database_url)


@pytest.fixture
def primary_db(primary_database_url: str) -> Iterator[Database]:
    """On the primary server only: for the tests whose subject is the orchestration (Prefect)."""
    with psycopg.connect(primary_database_url, autocommit=True) as conn:
        yield PgDatabase(conn, primary_database_url)


# -- an aesgcm world: two targets sharing one keyring, with tenants, soft delete and require_not_null --


class Shared:
    """Tables ``alpha`` and ``beta`` under one file keyring (keys 1..``keys``, the last current)."""

    def __init__(self, db: Database, tmp: Path, keys: int = 2) -> None:
        self.db, self.url, self.tmp = db, db.url, tmp
        self.material = {str(k): secrets.token_bytes(32) for k in range(1, keys + 1)}
        self.current = str(keys)
        self.keys_file = tmp / "keys.toml"
        write_keys_file(self.keys_file, self.current, self.material)
        self.ring = Keyring(current=self.current, keys={k: Key(k, v) for k, v in self.material.items()},
                            source="test")
        self.plain: list[bytes] = []
        self.next_id = 1
        for table in ("alpha", "beta"):
            db.execute(f"CREATE TABLE {table} (id bigint PRIMARY KEY, tenant_id text, deleted boolean, ref text, "
                       f"key_version integer, secret {db.binary})")

    def add(self, table: str, n: int, *, key: str, tenant: str | None = "A", deleted: bool = False,
            ref: str | None = "r") -> None:
        cipher = AesGcmCipherSet(self.ring).cipher(key)
        for _ in range(n):
            plaintext = f"{table} {self.next_id} ".encode() + secrets.token_bytes(6)
            self.plain.append(plaintext)
            self.db.execute(f"INSERT INTO {table} VALUES (%s, %s, %s, %s, %s, %s)",
                            (self.next_id, tenant, deleted, ref, int(key), cipher.encrypt(plaintext)))
            self.next_id += 1

    def mapping(self) -> dict[str, Any]:
        common = {"id": "id", "key_version": "key_version", "columns": ["secret"], "format": "aesgcm",
                  "tenant": "tenant_id"}
        return {
            "database": {"url": self.url},
            "keys": {"provider": "file", "file": str(self.keys_file)},
            "job": {"batch_size": 3, "inter_batch_delay": 0},
            "targets": [{"name": ALPHA, "table": "alpha", "soft_delete": "deleted", "require_not_null": ["ref"],
                         **common},
                        {"name": BETA, "table": "beta", **common}],
        }

    def settings(self) -> Settings:
        return settings_from_mapping(self.mapping(), env={})

    def config(self) -> Path:
        """The same settings as a pinrotate.toml, for the command line."""
        m = self.mapping()
        lines = [f'[database]\nurl = "{self.url}"', f'[keys]\nprovider = "file"\nfile = "{self.keys_file}"',
                 "[job]\nbatch_size = 3\ninter_batch_delay = 0"]
        for t in m["targets"]:
            lines.append("[[targets]]\n" + "\n".join(f"{k} = {json.dumps(v)}" for k, v in t.items()))
        path = self.tmp / "pinrotate.toml"
        path.write_text("\n\n".join(lines) + "\n", encoding="utf-8")
        return path

    def gate(self, *args: str, json_out: bool = True) -> tuple[int, Any, str]:
        extra = ("--json",) if json_out else ()
        code, out, err = cli("gate", "--config", str(self.config()), *args, *extra,
                             env={"PINROTATE_HOME": str(self.tmp / "home")})
        assert_secret_free(str(out) + err, *self.material.values(), *self.plain)
        return code, out, err

    def closed_gates(self, *calls: tuple[tuple[str, ...], bool]) -> list[tuple[int, Any, str]]:
        """``gate`` for each (args, json_out), all started together: only for gates that answer
        closed, which read and write nothing (an open one settles, waiting for what is in flight)."""
        config = str(self.config())
        results = cli_all([["gate", "--config", config, *args, *(("--json",) if json_out else ())]
                           for args, json_out in calls], env={"PINROTATE_HOME": str(self.tmp / "home")})
        for code, out, err in results:
            assert code == 3, err
            assert_secret_free(str(out) + err, *self.material.values(), *self.plain)
        return results


@pytest.fixture
def shared(db: Database, tmp_path: Path) -> Shared:
    return Shared(db, tmp_path)


# -- 1. one verdict over everything configured ---------------------------------------------------------


def test_a_tenant_gate_stays_closed_while_another_tenant_holds_rows_on_the_key(shared: Shared) -> None:
    shared.add("alpha", 6, key="1", tenant="A")
    shared.add("alpha", 10, key="1", tenant="B")
    shared.add("alpha", 1, key="1", tenant=None)  # outside every tenant: an unfiltered run's backlog
    shared.add("beta", 3, key="1", tenant="A")
    settings = shared.settings()

    run = rotation.run_rotation(settings, tenant="A")
    assert run.exit_code == rotation.EXIT_OK and run.targets[ALPHA].reencrypted == 6
    # The run's own gate: over every tenant, so closed by tenant B's rows and the NULL-tenant row.
    gate = run.gate["1"]
    assert gate["open"] is False and gate["blocking"] == {"HISTORICAL": 11}
    assert gate["slice"]["decides"] is False and gate["slice"]["tenant"] == "A"
    assert {n: t["on_key"] for n, t in gate["slice"]["targets"].items()} == {ALPHA: 0, BETA: 0}

    (code, doc, err), (code_erase, doc_erase, err_erase), (code_text, text, err_text) = shared.closed_gates(
        (("--retire", "1", "--tenant", "A"), True), (("--retire", "1", "--tenant", "A", "--erase-excluded"), True),
        (("--retire", "1", "--tenant", "A"), False))
    assert code == 3, err
    assert doc["open"] is False and doc["blocking"]["HISTORICAL"] == 11 and doc["blocking"]["EXCLUDED"] == 0
    assert doc["verdict_over"] == "every configured target and tenant"
    assert doc["targets"][ALPHA]["on_key"] == 11 and doc["targets"][BETA]["on_key"] == 0
    assert doc["slice"]["decides"] is False and doc["slice"]["tenant"] == "A"
    assert doc["slice"]["targets"][ALPHA]["on_key"] == 0
    # Accepting to erase EXCLUDED rows changes nothing: other tenants' rows are not excluded from the whole.
    assert code_erase == 3 and doc_erase["open"] is False and doc_erase["blocking"]["HISTORICAL"] == 11, err_erase
    assert code_text == 3 and "CLOSED" in text and "over every configured target and tenant" in text, err_text
    assert "slice of tenant A (shown only, does not decide)" in text

    # Only a run over every tenant takes the rest; then the key may go.
    assert rotation.run_rotation(settings).exit_code == rotation.EXIT_OK
    code, doc, err = shared.gate("--retire", "1", "--tenant", "A")
    assert code == 0 and doc["open"] is True, err


def test_a_run_of_one_target_reports_the_gate_closed_while_another_target_holds_the_key(shared: Shared) -> None:
    shared.add("alpha", 5, key="1")
    shared.add("beta", 8, key="1")
    settings = shared.settings()

    run = rotation.run_rotation(settings, target_names=[ALPHA])

    assert run.exit_code == rotation.EXIT_OK and run.targets[ALPHA].backlog_remaining == 0
    gate = run.gate["1"]
    assert gate["open"] is False and gate["blocking"] == {"HISTORICAL": 8}
    assert gate["slice"] == {"decides": False, "note": gate["slice"]["note"], "tenant": None,
                             "targets": {ALPHA: {"on_key": 0, "excluded_on_key": 0, "blocking": {}}}}
    d = run.as_dict()
    assert d["gate"]["1"]["open"] is False
    summary = reports.run_report(d)
    assert "gate for key 1 (every configured target and tenant): closed (HISTORICAL=8)" in summary
    assert "does not decide" in summary
    markdown = reports.gate_markdown(d)
    assert "| 1 | closed | HISTORICAL 8 |" in markdown and "does not decide" in markdown
    assert rotation.retire_gate(settings, "1").blocking["HISTORICAL"] == 8

    # Beta drained too: now nothing anywhere is on key 1.
    again = rotation.run_rotation(settings, target_names=[BETA])
    assert again.gate["1"]["open"] is True and again.gate["1"]["blocking"] == {}


def test_the_flows_gate_artifact_is_over_every_target_for_a_run_of_one(
        prefect_api: str, primary_db: Database, tmp_path: Path) -> None:
    from flows.rotate import pinrotate_rotate

    from .test_flow import run_artifacts

    shared = Shared(primary_db, tmp_path)
    shared.add("alpha", 4, key="1")
    shared.add("beta", 8, key="1", tenant="B")

    report = pinrotate_rotate(config_path=str(shared.config()), targets=[ALPHA])

    assert report["exit_code"] == 0 and report["targets"][ALPHA]["backlog_remaining"] == 0
    assert report["gate"]["1"]["open"] is False and report["gate"]["1"]["blocking"] == {"HISTORICAL": 8}
    assert report["gate"]["1"]["slice"]["targets"][ALPHA]["on_key"] == 0
    markdown = next(a.data for a in run_artifacts(report["run_id"])["markdown"] if a.key == "pinrotate-gate")
    assert "| 1 | closed | HISTORICAL 8 |" in markdown and "OPEN" not in markdown
    assert "every configured target and tenant" in markdown and "does not decide" in markdown


def test_a_run_of_one_target_is_closed_by_conflicts_recorded_for_a_target_it_did_not_drain(
        db: Database, keys_file: Path) -> None:
    write_keys(keys_file, legacy=None)
    db.execute("CREATE TABLE f (id bigint PRIMARY KEY, pw text)")
    db.execute("CREATE TABLE g (id bigint PRIMARY KEY, pw text)")
    db.execute("INSERT INTO f VALUES (1, %s)", (fpc1("k2", K2, b"already moved"),))
    db.execute("INSERT INTO g VALUES (1, %s)", (fpc1("k1", K1, b"to move"),))
    settings = settings_from_mapping({
        "database": {"url": db.url},
        "keys": {"provider": "file", "file": str(keys_file)},
        "job": {"batch_size": 2, "inter_batch_delay": 0},
        "targets": [{"name": "F", "table": "f", "columns": ["pw"], "format": "fpc1"},
                    {"name": "G", "table": "g", "columns": ["pw"], "format": "fpc1"}],
    }, env={})
    # A run of F on another host left one CONFLICT: an application edit that may still be on k1.
    db.record_conflicts("F", {NO_TENANT: 1}, run_id="earlier")

    run = rotation.run_rotation(settings, target_names=["G"], expected_key="k2")

    assert run.exit_code == rotation.EXIT_OK and run.targets["G"].reencrypted == 1
    assert run.gate["k1"]["open"] is False and run.gate["k1"]["blocking"] == {"CONFLICT": 1}
    assert run.gate["k1"]["slice"]["targets"] == {"G": {"on_key": 0, "excluded_on_key": 0, "blocking": {}}}


# -- 2. rows no run takes keep the gate closed unless --erase-excluded -----------------------------------


def test_excluded_rows_on_the_key_close_the_gate_until_erasing_them_is_accepted(db: Database, tmp_path: Path) -> None:
    shared = Shared(db, tmp_path, keys=3)
    shared.add("alpha", 4, key="3")
    shared.add("alpha", 2, key="1", deleted=True)                # soft_delete, on key 1
    shared.add("alpha", 1, key="1", deleted=True, ref=None)      # both rules: counted once, require_not_null
    shared.add("alpha", 3, key="2", ref=None)                    # require_not_null, on key 2
    shared.add("beta", 2, key="3")

    (code, doc, err), (code_text, text, err_text), (code_2, doc_2, err_2) = shared.closed_gates(
        (("--retire", "1"), True), (("--retire", "1"), False), (("--retire", "2"), True))
    assert code == 3, err
    assert {c: n for c, n in doc["blocking"].items() if n} == {"EXCLUDED": 3}
    assert doc["erase_excluded"] is False
    assert doc["excluded_on_key"] == {ALPHA: {"require_not_null": 1, "soft_delete": 2}}
    assert doc["targets"][ALPHA]["excluded_on_key"] == 3 and doc["targets"][ALPHA]["on_key"] == 0
    assert code_text == 3 and "gate --retire 1 --erase-excluded" in text and "soft_delete=2" in text, err_text
    # Key 2: only its own excluded rows count (values on other old keys do not block it).
    assert code_2 == 3 and doc_2["excluded_on_key"] == {ALPHA: {"require_not_null": 3}}, err_2

    record = tmp_path / "record.json"
    code, doc, err = shared.gate("--retire", "1", "--erase-excluded", "--ticket", "CHG-1", "--record", str(record))
    assert code == 0 and doc["open"] is True and doc["erase_excluded"] is True, err
    assert doc["excluded_on_key"] == {ALPHA: {"require_not_null": 1, "soft_delete": 2}}
    kept = json.loads(record.read_text(encoding="utf-8"))
    assert kept["verdict"] == "open" and kept["erase_excluded"] is True
    assert kept["excluded_on_key"] == {ALPHA: {"require_not_null": 1, "soft_delete": 2}}
    assert kept["targets"][ALPHA]["gate"]["excluded_by_rule"] == {"require_not_null": 1, "soft_delete": 2}
    assert_secret_free(record.read_text(encoding="utf-8"), *shared.material.values(), *shared.plain)
    code, text, err = shared.gate("--retire", "1", "--erase-excluded", json_out=False)
    assert code == 0 and "OPEN" in text and "ERASES 3 excluded values" in text, err

    # --erase-excluded opens only when EXCLUDED is the only reason: a live row on key 1 still blocks.
    shared.add("beta", 1, key="1")
    code, doc, err = shared.gate("--retire", "1", "--erase-excluded")
    assert code == 3 and {c: n for c, n in doc["blocking"].items() if n} == {"HISTORICAL": 1}, err
    # ... and it does not block key 2 (aesgcm: values on another old key do not block KEY).
    code, doc, err = shared.gate("--retire", "2", "--erase-excluded")
    assert code == 0 and doc["open"] is True, err

    # The run's own gate (no --erase-excluded there): closed by the excluded rows.
    run = rotation.run_rotation(shared.settings())
    assert run.exit_code == rotation.EXIT_OK
    assert run.gate == {"1": {"open": False, "blocking": {"EXCLUDED": 3}},
                        "2": {"open": False, "blocking": {"EXCLUDED": 3}}}


def test_the_inventory_counts_excluded_values_per_rule_on_both_counting_paths(shared: Shared) -> None:
    shared.add("alpha", 2, key="1", deleted=True)
    shared.add("alpha", 1, key="1", deleted=True, ref=None)
    shared.add("alpha", 1, key="2", ref=None)
    shared.add("alpha", 1, key="1", tenant="B")
    settings = shared.settings()

    for deep in (False, True):  # SQL counting, then row by row
        inv = rotation.inventory(settings, deep=deep).targets[ALPHA]
        assert inv.excluded_by_rule == {"soft_delete": {"1": 2}, "require_not_null": {"1": 1, "2": 1}}
        sliced = rotation.inventory(settings, deep=deep, tenant="A").targets[ALPHA]
        assert sliced.excluded_by_rule == {"soft_delete": {"1": 2}, "require_not_null": {"1": 1, "2": 1},
                                           "tenant": {"1": 1}}
        assert sliced.counts["EXCLUDED"] == 5 == sum(sliced.excluded_by_key.values())


# -- 3. vault-transit: retiring version N retires every older one -----------------------------------------


@pytest.mark.vault
def test_transit_values_on_any_version_up_to_the_key_block_it(db: Database, openbao: Any) -> None:
    mount, key = new_transit(openbao)
    provider = transit(openbao, mount, key)
    v1 = transit_encrypt(provider, [b"one", b"one excluded"])
    provider.rotate()
    v2 = transit_encrypt(provider, [b"two"])
    provider.rotate()
    v3 = transit_encrypt(provider, [b"three", b"three again"])
    db.execute("CREATE TABLE notes (id bigint PRIMARY KEY, body text, tag text)")
    db.executemany("INSERT INTO notes VALUES (%s, %s, %s)", [
        (1, v1[0], None), (2, v2[0], None), (3, v3[0], None),
        (4, None, v1[1]),  # body NULL: out of scope (require_not_null), its tag still on v1
    ])
    settings = settings_from_mapping({
        "database": {"url": db.url},
        "keys": {"provider": "vault-transit", "vault": {"addr": openbao.addr, "token": openbao.token,
                                                        "transit_mount": mount, "key": key}},
        "job": {"batch_size": 10, "inter_batch_delay": 0},
        "targets": [{"name": "N", "table": "notes", "id": "id", "columns": ["body", "tag"],
                     "format": "vault-transit", "require_not_null": ["body"]}],
    }, env={})

    two = rotation.retire_gate(settings, "2")
    assert not two.open and two.blocking["HISTORICAL"] == 2 and two.blocking["EXCLUDED"] == 1
    assert two.targets["N"]["on_versions"] == {"1": 1, "2": 1}
    one = rotation.retire_gate(settings, "1")
    assert not one.open and one.blocking["HISTORICAL"] == 1 and one.blocking["EXCLUDED"] == 1

    # Row 1 moves to v3: only v2 is left in scope. Retiring v1 keeps v2 readable; retiring v2 does not.
    db.execute("UPDATE notes SET body = %s WHERE id = 1", (v3[1],))
    assert rotation.retire_gate(settings, "1", erase_excluded=True).open
    two = rotation.retire_gate(settings, "2", erase_excluded=True)
    assert not two.open and {c: n for c, n in two.blocking.items() if n} == {"HISTORICAL": 1}

    # A run moves v2; what is left is the excluded tag on v1, which blocks both versions.
    run = rotation.run_rotation(settings)
    assert run.exit_code == rotation.EXIT_OK
    assert run.gate == {"1": {"open": False, "blocking": {"EXCLUDED": 1}},
                        "2": {"open": False, "blocking": {"EXCLUDED": 1}}}
    two = rotation.retire_gate(settings, "2")
    assert not two.open and two.as_dict()["excluded_on_key"] == {"N": {"require_not_null": 1}}
    assert rotation.retire_gate(settings, "2", erase_excluded=True).open

    # Once Transit itself has retired v1, destroying v2 no longer loses the excluded v1 value (it is
    # gone already): only what v2 still decrypts counts.
    BaoAdmin.of(openbao).api("POST", f"{mount}/keys/{key}/config", {"min_decryption_version": 2})
    two = rotation.retire_gate(settings, "2")
    assert two.open and two.as_dict()["excluded_on_key"] == {}, two.as_dict()
