"""``python -m flows.rotate seed``: the Pin profile sample loaded into a database the operator names
(issue 23, point 5), refusing one that already holds its tables, with nothing written then."""

from __future__ import annotations

from pathlib import Path

import psycopg

from tests.pinprofile import cli, write_config

TABLES = ("persons", "person_documents", "requisite_templates", "verification_requests")


def _counts(url: str) -> dict[str, dict[int, int]]:
    with psycopg.connect(url) as conn:
        return {t: dict(conn.execute(f"SELECT key_version, count(*) FROM profile.{t} GROUP BY 1").fetchall())
                for t in TABLES}


def _has_tables(url: str) -> bool:
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT to_regclass('profile.persons') IS NOT NULL").fetchone()
    return bool(row and row[0])


def test_seed_loads_the_sample_into_the_named_database_and_a_rotation_finds_its_backlog(
        database_url: str, tmp_path: Path) -> None:
    config = write_config(tmp_path / "mine.toml", database_url, tmp_path / "keys" / "keys.toml")
    code, doc, err = cli("seed", "--config", str(config), "--rows", "40", "--json")
    assert code == 0, err
    assert doc["key"] == "1" and doc["rows"] == 40 + 20 + 10 + 10
    counts = _counts(database_url)
    assert {t: sum(by_key.values()) for t, by_key in counts.items()} == {
        "persons": 40, "person_documents": 20, "requisite_templates": 10, "verification_requests": 10}
    assert all(set(by_key) <= {1, None} for by_key in counts.values())  # drafts have no snapshot and no key
    for args in (("keys", "add"), ("keys", "promote", "2")):
        assert cli(*args, "--config", str(config))[0] == 0
    code, inv, err = cli("inventory", "--config", str(config), "--json")
    assert code == 0, err
    assert inv["targets"]["Person"]["HISTORICAL"] == 40 and inv["targets"]["Person"]["by_key"] == {"1": 40}


def test_seed_refuses_a_database_that_already_holds_the_tables_and_writes_nothing(
        database_url: str, tmp_path: Path) -> None:
    config = write_config(tmp_path / "mine.toml", database_url, tmp_path / "keys" / "keys.toml")
    assert cli("seed", "--config", str(config), "--rows", "8")[0] == 0
    before = _counts(database_url)
    code, out, err = cli("seed", "--config", str(config), "--rows", "8", "--json")
    assert code == 2 and "Traceback" not in err
    errors = [x for x in err.splitlines() if x.startswith("pinrotate: error:")]
    assert len(errors) == 1 and "already holds profile." in errors[0] and "nothing was written" in errors[0]
    assert out["exit_code"] == 2
    assert _counts(database_url) == before


def test_seed_refuses_a_key_the_keyring_does_not_hold_before_creating_anything(
        database_url: str, tmp_path: Path) -> None:
    config = write_config(tmp_path / "mine.toml", database_url, tmp_path / "keys" / "keys.toml")
    code, _, err = cli("seed", "--config", str(config), "--key", "7")
    assert code == 2 and "--key 7" in err and "Traceback" not in err
    assert not _has_tables(database_url)
