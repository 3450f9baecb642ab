'use strict';
// @dedupd/client (loaded with require) against the real sidecar.

const test = require('node:test');
const assert = require('node:assert/strict');
const crypto = require('node:crypto');
const fs = require('node:fs');
const path = require('node:path');
const { Client, DedupError, FingerprintMismatch, InProgress, LeaseLost, ResponseErased, Stale, Unavailable } = require('@dedupd/client');
const { TOKEN, freePort, securedSidecar, sleep, startSidecar, tempDir } = require('./sidecar.cjs');

test('process runs the handler once and replays its result', async (t) => {
  const sidecar = await startSidecar(t, tempDir(t), '127.0.0.1:0');
  const dedup = new Client({ address: sidecar.address, namespace: 'payments', owner: 'node-test' });
  t.after(() => dedup.close());
  const calls = [];
  const handler = async (claim) => { calls.push(claim); return `transfer for ${claim.correlationId}`; };
  const first = await dedup.process('pay-1', handler, { eventType: 'PaymentReceived' });
  const again = await dedup.process('pay-1', handler, { eventType: 'PaymentReceived' });
  assert.equal(first.toString(), 'transfer for pay-1');
  assert.deepEqual(again, first);
  assert.equal(calls.length, 1);
  assert.equal(calls[0].attempt, 1);
  assert.equal(typeof calls[0].fencingToken, 'bigint');
  const record = await dedup.lookup('pay-1');
  assert.equal(record.state, 'COMMITTED');
  assert.equal(record.owner, 'node-test');
  assert.ok(record.committedAt instanceof Date);
});

test('an empty namespace is the sidecar\'s default, read from its answer', async (t) => {
  const sidecar = await startSidecar(t, tempDir(t), '127.0.0.1:0');
  const dedup = new Client({ address: sidecar.address });
  t.after(() => dedup.close());
  const claim = await dedup.claimOnce('no-namespace');
  assert.equal(claim.namespace, 'default');
  await dedup.commit(claim, 'ok');
  assert.equal((await dedup.lookup('no-namespace')).response.toString(), 'ok');
});

test('64-bit sequences keep every bit (bigint, not a JS number)', async (t) => {
  const sidecar = await startSidecar(t, tempDir(t), '127.0.0.1:0');
  const dedup = new Client({ address: sidecar.address });
  t.after(() => dedup.close());
  const high = 2n ** 60n + 1n; // 2^60 + 1 is not a JS number
  await dedup.process('seq-high', () => 'ok', { orderingKey: 'acct', sequence: high });
  await assert.rejects(dedup.process('seq-lower', () => 'never', { orderingKey: 'acct', sequence: 2n ** 60n }),
    (error) => error instanceof Stale && error.highestCommittedSequence === high);
  assert.equal((await dedup.lookup('seq-high')).sequence, high);
});

test('a failing handler releases, and its error is what the caller sees', async (t) => {
  const sidecar = await startSidecar(t, tempDir(t), '127.0.0.1:0');
  const dedup = new Client({ address: sidecar.address });
  t.after(() => dedup.close());
  await assert.rejects(dedup.process('pay-2', async () => { throw new Error('downstream unavailable'); }),
    /downstream unavailable/);
  const seen = [];
  assert.equal((await dedup.process('pay-2', (claim) => { seen.push(claim); return 'ok'; })).toString(), 'ok');
  assert.equal(seen[0].attempt, 2, 'the release kept the attempt count');
  assert.equal(seen[0].recovered, false);
});

test('a failing release never replaces the handler\'s error', async (t) => {
  const sidecar = await startSidecar(t, tempDir(t), '127.0.0.1:0');
  const dedup = new Client({ address: sidecar.address, retry: { attempts: 2, firstDelayMs: 10 } });
  t.after(() => dedup.close());
  await assert.rejects(dedup.process('pay-3', async () => {
    await sidecar.stop();
    throw new Error('the business write failed');
  }), (error) => error.message === 'the business write failed' && error.releaseError instanceof Unavailable);
});

