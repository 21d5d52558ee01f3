-- 05_retention.sql: keeping the outbox table small.
--
-- outbox-relay reads inserts from the write-ahead log through its replication slot; it never queries the
-- table, and the publication does not publish deletes. Deleting rows is therefore always safe for the relay,
-- even rows it has not published yet: the slot keeps the WAL that holds their inserts until JetStream has
-- acknowledged them. A table that only grows costs disk, backups and vacuum time, so choose one of:
--
--   (a) Never keep rows: write events with outbox_emit(...) (04_write_event.sql), which inserts and deletes
--       in the same transaction. The table stays empty; autovacuum removes the dead rows.
--   (b) Keep rows for a while (to look up what was sent) and prune old ones with outbox_prune, below,
--       from a scheduler. It deletes in batches and commits between them, so it never holds long locks
--       or builds one huge transaction.
--
-- Run as the owner of the outbox table, after 01_outbox_table.sql:
--   psql "$DATABASE_URL" -v ON_ERROR_STOP=1 -f sql/05_retention.sql
-- Prune by hand (outside an explicit transaction block, since the procedure commits):
--   CALL outbox_prune();                       -- keep 7 days, 10000 rows per batch
--   CALL outbox_prune(interval '1 day', 5000);
--   CALL outbox_prune(interval '1 day', proven_only => true);   -- only rows `verify --record` proved
-- Nightly with the pg_cron extension (jobs run in the database named by cron.database_name):
--   SELECT cron.schedule('outbox-prune', '17 3 * * *', $job$CALL outbox_prune(interval '7 days')$job$);
-- Safe to run again (IF NOT EXISTS / CREATE OR REPLACE).
--
-- Retention gated on proof: `outbox-relay verify --record` stores in <table>_proof (created here) the point
-- up to which it proved every row stored in the stream once and in order (proven_up_to: a creation time),
-- and the oldest transaction still running when it read the rows. With proven_only => true the procedure
-- deletes only rows created at or before that point AND written by a transaction older than that one
-- (the rows verify saw), besides `keep`: never a row whose event was waiting in the slot, dead-lettered or
-- not found, since the proof ends before the oldest of those. Without a proof it deletes nothing. A proof
-- is as old as the last `verify --record`: run the prune after it (e.g. the verify timer at 04:17, the
-- prune at 05:17).
--
-- Note that a growing outbox is no sign of a stalled relay here (rows are never marked as sent); a stalled
-- relay shows as a replication slot that retains more and more WAL: watch `outbox-relay status` or
-- pg_replication_slots.
--
-- psql variables (set with -v name=value):
--   outbox_table   the outbox table, schema-qualified (default public.outbox). The procedure is created in
--                  the table's schema as <table>_prune (public.outbox_prune by default, billing.outbox_prune
--                  for -v outbox_table=billing.outbox), the index as <table>_created_at_idx, the proof
--                  table as <table>_proof.
--   relay_role     the role `verify --record` runs as (default outbox_relay, the relay's own, as in
--                  03_relay_role.sql): it gets SELECT, INSERT and UPDATE on the proof table and nothing
--                  else. A role that does not exist yet gets nothing (a notice says so): run this again
--                  after 03_relay_role.sql.

\if :{?outbox_table}
\else
\set outbox_table public.outbox
\endif
\if :{?relay_role}
\else
\set relay_role outbox_relay
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
\set prune_procedure :outbox_name '_prune'
\set created_at_index :outbox_name '_created_at_idx'
\set proof_table :outbox_name '_proof'
SET outbox_sql.relay_role = :'relay_role';
SET outbox_sql.proof_table = :'proof_table';
SET outbox_sql.outbox_schema = :'outbox_schema';

-- Lets each batch find old rows without scanning the table. Not needed with (a).
CREATE INDEX IF NOT EXISTS :"created_at_index" ON :"outbox_schema".:"outbox_name" (created_at);

