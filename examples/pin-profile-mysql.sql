-- Pin profile preset on MySQL 8.0+ / MariaDB 10.6+: the four tables of examples/pin-profile.sql in
-- MySQL types, in the database of the URL (MySQL's databases are PostgreSQL's schemas).
-- Schema only, no data; safe to run again (IF NOT EXISTS everywhere). See examples/pin-profile-mysql.toml.
--
-- Cipher columns hold the `aesgcm` format: nonce(12) || ciphertext || tag(16) as raw bytes (blob),
-- under the key named by the row's integer key_version. Ids are UUIDs as text. Business `version`,
-- `updated_by_user_id` and `updated_at` (maintained by the server: ON UPDATE CURRENT_TIMESTAMP)
-- belong to the application: a rotation never changes them. No foreign keys.

CREATE TABLE IF NOT EXISTS persons (
    id                      char(36) NOT NULL PRIMARY KEY,
    owner_user_id           char(36) NULL,
    first_name_cipher       blob NOT NULL,
    last_name_cipher        blob NOT NULL,
    middle_name_cipher      blob NULL,
    birth_date_cipher       blob NULL,
    key_version             int NOT NULL,
    -- clear, not PII: outside key rotation
    citizenship_country_id  int NULL,
    gender                  varchar(16) NULL,
    is_deleted              tinyint(1) NOT NULL DEFAULT 0,
    version                 int NOT NULL DEFAULT 1,
    created_at              datetime(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    updated_at              datetime(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6) ON UPDATE CURRENT_TIMESTAMP(6),
    updated_by_user_id      char(36) NULL
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4;

CREATE TABLE IF NOT EXISTS person_documents (
    id                      char(36) NOT NULL PRIMARY KEY,
    person_id               char(36) NOT NULL,
    document_type           varchar(32) NOT NULL,
    payload_cipher          blob NOT NULL,
    -- HMAC of the document number under its own stable key: never rotated by pinrotate
    number_hash             binary(32) NOT NULL,
    number_mask             varchar(32) NOT NULL,
    key_version             int NOT NULL,
    scan_list               json NOT NULL,
    expires_on              date NULL,
    version                 int NOT NULL DEFAULT 1,
    created_at              datetime(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    updated_at              datetime(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6) ON UPDATE CURRENT_TIMESTAMP(6),
    updated_by_user_id      char(36) NULL
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4;

CREATE TABLE IF NOT EXISTS requisite_templates (
    id                      char(36) NOT NULL PRIMARY KEY,
    person_id               char(36) NOT NULL,
    name                    varchar(200) NOT NULL,
    contact_email_cipher    blob NULL,
    contact_phone_cipher    blob NULL,
    -- set even when both contacts are NULL: the row leaves the backlog with no crypto at all
    key_version             int NOT NULL,
    composition             json NOT NULL,
    version                 int NOT NULL DEFAULT 1,
    created_at              datetime(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    updated_at              datetime(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6) ON UPDATE CURRENT_TIMESTAMP(6),
    updated_by_user_id      char(36) NULL
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4;

CREATE TABLE IF NOT EXISTS verification_requests (
    id                      char(36) NOT NULL PRIMARY KEY,
    person_id               char(36) NOT NULL,
    status                  varchar(16) NOT NULL,
    submitted_at            datetime(6) NULL,
    -- immutable snapshot taken at Submit; drafts have neither snapshot nor key version
    snapshot_cipher         blob NULL,
    key_version             int NULL,
    version                 int NOT NULL DEFAULT 1,
    created_at              datetime(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    updated_at              datetime(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6) ON UPDATE CURRENT_TIMESTAMP(6),
    updated_by_user_id      char(36) NULL,
    CONSTRAINT verification_requests_snapshot_key_version_together
        CHECK ((snapshot_cipher IS NULL) = (key_version IS NULL))
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4
