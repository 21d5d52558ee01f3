-- 06_outbox_message.sql: outbox_message(), which writes an event into the WAL only, as a transactional
-- logical message, for the relay's `outbox.message_prefix` (docs/configuration.md, "Two ways to write
-- events").
--
-- Call it inside the transaction that makes the business change; the event commits with it or not at all,
-- and the relay publishes it in commit order, among the outbox rows of the same transaction:
--   BEGIN;
--   UPDATE claims SET status = 'approved' WHERE claim_id = 4711;
--   SELECT outbox_message('Claim', '4711', 'ClaimApproved', '{"claim_id": 4711, "status": "approved"}');
--   COMMIT;
-- It returns the event id (default: a new random uuid as text; pass your own with p_event_id => '…' to
-- make a retried write recognisable). p_headers is an optional JSON object of extra headers.
--
-- What it writes: pg_logical_emit_message(true, '<prefix>', '{"id", "aggregate_type", "aggregate_id",
-- "event_type", "payload", "headers"}'), no table row, so no index, no vacuum and no retention job. The
-- price: the event exists only in the WAL. It cannot be queried, audited afterwards or backfilled
-- (`outbox-relay backfill` reads a table); once the slot has passed it, only the stream has it.
--
-- Privileges: the function is SECURITY DEFINER, so a writer needs EXECUTE on it and nothing else. Its
-- owner must be allowed to execute pg_logical_emit_message: on a vanilla server every role may, but some
-- managed services revoke it from ordinary roles (then create this function as the most privileged role
-- the service gives you, e.g. rds_superuser / cloudsqlsuperuser / azure_pg_admin, or ask the provider).
-- A writer cannot use it to emit anything but a well-formed event under the fixed prefix.
--
-- Run as the role that will own the function (see above):
--   psql "$DATABASE_URL" -v ON_ERROR_STOP=1 -f sql/06_outbox_message.sql
-- Safe to run again (CREATE OR REPLACE).
--
-- psql variables (set with -v name=value), with their defaults:
--   message_schema   public           the schema the function is created in
--   message_prefix   outbox           the logical message prefix (`message_prefix` in [outbox] of relay.toml)
--   function_name    outbox_message   another name, for a second prefix in the same database:
--                                     -v message_prefix=billing -v function_name=billing_message
--   writer_role      (none)           the application's role: EXECUTE is revoked from PUBLIC and granted to it

\if :{?message_schema}
\else
\set message_schema public
\endif
\if :{?message_prefix}
\else
\set message_prefix outbox
\endif
\if :{?function_name}
\else
\set function_name outbox_message
\endif

-- The body names the prefix, and psql does not substitute variables inside it, so the function is written
-- by format() and run by \gexec.
SELECT format($ddl$
CREATE OR REPLACE FUNCTION %1$I.%2$I(
    p_aggregate_type text,
    p_aggregate_id   text,
    p_event_type     text,
    p_payload        jsonb,
    p_headers        jsonb DEFAULT NULL,
    p_event_id       text  DEFAULT gen_random_uuid()::text
) RETURNS text
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
-- A SECURITY DEFINER function must not resolve names through the caller's search_path.
SET search_path = pg_catalog, pg_temp
AS $body$
BEGIN
    -- The relay would dead-letter these; failing here keeps them out of the WAL in the first place.
    IF p_event_id IS NULL OR p_event_id = '' THEN
        RAISE EXCEPTION 'outbox event id must not be empty';
    END IF;
    IF p_aggregate_type IS NULL OR p_event_type IS NULL THEN
        RAISE EXCEPTION 'outbox event needs an aggregate type and an event type';
    END IF;
    IF p_headers IS NOT NULL AND jsonb_typeof(p_headers) <> 'object' THEN
        RAISE EXCEPTION 'outbox event headers must be a JSON object, got %%', jsonb_typeof(p_headers);
    END IF;
    -- transactional = true: decoded at commit, in commit order, never if the transaction rolls back.
    PERFORM pg_logical_emit_message(true, %3$L, jsonb_build_object(
        'id', p_event_id,
        'aggregate_type', p_aggregate_type,
        'aggregate_id', p_aggregate_id,
        'event_type', p_event_type,
        'payload', p_payload,
        'headers', p_headers)::text);
    RETURN p_event_id;
END
$body$
$ddl$, :'message_schema', :'function_name', :'message_prefix') \gexec

SELECT format('COMMENT ON FUNCTION %I.%I(text, text, text, jsonb, jsonb, text) IS %L',
    :'message_schema', :'function_name',
    format('Emit an outbox event as a transactional logical message with prefix %s (no table row); returns its id.',
           :'message_prefix')) \gexec

\if :{?writer_role}
SELECT format('REVOKE EXECUTE ON FUNCTION %I.%I(text, text, text, jsonb, jsonb, text) FROM PUBLIC',
    :'message_schema', :'function_name') \gexec
SELECT format('GRANT EXECUTE ON FUNCTION %I.%I(text, text, text, jsonb, jsonb, text) TO %I',
    :'message_schema', :'function_name', :'writer_role') \gexec
\endif
