//! The text form of the status report (`status` without `--json`): a line for Postgres, the slot,
//! the publication, the relay and the stream, one per other host of the URL, the schema directory
//! and an unfinished backfill when there are, then the warnings (`warning[NAME]: …`, the name an
//! operator may acknowledge), the names of those acknowledged, the problems, and `healthy` or
//! `NOT healthy` last (the exit code follows the same `Status::healthy`, in `main.rs`). Every line
//! is rendered from the same report `--json` prints: the two never disagree. Operators and scripts
//! read these lines, so their words and order only change on purpose.

use super::report::{
    BackfillStatus, RelayState, SchemasStatus, StandbyStatus, State, Status, StreamStatus,
};

impl Status {
    /// The human-readable form.
    pub fn render_text(&self) -> String {
        let mut out = String::new();
        out.push_str(&self.postgres_line());
        out.push_str(&self.slot_line());
        out.push_str(&self.publication_line());
        out.push_str(&self.relay_line());
        out.push_str(&self.stream_line());
        for sb in &self.standbys {
            out.push_str(&standby_line(sb));
        }
        if let Some(sc) = &self.schemas {
            out.push_str(&schemas_line(sc));
        }
        if let Some(b) = &self.backfill {
            out.push_str(&backfill_line(b));
        }
        for w in &self.warnings {
            out.push_str(&format!("{w}\n"));
        }
        if !self.acknowledged_warnings.is_empty() {
            out.push_str(&format!(
                "acknowledged warnings (warnings.acknowledged): {}\n",
                self.acknowledged_warnings.join(", ")
            ));
        }
        for p in &self.problems {
            // A problem may quote what a server said: one escaped, bounded line.
            out.push_str(&format!(
                "problem: {}\n",
                crate::text::shown(p, crate::error_chain::MAX_LINE)
            ));
        }
        out.push_str(if self.healthy {
            "healthy\n"
        } else {
            "NOT healthy\n"
        });
        out
    }

    /// `postgres: reachable at HOST, primary`.
    fn postgres_line(&self) -> String {
        let pg = &self.postgres;
        format!(
            "postgres: {}{}{}\n",
            if pg.state == State::Exists {
                "reachable"
            } else {
                pg.state.word()
            },
            pg.host
                .as_deref()
                .map(|h| format!(" at {h}"))
                .unwrap_or_default(),
            role(pg.in_recovery)
        )
    }

    /// `slot NAME: exists, active confirmed … lag … retained … wal_status …`.
    fn slot_line(&self) -> String {
        let s = &self.slot;
        let num = |v: Option<i64>| v.map_or_else(|| "-".into(), |n| n.to_string());
        format!(
            "slot {}: {}{}{} confirmed {} lag {} bytes retained {} bytes wal_status {}{}{}\n",
            s.name,
            s.state.word(),
            match (s.state, s.active) {
                (State::Exists, Some(true)) => ", active",
                (State::Exists, Some(false)) => ", inactive",
                _ => "",
            },
            s.unheld_secs
                .map(|n| format!(" (no relay for {n} s)"))
                .unwrap_or_default(),
            or_dash(&s.confirmed_flush_lsn),
            num(s.lag_bytes),
            num(s.retained_bytes),
            or_dash(&s.wal_status),
            match s.failover {
                Some(true) => " failover",
                _ => "",
            },
            match s.synced {
                Some(true) => " synced",
                _ => "",
            },
        )
    }

    /// `publication NAME: exists, tables [...]`; unknown rather than missing when Postgres did not
    /// answer.
    fn publication_line(&self) -> String {
        format!(
            "publication {}: {} tables [{}]\n",
            self.publication.name,
            if self.publication.exists {
                "exists,"
            } else if self.postgres.state == State::Exists {
                "MISSING,"
            } else {
                "UNKNOWN,"
            },
            crate::text::shown(&self.publication.tables.join(", "), 4096)
        )
    }

    /// `relay: streaming (pid …)`, retrying, not running or unknown.
    fn relay_line(&self) -> String {
        let r = &self.relay;
        let pids = r
            .pids
            .iter()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join(", ");
        if r.state == RelayState::NotStreaming {
            // Postgres still shows the walsender; the relay itself knows better.
            let w = r.own_word.as_ref();
            return format!(
                "relay: running (pid {pids}), NOT streaming by its own word: {}{} (its slot stays active until the ack timeout ends the session)\n",
                w.and_then(|w| w.not_ready_because.as_deref())
                    .unwrap_or("not ready"),
                w.map(last_ack).unwrap_or_default()
            );
        }
        let own = match &r.own_word {
            Some(w) if w.believed && w.ready == Some(true) => {
                let stored = w
                    .position
                    .as_ref()
                    .map(|p| format!(", stored up to {}", p.stored_lsn))
                    .unwrap_or_default();
                format!(
                    " (its own word at http {}: ready{stored}{})",
                    w.address,
                    last_ack(w)
                )
            }
            _ => String::new(),
        };
        let line = match r.state {
            RelayState::Streaming if pids.is_empty() => "relay: streaming\n".to_owned(),
            RelayState::Streaming => format!("relay: streaming (pid {pids})\n"),
            RelayState::Retrying => format!(
                "relay: running (pid {pids}), not streaming: retrying until its servers answer\n"
            ),
            RelayState::NotRunning => "relay: not running\n".to_owned(),
            RelayState::Unknown => format!(
                "relay: unknown: postgres {}\n",
                self.postgres.state.word().to_lowercase()
            ),
            RelayState::NotStreaming => unreachable!("returned above"),
        };
        match line.strip_suffix('\n') {
            Some(l) if !own.is_empty() => format!("{l}{own}\n"),
            _ => line,
        }
    }

