-- 09_requeue.sql: outbox_requeue(), outbox_discard() and outbox_requeue_event(), which release what the
-- relay holds back (docs/recovery.md, "A parked key"): a key parked by `outbox.on_invalid = "park"`, or
-- one dead letter.
--
--   SELECT * FROM outbox_requeue('Claim', '4711');    -- republish the key's parked run, in order, checked again
--   SELECT * FROM outbox_discard('Claim', '4711');    -- release the key, republishing nothing
--   SELECT * FROM outbox_requeue_event('6f1c…');      -- republish one dead letter to its subject, checked again
-- `outbox-relay requeue --key Claim/4711` (or `--event ID`, `--discard`) calls them for you and waits until
-- the relay has carried the request out. A NULL aggregate id is a key of its own, distinct from '':
-- outbox_requeue('Claim', NULL).
--
-- Each returns (request uuid, lsn pg_lsn): the request's id (the release marker the relay writes carries
-- it, `Outbox-Control-Id`) and the LSN of the logical message it wrote. Nothing is changed in any table:
-- each writes one transactional logical message, pg_logical_emit_message(true, '<prefix>', '<json>'), with
-- <prefix> = outbox-relay.control (outbox-relay.control.<name> for a relay with `name = "<name>"`) and the
-- content {"op": "requeue" | "discard", "aggregate_type": …, "aggregate_id": …, "request": "<uuid>"} or
-- {"op": "requeue_event", "event_id": …, "request": "<uuid>"}. The relay reads it from its slot in commit
-- order, like an event: the release is ordered with the writes around it, happens once the transaction
-- commits (never if it rolls back), and survives any crash of the relay, since the slot keeps the message
-- until the relay has stored what it expands to.
--
-- A request is at most 1 MiB of JSON, what the relay reads: a key longer than that is refused with an
-- error (the relay would ignore the message, and the caller believe the key released).
--
-- Privileges: SECURITY DEFINER, EXECUTE revoked from PUBLIC and granted to the operator role only. Through
-- them a caller can emit nothing but a well-formed control message under the fixed prefix. Anyone who can
-- call pg_logical_emit_message directly can emit a control message too (docs/security.md): sql/06 revokes
-- that from PUBLIC; the functions' owner must be allowed to execute it (a superuser, or the role sql/06
-- granted it to).
--
-- Run as the role that will own the functions, ideally a superuser (creating the operator role needs
-- CREATEROLE), after sql/06_outbox_message.sql:
--   psql "$DATABASE_URL" -v ON_ERROR_STOP=1 -f sql/09_requeue.sql
-- Safe to run again (CREATE OR REPLACE; the role is created only when missing).
--
-- psql variables (set with -v name=value), with their defaults:
--   requeue_schema   public            the schema the functions are created in
--   relay_name       (empty)           the relay's `name` (relay.toml, before any section): the prefix becomes
--                                      outbox-relay.control.<name>; for two relays of one database install
--                                      the functions once per relay, each in a schema of its own:
--                                      -v relay_name=orders -v requeue_schema=orders_ops
--   operator_role    outbox_operator   granted EXECUTE; created NOLOGIN when missing (GRANT it to the people
--                                      or the login role that release keys)

\if :{?requeue_schema}
\else
\set requeue_schema public
\endif
\if :{?relay_name}
\else
\set relay_name ''
\endif
\if :{?operator_role}
\else
\set operator_role outbox_operator
\endif

-- The relay's `name` is 1-50 lowercase letters, digits and underscores; any other value would be a prefix
-- no relay reads, so it stops here.
SELECT format('DO %L', format('BEGIN RAISE EXCEPTION USING MESSAGE = %L; END',
       format('relay_name %L must be a relay''s name (1-50 lowercase letters, digits and underscores) or empty',
              :'relay_name')))
 WHERE NOT (:'relay_name' ~ '^[a-z0-9_]{1,50}$' OR :'relay_name' = '') \gexec
SELECT CASE WHEN :'relay_name' = '' THEN 'outbox-relay.control'
            ELSE 'outbox-relay.control.' || :'relay_name' END AS control_prefix \gset

-- One transaction from here: a new function is executable by PUBLIC until the REVOKE below, and a run that
-- fails part way must leave nothing (no role, no function) behind.
BEGIN;

SELECT format('CREATE ROLE %I NOLOGIN', :'operator_role')
 WHERE NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = :'operator_role') \gexec

