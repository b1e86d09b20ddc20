"""A key id is one key (issue 22, point 7), on real PostgreSQL (and OpenBao for vault-kv / Transit);
tests/test_key_identity_mysql.py runs them on MariaDB (its own ``db`` fixtures; which and why in its docstring).

pinrotate records a check value per key id in ``pinrotate.key_checks``; a run, a Dask worker or a gate
whose key of the same id is other material refuses with exit 2, one line naming the key id, nothing
written. Ids that name one key version twice (``2`` and ``02``) are refused at load, by every provider.
All keys here are random TEST keys made by the tests.
"""

from __future__ import annotations

import base64
import re
import secrets
import threading
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import tomli_w

from pinrotate_core import rotation
from pinrotate_core._primitives import key_check_value
from pinrotate_core.config import load_settings, settings_from_mapping
from pinrotate_core.db import make_engine
from pinrotate_core.errors import ConfigError, DatabaseError, KeyUnavailable, RefusedToStart
from pinrotate_core.key_checks import HMAC_ALGORITHM, KeyIdentityMismatch
from pinrotate_core.keyring import Key, Keyring
from pinrotate_core.providers.env import EnvKeyProvider
from pinrotate_core.providers.file import FileKeyProvider
from pinrotate_core.providers.k8s import K8sDirKeyProvider
from tests.helpers import assert_secret_free
from tests.key_checks_records import AppRole, KeyChecksDatabase, PgKeyChecks
from tests.pinprofile import PinProfile, cli, cli_all, seed_profile

TABLES = ("persons", "person_documents", "requisite_templates", "verification_requests")


# The engine's fixtures: ``db`` a fresh database, ``primary_db`` one on the primary server only (for
# the command-line and Prefect tests), ``db_kind`` the engine alone, ``app_role`` a role without
# CREATE on the database.
@pytest.fixture
def db(database_url: str, make_role: Callable[[str], str]) -> PgKeyChecks:
    return PgKeyChecks(database_url, make_role)


@pytest.fixture
def primary_db(primary_database_url: str) -> KeyChecksDatabase:
    return PgKeyChecks(primary_database_url)


@pytest.fixture
def db_kind() -> type[KeyChecksDatabase]:
    return PgKeyChecks


@pytest.fixture
def app_role(db: PgKeyChecks) -> AppRole:
    return db.app_role()


def key_counts(profile: PinProfile) -> dict[str, dict[Any, int]]:
    return {t: profile.key_versions(t) for t in TABLES}


def key_material(keys_file: Path) -> list[str]:
    """Every base64 key of a keys file (to prove none of them appears in any output)."""
    raw = tomllib.loads(keys_file.read_text())
    return list(raw["keys"].values())


def replace_key(keys_file: Path, key_id: str, *, to: Path | None = None) -> str:
    """Write ``keys_file`` (or a copy at ``to``) with fresh material under ``key_id``; the new base64."""
    raw = tomllib.loads(keys_file.read_text())
    raw["keys"][key_id] = base64.b64encode(secrets.token_bytes(32)).decode()
    target = to or keys_file
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    target.write_text(tomli_w.dumps(raw))
    target.chmod(0o600)
    return str(raw["keys"][key_id])


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("pinrotate: error:")]


# --- runs, through the command line ----------------------------------------------------------------------


def test_key_2_replaced_between_two_runs_refuses_the_second_run_with_exit_2_and_writes_nothing(
        prefect_api: str, primary_db: KeyChecksDatabase, tmp_path: Path) -> None:
    profile = seed_profile(primary_db.url, tmp_path, rows=30, batch_size=50)
    env = {"PREFECT_API_URL": prefect_api}
    old = key_material(profile.keys_file)
    code, _, err = cli("run", "--target", "Person", "--config", str(profile.config_path), "--json", env=env)
    assert code == 0, err[-3000:]
    checks = primary_db.recorded()
    assert set(checks) == {"1", "2"}
    assert all(re.fullmatch(r"[0-9a-f]{32}", v) and a == HMAC_ALGORITHM and by.startswith("host ")
               for v, a, by in checks.values())
    before = key_counts(profile)
    assert before["persons"] == {2: 30} and before["person_documents"].get(1, 0) > 0  # a backlog is left

    new = replace_key(profile.keys_file, "2")  # another host's `keys add`, a stale Secret, ...
    code, out, err = cli("run", "--config", str(profile.config_path), env=env)

    assert code == 2, err[-3000:]
    assert "Traceback" not in err
    (line,) = error_lines(err)
    assert "key 2 " in line and "pinrotate.key_checks" in line and "two keyrings disagree" in line, line
    assert key_counts(profile) == before  # not one row written under the new key 2
    assert primary_db.recorded() == checks  # and the record was not changed either
    for text in (out, err):
        assert_secret_free(text, *old, new, *(v for v, _, _ in checks.values()))


