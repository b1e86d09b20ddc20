"""``[keys] provider = "forge"``: Forge's own bootstrap file and FORGE_CRYPTO_PERSISTENCE_* environment.

The file is written as Forge's bootstrapper writes it (tests/forge_bootstrap.py: Java's
``Properties.store`` output, ``=`` escaped); the data set is tests/data/fpc1_generic.sql with the rows of
tests/test_fpc1_migration.py. All keys are random TEST keys made here.
"""

from __future__ import annotations

import base64

import json
import os
import secrets
import tomllib
from pathlib import Path
from typing import Any

import psycopg
import javaproperties
import pytest
import tomli_w

from pinrotate_core import rotation
from pinrotate_core.config import Settings, settings_from_mapping
from pinrotate_core.errors import ConfigError, RefusedToStart
from pinrotate_core.gate import retire_gate
from pinrotate_core.providers import build_provider
from pinrotate_core.providers.forge import ForgeKeyProvider
from pinrotate_core.schemes.fpc1_values import parse_fpc1

from .forge_bootstrap import P, b64, bootstrap_props, write_bootstrap_file
from .helpers import assert_secret_free
from .pinprofile import cli
from .test_fpc1_migration import DC, K1, K2, LC, LEGACY, TEST_DATA, Forge, decrypt

K_NEW = secrets.token_bytes(16)
ENV_HISTORY = {  # what an operator adds next to the bootstrap file for an upgraded install (design 003)
    "FORGE_CRYPTO_PERSISTENCE_KEYS_K1": b64(K1),
    "FORGE_CRYPTO_PERSISTENCE_LEGACY_KEY": b64(LEGACY),
    "FORGE_CRYPTO_PERSISTENCE_LEGACY_READ_ENABLED": "true",
}


@pytest.fixture
def forge_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """Environment for one test; conftest already removed any FORGE_CRYPTO_* of the developer's shell."""
    assert not [name for name in os.environ if name.startswith("FORGE_CRYPTO_")]
    return monkeypatch


def bootstrap_file(tmp_path: Path, **overrides: str) -> Path:
    return write_bootstrap_file(tmp_path / "secrets" / "crypto.properties", bootstrap_props("k2", K2, **overrides))


def config_dict(database_url: str, path: Path | None, **keys: Any) -> dict[str, Any]:
    raw = tomllib.loads((TEST_DATA / "fpc1_generic.toml").read_text(encoding="utf-8"))
    raw["database"] = {"url": database_url}
    raw["keys"] = {"provider": "forge", **({"file": str(path)} if path else {}), **keys}
    raw["job"].update(batch_size=2, inter_batch_delay=0)
    return raw


def forge_settings(database_url: str, path: Path | None, **keys: Any) -> Settings:
    return settings_from_mapping(config_dict(database_url, path, **keys), env={})


def one_line_error(excinfo: pytest.ExceptionInfo[BaseException]) -> str:
    text = str(excinfo.value)
    assert "\n" not in text
    assert_secret_free(excinfo.value, K1, K2, K_NEW, LEGACY)
    return text


# --- reading the file and the environment ---------------------------------------------------------------


def test_a_file_written_by_forges_bootstrapper_gives_its_active_key_and_switches(
        tmp_path: Path, forge_env: pytest.MonkeyPatch) -> None:
    path = bootstrap_file(tmp_path)
    assert b"\\=\\=" in path.read_bytes()  # Java escaped the base64 padding; the library must undo it
    ring = ForgeKeyProvider(path).load_keyring()
    assert ring.current == "k2" and ring.ids() == ["k2"] and ring.keys["k2"].material == K2
    # No legacy-key: Forge reads legacy values with the transport key, and so does pinrotate.
    transport = base64.b64decode(javaproperties.loads(path.read_bytes().decode("latin-1"))["forge.crypto.secret-key"])
    assert ring.legacy is not None and ring.legacy.material == transport
    assert ring.policy is not None
    assert (ring.policy.enabled, ring.policy.write_versioned, ring.policy.legacy_read_enabled) == (True, True, False)
    assert ring.source == f"forge {path}"
    assert_secret_free(repr(ring) + repr(ring.policy), K2)


