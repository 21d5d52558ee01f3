-- 02_publication.sql: the publication through which outbox-relay receives outbox inserts.
--
-- Logical replication sends only what a publication names. This one names the outbox table and only its
-- inserts: updates, deletes and truncates of the table are never sent, so deleting published rows (the way
-- to keep the table small) costs the relay nothing. The name must match `publication` in the [postgres]
-- section of relay.toml (default outbox_relay).
--
-- Creating or altering a publication requires owning the table, so the table's owner (or a superuser) runs
-- this, after 01_outbox_table.sql and before the relay's first `outbox-relay setup`: the replication slot
-- that setup creates must not be older than the publication it reads.
--   psql "$DATABASE_URL" -v ON_ERROR_STOP=1 -f sql/02_publication.sql
-- Safe to run again: it creates the publication when missing, and otherwise makes sure it contains
-- the outbox table and publishes inserts only. A partitioned outbox (07_partitioned_outbox.sql) is
-- published through its root (publish_via_partition_root = true), so inserts into any partition arrive
-- as the outbox table's and partitions can be added and dropped while the relay streams.
--
-- psql variables (set with -v name=value), with their defaults:
--   outbox_table   public.outbox   the outbox table, schema-qualified (`table` in [outbox] of relay.toml)
--   publication    outbox_relay    the publication (`publication` in [postgres] of relay.toml)
-- A second outbox in the same database gets its own publication (docs/multiple-outboxes.md):
--   psql "$DATABASE_URL" -v ON_ERROR_STOP=1 -v outbox_table=billing.outbox -v publication=billing_relay \
--        -f sql/02_publication.sql

\if :{?outbox_table}
\else
\set outbox_table public.outbox
\endif
\if :{?publication}
\else
\set publication outbox_relay
\endif
SET outbox_sql.outbox_table = :'outbox_table';
SET outbox_sql.publication = :'publication';

DO $$
DECLARE
    tbl  text[] := parse_ident(current_setting('outbox_sql.outbox_table'));
    name text   := current_setting('outbox_sql.publication');
    pub  pg_publication%ROWTYPE;
    partitioned boolean;
BEGIN
    IF cardinality(tbl) <> 2 THEN
        RAISE EXCEPTION 'outbox_table must be schema-qualified (schema.table), got "%"',
            current_setting('outbox_sql.outbox_table');
    END IF;
    IF to_regclass(format('%I.%I', tbl[1], tbl[2])) IS NULL THEN
        RAISE EXCEPTION 'table %.% does not exist: run 01_outbox_table.sql first (with the same outbox_table)',
            tbl[1], tbl[2];
    END IF;

    SELECT relkind = 'p' INTO partitioned FROM pg_class WHERE oid = to_regclass(format('%I.%I', tbl[1], tbl[2]));
    SELECT * INTO pub FROM pg_publication WHERE pubname = name;
    IF NOT FOUND THEN
        EXECUTE format('CREATE PUBLICATION %I FOR TABLE %I.%I WITH (publish = %L, publish_via_partition_root = %s)',
                       name, tbl[1], tbl[2], 'insert', coalesce(partitioned, false)::text);
        RAISE NOTICE 'created publication % for table %.%', name, tbl[1], tbl[2];
        RETURN;
    END IF;

    IF partitioned AND NOT pub.pubviaroot THEN
        EXECUTE format('ALTER PUBLICATION %I SET (publish_via_partition_root = true)', name);
        RAISE NOTICE 'publication % now publishes the partitions of %.% through it', name, tbl[1], tbl[2];
    END IF;

    -- pg_publication_rel, not pg_publication_tables: the latter lists a partitioned table's
    -- partitions instead of the table when the publication does not publish via the root.
    IF NOT pub.puballtables AND NOT EXISTS (
        SELECT 1 FROM pg_publication_rel pr JOIN pg_publication p ON p.oid = pr.prpubid
        WHERE p.pubname = name AND pr.prrelid = to_regclass(format('%I.%I', tbl[1], tbl[2]))
    ) THEN
        EXECUTE format('ALTER PUBLICATION %I ADD TABLE %I.%I', name, tbl[1], tbl[2]);
        RAISE NOTICE 'added table %.% to publication %', tbl[1], tbl[2], name;
    END IF;

    IF NOT pub.pubinsert OR pub.pubupdate OR pub.pubdelete OR pub.pubtruncate THEN
        EXECUTE format('ALTER PUBLICATION %I SET (publish = %L)', name, 'insert');
        RAISE NOTICE 'publication % now publishes inserts only', name;
    END IF;
END
$$;
