'use strict';
// The consumer-loop examples against the real sidecar (and, for RabbitMQ,
// the machine's broker on 127.0.0.1:5672).

const test = require('node:test');
const assert = require('node:assert/strict');
const { randomUUID } = require('node:crypto');
const amqp = require('amqplib');
const { Client } = require('@dedupd/client');
const { startSidecar, tempDir } = require('../../clients/node/test/sidecar.cjs');
const { consume } = require('./amqp-consumer');
const { processBatch } = require('./kafka-batches');

test('RabbitMQ redeliveries are handled once', async (t) => {
  const sidecar = await startSidecar(t, tempDir(t), '127.0.0.1:0');
  const dedup = new Client({ address: sidecar.address, namespace: 'orders' });
  const connection = await amqp.connect('amqp://127.0.0.1:5672');
  t.after(async () => { dedup.close(); await connection.close(); });
  const channel = await connection.createChannel();
  const queue = `dedupd-node-example-${randomUUID().slice(0, 8)}`;
  await channel.assertQueue(queue, { autoDelete: true });
  // Five deliveries of three events: the producer retried two of them.
  for (const id of ['order-1', 'order-2', 'order-1', 'order-3', 'order-2']) {
    channel.sendToQueue(queue, Buffer.from(`body of ${id}`), { correlationId: id, type: 'OrderPlaced' });
  }
  const handled = [];
  const acknowledged = await consume(channel, queue, dedup, (claim, content) => { handled.push(content.toString()); }, 5);
  assert.equal(acknowledged, 5, 'duplicates are acknowledged too');
  assert.deepEqual(handled.sort(), ['body of order-1', 'body of order-2', 'body of order-3']);
});

test('Kafka-shaped batches process each record once', async (t) => {
  const sidecar = await startSidecar(t, tempDir(t), '127.0.0.1:0');
  const dedup = new Client({ address: sidecar.address, namespace: 'kafka' });
  t.after(() => dedup.close());
  const handled = [];
  const handle = (claim, record) => {
    if (record.value === 'poison') throw new Error('cannot handle this one yet');
    handled.push(record.correlationId);
    return 'ok';
  };
  const first = await processBatch(dedup, [
    { correlationId: 'k-1', value: 'a' }, { correlationId: 'k-2', value: 'poison' }, { correlationId: 'k-3', value: 'c' }], handle);
  assert.deepEqual(first, { processed: ['k-1', 'k-3'], duplicates: [], retry: ['k-2'] });
  // The next poll overlaps the first (the offset was committed only up to k-1).
  const second = await processBatch(dedup, [
    { correlationId: 'k-2', value: 'b' }, { correlationId: 'k-3', value: 'c' }, { correlationId: 'k-4', value: 'd' }], handle);
  assert.deepEqual(second, { processed: ['k-2', 'k-4'], duplicates: ['k-3'], retry: [] });
  assert.deepEqual(handled, ['k-1', 'k-3', 'k-2', 'k-4']);
});
