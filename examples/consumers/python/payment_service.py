"""The payment service of docs/consumer-dedup.md in Python: pays each approved claim once.

A durable JetStream pull consumer on the relay's stream, filtered to `outbox.Claim`. For each
message, in one Postgres transaction: record its event id (`Nats-Msg-Id`, or `Outbox-Event-Id` on
an atomic batch) in the inbox table `processed_events`; only if that inserted a row, pay. Commit,
then acknowledge. A redelivered event finds its id recorded and is acknowledged without paying
again; a restart resumes after the last acknowledged message, because the consumer is durable.

    pip install -r requirements.txt      # nats-py and psycopg, pinned
    python3 payment_service.py --postgres postgres://payments@127.0.0.1:5432/payments \
        --nats nats://127.0.0.1:4222

`--until-caught-up` exits 0 once the consumer has nothing left to deliver or to acknowledge
(scripts and tests); without it the service runs until interrupted.
"""

import argparse
import asyncio
import json
import sys
from decimal import Decimal
from pathlib import Path

import nats
import psycopg
from nats.errors import TimeoutError as NothingToFetch
from nats.js.api import AckPolicy, ConsumerConfig

# The inbox table and the payments (docs/consumer-dedup.md), shared with the Node.js recipe.
SCHEMA = (Path(__file__).resolve().parent.parent / "schema.sql").read_text()


class Unreadable(Exception):
    """A payload no retry can fix: it is parked (`term`), not redelivered."""


def claim_of(payload: bytes) -> tuple[int, Decimal]:
    """The claim id and the amount of a ClaimApproved payload, the amount with its exact digits."""
    try:
        claim = json.loads(payload, parse_float=Decimal)
        claim_id, amount = claim["claim_id"], claim["amount"]
    except (ValueError, TypeError, KeyError) as e:
        raise Unreadable(f"not a ClaimApproved payload: {e}") from e
    if type(claim_id) is not int or type(amount) not in (int, Decimal):
        raise Unreadable("claim_id must be an integer and amount a number")
    return claim_id, Decimal(amount)


async def handle(db: psycopg.AsyncConnection, msg) -> str:
    """Processes one message; returns what happened, for the log."""
    headers = msg.headers or {}
    # Outbox-Event-Id on atomic batches, which cannot carry Nats-Msg-Id.
    event_id = headers.get("Nats-Msg-Id") or headers.get("Outbox-Event-Id")
    if event_id is None or headers.get("Outbox-Event-Type") != "ClaimApproved":
        # Not an event this service acts on: acknowledge it so it is not redelivered.
        await msg.ack_sync()
        return f"ignored a message without a ClaimApproved event id ({event_id})"
    try:
        async with db.transaction():
            # Claim the id first: a concurrent redelivery waits here until this transaction ends.
            cur = await db.execute(
                "INSERT INTO processed_events (event_id) VALUES (%s) ON CONFLICT DO NOTHING",
                (event_id,),
            )
            paid = cur.rowcount == 1
            if paid:
                claim_id, amount = claim_of(msg.data)  # raising rolls the id back too
                await db.execute(
                    "INSERT INTO payments (claim_id, amount, event_id) VALUES (%s, %s, %s)",
                    (claim_id, amount, event_id),
                )
            # Otherwise processed before (a redelivery): nothing to do but ack.
    except Unreadable as e:
        # Redelivery will not make it readable: park it, and record it somewhere you look.
        await msg.term()
        return f"parked event {event_id}: {e}"
    # Ack only after the commit. A crash before this line means a redelivery, which the inbox skips.
    await msg.ack_sync()
    if paid:
        return f"paid claim {claim_id} for event {event_id}"
    return f"event {event_id} processed before: acknowledged, not paid again"


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--postgres", required=True, help="the service's own database")
    parser.add_argument("--nats", default="nats://127.0.0.1:4222")
    parser.add_argument("--stream", default="OUTBOX")
    parser.add_argument("--subject", default="outbox.Claim")
    parser.add_argument("--durable", default="payment", help="the durable consumer's name")
    parser.add_argument("--until-caught-up", action="store_true",
                        help="exit once nothing is left to deliver or acknowledge")
    args = parser.parse_args()

    # Autocommit: each `db.transaction()` block is one BEGIN ... COMMIT.
    db = await psycopg.AsyncConnection.connect(args.postgres, autocommit=True)
    await db.execute(SCHEMA)
    nc = await nats.connect(args.nats)
    try:
        js = nc.jetstream()
        # A durable consumer: the server remembers what this service acknowledged, across restarts.
        sub = await js.pull_subscribe(
            args.subject,
            durable=args.durable,
            stream=args.stream,
            config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT),
        )
        while True:
            try:
                # One message at a time keeps the stream's order (a batch would too, in sequence).
                messages = await sub.fetch(batch=1, timeout=5)
            except NothingToFetch:
                messages = []
            for msg in messages:
                print(await handle(db, msg), flush=True)
            if args.until_caught_up:
                info = await sub.consumer_info()
                if info.num_pending == 0 and info.num_ack_pending == 0:
                    return 0
    finally:
        await nc.close()
        await db.close()


if __name__ == "__main__":
    try:
        sys.exit(asyncio.run(main()))
    except KeyboardInterrupt:
        sys.exit(130)
