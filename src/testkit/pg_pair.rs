//! A Postgres primary with a streaming physical standby, for high-availability tests: failover slots,
//! promotion, and clients that follow the writable server through a multi-host URL (P10 in
//! docs/guarantees.md).
//!
//! ```ignore
//! let pair = PgPair::start();                    // PG_BIN's version; PgPair::start_with(bin) for another
//! pair.primary.psql("postgres", "SELECT pg_create_logical_replication_slot(
//!     's', 'pgoutput', false, false, true)");    // failover = true: only such slots are synced
//! let url = pair.multi_host_url("postgres");     // give this to the relay: it reaches the writable one
//! // ... the relay streams from slot `s` and confirms; note an LSN it has confirmed ...
//! pair.wait_slot_synced("s", &lsn, Duration::from_secs(90)).await;
//! pair.stop_primary_immediate();                 // a crash; stop_primary_clean() for a switchover
//! pair.promote_standby();                        // from here `pair.standby` is the writable server
//! ```
//!
//! Setup (`start`): the primary is an ordinary private `PgServer` (`wal_level = logical`, TLS, the
//! SCRAM and md5 roles) with a physical slot `PgPair::PHYSICAL_SLOT` for the standby. It is stopped
//! cleanly and its data dir copied (`PgServer::start_copy`; the npm builds have no `pg_basebackup`),
//! and the copy starts with `standby.signal`, `primary_conninfo` (with `dbname=`, which slot sync
//! needs), `primary_slot_name`, `hot_standby_feedback = on`, a 1 s `wal_receiver_status_interval`
//! (the primary learns the standby's position quickly, so clients held back by
//! `synchronized_standby_slots` wait briefly) and a 500 ms `wal_retrieve_retry_interval`. On 17+ the
//! standby also has `sync_replication_slots = on` and the primary `synchronized_standby_slots =
//! '<physical slot>'`, so a logical slot created with `failover = true` is copied to the standby,
//! and clients of such a slot on the primary are never sent changes the standby has not received.
//! `start` returns once the standby streams from the physical slot. Both servers share one CA
//! (`ca_cert_path` of either), their roles and their databases (create them on the primary).
//!
//! Stopping and promoting: `stop_primary_immediate` (SIGQUIT, as `pg_ctl stop -m immediate`: no
//! shutdown checkpoint, WAL not yet sent is lost to the standby), `stop_primary_clean` (fast
//! shutdown: the primary sends all its WAL, shutdown checkpoint included, to the standby before it
//! exits: a switchover), `promote_standby` (`pg_promote`; returns when the standby accepts writes).
//! The fields keep their names after a promotion: `standby` is then the writable server. The old
//! primary is not rejoined as a standby (that needs `pg_rewind`); `primary.start()` would bring it
//! back as a second, diverged primary, which a multi-host URL listing it first would then reach.
//!
//! Slot sync (17+): the standby's slot sync worker first makes a temporary copy of the slot, and
//! makes it persistent only once the primary's slot has moved (its `restart_lsn` and
//! `catalog_xmin`, not just `confirmed_flush_lsn`) past where the standby could decode from; until
//! then the standby logs "could not synchronize replication slot ... could lead to data loss". The
//! worker naps 200 ms while slots move and backs off up to 30 s while they do not, so a sync takes
//! seconds to tens of seconds: always wait with an explicit bound (60-90 s). Two ways to wait:
//! `wait_slot_synced(slot, min_lsn, timeout)` only polls, for when a client (the relay) keeps the
//! slot moving; `advance_until_synced(slot, timeout)` drives a slot nobody streams from, as a client
//! confirming everything would (`advance_slot`, which also logs the standby snapshot the slot needs
//! to move). Both return a `SyncedSlot` (the standby's `confirmed_flush_lsn`, and how long it took).
//! `stop_slot_sync` freezes the standby's copies where they are (a lag that is otherwise a race).
//! After a promotion the synced slot is a usable logical slot on the new primary at that LSN or
//! later; its `synced` column stays true there (the docs call it meaningless on a primary).
//! Before 17 there is no slot sync (`supports_slot_sync` is false) and the waits panic; the pair
//! still works as a physical standby with promotion and a multi-host URL.
//!
//! Servers stop on Drop and have the watchdogs of `PgServer`, so a failed test leaves nothing running.

use std::path::Path;
use std::time::{Duration, Instant};

use super::postgres::{self, PgServer};

/// A Postgres primary and its streaming physical standby, both stopped on Drop.
pub struct PgPair {
    /// Writable until `stop_primary_*`.
    pub primary: PgServer,
    /// Read-only and streaming from `primary` until `promote_standby`; then the writable one.
    pub standby: PgServer,
}