def test_a_dry_run_and_a_gate_only_compare_and_the_gate_says_when_no_check_value_was_recorded(
        prefect_api: str, primary_db: KeyChecksDatabase, tmp_path: Path) -> None:
    profile = seed_profile(primary_db.url, tmp_path, rows=12)
    cfg = str(profile.config_path)
    code, doc, err = cli("run", "--dry-run", "--config", cfg, "--json", env={"PREFECT_API_URL": prefect_api})
    assert code == 0, err[-3000:]
    assert not primary_db.table_exists()  # a dry run never writes, not even the check values

    # Both gates at once: closed (every row on key 1), they read only.
    (code, doc, err), (_, human, _) = cli_all([["gate", "--retire", "1", "--config", cfg, "--json"],
                                              ["gate", "--retire", "1", "--config", cfg]])
    assert code == 3, err[-3000:]
    assert doc["key_identity"]["recorded"] is False and "no check value was recorded for key 1" in \
        doc["key_identity"]["note"]
    assert "no check value was recorded for key 1" in human
    assert not primary_db.table_exists()  # nor does a gate


def test_a_gate_whose_key_differs_from_the_recorded_one_refuses_with_exit_2_before_answering(
        primary_db: KeyChecksDatabase, tmp_path: Path) -> None:
    profile = seed_profile(primary_db.url, tmp_path, rows=8)
    settings = load_settings(str(profile.config_path))
    report = rotation.run_rotation(settings, target_names=["Person"])
    assert report.exit_code == 0
    cfg = str(profile.config_path)
    code, doc, _ = cli("gate", "--retire", "1", "--config", cfg, "--json")
    assert code == 3 and doc["key_identity"]["recorded"] is True and doc["key_identity"]["recorded_by"]

    new = replace_key(profile.keys_file, "1")
    code, out, err = cli("gate", "--retire", "1", "--config", cfg, "--json")
    assert code == 2
    (line,) = error_lines(err)
    assert "key 1 " in line and "differs from the key 1 recorded in pinrotate.key_checks" in line, line
    assert "Traceback" not in err and out == {"error": line.removeprefix("pinrotate: error: "), "exit_code": 2}
    assert_secret_free(str(out) + err, new, *key_material(profile.keys_file))


# --- a Dask worker whose host holds another keyring -------------------------------------------------------


@pytest.fixture
def worker_cluster(tmp_path: Path, prefect_api: str) -> Iterator[tuple[Any, Path]]:
    """A real Dask cluster (one worker process) whose workers read PINROTATE_KEYS_FILE from their own
    environment: a keys file of their host, not the run's."""
    from distributed import LocalCluster

    worker_keys = tmp_path / "worker-host" / "keys.toml"
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None,
                      env={"PINROTATE_KEYS_FILE": str(worker_keys), "PREFECT_API_URL": prefect_api}) as cluster:
        yield cluster, worker_keys


def test_a_dask_worker_with_another_key_2_refuses_its_shards_before_writing_and_the_run_exits_2(
        prefect_api: str, primary_db: KeyChecksDatabase, tmp_path: Path, worker_cluster: tuple[Any, Path]) -> None:
    cluster, worker_keys = worker_cluster
    profile = seed_profile(primary_db.url, tmp_path, rows=20, task_runner="dask",
                           dask_address=cluster.scheduler_address)
    other = replace_key(profile.keys_file, "2", to=worker_keys)  # the worker host's keyring: another key 2
    before = key_counts(profile)

    code, doc, err = cli("run", "--config", str(profile.config_path), "--json", timeout=300,
                         env={"PREFECT_API_URL": prefect_api})

    assert code == 2, err[-4000:]
    assert doc["exit_code"] == 2
    stopped = {name: t.get("stopped") for name, t in doc["targets"].items()}
    assert set(stopped.values()) == {"key_mismatch"}, stopped
    errors = {t["error"] for t in doc["targets"].values()}
    assert all("key 2 " in e and "two keyrings disagree" in e for e in errors), errors
    assert all(t["reencrypted"] == 0 for t in doc["targets"].values())
    assert key_counts(profile) == before  # the worker wrote nothing
    assert "Traceback" not in err
    assert_secret_free(str(doc) + err, other, *key_material(profile.keys_file))