test('the lease is renewed while a long handler runs, and its signal stays quiet', async (t) => {
  const sidecar = await startSidecar(t, tempDir(t), '127.0.0.1:0');
  const dedup = new Client({ address: sidecar.address, leaseMs: 600 });
  const other = new Client({ address: sidecar.address });
  t.after(() => { dedup.close(); other.close(); });
  let refused = 0;
  const result = await dedup.process('long-1', async (claim, signal) => {
    for (let i = 0; i < 5; i += 1) {
      await sleep(400); // 2 s in all: more than three leases
      await assert.rejects(other.claimOnce('long-1'), InProgress);
      refused += 1;
    }
    assert.equal(signal.aborted, false);
    return 'finished';
  });
  assert.equal(result.toString(), 'finished');
  assert.equal(refused, 5);
});

test('one timer renews every long handler of a client, and an idle client holds none', async (t) => {
  const sidecar = await startSidecar(t, tempDir(t), '127.0.0.1:0');
  const dedup = new Client({ address: sidecar.address, leaseMs: 900 });
  const other = new Client({ address: sidecar.address });
  t.after(() => { dedup.close(); other.close(); });
  // The client's own timers (not grpc-js's deadlines): those set from its
  // dist/ files, alive until they fire or are cleared.
  const ours = new Set();
  const real = { setTimeout, setInterval, clearTimeout, clearInterval };
  const fromClient = () => /[\\/]dist[\\/](renewal|client)\.js/.test(new Error().stack);
  const track = (set, repeats) => (callback, ms, ...rest) => {
    const handle = set((...a) => { if (!repeats) ours.delete(handle); callback(...a); }, ms, ...rest);
    if (fromClient()) ours.add(handle);
    return handle;
  };
  const untrack = (clear) => (handle) => { ours.delete(handle); clear(handle); };
  global.setTimeout = track(real.setTimeout, false);
  global.setInterval = track(real.setInterval, true);
  global.clearTimeout = untrack(real.clearTimeout);
  global.clearInterval = untrack(real.clearInterval);
  t.after(() => Object.assign(global, real));
  const timers = () => [...ours].filter((handle) => handle.hasRef()).length;
  // Eight handlers wait on a promise only the test resolves (no timer of
  // their own), for more than three leases (3 s against 0.9 s).
  let finish;
  const finished = new Promise((resolve) => { finish = resolve; });
  const signals = [];
  const running = Array.from({ length: 8 }, (_, i) => dedup.process(`many-${i}`, async (claim, signal) => {
    signals.push(signal);
    await finished;
    return `done-${i}`;
  }));
  while (signals.length < 8) await new Promise((resolve) => setImmediate(resolve));
  const deadline = Date.now() + 3000;
  let most = 0;
  while (Date.now() < deadline) {
    most = Math.max(most, timers());
    await sleep(5); // the test file's timer, not the client's: not counted
  }
  for (let i = 0; i < 8; i += 1) await assert.rejects(other.claimOnce(`many-${i}`), InProgress, `many-${i} is held`);
  finish();
  const results = await Promise.all(running);
  assert.deepEqual(results.map(String), Array.from({ length: 8 }, (_, i) => `done-${i}`));
  assert.ok(signals.every((signal) => !signal.aborted));
  assert.equal(most, 1, 'one renewal timer for eight handlers');
  assert.equal(timers(), 0, 'no timer holds the process once no handler runs');
});

test('a lost lease aborts the handler\'s signal and refuses the commit', async (t) => {
  const sidecar = await startSidecar(t, tempDir(t), '127.0.0.1:0');
  const dedup = new Client({ address: sidecar.address, leaseMs: 300 });
  const other = new Client({ address: sidecar.address });
  t.after(() => { dedup.close(); other.close(); });
  let aborted;
  await assert.rejects(dedup.process('lost-1', async (claim, signal) => {
    // Someone takes the record away (an operator's Forget) while we work.
    await new Promise((resolve, reject) => other['client'].Forget(
      { namespace: claim.namespace, correlation_id: claim.correlationId }, (e) => (e ? reject(e) : resolve())));
    await new Promise((resolve) => signal.addEventListener('abort', resolve, { once: true }));
    aborted = signal.reason;
    return 'too late';
  }), LeaseLost);
  assert.ok(aborted instanceof LeaseLost, String(aborted));
});

