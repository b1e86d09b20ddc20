-- Forge's own tables (PostgreSQL flavour), as far as pinrotate reads them: the data-connection
-- passwords, the low-code CRUD configs that say which business columns are encrypted, and one
-- low-code business table. Forge's own migrations are MySQL (see docs/reference.md, "Forge");
-- these are the same columns in PostgreSQL types. Schema only; safe to run again.
--
-- Encrypted values are what Forge writes: `FPC1:<SM4|AES>:<keyId>:<base64>` (SM4 or AES, ECB,
-- PKCS#7) and, from before write-versioned was on, the bare base64 under the legacy key.
-- pinrotate reads and rewrites only the encrypted columns of rows in scope (del_flag = '0'), and
-- never runs DDL.

CREATE TABLE IF NOT EXISTS ai_report_data_connection (
    id               bigint PRIMARY KEY,
    tenant_id        bigint NOT NULL DEFAULT 1,
    connection_code  varchar(64) NOT NULL,
    connection_name  varchar(128) NOT NULL,
    db_type          varchar(32) NOT NULL DEFAULT 'MYSQL',
    jdbc_url         varchar(1000) NOT NULL DEFAULT '',
    username         varchar(128) NULL,
    password_cipher  varchar(500) NULL,          -- FPC1 or legacy ciphertext; NULL when there is none
    create_time      timestamp NOT NULL DEFAULT CURRENT_TIMESTAMP,
    update_time      timestamp NOT NULL DEFAULT CURRENT_TIMESTAMP,
    del_flag         char(1) NOT NULL DEFAULT '0' -- '0' live, '1' deleted
);

CREATE TABLE IF NOT EXISTS ai_crud_config (
    id              bigint PRIMARY KEY,
    tenant_id       bigint NOT NULL DEFAULT 1,
    config_key      varchar(128) NOT NULL UNIQUE,
    table_name      varchar(128) NOT NULL,
    -- {"phone": {"algorithm": "SM4"}, "idCard": {"algorithm": "AES"}}: camelCase fields,
    -- snake_case columns of table_name, each field's algorithm
    encrypt_config  json NULL,
    create_time     timestamp NOT NULL DEFAULT CURRENT_TIMESTAMP,
    update_time     timestamp NOT NULL DEFAULT CURRENT_TIMESTAMP,
    del_flag        char(1) NOT NULL DEFAULT '0'
);

-- A low-code business table with two encrypted fields (config_key 'crm_customer').
CREATE TABLE IF NOT EXISTS crm_customer (
    id           bigint PRIMARY KEY,
    tenant_id    bigint NOT NULL DEFAULT 1,
    name         varchar(128) NOT NULL,
    phone        varchar(255) NULL,
    id_card      varchar(255) NULL,
    update_time  timestamp NOT NULL DEFAULT CURRENT_TIMESTAMP,
    del_flag     char(1) NOT NULL DEFAULT '0'
);