def test_environment_overrides_the_file_as_in_forge(tmp_path: Path, forge_env: pytest.MonkeyPatch) -> None:
    path = bootstrap_file(tmp_path)
    for name, value in {**ENV_HISTORY, "FORGE_CRYPTO_PERSISTENCE_ACTIVE_KEY_ID": "k3",
                        "FORGE_CRYPTO_PERSISTENCE_ACTIVE_KEY": b64(K_NEW),
                        "FORGE_CRYPTO_PERSISTENCE_KEYS_K2": b64(K2)}.items():
        forge_env.setenv(name, value)
    ring = ForgeKeyProvider(path).load_keyring()
    assert ring.current == "k3" and ring.keys["k3"].material == K_NEW
    assert ring.keys["k1"].material == K1 and ring.keys["k2"].material == K2
    assert ring.legacy is not None and ring.legacy.material == LEGACY
    assert ring.policy is not None and ring.policy.legacy_read_enabled is True
    assert ring.policy.legacy_read_enabled_setting == "FORGE_CRYPTO_PERSISTENCE_LEGACY_READ_ENABLED"
    assert "FORGE_CRYPTO_PERSISTENCE_ACTIVE_KEY_ID" in ring.source  # names, never values
    assert_secret_free(ring.source, K1, K2, K_NEW, LEGACY)


def test_spring_canonical_variable_names_bind_too(tmp_path: Path, forge_env: pytest.MonkeyPatch) -> None:
    forge_env.setenv("FORGE_CRYPTO_PERSISTENCE_WRITEVERSIONED", "FALSE")
    ring = ForgeKeyProvider(bootstrap_file(tmp_path)).load_keyring()
    assert ring.policy is not None and ring.policy.write_versioned is False


def test_historical_key_ids_from_the_environment_are_lower_cased_as_spring_binds_them(
        tmp_path: Path, forge_env: pytest.MonkeyPatch) -> None:
    forge_env.setenv("FORGE_CRYPTO_PERSISTENCE_KEYS_K2024Q4", b64(K1))
    ring = ForgeKeyProvider(bootstrap_file(tmp_path)).load_keyring()
    assert ring.ids() == ["k2", "k2024q4"]


def test_an_env_key_id_that_spring_binds_with_a_dot_is_refused(tmp_path: Path, forge_env: pytest.MonkeyPatch) -> None:
    forge_env.setenv("FORGE_CRYPTO_PERSISTENCE_KEYS_OLD_KEY", b64(K1))
    with pytest.raises(ConfigError) as excinfo:
        ForgeKeyProvider(bootstrap_file(tmp_path)).load_keyring()
    assert "FORGE_CRYPTO_PERSISTENCE_KEYS_OLD_KEY" in one_line_error(excinfo) and "'old.key'" in str(excinfo.value)


def test_a_set_transport_key_makes_forge_skip_the_file_and_so_does_pinrotate(
        tmp_path: Path, forge_env: pytest.MonkeyPatch) -> None:
    path = tmp_path / "absent" / "crypto.properties"
    forge_env.setenv("FORGE_CRYPTO_SECRET_KEY", b64(secrets.token_bytes(16)))
    for name, value in {"FORGE_CRYPTO_PERSISTENCE_ENABLED": "true", "FORGE_CRYPTO_PERSISTENCE_WRITE_VERSIONED": "true",
                        "FORGE_CRYPTO_PERSISTENCE_LEGACY_READ_ENABLED": "false",
                        "FORGE_CRYPTO_PERSISTENCE_ACTIVE_KEY_ID": "k2",
                        "FORGE_CRYPTO_PERSISTENCE_ACTIVE_KEY": b64(K2)}.items():
        forge_env.setenv(name, value)
    ring = ForgeKeyProvider(path).load_keyring()
    assert ring.current == "k2" and "bootstrap file skipped: FORGE_CRYPTO_SECRET_KEY is set" in ring.source
    assert not path.parent.exists()


