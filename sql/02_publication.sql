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
-- public.outbox and publishes inserts only.

DO $$
DECLARE
    pub pg_publication%ROWTYPE;
BEGIN
    SELECT * INTO pub FROM pg_publication WHERE pubname = 'outbox_relay';
    IF NOT FOUND THEN
        CREATE PUBLICATION outbox_relay FOR TABLE public.outbox WITH (publish = 'insert');
        RAISE NOTICE 'created publication outbox_relay for table public.outbox';
        RETURN;
    END IF;

    IF NOT pub.puballtables AND NOT EXISTS (
        SELECT 1 FROM pg_publication_tables
        WHERE pubname = 'outbox_relay' AND schemaname = 'public' AND tablename = 'outbox'
    ) THEN
        ALTER PUBLICATION outbox_relay ADD TABLE public.outbox;
        RAISE NOTICE 'added table public.outbox to publication outbox_relay';
    END IF;

    IF NOT pub.pubinsert OR pub.pubupdate OR pub.pubdelete OR pub.pubtruncate THEN
        ALTER PUBLICATION outbox_relay SET (publish = 'insert');
        RAISE NOTICE 'publication outbox_relay now publishes inserts only';
    END IF;
END
$$;
