-- 03_relay_role.sql: a least-privilege login role for outbox-relay.
--
-- What the relay does in Postgres, and what that needs:
--   * stream changes from a logical replication slot (and create that slot in `setup`): LOGIN REPLICATION.
--     Decoding through the publication reads the WAL, not the table, and needs no table privilege.
--   * `setup` and `status` look up the table, its columns, the publication and the slot in the system
--     catalogs, and check the relay's privileges: CONNECT on the database, USAGE on the schema.
--   * SELECT on public.outbox: read-only access to the one table it relays, so that setup can check the
--     table as the relay sees it and an operator logged in as this role can look at recent events. The
--     role owns nothing and can change nothing.
--
-- It does not own the table, so it cannot create the publication: the table's owner runs
-- 02_publication.sql, and the relay's `setup` then only creates what it may (the replication slot and the
-- JetStream stream) and reports the missing publication otherwise. To let the relay create the publication
-- itself, make this role the table's owner (ALTER TABLE public.outbox OWNER TO outbox_relay) and give it
-- CREATE on the database; that is more than it needs to run.
--
-- Run as a superuser (or a role with CREATEROLE that may grant REPLICATION), connected to the application's
-- database, after 01_outbox_table.sql:
--   psql "$DATABASE_URL" -v ON_ERROR_STOP=1 -f sql/03_relay_role.sql
-- then set a real password at once (the placeholder below is public):
--   psql "$DATABASE_URL" -c '\password outbox_relay'
-- or ALTER ROLE outbox_relay PASSWORD '...'. Safe to run again: an existing role keeps its password.
--
-- pg_hba.conf: a logical replication connection matches the database column of pg_hba.conf like an
-- ordinary connection (the `replication` keyword there is for physical replication), so a line such as
--   hostssl  appdb  outbox_relay  10.0.0.0/8  scram-sha-256
-- admits the relay.

DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'outbox_relay') THEN
        CREATE ROLE outbox_relay LOGIN REPLICATION PASSWORD 'change-me-outbox-relay';
        RAISE NOTICE 'created role outbox_relay with a placeholder password: change it now';
    ELSE
        ALTER ROLE outbox_relay LOGIN REPLICATION;
    END IF;
    EXECUTE format('GRANT CONNECT ON DATABASE %I TO outbox_relay', current_database());
END
$$;

GRANT USAGE ON SCHEMA public TO outbox_relay;
GRANT SELECT ON public.outbox TO outbox_relay;
