"""``pinrotate.toml``: read, overlay environment variables, validate in full before anything runs.

Every error is one line naming the setting (``job.batch_size``) and, for an environment variable,
where it came from; never a value: a database URL or a token may sit in the same file. A bad
configuration touches nothing (exit code 2). Types are strict: ``batch_size = "200"`` is refused.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict, TomlConfigSettingsSource

from .config_env import EnvironmentSource
from .config_errors import TARGET_NAME, describe_validation_error
from .config_forge import FORGE_ALGORITHMS, REMOVED_KEYS_SETTINGS, ForgeSettings, algorithm_code
from .errors import ConfigError
from .schemes import DEFAULT_FORMAT, FORMATS, known_formats

DEFAULT_CONFIG_NAME = "pinrotate.toml"
# Forge's own default for its bootstrap keyring (design 003), used when provider = "forge".
FORGE_BOOTSTRAP_FILE = "~/.forge/secrets/crypto.properties"
# When neither batch_size nor batch_time_target is set, batches adapt towards this many seconds.
# Seconds per batch, read to commit (its rows are locked only for the write at its end). Far below
# pt-online-schema-change's 0.5 s chunk time: a row locked by a batch makes an application's
# UPDATE of it wait until the batch commits, and
# benchmarks/writer_latency.py shows the writer's p99 growing with the target (0.02 s: about
# +9..12 ms beside a 100k-row table on 2 shared cores; 0.05 s: +17; 0.5 s: +28..70).
DEFAULT_BATCH_TIME_TARGET = 0.02
# Bounds checked at start, so that no setting reaches PostgreSQL or a wait as something they refuse.
# PostgreSQL's lock_timeout, statement_timeout and idle_in_transaction_session_timeout are int32
# milliseconds, and 0 means "no timeout": a set timeout is therefore at least 1 ms.
PG_TIMEOUT_MIN = 0.001
PG_TIMEOUT_MAX = 2_147_483.647
MAX_SECONDS = 365 * 24 * 3600  # any other duration: a year is far past a sensible one
MAX_BATCH_ROWS = 1_000_000  # rows in one batch transaction
MAX_SESSIONS = 262_143  # PostgreSQL's limit on max_connections


def pinrotate_home() -> Path:
    return Path(os.environ.get("PINROTATE_HOME", "~/.pinrotate")).expanduser()


def env(name: str, *variables: str) -> AliasChoices:
    """The setting ``name`` in the file, or any of the environment ``variables`` (which win)."""
    return AliasChoices(name, *variables)


class _Strict(BaseModel):
    # strict: a TOML string is no number and no boolean; environment strings are converted first.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class DatabaseSettings(_Strict):
    url: str | None = Field(default=None, validation_alias=env("url", "PINROTATE_DATABASE_URL"))  # absent: embedded
    # The throttle's lag watch: absent: the primary's standbys, found from pg_stat_replication; [] checks no
    # replica at all. The gate always checks the primary's standbys and slots, and these URLs besides.
    replicas: tuple[str, ...] | None = Field(default=None, strict=False)

    @field_validator("replicas")
    @classmethod
    def _replica_urls(cls, urls: tuple[str, ...] | None, info: ValidationInfo) -> tuple[str, ...] | None:
        """Replicas of the database's own engine: ``postgresql://`` beside a PostgreSQL database,
        ``mysql://`` / ``mariadb://`` beside a MySQL / MariaDB one (the throttle reads each one's
        own replication status there)."""
        url = info.data.get("url")
        mysql = isinstance(url, str) and re.match(r"(mysql|mariadb)(\+\w+)?://", url) is not None
        pattern, scheme = (r"(mysql|mariadb)(\+\w+)?://", "mysql:// or mariadb://") if mysql else \
            (r"postgres(ql)?(\+psycopg)?://", "postgresql://")
        for i, url in enumerate(urls or ()):
            if not re.match(pattern, url):
                raise ValueError(f"entry {i + 1} is not a {scheme} URL")
        return urls


class VaultSettings(_Strict):
    addr: str | None = Field(default=None, validation_alias=env("addr", "VAULT_ADDR"))
    token: str | None = Field(default=None, repr=False, validation_alias=env("token", "VAULT_TOKEN"))
    namespace: str | None = Field(default=None, validation_alias=env("namespace", "VAULT_NAMESPACE"))
    auth: Literal["token", "approle", "kubernetes"] = "token"
    role_id: str | None = None
    secret_id: str | None = Field(default=None, repr=False)
    secret_id_file: str | None = None
    role: str | None = None  # kubernetes auth role
    jwt_file: str = "/var/run/secrets/kubernetes.io/serviceaccount/token"
    auth_mount: str | None = None  # defaults to "approle" / "kubernetes"
    mount: str = "secret"  # KV v2 mount
    path: str | None = None  # KV v2 secret path
    transit_mount: str = "transit"
    key: str | None = None  # transit key name
    verify: bool = True
    ca_cert: str | None = Field(default=None, validation_alias=env("ca_cert", "VAULT_CACERT"))
    timeout: float = Field(default=10.0, gt=0, le=MAX_SECONDS, allow_inf_nan=False)

    @model_validator(mode="after")
    def _auth_complete(self) -> VaultSettings:
        if self.auth == "approle" and not self.role_id:
            raise ValueError("auth = \"approle\" needs role_id")
        if self.auth == "kubernetes" and not self.role:
            raise ValueError("auth = \"kubernetes\" needs role")
        return self


class KeysSettings(_Strict):
    provider: Literal["file", "env", "k8s-dir", "vault-kv", "vault-transit", "forge"] = Field(
        default="file", validation_alias=env("provider", "PINROTATE_KEYS_PROVIDER"))
    # default: $PINROTATE_HOME/keys.toml; for provider "forge" Forge's own bootstrap file
    file: str | None = Field(default=None, validation_alias=env("file", "PINROTATE_KEYS_FILE"))
    dir: str | None = Field(default=None, validation_alias=env("dir", "PINROTATE_KEYS_DIR"))  # k8s-dir: the Secret folder
    write_versioned: bool = Field(default=True, validation_alias=env("write_versioned", "PINROTATE_WRITE_VERSIONED"))
    legacy_read_enabled: bool = Field(default=False, validation_alias=env("legacy_read_enabled",
                                                                  "PINROTATE_LEGACY_READ_ENABLED"))
    # fpc1: the algorithm of legacy (headerless) values, SM4 or AES; a target or a column may say
    # otherwise. Unset: Forge's forge.crypto.algorithm ([forge] algorithm, FORGE_CRYPTO_ALGORITHM), else SM4.
    legacy_algorithm: str | None = None
    vault: VaultSettings = VaultSettings()

    @model_validator(mode="before")
    @classmethod
    def _removed_settings(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            for name in REMOVED_KEYS_SETTINGS:
                if name in data:
                    raise ValueError(f"keys.{name} is no longer a setting: fpc1 legacy values are Forge's own form"
                                     " (SM4 or AES, ECB/PKCS#7, base64); say their algorithm with legacy_algorithm")
        return data

    @field_validator("legacy_algorithm")
    @classmethod
    def _legacy_algorithm(cls, code: str | None) -> str | None:
        return None if code is None else algorithm_code(code)

    @model_validator(mode="after")
    def _provider_complete(self) -> KeysSettings:
        if self.provider == "k8s-dir" and not self.dir:
            raise ValueError("provider \"k8s-dir\" needs keys.dir")
        if self.provider == "vault-kv" and not self.vault.path:
            raise ValueError("provider \"vault-kv\" needs keys.vault.path")
        if self.provider == "vault-transit" and not self.vault.key:
            raise ValueError("provider \"vault-transit\" needs keys.vault.key")
        # forge: Forge's own write-versioned / legacy-read-enabled decide, as for Forge's migration
        # endpoint; a second, possibly different, value here would only mislead.
        fixed = sorted({"write_versioned", "legacy_read_enabled"} & self.model_fields_set)
        if self.provider == "forge" and fixed:
            raise ValueError(f"{fixed[0]} cannot be set with provider \"forge\": it comes from Forge's"
                             f" forge.crypto.persistence.{fixed[0].replace('_', '-')}")
        return self

    @property
    def file_path(self) -> Path:
        if self.file:
            return Path(self.file).expanduser()
        if self.provider == "forge":
            return Path(os.environ.get("FORGE_CRYPTO_BOOTSTRAP_FILE") or FORGE_BOOTSTRAP_FILE).expanduser()
        return pinrotate_home() / "keys.toml"


def _seconds(default: float | None, variable: str, name: str, *, ge: float | None = None,
             le: float = MAX_SECONDS) -> Any:
    """A finite duration in seconds (> 0 unless ``ge`` says otherwise, at most ``le``), overridable
    by ``variable``."""
    limits = {"ge": ge} if ge is not None else {"gt": 0}
    return Field(default=default, validation_alias=env(name, variable), le=le, allow_inf_nan=False, **limits)


def _pg_timeout(default: float, variable: str, name: str) -> Any:
    """A PostgreSQL timeout in seconds: whole milliseconds from 1 ms to PostgreSQL's int32 limit."""
    return _seconds(default, variable, name, ge=PG_TIMEOUT_MIN, le=PG_TIMEOUT_MAX)


