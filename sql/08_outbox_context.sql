-- 08_outbox_context.sql: outbox_context(), which hands the writer's trace context to the relay for the
-- events of the current transaction, for the relay's `outbox.context_prefix = "outbox-context"`
-- (docs/tracing.md, "Context in").
--
-- Call it inside the transaction, before the events it is for; every event of the transaction written
-- after it (outbox rows and outbox_message events) gets these headers unless it has its own header of the
-- same name, and a later call replaces the context of an earlier one:
--   BEGIN;
--   SELECT outbox_context('00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01');
--   UPDATE claims SET status = 'approved' WHERE claim_id = 4711;
--   INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES (...);
--   COMMIT;
-- p_traceparent is the W3C traceparent of the writer's current span (docs/tracing.md shows how to get it
-- in Python, Go and Java), p_tracestate its tracestate, p_headers any other headers as a JSON object of
-- strings (e.g. {"baggage": "tenant=7"}). A NULL traceparent emits nothing: code that runs without a
-- trace can call it all the same.
--
-- What it writes: pg_logical_emit_message(true, 'outbox-context', '{"traceparent": ..., "tracestate": ...,
-- ...}'), nothing in any table. Transactional, so it is decoded at commit, in order, with the events.
--
-- Privileges: as sql/06_outbox_message.sql, SECURITY DEFINER, because that script revokes
-- pg_logical_emit_message from PUBLIC. A writer needs EXECUTE on this function only, and through it can
-- emit nothing but a context message under the fixed prefix. Its owner must be allowed to execute
-- pg_logical_emit_message (a superuser, or the role sql/06 granted it to).
--
-- Run as the role that will own the function, after sql/06_outbox_message.sql:
--   psql "$DATABASE_URL" -v ON_ERROR_STOP=1 -f sql/08_outbox_context.sql
-- Safe to run again (CREATE OR REPLACE).
--
-- psql variables (set with -v name=value), with their defaults:
--   context_schema   public            the schema the function is created in
--   context_prefix   outbox-context    the logical message prefix (`context_prefix` in [outbox] of relay.toml)
--   writer_role      (none)            the application's role, granted EXECUTE (PUBLIC never has it: without
--                                      this, only the owner may call the function until you grant it)

\if :{?context_schema}
\else
\set context_schema public
\endif
\if :{?context_prefix}
\else
\set context_prefix outbox-context
\endif

-- The body names the prefix, and psql does not substitute variables inside it, so the function is written
-- by format() and run by \gexec.
SELECT format($ddl$
CREATE OR REPLACE FUNCTION %1$I.outbox_context(
    p_traceparent text,
    p_tracestate  text  DEFAULT NULL,
    p_headers     jsonb DEFAULT NULL
) RETURNS void
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
-- A SECURITY DEFINER function must not resolve names through the caller's search_path.
SET search_path = pg_catalog, pg_temp
AS $body$
DECLARE
    v_context jsonb;
BEGIN
    IF p_traceparent IS NULL OR p_traceparent = '' THEN
        RETURN;
    END IF;
    IF p_headers IS NOT NULL AND jsonb_typeof(p_headers) <> 'object' THEN
        RAISE EXCEPTION 'outbox context headers must be a JSON object, got %%', jsonb_typeof(p_headers);
    END IF;
    -- The relay takes string values only; failing here keeps a bad context out of the WAL (the relay
    -- would dead-letter it).
    IF p_headers IS NOT NULL AND EXISTS (
        SELECT 1 FROM jsonb_each(p_headers) e WHERE jsonb_typeof(e.value) <> 'string'
    ) THEN
        RAISE EXCEPTION 'outbox context headers must have string values';
    END IF;
    v_context := coalesce(p_headers, '{}'::jsonb) || jsonb_build_object('traceparent', p_traceparent);
    IF p_tracestate IS NOT NULL AND p_tracestate <> '' THEN
        v_context := v_context || jsonb_build_object('tracestate', p_tracestate);
    END IF;
    -- transactional = true: decoded at commit, in commit order, never if the transaction rolls back.
    PERFORM pg_logical_emit_message(true, %2$L, v_context::text);
END
$body$
$ddl$, :'context_schema', :'context_prefix') \gexec

SELECT format('COMMENT ON FUNCTION %I.outbox_context(text, text, jsonb) IS %L',
    :'context_schema',
    format('Hand the trace context (W3C traceparent, tracestate, other headers) to the outbox relay for the events of this transaction that follow (logical message prefix %s).',
           :'context_prefix')) \gexec

-- As in sql/06: PUBLIC never executes it, only the writer role (and the owner).
SELECT format('REVOKE EXECUTE ON FUNCTION %I.outbox_context(text, text, jsonb) FROM PUBLIC',
    :'context_schema') \gexec
\if :{?writer_role}
SELECT format('GRANT EXECUTE ON FUNCTION %I.outbox_context(text, text, jsonb) TO %I',
    :'context_schema', :'writer_role') \gexec
\else
SELECT format('only the owner may call %I.outbox_context(…) now: GRANT EXECUTE ON FUNCTION %I.outbox_context(text, text, jsonb) TO <your writer role>, or run this script with -v writer_role=…',
    :'context_schema', :'context_schema') AS notice \gset
\echo :notice
\endif

-- The helper calls the text overload with its owner's rights: a superuser owner needs no grant, another
-- owner gets one here when this role may give it (sql/06 revoked it from PUBLIC).
SELECT format('GRANT EXECUTE ON FUNCTION %s TO %s', p.oid::regprocedure, f.proowner::regrole)
  FROM pg_catalog.pg_proc p, pg_catalog.pg_proc f
 WHERE p.proname = 'pg_logical_emit_message' AND p.pronamespace = 'pg_catalog'::regnamespace
   AND p.proargtypes[2] = 'text'::regtype
   AND pg_catalog.pg_has_role(p.proowner, 'USAGE')
   AND f.oid = format('%I.outbox_context(text, text, jsonb)', :'context_schema')::regprocedure
   AND NOT (SELECT r.rolsuper FROM pg_catalog.pg_roles r WHERE r.oid = f.proowner)
 ORDER BY 1 \gexec
