//! Setup's JetStream side: the stream must cover the subject template and the dead-letter subject;
//! created with file storage, `discard: new` and the relay's metadata when missing.
//!
//! The metadata (`outbox-relay.slot`, `outbox-relay.table`) and the stream's last sequence, or for a
//! stream made without the metadata the `Outbox-Commit-Lsn` header of its last message, are how the
//! relay knows a stream already holds (or held) this outbox's events, so a missing slot is never
//! replaced quietly (P9), even after the stream's limits removed every message.

use std::collections::HashMap;
use std::time::Duration;

use async_nats::jetstream::{self, stream};

use super::{SetupError, SetupReport};
use crate::config::Settings;
use crate::message;
use crate::route::subject_covers;
use crate::warning::Warning;

/// Metadata keys setup writes on a stream it creates.
pub(crate) const META_SLOT: &str = "outbox-relay.slot";
/// The stream metadata key that names the outbox table the stream's events come from.
pub(crate) const META_TABLE: &str = "outbox-relay.table";
/// The stream metadata key that names the database the slot is in, `<system identifier>/<database>`:
/// slot names are unique per server only, and two servers may share one NATS.
pub(crate) const META_DATABASE: &str = "outbox-relay.database";
/// The stream metadata key that names the logical message prefix the stream's relay publishes
/// (absent: none, or a stream made before the key): every slot receives every logical message, so
/// this is how `setup` tells that another relay already publishes a prefix.
pub(crate) const META_MESSAGE_PREFIX: &str = "outbox-relay.message_prefix";

/// The stream as setup found it.
pub(super) struct FoundStream {
    /// The stream holds events written by a relay for this outbox: the sequence and LSN of the
    /// last one.
    pub(crate) relay_events: Option<(u64, String)>,
    /// A backfill of this slot has begun and not finished: why `setup` and `run` refuse.
    pub(crate) backfill_refusal: Option<String>,
    /// With `outbox.on_invalid = "park"`, the stream does not store the parking subjects
    /// (`<dead_letter_subject>.parked.>`): `setup` (and `run`, which runs it first) adds them.
    pub(crate) add_parked: bool,
    /// With `outbox.on_invalid = "park"`, the stream does not allow per-message TTL: `setup`
    /// allows it ([`allow_ttl`]), so parked copies and release markers can carry `Nats-TTL:
    /// never` and outlive `max_age` (the stream is the only record of a parked event).
    pub(crate) allow_ttl: bool,
}

/// Checks the stream; `None` when it must be created.
pub(super) async fn check(
    settings: &Settings,
    js: &jetstream::Context,
    report: &mut SetupReport,
) -> Result<Option<FoundStream>, SetupError> {
    let name = &settings.config().nats.stream;
    let Some(mut s) = get_stream(js, name).await? else {
        return Ok(None);
    };
    let info = s
        .info()
        .await
        .map_err(|e| problem(name, e.to_string()))?
        .clone();
    // Another relay's stream first: its subjects not covering ours would be the wrong reason.
    super::overlap::check_existing_stream(
        settings,
        info.config.metadata.get(META_SLOT).map(String::as_str),
    )?;
    check_subjects(settings, &info, report)?;
    check_config(settings, &info, report)?;
    report.lines.push(format!(
        "stream {name}: exists ({} messages, subjects {})",
        info.state.messages,
        crate::text::shown(&info.config.subjects.join(", "), 4096)
    ));
    let relay_events = relay_events(settings, &mut s, &info).await;
    let backfill_refusal = crate::backfill_marker::refusal(settings, &info.config.metadata);
    let probe = parked_probe(settings);
    let add_parked = settings.park_on_invalid
        && !info
            .config
            .subjects
            .iter()
            .any(|f| subject_covers(f, &probe));
    let allow_ttl = settings.park_on_invalid && !info.config.allow_message_ttl;
    Ok(Some(FoundStream {
        relay_events,
        backfill_refusal,
        add_parked,
        allow_ttl,
    }))
}

