-- 07_partitioned_outbox.sql: the outbox as a table partitioned by month, for keeping rows for months
-- (to look up what was sent, or to recover a lost slot with `outbox-relay backfill`) without the cost of
-- deleting them: retention drops a whole month's partition, which is a catalog change, not millions of
-- deleted rows for vacuum to clean up.
--
-- Use it instead of 01_outbox_table.sql (same columns, so relay.toml stays the same), then run
-- 02_publication.sql, which publishes a partitioned table through its root
-- (publish_via_partition_root = true): every insert reaches the relay as an insert into the outbox table,
-- whatever partition holds it, and partitions can be created, detached and dropped while the relay
-- streams (none of that is an event). `outbox-relay setup` creates the publication that way too, and
-- refuses an existing one that publishes the partitions under their own names.
--
--   psql "$DATABASE_URL" -v ON_ERROR_STOP=1 -f sql/07_partitioned_outbox.sql
--   psql "$DATABASE_URL" -v ON_ERROR_STOP=1 -f sql/02_publication.sql
--
-- It creates:
--   <table>                        partitioned by RANGE (created_at); primary key (event_id, created_at),
--                                  since a partitioned table's unique keys must contain the partition key
--                                  (event ids are uuids; JetStream deduplicates by the id all the same)
--   <table>_create_partition(month date default next month)
--                                  creates the partition <table>_pYYYYMM for that month if it is missing;
--                                  returns its name. This file creates this month's and the next two.
--   <table>_drop_partitions(keep interval default '3 months')
--                                  drops the partitions <table>_pYYYYMM whose whole month is older than
--                                  now() - keep; returns the names it dropped
-- Schedule both daily, e.g. with pg_cron (jobs run in the database named by cron.database_name):
--   SELECT cron.schedule('outbox-partitions', '7 3 * * *',
--     $job$SELECT public.outbox_create_partition(); SELECT public.outbox_drop_partitions(interval '3 months')$job$);
-- Creating partitions ahead matters: an insert whose created_at has no partition fails, and with it the
-- application's transaction. There is deliberately no DEFAULT partition: rows in it would make creating
-- the month's partition later fail until they are moved.
--
-- Sizing, for 730,000 events a year (2,000 a day): a month's partition holds about 61,000 rows; at around
-- 500 bytes a row with its index that is some 30 MB, so three months kept are about 180,000 rows and
-- 100 MB, and each daily run drops at most one month (about 61,000 rows) in a few milliseconds. Keep
-- rows for longer than it can take to notice and recover a lost slot (docs/recovery.md).
--
-- Safe to run again (IF NOT EXISTS / CREATE OR REPLACE).
--
-- psql variable (set with -v name=value):
--   outbox_table   the table, schema-qualified (default public.outbox)

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
\set create_partition :outbox_name '_create_partition'
\set drop_partitions :outbox_name '_drop_partitions'

CREATE TABLE IF NOT EXISTS :"outbox_schema".:"outbox_name" (
    event_id       uuid        NOT NULL DEFAULT gen_random_uuid(),
    aggregate_type text        NOT NULL,
    aggregate_id   text        NOT NULL,
    event_type     text        NOT NULL,
    payload        jsonb       NOT NULL,
    created_at     timestamptz NOT NULL DEFAULT now(),
    headers        jsonb,
    PRIMARY KEY (event_id, created_at)
) PARTITION BY RANGE (created_at);

-- The bodies name the table, and psql does not substitute variables inside them, so they are written by
-- format() and run by \gexec (%1$s schema, %2$s table; %% is a literal %).

-- The partition for the month that contains `month`.
SELECT format($ddl$
CREATE OR REPLACE FUNCTION %1$I.%3$I(
    month date DEFAULT (date_trunc('month', now()) + interval '1 month')::date
) RETURNS text
LANGUAGE plpgsql AS $body$
DECLARE
    first_day date := date_trunc('month', month)::date;
    part      text := %2$L || '_p' || to_char(month, 'YYYYMM');
BEGIN
    IF to_regclass(format('%%I.%%I', %1$L, part)) IS NULL THEN
        EXECUTE format('CREATE TABLE %%I.%%I PARTITION OF %%I.%%I FOR VALUES FROM (%%L) TO (%%L)',
                       %1$L, part, %1$L, %2$L,
                       first_day::timestamptz, (first_day + interval '1 month')::timestamptz);
    END IF;
    RETURN part;
END
$body$
$ddl$, :'outbox_schema', :'outbox_name', :'create_partition') \gexec

-- Drops whole months older than `keep`. Dropping a partition is not an event and does not disturb the
-- relay: the events in it were published when they were inserted.
SELECT format($ddl$
CREATE OR REPLACE FUNCTION %1$I.%3$I(keep interval DEFAULT interval '3 months') RETURNS SETOF text
LANGUAGE plpgsql AS $body$
DECLARE
    -- The partition named for month M holds rows up to M + 1 month: it goes once M is before the
    -- month that now() - keep falls in.
    oldest_kept text := to_char(date_trunc('month', now() - keep), 'YYYYMM');
    part        record;
BEGIN
    FOR part IN
        SELECT c.relname::text AS name
        FROM pg_inherits i
        JOIN pg_class c ON c.oid = i.inhrelid
        WHERE i.inhparent = to_regclass(format('%%I.%%I', %1$L, %2$L))
          AND c.relname ~ ('^' || %2$L || '_p[0-9]{6}$')
          AND right(c.relname, 6) < oldest_kept
        ORDER BY c.relname
    LOOP
        EXECUTE format('DROP TABLE %%I.%%I', %1$L, part.name);
        RETURN NEXT part.name;
    END LOOP;
END
$body$
$ddl$, :'outbox_schema', :'outbox_name', :'drop_partitions') \gexec

SELECT :"outbox_schema".:"create_partition"((date_trunc('month', now()) + m * interval '1 month')::date)
FROM generate_series(0, 2) AS m;
