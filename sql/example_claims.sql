-- example_claims.sql: the claims story of the docs, as SQL.
--
-- The claims service approves claim 4711 and, in the same transaction, writes the event "claim 4711
-- approved" to the outbox. Both commit together or not at all; outbox-relay then publishes the event to
-- the subject outbox.Claim. The docs call this event e-5531: it stands for the uuid that outbox_write
-- returns (the default table's event_id is a uuid; a table whose id column is text or bigint works too).
--
-- Run after 01, 02 and 04, with the relay running (`outbox-relay run`) and a subscriber watching (or,
-- without the nats CLI, `curl -s 127.0.0.1:9187/position` before and after: last_sequence goes up by one):
--   nats sub 'outbox.>'
--   psql "$DATABASE_URL" -v ON_ERROR_STOP=1 -f sql/example_claims.sql
-- Each run approves the claim again and so writes one more event, as the application would.

CREATE TABLE IF NOT EXISTS public.claims (
    claim_id bigint  PRIMARY KEY,
    status   text    NOT NULL,
    amount   numeric NOT NULL
);

INSERT INTO public.claims (claim_id, status, amount)
VALUES (4711, 'submitted', 1250.00)
ON CONFLICT (claim_id) DO NOTHING;

BEGIN;

UPDATE public.claims SET status = 'approved' WHERE claim_id = 4711;

-- Returns the event id ("e-5531" in the docs); it arrives as the Nats-Msg-Id header.
SELECT outbox_write(
    'Claim',
    '4711',
    'ClaimApproved',
    '{"claim_id": 4711, "status": "approved", "amount": 1250.00}'
) AS event_id;

COMMIT;