def test_the_default_file_is_forges_bootstrap_file(tmp_path: Path, forge_env: pytest.MonkeyPatch) -> None:
    path = bootstrap_file(tmp_path)
    forge_env.setenv("FORGE_CRYPTO_BOOTSTRAP_FILE", str(path))
    provider = build_provider(forge_settings("postgresql://unused@127.0.0.1/x", None))
    assert isinstance(provider, ForgeKeyProvider) and provider.path == path
    forge_env.delenv("FORGE_CRYPTO_BOOTSTRAP_FILE")
    forge_env.setenv("HOME", str(tmp_path / "home"))
    assert ForgeKeyProvider().path == tmp_path / "home" / ".forge" / "secrets" / "crypto.properties"


# --- refusals, as Forge refuses to start ------------------------------------------------------------------


@pytest.mark.parametrize(("overrides", "named"), [
    ({"forge.crypto.persistence.active-key-ids": "k2"}, "unknown setting forge.crypto.persistence.active-key-ids"),
    ({"forge.crypto.algorithm": "SM4"}, "unknown setting forge.crypto.algorithm"),
    ({P + "active-key": "not base64!"}, "is not valid base64"),
    ({P + "active-key": b64(secrets.token_bytes(32))}, "must be base64 of 16 bytes"),
    ({P + "active-key-id": "bad id"}, "key id must match"),
    ({P + "keys.k1/x": b64(K1)}, "key id must match"),
    ({P + "write-versioned": "maybe"}, "must be true or false"),
    ({P + "keys.k2": b64(K_NEW)}, "differs from the active key"),
])
def test_a_file_forge_would_refuse_stops_the_start_with_one_line(
        tmp_path: Path, forge_env: pytest.MonkeyPatch, overrides: dict[str, str], named: str) -> None:
    path = bootstrap_file(tmp_path, **overrides)
    before = path.read_bytes()
    with pytest.raises(ConfigError) as excinfo:
        ForgeKeyProvider(path).load_keyring()
    message = one_line_error(excinfo)
    assert named in message and str(path) in message
    assert path.read_bytes() == before


def test_a_missing_field_stops_the_start(tmp_path: Path, forge_env: pytest.MonkeyPatch) -> None:
    props = bootstrap_props("k2", K2)
    del props[P + "active-key"]
    path = write_bootstrap_file(tmp_path / "crypto.properties", props)
    with pytest.raises(ConfigError) as excinfo:
        ForgeKeyProvider(path).load_keyring()
    assert "forge.crypto.persistence.active-key is missing" in one_line_error(excinfo)


def test_an_unknown_persistence_variable_stops_the_start(tmp_path: Path, forge_env: pytest.MonkeyPatch) -> None:
    forge_env.setenv("FORGE_CRYPTO_PERSISTENCE_WRITE_VERSION", "true")  # a typo must not pass silently
    with pytest.raises(ConfigError) as excinfo:
        ForgeKeyProvider(bootstrap_file(tmp_path)).load_keyring()
    assert one_line_error(excinfo).startswith("FORGE_CRYPTO_PERSISTENCE_WRITE_VERSION: unknown")


def test_a_missing_file_is_refused_and_never_created(tmp_path: Path, forge_env: pytest.MonkeyPatch) -> None:
    path = tmp_path / "nowhere" / "crypto.properties"
    with pytest.raises(ConfigError) as excinfo:
        ForgeKeyProvider(path).load_keyring()
    assert "pinrotate never writes it" in one_line_error(excinfo)
    assert not path.parent.exists()


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660])
def test_a_file_group_or_others_may_read_is_refused_with_the_chmod_to_run(
        tmp_path: Path, forge_env: pytest.MonkeyPatch, mode: int) -> None:
    path = write_bootstrap_file(tmp_path / "crypto.properties", bootstrap_props("k2", K2), mode=mode)
    with pytest.raises(ConfigError) as excinfo:
        ForgeKeyProvider(path).load_keyring()
    assert one_line_error(excinfo).endswith(f"chmod 600 {path}")
    assert os.stat(path).st_mode & 0o777 == mode  # reported, never changed


