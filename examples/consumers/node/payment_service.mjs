// The payment service of docs/consumer-dedup.md in Node.js: pays each approved claim once.
//
// A durable JetStream pull consumer on the relay's stream, filtered to `outbox.Claim`. For each
// message, in one Postgres transaction: record its event id (`Nats-Msg-Id`, or `Outbox-Event-Id` on
// an atomic batch) in the inbox table `processed_events`; only if that inserted a row, pay. Commit,
// then acknowledge. A redelivered event finds its id recorded and is acknowledged without paying
// again; a restart resumes after the last acknowledged message, because the consumer is durable.
//
//   npm ci                                # @nats-io/jetstream, @nats-io/transport-node, pg (pinned)
//   node payment_service.mjs --postgres postgres://payments@127.0.0.1:5432/payments \
//       --nats nats://127.0.0.1:4222
//
// `--until-caught-up` exits 0 once the consumer has nothing left to deliver or to acknowledge
// (scripts and tests); without it the service runs until interrupted.

import { readFileSync } from "node:fs";
import { parseArgs } from "node:util";

import { AckPolicy, JetStreamApiCodes, JetStreamApiError, jetstream, jetstreamManager } from "@nats-io/jetstream";
import { connect } from "@nats-io/transport-node";
import pg from "pg";

// The inbox table and the payments (docs/consumer-dedup.md), shared with the Python recipe.
const SCHEMA = readFileSync(new URL("../schema.sql", import.meta.url), "utf8");

// The amount goes from the payload to `numeric` inside Postgres: JSON.parse would turn 1250.00 into
// a float; jsonb keeps its exact digits.
const PAY = `
INSERT INTO payments (claim_id, amount, event_id)
SELECT (claim->>'claim_id')::bigint, (claim->>'amount')::numeric, $2
FROM (SELECT $1::jsonb AS claim) AS approved`;

/** A payload no retry can fix: it is parked (`term`), not redelivered. */
class Unreadable extends Error {}

/** Checks that `text` is a ClaimApproved payload: an integer claim_id and a numeric amount. */
function checkClaim(text) {
  let claim;
  try {
    claim = JSON.parse(text);
  } catch (e) {
    throw new Unreadable(`not a ClaimApproved payload: ${e.message}`);
  }
  if (!Number.isInteger(claim?.claim_id) || typeof claim?.amount !== "number") {
    throw new Unreadable("claim_id must be an integer and amount a number");
  }
  return claim.claim_id;
}

/** Processes one message; returns what happened, for the log. */
async function handle(db, msg) {
  // Outbox-Event-Id on atomic batches, which cannot carry Nats-Msg-Id.
  const eventId = msg.headers?.get("Nats-Msg-Id") || msg.headers?.get("Outbox-Event-Id") || null;
  if (eventId === null || msg.headers.get("Outbox-Event-Type") !== "ClaimApproved") {
    // Not an event this service acts on: acknowledge it so it is not redelivered.
    await msg.ackAck();
    return `ignored a message without a ClaimApproved event id (${eventId})`;
  }
  let claimId = null;
  await db.query("BEGIN");
  try {
    // Claim the id first: a concurrent redelivery waits here until this transaction ends.
    const claimed = await db.query(
      "INSERT INTO processed_events (event_id) VALUES ($1) ON CONFLICT DO NOTHING",
      [eventId],
    );
    if (claimed.rowCount === 1) {
      const payload = msg.string();
      claimId = checkClaim(payload);
      await db.query(PAY, [payload, eventId]);
    }
    // Otherwise processed before (a redelivery): nothing to do but ack.
    await db.query("COMMIT");
  } catch (e) {
    await db.query("ROLLBACK");
    if (!(e instanceof Unreadable)) throw e; // no ack: redelivered after ack_wait, or on restart
    // Redelivery will not make it readable: park it, and record it somewhere you look.
    msg.term();
    return `parked event ${eventId}: ${e.message}`;
  }
  // Ack only after the commit. A crash before this line means a redelivery, which the inbox skips.
  await msg.ackAck();
  if (claimId !== null) return `paid claim ${claimId} for event ${eventId}`;
  return `event ${eventId} processed before: acknowledged, not paid again`;
}

/** The durable consumer, created on first start; the server keeps what it acknowledged. */
async function durableConsumer(nc, stream, durable, subject) {
  const jsm = await jetstreamManager(nc);
  try {
    await jsm.consumers.info(stream, durable);
  } catch (e) {
    if (!(e instanceof JetStreamApiError && e.code === JetStreamApiCodes.ConsumerNotFound)) throw e;
    await jsm.consumers.add(stream, {
      durable_name: durable,
      filter_subject: subject,
      ack_policy: AckPolicy.Explicit,
    });
  }
  return jetstream(nc).consumers.get(stream, durable);
}

async function main() {
  const { values: args } = parseArgs({
    options: {
      postgres: { type: "string" },
      nats: { type: "string", default: "nats://127.0.0.1:4222" },
      stream: { type: "string", default: "OUTBOX" },
      subject: { type: "string", default: "outbox.Claim" },
      durable: { type: "string", default: "payment" },
      "until-caught-up": { type: "boolean", default: false },
    },
  });
  if (!args.postgres) throw new Error("--postgres URL is required: the service's own database");

  const db = new pg.Client({ connectionString: args.postgres });
  await db.connect();
  await db.query(SCHEMA);
  const nc = await connect({ servers: args.nats });
  try {
    const consumer = await durableConsumer(nc, args.stream, args.durable, args.subject);
    for (;;) {
      // One message at a time keeps the stream's order.
      const messages = await consumer.fetch({ max_messages: 1, expires: 5000 });
      for await (const msg of messages) {
        console.log(await handle(db, msg));
      }
      if (args["until-caught-up"]) {
        const info = await consumer.info();
        if (info.num_pending === 0 && info.num_ack_pending === 0) return;
      }
    }
  } finally {
    await nc.close();
    await db.end();
  }
}

main().catch((e) => {
  console.error(`payment service: ${e.stack ?? e}`);
  process.exit(1);
});