class JobSettings(_Strict):
    batch_size: int = Field(default=200, gt=0, le=MAX_BATCH_ROWS, validation_alias=env("batch_size", "PINROTATE_BATCH_SIZE"))
    max_degree_of_parallelism: int = Field(default=1, ge=1, le=64, validation_alias=env(
        "max_degree_of_parallelism", "PINROTATE_MAX_DEGREE_OF_PARALLELISM"))
    inter_batch_delay: float = _seconds(0.2, "PINROTATE_INTER_BATCH_DELAY", "inter_batch_delay", ge=0)
    max_run_duration: float = _seconds(600, "PINROTATE_MAX_RUN_DURATION", "max_run_duration")
    polling_interval: int = Field(default=300, gt=0, le=MAX_SECONDS, validation_alias=env("polling_interval", "PINROTATE_POLLING_INTERVAL"))
    single_instance: bool = Field(default=False, validation_alias=env("single_instance", "PINROTATE_SINGLE_INSTANCE"))
    task_runner: Literal["threads", "dask"] = Field(default="threads", validation_alias=env("task_runner",
                                                                                   "PINROTATE_TASK_RUNNER"))
    # An existing Dask cluster's scheduler; absent: a local cluster of max_degree_of_parallelism processes.
    dask_address: str | None = Field(default=None, pattern=r"^[a-z][a-z0-9+]*://\S+$",
                                     validation_alias=env("dask_address", "PINROTATE_DASK_ADDRESS"))
    # Adaptive batches: the batch size moves within [batch_size_min, batch_size_max] so that one
    # batch takes about this long. See adaptive_batch_target for when it applies.
    batch_time_target: float | None = _seconds(None, "PINROTATE_BATCH_TIME_TARGET", "batch_time_target")
    batch_size_min: int = Field(default=50, gt=0, le=MAX_BATCH_ROWS, validation_alias=env("batch_size_min", "PINROTATE_BATCH_SIZE_MIN"))
    batch_size_max: int = Field(default=5000, gt=0, le=MAX_BATCH_ROWS, validation_alias=env("batch_size_max", "PINROTATE_BATCH_SIZE_MAX"))
    # Back-pressure: the drain waits between batches while a replica lags more than this or more
    # sessions than this are active; beyond the critical_* levels the run stops (exit 4).
    max_replica_lag: float | None = _seconds(None, "PINROTATE_MAX_REPLICA_LAG", "max_replica_lag")
    max_active_sessions: int | None = Field(default=None, gt=0, le=MAX_SESSIONS, validation_alias=env("max_active_sessions",
                                                                            "PINROTATE_MAX_ACTIVE_SESSIONS"))
    critical_replica_lag: float | None = _seconds(None, "PINROTATE_CRITICAL_REPLICA_LAG", "critical_replica_lag")
    critical_active_sessions: int | None = Field(default=None, gt=0, le=MAX_SESSIONS, validation_alias=env(
        "critical_active_sessions", "PINROTATE_CRITICAL_ACTIVE_SESSIONS"))
    # Per batch transaction (SET LOCAL lock_timeout / statement_timeout).
    lock_timeout: float = _pg_timeout(2.0, "PINROTATE_LOCK_TIMEOUT", "lock_timeout")
    statement_timeout: float = _pg_timeout(30.0, "PINROTATE_STATEMENT_TIMEOUT", "statement_timeout")
    # SET LOCAL idle_in_transaction_session_timeout: the server ends a batch transaction that sits
    # this long between two statements (a stuck key provider, a frozen process) and frees its rows.
    batch_idle_timeout: float = _pg_timeout(60.0, "PINROTATE_BATCH_IDLE_TIMEOUT", "batch_idle_timeout")
    # The Prefect Variable an operator sets to slow down or pause running drains.
    throttle_variable: str = Field(default="pinrotate_throttle", pattern=r"^[a-z0-9_-]{1,255}$",
                                   validation_alias=env("throttle_variable", "PINROTATE_THROTTLE_VARIABLE"))

    @model_validator(mode="after")
    def _consistent(self) -> JobSettings:
        if self.batch_size_min > self.batch_size_max:
            raise ValueError("batch_size_min must not be greater than batch_size_max")
        if self.dask_address and self.task_runner != "dask":
            raise ValueError("dask_address is only used with task_runner = \"dask\"")
        for level in ("replica_lag", "active_sessions"):
            wait, stop = getattr(self, f"max_{level}"), getattr(self, f"critical_{level}")
            if wait is not None and stop is not None and stop <= wait:
                raise ValueError(f"critical_{level} must be greater than max_{level}")
        return self

    @property
    def adaptive_batch_target(self) -> float | None:
        """Seconds per batch that adaptive batching aims for; None: fixed batches of batch_size.

        batch_time_target set: adaptive. Neither it nor batch_size set: adaptive, DEFAULT_BATCH_TIME_TARGET.
        Only batch_size set: fixed, as before adaptive batches existed.
        """
        if self.batch_time_target is not None:
            return self.batch_time_target
        return None if "batch_size" in self.model_fields_set else DEFAULT_BATCH_TIME_TARGET

    @property
    def first_batch_size(self) -> int:
        """The size of the first batch: batch_size, kept within the adaptive bounds when adaptive."""
        if self.adaptive_batch_target is None:
            return self.batch_size
        return min(max(self.batch_size, self.batch_size_min), self.batch_size_max)


