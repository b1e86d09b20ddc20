"""``pinrotate.toml``: where it is found, how the environment overrides it, and how it is refused.

A bad configuration must stop the start with one line naming the setting. The same file may hold
a database URL with a password, so no message may ever echo a value.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pinrotate_core.config import DEFAULT_BATCH_TIME_TARGET, Settings, load_settings, settings_from_mapping
from pinrotate_core.errors import ConfigError
from pinrotate_core.samples.pin_profile import PIN_PROFILE_TOML

SECRET = "S3cretPw-7f3a9c"  # stands for a password that shares the file with the bad setting
DB_URL = f"postgresql://app:{SECRET}@db.internal/profile"

TARGET = """
[[targets]]
name = "Person"
table = "profile.persons"
key_version = "key_version"
columns = ["first_name_cipher", "last_name_cipher"]
"""


def config_text(job: str = "", extra: str = "", target: str = TARGET, database: str = f'url = "{DB_URL}"') -> str:
    return f"[database]\n{database}\n\n[job]\n{job}\n{extra}\n{target}"


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def refused(path: Path, env: dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as err:
        load_settings(path, env={} if env is None else env)
    return str(err.value)


# -- where the file is found ---------------------------------------------------------------------


@pytest.fixture
def three_configs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """A --config file, a $PINROTATE_CONFIG file and ./pinrotate.toml, told apart by batch_size."""
    cwd_config = write(tmp_path / "cwd" / "pinrotate.toml", config_text("batch_size = 33"))
    monkeypatch.chdir(cwd_config.parent)
    return {
        "explicit": write(tmp_path / "explicit.toml", config_text("batch_size = 11")),
        "env": write(tmp_path / "from-env.toml", config_text("batch_size = 22")),
        "cwd": cwd_config,
    }


def test_the_config_option_wins_over_pinrotate_config_and_the_working_directory(three_configs: dict[str, Path]) -> None:
    env = {"PINROTATE_CONFIG": str(three_configs["env"])}
    assert load_settings(three_configs["explicit"], env=env).job.batch_size == 11


def test_pinrotate_config_wins_over_the_working_directory(three_configs: dict[str, Path]) -> None:
    env = {"PINROTATE_CONFIG": str(three_configs["env"])}
    assert load_settings(None, env=env).job.batch_size == 22


def test_pinrotate_toml_in_the_working_directory_is_the_last_resort(three_configs: dict[str, Path]) -> None:
    assert load_settings(None, env={}).job.batch_size == 33
    assert load_settings(None, env={"PINROTATE_CONFIG": ""}).job.batch_size == 33


def test_the_process_environment_is_read_when_no_mapping_is_given(three_configs: dict[str, Path],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PINROTATE_CONFIG", str(three_configs["env"]))
    assert load_settings().job.batch_size == 22
    monkeypatch.setenv("PINROTATE_BATCH_SIZE", "44")
    assert load_settings().job.batch_size == 44


def test_a_missing_config_file_is_an_error_and_never_falls_back(three_configs: dict[str, Path], tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "pinrotate.toml"
    assert f"configuration file not found: {missing}" in refused(missing)
    with pytest.raises(ConfigError, match="configuration file not found"):
        load_settings(None, env={"PINROTATE_CONFIG": str(missing)})


def test_no_configuration_anywhere_says_how_to_give_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as err:
        load_settings(None, env={})
    message = str(err.value)
    assert "pinrotate.toml not found" in message and "--config" in message and "PINROTATE_CONFIG" in message


def test_a_home_relative_config_path_is_expanded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    write(tmp_path / "conf" / "p.toml", config_text("batch_size = 55"))
    assert load_settings("~/conf/p.toml", env={}).job.batch_size == 55
    assert load_settings(None, env={"PINROTATE_CONFIG": "~/conf/p.toml"}).job.batch_size == 55


def test_the_pin_profile_example_loads_with_its_four_targets_in_order() -> None:
    settings = load_settings(PIN_PROFILE_TOML, env={})
    assert [t.name for t in settings.targets] == ["Person", "PersonDocument", "RequisiteTemplate",
                                                  "VerificationRequest"]
    assert all(t.format == "aesgcm" and t.key_version == "key_version" for t in settings.targets)
    assert settings.target("VerificationRequest").require_not_null == ("snapshot_cipher",)
    assert settings.target("PersonDocument").columns == ("payload_cipher",)
    assert settings.database.url is None  # absent: the embedded PostgreSQL
    assert (settings.job.batch_size, settings.job.max_degree_of_parallelism) == (200, 1)


def test_defaults_follow_the_contract(tmp_path: Path) -> None:
    settings = load_settings(write(tmp_path / "p.toml", TARGET), env={})
    job = settings.job
    assert (job.batch_size, job.max_degree_of_parallelism, job.inter_batch_delay, job.max_run_duration,
            job.polling_interval, job.single_instance) == (200, 1, 0.2, 600, 300, False)
    assert settings.keys.provider == "file" and settings.database.url is None
    assert settings.metrics.prefix == "profile_crypto_reencrypt"
    assert settings.keys.file_path == Path(os.environ["PINROTATE_HOME"]) / "keys.toml"


# -- environment overrides ------------------------------------------------------------------------


def test_environment_variables_override_single_settings(tmp_path: Path) -> None:
    path = write(tmp_path / "p.toml", config_text("batch_size = 10\ninter_batch_delay = 1"))
    env = {
        "PINROTATE_DATABASE_URL": "postgresql://other@127.0.0.1/x",
        "PINROTATE_BATCH_SIZE": "50",
        "PINROTATE_MAX_DEGREE_OF_PARALLELISM": "3",
        "PINROTATE_INTER_BATCH_DELAY": "0.05",
        "PINROTATE_MAX_RUN_DURATION": "30",
        "PINROTATE_SINGLE_INSTANCE": "true",
        "PINROTATE_KEYS_PROVIDER": "env",
        "PINROTATE_KEYS_FILE": str(tmp_path / "k.toml"),
        "PINROTATE_METRICS_TEXTFILE": str(tmp_path / "m.prom"),
        "VAULT_ADDR": "http://127.0.0.1:8200",
        "VAULT_TOKEN": "hvs.not-a-real-token",
    }
    s = load_settings(path, env=env)
    assert s.database.url == "postgresql://other@127.0.0.1/x"
    assert (s.job.batch_size, s.job.max_degree_of_parallelism, s.job.inter_batch_delay,
            s.job.max_run_duration, s.job.single_instance) == (50, 3, 0.05, 30, True)
    assert s.keys.provider == "env" and s.keys.file_path == tmp_path / "k.toml"
    assert s.metrics.textfile == str(tmp_path / "m.prom")
    assert s.keys.vault.addr == "http://127.0.0.1:8200" and s.keys.vault.token == "hvs.not-a-real-token"
    assert "hvs.not-a-real-token" not in repr(s)


def test_an_override_fills_a_section_the_file_does_not_have(tmp_path: Path) -> None:
    s = load_settings(write(tmp_path / "p.toml", TARGET), env={"PINROTATE_DATABASE_URL": "postgresql://a@127.0.0.1/b"})
    assert s.database.url == "postgresql://a@127.0.0.1/b"


def test_an_empty_environment_variable_overrides_nothing(tmp_path: Path) -> None:
    s = load_settings(write(tmp_path / "p.toml", config_text("batch_size = 10")),
                      env={"PINROTATE_BATCH_SIZE": "", "PINROTATE_DATABASE_URL": ""})
    assert s.job.batch_size == 10 and s.database.url == DB_URL


def test_unrelated_environment_variables_are_ignored(tmp_path: Path) -> None:
    s = load_settings(write(tmp_path / "p.toml", config_text("batch_size = 10")),
                      env={"PINROTATE_BATCHSIZE": "1", "PINROTATE_KEY_1": "not a setting", "BATCH_SIZE": "2"})
    assert s.job.batch_size == 10


@pytest.mark.parametrize("var, value, setting", [
    ("PINROTATE_BATCH_SIZE", SECRET, "job.batch_size"),
    ("PINROTATE_BATCH_SIZE", "0", "job.batch_size"),
    ("PINROTATE_MAX_DEGREE_OF_PARALLELISM", "0", "job.max_degree_of_parallelism"),
    ("PINROTATE_SINGLE_INSTANCE", SECRET, "job.single_instance"),
    ("PINROTATE_KEYS_PROVIDER", SECRET, "keys.provider"),
    ("PINROTATE_INTER_BATCH_DELAY", "-1", "job.inter_batch_delay"),
])
def test_a_bad_override_names_the_setting_and_not_the_value(tmp_path: Path, var: str, value: str, setting: str) -> None:
    path = write(tmp_path / "p.toml", config_text())
    message = refused(path, {var: value, "PINROTATE_DATABASE_URL": DB_URL})
    assert message.startswith(f"{path}: {setting} (from {var}): ")
    assert "\n" not in message and SECRET not in message


def test_settings_are_immutable_once_validated(tmp_path: Path) -> None:
    s = load_settings(write(tmp_path / "p.toml", config_text()), env={})
    with pytest.raises(Exception) as err:
        s.job.batch_size = 1  # type: ignore[misc]
    assert "frozen" in str(err.value).lower()


# -- every validation error: one line, the setting named, no value echoed ------------------------

BAD = {
    "batch_size_zero": (config_text("batch_size = 0"), "job.batch_size: must be greater than 0"),
    "batch_size_negative": (config_text("batch_size = -5"), "job.batch_size"),
    "batch_size_not_a_number": (config_text(f'batch_size = "{SECRET}"'), "job.batch_size"),
    "parallelism_zero": (config_text("max_degree_of_parallelism = 0"), "job.max_degree_of_parallelism"),
    "negative_delay": (config_text("inter_batch_delay = -0.1"), "job.inter_batch_delay"),
    "zero_duration": (config_text("max_run_duration = 0"), "job.max_run_duration"),
    "zero_polling": (config_text("polling_interval = 0"), "job.polling_interval"),
    "single_instance_not_bool": (config_text(f'single_instance = "{SECRET}"'), "job.single_instance"),
    "unknown_job_setting": (config_text(f'batchsize = "{SECRET}"'), "job.batchsize: unknown setting"),
    "unknown_section": (config_text(extra=f'[jobs]\nbatch_size = "{SECRET}"\n'), "jobs: unknown setting"),
    "unknown_database_setting": (config_text(database=f'url = "{DB_URL}"\npassword = "{SECRET}"'),
                                 "database.password: unknown setting"),
    "url_not_a_string": (config_text(database=f'url = ["{DB_URL}"]'), "database.url"),
    "unknown_provider": (config_text(extra=f'[keys]\nprovider = "{SECRET}"\n'), "keys.provider"),
    "k8s_dir_without_dir": (config_text(extra='[keys]\nprovider = "k8s-dir"\n'),
                            "keys: provider \"k8s-dir\" needs keys.dir"),
    "vault_kv_without_path": (config_text(extra='[keys]\nprovider = "vault-kv"\n'), "keys.vault.path"),
    "approle_without_role_id": (config_text(extra=f'[keys.vault]\nauth = "approle"\nsecret_id = "{SECRET}"\n'),
                                "keys.vault: auth = \"approle\" needs role_id"),
    "unknown_vault_setting": (config_text(extra=f'[keys.vault]\npasswd = "{SECRET}"\n'),
                              "keys.vault.passwd: unknown setting"),
    "removed_legacy_format": (config_text(extra=f'[keys]\nlegacy_format = "{SECRET}"\n'), "keys.legacy_format"),
    "bad_metrics_prefix": (config_text(extra='[metrics]\nprefix = "9-bad"\n'), "metrics.prefix"),
    "no_targets": (config_text(target=""), "targets: required setting is missing"),
    "aesgcm_without_key_version": (config_text(target=TARGET.replace('key_version = "key_version"\n', "")),
                                   'target "Person": an aesgcm target needs key_version'),
    "target_without_columns": (config_text(target=TARGET.replace(
        'columns = ["first_name_cipher", "last_name_cipher"]', "columns = []")), 'target "Person": columns'),
    "target_without_table": (config_text(target=TARGET.replace('table = "profile.persons"\n', "")),
                             'target "Person": table: required setting is missing'),
    "unknown_format": (config_text(target=TARGET + f'format = "{SECRET}"\n'), 'target "Person": format'),
    "unknown_target_setting": (config_text(target=TARGET + f'secret = "{SECRET}"\n'),
                               'target "Person": secret: unknown setting'),
    "bad_table_name": (config_text(target=TARGET.replace('"profile.persons"', '"a.b.c"')), 'target "Person": table'),
    "bad_target_name": (config_text(target=TARGET.replace('name = "Person"', 'name = "Per son!"')),
                        "[[targets]] table 1: name"),
    "duplicate_column": (config_text(target=TARGET.replace('"last_name_cipher"]', '"first_name_cipher"]')),
                         'target "Person": columns are listed twice'),
    "json_paths_on_aesgcm": (config_text(target=TARGET + 'json_paths = {first_name_cipher = ["$.x"]}\n'),
                             'target "Person": json_paths is supported for fpc1 targets only'),
    "second_target_bad": (config_text(target=TARGET + TARGET.replace('"Person"', '"Other"') + "batch = 1\n"),
                          'target "Other": batch: unknown setting'),
    "duplicate_target_names": (config_text(target=TARGET + TARGET), "target names must be unique"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_every_validation_error_is_one_line_naming_the_setting_and_never_a_value(tmp_path: Path, case: str) -> None:
    text, named = BAD[case]
    path = write(tmp_path / "pinrotate.toml", text)
    message = refused(path, {"VAULT_TOKEN": "hvs." + SECRET})
    assert message.startswith(f"{path}: ")
    assert named in message
    assert "\n" not in message
    assert SECRET not in message and DB_URL not in message and "db.internal" not in message


def test_several_errors_report_the_first_and_how_many_more(tmp_path: Path) -> None:
    message = refused(write(tmp_path / "p.toml", config_text("batch_size = 0\nmax_degree_of_parallelism = 0")))
    assert "job.batch_size" in message and "(and 1 more)" in message and "\n" not in message


@pytest.mark.parametrize("text", [
    f'[database]\nurl = "{DB_URL}\n',  # unterminated string on the password's line
    f"[database]\nurl = {DB_URL}\n",  # not a TOML value at all
    f'[database]\nurl = "a"\nurl = "{DB_URL}"\n',  # the same key twice
    f"{SECRET} {SECRET}\n",
])
def test_a_file_that_is_not_toml_is_refused_by_line_and_column_without_its_text(tmp_path: Path, text: str) -> None:
    path = write(tmp_path / "p.toml", text)
    message = refused(path)
    assert message.startswith(f"{path}: not valid TOML (") and "line" in message
    assert SECRET not in message and "\n" not in message


def test_a_file_that_is_not_utf8_is_refused_naming_the_file_only(tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    path.write_bytes(b'[database]\nurl = "postgresql://app:\xff\xfe' + SECRET.encode() + b'@h/db"\n')
    message = refused(path)
    assert message == f"{path}: cannot read (UnicodeDecodeError)"


def test_a_mapping_is_validated_the_same_way_with_the_source_named() -> None:
    with pytest.raises(ConfigError) as err:
        settings_from_mapping({"job": {"batch_size": 0}, "targets": []}, env={}, source="flow parameters")
    assert str(err.value).startswith("flow parameters: ")


def test_an_override_into_a_section_that_is_not_a_table_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path / "p.toml", f'job = "{SECRET}"\n' + TARGET)
    message = refused(path, {"PINROTATE_BATCH_SIZE": "5"})
    assert message == f"{path}: job must be a table"


def test_an_unknown_target_name_lists_the_configured_ones(tmp_path: Path) -> None:
    settings: Settings = load_settings(PIN_PROFILE_TOML, env={})
    with pytest.raises(ConfigError) as err:
        settings.target("Nobody")
    assert "--target Nobody" in str(err.value) and "Person, PersonDocument" in str(err.value)



# -- strict types -----------------------------------------------------------------------------


@pytest.mark.parametrize("job, setting", [
    ('batch_size = "200"', "job.batch_size"),
    ("batch_size = 200.0", "job.batch_size"),
    ("batch_size = true", "job.batch_size"),
    ('single_instance = "true"', "job.single_instance"),
    ("single_instance = 1", "job.single_instance"),
    ('inter_batch_delay = "0.2"', "job.inter_batch_delay"),
    ('lock_timeout = "2"', "job.lock_timeout"),
])
def test_a_string_or_other_type_in_the_file_is_refused_where_a_number_or_boolean_belongs(
        tmp_path: Path, job: str, setting: str) -> None:
    message = refused(write(tmp_path / "p.toml", config_text(job)))
    assert setting in message and "\n" not in message


def test_whole_seconds_are_accepted_where_a_duration_is_a_float(tmp_path: Path) -> None:
    s = load_settings(write(tmp_path / "p.toml", config_text("inter_batch_delay = 1\nlock_timeout = 3")), env={})
    assert (s.job.inter_batch_delay, s.job.lock_timeout) == (1.0, 3.0)


def test_environment_strings_are_converted_by_the_settings_type(tmp_path: Path) -> None:
    s = load_settings(write(tmp_path / "p.toml", config_text()),
                      env={"PINROTATE_BATCH_SIZE": "200", "PINROTATE_SINGLE_INSTANCE": "yes",
                           "PINROTATE_LOCK_TIMEOUT": "1.5"})
    assert (s.job.batch_size, s.job.single_instance, s.job.lock_timeout) == (200, True, 1.5)


# -- the settings of contract §3 -----------------------------------------------------------------


def test_the_newer_settings_default_as_documented(tmp_path: Path) -> None:
    s = load_settings(write(tmp_path / "p.toml", TARGET), env={})
    job = s.job
    assert (job.task_runner, job.dask_address, job.batch_time_target) == ("threads", None, None)
    assert (job.batch_size_min, job.batch_size_max) == (50, 5000)
    assert (job.max_replica_lag, job.max_active_sessions) == (None, None)
    assert (job.critical_replica_lag, job.critical_active_sessions) == (None, None)
    assert (job.lock_timeout, job.statement_timeout) == (2.0, 30.0)
    assert job.throttle_variable == "pinrotate_throttle"
    assert s.database.replicas is None
    assert s.keys.legacy_algorithm == "SM4"  # Forge's forge.crypto.algorithm default
    assert (s.forge.algorithm, s.forge.discover_targets) == ("SM4", False)
    assert s.targets[0].triggers == "block"


def test_every_newer_setting_is_read_from_the_file(tmp_path: Path) -> None:
    job = "\n".join([
        'task_runner = "dask"', 'dask_address = "tcp://scheduler:8786"', "batch_time_target = 0.25",
        "batch_size_min = 10", "batch_size_max = 900", "max_replica_lag = 1.5", "max_active_sessions = 40",
        "critical_replica_lag = 30", "critical_active_sessions = 90", "lock_timeout = 0.5",
        "statement_timeout = 12", 'throttle_variable = "profile-throttle"',
    ])
    extra = '[keys]\nlegacy_algorithm = "aes"\n'
    database = f'url = "{DB_URL}"\nreplicas = ["postgresql://app@replica-1/profile", "postgres://app@replica-2/p"]'
    path = write(tmp_path / "p.toml", config_text(job, extra, TARGET + 'triggers = "disable"\n', database))
    s = load_settings(path, env={})
    assert (s.job.task_runner, s.job.dask_address, s.job.batch_time_target) == ("dask", "tcp://scheduler:8786", 0.25)
    assert (s.job.batch_size_min, s.job.batch_size_max) == (10, 900)
    assert (s.job.max_replica_lag, s.job.max_active_sessions) == (1.5, 40)
    assert (s.job.critical_replica_lag, s.job.critical_active_sessions) == (30.0, 90)
    assert (s.job.lock_timeout, s.job.statement_timeout, s.job.throttle_variable) == (0.5, 12.0, "profile-throttle")
    assert s.database.replicas == ("postgresql://app@replica-1/profile", "postgres://app@replica-2/p")
    assert s.keys.legacy_algorithm == "AES" and s.targets[0].triggers == "disable"


def test_no_replicas_is_a_setting_of_its_own(tmp_path: Path) -> None:
    path = write(tmp_path / "p.toml", config_text(database=f'url = "{DB_URL}"\nreplicas = []'))
    assert load_settings(path, env={}).database.replicas == ()


@pytest.mark.parametrize("job, target, first", [
    ("", None, 200),  # neither batch_size nor batch_time_target: adaptive, DEFAULT_BATCH_TIME_TARGET
    ("batch_size = 300", None, 300),  # batch_size alone: fixed batches, as before
    ("batch_time_target = 2.0", 2.0, 200),
    ("batch_size = 20\nbatch_time_target = 2.0", 2.0, 50),  # adaptive: the first batch within the bounds
    ("batch_size = 9000\nbatch_size_max = 1000", None, 9000),  # fixed batches ignore the adaptive bounds
])
def test_batches_adapt_unless_only_a_fixed_batch_size_is_given(tmp_path: Path, job: str, target: float | None,
                                                               first: int) -> None:
    s = load_settings(write(tmp_path / "p.toml", config_text(job)), env={})
    expected = DEFAULT_BATCH_TIME_TARGET if not job else target
    assert s.job.adaptive_batch_target == expected
    assert s.job.first_batch_size == first


def test_a_batch_size_from_the_environment_also_means_fixed_batches(tmp_path: Path) -> None:
    s = load_settings(write(tmp_path / "p.toml", config_text()), env={"PINROTATE_BATCH_SIZE": "100"})
    assert s.job.adaptive_batch_target is None and s.job.batch_size == 100


def test_every_newer_job_setting_has_its_environment_variable(tmp_path: Path) -> None:
    env = {
        "PINROTATE_POLLING_INTERVAL": "60", "PINROTATE_TASK_RUNNER": "dask",
        "PINROTATE_DASK_ADDRESS": "tcp://10.0.0.5:8786", "PINROTATE_BATCH_TIME_TARGET": "0.75",
        "PINROTATE_BATCH_SIZE_MIN": "5", "PINROTATE_BATCH_SIZE_MAX": "500", "PINROTATE_MAX_REPLICA_LAG": "2",
        "PINROTATE_MAX_ACTIVE_SESSIONS": "30", "PINROTATE_CRITICAL_REPLICA_LAG": "20",
        "PINROTATE_CRITICAL_ACTIVE_SESSIONS": "80", "PINROTATE_LOCK_TIMEOUT": "1",
        "PINROTATE_STATEMENT_TIMEOUT": "10", "PINROTATE_THROTTLE_VARIABLE": "eu_throttle",
        "PINROTATE_BATCH_IDLE_TIMEOUT": "45",
    }
    job = load_settings(write(tmp_path / "p.toml", config_text()), env=env).job
    assert (job.polling_interval, job.task_runner, job.dask_address) == (60, "dask", "tcp://10.0.0.5:8786")
    assert (job.batch_time_target, job.batch_size_min, job.batch_size_max) == (0.75, 5, 500)
    assert (job.max_replica_lag, job.max_active_sessions) == (2.0, 30)
    assert (job.critical_replica_lag, job.critical_active_sessions) == (20.0, 80)
    assert (job.lock_timeout, job.statement_timeout, job.throttle_variable) == (1.0, 10.0, "eu_throttle")
    assert job.batch_idle_timeout == 45.0


NEWER_BAD = {
    "unknown_task_runner": (config_text('task_runner = "processes"'), "job.task_runner"),
    "dask_address_without_dask": (config_text('dask_address = "tcp://h:8786"'),
                                  'job: dask_address is only used with task_runner = "dask"'),
    "dask_address_not_an_address": (config_text(f'task_runner = "dask"\ndask_address = "{SECRET} x"'),
                                    "job.dask_address"),
    "batch_time_target_zero": (config_text("batch_time_target = 0"), "job.batch_time_target"),
    "batch_size_min_zero": (config_text("batch_size_min = 0"), "job.batch_size_min"),
    "min_above_max": (config_text("batch_size_min = 600\nbatch_size_max = 500"),
                      "job: batch_size_min must not be greater than batch_size_max"),
    "negative_replica_lag": (config_text("max_replica_lag = -1"), "job.max_replica_lag"),
    "sessions_not_an_integer": (config_text("max_active_sessions = 2.5"), "job.max_active_sessions"),
    "critical_lag_below_max": (config_text("max_replica_lag = 5\ncritical_replica_lag = 5"),
                               "job: critical_replica_lag must be greater than max_replica_lag"),
    "critical_sessions_below_max": (config_text("max_active_sessions = 50\ncritical_active_sessions = 10"),
                                    "job: critical_active_sessions must be greater than max_active_sessions"),
    "lock_timeout_zero": (config_text("lock_timeout = 0"), "job.lock_timeout"),
    "statement_timeout_negative": (config_text("statement_timeout = -3"), "job.statement_timeout"),
    "batch_idle_timeout_zero": (config_text("batch_idle_timeout = 0"), "job.batch_idle_timeout"),
    "throttle_variable_not_a_prefect_name": (config_text('throttle_variable = "Throttle Me"'),
                                             "job.throttle_variable"),
    "removed_legacy_plaintext": (config_text(extra=f'[keys]\nlegacy_plaintext = "{SECRET}"\n'), "keys.legacy_plaintext"),
    "bad_legacy_algorithm": (config_text(extra=f'[keys]\nlegacy_algorithm = "{SECRET}"\n'), "keys.legacy_algorithm"),
    "bad_forge_algorithm": (config_text(extra=f'[forge]\nalgorithm = "{SECRET}"\n'), "forge.algorithm"),
    "bad_triggers": (config_text(target=TARGET + f'triggers = "{SECRET}"\n'), 'target "Person": triggers'),
    "replica_not_a_postgresql_url": (config_text(database=f'url = "{DB_URL}"\nreplicas = ["mysql://{SECRET}@h/d"]'),
                                     "database.replicas: entry 1 is not a postgresql:// URL"),
    "replicas_not_a_list": (config_text(database=f'url = "{DB_URL}"\nreplicas = "{DB_URL}"'), "database.replicas"),
    # Beside a MySQL / MariaDB database, its replicas are MySQL / MariaDB servers (their own lag is read).
    "mysql_replica_not_a_mysql_url": (config_text(database='url = "mysql://app@h:3306/d"\n'
                                                           f'replicas = ["postgresql://{SECRET}@h/d"]'),
                                      "database.replicas: entry 1 is not a mysql:// or mariadb:// URL"),
}


@pytest.mark.parametrize("case", sorted(NEWER_BAD))
def test_every_newer_setting_is_checked_in_one_line_without_its_value(tmp_path: Path, case: str) -> None:
    text, named = NEWER_BAD[case]
    path = write(tmp_path / "pinrotate.toml", text)
    message = refused(path)
    assert message.startswith(f"{path}: ") and named in message
    assert "\n" not in message and SECRET not in message and "db.internal" not in message


def test_a_bad_newer_override_names_its_variable(tmp_path: Path) -> None:
    path = write(tmp_path / "p.toml", config_text())
    message = refused(path, {"PINROTATE_TASK_RUNNER": SECRET})
    assert message.startswith(f"{path}: job.task_runner (from PINROTATE_TASK_RUNNER): ") and SECRET not in message
    message = refused(path, {"PINROTATE_BATCH_SIZE_MIN": "6000"})
    assert message == f"{path}: job: batch_size_min must not be greater than batch_size_max"


def test_the_forge_provider_reads_forges_own_bootstrap_file_by_default(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("FORGE_CRYPTO_BOOTSTRAP_FILE", raising=False)
    path = write(tmp_path / "p.toml", config_text(extra='[keys]\nprovider = "forge"\n'))
    assert load_settings(path, env={}).keys.file_path == tmp_path / ".forge" / "secrets" / "crypto.properties"
    monkeypatch.setenv("FORGE_CRYPTO_BOOTSTRAP_FILE", str(tmp_path / "mounted" / "crypto.properties"))
    assert load_settings(path, env={}).keys.file_path == tmp_path / "mounted" / "crypto.properties"
    explicit = write(tmp_path / "q.toml", config_text(extra='[keys]\nprovider = "forge"\nfile = "~/f.properties"\n'))
    assert load_settings(explicit, env={}).keys.file_path == tmp_path / "f.properties"


# -- numbers PostgreSQL or a wait would refuse, and errors in the file's own terms (issue 23) ----

OUT_OF_RANGE = {
    "inter_batch_delay_inf": ("inter_batch_delay = inf", "job.inter_batch_delay: must be a finite number"),
    "max_run_duration_nan": ("max_run_duration = nan", "job.max_run_duration: must be a finite number"),
    "batch_time_target_inf": ("batch_time_target = inf", "job.batch_time_target: must be a finite number"),
    "max_replica_lag_inf": ("max_replica_lag = inf", "job.max_replica_lag: must be a finite number"),
    "batch_size_beyond_64_bits": ("batch_size = 100000000000000000000000", "job.batch_size: must be less than"),
    "batch_size_max_huge": ("batch_size_max = 9223372036854775807", "job.batch_size_max: must be less than"),
    "sessions_beyond_postgresql": ("max_active_sessions = 262144", "job.max_active_sessions: must be less than"),
    "lock_timeout_below_a_millisecond": ("lock_timeout = 0.0004", "job.lock_timeout: must be greater than or equal"),
    "lock_timeout_beyond_int32_ms": ("lock_timeout = 1e12", "job.lock_timeout: must be less than or equal"),
    "statement_timeout_beyond_int32_ms": ("statement_timeout = 2147484", "job.statement_timeout: must be less"),
    "idle_timeout_inf": ("batch_idle_timeout = inf", "job.batch_idle_timeout: must be a finite number"),
    "polling_interval_huge": ("polling_interval = 100000000000", "job.polling_interval: must be less than"),
}


@pytest.mark.parametrize("case", sorted(OUT_OF_RANGE))
def test_non_finite_and_out_of_range_numbers_are_refused_at_start_naming_the_setting(tmp_path: Path,
                                                                                     case: str) -> None:
    job, named = OUT_OF_RANGE[case]
    path = write(tmp_path / "p.toml", config_text(job))
    message = refused(path)
    assert message.startswith(f"{path}: {named}"), message
    assert "\n" not in message


def test_an_infinite_duration_from_the_environment_is_refused_naming_the_variable(tmp_path: Path) -> None:
    message = refused(write(tmp_path / "p.toml", config_text()), {"PINROTATE_INTER_BATCH_DELAY": "inf"})
    assert "job.inter_batch_delay (from PINROTATE_INTER_BATCH_DELAY): must be a finite number" in message


def test_the_postgresql_timeouts_accept_their_whole_range_in_milliseconds(tmp_path: Path) -> None:
    job = load_settings(write(tmp_path / "p.toml", config_text(
        "lock_timeout = 0.001\nstatement_timeout = 2147483.647\nbatch_idle_timeout = 1")), env={}).job
    assert (int(job.lock_timeout * 1000), int(job.statement_timeout * 1000)) == (1, 2**31 - 1)


def test_errors_speak_toml_naming_a_target_by_its_name_and_entries_from_one() -> None:
    target = {"name": "Person", "table": "t", "key_version": "kv", "columns": ["c"]}
    cases = [
        ({"targets": [target, {**target, "name": "Other", "columns": "c"}]},
         'target "Other": columns: must be an array'),
        ({"targets": [{**target, "columns": ["c", 7]}]}, 'target "Person": columns entry 2: must be a string'),
        ({"targets": [target, {**target, "name": "no good!", "tenant": 1}]}, "[[targets]] table 2: name: must match"),
        ({"targets": [target], "job": "fast"}, "job: must be a table"),
        ({"targets": [target], "job": {"single_instance": 1}}, "job.single_instance: must be true or false"),
        ({"targets": [target], "job": {"batch_size": 2.5}}, "job.batch_size: must be an integer"),
        ({"targets": [target], "database": {"replicas": [7]}}, "database.replicas entry 1: must be a string"),
    ]
    for mapping, expected in cases:
        with pytest.raises(ConfigError) as err:
            settings_from_mapping(mapping, env={}, source="p.toml")
        message = str(err.value)
        assert message.startswith(f"p.toml: {expected}"), message
        assert "Input should" not in message and "tuple" not in message and "[0]" not in message


def test_legacy_algorithm_defaults_to_forges_own_setting_and_may_be_set_per_target_and_column(tmp_path: Path) -> None:
    """[keys] legacy_algorithm unset: FORGE_CRYPTO_ALGORITHM, else [forge] algorithm, else SM4; a
    target or a column may say otherwise; anything but SM4 / AES is a one-line error naming it."""
    path = write(tmp_path / "p.toml", config_text(extra='[forge]\nalgorithm = "AES"\n'))
    assert load_settings(path, env={}).keys.legacy_algorithm == "AES"
    assert load_settings(path, env={"FORGE_CRYPTO_ALGORITHM": "sm4"}).keys.legacy_algorithm == "SM4"
    fpc1 = ('[[targets]]\nname = "F"\ntable = "f"\ncolumns = ["phone", "id_card"]\nformat = "fpc1"\n'
            'legacy_algorithm = { phone = "SM4", id_card = "aes" }\n')
    s = load_settings(write(tmp_path / "q.toml", config_text() + fpc1), env={})
    assert s.target("F").legacy_algorithm == {"phone": "SM4", "id_card": "AES"}
    bad = fpc1.replace('id_card = "aes"', 'address = "AES"')
    with pytest.raises(ConfigError, match=r"^[^\n]*legacy_algorithm names column address"):
        load_settings(write(tmp_path / "r.toml", config_text() + bad), env={})


def test_replicas_of_a_mysql_database_are_mysql_or_mariadb_urls(tmp_path: Path) -> None:
    path = write(tmp_path / "pinrotate.toml", config_text(
        database='url = "mysql://app@h:3306/d"\nreplicas = ["mysql://app@r1:3306/d", "mariadb://app@r2/d"]'))
    assert load_settings(str(path)).database.replicas == ("mysql://app@r1:3306/d", "mariadb://app@r2/d")