test('an answer whose sealing key was destroyed is a duplicate with responseErased; process rejects', async (t) => {
  const dir = tempDir(t);
  const key = (name, hex) => { const file = path.join(dir, name); fs.writeFileSync(file, hex.repeat(32)); return file; };
  const first = await startSidecar(t, dir, '127.0.0.1:0', '--encryption-key-file', key('a.key', 'aa'));
  const sealing = new Client({ address: first.address });
  assert.equal((await sealing.process('erased-1', () => 'card 4242')).toString(), 'card 4242');
  sealing.close();
  await first.stop();
  // Key a removed but not declared destroyed: the sidecar refuses to start
  // (exit 64, naming it; tests/binary.rs), never empty answers.
  const keyA = crypto.createHash('sha256').update(Buffer.concat([Buffer.from('dedupd sealing key id v1\0'), Buffer.alloc(32, 0xaa)])).digest().subarray(0, 8).toString('hex');
  // Key a destroyed, and declared so (its ID as the sidecar derives it).
  const second = await startSidecar(t, dir, '127.0.0.1:0', '--encryption-key-file', key('b.key', 'bb'), '--erased-key-id', keyA);
  const dedup = new Client({ address: second.address });
  t.after(() => dedup.close());
  const claim = await dedup.claimOnce('erased-1');
  assert.equal(claim.duplicate, true, 'processed once, never again');
  assert.equal(claim.responseErased, true);
  assert.equal(claim.cachedResponse.length, 0);
  const record = await dedup.lookup('erased-1');
  assert.equal(record.responseErased, true);
  let called = false;
  await assert.rejects(dedup.process('erased-1', () => { called = true; }),
    (error) => error instanceof ResponseErased && error.correlationId === 'erased-1');
  assert.equal(called, false);
});

test('stale and fingerprint mismatch are errors of their own', async (t) => {
  const sidecar = await startSidecar(t, tempDir(t), '127.0.0.1:0');
  const dedup = new Client({ address: sidecar.address, namespace: 'orders' });
  t.after(() => dedup.close());
  await dedup.process('evt-9', () => '', { payloadFingerprint: 'sha256:aaa' });
  await assert.rejects(dedup.process('evt-9', () => '', { payloadFingerprint: 'sha256:bbb' }),
    (error) => error instanceof FingerprintMismatch && error instanceof DedupError && error.existingFingerprint === 'sha256:aaa');
});

test('batches claim, commit and release a poll in one call each', async (t) => {
  const sidecar = await startSidecar(t, tempDir(t), '127.0.0.1:0');
  const dedup = new Client({ address: sidecar.address, namespace: 'kafka' });
  t.after(() => dedup.close());
  await dedup.process('m-2', () => 'earlier');
  const claims = await dedup.claimMany(['m-1', 'm-2', 'm-3']);
  assert.deepEqual(claims.map((c) => c.duplicate), [false, true, false]);
  assert.equal(claims[1].cachedResponse.toString(), 'earlier');
  const records = await dedup.commitMany([[claims[0], 'one'], [claims[2], 'three']]);
  assert.deepEqual(records.map((r) => r.response.toString()), ['one', 'three']);
  const again = await dedup.claimMany(['m-1', 'm-4']);
  assert.deepEqual(again.map((c) => c.duplicate), [true, false]);
  await dedup.releaseMany([again[1]]);
  assert.equal((await dedup.lookup('m-4')).state, 'RELEASED');
});

