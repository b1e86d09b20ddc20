"""Unauthenticated legacy values on MariaDB: all or nothing per key (contract §2), as
tests/test_legacy_ecb.py proves on PostgreSQL, with the same deterministic data set: genuine
legacy values beside foreign ones, some of which pass the padding check under our legacy key
(none as UTF-8 text). Every legacy value is held back while one fails, the legacy gate stays
closed, and once a person has dealt with the foreign values the genuine ones move to what Forge
reads (test_legacy_ecb's ``assert_all_or_nothing_per_key``: the same assertions). The gate sweeps
the whole server: a mariadbd of the module's own (``mariadb`` and ``mysql_database``:
tests/mariadb_server.private_mariadb). TEST keys only.
"""

from __future__ import annotations

import contextlib
import random
from pathlib import Path

import pytest

from pinrotate_core.config import Settings
from tests.mariadb_server import MariaDbServer, private_mariadb, private_mysql_database  # noqa: F401 (fixtures)

from .test_fpc1_migration import custom_settings, legacy_ecb, write_keys
from .test_legacy_ecb import FOREIGN, GENUINE, SEED, assert_all_or_nothing_per_key, is_utf8, padding_passes

pytestmark = [pytest.mark.mysql, pytest.mark.xdist_group("test_legacy_ecb_mysql")]


class MariaDbEcbDataSet:
    """``creds`` as test_legacy_ecb's ``EcbDataSet`` makes it (same seed, same values), on MariaDB."""

    def __init__(self, server: MariaDbServer, database: str) -> None:
        rng = random.Random(SEED)
        self.legacy_key, foreign_key = rng.randbytes(32), rng.randbytes(32)
        self.genuine = {i: f"пароль {i} {rng.randbytes(6).hex()}".encode() for i in range(1, GENUINE + 1)}
        foreign_plain = {i: f"other service {i}: {rng.randbytes(rng.randrange(1, 20)).hex()}".encode()
                         for i in range(GENUINE + 1, GENUINE + FOREIGN + 1)}
        self.values = {i: legacy_ecb(p, self.legacy_key, "AES") for i, p in self.genuine.items()}
        self.values |= {i: legacy_ecb(p, foreign_key, "AES") for i, p in foreign_plain.items()}
        self.foreign_ids = sorted(foreign_plain)
        self.server, self.database = server, database
        self.execute("CREATE TABLE creds (id bigint PRIMARY KEY, pw text)")
        self.execute("INSERT INTO creds VALUES " + ", ".join(["(%s, %s)"] * len(self.values)),
                     tuple(x for item in sorted(self.values.items()) for x in item))
        opened = {i: padding_passes(self.values[i], self.legacy_key) for i in self.foreign_ids}
        self.padding_only = sorted(i for i, p in opened.items() if p is not None)
        self.utf8_too = sorted(i for i, p in opened.items() if p is not None and is_utf8(p))

    def execute(self, statement: str, params: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
        with contextlib.closing(self.server.connect()) as conn, conn.cursor() as cur:
            cur.execute(f"USE `{self.database}`")
            cur.execute(statement, params or None)
            rows = list(cur.fetchall())
            conn.commit()
            return rows

    def settings(self, keys_file: Path) -> Settings:
        write_keys(keys_file, legacy=self.legacy_key)
        s = custom_settings(self.server.url(self.database), keys_file,
                            {"table": "creds", "columns": ["pw"], "legacy_algorithm": "AES"})
        return s.model_copy(update={"job": s.job.model_copy(update={"batch_size": 200})})

    def stored(self) -> dict[int, str | None]:
        return {int(str(r[0])): None if r[1] is None else str(r[1]) for r in self.execute("SELECT id, pw FROM creds")}

    def clear_foreign(self) -> None:
        self.execute("UPDATE creds SET pw = NULL WHERE id > %s", (GENUINE,))


def test_foreign_ecb_values_hold_back_every_legacy_value_on_mariadb_and_keep_the_legacy_gate_closed(
        mariadb: MariaDbServer, mysql_database: str, tmp_path: Path) -> None:
    data = MariaDbEcbDataSet(mariadb, mysql_database)
    assert_all_or_nothing_per_key(data, data.settings(tmp_path / "keys.toml"))
