-- The payment service's own tables, as docs/consumer-dedup.md shows them: the inbox of processed event
-- ids, and the payments. Both recipes (python/, node/) run this file when they start; it changes nothing
-- where the tables exist.
CREATE TABLE IF NOT EXISTS processed_events (
    event_id     text        PRIMARY KEY,          -- the Nats-Msg-Id of a processed event
    processed_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE IF NOT EXISTS payments (
    payment_id bigint  GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    claim_id   bigint  NOT NULL,
    amount     numeric NOT NULL,
    event_id   text    NOT NULL UNIQUE REFERENCES processed_events
);