class GateSettings(_Strict):
    """``[gate]``: how long the retire gate may wait before answering (it answers closed when the wait runs out)."""

    wait: float = _seconds(60.0, "PINROTATE_GATE_WAIT", "wait")  # in-flight transactions, standbys' flush
    # The sweep outside the targets (gate.discover): tables or columns the operator vouches for, as
    # "schema.table" or "schema.table.column" globs; reported as not swept, never silently.
    discover_skip: tuple[str, ...] = Field(default=(), strict=False)
    discover_sample: int = Field(default=200, ge=1, le=100_000)  # values tried per bytea / base64 text column

    @field_validator("discover_skip")
    @classmethod
    def _skip_patterns(cls, patterns: tuple[str, ...]) -> tuple[str, ...]:
        for i, pattern in enumerate(patterns):
            parts = pattern.split(".")
            if len(parts) not in (2, 3) or not all(parts):
                raise ValueError(f"entry {i} must be \"schema.table\" or \"schema.table.column\" (globs allowed)")
        return patterns


class MetricsSettings(_Strict):
    prefix: str = Field(default="profile_crypto_reencrypt", pattern=r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
    pushgateway: str | None = Field(default=None, validation_alias=env("pushgateway", "PINROTATE_METRICS_PUSHGATEWAY"))
    textfile: str | None = Field(default=None, validation_alias=env("textfile", "PINROTATE_METRICS_TEXTFILE"))
    job: str = "pinrotate"  # Pushgateway grouping key


class TargetSettings(_Strict):
    name: str = Field(pattern=f"^{TARGET_NAME.pattern}$")
    table: str
    id: str = "id"
    key_version: str | None = None
    columns: tuple[str, ...] = Field(min_length=1, strict=False)
    format: str = DEFAULT_FORMAT  # a name of schemes.FORMATS (its scheme registers it)
    require_not_null: tuple[str, ...] = Field(default=(), strict=False)
    tenant: str | None = None
    soft_delete: str | None = None
    json_paths: dict[str, Annotated[tuple[str, ...], Strict(False)]] = Field(default_factory=dict)
    # UPDATE triggers on the table: "block" the target (default), "disable" them for each batch
    # (session_replication_role = replica), or let them "fire" and accept their side effects.
    triggers: Literal["block", "disable", "fire"] = "block"
    # fpc1: the algorithm of this target's legacy values, for all its columns ("SM4") or per column
    # ({ phone = "SM4", id_card = "AES" }; a column not named takes [keys] legacy_algorithm).
    legacy_algorithm: str | dict[str, str] | None = None

    @field_validator("legacy_algorithm")
    @classmethod
    def _legacy_algorithm(cls, v: str | dict[str, str] | None) -> str | dict[str, str] | None:
        if isinstance(v, dict):
            return {column: algorithm_code(code) for column, code in v.items()}
        return None if v is None else algorithm_code(v)

    @field_validator("table")
    @classmethod
    def _table(cls, v: str) -> str:
        parts = v.split(".")
        if len(parts) > 2 or not all(parts):
            raise ValueError("must be \"table\" or \"schema.table\"")
        return v

    @field_validator("format")
    @classmethod
    def _known_format(cls, name: str) -> str:
        if name not in FORMATS:
            raise ValueError(f"not a known format (known: {', '.join(known_formats())})")
        return name

    @model_validator(mode="after")
    def _consistent(self) -> TargetSettings:
        rules = FORMATS[self.format]
        if rules.needs_key_version and not self.key_version:
            article = "an" if self.format[:1] in "aeiou" else "a"
            raise ValueError(f"{article} {self.format} target needs key_version (the integer key-version column)")
        if len(set(self.columns)) != len(self.columns):
            raise ValueError("columns are listed twice")
        for col in self.json_paths:
            if col not in self.columns:
                raise ValueError(f"json_paths names column {col} that is not in columns")
        if isinstance(self.legacy_algorithm, dict):
            for col in self.legacy_algorithm:
                if col not in self.columns:
                    raise ValueError(f"legacy_algorithm names column {col} that is not in columns")
        if self.legacy_algorithm is not None and not rules.legacy_values:
            allowed = [name for name in known_formats() if FORMATS[name].legacy_values]
            raise ValueError(f"legacy_algorithm is for {' and '.join(allowed)} targets only")
        if self.json_paths and not rules.json_paths:
            allowed = [name for name in known_formats() if FORMATS[name].json_paths]
            raise ValueError(f"json_paths is supported for {' and '.join(allowed)} targets only")
        return self

    @property
    def schema_name(self) -> str | None:
        return self.table.split(".")[0] if "." in self.table else None

    @property
    def table_name(self) -> str:
        return self.table.split(".")[-1]


class Settings(BaseSettings):
    # Built by load_settings/settings_from_mapping from explicit sources, never from the
    # process environment behind the caller's back.
    model_config = SettingsConfigDict(extra="forbid", frozen=True, strict=True)

    database: DatabaseSettings = DatabaseSettings()
    keys: KeysSettings = KeysSettings()
    job: JobSettings = JobSettings()
    metrics: MetricsSettings = MetricsSettings()
    gate: GateSettings = GateSettings()
    forge: ForgeSettings = ForgeSettings()
    targets: tuple[TargetSettings, ...] = Field(default=(), strict=False)

    @model_validator(mode="before")
    @classmethod
    def _forge_default_algorithm(cls, data: Any) -> Any:
        """``[keys] legacy_algorithm`` unset: Forge's own ``forge.crypto.algorithm`` (``[forge] algorithm``
        or ``FORGE_CRYPTO_ALGORITHM``), else SM4, so that a scheme reads one setting."""
        if not isinstance(data, Mapping):
            return data
        keys, forge = data.get("keys", {}), data.get("forge", {})
        if not isinstance(keys, Mapping) or not isinstance(forge, Mapping) or keys.get("legacy_algorithm") is not None:
            return data
        code = forge.get("algorithm", "SM4")
        if isinstance(code, str) and code.upper() in FORGE_ALGORITHMS:
            return {**data, "keys": {**keys, "legacy_algorithm": code.upper()}}
        return data

    @model_validator(mode="after")
    def _unique_targets(self) -> Settings:
        if not self.targets and not self.forge.discover_targets:
            raise ValueError("targets: required setting is missing (configure [[targets]], or set [forge] discover_targets = true)")
        names = [t.name for t in self.targets]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"target names must be unique: {', '.join(dupes)}")
        return self

    def target(self, name: str) -> TargetSettings:
        for t in self.targets:
            if t.name == name:
                return t
        raise ConfigError(f"--target {name}: no such target (have: {', '.join(t.name for t in self.targets)})")


