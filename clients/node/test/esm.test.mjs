// @dedupd/client loaded as an ES module: the same classes as require().
import test from 'node:test';
import assert from 'node:assert/strict';
import { createRequire } from 'node:module';
import dedupdDefault, { Client, InProgress } from '@dedupd/client';
import sidecarHelpers from './sidecar.cjs';

const require = createRequire(import.meta.url);
const { startSidecar, tempDir } = sidecarHelpers;

test('import and require give the same classes', () => {
  assert.equal(Client, require('@dedupd/client').Client);
  assert.equal(dedupdDefault.InProgress, InProgress);
});

test('the ES module exports every name the CommonJS build does', async () => {
  const esm = await import('@dedupd/client');
  const names = Object.keys(require('@dedupd/client')).filter((name) => name !== '__esModule');
  for (const name of names) {
    assert.equal(esm[name], require('@dedupd/client')[name], `${name} missing from esm/index.mjs`);
  }
});

test('an ES module consumer deduplicates', async (t) => {
  const sidecar = await startSidecar(t, tempDir(t), '127.0.0.1:0');
  const dedup = new Client({ address: sidecar.address });
  t.after(() => dedup.close());
  let runs = 0;
  const handler = () => { runs += 1; return 'esm'; };
  const results = await Promise.allSettled(Array.from({ length: 8 }, () => dedup.process('esm-1', handler)));
  assert.equal(runs, 1);
  assert.equal(results.filter((r) => r.status === 'fulfilled').length, 1);
  assert.ok(results.every((r) => r.status === 'fulfilled' || r.reason instanceof InProgress));
});
