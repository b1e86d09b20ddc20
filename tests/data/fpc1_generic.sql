-- Forge-like schema for the generic `fpc1` tests: data-connection passwords and low-code JSON configs
-- (Forge's own tables are examples/forge.sql).
-- Schema only, no data; safe to run again (IF NOT EXISTS everywhere). See fpc1_generic.toml.
--
-- Encrypted values are self-describing text, `FPC1:<SM4|AES>:<keyId>:<base64>`, next to older
-- unversioned (legacy) base64 ciphertexts; there is no key-version column. Rows are per tenant and
-- soft-deleted with a flag: pinrotate only reads and rewrites rows in scope (the given tenant, not
-- deleted), only the encrypted column, and never runs DDL: a column too narrow for the new
-- ciphertexts is reported BLOCKED, to be widened by the operator.

CREATE TABLE IF NOT EXISTS data_connections (
    id          bigint PRIMARY KEY,
    tenant_id   bigint NOT NULL,
    name        varchar(128) NOT NULL,
    db_type     varchar(32) NOT NULL DEFAULT 'postgresql',
    jdbc_url    varchar(1024) NOT NULL DEFAULT '',
    username    varchar(128) NULL,
    -- FPC1 or legacy ciphertext of the connection password; NULL when there is none
    password    varchar(255) NULL,
    deleted     boolean NOT NULL DEFAULT false,
    version     integer NOT NULL DEFAULT 1,
    updated_at  timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX IF NOT EXISTS data_connections_tenant_idx ON data_connections (tenant_id);

-- Low-code form configs: one JSON document per config, several encrypted fields inside
-- (e.g. {"host": "...", "password": "FPC1:...", "token": "FPC1:..."}); the other fields are clear.
CREATE TABLE IF NOT EXISTS lowcode_configs (
    id              bigint PRIMARY KEY,
    tenant_id       bigint NOT NULL,
    deleted         boolean NOT NULL DEFAULT false,
    config_key      varchar(128) NOT NULL,
    encrypt_config  text NULL,
    version         integer NOT NULL DEFAULT 1,
    updated_at      timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX IF NOT EXISTS lowcode_configs_tenant_idx ON lowcode_configs (tenant_id);
