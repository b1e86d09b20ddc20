"""The fpc1 migration path on MariaDB (issue 32): the tests of tests/test_fpc1_migration.py, their
bodies run on a MariaDB database through ``MariaFpc1Db`` (tests/fpc1_db.py), with the generic schema's
MySQL twin (tests/data/fpc1_generic_mysql.sql): inventory, dry run, compare-and-swap run, JSON paths
inside a text or JSON column, legacy values, CONFLICTs, tenants, soft deletes, BLOCKED causes and the
gate. Values are made and read back by the tests' own ECB code.

Not twinned: what ``rotation.read_current_key`` decides before any engine is asked anything (the
refusals at the start: ``write_versioned``, ``--expected-key-version``, a 32-byte key; the first
run's keyring; a dry run needing no ``--expected-key-version``, whose read-only proof is PostgreSQL's
``pg_stat_user_tables``); the soft-delete rule's SQL (``live_condition`` composes PostgreSQL SQL;
tests/test_scope_matrix_mysql.py reads the words on MariaDB); a read-only database
(``default_transaction_read_only``; the read-only auditor is tests/test_privileges_mysql.py); and
``length_after`` (no database). Left to tests/test_scope_matrix_mysql.py, which runs every command
of an fpc1 target under each scope rule on MariaDB (suite time): the tenant run and the soft-deleted
rows (EXCLUDED, the gate decided over every tenant; the round trip here checks both too).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests import test_fpc1_migration as pg
from tests.fpc1_db import MariaFpc1Db
from tests.mariadb_server import MariaDbServer, private_mariadb, private_mysql_database  # noqa: F401 (fixtures)

# Runs and gates sweep every database of the server: on the shared MariaDB these tests would hold it
# alone (server_wide). The module has a mariadbd of its own instead, its tests on one worker.
pytestmark = [pytest.mark.mysql, pytest.mark.xdist_group("test_fpc1_migration_mysql")]


@pytest.fixture
def db(mariadb: MariaDbServer, mysql_database: str) -> MariaFpc1Db:
    return MariaFpc1Db(mariadb, mysql_database)


def test_legacy_and_historical_values_move_to_the_active_key_and_read_back_the_same_on_mariadb(
        db: MariaFpc1Db, keys_file: Path) -> None:
    # AES FPC1 values beside SM4 legacy ones: both ciphers in one run (Forge's SM4 alone: test_forge_on_mariadb).
    pg.test_legacy_and_historical_values_move_to_the_active_key_and_read_back_the_same(db, keys_file, "AES")


def test_json_column_fields_are_rewritten_with_compare_and_swap_on_mariadb(db: MariaFpc1Db, keys_file: Path) -> None:
    pg.test_jsonb_column_fields_are_rewritten_with_compare_and_swap(db, keys_file)


def test_dry_run_writes_nothing_and_reports_the_counts_of_the_real_run_on_mariadb(
        db: MariaFpc1Db, keys_file: Path) -> None:
    pg.test_dry_run_writes_nothing_and_reports_the_counts_of_the_real_run(db, keys_file)


def test_an_edit_between_read_and_write_is_a_conflict_and_the_edit_is_kept_on_mariadb(
        db: MariaFpc1Db, keys_file: Path, pinrotate_home: Path) -> None:
    pg.test_an_edit_between_read_and_write_is_a_conflict_and_the_edit_is_kept(db, keys_file, pinrotate_home)


def test_an_edit_inside_a_json_document_is_a_conflict_and_the_document_is_kept_on_mariadb(
        db: MariaFpc1Db, keys_file: Path) -> None:
    pg.test_an_edit_inside_a_json_document_is_a_conflict_and_the_document_is_kept(db, keys_file)


def test_deleting_a_row_between_read_and_write_is_a_conflict_and_it_stays_untouched_on_mariadb(
        db: MariaFpc1Db, keys_file: Path) -> None:
    pg.test_deleting_a_row_between_read_and_write_is_a_conflict_and_it_stays_untouched(db, keys_file)


@pytest.mark.parametrize("cause", list(pg.BLOCKED_CASES))
def test_each_blocked_cause_blocks_the_inventory_and_the_gate_and_refuses_the_run_on_mariadb(
        db: MariaFpc1Db, keys_file: Path, cause: str) -> None:
    pg.test_each_blocked_cause_blocks_the_inventory_and_the_gate_and_refuses_the_run(db, keys_file, cause)


def test_a_column_wide_enough_for_every_new_value_is_not_blocked_on_mariadb(db: MariaFpc1Db, keys_file: Path) -> None:
    pg.test_a_column_wide_enough_for_every_new_value_is_not_blocked(db, keys_file)


def test_unknown_and_unknown_key_values_are_counted_left_alone_and_the_run_fails_closed_on_mariadb(
        db: MariaFpc1Db, keys_file: Path) -> None:
    pg.test_unknown_and_unknown_key_values_are_counted_left_alone_and_the_run_fails_closed(db, keys_file)


def test_in_a_row_with_two_stale_fields_each_value_is_decided_on_its_own_on_mariadb(
        db: MariaFpc1Db, keys_file: Path) -> None:
    pg.test_in_a_row_with_two_stale_fields_each_value_is_decided_on_its_own(db, keys_file)


def test_legacy_values_are_counted_but_not_migrated_while_legacy_reading_is_off_on_mariadb(
        db: MariaFpc1Db, keys_file: Path) -> None:
    pg.test_legacy_values_are_counted_but_not_migrated_while_legacy_reading_is_off(db, keys_file)


def test_the_gate_opens_only_when_every_blocking_count_is_zero_on_mariadb(db: MariaFpc1Db, keys_file: Path) -> None:
    pg.test_the_gate_opens_only_when_every_blocking_count_is_zero(db, keys_file)


def test_a_value_outside_the_json_paths_of_a_target_column_closes_the_gate_on_mariadb(
        db: MariaFpc1Db, keys_file: Path) -> None:
    """The gate searches a target's JSON column outside its configured paths (as on PostgreSQL,
    tests/test_gate_discover.py): a k1 value nested under a field nobody configured is a find."""
    forge = pg.Forge(db)
    pg.write_keys(keys_file)
    settings = pg.forge_settings(db.url, keys_file)
    assert pg.rotation.run_rotation(settings, expected_key="k2").exit_code == pg.rotation.EXIT_OK
    assert pg.retire_gate(settings, "k1", erase_excluded=True).open
    doc = json.loads(forge.config(4))
    doc["old"] = [pg.fpc1("k1", pg.K1, b"a copy nobody configured")]
    db.execute("UPDATE lowcode_configs SET encrypt_config = %s WHERE id = 4", (json.dumps(doc),))
    gate = pg.retire_gate(settings, "k1", erase_excluded=True)
    assert not gate.open and {c: n for c, n in gate.blocking.items() if n} == {"OUTSIDE_TARGETS": 1}
    assert f"{db.database}.lowcode_configs.encrypt_config" in json.dumps(gate.as_dict())


def test_fpc1_targets_drain_with_several_workers_like_the_others_on_mariadb(
        db: MariaFpc1Db, keys_file: Path) -> None:
    # The one drain of drain/: max_degree_of_parallelism id ranges, counted exactly (no TABLESAMPLE).
    pg.test_fpc1_targets_drain_with_several_workers_like_the_others(db, keys_file)