test('a Unix socket address', async (t) => {
  const dir = tempDir(t);
  const sidecar = await startSidecar(t, dir, `unix://${path.join(dir, 'dedupd.sock')}`);
  assert.match(sidecar.address, /^unix:\/\//);
  const dedup = new Client({ address: sidecar.address });
  t.after(() => dedup.close());
  assert.equal((await dedup.process('over-a-socket', () => 'ok')).toString(), 'ok');
});

test('DEDUPD_ADDR is honoured', async (t) => {
  const sidecar = await startSidecar(t, tempDir(t), '127.0.0.1:0');
  process.env.DEDUPD_ADDR = `http://${sidecar.address}`;
  t.after(() => { delete process.env.DEDUPD_ADDR; });
  const dedup = new Client();
  t.after(() => dedup.close());
  assert.equal((await dedup.process('from-env', () => 'ok')).toString(), 'ok');
});

test('TLS with a client certificate and a token', async (t) => {
  const { sidecar, certs } = await securedSidecar(t, tempDir(t));
  const tls = { caFile: certs.ca, certFile: certs.clientCert, keyFile: certs.clientKey };
  const dedup = new Client({ address: sidecar.address, tls, token: TOKEN });
  const anonymous = new Client({ address: sidecar.address, tls });
  t.after(() => { dedup.close(); anonymous.close(); });
  assert.equal((await dedup.process('secure-1', () => 'ok')).toString(), 'ok');
  await assert.rejects(anonymous.claimOnce('secure-2'),
    (error) => error instanceof DedupError && error.code === 16 /* UNAUTHENTICATED */);
});

test('TLS settings and the token from the environment', async (t) => {
  const { sidecar, certs } = await securedSidecar(t, tempDir(t));
  Object.assign(process.env, {
    DEDUPD_ADDR: `https://${sidecar.address}`, DEDUPD_TLS_CA: certs.ca,
    DEDUPD_TLS_CLIENT_CERT: certs.clientCert, DEDUPD_TLS_CLIENT_KEY: certs.clientKey, DEDUPD_TOKEN: TOKEN,
  });
  t.after(() => {
    for (const name of ['DEDUPD_ADDR', 'DEDUPD_TLS_CA', 'DEDUPD_TLS_CLIENT_CERT', 'DEDUPD_TLS_CLIENT_KEY', 'DEDUPD_TOKEN']) {
      delete process.env[name];
    }
  });
  const dedup = new Client();
  t.after(() => dedup.close());
  assert.equal((await dedup.process('secure-env', () => 'ok')).toString(), 'ok');
});

test('Unavailable after the retries says when to come back', async (t) => {
  const dedup = new Client({ address: `127.0.0.1:${await freePort()}`, timeoutMs: 2000,
    retry: { attempts: 3, firstDelayMs: 10, maxDelayMs: 500 } });
  t.after(() => dedup.close());
  await assert.rejects(dedup.claimOnce('nobody-home'),
    (error) => error instanceof Unavailable && error.code === 14 && error.retryAfterMs === 500);
});

test('each retry waits at least half its delay (equal jitter)', () => {
  // The compiled module beside the package's entry point (the exports map
  // keeps it out of the public API).
  const { backoff } = require(path.join(path.dirname(require.resolve('@dedupd/client')), 'connection.js'));
  const retry = { attempts: 8, firstDelayMs: 100, maxDelayMs: 1000 };
  for (let attempt = 0; attempt < 7; attempt += 1) {
    const delay = Math.min(1000, 100 * 2 ** attempt);
    const waits = Array.from({ length: 1000 }, () => backoff(retry, attempt));
    assert.ok(Math.min(...waits) >= delay / 2, `attempt ${attempt}: ${Math.min(...waits)} < ${delay / 2}`);
    assert.ok(Math.max(...waits) <= delay, `attempt ${attempt}: ${Math.max(...waits)} > ${delay}`);
  }
});

test('a call rides out a sidecar restart', async (t) => {
  const dir = tempDir(t);
  const listen = `127.0.0.1:${await freePort()}`;
  const first = await startSidecar(t, dir, listen);
  // Nine waits of at least 50, 100, 200, 400 and 500 ms × 5: 3.25 s at
  // least, for a restart 0.5 s away plus a debug build's start-up on a
  // loaded machine and the channel's own reconnect backoff.
  const dedup = new Client({ address: listen, retry: { attempts: 10, firstDelayMs: 100, maxDelayMs: 1000 } });
  t.after(() => dedup.close());
  assert.equal((await dedup.process('before', () => '1')).toString(), '1');
  await first.stop();
  setTimeout(() => startSidecar(t, dir, listen), 500);
  assert.equal((await dedup.process('before', () => 'again')).toString(), '1', 'the record survived');
});
