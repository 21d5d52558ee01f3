//! The `/metrics` text of a fully populated [`Metrics`], compared byte for byte with a golden copy:
//! every series filled with a distinct value, so a change to the encoder that alters one byte of
//! what the deployment kit's alerts, promtool tests and dashboard read fails here first.

use super::*;
use std::time::Duration;

/// Every counter, gauge, histogram bucket and schema series, each with its own value.
fn populated() -> Metrics {
    let m = Metrics::default();
    m.published_ok.add(11);
    m.published_duplicate.add(12);
    m.dead_letters.add(13);
    m.ignored_changes.add(14);
    m.restarted(CauseKind::Postgres);
    for _ in 0..2 {
        m.restarted(CauseKind::Nats);
    }
    for _ in 0..3 {
        m.restarted(CauseKind::SlotHeld);
    }
    m.confirmed_lsn.set(0x1_6B37_4D48);
    m.received_lsn.set(0x1_6B37_5000);
    m.in_flight.set(17);
    m.streaming.set(1);
    m.nats_connected.set(1);
    m.standby.set(1);
    m.slot_lag_bytes.set(18_432);
    m.retained_wal_bytes.set(16_777_216);
    m.set_wal_status("unreserved");
    m.slot_consumed_events.set(19);
    m.spans_exported.add(21);
    m.spans_dropped.add(22);
    m.position_refused_reply.add(23);
    m.position_refused_too_large.add(24);
    m.position_refused_overloaded.add(25);
    for (i, ms) in [1, 2, 3, 7, 15, 40, 90, 200, 400, 900, 4_000, 20_000, 60_000]
        .into_iter()
        .enumerate()
    {
        for _ in 0..=i {
            m.commit_to_ack
                .observe(Duration::from_micros(ms * 1000 + 250));
        }
    }
    m.schemas.failed("ClaimApproved");
    m.schemas.failed("ClaimApproved");
    m.schemas.failed("we\"ird\\type\nsplit");
    m.schemas.failed("Another");
    m.schemas.reloads.add(5);
    m.schemas.reload_failures.add(6);
    m.schemas.loaded.set(7);
    m.parking.parked_total.add(26);
    m.parking.set(27, 28, 0);
    m.parking
        .control(ControlOp::Requeue, ControlResult::Applied);
    m.parking
        .control(ControlOp::Discard, ControlResult::Nothing);
    m.parking
        .control(ControlOp::Invalid, ControlResult::Ignored);
    m
}

#[test]
fn renders_every_series_byte_for_byte() {
    let text = populated().render();
    assert_eq!(text, GOLDEN, "{text}");
}

