"""``pinrotate.toml``: read, overlay environment variables, validate in full before anything runs.

Every error is one line naming the setting (``job.batch_size``), never echoing a value: a database
URL or a token may sit in the same file. A bad configuration touches nothing (exit code 2).
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import ConfigError

DEFAULT_CONFIG_NAME = "pinrotate.toml"
TARGET_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
FORMATS = ("aesgcm", "fpc1", "vault-transit")


def pinrotate_home() -> Path:
    return Path(os.environ.get("PINROTATE_HOME", "~/.pinrotate")).expanduser()


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DatabaseSettings(_Strict):
    url: str | None = None  # absent: embedded PostgreSQL under $PINROTATE_HOME


class VaultSettings(_Strict):
    addr: str | None = None
    token: str | None = Field(default=None, repr=False)
    namespace: str | None = None
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
    ca_cert: str | None = None
    timeout: float = Field(default=10.0, gt=0)

    @model_validator(mode="after")
    def _auth_complete(self) -> VaultSettings:
        if self.auth == "approle" and not self.role_id:
            raise ValueError("auth = \"approle\" needs role_id")
        if self.auth == "kubernetes" and not self.role:
            raise ValueError("auth = \"kubernetes\" needs role")
        return self


class KeysSettings(_Strict):
    provider: Literal["file", "env", "k8s-dir", "vault-kv", "vault-transit"] = "file"
    file: str | None = None  # default $PINROTATE_HOME/keys.toml
    dir: str | None = None  # k8s-dir: mounted Secret folder
    write_versioned: bool = True
    legacy_read_enabled: bool = False
    legacy_format: Literal["aesgcm-b64", "aes-ecb-b64"] = "aesgcm-b64"
    vault: VaultSettings = VaultSettings()

    @model_validator(mode="after")
    def _provider_complete(self) -> KeysSettings:
        if self.provider == "k8s-dir" and not self.dir:
            raise ValueError("provider \"k8s-dir\" needs keys.dir")
        if self.provider == "vault-kv" and not self.vault.path:
            raise ValueError("provider \"vault-kv\" needs keys.vault.path")
        if self.provider == "vault-transit" and not self.vault.key:
            raise ValueError("provider \"vault-transit\" needs keys.vault.key")
        return self

    @property
    def file_path(self) -> Path:
        return Path(self.file).expanduser() if self.file else pinrotate_home() / "keys.toml"


class JobSettings(_Strict):
    batch_size: int = Field(default=200, gt=0)
    max_degree_of_parallelism: int = Field(default=1, ge=1, le=64)
    inter_batch_delay: float = Field(default=0.2, ge=0)
    max_run_duration: float = Field(default=600, gt=0)
    polling_interval: int = Field(default=300, gt=0)
    single_instance: bool = False
    # Where the drain tasks run: threads of the flow's process, or Dask worker processes (an
    # existing cluster at dask_address, else a local cluster of max_degree_of_parallelism processes).
    task_runner: Literal["threads", "dask"] = "threads"
    dask_address: str | None = None


class MetricsSettings(_Strict):
    prefix: str = Field(default="profile_crypto_reencrypt", pattern=r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
    pushgateway: str | None = None
    textfile: str | None = None
    job: str = "pinrotate"  # Pushgateway grouping key


class TargetSettings(_Strict):
    name: str
    table: str
    id: str = "id"
    key_version: str | None = None
    columns: tuple[str, ...] = Field(min_length=1)
    format: Literal["aesgcm", "fpc1", "vault-transit"] = "aesgcm"
    require_not_null: tuple[str, ...] = ()
    tenant: str | None = None
    soft_delete: str | None = None
    json_paths: dict[str, tuple[str, ...]] = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not TARGET_NAME.fullmatch(v):
            raise ValueError("must match [A-Za-z0-9_.-]{1,64}")
        return v

    @field_validator("table")
    @classmethod
    def _table(cls, v: str) -> str:
        parts = v.split(".")
        if len(parts) > 2 or not all(parts):
            raise ValueError("must be \"table\" or \"schema.table\"")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> TargetSettings:
        if self.format == "aesgcm" and not self.key_version:
            raise ValueError("an aesgcm target needs key_version (the integer key-version column)")
        if len(set(self.columns)) != len(self.columns):
            raise ValueError("columns are listed twice")
        for col in self.json_paths:
            if col not in self.columns:
                raise ValueError(f"json_paths names column {col} that is not in columns")
        if self.json_paths and self.format != "fpc1":
            raise ValueError("json_paths is supported for fpc1 targets only")
        return self

    @property
    def schema_name(self) -> str | None:
        return self.table.split(".")[0] if "." in self.table else None

    @property
    def table_name(self) -> str:
        return self.table.split(".")[-1]


class Settings(_Strict):
    database: DatabaseSettings = DatabaseSettings()
    keys: KeysSettings = KeysSettings()
    job: JobSettings = JobSettings()
    metrics: MetricsSettings = MetricsSettings()
    targets: tuple[TargetSettings, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique_targets(self) -> Settings:
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


# Environment variables that override single settings: (section, key) paths.
_ENV_OVERRIDES: dict[str, tuple[str, ...]] = {
    "PINROTATE_DATABASE_URL": ("database", "url"),
    "PINROTATE_KEYS_PROVIDER": ("keys", "provider"),
    "PINROTATE_KEYS_FILE": ("keys", "file"),
    "PINROTATE_KEYS_DIR": ("keys", "dir"),
    "PINROTATE_WRITE_VERSIONED": ("keys", "write_versioned"),
    "PINROTATE_LEGACY_READ_ENABLED": ("keys", "legacy_read_enabled"),
    "PINROTATE_BATCH_SIZE": ("job", "batch_size"),
    "PINROTATE_MAX_DEGREE_OF_PARALLELISM": ("job", "max_degree_of_parallelism"),
    "PINROTATE_INTER_BATCH_DELAY": ("job", "inter_batch_delay"),
    "PINROTATE_MAX_RUN_DURATION": ("job", "max_run_duration"),
    "PINROTATE_SINGLE_INSTANCE": ("job", "single_instance"),
    "PINROTATE_METRICS_PUSHGATEWAY": ("metrics", "pushgateway"),
    "PINROTATE_METRICS_TEXTFILE": ("metrics", "textfile"),
    "VAULT_ADDR": ("keys", "vault", "addr"),
    "VAULT_TOKEN": ("keys", "vault", "token"),
    "VAULT_NAMESPACE": ("keys", "vault", "namespace"),
    "VAULT_CACERT": ("keys", "vault", "ca_cert"),
}


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
        raw = tomllib.loads(cfg_path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        # tomllib's message carries line and column, not the offending text.
        raise ConfigError(f"{cfg_path}: not valid TOML ({e})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{cfg_path}: cannot read ({type(e).__name__})") from None
    return settings_from_mapping(raw, env=env, source=str(cfg_path))


def settings_from_mapping(raw: Mapping[str, Any], *, env: Mapping[str, str] | None = None,
                          source: str = "configuration") -> Settings:
    env = os.environ if env is None else env
    data = _deep_copy(raw)
    origins: dict[tuple[str, ...], str] = {}
    for var, where in _ENV_OVERRIDES.items():
        value = env.get(var)
        if value is None or value == "":
            continue
        node = data
        for part in where[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{source}: {'.'.join(where[:-1])} must be a table")
        node[where[-1]] = value
        origins[where] = var
    try:
        return Settings.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"{source}: {describe_validation_error(e, origins)}") from None


def describe_validation_error(e: ValidationError, origins: Mapping[tuple[str, ...], str] | None = None) -> str:
    """First error as ``dotted.setting: message``; pydantic's input value is deliberately left out.

    A setting that came from an environment variable is named with it, so the operator looks there
    and not in the file.
    """
    parts = []
    for err in e.errors(include_url=False, include_input=False):
        loc = ""
        for item in err["loc"]:
            loc += f"[{item}]" if isinstance(item, int) else (f".{item}" if loc else str(item))
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown setting"
        elif err["type"] == "missing":
            msg = "required setting is missing"
        var = (origins or {}).get(tuple(str(i) for i in err["loc"]))
        parts.append(f"{loc or 'configuration'}{f' (from {var})' if var else ''}: {msg}")
    more = f" (and {len(parts) - 1} more)" if len(parts) > 1 else ""
    return parts[0] + more


def _deep_copy(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return {k: _deep_copy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_deep_copy(v) for v in obj]
    return obj
