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
-- Privileges: the function is SECURITY DEFINER, so a writer needs EXECUTE on it and nothing else, and
-- through it can emit nothing but a well-formed event under the fixed prefix. Its owner must be allowed
-- to execute pg_logical_emit_message.
--
-- The helper alone would not keep events honest: on a vanilla server pg_logical_emit_message is
-- executable by PUBLIC, and table privileges do not apply to it, so any role that can connect to this
-- database could call pg_logical_emit_message(true, '<prefix>', '…') itself and the relay would publish
-- whatever it wrote as an event. So this script also revokes EXECUTE on every overload of
-- pg_logical_emit_message (text and bytea content, and on PG 17+ the variants with a `flush` argument)
-- from PUBLIC, and grants the text overload the helper calls to the helper's owner when that is not a
-- superuser. Only this database is changed: the relay's slot decodes no other database's messages, and a
-- database created later starts with the default again. Superusers can still emit directly.
-- Revoking needs the functions' owner or a superuser. Run by anyone else, the script leaves the
-- privilege as it was and says so with a WARNING; on a managed service create the function as the most
-- privileged role the service gives you (e.g. rds_superuser / cloudsqlsuperuser / azure_pg_admin) and ask
-- the provider to revoke it, or accept that every role of the database can write events. `outbox-relay
-- setup` and `status` warn while PUBLIC can still execute it.
--
-- Run as the role that will own the function (see above), ideally a superuser:
--   psql "$DATABASE_URL" -v ON_ERROR_STOP=1 -f sql/06_outbox_message.sql
-- Safe to run again (CREATE OR REPLACE).
--
-- psql variables (set with -v name=value), with their defaults:
--   message_schema   public           the schema the function is created in
--   message_prefix   outbox           the logical message prefix (`message_prefix` in [outbox] of relay.toml)
--   function_name    outbox_message   another name, for a second prefix in the same database:
--                                     -v message_prefix=billing -v function_name=billing_message
--   writer_role      (none)           the application's role, granted EXECUTE (PUBLIC never has it: without
--                                     this, only the owner may call the function until you grant it)

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

-- A new function is executable by PUBLIC: every role of the database could write events through this
-- one. Only the writer role may (and the owner); without -v writer_role, grant it yourself:
--   GRANT EXECUTE ON FUNCTION public.outbox_message(text, text, text, jsonb, jsonb, text) TO app_writer;
SELECT format('REVOKE EXECUTE ON FUNCTION %I.%I(text, text, text, jsonb, jsonb, text) FROM PUBLIC',
    :'message_schema', :'function_name') \gexec
\if :{?writer_role}
SELECT format('GRANT EXECUTE ON FUNCTION %I.%I(text, text, text, jsonb, jsonb, text) TO %I',
    :'message_schema', :'function_name', :'writer_role') \gexec
\else
SELECT format('only the owner may call %I.%I(…) now: GRANT EXECUTE ON FUNCTION %I.%I(text, text, text, jsonb, jsonb, text) TO <your writer role>, or run this script with -v writer_role=…',
    :'message_schema', :'function_name', :'message_schema', :'function_name') AS notice \gset
\echo :notice
\endif

-- Direct calls: see "Privileges" above. Only statements this role may run are generated (it must be a
-- member of the functions' owner, as a superuser is), so a lesser role gets the WARNING below instead
-- of one per statement.
SELECT format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', p.oid::regprocedure)
  FROM pg_catalog.pg_proc p
 WHERE p.proname = 'pg_logical_emit_message' AND p.pronamespace = 'pg_catalog'::regnamespace
   AND pg_catalog.pg_has_role(p.proowner, 'USAGE')
 ORDER BY 1 \gexec

-- The helper calls the text overload with its owner's rights: a superuser owner needs no grant.
SELECT format('GRANT EXECUTE ON FUNCTION %s TO %s', p.oid::regprocedure, f.proowner::regrole)
  FROM pg_catalog.pg_proc p, pg_catalog.pg_proc f
 WHERE p.proname = 'pg_logical_emit_message' AND p.pronamespace = 'pg_catalog'::regnamespace
   AND p.proargtypes[2] = 'text'::regtype
   AND pg_catalog.pg_has_role(p.proowner, 'USAGE')
   AND f.oid = format('%I.%I(text, text, text, jsonb, jsonb, text)', :'message_schema', :'function_name')::regprocedure
   AND NOT (SELECT r.rolsuper FROM pg_catalog.pg_roles r WHERE r.oid = f.proowner)
 ORDER BY 1 \gexec

DO $check$
DECLARE
    still text;
BEGIN
    SELECT string_agg(p.oid::regprocedure::text, ', ' ORDER BY p.oid::regprocedure::text) INTO still
      FROM pg_catalog.pg_proc p
     WHERE p.proname = 'pg_logical_emit_message' AND p.pronamespace = 'pg_catalog'::regnamespace
       AND EXISTS (SELECT 1 FROM aclexplode(coalesce(p.proacl, acldefault('f', p.proowner))) a
                    WHERE a.grantee = 0 AND a.privilege_type = 'EXECUTE');
    IF still IS NOT NULL THEN
        RAISE WARNING 'every role of this database can still call % directly and so write any event: as a superuser, REVOKE EXECUTE ON FUNCTION % FROM PUBLIC', still, still;
    END IF;
END
$check$;
