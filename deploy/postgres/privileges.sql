-- Least-privilege PostgreSQL roles for vantage.
--
-- The schema is "vantage" here (database.schema's default). If you configured another schema,
-- replace every "vantage." and "SCHEMA vantage" below with yours; the role names are examples
-- too (replace "vantage_daemon", "vantage_producer", "vantage_operator" consistently).
--
-- Four kinds of access:
--   schema owner      runs `vantage migrate`: needs CREATE on the schema (and, the first time,
--                     CREATE on the database unless the schema already exists). Never the daemon.
--   vantage_daemon    runs `vantage run`: reads and writes the work, instance and dead-letter
--                     tables through vantage's functions; cannot create or drop anything.
--   vantage_producer  your applications: append events (append_events or a plain INSERT; the
--                     fan-out trigger runs with the producer's privileges).
--   vantage_operator  people running `vantage dlq ...`, `status`, `perspectives rebuild`.
--
-- ---------------------------------------------------------------------------------------------
-- 1. Once, before the first migration (as a superuser or a role with CREATEROLE):
--
--      CREATE ROLE vantage_owner LOGIN;              -- then set its password: \password vantage_owner
--      CREATE SCHEMA vantage AUTHORIZATION vantage_owner;
--
--    then, as vantage_owner:   DATABASE_URL=postgres://vantage_owner@.../app vantage migrate
--
--    Since the daemon's role cannot create objects, run the daemon with
--    database.auto_migrate = false (VANTAGE__DATABASE__AUTO_MIGRATE=false) and repeat
--    `vantage migrate` with the owner's role before starting a new version.
--
-- 2. After every `vantage migrate` (new versions may add tables or functions), run this file as
--    a superuser, or as a role that owns the database and the schema and has CREATEROLE:
--
--      psql "postgres://admin@db/app" -v ON_ERROR_STOP=1 -f deploy/postgres/privileges.sql
--
--    It is idempotent. It creates the roles without passwords; set them yourself
--    (\password vantage_daemon) or use another authentication method (certificates, IAM).
-- ---------------------------------------------------------------------------------------------

BEGIN;

DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'vantage_daemon') THEN
        CREATE ROLE vantage_daemon LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'vantage_producer') THEN
        CREATE ROLE vantage_producer LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'vantage_operator') THEN
        CREATE ROLE vantage_operator LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS;
    END IF;
    -- CONNECT is granted to PUBLIC by default; hardened clusters revoke that.
    EXECUTE format('GRANT CONNECT ON DATABASE %I TO vantage_daemon, vantage_producer, vantage_operator',
                   current_database());
END
$$;

-- The daemon ------------------------------------------------------------------------------------

GRANT USAGE ON SCHEMA vantage TO vantage_daemon;

-- Migration bookkeeping: the daemon checks at start and in /readyz that the schema is current.
GRANT SELECT ON vantage._sqlx_migrations TO vantage_daemon;
-- Events are read (claims return them; `dlq inspect` re-reads them), never written by the daemon.
GRANT SELECT ON vantage.wh_event_store TO vantage_daemon;
-- The registry: the daemon upserts its configured perspectives at start.
GRANT SELECT, INSERT, UPDATE ON vantage.wh_perspectives TO vantage_daemon;
-- Work rows: claimed, renewed, failed and released (UPDATE), completed and dead-lettered (DELETE).
GRANT SELECT, UPDATE, DELETE ON vantage.wh_perspective_events TO vantage_daemon;
-- The lane index (claims lock, insert, update and delete lanes; triggers on the work rows
-- keep it) and its wake-ups (claims lock them FOR UPDATE, fold and delete them),
-- migrations/0003_lanes.sql.
GRANT SELECT, INSERT, UPDATE, DELETE ON vantage.wh_perspective_lanes TO vantage_daemon;
GRANT SELECT, INSERT, UPDATE, DELETE ON vantage.wh_lane_wakeups TO vantage_daemon;
-- Instance registry: heartbeat (upsert), deregistration and dead-instance cleanup.
GRANT SELECT, INSERT, UPDATE, DELETE ON vantage.wh_service_instances TO vantage_daemon;
-- Dead letters: moved in (INSERT, or UPDATE when a requeued message is dead-lettered again).
GRANT SELECT, INSERT, UPDATE ON vantage.wh_dead_letters TO vantage_daemon;
-- History is append-only (a trigger refuses UPDATE and DELETE even to the owner).
GRANT SELECT, INSERT ON vantage.wh_dead_letter_history TO vantage_daemon;
-- Versioned perspectives (docs/versions.md): claims read which versions are still building;
-- the backfill records its position and state, and the first version's going live its
-- history row. Registering a version (it creates schemas and runs setup) and making one live
-- (it re-creates the views of read_schema) need more: run those as the owner, or grant CREATE
-- on the database and ownership of the read_schema.
GRANT SELECT, UPDATE ON vantage.wh_perspective_versions TO vantage_daemon;
GRANT SELECT, INSERT ON vantage.wh_perspective_version_history TO vantage_daemon;
-- The console's chart history (docs/operations.md, "The metric history"): the sampler upserts
-- a row per minute and perspective and deletes those older than 24 hours; the console reads it.
GRANT SELECT, INSERT, UPDATE, DELETE ON vantage.wh_metric_samples TO vantage_daemon;
-- Identity columns need no sequence privileges; this keeps older or custom setups working.
GRANT USAGE ON ALL SEQUENCES IN SCHEMA vantage TO vantage_daemon;
-- The contract functions (EXECUTE is also PUBLIC by default; say it explicitly).
GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA vantage TO vantage_daemon;

-- SQL perspectives run their statements as the daemon, in the transaction that completes the
-- work row: grant exactly what each statement needs on its read-model tables, e.g.
--   GRANT SELECT, INSERT, UPDATE ON public.order_summary TO vantage_daemon;

-- Producers ---------------------------------------------------------------------------------

GRANT USAGE ON SCHEMA vantage TO vantage_producer;
-- `vantage append` checks that the schema is current before it writes anything.
GRANT SELECT ON vantage._sqlx_migrations TO vantage_producer;
-- append_events reads the stream's current version and inserts.
GRANT SELECT, INSERT ON vantage.wh_event_store TO vantage_producer;
-- The fan-out trigger reads the registry and inserts one work row per subscribed perspective.
GRANT SELECT ON vantage.wh_perspectives TO vantage_producer;
GRANT INSERT ON vantage.wh_perspective_events TO vantage_producer;
-- ... and a trigger adds one wake-up per lane touched: an INSERT only. Producers never read
-- or write the lane index itself, so nothing of vantage's can block or fail an append.
GRANT INSERT ON vantage.wh_lane_wakeups TO vantage_producer;
GRANT USAGE ON ALL SEQUENCES IN SCHEMA vantage TO vantage_producer;
GRANT EXECUTE ON FUNCTION vantage.append_events TO vantage_producer;

-- Operators (the CLI) --------------------------------------------------------------------------

-- Everything the daemon may do (`dlq replay` runs the perspective's handler like the daemon) ...
GRANT vantage_daemon TO vantage_operator;
-- ... plus re-inserting work rows: `dlq requeue` and `perspectives rebuild`.
GRANT INSERT ON vantage.wh_perspective_events TO vantage_operator;
GRANT INSERT ON vantage.wh_lane_wakeups TO vantage_operator;
-- `perspectives rebuild` also runs the perspective's reset statement: grant it on the read
-- model, e.g.  GRANT TRUNCATE ON public.order_summary TO vantage_operator;

COMMIT;
