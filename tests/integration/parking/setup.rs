//! `setup` and the parking subjects: a stream made before parking existed (only the template's and
//! the dead-letter subject) gets `<dead_letter_subject>.parked.>` added when `on_invalid = "park"`;
//! `setup --check` says it would and changes nothing; likewise per-message TTL is allowed (parked
//! copies and release markers carry `Nats-TTL: never`).

use async_nats::jetstream::stream;
use outbox_relay::config::OnInvalid;

use super::{STRICT, world};

#[tokio::test]
async fn setup_adds_the_parking_subjects_to_an_older_stream_and_check_says_so() {
    let s = world(STRICT).await;
    let (js, config) = (s.js.clone(), &s.config);
    let dl = config.nats.dead_letter_subject.clone();
    js.create_stream(stream::Config {
        name: config.nats.stream.clone(),
        subjects: vec!["outbox.*".into(), dl.clone()],
        ..Default::default()
    })
    .await
    .expect("an older stream");
    let subjects = |js: async_nats::jetstream::Context, name: String| async move {
        let mut s = js.get_stream(&name).await.expect("stream");
        s.info().await.expect("info").config.subjects.clone()
    };
    // Without park mode nothing changes.
    let mut plain = config.clone();
    plain.outbox.on_invalid = OnInvalid::DeadLetter;
    let r = outbox_relay::setup::check(&plain.validate().unwrap())
        .await
        .expect("check");
    assert!(
        !r.lines.iter().any(|l| l.contains(".parked.>")),
        "{:?}",
        r.lines
    );
    let settings = config.validate().unwrap();
    let r = outbox_relay::setup::check(&settings).await.expect("check");
    let want = format!("would add subject {dl}.parked.>");
    assert!(r.lines.iter().any(|l| l.contains(&want)), "{:?}", r.lines);
    let ttl = "would allow per-message TTL";
    assert!(r.lines.iter().any(|l| l.contains(ttl)), "{:?}", r.lines);
    assert!(r.would_change >= 1);
    assert_eq!(
        subjects(js.clone(), config.nats.stream.clone()).await.len(),
        2,
        "--check changes nothing"
    );
    let r = outbox_relay::setup::setup(&settings).await.expect("setup");
    assert!(
        r.lines
            .iter()
            .any(|l| l.contains(&format!("subject {dl}.parked.> added"))),
        "{:?}",
        r.lines
    );
    assert!(
        subjects(js.clone(), config.nats.stream.clone())
            .await
            .contains(&format!("{dl}.parked.>"))
    );
    let mut stream = js.get_stream(&config.nats.stream).await.expect("stream");
    assert!(
        stream.info().await.expect("info").config.allow_message_ttl,
        "per-message TTL allowed: parked copies carry Nats-TTL: never"
    );
    // Once added, nothing more to do.
    let r = outbox_relay::setup::check(&settings).await.expect("check");
    assert!(!r.lines.iter().any(|l| l.contains(&want)), "{:?}", r.lines);
    assert!(!r.lines.iter().any(|l| l.contains(ttl)), "{:?}", r.lines);
}
