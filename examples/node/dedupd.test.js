'use strict';
// Tests of the Node.js helper against the real dedupd binary:
//   cargo build && (cd examples/node && npm ci && npm test)
// DEDUPD_BIN overrides the binary (default: target/debug/dedupd).

const test = require('node:test');
const assert = require('node:assert/strict');
const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');
const { spawn } = require('node:child_process');
const { Dedup, InProgress, Stale } = require('./dedupd');

const BINARY = process.env.DEDUPD_BIN || path.resolve(__dirname, '..', '..', 'target', 'debug', 'dedupd');
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

async function startSidecar(t) {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'dedupd-node-'));
  const readyFile = path.join(dir, 'ready.json');
  const child = spawn(BINARY, ['--listen', '127.0.0.1:0', '--metrics-listen', 'off',
    '--log-format', 'json', '--data-dir', path.join(dir, 'data'), '--ready-file', readyFile],
  { stdio: ['ignore', 'ignore', 'ignore'] });
  let exitCode = null;
  child.on('exit', (code) => { exitCode = code; });
  // dedupd writes the ready file (whole, by rename) once it serves; it
  // names the port it bound.
  const deadline = Date.now() + 20000;
  while (!fs.existsSync(readyFile)) {
    if (exitCode !== null) throw new Error(`dedupd exited with ${exitCode}`);
    if (Date.now() > deadline) throw new Error('dedupd was not ready within 20 s');
    await sleep(10);
  }
  const address = JSON.parse(fs.readFileSync(readyFile, 'utf8')).grpc[0];
  t.after(async () => {
    const exited = exitCode !== null ? Promise.resolve(exitCode)
      : new Promise((resolve) => child.on('exit', resolve));
    child.kill('SIGTERM');
    assert.equal(await exited, 0, 'dedupd exits 0 on SIGTERM');
    assert.ok(!fs.existsSync(readyFile), 'dedupd removes its ready file on exit');
    fs.rmSync(dir, { recursive: true, force: true });
  });
  return address;
}

test('process runs the handler once and replays its result', async (t) => {
  const address = await startSidecar(t);
  const dedup = new Dedup({ address, namespace: 'payments' });
  t.after(() => dedup.close());
  let calls = 0;
  const handler = async (claim) => {
    calls += 1;
    assert.equal(claim.attempt, 1);
    return `transfer for ${claim.correlationId}`;
  };
  const first = await dedup.process('pay-1', handler, { event_type: 'PaymentReceived' });
  const again = await dedup.process('pay-1', handler, { event_type: 'PaymentReceived' });
  assert.equal(first.toString(), 'transfer for pay-1');
  assert.equal(again.toString(), 'transfer for pay-1');
  assert.equal(calls, 1);
});

test('a throwing handler releases the claim so a redelivery retries', async (t) => {
  const address = await startSidecar(t);
  const dedup = new Dedup({ address });
  t.after(() => dedup.close());
  await assert.rejects(dedup.process('pay-2', async () => { throw new Error('downstream down'); }),
    /downstream down/);
  let attempt;
  const result = await dedup.process('pay-2', async (claim) => { attempt = claim.attempt; return 'ok'; });
  assert.equal(result.toString(), 'ok');
  assert.equal(attempt, 2);
});

test('the lease is renewed while a long handler runs', async (t) => {
  const address = await startSidecar(t);
  const dedup = new Dedup({ address, leaseMs: 600 });
  const other = new Dedup({ address, leaseMs: 600 });
  t.after(() => { dedup.close(); other.close(); });
  let refusals = 0;
  const result = await dedup.process('long-1', async () => {
    for (let i = 0; i < 6; i += 1) { // three lease lengths
      await sleep(300);
      await assert.rejects(other.process('long-1', async () => 'stolen'), InProgress);
      refusals += 1;
    }
    return 'finished';
  });
  assert.equal(result.toString(), 'finished');
  assert.equal(refusals, 6);
});

test('a late lower sequence is stale', async (t) => {
  const address = await startSidecar(t);
  const dedup = new Dedup({ address, namespace: 'statuses' });
  t.after(() => dedup.close());
  await dedup.process('status-failed', async () => 'failed', { ordering_key: 'link-9', sequence: 2 });
  await assert.rejects(
    dedup.process('status-degraded', async () => 'degraded', { ordering_key: 'link-9', sequence: 1 }),
    (error) => error instanceof Stale && error.highestCommittedSequence === 2,
  );
});
