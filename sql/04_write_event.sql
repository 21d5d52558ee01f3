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
-- Both run with the caller's privileges: outbox_write needs INSERT on public.outbox, outbox_emit also DELETE.
--
-- Run as the owner of public.outbox, after 01_outbox_table.sql:
--   psql "$DATABASE_URL" -v ON_ERROR_STOP=1 -f sql/04_write_event.sql
-- Safe to run again (CREATE OR REPLACE).

CREATE OR REPLACE FUNCTION public.outbox_write(
    p_aggregate_type text,
    p_aggregate_id   text,
    p_event_type     text,
    p_payload        jsonb,
    p_headers        jsonb DEFAULT NULL,
    p_event_id       uuid  DEFAULT gen_random_uuid()
) RETURNS uuid
LANGUAGE sql
VOLATILE
AS $$
    INSERT INTO public.outbox (event_id, aggregate_type, aggregate_id, event_type, payload, headers)
    VALUES (p_event_id, p_aggregate_type, p_aggregate_id, p_event_type, p_payload, p_headers)
    RETURNING event_id;
$$;

COMMENT ON FUNCTION public.outbox_write(text, text, text, jsonb, jsonb, uuid) IS
    'Insert an outbox event in the current transaction and return its event_id.';

-- Two statements, not one: in a single statement with a data-modifying CTE
-- (WITH ins AS (INSERT … RETURNING …) DELETE … USING ins) the DELETE runs on the statement's snapshot,
-- which does not contain the row being inserted, so it would delete nothing.
CREATE OR REPLACE FUNCTION public.outbox_emit(
    p_aggregate_type text,
    p_aggregate_id   text,
    p_event_type     text,
    p_payload        jsonb,
    p_headers        jsonb DEFAULT NULL,
    p_event_id       uuid  DEFAULT gen_random_uuid()
) RETURNS uuid
LANGUAGE plpgsql
VOLATILE
AS $$
DECLARE
    v_event_id uuid;
BEGIN
    INSERT INTO public.outbox (event_id, aggregate_type, aggregate_id, event_type, payload, headers)
    VALUES (p_event_id, p_aggregate_type, p_aggregate_id, p_event_type, p_payload, p_headers)
    RETURNING event_id INTO v_event_id;
    DELETE FROM public.outbox WHERE event_id = v_event_id;
    RETURN v_event_id;
END
$$;

COMMENT ON FUNCTION public.outbox_emit(text, text, text, jsonb, jsonb, uuid) IS
    'Insert an outbox event and delete it again in the current transaction: the relay publishes it from '
    'the WAL, the table stays empty. Returns the event_id.';