/// A problem with the stream `name`, as [`SetupError::Stream`].
fn problem(name: &str, problem: String) -> SetupError {
    SetupError::Stream {
        name: name.to_owned(),
        problem,
    }
}

/// The stream `name`; `None` when it does not exist.
async fn get_stream(
    js: &jetstream::Context,
    name: &str,
) -> Result<Option<stream::Stream>, SetupError> {
    match js.get_stream(name).await {
        Ok(s) => Ok(Some(s)),
        Err(e) => match e.kind() {
            jetstream::context::GetStreamErrorKind::JetStream(je)
                if je.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND =>
            {
                Ok(None)
            }
            jetstream::context::GetStreamErrorKind::JetStream(_) => {
                Err(problem(name, e.to_string()))
            }
            _ => Err(SetupError::NoJetStream(e)),
        },
    }
}

/// The stream's subjects must cover the subject template (or, with `{partition}`, at least one
/// partition: a warning names those left out) and the dead-letter subject.
fn check_subjects(
    settings: &Settings,
    info: &stream::Info,
    report: &mut SetupReport,
) -> Result<(), SetupError> {
    let name = &settings.config().nats.stream;
    let subjects = &info.config.subjects;
    let covered = |needed: &str| subjects.iter().any(|f| subject_covers(f, needed));
    // With {partition}, a stream may name its partitions one by one: a stream that covers some
    // but not all of them takes the events of those and refuses the others' (the relay retries them
    // and stops advancing), which setup says; one that covers none is refused below as before.
    let partitions = settings.subject.partition_wildcards();
    let missing: Vec<&String> = partitions.iter().filter(|p| !covered(p)).collect();
    let template = if !missing.is_empty() && missing.len() < partitions.len() {
        report.warnings.push(Warning::new(
            "partitions-not-covered",
            format!(
                "stream {name}'s subjects ({}) do not cover {} of the {} partitions, e.g. {}: events of those \
                 partitions cannot be stored, and the relay stops at the first one; add the subjects or set \
                 nats.partitions to what the stream covers",
                subjects.join(", "),
                missing.len(),
                partitions.len(),
                missing.iter().take(3).map(|s| s.as_str()).collect::<Vec<_>>().join(", ")
            ),
        ));
        None
    } else if !partitions.is_empty() && missing.is_empty() {
        None
    } else {
        Some(settings.subject.wildcard())
    };
    for needed in template
        .iter()
        .chain([&settings.config().nats.dead_letter_subject])
    {
        if !covered(needed) {
            return Err(problem(
                name,
                format!(
                    "does not cover subject {needed} (its subjects: {}): add it with `nats stream edit {name} \
                     --subjects ...` or use another nats.stream",
                    subjects.join(", ")
                ),
            ));
        }
    }
    Ok(())
}

/// Atomic publishing when `nats.atomic_transactions` needs it; a warning for memory storage.
fn check_config(
    settings: &Settings,
    info: &stream::Info,
    report: &mut SetupReport,
) -> Result<(), SetupError> {
    let name = &settings.config().nats.stream;
    if settings.config().nats.atomic_transactions && !info.config.allow_atomic_publish {
        return Err(problem(
            name,
            format!(
                "does not allow atomic batch publishing, which nats.atomic_transactions needs: set \
                 \"allow_atomic\": true in its configuration (nats-server 2.12 or later; e.g. `nats stream info {name} --json`, \
                 edit the config part, then `nats stream edit {name} --config FILE`), or set nats.atomic_transactions = false"
            ),
        ));
    }
    if info.config.storage == stream::StorageType::Memory {
        report.warnings.push(Warning::new(
            "memory-storage",
            format!(
                "stream {name} uses memory storage: acknowledged events are lost when nats-server restarts"
            ),
        ));
    }
    Ok(())
}

