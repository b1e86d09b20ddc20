-- The Pin profile sample (examples/pin-profile.sql) in MySQL / MariaDB types, as an application on
-- MySQL keeps it: two of its tables, cipher columns as base64 text (persons) and raw bytes
-- (person_documents), the business version and timestamps the database maintains itself.

CREATE TABLE persons (
    id                  char(36) NOT NULL PRIMARY KEY,
    owner_user_id       char(36) NULL,
    first_name_cipher   text NOT NULL,       -- base64 of nonce || ciphertext || tag
    last_name_cipher    text NOT NULL,
    middle_name_cipher  text NULL,
    birth_date_cipher   text NULL,
    key_version         int NOT NULL,
    gender              varchar(16) NULL,
    is_deleted          tinyint(1) NOT NULL DEFAULT 0,
    version             int NOT NULL DEFAULT 1,
    created_at          datetime(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    updated_at          datetime(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6) ON UPDATE CURRENT_TIMESTAMP(6),
    updated_by_user_id  char(36) NULL
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4;

CREATE TABLE person_documents (
    id                  char(36) NOT NULL PRIMARY KEY,
    person_id           char(36) NOT NULL,
    document_type       varchar(32) NOT NULL,
    payload_cipher      blob NOT NULL,       -- raw nonce || ciphertext || tag
    number_hash         binary(32) NOT NULL, -- HMAC under its own key: never rotated
    number_mask         varchar(32) NOT NULL,
    key_version         int NOT NULL,
    version             int NOT NULL DEFAULT 1,
    updated_at          timestamp NOT NULL DEFAULT CURRENT_TIMESTAMP ON UPDATE CURRENT_TIMESTAMP,
    updated_by_user_id  char(36) NULL
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4;
