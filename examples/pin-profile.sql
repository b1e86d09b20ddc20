-- Pin profile preset: the four tables of the profile service whose PII columns pinrotate rotates
-- (design 000: Person, PersonDocument, RequisiteTemplate, VerificationRequest).
-- Schema only, no data; safe to run again (IF NOT EXISTS everywhere).
--
-- Cipher columns hold the `aesgcm` format: nonce(12) || ciphertext || tag(16) as raw bytea, under
-- the key named by the row's integer key_version (every cipher column of a row uses one key).
-- Business `version`, `updated_at`, `updated_by_user_id` belong to the application: a rotation
-- never changes them. No foreign keys: the rotation never joins, and tests seed tables alone.

CREATE SCHEMA IF NOT EXISTS profile;

CREATE TABLE IF NOT EXISTS profile.persons (
    id                      uuid PRIMARY KEY,
    owner_user_id           uuid,
    first_name_cipher       bytea NOT NULL,
    last_name_cipher        bytea NOT NULL,
    middle_name_cipher      bytea NULL,
    birth_date_cipher       bytea NULL,
    key_version             integer NOT NULL,
    -- clear, not PII: outside key rotation
    citizenship_country_id  integer NULL,
    gender                  text NULL,
    is_deleted              boolean NOT NULL DEFAULT false,
    version                 integer NOT NULL DEFAULT 1,
    created_at              timestamptz NOT NULL DEFAULT now(),
    updated_at              timestamptz NOT NULL DEFAULT now(),
    updated_by_user_id      uuid NULL
);

CREATE TABLE IF NOT EXISTS profile.person_documents (
    id                      uuid PRIMARY KEY,
    person_id               uuid NOT NULL,
    document_type           text NOT NULL,
    payload_cipher          bytea NOT NULL,
    -- HMAC of the document number under its own stable key: never rotated by pinrotate
    number_hash             bytea NOT NULL,
    number_mask             text NOT NULL,
    key_version             integer NOT NULL,
    scan_list               jsonb NOT NULL DEFAULT '[]'::jsonb,
    expires_on              date NULL,
    version                 integer NOT NULL DEFAULT 1,
    created_at              timestamptz NOT NULL DEFAULT now(),
    updated_at              timestamptz NOT NULL DEFAULT now(),
    updated_by_user_id      uuid NULL
);

CREATE TABLE IF NOT EXISTS profile.requisite_templates (
    id                      uuid PRIMARY KEY,
    person_id               uuid NOT NULL,
    name                    text NOT NULL,
    contact_email_cipher    bytea NULL,
    contact_phone_cipher    bytea NULL,
    -- set even when both contacts are NULL: the row leaves the backlog with no crypto at all
    key_version             integer NOT NULL,
    composition             jsonb NOT NULL DEFAULT '{}'::jsonb,
    version                 integer NOT NULL DEFAULT 1,
    created_at              timestamptz NOT NULL DEFAULT now(),
    updated_at              timestamptz NOT NULL DEFAULT now(),
    updated_by_user_id      uuid NULL
);

CREATE TABLE IF NOT EXISTS profile.verification_requests (
    id                      uuid PRIMARY KEY,
    person_id               uuid NOT NULL,
    status                  text NOT NULL,
    submitted_at            timestamptz NULL,
    -- immutable snapshot taken at Submit; drafts have neither snapshot nor key version
    snapshot_cipher         bytea NULL,
    key_version             integer NULL,
    version                 integer NOT NULL DEFAULT 1,
    created_at              timestamptz NOT NULL DEFAULT now(),
    updated_at              timestamptz NOT NULL DEFAULT now(),
    updated_by_user_id      uuid NULL,
    CONSTRAINT verification_requests_snapshot_key_version_together
        CHECK ((snapshot_cipher IS NULL) = (key_version IS NULL))
);