/// What `wait_slot_synced` saw on the standby.
#[derive(Clone, Debug)]
pub struct SyncedSlot {
    /// The synced slot's `confirmed_flush_lsn`, e.g. `0/3000140`.
    pub confirmed_flush_lsn: String,
    /// How long the wait took.
    pub waited: Duration,
}

impl PgPair {
    /// The physical slot the standby streams from (and the primary's `synchronized_standby_slots`).
    pub(crate) const PHYSICAL_SLOT: &'static str = "pair_standby";

    /// A pair from `PG_BIN` (else the default Postgres), like `PgServer`.
    pub fn start() -> PgPair {
        PgPair::start_with(&postgres::bin_dir())
    }

    /// A pair from the server binaries in `bin_dir`.
    pub(crate) fn start_with(bin_dir: &Path) -> PgPair {
        let primary = PgServer::start_new_with(bin_dir.to_path_buf());
        let slot_sync = primary.version_num() >= 170000;
        // Created before the copy so the physical slot holds the WAL the standby starts from; the
        // copy itself leaves slots out.
        primary.psql(
            "postgres",
            &format!(
                "SELECT pg_create_physical_replication_slot('{}', true)",
                PgPair::PHYSICAL_SLOT
            ),
        );
        primary.stop();

        let mut standby_conf = format!(
            "# outbox-relay tests: physical standby\n\
             primary_conninfo = 'host={host} port={port} user=postgres dbname=postgres \
             application_name=pair_standby sslmode=disable'\n\
             primary_slot_name = '{slot}'\n\
             hot_standby = on\n\
             hot_standby_feedback = on\n\
             wal_receiver_status_interval = '1s'\n\
             wal_retrieve_retry_interval = '500ms'\n",
            host = primary.host(),
            port = primary.port(),
            slot = PgPair::PHYSICAL_SLOT,
        );
        if slot_sync {
            standby_conf.push_str("sync_replication_slots = on\n");
        }
        // The copy is taken before the primary gets synchronized_standby_slots: a promoted standby
        // must not wait for a physical slot that only the old primary has.
        let standby = PgServer::start_copy(&primary, &standby_conf, Some("standby.signal"));
        if slot_sync {
            primary.append_config(&format!(
                "synchronized_standby_slots = '{}'",
                PgPair::PHYSICAL_SLOT
            ));
        }
        primary.start();

        let pair = PgPair { primary, standby };
        pair.wait_streaming(Duration::from_secs(60));
        pair
    }

    /// Whether this version has failover slots (`sync_replication_slots`, PG 17+).
    pub fn supports_slot_sync(&self) -> bool {
        self.primary.version_num() >= 170000
    }

    /// Crash-like stop of the primary: SIGQUIT (`pg_ctl stop -m immediate`), no shutdown checkpoint.
    pub fn stop_primary_immediate(&self) {
        self.primary.stop_immediate();
    }

    /// Switchover stop of the primary: fast shutdown, after which the standby has all of its WAL.
    pub fn stop_primary_clean(&self) {
        self.primary.stop();
    }

    /// Promotes the standby and returns once it accepts writes (`pg_promote` waits up to 60 s).
    pub fn promote_standby(&self) {
        let promoted = self.standby.psql("postgres", "SELECT pg_promote(true, 60)");
        assert_eq!(promoted, "t", "pg_promote did not finish within 60 s");
        assert_eq!(
            self.standby.psql("postgres", "SELECT pg_is_in_recovery()"),
            "f",
            "promoted standby still in recovery"
        );
    }