# --- recording, in the core ---------------------------------------------------------------------------------


def _aesgcm_settings(url: str, keys_file: Path) -> Any:
    return settings_from_mapping({"database": {"url": url}, "keys": {"provider": "file", "file": str(keys_file)},
                                  "targets": [{"name": "T", "table": "t", "key_version": "kv", "columns": ["c"]}]})


def test_two_first_runs_at_once_record_one_check_value_per_key_and_the_second_compares_with_it(
        db: KeyChecksDatabase, tmp_path: Path) -> None:
    keys_file = tmp_path / "keys" / "keys.toml"
    provider = FileKeyProvider(keys_file, create=True)
    ring = provider.load_keyring()
    other = Keyring(current="1", keys={"1": Key("1", secrets.token_bytes(32))}, source="another host")
    settings = _aesgcm_settings(db.url, keys_file)
    outcomes: dict[str, BaseException | None] = {}
    start = threading.Barrier(2)

    def first_run(name: str, keyring: Keyring) -> None:
        engine = make_engine(db.url, pool_size=1)
        try:
            start.wait()
            db.confirm(engine, settings, keyring, provider, record=True, run_id=name)
            outcomes[name] = None
        except KeyIdentityMismatch as e:
            outcomes[name] = e
        finally:
            engine.dispose()

    threads = [threading.Thread(target=first_run, args=(n, k)) for n, k in (("a", ring), ("b", other))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    # Whichever came first recorded key 1; the other one compared with it and was refused.
    refused = [n for n, e in outcomes.items() if e is not None]
    assert len(outcomes) == 2 and len(refused) == 1, outcomes
    winner = ({"a", "b"} - set(refused)).pop()
    stored = db.recorded()
    assert set(stored) == {"1"} and f"run {winner}" in stored["1"][2]
    assert stored["1"][0] == key_check_value((ring if winner == "a" else other).key("1").material)


def test_the_check_value_is_a_truncated_hmac_of_a_fixed_label_and_never_the_key() -> None:
    import hashlib
    import hmac

    material = secrets.token_bytes(32)
    value = key_check_value(material)
    expected = hmac.new(material, b"pinrotate key check value v1", hashlib.sha256).hexdigest()[:32]
    assert value == expected and len(value) == 32
    assert key_check_value(secrets.token_bytes(32)) != value
    assert_secret_free(value, material)


def test_a_role_that_may_not_create_the_key_checks_table_is_refused_naming_the_privilege(
        db: KeyChecksDatabase, app_role: AppRole, tmp_path: Path) -> None:
    keys_file = tmp_path / "keys" / "keys.toml"
    FileKeyProvider(keys_file, create=True).load_keyring()
    settings = _aesgcm_settings(app_role.url, keys_file)
    ctx = rotation.open_run(settings)
    try:
        with pytest.raises(RefusedToStart) as refused:
            rotation.read_current_key(ctx)
    finally:
        ctx.close()
    message = str(refused.value)
    assert "\n" not in message
    assert f"role {app_role.name} may not create pinrotate.key_checks" in message
    assert db.create_grant in message and message.endswith("nothing was written")
    assert not db.table_exists()


def test_a_role_that_may_read_but_not_write_the_key_checks_table_runs_dry_but_not_for_real(
        db: KeyChecksDatabase, app_role: AppRole, tmp_path: Path) -> None:
    db.let_read_key_checks(app_role)
    keys_file = tmp_path / "keys" / "keys.toml"
    ring = FileKeyProvider(keys_file, create=True).load_keyring()
    settings = _aesgcm_settings(app_role.url, keys_file)
    engine = make_engine(app_role.url, pool_size=1)
    try:
        seen = db.confirm(engine, settings, ring, FileKeyProvider(keys_file), record=False)
        assert seen.not_recorded == ["1"]
        with pytest.raises(RefusedToStart, match=rf"role {re.escape(app_role.name)} may not write "
                                                 r"pinrotate.key_checks.*GRANT SELECT, INSERT"):
            db.confirm(engine, settings, ring, FileKeyProvider(keys_file), record=True)
    finally:
        engine.dispose()


# --- one key version, one id: refused at load, by every provider --------------------------------------------

def _b64() -> str:
    return base64.b64encode(secrets.token_bytes(32)).decode()


def _private_file(path: Path, text: str) -> Path:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o600)
    return path


