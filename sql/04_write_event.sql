-- 04_write_event.sql: helper functions that write an outbox event.
--
-- Call one of them inside the transaction that makes the business change, so that the change and its event
-- commit together or not at all:
--   BEGIN;
--   UPDATE claims SET status = 'approved' WHERE claim_id = 4711;
--   SELECT outbox_write('Claim', '4711', 'ClaimApproved', '{"claim_id": 4711, "status": "approved"}');
--   COMMIT;
--
-- outbox_write(...)  inserts the event and returns its id; the row stays until retention removes it
--                    (05_retention.sql).
-- outbox_emit(...)   inserts the event and deletes it again in the same transaction; the table stays empty
--                    and the relay still publishes the event, because logical decoding reads the insert from
--                    the WAL and the publication does not publish deletes. Use it when nobody needs to look
--                    at old events in the table.
-- Both take optional extra headers (a JSON object of strings, e.g. {"traceparent": "00-..."}) and an
-- optional event id (default: a new random uuid; pass your own to make a retried write recognisable):
--   SELECT outbox_emit('Claim', '4711', 'ClaimApproved', '{}', p_event_id => '…'::uuid);
-- Both run with the caller's privileges: outbox_write needs INSERT on the outbox table, outbox_emit also
-- DELETE.
--
-- Run as the owner of the outbox table, after 01_outbox_table.sql:
--   psql "$DATABASE_URL" -v ON_ERROR_STOP=1 -f sql/04_write_event.sql
-- Safe to run again (CREATE OR REPLACE).
--
-- psql variable (set with -v name=value):
--   outbox_table   the outbox table, schema-qualified (default public.outbox). The functions are created
--                  in the table's schema and named after the table: <table>_write and <table>_emit, i.e.
--                  public.outbox_write and public.outbox_emit by default, billing.outbox_write and
--                  billing.outbox_emit for -v outbox_table=billing.outbox, public.billing_outbox_write for
--                  -v outbox_table=public.billing_outbox.

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
\set write_function :outbox_name '_write'
\set emit_function :outbox_name '_emit'

-- The function bodies name the table, and psql does not substitute variables inside them, so each
-- function is written by format() and run by \gexec.
SELECT format($ddl$
CREATE OR REPLACE FUNCTION %1$I.%2$I(
    p_aggregate_type text,
    p_aggregate_id   text,
    p_event_type     text,
    p_payload        jsonb,
    p_headers        jsonb DEFAULT NULL,
    p_event_id       uuid  DEFAULT gen_random_uuid()
) RETURNS uuid
LANGUAGE sql
VOLATILE
AS $body$
    INSERT INTO %1$I.%3$I (event_id, aggregate_type, aggregate_id, event_type, payload, headers)
    VALUES (p_event_id, p_aggregate_type, p_aggregate_id, p_event_type, p_payload, p_headers)
    RETURNING event_id;
$body$
$ddl$, :'outbox_schema', :'write_function', :'outbox_name') \gexec

COMMENT ON FUNCTION :"outbox_schema".:"write_function"(text, text, text, jsonb, jsonb, uuid) IS
    'Insert an outbox event in the current transaction and return its event_id.';

-- Two statements, not one: in a single statement with a data-modifying CTE
-- (WITH ins AS (INSERT … RETURNING …) DELETE … USING ins) the DELETE runs on the statement's snapshot,
-- which does not contain the row being inserted, so it would delete nothing.
SELECT format($ddl$
CREATE OR REPLACE FUNCTION %1$I.%2$I(
    p_aggregate_type text,
    p_aggregate_id   text,
    p_event_type     text,
    p_payload        jsonb,
    p_headers        jsonb DEFAULT NULL,
    p_event_id       uuid  DEFAULT gen_random_uuid()
) RETURNS uuid
LANGUAGE plpgsql
VOLATILE
AS $body$
DECLARE
    v_event_id uuid;
BEGIN
    INSERT INTO %1$I.%3$I (event_id, aggregate_type, aggregate_id, event_type, payload, headers)
    VALUES (p_event_id, p_aggregate_type, p_aggregate_id, p_event_type, p_payload, p_headers)
    RETURNING event_id INTO v_event_id;
    DELETE FROM %1$I.%3$I WHERE event_id = v_event_id;
    RETURN v_event_id;
END
$body$
$ddl$, :'outbox_schema', :'emit_function', :'outbox_name') \gexec

COMMENT ON FUNCTION :"outbox_schema".:"emit_function"(text, text, text, jsonb, jsonb, uuid) IS
    'Insert an outbox event and delete it again in the current transaction: the relay publishes it from '
    'the WAL, the table stays empty. Returns the event_id.';