    /// Stops slot sync on the standby (`sync_replication_slots = off`, reloaded) and returns once
    /// its slot sync worker is gone: from here the standby's copies of failover slots stay where
    /// they are, behind whatever clients confirm on the primary. A sync always lags the primary
    /// (the worker naps), so after a promotion a client is sent again what it had confirmed on the
    /// old primary; this makes that lag certain instead of a race. PG 17+ only.
    pub fn stop_slot_sync(&self, timeout: Duration) {
        assert!(
            self.supports_slot_sync(),
            "slot sync needs PG 17+, this pair is {}",
            self.primary.version_num()
        );
        self.standby
            .append_config("# outbox-relay tests: slot sync stopped\nsync_replication_slots = off");
        self.standby.psql("postgres", "SELECT pg_reload_conf()");
        let sql = "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'slotsync worker'";
        let start = Instant::now();
        while self.standby.psql("postgres", sql) != "0" {
            assert!(
                start.elapsed() < timeout,
                "the standby's slot sync worker still runs {timeout:?} after sync_replication_slots = off; \
                 standby log:\n{}",
                self.standby.log_tail(4000)
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Polls the standby's `pg_replication_slots` until `slot` is there with `synced = true`, not
    /// temporary (the slot sync worker's first copy is temporary until the primary's slot moves past
    /// it, and a temporary one is dropped at promotion) and `confirmed_flush_lsn >= min_lsn`. Panics
    /// with the last row seen and the standby's log after `timeout`. PG 17+ only.
    ///
    /// Passive: something must keep the primary's slot moving (a relay streaming from it does, by
    /// confirming), or the first sync never completes; see `advance_until_synced`.
    pub async fn wait_slot_synced(
        &self,
        slot: &str,
        min_lsn: &str,
        timeout: Duration,
    ) -> SyncedSlot {
        self.poll_synced(slot, min_lsn, timeout, || {}).await
    }

    /// For a slot no client streams from: advances it on the primary as a consumer confirming
    /// everything would (`advance_slot`), again on every poll, until the standby has it synced at or
    /// past the first advance. Returns what the standby has; the primary's slot may be a little
    /// further on, past nothing but WAL the test did not write (standby snapshots).
    pub async fn advance_until_synced(&self, slot: &str, timeout: Duration) -> SyncedSlot {
        let min_lsn = self.advance_slot(slot);
        self.poll_synced(slot, &min_lsn, timeout, || {
            self.advance_slot(slot);
        })
        .await
    }

    /// Advances a logical slot on the primary to the current WAL position and returns where it got
    /// to. A standby snapshot (`pg_log_standby_snapshot`) is logged first: decoding that record is
    /// what moves the slot's `catalog_xmin` and `restart_lsn`, and the slot sync worker only makes
    /// its copy persistent once those are past the standby's own (its log says "could lead to data
    /// loss" until then). On an idle server nothing else would log one for up to 15 s.
    pub(crate) fn advance_slot(&self, slot: &str) -> String {
        self.primary.psql(
            "postgres",
            &format!(
                "SELECT FROM pg_log_standby_snapshot();\n\
                 SELECT end_lsn FROM pg_replication_slot_advance('{slot}', pg_current_wal_lsn())"
            ),
        )
    }

    async fn poll_synced(
        &self,
        slot: &str,
        min_lsn: &str,
        timeout: Duration,
        mut each_poll: impl FnMut(),
    ) -> SyncedSlot {
        assert!(
            self.supports_slot_sync(),
            "slot sync needs PG 17+, this pair is {}",
            self.primary.version_num()
        );
        let sql = format!(
            "SELECT synced AND NOT temporary AND confirmed_flush_lsn >= '{min_lsn}'::pg_lsn, \
                    synced, temporary, confirmed_flush_lsn, restart_lsn \
               FROM pg_replication_slots WHERE slot_name = '{slot}'"
        );
        let start = Instant::now();
        let mut last = String::new();
        while start.elapsed() < timeout {
            last = self.standby.psql("postgres", &sql);
            let fields: Vec<&str> = last.split('|').collect();
            if fields.first() == Some(&"t") {
                return SyncedSlot {
                    confirmed_flush_lsn: fields[3].to_string(),
                    waited: start.elapsed(),
                };
            }
            each_poll();
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        panic!(
            "slot {slot} not synced to the standby at or past {min_lsn} within {timeout:?}; \
             last row (ok|synced|temporary|confirmed_flush_lsn|restart_lsn): {last:?}\n\
             standby log:\n{}",
            self.standby.log_tail(4000)
        );
    }

    /// Superuser URL listing both servers, primary first, that only accepts a writable one:
    /// `postgres://postgres@127.0.0.1:<primary>,127.0.0.1:<standby>/<db>?target_session_attrs=read-write`.
    pub fn multi_host_url(&self, db: &str) -> String {
        format!(
            "postgres://postgres@{}/{db}?target_session_attrs=read-write",
            self.hosts()
        )
    }

    fn hosts(&self) -> String {
        format!(
            "{}:{},{}:{}",
            self.primary.host(),
            self.primary.port(),
            self.standby.host(),
            self.standby.port()
        )
    }

    /// Until the primary shows the standby streaming from the physical slot.
    fn wait_streaming(&self, timeout: Duration) {
        let sql = format!(
            "SELECT count(*) FROM pg_stat_replication r \
               JOIN pg_replication_slots s ON s.active_pid = r.pid \
              WHERE s.slot_name = '{}' AND r.state = 'streaming'",
            PgPair::PHYSICAL_SLOT
        );
        let start = Instant::now();
        while self.primary.psql("postgres", &sql) != "1" {
            assert!(
                start.elapsed() < timeout,
                "standby not streaming after {timeout:?}; standby log:\n{}",
                self.standby.log_tail(4000)
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}