/// Whether the stream holds (or held) this outbox's events: the last sequence and the
/// `Outbox-Commit-Lsn` of its message.
async fn relay_events(
    settings: &Settings,
    s: &mut stream::Stream,
    info: &stream::Info,
) -> Option<(u64, String)> {
    let last = info.state.last_sequence;
    let ours = info.config.metadata.get(META_SLOT) == Some(&settings.config().postgres.slot);
    // The stream's metadata decides first: a stream made for this slot that ever stored a message
    // held its events, even when age or size limits (or a purge) have emptied it since; its last
    // sequence survives the removal. The last message's header covers streams made without it.
    if last == 0 {
        return None;
    }
    let lsn = s
        .get_raw_message(last)
        .await
        .ok()
        .and_then(|m| commit_lsn_of(&m.headers));
    match lsn {
        Some(lsn) => Some((last, lsn)),
        None if ours => Some((
            last,
            "unknown: the message is gone (age or size limits, or a purge)".to_owned(),
        )),
        None => None,
    }
}

/// The commit LSN a relay's message names: its `Outbox-Commit-Lsn`, or without one
/// (`nats.descriptive_headers = false`) the LSN of its `Outbox-Position`, which for an event of a
/// transaction is the same commit LSN.
fn commit_lsn_of(headers: &async_nats::HeaderMap) -> Option<String> {
    if let Some(v) = headers.get(message::COMMIT_LSN) {
        return Some(v.as_str().to_owned());
    }
    let stamp = headers.get(message::POSITION)?;
    let (_, position) = crate::position::parse_stamp(stamp.as_str()).ok()?;
    Some(position.lsn.text())
}

/// The first existing stream whose subjects overlap `ours`, and its subjects.
async fn overlapping_stream(
    js: &jetstream::Context,
    ours: &[String],
) -> Option<(String, Vec<String>)> {
    use futures_util::StreamExt;
    let mut streams = js.streams();
    while let Some(Ok(info)) = streams.next().await {
        let theirs = info.config.subjects;
        if theirs
            .iter()
            .any(|t| ours.iter().any(|o| crate::route::subjects_overlap(o, t)))
        {
            return Some((info.config.name, theirs));
        }
    }
    None
}

/// A parking subject (of a made-up key) that the stream must store for `on_invalid = "park"`.
fn parked_probe(settings: &Settings) -> String {
    let n = &settings.config().nats;
    crate::parking::parked_subject(
        &n.dead_letter_subject,
        crate::parking::KeyHash::of(Some("probe"), Some("probe")),
    )
}

/// The change [`add_parked`] makes, as `setup --check` words it.
pub(super) fn parked_change(settings: &Settings) -> String {
    let n = &settings.config().nats;
    format!(
        "stream {}: would add subject {} (outbox.on_invalid = \"park\": the parking subjects)",
        n.stream,
        crate::parking::parked_filter(&n.dead_letter_subject)
    )
}

/// Adds the parking subjects to the existing stream (`outbox.on_invalid = "park"`).
pub(super) async fn add_parked(
    settings: &Settings,
    js: &jetstream::Context,
) -> Result<String, SetupError> {
    let n = &settings.config().nats;
    let filter = crate::parking::parked_filter(&n.dead_letter_subject);
    let refused = |why: String| {
        problem(
            &n.stream,
            format!(
                "does not store the parking subjects {filter} that outbox.on_invalid = \"park\" needs, and setup \
                 could not add them ({}): run `outbox-relay setup` with the right to edit the stream, or add them \
                 with `nats stream edit {} --subjects ...`",
                crate::text::shown(&why, 512),
                n.stream
            ),
        )
    };
    edit(js, &n.stream, |c| c.subjects.push(filter.clone()), refused).await?;
    Ok(format!(
        "stream {}: subject {filter} added (outbox.on_invalid = \"park\": the parking subjects)",
        n.stream
    ))
}

/// The change [`allow_ttl`] makes, as `setup --check` words it.
pub(super) fn ttl_change(settings: &Settings) -> String {
    format!(
        "stream {}: would allow per-message TTL ({TTL_WHY})",
        settings.config().nats.stream
    )
}

