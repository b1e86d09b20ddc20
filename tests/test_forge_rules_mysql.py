"""Forge's rules on MariaDB, Forge's own metadata engine (issue 32): the tests of
tests/test_forge_rules.py, their bodies run unchanged on the machine's MariaDB through a
``ForgeTables`` of this module (a fresh database per test). Values are made and read back by that
module's own ECB code; keys are random TEST keys, or the fixed test keys it names.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from pinrotate_core.config import Settings
from pinrotate_core.drain import DrainOptions, DrainResult
from tests import test_forge_rules as rules
from tests.mariadb_server import MariaDbServer

pytestmark = pytest.mark.mysql


class MariaDbForgeTables:
    """Forge's tables in the test's fresh MariaDB database (``rules.ForgeTables``)."""

    def __init__(self, server: MariaDbServer, database: str) -> None:
        self.server, self.database = server, database
        self.url = server.url(database)

    def execute(self, statement: str, params: Sequence[Any] = ()) -> None:
        with contextlib.closing(self.server.connect(self.database)) as conn, conn.cursor() as cur:
            cur.execute(statement, tuple(params) or None)

    def column(self, table: str, name: str) -> dict[int, str | None]:
        with contextlib.closing(self.server.connect(self.database)) as conn, conn.cursor() as cur:
            cur.execute(f"SELECT id, `{name}` FROM `{table}` ORDER BY id")
            return {int(i): None if v is None else str(v) for i, v in cur.fetchall()}

    def drain_first_target(self, s: Settings, after_batch: rules.BatchHook) -> DrainResult:
        from pinrotate_core.commands.mysql.run import drain
        from pinrotate_core.commands.mysql.targets import resolve_mysql_target
        from pinrotate_core.engines.mysql.connect import make_engine, raw_connection
        from pinrotate_core.providers import build_provider
        from pinrotate_core.schemes.registry import build_scheme

        keyring = build_provider(s).load_keyring()
        engine = make_engine(self.url)
        try:
            with raw_connection(engine) as conn:
                target = resolve_mysql_target(conn, s.targets[0])
            scheme = build_scheme(target, keyring, s.keys.model_copy(update={"legacy_read_enabled": True}))
            return drain(engine, scheme, DrainOptions(batch_size=3, before_write=after_batch))
        finally:
            engine.dispose()


@pytest.fixture
def forge_tables(mariadb: MariaDbServer, mysql_database: str) -> rules.ForgeTables:
    return MariaDbForgeTables(mariadb, mysql_database)


def test_forge_values_are_counted_as_forge_counts_them_and_rotated_to_what_forge_reads_on_mariadb(
        forge_tables: rules.ForgeTables, tmp_path: Path) -> None:
    rules.test_forge_values_are_counted_as_forge_counts_them_and_rotated_to_what_forge_reads(forge_tables, tmp_path)


def test_legacy_values_are_read_with_the_transport_key_when_no_legacy_key_is_set_on_mariadb(
        forge_tables: rules.ForgeTables, tmp_path: Path) -> None:
    rules.test_legacy_values_are_read_with_the_transport_key_when_no_legacy_key_is_set(forge_tables, tmp_path)


def test_a_wrong_legacy_key_rewrites_nothing_not_even_values_that_happen_to_unpad_on_mariadb(
        forge_tables: rules.ForgeTables, tmp_path: Path) -> None:
    rules.test_a_wrong_legacy_key_rewrites_nothing_not_even_values_that_happen_to_unpad(forge_tables, tmp_path)


def test_a_value_written_under_a_checked_key_after_the_pre_pass_holds_the_key_from_that_batch_on_on_mariadb(
        forge_tables: rules.ForgeTables, tmp_path: Path) -> None:
    rules.test_a_value_written_under_a_checked_key_after_the_pre_pass_holds_the_key_from_that_batch_on(
        forge_tables, tmp_path)


def test_a_value_that_reads_as_text_under_the_wrong_legacy_key_is_held_not_rewritten_on_mariadb(
        forge_tables: rules.ForgeTables, tmp_path: Path) -> None:
    rules.test_a_value_that_reads_as_text_under_the_wrong_legacy_key_is_held_not_rewritten(forge_tables, tmp_path)
