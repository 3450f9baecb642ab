'use strict';
// A RabbitMQ consumer loop with dedupd (amqplib): at-least-once delivery in,
// effectively-once processing out.
//
//   DEDUPD_ADDR=127.0.0.1:50051 node amqp-consumer.js QUEUE
//
// Each message carries the producer's correlation ID in its correlationId
// property (never the broker's delivery tag: a redelivery gets a new one).

const amqp = require('amqplib');
const { Client, FingerprintMismatch, InProgress, Stale, Unavailable } = require('@dedupd/client');

/** Consumes `queue` on `channel`, calling `handle(claim, content, signal)`
 * at most once per correlation ID; resolves after `maxMessages` were
 * acknowledged (duplicates included). */
function consume(channel, queue, dedup, handle, maxMessages = Infinity) {
  return new Promise((resolve, reject) => {
    let acknowledged = 0;
    channel.prefetch(16);
    channel.consume(queue, async (message) => {
      if (message === null) return; // the queue was deleted
      const { correlationId, type } = message.properties;
      if (!correlationId) {
        channel.reject(message, false); // nothing to deduplicate on: dead-letter it
        return;
      }
      try {
        await dedup.process(correlationId, (claim, signal) => handle(claim, message.content, signal),
          { eventType: type || '' });
        channel.ack(message); // processed now, or a duplicate of one processed before
      } catch (error) {
        if (error instanceof InProgress || error instanceof Unavailable) {
          channel.nack(message, false, true); // someone else is on it, or the sidecar is away
          return;
        }
        if (error instanceof Stale || error instanceof FingerprintMismatch) {
          channel.ack(message); // older than what was applied / an ID reused: skip (alert on the second)
          return;
        }
        channel.nack(message, false, true); // the handler failed: the claim was released, retry
        reject(error);
        return;
      }
      acknowledged += 1;
      if (acknowledged >= maxMessages) resolve(acknowledged);
    }).catch(reject);
  });
}

module.exports = { consume };

if (require.main === module) {
  (async () => {
    const connection = await amqp.connect('amqp://127.0.0.1:5672');
    const channel = await connection.createChannel();
    const dedup = new Client({ namespace: 'orders' });
    await consume(channel, process.argv[2], dedup, (claim, content) => console.log(content.toString()));
  })().catch((error) => { console.error(error); process.exit(1); });
}