def test_a_keys_file_with_keys_2_and_02_is_refused_by_run_with_exit_2_naming_both(
        primary_db: KeyChecksDatabase, tmp_path: Path) -> None:
    profile = seed_profile(primary_db.url, tmp_path, rows=6)
    raw = tomllib.loads(profile.keys_file.read_text())
    raw["keys"]["02"] = _b64()
    raw["current"] = "02"
    _private_file(profile.keys_file, tomli_w.dumps(raw))
    before = key_counts(profile)
    code, out, err = cli("run", "--config", str(profile.config_path))
    assert code == 2
    (line,) = error_lines(err)
    assert "[keys] 02 and [keys] 2 name the same key version 2" in line, line
    assert key_counts(profile) == before
    assert_secret_free(out + err, *tomllib.loads(profile.keys_file.read_text())["keys"].values())


def test_current_02_with_only_key_2_is_refused_naming_the_spelling_held(tmp_path: Path) -> None:
    path = _private_file(tmp_path / "k" / "keys.toml", f'current = "02"\n[keys]\n1 = "{_b64()}"\n2 = "{_b64()}"\n')
    with pytest.raises(ConfigError, match=r"current names key 02, but the keyring holds key version 2 as "
                                          r"\[keys\] 2; set current to 2"):
        FileKeyProvider(path).load_keyring()


def test_a_lone_zero_padded_version_is_refused_before_an_aesgcm_run_writes_version_2_under_it(
        db: KeyChecksDatabase, tmp_path: Path) -> None:
    path = _private_file(tmp_path / "k" / "keys.toml", f'current = "02"\n[keys]\n1 = "{_b64()}"\n02 = "{_b64()}"\n')
    ctx = rotation.open_run(_aesgcm_settings(db.url, path))
    try:
        with pytest.raises(ConfigError, match=r"key id 02 is key version 2 with a leading zero.*name it 2"):
            rotation.read_current_key(ctx)
    finally:
        ctx.close()


def test_env_keys_2_and_02_are_refused_naming_both_variables() -> None:
    env = {"PINROTATE_KEY_CURRENT": "2", "PINROTATE_KEY_2": _b64(), "PINROTATE_KEY_02": _b64()}
    with pytest.raises(ConfigError) as refused:
        EnvKeyProvider(env).load_keyring()
    assert "PINROTATE_KEY_02 and PINROTATE_KEY_2 name the same key version 2" in str(refused.value)
    assert_secret_free(refused.value, env["PINROTATE_KEY_2"], env["PINROTATE_KEY_02"])


def test_k8s_secret_files_1_and_01_are_refused_naming_both_files(tmp_path: Path) -> None:
    d = tmp_path / "secret"
    d.mkdir()
    (d / "current").write_text("1")
    (d / "1").write_text(_b64())
    (d / "01").write_text(_b64())
    with pytest.raises(ConfigError, match=rf"file {re.escape(str(d / '01'))} and file {re.escape(str(d / '1'))} "
                                          r"name the same key version 1"):
        K8sDirKeyProvider(d).load_keyring()


def test_every_keyring_refuses_two_ids_of_one_version_whatever_built_it() -> None:
    keys = {k: Key(k, secrets.token_bytes(16)) for k in ("k1", "3", "003")}
    with pytest.raises(ConfigError, match="key 003 and key 3 name the same key version 3"):
        Keyring(current="k1", keys=keys, source="forge test")


# --- OpenBao: vault-kv fields, Transit identity -------------------------------------------------------------


@pytest.mark.vault
def test_vault_kv_fields_2_and_02_are_refused_naming_both_fields(openbao: Any) -> None:
    from pinrotate_core.config import VaultSettings
    from pinrotate_core.providers.vault import VaultKvKeyProvider
    from tests.vault_server import BaoAdmin

    path = f"ki-{secrets.token_hex(4)}"
    fields = {"current": "2", "1": _b64(), "2": _b64(), "02": _b64()}
    BaoAdmin.of(openbao).kv_put("secret", path, fields)
    provider = VaultKvKeyProvider(VaultSettings(addr=openbao.addr, token=openbao.token, mount="secret", path=path))
    with pytest.raises(ConfigError) as refused:
        provider.load_keyring()
    assert "field 02 and field 2 name the same key version 2" in str(refused.value)
    assert_secret_free(refused.value, *(v for k, v in fields.items() if k != "current"))