    /// `stream NAME: exists, N messages …`, missing, or unknown and why.
    fn stream_line(&self) -> String {
        let st = &self.stream;
        match (st.exists, &st.unknown_because) {
            (Some(true), _) => format!(
                "stream {}: {}, {} messages {} bytes last sequence {} storage {} replicas {} duplicate window {}s{}{}{}\n",
                st.name,
                st.state.word(),
                st.messages.unwrap_or(0),
                st.bytes.unwrap_or(0),
                st.last_sequence.unwrap_or(0),
                st.storage.as_deref().unwrap_or("-"),
                st.replicas.unwrap_or(0),
                st.duplicate_window_secs.unwrap_or(0),
                limits(st),
                st.dead_letters
                    .as_ref()
                    .filter(|d| d.count > 0)
                    .map(|d| format!(" dead letters {}", d.count))
                    .unwrap_or_default(),
                st.parked
                    .as_ref()
                    .filter(|p| p.keys > 0)
                    .map(|p| format!(" parked keys {} ({} events)", p.keys, p.events))
                    .unwrap_or_default()
            ),
            (Some(false), _) => format!("stream {}: MISSING\n", st.name),
            (None, why) => format!(
                "stream {}: unknown: {}\n",
                st.name,
                why.as_deref().unwrap_or("NATS unreachable")
            ),
        }
    }
}

/// ` limits max_msgs … max_bytes … max_age …s discard …`, the limits the stream has.
fn limits(st: &StreamStatus) -> String {
    let mut out = String::new();
    if let Some(m) = st.max_msgs {
        out.push_str(&format!(" max_msgs {m}"));
    }
    if let Some(b) = st.max_bytes {
        out.push_str(&format!(" max_bytes {b}"));
    }
    if let Some(a) = st.max_age_secs {
        out.push_str(&format!(" max_age {a}s"));
    }
    if !out.is_empty()
        && let Some(d) = &st.discard
    {
        out.push_str(&format!(" discard {d}"));
    }
    out
}

/// A value, or `-` when unknown.
fn or_dash(v: &Option<String>) -> String {
    v.clone().unwrap_or_else(|| "-".into())
}

/// `, standby` or `, primary`; nothing when unknown.
fn role(in_recovery: Option<bool>) -> &'static str {
    match in_recovery {
        Some(true) => ", standby",
        Some(false) => ", primary",
        None => "",
    }
}

/// `host H:P: reachable, standby, slot copy exists (synced, confirmed …)`.
fn standby_line(sb: &StandbyStatus) -> String {
    format!(
        "host {}: {}{}, slot copy {}{}\n",
        sb.host,
        if sb.state == State::Exists {
            "reachable"
        } else {
            "UNREACHABLE"
        },
        role(sb.in_recovery),
        if sb.slot_exists { "exists" } else { "missing" },
        match (sb.synced, &sb.confirmed_flush_lsn) {
            (Some(true), Some(l)) => format!(" (synced, confirmed {l})"),
            (_, Some(l)) => format!(" (confirmed {l})"),
            _ => String::new(),
        }
    )
}

/// `backfill: NOT FINISHED: …`, with the command that recovers.
fn backfill_line(b: &BackfillStatus) -> String {
    format!(
        "backfill: NOT FINISHED: slot {}, started by {} (marker {}); once it no longer runs, {}\n",
        b.backfill.slot_shown(),
        b.backfill.origin(),
        b.marker,
        b.recover
    )
}

/// `schemas DIR: N load`, or why they do not.
fn schemas_line(sc: &SchemasStatus) -> String {
    match (&sc.loaded, &sc.error) {
        (Some(n), _) => format!(
            "schemas {}: {n} load{}\n",
            sc.dir,
            if sc.required {
                ", required for every event type"
            } else {
                ""
            }
        ),
        (None, e) => format!(
            "schemas {}: DO NOT LOAD: {}\n",
            sc.dir,
            e.as_deref().unwrap_or("-")
        ),
    }
}