/// Captured from the renderer before the encoder was shared by every series.
const GOLDEN: &str = r#"# HELP outbox_relay_events_published_total Outbox events acknowledged by JetStream, by outcome.
# TYPE outbox_relay_events_published_total counter
outbox_relay_events_published_total{outcome="ok"} 11
outbox_relay_events_published_total{outcome="duplicate"} 12
outbox_relay_events_published_total{outcome="dead_letter"} 13
outbox_relay_events_published_total{outcome="parked"} 26
# HELP outbox_relay_ignored_changes_total Updates, deletes and truncates of the outbox table (not published).
# TYPE outbox_relay_ignored_changes_total counter
outbox_relay_ignored_changes_total 14
# HELP outbox_relay_reconnects_total Pipeline restarts from the confirmed position, by cause.
# TYPE outbox_relay_reconnects_total counter
outbox_relay_reconnects_total{cause="postgres"} 1
outbox_relay_reconnects_total{cause="nats"} 2
outbox_relay_reconnects_total{cause="slot_held"} 3
# HELP outbox_relay_in_flight Messages published and not yet acknowledged.
# TYPE outbox_relay_in_flight gauge
outbox_relay_in_flight 17
# HELP outbox_relay_confirmed_lsn The LSN confirmed to the replication slot (as a number).
# TYPE outbox_relay_confirmed_lsn gauge
outbox_relay_confirmed_lsn 6093753672
# HELP outbox_relay_received_lsn The highest WAL position received from Postgres (as a number).
# TYPE outbox_relay_received_lsn gauge
outbox_relay_received_lsn 6093754368
# HELP outbox_relay_slot_lag_bytes pg_current_wal_lsn() minus the slot's confirmed_flush_lsn, sampled.
# TYPE outbox_relay_slot_lag_bytes gauge
outbox_relay_slot_lag_bytes 18432
# HELP outbox_relay_retained_wal_bytes pg_current_wal_lsn() minus the slot's restart_lsn: WAL kept for the slot, sampled.
# TYPE outbox_relay_retained_wal_bytes gauge
outbox_relay_retained_wal_bytes 16777216
# HELP outbox_relay_slot_wal_status The slot's wal_status (1 for the current one); lost means events may be gone.
# TYPE outbox_relay_slot_wal_status gauge
outbox_relay_slot_wal_status{status="reserved"} 0
outbox_relay_slot_wal_status{status="extended"} 0
outbox_relay_slot_wal_status{status="unreserved"} 1
outbox_relay_slot_wal_status{status="lost"} 0
# HELP outbox_relay_slot_consumed_events Outbox events another client consumed from the slot (or advanced it past) that the stream lacks; 0 when none.
# TYPE outbox_relay_slot_consumed_events gauge
outbox_relay_slot_consumed_events 19
# HELP outbox_relay_seconds_since_last_ack Seconds since JetStream last acknowledged an event (-1 before the first): the stall detector.
# TYPE outbox_relay_seconds_since_last_ack gauge
outbox_relay_seconds_since_last_ack -1
# HELP outbox_relay_streaming 1 while a replication session streams from Postgres.
# TYPE outbox_relay_streaming gauge
outbox_relay_streaming 1
# HELP outbox_relay_standby 1 while this relay waits as a standby because another relay holds the slot.
# TYPE outbox_relay_standby gauge
outbox_relay_standby 1
# HELP outbox_relay_nats_connected 1 while the NATS connection is up.
# TYPE outbox_relay_nats_connected gauge
outbox_relay_nats_connected 1
# HELP outbox_relay_spans_exported_total Trace spans sent to the OTLP collector ([telemetry]).
# TYPE outbox_relay_spans_exported_total counter
outbox_relay_spans_exported_total 21
# HELP outbox_relay_spans_dropped_total Trace spans dropped: export queue full, or the collector refused, failed or did not answer in time.
# TYPE outbox_relay_spans_dropped_total counter
outbox_relay_spans_dropped_total 22
# HELP outbox_relay_position_requests_refused_total Position service and /wait requests refused, by reason (reply_subject: never answered; too_large: over 512 bytes).
# TYPE outbox_relay_position_requests_refused_total counter
outbox_relay_position_requests_refused_total{reason="reply_subject"} 23
outbox_relay_position_requests_refused_total{reason="too_large"} 24
outbox_relay_position_requests_refused_total{reason="overloaded"} 25
# HELP outbox_relay_commit_to_ack_seconds Time from the transaction's commit to JetStream's ack.
# TYPE outbox_relay_commit_to_ack_seconds histogram
outbox_relay_commit_to_ack_seconds_bucket{le="0.001"} 0
outbox_relay_commit_to_ack_seconds_bucket{le="0.002"} 1
outbox_relay_commit_to_ack_seconds_bucket{le="0.005"} 6
outbox_relay_commit_to_ack_seconds_bucket{le="0.01"} 10
outbox_relay_commit_to_ack_seconds_bucket{le="0.02"} 15
outbox_relay_commit_to_ack_seconds_bucket{le="0.05"} 21
outbox_relay_commit_to_ack_seconds_bucket{le="0.1"} 28
outbox_relay_commit_to_ack_seconds_bucket{le="0.25"} 36
outbox_relay_commit_to_ack_seconds_bucket{le="0.5"} 45
outbox_relay_commit_to_ack_seconds_bucket{le="1"} 55
outbox_relay_commit_to_ack_seconds_bucket{le="5"} 66
outbox_relay_commit_to_ack_seconds_bucket{le="30"} 78
outbox_relay_commit_to_ack_seconds_bucket{le="+Inf"} 91
outbox_relay_commit_to_ack_seconds_sum 1079.20975
outbox_relay_commit_to_ack_seconds_count 91
# HELP outbox_relay_schema_failures_total Events whose payload failed its JSON Schema (dead letters), by event type.
# TYPE outbox_relay_schema_failures_total counter
outbox_relay_schema_failures_total{event_type="Another"} 1
outbox_relay_schema_failures_total{event_type="ClaimApproved"} 2
outbox_relay_schema_failures_total{event_type="we\"ird\\type\nsplit"} 1
# HELP outbox_relay_schema_reloads_total Reloads of the schema directory (SIGHUP), by result.
# TYPE outbox_relay_schema_reloads_total counter
outbox_relay_schema_reloads_total{result="ok"} 5
outbox_relay_schema_reloads_total{result="failed"} 6
# HELP outbox_relay_schemas_loaded JSON Schemas in force.
# TYPE outbox_relay_schemas_loaded gauge
outbox_relay_schemas_loaded 7
# HELP outbox_relay_parked_keys Keys parked behind an event that could not be published.
# TYPE outbox_relay_parked_keys gauge
outbox_relay_parked_keys 27
# HELP outbox_relay_parked_events Events held on parked keys.
# TYPE outbox_relay_parked_events gauge
outbox_relay_parked_events 28
# HELP outbox_relay_parked_oldest_age_seconds Seconds since the oldest parked key's poison event committed (0 when none is parked).
# TYPE outbox_relay_parked_oldest_age_seconds gauge
outbox_relay_parked_oldest_age_seconds 0
# HELP outbox_relay_control_messages_total Control messages (outbox-relay.control) read, by operation and result.
# TYPE outbox_relay_control_messages_total counter
outbox_relay_control_messages_total{op="requeue",result="applied"} 1
outbox_relay_control_messages_total{op="requeue",result="nothing"} 0
outbox_relay_control_messages_total{op="requeue",result="ignored"} 0
outbox_relay_control_messages_total{op="discard",result="applied"} 0
outbox_relay_control_messages_total{op="discard",result="nothing"} 1
outbox_relay_control_messages_total{op="discard",result="ignored"} 0
outbox_relay_control_messages_total{op="requeue_event",result="applied"} 0
outbox_relay_control_messages_total{op="requeue_event",result="nothing"} 0
outbox_relay_control_messages_total{op="requeue_event",result="ignored"} 0
outbox_relay_control_messages_total{op="invalid",result="applied"} 0
outbox_relay_control_messages_total{op="invalid",result="nothing"} 0
outbox_relay_control_messages_total{op="invalid",result="ignored"} 1
"#;