-- The proof `verify --record` stores: one row, replaced by each run. Written only by verify; read by the
-- prune below.
CREATE TABLE IF NOT EXISTS :"outbox_schema".:"proof_table" (
    id                boolean     PRIMARY KEY DEFAULT true CHECK (id),
    proven_lsn        pg_lsn,     -- commit LSN of the newest event proven (for the operator)
    proven_created_at timestamptz, -- every row created at or before it is proven; NULL: nothing is
    snapshot_xmin     xid8,        -- the oldest transaction running when verify read the rows
    rows_checked      bigint,
    stream            text,
    recorded_at       timestamptz NOT NULL DEFAULT now()
);
COMMENT ON TABLE :"outbox_schema".:"proof_table" IS
    'outbox-relay verify --record: up to where every outbox row is proven stored once, in order; read by '
    'the prune procedure with proven_only => true.';

DO $$
DECLARE
    role text := current_setting('outbox_sql.relay_role');
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = role) THEN
        EXECUTE format('GRANT SELECT, INSERT, UPDATE ON %I.%I TO %I',
            current_setting('outbox_sql.outbox_schema'), current_setting('outbox_sql.proof_table'), role);
    ELSE
        RAISE NOTICE 'role % does not exist: it was granted nothing on the proof table; run this file again after 03_relay_role.sql',
            role;
    END IF;
END
$$;

-- The signature before proven_only existed: replaced, so that CALL <table>_prune() stays unambiguous.
DROP PROCEDURE IF EXISTS :"outbox_schema".:"prune_procedure"(interval, int);

-- The procedure's body names the tables, and psql does not substitute variables inside it, so it is
-- written by format() and run by \gexec. A row written by transaction x is older than the proof's
-- snapshot_xmin s when age(x) > age(s) (the xid8 cut to the xid the system column carries).
SELECT format($ddl$
CREATE OR REPLACE PROCEDURE %1$I.%2$I(
    keep interval DEFAULT interval '7 days',
    batch int DEFAULT 10000,
    proven_only boolean DEFAULT false)
LANGUAGE plpgsql
AS $body$
DECLARE
    cutoff      timestamptz := clock_timestamp() - keep;
    proven_at   timestamptz;
    proven_xmin xid;
    deleted     bigint;
    total       bigint := 0;
BEGIN
    IF batch IS NULL OR batch < 1 THEN
        RAISE EXCEPTION '%2$s: batch must be at least 1, got %%', batch;
    END IF;
    IF proven_only THEN
        SELECT p.proven_created_at, (p.snapshot_xmin::text::bigint %% 4294967296)::text::xid
        INTO proven_at, proven_xmin
        FROM %1$I.%4$I p;
        IF proven_at IS NULL OR proven_xmin IS NULL THEN
            RAISE NOTICE '%2$s: no proof in %1$s.%4$s (run outbox-relay verify --record): deleted nothing';
            RETURN;
        END IF;
        -- At or below the proof: created_at <= proven_at.
        cutoff := least(cutoff, proven_at + interval '1 microsecond');
    END IF;
    LOOP
        DELETE FROM %1$I.%3$I
        WHERE event_id IN (
            SELECT event_id FROM %1$I.%3$I
            WHERE created_at < cutoff
              AND (NOT proven_only OR age(xmin) > age(proven_xmin))
            ORDER BY created_at
            LIMIT batch
            FOR UPDATE SKIP LOCKED
        );
        GET DIAGNOSTICS deleted = ROW_COUNT;
        total := total + deleted;
        COMMIT;
        EXIT WHEN deleted < batch;
    END LOOP;
    RAISE NOTICE '%2$s: deleted %% rows created before %% (proven_only %%)', total, cutoff, proven_only;
END
$body$
$ddl$, :'outbox_schema', :'prune_procedure', :'outbox_name', :'proof_table') \gexec

COMMENT ON PROCEDURE :"outbox_schema".:"prune_procedure"(interval, int, boolean) IS
    'Delete outbox rows older than keep, batch rows per transaction; with proven_only, only rows at or below '
    'the proof outbox-relay verify --record stored. Safe for outbox-relay, which reads the WAL, not the table.';
