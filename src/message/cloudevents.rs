//! The CloudEvents binary content mode of a routed event (`nats.cloudevents`): the `ce-*` headers
//! of the NATS protocol binding, values percent-encoded as its §3.1.3.2 says
//! (<https://github.com/cloudevents/spec/blob/main/cloudevents/bindings/nats-protocol-binding.md>),
//! and the commit time as RFC 3339 ([`rfc3339_micros`]; [`parse_rfc3339_micros`] reads back only
//! what it writes).

use async_nats::HeaderMap;
use async_nats::header::HeaderValue;
use percent_encoding::{AsciiSet, CONTROLS, utf8_percent_encode};

use super::names;
use crate::event::OutboxEvent;

/// CloudEvents header names (lower case, as the binding's examples write them).
pub(crate) const CE_SPECVERSION: &str = "ce-specversion";
/// The CloudEvents `id`: the event's message id.
pub(crate) const CE_ID: &str = "ce-id";
/// The CloudEvents `type`: the event type.
pub(crate) const CE_TYPE: &str = "ce-type";
/// The CloudEvents `source`: `nats.cloudevents_source`.
pub(crate) const CE_SOURCE: &str = "ce-source";
/// The CloudEvents `subject`: the aggregate id.
pub(crate) const CE_SUBJECT: &str = "ce-subject";
/// The CloudEvents `time`: the transaction's commit time (RFC 3339).
pub(crate) const CE_TIME: &str = "ce-time";
/// The binding maps `datacontenttype` to `ce-datacontenttype` like every other attribute; a
/// `Content-Type` header is what marks a *structured* mode message (§3), so the relay never sets one.
pub(crate) const CE_DATACONTENTTYPE: &str = "ce-datacontenttype";
/// The CloudEvents `dataschema`: the `$id` of the JSON Schema the payload passed (`outbox.schemas`).
pub(crate) const CE_DATASCHEMA: &str = "ce-dataschema";

/// `nats.cloudevents`: what every CloudEvent shares, encoded once.
#[derive(Debug, Clone)]
pub struct CloudEvents {
    source: HeaderValue,
}

impl CloudEvents {
    /// `source` is `nats.cloudevents_source`.
    pub fn new(source: &str) -> Self {
        CloudEvents {
            source: HeaderValue::from(ce_encode(source)),
        }
    }
}

/// The binding's §3.1.3.2: space, `"`, `%` and everything outside printable ASCII are percent-encoded
/// (upper-case hex), byte by byte of the UTF-8 encoding.
const CE_ESCAPED: &AsciiSet = &CONTROLS.add(b' ').add(b'"').add(b'%');

pub(super) fn ce_encode(v: &str) -> String {
    utf8_percent_encode(v, CE_ESCAPED).to_string()
}

/// The CloudEvents attributes of a routable event (it has an id and an event type).
pub(super) fn cloudevents_headers(h: &mut HeaderMap, event: &OutboxEvent, ce: &CloudEvents) {
    let n = names();
    h.insert(n.ce_specversion.clone(), HeaderValue::from("1.0"));
    h.insert(n.ce_id.clone(), HeaderValue::from(ce_encode(&event.msg_id)));
    if let Some(t) = &event.event_type {
        h.insert(n.ce_type.clone(), HeaderValue::from(ce_encode(t)));
    }
    h.insert(n.ce_source.clone(), ce.source.clone());
    if let Some(s) = &event.aggregate_id {
        h.insert(n.ce_subject.clone(), HeaderValue::from(ce_encode(s)));
    }
    // The event's own commit time: a requeued event's, not the request's.
    let committed = event.own_commit_ts();
    if committed != 0 {
        h.insert(
            n.ce_time.clone(),
            HeaderValue::from(rfc3339_micros(committed)),
        );
    }
    if let Some(ct) = event.content_type {
        h.insert(n.ce_datacontenttype.clone(), HeaderValue::from(ct));
    }
    if let Some(id) = &event.data_schema {
        h.insert(CE_DATASCHEMA, HeaderValue::from(ce_encode(id)));
    }
}

