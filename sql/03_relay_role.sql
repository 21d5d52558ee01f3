-- 03_relay_role.sql: the login role outbox-relay connects as, with no more than the relay needs.
--
-- What the relay does in Postgres, and what that needs:
--   * stream changes from a logical replication slot (and create that slot in `setup`): LOGIN REPLICATION.
--     Decoding through the publication reads the WAL, not the table, and needs no table privilege.
--   * `setup` and `status` look up the table, its columns, the publication and the slot in the system
--     catalogs: CONNECT on the database, USAGE on the schema.
--   * SELECT on the outbox table, so that an operator logged in as this role can look at recent events.
--     The role owns nothing and has no write privilege on any table.
--
-- What REPLICATION also allows, plainly: it is not a read-only privilege for one table.
--   * Logical decoding is not limited by table privileges. With a slot of its own and any publication or
--     output plugin available in the database, this role can read every committed change (inserts,
--     updates, deletes, with their row values) of every table in the database, not only the outbox.
--   * It can create, advance and drop any replication slot on the server, including the slots of other
--     consumers (another relay, a standby, a CDC tool); dropping or advancing one loses that consumer's
--     place.
--   * If a pg_hba.conf line with the `replication` keyword admits it, it can stream the physical WAL and
--     take a base backup (pg_basebackup): a copy of every database on the server.
-- So guard this role's password as you would a superuser's read access, admit it in pg_hba.conf only to
-- the application's database (never to `replication`), and from the relay's hosts only.
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
-- The role is created with PASSWORD NULL: it cannot log in with a password until you give it one, so no
-- placeholder password is ever valid. Set one at once, interactively (the password is not echoed or logged):
--   psql "$DATABASE_URL" -c '\password outbox_relay'
-- or in SQL: ALTER ROLE outbox_relay PASSWORD '...'; (the statement, with the password, can end up in the
-- server log or psql history). Safe to run again: an existing role keeps its password. A role created by
-- an earlier version of this file has the public placeholder password 'change-me-outbox-relay' unless
-- someone changed it: set a new one.
--
-- psql variables (set with -v name=value), with their defaults:
--   outbox_table   public.outbox   the outbox table, schema-qualified (`table` in [outbox] of relay.toml)
--   relay_role     outbox_relay    the role (the user in `url` in [postgres] of relay.toml)
--   psql "$DATABASE_URL" -v ON_ERROR_STOP=1 -v outbox_table=billing.outbox -v relay_role=billing_relay \
--        -f sql/03_relay_role.sql
--
-- pg_hba.conf: a logical replication connection matches the database column of pg_hba.conf like an
-- ordinary connection (the `replication` keyword there is for physical replication), so a line such as
--   hostssl  appdb  outbox_relay  10.0.0.0/8  scram-sha-256
-- admits the relay.

\if :{?outbox_table}
\else
\set outbox_table public.outbox
\endif
\if :{?relay_role}
\else
\set relay_role outbox_relay
\endif
SET outbox_sql.outbox_table = :'outbox_table';
SET outbox_sql.relay_role = :'relay_role';

DO $$
DECLARE
    tbl  text[] := parse_ident(current_setting('outbox_sql.outbox_table'));
    role text   := current_setting('outbox_sql.relay_role');
BEGIN
    IF cardinality(tbl) <> 2 THEN
        RAISE EXCEPTION 'outbox_table must be schema-qualified (schema.table), got "%"',
            current_setting('outbox_sql.outbox_table');
    END IF;
    IF to_regclass(format('%I.%I', tbl[1], tbl[2])) IS NULL THEN
        RAISE EXCEPTION 'table %.% does not exist: run 01_outbox_table.sql first (with the same outbox_table)',
            tbl[1], tbl[2];
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = role) THEN
        EXECUTE format('CREATE ROLE %I LOGIN REPLICATION PASSWORD NULL', role);
        RAISE NOTICE 'created role % without a password: set one with \password % (or ALTER ROLE % PASSWORD ...)',
            role, role, role;
    ELSE
        EXECUTE format('ALTER ROLE %I LOGIN REPLICATION', role);
    END IF;
    EXECUTE format('GRANT CONNECT ON DATABASE %I TO %I', current_database(), role);
    EXECUTE format('GRANT USAGE ON SCHEMA %I TO %I', tbl[1], role);
    EXECUTE format('GRANT SELECT ON %I.%I TO %I', tbl[1], tbl[2], role);
END
$$;