def test_a_file_another_user_owns_is_refused(tmp_path: Path, forge_env: pytest.MonkeyPatch) -> None:
    if os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    path = bootstrap_file(tmp_path)
    os.chown(path, 65534, 65534)
    with pytest.raises(ConfigError) as excinfo:
        ForgeKeyProvider(path).load_keyring()
    assert "owned by uid 65534" in one_line_error(excinfo)


def test_forge_settings_decide_write_versioned_so_pinrotate_refuses_a_second_value() -> None:
    raw = config_dict("postgresql://unused@127.0.0.1/x", Path("/x"), write_versioned=True)
    with pytest.raises(ConfigError) as excinfo:
        settings_from_mapping(raw, env={})
    assert "keys: write_versioned cannot be set with provider \"forge\"" in str(excinfo.value)


def test_forge_keys_serve_fpc1_targets_only() -> None:
    raw = config_dict("postgresql://unused@127.0.0.1/x", Path("/x"))
    raw["targets"].append({"name": "P", "table": "p", "key_version": "kv", "columns": ["c"], "format": "aesgcm"})
    with pytest.raises(ConfigError) as excinfo:
        build_provider(settings_from_mapping(raw, env={}))
    assert "target P has format aesgcm" in str(excinfo.value)


# --- inventory, dry run, run and gate on Forge's keyring -------------------------------------------------


def test_forge_keyring_drives_inventory_dry_run_run_and_gate_for_fpc1_targets(
        database_url: str, pg_conn: psycopg.Connection[Any], tmp_path: Path, forge_env: pytest.MonkeyPatch) -> None:
    forge = Forge(pg_conn)
    path = bootstrap_file(tmp_path)
    file_bytes, file_mtime = path.read_bytes(), os.stat(path).st_mtime_ns
    for name, value in ENV_HISTORY.items():
        forge_env.setenv(name, value)
    settings = forge_settings(database_url, path)

    inv = rotation.inventory(settings).targets
    assert inv[DC].counts["LEGACY"] == 2 and inv[DC].counts["HISTORICAL"] == 2 and inv[DC].counts["ACTIVE"] == 1
    assert inv[DC].counts["UNKNOWN_KEY"] == 0 and inv[LC].counts["UNKNOWN_KEY"] == 0

    before = forge.snapshot()
    dry = rotation.run_rotation(settings, dry_run=True)
    assert dry.exit_code == 0 and dry.targets[DC].reencrypted == 4 and dry.targets[LC].reencrypted == 3
    assert forge.snapshot() == before

    report = rotation.run_rotation(settings, expected_key="k2")
    assert report.exit_code == 0 and report.targets[DC].reencrypted == 4 and report.targets[LC].reencrypted == 3
    for row_id in (1, 2, 3, 4, 7):  # legacy (1, 7) and historical (2, 4) values all end on the active key
        value = forge.password(row_id)
        assert value is not None and parse_fpc1(value).key_id == "k2"
        assert decrypt(value) == forge.plain[("dc", row_id, "password")]
    for row_id in (1, 2):
        doc = json.loads(forge.config(row_id))
        for field in ("password", "token"):
            assert parse_fpc1(doc[field]).key_id == "k2"
            assert decrypt(doc[field]) == forge.plain[("lc", row_id, f"$.{field}")]

    assert retire_gate(settings, "legacy").open
    # The soft-deleted rows stay on k1 (EXCLUDED): closed unless erasing them is accepted.
    assert not retire_gate(settings, "k1").open and retire_gate(settings, "k1", erase_excluded=True).open
    assert path.read_bytes() == file_bytes and os.stat(path).st_mtime_ns == file_mtime
    assert sorted(p.name for p in path.parent.iterdir()) == ["crypto.properties"]  # no lock, no temporary file