/// A Postgres timestamp (µs since 2000-01-01 00:00 UTC) as RFC 3339 in UTC with microseconds:
/// `2024-05-17T09:30:00.123456Z`.
pub(crate) fn rfc3339_micros(pg_micros: i64) -> String {
    // 2000-01-01 is day 10957 of the Unix epoch.
    const PG_EPOCH_DAYS: i64 = 10_957;
    const DAY: i64 = 86_400_000_000;
    let days = pg_micros.div_euclid(DAY) + PG_EPOCH_DAYS;
    let in_day = pg_micros.rem_euclid(DAY);
    let (y, m, d) = civil_from_days(days);
    let secs = in_day / 1_000_000;
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:06}Z",
        secs / 3600,
        secs / 60 % 60,
        secs % 60,
        in_day % 1_000_000
    )
}

/// The Postgres timestamp `text` names when it is exactly what [`rfc3339_micros`] writes
/// (`YYYY-MM-DDTHH:MM:SS.ffffffZ`, 27 bytes, a real date and time); `None` for anything else: a
/// header read back from the stream is believed only in the relay's own form, and anything longer
/// is not looked at.
pub(crate) fn parse_rfc3339_micros(text: &str) -> Option<i64> {
    const DAY: i64 = 86_400_000_000;
    const PG_EPOCH_DAYS: i64 = 10_957;
    let b = text.as_bytes();
    if b.len() != 27 {
        return None;
    }
    let num = |from: usize, to: usize| -> Option<i64> {
        let part = &b[from..to];
        part.iter()
            .all(u8::is_ascii_digit)
            .then(|| part.iter().fold(0, |n, d| n * 10 + i64::from(d - b'0')))
    };
    let (y, m, d) = (num(0, 4)?, num(5, 7)?, num(8, 10)?);
    let (hh, mm, ss, us) = (num(11, 13)?, num(14, 16)?, num(17, 19)?, num(20, 26)?);
    if !(1..=12).contains(&m) || !(1..=31).contains(&d) || hh > 23 || mm > 59 || ss > 59 {
        return None;
    }
    let days = days_from_civil(y, m as u32, d as u32) - PG_EPOCH_DAYS;
    let micros = days * DAY + ((hh * 60 + mm) * 60 + ss) * 1_000_000 + us;
    // The separators, and a day that exists in its month (2026-02-30 is none): what this reads
    // must be what the relay would write for it.
    (rfc3339_micros(micros) == text).then_some(micros)
}

/// (year, month, day) in the proleptic Gregorian calendar → days since 1970-01-01 (Howard
/// Hinnant's `days_from_civil`, the inverse of [`civil_from_days`]).
fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = i64::from(if m > 2 { m - 3 } else { m + 9 });
    let doy = (153 * mp + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Days since 1970-01-01 → (year, month, day) in the proleptic Gregorian calendar (Howard Hinnant's
/// `civil_from_days`, <https://howardhinnant.github.io/date_algorithms.html#civil_from_days>).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_commit_time_reads_back_only_in_the_form_the_relay_writes() {
        for t in [
            0,
            762_529_506_000_789,
            -1,
            -86_400_000_001,
            4_102_444_800_000_000,
            951_782_400_000_000,
        ] {
            let text = rfc3339_micros(t);
            assert_eq!(parse_rfc3339_micros(&text), Some(t), "{text}");
        }
        for bad in [
            "",
            "2024-02-29T13:45:06Z",
            "2024-02-29T13:45:06.000789+00:00",
            "2024-02-30T13:45:06.000789Z",
            "2023-02-29T13:45:06.000789Z",
            "2024-13-01T13:45:06.000789Z",
            "2024-02-29T24:00:00.000000Z",
            "2024-02-29 13:45:06.000789Z",
            "2024-02-29T13:45:06.000789z",
            "+024-02-29T13:45:06.000789Z",
            "2024-02-29T13:45:06.00078\u{e9}",
        ] {
            assert_eq!(parse_rfc3339_micros(bad), None, "{bad}");
        }
    }
}
