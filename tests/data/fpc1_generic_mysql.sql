-- MySQL / MariaDB twin of fpc1_generic.sql (the generic `fpc1` tests on MariaDB, issue 32): the same
-- tables, columns and meaning; see fpc1_generic.sql and fpc1_generic.toml. Schema only, no data.

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
    updated_at  datetime(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)
);

CREATE INDEX IF NOT EXISTS data_connections_tenant_idx ON data_connections (tenant_id);

-- Low-code form configs: one JSON document per config, several encrypted fields inside.
CREATE TABLE IF NOT EXISTS lowcode_configs (
    id              bigint PRIMARY KEY,
    tenant_id       bigint NOT NULL,
    deleted         boolean NOT NULL DEFAULT false,
    config_key      varchar(128) NOT NULL,
    encrypt_config  text NULL,
    version         integer NOT NULL DEFAULT 1,
    updated_at      datetime(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)
);

CREATE INDEX IF NOT EXISTS lowcode_configs_tenant_idx ON lowcode_configs (tenant_id);