def test_legacy_values_stay_while_forge_has_legacy_reading_off(
        database_url: str, pg_conn: psycopg.Connection[Any], tmp_path: Path, forge_env: pytest.MonkeyPatch) -> None:
    forge = Forge(pg_conn)
    forge_env.setenv("FORGE_CRYPTO_PERSISTENCE_KEYS_K1", b64(K1))
    forge_env.setenv("FORGE_CRYPTO_PERSISTENCE_LEGACY_KEY", b64(LEGACY))
    settings = forge_settings(database_url, bootstrap_file(tmp_path))  # the file says legacy-read-enabled=false
    report = rotation.run_rotation(settings, expected_key="k2")
    assert report.targets[DC].reencrypted == 2  # the two historical values; the legacy ones stay
    assert forge.password(1) == forge.dc_rows[1][2] and forge.password(7) == forge.dc_rows[7][2]
    assert not retire_gate(settings, "legacy").open


def test_write_versioned_off_in_forge_refuses_a_real_run_but_not_a_dry_run(
        database_url: str, pg_conn: psycopg.Connection[Any], tmp_path: Path, forge_env: pytest.MonkeyPatch) -> None:
    forge = Forge(pg_conn)
    for name, value in ENV_HISTORY.items():
        forge_env.setenv(name, value)
    forge_env.setenv("FORGE_CRYPTO_PERSISTENCE_WRITE_VERSIONED", "false")
    settings = forge_settings(database_url, bootstrap_file(tmp_path))
    before = forge.snapshot()
    with pytest.raises(RefusedToStart) as excinfo:
        rotation.run_rotation(settings, expected_key="k2")
    assert str(excinfo.value).startswith("FORGE_CRYPTO_PERSISTENCE_WRITE_VERSIONED is false: refusing to migrate")
    assert rotation.run_rotation(settings, dry_run=True).targets[DC].reencrypted == 4
    assert forge.snapshot() == before


# --- the command line -----------------------------------------------------------------------------------


def write_toml(tmp_path: Path, database_url: str, path: Path) -> Path:
    cfg = tmp_path / "pinrotate.toml"
    cfg.write_text(tomli_w.dumps(config_dict(database_url, path)), encoding="utf-8")
    return cfg


@pytest.mark.parametrize(("command", "overrides", "env", "named"), [
    (["run", "--expected-key-version", "k2"], {}, {"FORGE_CRYPTO_PERSISTENCE_WRITE_VERSIONED": "false"},
     "FORGE_CRYPTO_PERSISTENCE_WRITE_VERSIONED is false"),
    (["inventory"], {P + "active-key-id": "k2!"}, {}, "key id must match"),
    (["inventory"], {"forge.crypto.persistence.rotate-now": "true"}, {},
     "unknown setting forge.crypto.persistence.rotate-now"),
    (["gate", "--retire", "k1"], {}, {"FORGE_CRYPTO_PERSISTENCE_ACTIVE_KEY": "%%%"}, "is not valid base64"),
])
def test_forge_refusals_exit_2_with_one_line(primary_database_url: str, tmp_path: Path, command: list[str],
                                            overrides: dict[str, str], env: dict[str, str], named: str) -> None:
    path = bootstrap_file(tmp_path, **overrides)
    cfg = write_toml(tmp_path, primary_database_url, path)
    code, doc, err = cli(*command, "--config", str(cfg), "--json", env=env)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and named in lines[0], err
    assert doc["exit_code"] == 2 and named in doc["error"]
    assert_secret_free(err + json.dumps(doc), K2, K1)


def secrets_of(forge: Forge) -> list[bytes | str]:
    """Everything that must never appear in a record: keys, plaintexts, stored ciphertexts."""
    return [K1, K2, LEGACY, *forge.plain.values(), *forge.stored_values()]