/// `; its last ack N s ago`, when the relay has acked anything.
pub(super) fn last_ack(w: &crate::relay_word::RelayWord) -> String {
    w.seconds_since_last_ack
        .map(|s| format!("; its last ack {s:.1} s ago"))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    //! The text form of reports built by hand, line for line: operators and scripts read these
    //! words, so a change to any of them shows here first.

    use super::super::report::unknown_stream;
    use super::super::report::{PublicationStatus, RelayStatus, ServerStatus};
    use super::super::slot::slot_status;
    use super::*;
    use crate::backfill_marker::{META_BACKFILL, Marker};
    use crate::catalog::SlotRow;
    use crate::relay_word::{RelayWord, WordPosition};

    /// What `status` reports when neither server answers.
    fn nothing_answers() -> Status {
        let mut stream = unknown_stream("st");
        stream.unknown_because = Some("NATS unreachable (refused)".into());
        Status {
            healthy: false,
            postgres: ServerStatus::unread(State::Unreachable),
            standbys: Vec::new(),
            slot: slot_status("s", State::Unreachable, None),
            relay: RelayStatus {
                state: RelayState::Unknown,
                pids: Vec::new(),
                own_word: None,
            },
            publication: PublicationStatus {
                name: "p".into(),
                exists: false,
                tables: Vec::new(),
            },
            stream,
            schemas: None,
            backfill: None,
            orphan_marks: Vec::new(),
            grace_secs: 30,
            problems: vec!["postgres down".into(), "nats down".into()],
            warning_names: Vec::new(),
            warnings: Vec::new(),
            acknowledged_warnings: Vec::new(),
        }
    }

    /// The relay's own word over http, ready or not.
    fn word(ready: bool) -> RelayWord {
        RelayWord {
            address: "127.0.0.1:9090".into(),
            reached: true,
            believed: true,
            not_believed_because: None,
            ready: Some(ready),
            not_ready_because: (!ready).then(|| "nats disconnected".into()),
            position: Some(WordPosition {
                slot: "s".into(),
                stream: "st".into(),
                stored_lsn: crate::Lsn(0x16B_3740),
                confirmed_lsn: crate::Lsn(0x16B_3740),
                last_sequence: 10,
            }),
            seconds_since_last_ack: Some(1.5),
            error: None,
        }
    }

    /// What `status` reports of a healthy primary with a standby, schemas and stream limits.
    fn all_there() -> Status {
        let row = SlotRow {
            active: true,
            active_pid: Some(77),
            confirmed_flush_lsn: Some("0/16B3740".into()),
            lag_bytes: Some(0),
            retained_bytes: Some(1024),
            wal_status: Some("reserved".into()),
            failover: Some(true),
            ..SlotRow::default()
        };
        let mut stream = unknown_stream("st");
        stream.state = State::Exists;
        stream.exists = Some(true);
        stream.messages = Some(10);
        stream.bytes = Some(2048);
        stream.last_sequence = Some(10);
        stream.storage = Some("file".into());
        stream.replicas = Some(3);
        stream.duplicate_window_secs = Some(120);
        stream.max_msgs = Some(100);
        stream.max_age_secs = Some(86400);
        stream.discard = Some("new".into());
        Status {
            healthy: true,
            postgres: ServerStatus {
                host: Some("10.0.0.1:5432".into()),
                server_version: Some("17.2".into()),
                in_recovery: Some(false),
                ..ServerStatus::unread(State::Exists)
            },
            standbys: vec![StandbyStatus {
                host: "10.0.0.2:5432".into(),
                state: State::Exists,
                in_recovery: Some(true),
                slot_exists: true,
                synced: Some(true),
                confirmed_flush_lsn: Some("0/16B3740".into()),
            }],
            slot: slot_status("s", State::Exists, Some(&row)),
            relay: RelayStatus {
                state: RelayState::Streaming,
                pids: vec![42],
                own_word: Some(word(true)),
            },
            publication: PublicationStatus {
                name: "p".into(),
                exists: true,
                tables: vec!["public.outbox".into()],
            },
            stream,
            schemas: Some(SchemasStatus {
                dir: "/etc/schemas".into(),
                loaded: Some(3),
                error: None,
                required: true,
            }),
            backfill: None,
            orphan_marks: Vec::new(),
            grace_secs: 30,
            problems: Vec::new(),
            warning_names: vec!["one-replica"],
            warnings: vec![crate::warning::Warning::new("one-replica", "a warning")],
            acknowledged_warnings: vec!["dead-letters"],
        }
    }

    #[test]
    fn nothing_answering_is_unknown_not_missing_and_not_healthy() {
        assert_eq!(
            nothing_answers().render_text(),
            "postgres: UNREACHABLE\n\
             slot s: UNREACHABLE confirmed - lag - bytes retained - bytes wal_status -\n\
             publication p: UNKNOWN, tables []\n\
             relay: unknown: postgres unreachable\n\
             stream st: unknown: NATS unreachable (refused)\n\
             problem: postgres down\n\
             problem: nats down\n\
             NOT healthy\n"
        );
    }

    #[test]
    fn a_healthy_status_has_a_line_per_object_then_warnings_then_healthy() {
        assert_eq!(
            all_there().render_text(),
            "postgres: reachable at 10.0.0.1:5432, primary\n\
             slot s: exists, active confirmed 0/16B3740 lag 0 bytes retained 1024 bytes wal_status reserved failover\n\
             publication p: exists, tables [public.outbox]\n\
             relay: streaming (pid 42) (its own word at http 127.0.0.1:9090: ready, stored up to 0/16B3740; its last ack 1.5 s ago)\n\
             stream st: exists, 10 messages 2048 bytes last sequence 10 storage file replicas 3 duplicate window 120s max_msgs 100 max_age 86400s discard new\n\
             host 10.0.0.2:5432: reachable, standby, slot copy exists (synced, confirmed 0/16B3740)\n\
             schemas /etc/schemas: 3 load, required for every event type\n\
             warning[one-replica]: a warning\n\
             acknowledged warnings (warnings.acknowledged): dead-letters\n\
             healthy\n"
        );
    }

    #[test]
    fn the_relay_line_believes_the_relays_own_word_over_postgres() {
        let mut s = all_there();
        s.relay.own_word = Some(word(false));
        s.relay.state = RelayState::NotStreaming;
        assert_eq!(
            s.relay_line(),
            "relay: running (pid 42), NOT streaming by its own word: nats disconnected; its last \
             ack 1.5 s ago (its slot stays active until the ack timeout ends the session)\n"
        );
        s.relay = RelayStatus {
            state: RelayState::Retrying,
            pids: vec![5, 6],
            own_word: None,
        };
        assert_eq!(
            s.relay_line(),
            "relay: running (pid 5, 6), not streaming: retrying until its servers answer\n"
        );
        s.relay.state = RelayState::NotRunning;
        assert_eq!(s.relay_line(), "relay: not running\n");
    }

    #[test]
    fn what_a_server_said_stays_on_the_line_it_is_quoted_in() {
        let mut s = nothing_answers();
        s.problems = vec!["postgres: relation \"x\nhealthy\" does not exist".into()];
        s.publication.tables = vec!["public.\"a\u{1b}[2K\"".into()];
        s.warnings = vec![crate::warning::Warning::new("one-replica", "w\nhealthy")];
        let text = s.render_text();
        assert_eq!(
            text.lines().filter(|l| *l == "healthy").count(),
            0,
            "no line of its own: {text}"
        );
        assert!(!text.contains('\u{1b}'), "{text:?}");
        assert!(
            text.contains(r#"problem: postgres: relation "x\u{a}healthy" does not exist"#),
            "{text}"
        );
    }

    #[test]
    fn a_word_not_believed_is_not_quoted_and_a_not_streaming_relay_says_so() {
        let mut s = all_there();
        let mut w = word(true);
        w.believed = false;
        s.relay.own_word = Some(w);
        assert_eq!(s.relay_line(), "relay: streaming (pid 42)\n");
    }

    #[test]
    fn missing_objects_and_an_unfinished_backfill_have_their_lines() {
        let mut s = all_there();
        s.slot = slot_status("s", State::Missing, None);
        s.publication.exists = false;
        s.stream = unknown_stream("st");
        s.stream.state = State::Missing;
        s.stream.exists = Some(false);
        s.schemas = Some(SchemasStatus {
            dir: "/etc/schemas".into(),
            loaded: None,
            error: Some("a.json: not JSON".into()),
            required: false,
        });
        s.backfill = Some(BackfillStatus {
            marker: META_BACKFILL,
            backfill: Marker {
                slot: String::new(),
                pid: 9,
                host: "h".into(),
                started: "2026-01-01T00:00:00Z".into(),
                where_sql: None,
                order_by: None,
            },
            recover: "run `outbox-relay backfill` again".into(),
        });
        let text = s.render_text();
        for line in [
            "slot s: MISSING confirmed - lag - bytes retained - bytes wal_status -\n",
            "publication p: MISSING, tables [public.outbox]\n",
            "stream st: MISSING\n",
            "schemas /etc/schemas: DO NOT LOAD: a.json: not JSON\n",
            "backfill: NOT FINISHED: slot (unknown), started by pid 9 on h at 2026-01-01T00:00:00Z \
             (marker outbox-relay.backfill); once it no longer runs, run `outbox-relay backfill` again\n",
        ] {
            assert!(text.contains(line), "{line:?} not in:\n{text}");
        }
    }
}