/// Why park mode needs per-message TTL, as setup's lines say it.
const TTL_WHY: &str = "outbox.on_invalid = \"park\": parked events and release markers carry \
                       Nats-TTL: never, so the stream's max_age never removes them";

/// Allows per-message TTL on the existing stream (`outbox.on_invalid = "park"`): without it a
/// key parked longer than `max_age` lost its parked events, and a restart found it released.
pub(super) async fn allow_ttl(
    settings: &Settings,
    js: &jetstream::Context,
) -> Result<String, SetupError> {
    let n = &settings.config().nats;
    let refused = |why: String| {
        problem(
            &n.stream,
            format!(
                "does not allow per-message TTL, which outbox.on_invalid = \"park\" needs so that max_age never \
                 removes a parked event, and setup could not allow it ({}): run `outbox-relay setup` with the right \
                 to edit the stream, or set \"allow_msg_ttl\": true in its configuration (nats-server 2.11 or later)",
                crate::text::shown(&why, 512)
            ),
        )
    };
    edit(js, &n.stream, |c| c.allow_message_ttl = true, refused).await?;
    Ok(format!(
        "stream {}: per-message TTL allowed ({TTL_WHY})",
        n.stream
    ))
}

/// Reads the stream's configuration, applies `change` and updates the stream; any failure is
/// `refused` with the server's words.
async fn edit(
    js: &jetstream::Context,
    stream: &str,
    change: impl FnOnce(&mut jetstream::stream::Config),
    refused: impl Fn(String) -> SetupError,
) -> Result<(), SetupError> {
    let mut s = js
        .get_stream(stream)
        .await
        .map_err(|e| refused(e.to_string()))?;
    let mut config = s
        .info()
        .await
        .map_err(|e| refused(e.to_string()))?
        .config
        .clone();
    change(&mut config);
    js.update_stream(config)
        .await
        .map_err(|e| refused(e.to_string()))?;
    Ok(())
}

/// Creates the stream.
pub(super) async fn create(
    settings: &Settings,
    js: &jetstream::Context,
    database: Option<&str>,
) -> Result<String, SetupError> {
    let n = &settings.config().nats;
    let wildcard = settings.subject.wildcard();
    let cfg = stream::Config {
        name: n.stream.clone(),
        // The parking subjects too, whatever on_invalid says now: choosing "park" later then
        // needs no change to the stream.
        subjects: vec![
            wildcard.clone(),
            n.dead_letter_subject.clone(),
            crate::parking::parked_filter(&n.dead_letter_subject),
        ],
        storage: stream::StorageType::File,
        retention: stream::RetentionPolicy::Limits,
        // At a limit, refuse new events (the relay stalls and retries) rather than delete old ones.
        discard: stream::DiscardPolicy::New,
        duplicate_window: Duration::from_secs(n.duplicate_window_secs),
        max_age: Duration::from_secs(n.max_age_secs),
        // Checked below 2^63 by the settings; JetStream's "no limit" is -1.
        max_bytes: match n.max_bytes {
            0 => -1,
            b => i64::try_from(b).unwrap_or(i64::MAX),
        },
        num_replicas: n.stream_replicas,
        allow_atomic_publish: n.atomic_transactions,
        // Parked copies and release markers carry `Nats-TTL: never` (`allow_ttl`).
        allow_message_ttl: settings.park_on_invalid,
        metadata: HashMap::from([
            (
                META_SLOT.to_owned(),
                settings.config().postgres.slot.clone(),
            ),
            (
                META_TABLE.to_owned(),
                settings.config().outbox.table.clone(),
            ),
        ])
        .into_iter()
        .chain(
            Some(&settings.config().outbox.message_prefix)
                .filter(|p| !p.is_empty())
                .map(|p| (META_MESSAGE_PREFIX.to_owned(), p.clone())),
        )
        .chain(database.map(|d| (META_DATABASE.to_owned(), d.to_owned())))
        .collect(),
        ..Default::default()
    };
    let ours = cfg.subjects.clone();
    if let Err(e) = js.create_stream(cfg).await {
        // Subjects overlap with an existing stream; the server does not say which.
        if let jetstream::context::CreateStreamErrorKind::JetStream(je) = e.kind()
            && je.error_code() == jetstream::ErrorCode::STREAM_SUBJECT_OVERLAP
            && let Some((other, theirs)) = overlapping_stream(js, &ours).await
        {
            return Err(SetupError::Stream {
                name: n.stream.clone(),
                problem: format!(
                    "cannot be created: its subjects [{}] overlap with stream {other}'s [{}]; give this relay names \
                     of its own with name, or use that stream (nats.stream = \"{other}\") or other subjects \
                     (nats.subject, nats.dead_letter_subject)",
                    ours.join(", "),
                    theirs.join(", ")
                ),
            });
        }
        return Err(SetupError::Create {
            object: format!("JetStream stream {}", n.stream),
            source: Box::new(e),
        });
    }
    Ok(format!(
        "stream {}: created ({})",
        n.stream,
        described(settings)
    ))
}

