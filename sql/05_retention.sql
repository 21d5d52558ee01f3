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
-- Nightly with the pg_cron extension (jobs run in the database named by cron.database_name):
--   SELECT cron.schedule('outbox-prune', '17 3 * * *', $job$CALL outbox_prune(interval '7 days')$job$);
-- Safe to run again (IF NOT EXISTS / CREATE OR REPLACE).
--
-- Note that a growing outbox is no sign of a stalled relay here (rows are never marked as sent); a stalled
-- relay shows as a replication slot that retains more and more WAL: watch `outbox-relay status` or
-- pg_replication_slots.
--
-- psql variable (set with -v name=value):
--   outbox_table   the outbox table, schema-qualified (default public.outbox). The procedure is created in
--                  the table's schema as <table>_prune (public.outbox_prune by default, billing.outbox_prune
--                  for -v outbox_table=billing.outbox), the index as <table>_created_at_idx.

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
\set prune_procedure :outbox_name '_prune'
\set created_at_index :outbox_name '_created_at_idx'

-- Lets each batch find old rows without scanning the table. Not needed with (a).
CREATE INDEX IF NOT EXISTS :"created_at_index" ON :"outbox_schema".:"outbox_name" (created_at);

-- The procedure's body names the table, and psql does not substitute variables inside it, so it is
-- written by format() and run by \gexec.
SELECT format($ddl$
CREATE OR REPLACE PROCEDURE %1$I.%2$I(keep interval DEFAULT interval '7 days', batch int DEFAULT 10000)
LANGUAGE plpgsql
AS $body$
DECLARE
    cutoff  timestamptz := clock_timestamp() - keep;
    deleted bigint;
    total   bigint := 0;
BEGIN
    IF batch IS NULL OR batch < 1 THEN
        RAISE EXCEPTION '%2$s: batch must be at least 1, got %%', batch;
    END IF;
    LOOP
        DELETE FROM %1$I.%3$I
        WHERE event_id IN (
            SELECT event_id FROM %1$I.%3$I
            WHERE created_at < cutoff
            ORDER BY created_at
            LIMIT batch
            FOR UPDATE SKIP LOCKED
        );
        GET DIAGNOSTICS deleted = ROW_COUNT;
        total := total + deleted;
        COMMIT;
        EXIT WHEN deleted < batch;
    END LOOP;
    RAISE NOTICE '%2$s: deleted %% rows created before %%', total, cutoff;
END
$body$
$ddl$, :'outbox_schema', :'prune_procedure', :'outbox_name') \gexec

COMMENT ON PROCEDURE :"outbox_schema".:"prune_procedure"(interval, int) IS
    'Delete outbox rows older than keep, batch rows per transaction. Safe for outbox-relay, which reads '
    'the WAL, not the table.';