def test_gate_ticket_record_names_database_keyring_and_counts_but_no_value_or_key(
        primary_database_url: str, tmp_path: Path) -> None:
    forge = Forge(psycopg.connect(primary_database_url, autocommit=True))
    path = bootstrap_file(tmp_path)
    cfg = write_toml(tmp_path, primary_database_url, path)
    home = tmp_path / "home"
    code, doc, err = cli("gate", "--retire", "k1", "--ticket", "CHG-4711", "--config", str(cfg), "--json",
                         env={**ENV_HISTORY, "PINROTATE_HOME": str(home)})
    assert code == 3 and doc["open"] is False, err
    record_path = Path(doc["record"])
    assert record_path.parent == home / "records" and record_path.name.startswith("gate-k1-CHG-4711-")
    text = record_path.read_text(encoding="utf-8")
    record = json.loads(text)
    assert record["record"] == "pinrotate gate record" and record["ticket"] == "CHG-4711"
    assert record["key"] == "k1" and record["verdict"] == "closed" and record["current_key"] == "k2"
    assert record["blocking"]["HISTORICAL"] == 4  # dc 2, 4; lc 1 password, lc 2 token (deleted rows excluded)
    db = record["database"]
    with psycopg.connect(primary_database_url) as conn:
        sysid, dbname = conn.execute("SELECT system_identifier::text, current_database() "
                                     "FROM pg_control_system()").fetchone()  # type: ignore[misc]
    assert db["system_identifier"] == sysid and db["database"] == dbname and db["host"]
    assert record["pinrotate_version"].startswith("pinrotate ")
    assert record["keyring_source"].startswith(f"forge {path}") and "FORGE_CRYPTO_PERSISTENCE_KEYS_K1" in text
    assert record["tenants"] == ["1", "2"] and record["scope"]["all_tenants"] is True
    assert record["targets"][DC]["HISTORICAL"] == 2 and record["targets"][DC]["LEGACY"] == 2
    assert record["targets"][DC]["gate"]["on_key"] == 2
    assert record["recorded_at"].endswith("+00:00")
    assert_secret_free(text, *secrets_of(forge))
    assert_secret_free(err, *secrets_of(forge))
    assert os.stat(record_path).st_mode & 0o777 == 0o600


def test_forge_install_through_the_command_line_inventory_dry_run_run_and_gate_record(
        prefect_api: str, primary_database_url: str, tmp_path: Path) -> None:
    forge = Forge(psycopg.connect(primary_database_url, autocommit=True))
    path = bootstrap_file(tmp_path)
    file_bytes = path.read_bytes()
    cfg = write_toml(tmp_path, primary_database_url, path)
    env = {**ENV_HISTORY, "PREFECT_API_URL": prefect_api}
    # Global options before the command, as the usage line shows them.
    code, inv, err = cli("--config", str(cfg), "--json", "inventory", env=env)
    assert code == 0, err
    assert inv["current_key"] == "k2" and inv["targets"][DC]["LEGACY"] == 2 and inv["targets"][DC]["HISTORICAL"] == 2
    before = forge.snapshot()
    code, dry, err = cli("run", "--dry-run", "--config", str(cfg), "--json", env=env)
    assert code == 0, err
    assert dry["dry_run"] is True and dry["targets"][DC]["reencrypted"] == 4 and forge.snapshot() == before
    code, real, err = cli("run", "--expected-key-version", "k2", "--config", str(cfg), "--json", env=env)
    assert code == 0, err
    assert real["targets"][DC]["reencrypted"] == 4 and real["targets"][LC]["reencrypted"] == 3
    for row_id in (1, 2, 3, 4, 7):
        value = forge.password(row_id)
        assert value is not None and parse_fpc1(value).key_id == "k2"
        assert decrypt(value) == forge.plain[("dc", row_id, "password")]
    record_path = tmp_path / "CHG-4711-legacy.json"
    code, gate, err = cli("gate", "--retire", "legacy", "--ticket", "CHG-4711", "--record", str(record_path),
                          "--config", str(cfg), "--json", env=env)
    assert code == 0 and gate["open"] is True and gate["record"] == str(record_path), err
    record = json.loads(record_path.read_text(encoding="utf-8"))
    assert record["verdict"] == "open" and record["ticket"] == "CHG-4711" and record["key"] == "legacy"
    assert_secret_free(record_path.read_text(encoding="utf-8"), *secrets_of(forge))
    assert path.read_bytes() == file_bytes
