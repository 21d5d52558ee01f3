//! `OUTBOX_RELAY_TEST_READ_PAGE` reaches the binary these tests run: the variable is compiled only
//! with the feature `test-support` (a release binary reads no such input), so a test that sets it
//! (`rebuild.rs`, which reads the parked set through many small pages) means something only if
//! the binary cargo builds for the tests has that feature. It says so when it uses the page: a
//! build without the feature fails here instead of leaving `rebuild.rs` to read one page and pass.

use super::{LIMIT, STRICT, approve, run_paged, stored, world};
use crate::support::wait_for;

#[tokio::test]
async fn the_tests_binary_reads_the_test_read_page() {
    let s = world(STRICT).await;
    let mut relay = run_paged(&s);
    s.wait_slot_made().await;
    approve(&s.client, "4711", r#"{"claim": "x"}"#).await;
    stored(&s.nats, &s.config, 1).await;
    relay.signal("TERM");
    assert!(relay.wait(LIMIT).is_some(), "stopped");
    // Started again, it reads the parked key back from the stream, through the test's page.
    let mut relay = run_paged(&s);
    let said = "stream reads take 8 messages per consumer (a test build)";
    wait_for("the binary to use the test read page", LIMIT, || async {
        relay.stderr().contains(said)
    })
    .await;
    relay.signal("TERM");
    assert!(relay.wait(LIMIT).is_some(), "stopped");
}
