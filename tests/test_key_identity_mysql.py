"""A key id is one key (issue 22, point 7) on MariaDB: tests/test_key_identity.py's database tests,
the same functions, collected here with this module's fixtures (``db``, ``primary_db``,
``db_kind``, ``app_role``: tests/key_checks_records.MariaKeyChecks). The check values live in the
server's ``pinrotate`` database, one row per database and key id. A run ends with its gate, which
sweeps every database of the server and waits for every transaction in flight on it: the module
has a mariadbd of its own (tests/mariadb_server.private_mariadb), its tests on one worker.

Not here, because no database takes part: the check value's definition, the refusals of ids that
name one version twice by the file, env, k8s-dir and vault-kv providers and by any keyring, and
the exit code of a run whose shard stopped on a key mismatch. Nor the Dask worker with another key
2: a worker compares its keyring by the same call as the flow's first task (``read_current_key``,
the engine's ``confirm_key_identity``: refusing on MariaDB here and in
test_mysql_bookkeeping's flow test, and Dask shards of a MariaDB target run in
mysql_contract/test_flow_on_mariadb); what is left is the flow's own handling, engine-neutral, for
a Dask cluster and a run of about 12 s. Nor, repeated by test_mysql_bookkeeping's first test
(another host's keyring under the same key ids: its run, dry run and gate refused with one line,
exit 2, nothing written): key 2 replaced between two runs, and a gate whose key differs from the
recorded one. All keys are random TEST keys.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from pinrotate_core import rotation
from pinrotate_core.errors import RefusedToStart
from pinrotate_core.providers.file import FileKeyProvider
from tests.key_checks_records import AppRole, KeyChecksDatabase, MariaKeyChecks
from tests.mariadb_server import MariaDbServer, private_mariadb, private_mysql_database  # noqa: F401 (fixtures)

from . import test_key_identity as on_postgresql

pytestmark = [pytest.mark.mysql, pytest.mark.xdist_group("test_key_identity_mysql")]


@pytest.fixture
def db(mariadb: MariaDbServer, mysql_database: str) -> MariaKeyChecks:
    return MariaKeyChecks(mariadb, mysql_database)


@pytest.fixture
def primary_db(db: MariaKeyChecks) -> KeyChecksDatabase:
    return db


@pytest.fixture
def db_kind() -> type[KeyChecksDatabase]:
    return MariaKeyChecks


@pytest.fixture
def app_role(db: MariaKeyChecks) -> Iterator[AppRole]:
    with db.app_role() as role:
        yield role


# --- runs, through the command line ----------------------------------------------------------------------
test_a_dry_run_and_a_gate_only_compare_and_the_gate_says_when_no_check_value_was_recorded = (
    on_postgresql.test_a_dry_run_and_a_gate_only_compare_and_the_gate_says_when_no_check_value_was_recorded)

# --- recording, in the core ---------------------------------------------------------------------------------
test_two_first_runs_at_once_record_one_check_value_per_key_and_the_second_compares_with_it = (
    on_postgresql.test_two_first_runs_at_once_record_one_check_value_per_key_and_the_second_compares_with_it)
test_a_role_that_may_not_create_the_key_checks_table_is_refused_naming_the_privilege = (
    on_postgresql.test_a_role_that_may_not_create_the_key_checks_table_is_refused_naming_the_privilege)
test_a_role_that_may_read_but_not_write_the_key_checks_table_runs_dry_but_not_for_real = (
    on_postgresql.test_a_role_that_may_read_but_not_write_the_key_checks_table_runs_dry_but_not_for_real)


def test_the_grants_a_refusal_names_run_as_printed_on_mariadb_and_then_the_run_starts(
        db: MariaKeyChecks, app_role: AppRole, tmp_path: Path) -> None:
    """MySQL's own: an account is ``'user'@'host'`` in a GRANT (a bare ``user@%`` is a syntax
    error). A DBA runs each statement a refusal names, as printed, until the role's run starts."""
    keys_file = tmp_path / "keys" / "keys.toml"
    FileKeyProvider(keys_file, create=True).load_keyring()
    ctx = rotation.open_run(on_postgresql._aesgcm_settings(app_role.url, keys_file))
    try:
        ran = []
        for _ in range(3):
            try:
                rotation.read_current_key(ctx)
                break
            except RefusedToStart as refused:
                grant = re.search(r"GRANT [A-Z, ]+ ON \S+ TO '[^']+'@'%'", str(refused))
                assert grant is not None and app_role.name in str(refused), str(refused)
                db.as_owner(grant.group(0))
                ran.append(grant.group(0))
    finally:
        ctx.close()
    assert ran and ran[0].startswith("GRANT CREATE ON pinrotate.* TO "), ran
    assert set(db.recorded()) == {"1"}

# --- one key version, one id: refused at load, before the run reads or writes a row -------------------------
test_a_keys_file_with_keys_2_and_02_is_refused_by_run_with_exit_2_naming_both = (
    on_postgresql.test_a_keys_file_with_keys_2_and_02_is_refused_by_run_with_exit_2_naming_both)
test_a_lone_zero_padded_version_is_refused_before_an_aesgcm_run_writes_version_2_under_it = (
    on_postgresql.test_a_lone_zero_padded_version_is_refused_before_an_aesgcm_run_writes_version_2_under_it)

# --- OpenBao: Transit identity; a database that cannot be reached -------------------------------------------
test_a_transit_key_created_again_under_the_same_name_is_refused_and_the_same_key_is_not = (
    on_postgresql.test_a_transit_key_created_again_under_the_same_name_is_refused_and_the_same_key_is_not)
test_a_database_that_cannot_be_reached_for_the_check_is_exit_4_never_a_pass = (
    on_postgresql.test_a_database_that_cannot_be_reached_for_the_check_is_exit_4_never_a_pass)