/// How events are published, one sentence per mode (`nats.atomic_transactions`), so that setup's
/// output tells the two apart (docs/configuration.md, "Single publishes or atomic transactions").
pub(super) fn publishing(settings: &Settings) -> String {
    if settings.config().nats.atomic_transactions {
        "publishing: atomic transactions (nats.atomic_transactions = true): each Postgres transaction is \
         stored whole or not at all as one JetStream atomic batch, its event ids in Outbox-Event-Id (no \
         duplicate window applies), at a few milliseconds more per lone transaction"
            .to_owned()
    } else {
        "publishing: single publishes (nats.atomic_transactions = false, the default): each event is its \
         own JetStream message, deduplicated by Nats-Msg-Id within the duplicate window, and a consumer may \
         see a transaction's first events before its last are stored"
            .to_owned()
    }
}

/// What a stream that setup creates is like: `file storage, subjects …, duplicate window …`.
pub(super) fn described(settings: &Settings) -> String {
    let n = &settings.config().nats;
    format!(
        "file storage, subjects {}, {}, {}, duplicate window {}s, {}, {}, replicas {}{}",
        settings.subject.wildcard(),
        n.dead_letter_subject,
        crate::parking::parked_filter(&n.dead_letter_subject),
        n.duplicate_window_secs,
        match n.max_age_secs {
            0 => "messages kept forever".to_owned(),
            s => format!("messages kept {s}s"),
        },
        match n.max_bytes {
            0 => "no size limit".to_owned(),
            b => format!("at most {b} bytes, then new events wait"),
        },
        n.stream_replicas,
        if n.atomic_transactions {
            ", atomic publish allowed"
        } else {
            ""
        }
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use async_nats::HeaderMap;

    #[test]
    fn setup_tells_the_two_publishing_modes_apart_in_one_sentence_each() {
        let mut c = crate::config::Config::default();
        let single = publishing(&c.clone().validate().unwrap());
        c.nats.atomic_transactions = true;
        let atomic = publishing(&c.validate().unwrap());
        assert!(
            single.starts_with("publishing: single publishes"),
            "{single}"
        );
        assert!(
            atomic.starts_with("publishing: atomic transactions"),
            "{atomic}"
        );
        for line in [&single, &atomic] {
            assert!(
                !line.contains(". ") && !line.contains('\n'),
                "one sentence: {line}"
            );
        }
    }

    #[test]
    fn the_commit_lsn_comes_from_its_header_or_else_from_the_position() {
        let mut h = HeaderMap::new();
        assert_eq!(commit_lsn_of(&h), None, "not a relay's message");
        h.insert(
            message::POSITION,
            "7441234567890123456/1/outbox_relay/1/A0:3",
        );
        assert_eq!(commit_lsn_of(&h).as_deref(), Some("1/A0"));
        h.insert(message::COMMIT_LSN, "1/B0");
        assert_eq!(
            commit_lsn_of(&h).as_deref(),
            Some("1/B0"),
            "the header wins"
        );
    }
}