@pytest.mark.vault
def test_a_transit_key_created_again_under_the_same_name_is_refused_and_the_same_key_is_not(
        openbao: Any, db: KeyChecksDatabase) -> None:
    import time

    from pinrotate_core.config import VaultSettings
    from pinrotate_core.providers.vault import VaultTransitKeyProvider
    from tests.vault_server import BaoAdmin

    admin = BaoAdmin.of(openbao)
    mount = f"transit-ki-{secrets.token_hex(3)}"
    admin.enable_secrets(mount, "transit")
    admin.api("POST", f"{mount}/keys/pii", {})
    admin.api("POST", f"{mount}/keys/pii/rotate", {})
    settings = settings_from_mapping({
        "database": {"url": db.url},
        "keys": {"provider": "vault-transit", "vault": {"addr": openbao.addr, "transit_mount": mount, "key": "pii"}},
        "targets": [{"name": "T", "table": "t", "columns": ["c"], "format": "vault-transit"}]})
    engine = make_engine(db.url, pool_size=1)

    def provider() -> VaultTransitKeyProvider:
        return VaultTransitKeyProvider(VaultSettings(addr=openbao.addr, token=openbao.token, transit_mount=mount,
                                                     key="pii"))

    try:
        p = provider()
        first = db.confirm(engine, settings, p.load_keyring(), p, record=True, run_id="r1")
        assert first.recorded_now == ["1", "2"]
        assert db.recorded_rows() == [(f"vault-transit {mount}/pii", "1", "transit-creation-time:v1"),
                        (f"vault-transit {mount}/pii", "2", "transit-creation-time:v1")]
        p = provider()  # the same key, read again: the same identity
        assert set(db.confirm(engine, settings, p.load_keyring(), p, record=True).compared) == {"1", "2"}

        # Deleted and created again under the same name: Transit keeps creation times in seconds.
        time.sleep(1.1)
        admin.api("POST", f"{mount}/keys/pii/config", {"deletion_allowed": True})
        admin.api("DELETE", f"{mount}/keys/pii")
        admin.api("POST", f"{mount}/keys/pii", {})
        p = provider()
        with pytest.raises(KeyIdentityMismatch, match=r"key 1 of this keyring .* differs from the key 1 recorded"):
            db.confirm(engine, settings, p.load_keyring(), p, record=True)
    finally:
        engine.dispose()


def test_a_database_that_cannot_be_reached_for_the_check_is_exit_4_never_a_pass(
        db_kind: type[KeyChecksDatabase], tmp_path: Path) -> None:
    keys_file = tmp_path / "keys" / "keys.toml"
    FileKeyProvider(keys_file, create=True).load_keyring()
    url = db_kind.unreachable
    ctx = rotation.open_run(_aesgcm_settings(url, keys_file), engine=db_kind.lazy_engine(url))
    try:
        with pytest.raises(DatabaseError) as failed:
            rotation.read_current_key(ctx)
    finally:
        ctx.close()
    assert not isinstance(failed.value, (ConfigError, KeyUnavailable))


def test_a_shard_stopped_on_a_key_mismatch_makes_the_run_exit_2_and_counts_a_key_error() -> None:
    from pinrotate_core.drain import DrainResult
    from pinrotate_core.key_checks import STOP_KEY_MISMATCH
    from pinrotate_core.metrics import RotationMetrics

    report = rotation.RunReport("r", "2", False)
    report.targets = {"A": DrainResult("A", "2", reencrypted=5),
                      "B": DrainResult("B", "2", stopped=STOP_KEY_MISMATCH, error="key 2 ... differs", retryable=False)}
    assert report.exit_code == rotation.EXIT_CONFIG  # a refusal, not an outage (4) and never a success (0)
    metrics = RotationMetrics()
    rotation.record_metrics(report, metrics)
    value = metrics.registry.get_sample_value("profile_crypto_reencrypt_errors_total", {"reason": "key_unavailable"})
    assert value == 1.0  # PinrotateKeyErrors fires for a worker without the real key