-- The bodies name the prefix, and psql does not substitute variables inside them, so each function is
-- written by format() and run by \gexec. The content is built by jsonb_build_object, never by joining
-- strings: whatever the arguments hold (quotes, line breaks) arrives as JSON string data, and a NULL
-- aggregate id as JSON null.
SELECT format($ddl$
CREATE OR REPLACE FUNCTION %1$I.%2$I(aggregate_type text, aggregate_id text, OUT request uuid, OUT lsn pg_lsn)
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
-- A SECURITY DEFINER function must not resolve names through the caller's search_path.
SET search_path = pg_catalog, pg_temp
AS $body$
DECLARE
    content text;
BEGIN
    IF aggregate_type IS NULL THEN
        RAISE EXCEPTION 'a parked key needs its aggregate type (the aggregate id may be NULL)';
    END IF;
    request := gen_random_uuid();
    content := jsonb_build_object(
        'op', %4$L,
        'aggregate_type', aggregate_type,
        'aggregate_id', aggregate_id,
        'request', request::text)::text;
    -- The relay reads a control message of at most 1 MiB and ignores a longer one (with a warning):
    -- refused here, or the caller would believe a release the relay never carries out.
    IF octet_length(content) > 1048576 THEN
        RAISE EXCEPTION 'the key is too long for a control message: %% bytes, over the 1048576 (1 MiB) the relay reads',
            octet_length(content);
    END IF;
    -- transactional = true: decoded at commit, in commit order, never if the transaction rolls back.
    lsn := pg_logical_emit_message(true, %3$L, content);
END
$body$
$ddl$, :'requeue_schema', f.name, :'control_prefix', f.op)
  FROM (VALUES ('outbox_requeue', 'requeue'), ('outbox_discard', 'discard')) AS f(name, op) \gexec

SELECT format($ddl$
CREATE OR REPLACE FUNCTION %1$I.outbox_requeue_event(event_id text, OUT request uuid, OUT lsn pg_lsn)
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $body$
BEGIN
    IF event_id IS NULL OR event_id = '' THEN
        RAISE EXCEPTION 'outbox_requeue_event needs the id of the dead-lettered event';
    END IF;
    request := gen_random_uuid();
    lsn := pg_logical_emit_message(true, %2$L, jsonb_build_object(
        'op', 'requeue_event',
        'event_id', event_id,
        'request', request::text)::text);
END
$body$
$ddl$, :'requeue_schema', :'control_prefix') \gexec

SELECT format('COMMENT ON FUNCTION %I.%s IS %L', :'requeue_schema', f.sig,
              format('%s (control message prefix %s); returns the request id and the message''s LSN.',
                     f.what, :'control_prefix'))
  FROM (VALUES
    ('outbox_requeue(text, text)', 'Ask the outbox relay to republish a parked key''s events, checked again, and release it'),
    ('outbox_discard(text, text)', 'Ask the outbox relay to release a parked key without republishing its events'),
    ('outbox_requeue_event(text)', 'Ask the outbox relay to republish one dead-lettered event, checked again')
  ) AS f(sig, what) \gexec

-- A new function is executable by PUBLIC: every role of the database could release keys. Only the
-- operator role may (and the owner).
SELECT format('REVOKE EXECUTE ON FUNCTION %I.%s FROM PUBLIC', :'requeue_schema', sig),
       format('GRANT EXECUTE ON FUNCTION %I.%s TO %I', :'requeue_schema', sig, :'operator_role')
  FROM unnest(ARRAY['outbox_requeue(text, text)', 'outbox_discard(text, text)',
                    'outbox_requeue_event(text)']) AS sig \gexec
-- The role calls them by their schema-qualified names: it needs the schema's USAGE.
SELECT format('GRANT USAGE ON SCHEMA %I TO %I', :'requeue_schema', :'operator_role')
 WHERE NOT pg_catalog.has_schema_privilege(:'operator_role', :'requeue_schema', 'USAGE') \gexec

-- The functions call the text overload with their owner's rights: a superuser owner needs no grant,
-- another owner gets one here when this role may give it (sql/06 revoked it from PUBLIC).
SELECT DISTINCT format('GRANT EXECUTE ON FUNCTION %s TO %s', p.oid::regprocedure, f.proowner::regrole)
  FROM pg_catalog.pg_proc p, pg_catalog.pg_proc f
 WHERE p.proname = 'pg_logical_emit_message' AND p.pronamespace = 'pg_catalog'::regnamespace
   AND p.proargtypes[2] = 'text'::regtype
   AND pg_catalog.pg_has_role(p.proowner, 'USAGE')
   AND f.oid = format('%I.outbox_requeue(text, text)', :'requeue_schema')::regprocedure
   AND NOT (SELECT r.rolsuper FROM pg_catalog.pg_roles r WHERE r.oid = f.proowner)
 ORDER BY 1 \gexec

COMMIT;