def resolve_config_path(explicit: str | None, env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    if explicit:
        return Path(explicit).expanduser()
    if env.get("PINROTATE_CONFIG"):
        return Path(env["PINROTATE_CONFIG"]).expanduser()
    return Path(DEFAULT_CONFIG_NAME)


def load_settings(path: str | Path | None = None, env: Mapping[str, str] | None = None) -> Settings:
    """Read the configuration file (§3 search order), overlay the environment, validate in full."""
    env = os.environ if env is None else env
    cfg_path = resolve_config_path(str(path) if path is not None else None, env)
    if not cfg_path.is_file():
        if path is None and not env.get("PINROTATE_CONFIG"):
            raise ConfigError(
                f"no configuration: {DEFAULT_CONFIG_NAME} not found; pass --config PATH or set PINROTATE_CONFIG"
            )
        raise ConfigError(f"configuration file not found: {cfg_path}")
    try:
        raw = TomlConfigSettingsSource(Settings, toml_file=cfg_path)()
    except tomllib.TOMLDecodeError as e:
        # tomllib's message carries line and column, not the offending text.
        raise ConfigError(f"{cfg_path}: not valid TOML ({e})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{cfg_path}: cannot read ({type(e).__name__})") from None
    return settings_from_mapping(raw, env=env, source=str(cfg_path))


def settings_from_mapping(raw: Mapping[str, Any], *, env: Mapping[str, str] | None = None,
                          source: str = "configuration") -> Settings:
    environment = EnvironmentSource(Settings, os.environ if env is None else env, source)
    data = _overlay(raw, environment(), source)
    try:
        return Settings.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"{source}: {describe_validation_error(e, environment.origins, data)}") from None


def _overlay(base: Mapping[str, Any], top: Mapping[str, Any], source: str, path: str = "") -> dict[str, Any]:
    """``base`` with ``top`` laid over it, table by table (new dicts: ``base`` stays as it was)."""
    merged = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping):
            below = merged.get(key, {})
            if not isinstance(below, Mapping):
                raise ConfigError(f"{source}: {path}{key} must be a table")
            value = _overlay(below, value, source, f"{path}{key}.")
        merged[key] = value
    return merged
