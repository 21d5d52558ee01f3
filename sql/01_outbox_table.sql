-- 01_outbox_table.sql: the default outbox table that outbox-relay reads.
--
-- The application inserts one row per event in the same transaction as its business change; the relay
-- publishes each committed insert to NATS JetStream. The relay reads the write-ahead log, never this table,
-- so rows may be deleted at any time after their commit (see 04_write_event.sql and 05_retention.sql).
-- The column names are the defaults of the [outbox] section of relay.toml; a table with other names works
-- when the *_column keys say so.
--
-- Run as the owner of the application's schema (Postgres 15+), before 02_publication.sql:
--   psql "$DATABASE_URL" -v ON_ERROR_STOP=1 -f sql/01_outbox_table.sql
-- Safe to run again: it creates only what is missing.
--
-- psql variable (set with -v name=value; every file in sql/ reads the same names):
--   outbox_table   the table, schema-qualified (default public.outbox); the schema must exist. Must match
--                  `table` in the [outbox] section of relay.toml. A second outbox in the same database:
--     psql "$DATABASE_URL" -v ON_ERROR_STOP=1 -v outbox_table=billing.outbox -f sql/01_outbox_table.sql
--   (docs/multiple-outboxes.md). Unquoted names are folded to lower case, as in SQL.

\if :{?outbox_table}
\else
\set outbox_table public.outbox
\endif
SET outbox_sql.outbox_table = :'outbox_table';
DO $$
BEGIN
    IF cardinality(parse_ident(current_setting('outbox_sql.outbox_table'))) <> 2 THEN
        RAISE EXCEPTION 'outbox_table must be schema-qualified (schema.table), got "%"',
            current_setting('outbox_sql.outbox_table');
    END IF;
END
$$;
SELECT i[1] AS outbox_schema, i[2] AS outbox_name FROM parse_ident(:'outbox_table') AS i \gset

-- gen_random_uuid() is built in since Postgres 13; no extension needed.
CREATE TABLE IF NOT EXISTS :"outbox_schema".:"outbox_name" (
    event_id       uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
    aggregate_type text        NOT NULL,
    aggregate_id   text        NOT NULL,
    event_type     text        NOT NULL,
    payload        jsonb       NOT NULL,
    created_at     timestamptz NOT NULL DEFAULT now(),
    headers        jsonb
);

-- Tables created before the headers column existed get it now (quietly: on a fresh install the column
-- is there and Postgres would say so in a NOTICE).
SET client_min_messages = warning;
ALTER TABLE :"outbox_schema".:"outbox_name" ADD COLUMN IF NOT EXISTS headers jsonb;
RESET client_min_messages;

-- Extra headers must be a JSON object whose keys are valid header names and not the relay's own
-- (Nats-*, Outbox-*), with no line breaks in string values; other values are sent as their JSON text.
-- The relay dead-letters a row that breaks these rules; the constraint rejects it already when it is
-- written, where the writer sees the error.
DO $$
BEGIN
    IF NOT EXISTS (
        SELECT 1 FROM pg_constraint
        WHERE conrelid = current_setting('outbox_sql.outbox_table')::regclass AND conname = 'outbox_headers_valid'
    ) THEN
        EXECUTE format($ddl$ALTER TABLE %s ADD CONSTRAINT outbox_headers_valid CHECK (
            headers IS NULL
            OR (jsonb_typeof(headers) = 'object'
                AND NOT jsonb_path_exists(headers, '$.keyvalue() ? (
                        @.key == ""
                     || @.key like_regex "[^!-9;-~]"
                     || @.key like_regex "^(nats|outbox)-" flag "i"
                     || (@.value.type() == "string" && @.value like_regex "[\r\n]"))'))
        )$ddl$, current_setting('outbox_sql.outbox_table')::regclass);
    END IF;
END
$$;

COMMENT ON TABLE :"outbox_schema".:"outbox_name" IS
    'Transactional outbox: insert one row per event in the same transaction as the business change. '
    'outbox-relay publishes each committed insert to NATS JetStream (subject outbox.<aggregate_type>, '
    'Nats-Msg-Id = event_id) by reading the WAL; rows can be deleted once committed.';
COMMENT ON COLUMN :"outbox_schema".:"outbox_name".event_id IS
    'Event id; published as the Nats-Msg-Id header, by which JetStream and consumers drop duplicates.';
COMMENT ON COLUMN :"outbox_schema".:"outbox_name".aggregate_type IS
    'Kind of entity the event is about, e.g. Claim; chooses the subject. Must be a valid NATS subject token.';
COMMENT ON COLUMN :"outbox_schema".:"outbox_name".aggregate_id IS 'Id of the entity, e.g. 4711; header Outbox-Aggregate-Id.';
COMMENT ON COLUMN :"outbox_schema".:"outbox_name".event_type IS 'What happened, e.g. ClaimApproved; header Outbox-Event-Type.';
COMMENT ON COLUMN :"outbox_schema".:"outbox_name".payload IS 'Message body, published as stored (the jsonb text form).';
COMMENT ON COLUMN :"outbox_schema".:"outbox_name".created_at IS 'Start of the writing transaction; used only by retention.';
COMMENT ON COLUMN :"outbox_schema".:"outbox_name".headers IS
    'Optional extra message headers: a JSON object of string values, e.g. {"traceparent": "00-..."}. '
    'Published only when relay.toml sets headers_column = "headers".';
