// The consumer loop a Node team times before adopting dedupd: the same
// trivial handler, fresh IDs, run through
//
// - `powertools`: Powertools for TypeScript's `makeIdempotent` on its cache
//   (Redis) persistence layer, with @redis/client;
// - `dedupd`: `Client.process()` of @dedupd/client;
// - `raw`: @grpc/grpc-js making the same Claim and Commit by hand with the
//   same proto loading, nothing else: the floor `process()` adds its cost to.
//
// `concurrency` loops run at once in this one process (one event loop, as a
// Node consumer runs). Peers alternate within each round. Every event is
// checked: its answer came back. Prints one JSON line per peer and round,
// then a table of medians on stderr. Run by benches/clients/run.sh.
//
//   node loop.mjs --dedupd 127.0.0.1:PORT --redis-port PORT --events 2000 \
//       --concurrency 1 --rounds 3 --setting durable

import { randomUUID } from 'node:crypto';
import { createRequire } from 'node:module';
import * as path from 'node:path';
import { parseArgs } from 'node:util';

import { IdempotencyConfig, makeIdempotent } from '@aws-lambda-powertools/idempotency';
import { CachePersistenceLayer } from '@aws-lambda-powertools/idempotency/cache';
import { Client } from '@dedupd/client';
import { createClient } from '@redis/client';

// The same grpc-js and proto-loader the client uses: resolved from it.
const require = createRequire(import.meta.url);
const clientRequire = createRequire(require.resolve('@dedupd/client/package.json'));
const grpc = clientRequire('@grpc/grpc-js');
const protoLoader = clientRequire('@grpc/proto-loader');

const { values: args } = parseArgs({
  options: {
    dedupd: { type: 'string' },
    'redis-port': { type: 'string' },
    events: { type: 'string', default: '2000' },
    concurrency: { type: 'string', default: '1' },
    rounds: { type: 'string', default: '3' },
    setting: { type: 'string', default: 'durable' },
    peers: { type: 'string', default: 'powertools,dedupd,raw' },
  },
});
const events = Number(args.events);
const concurrency = Number(args.concurrency);
const rounds = Number(args.rounds);

async function powertoolsLoop() {
  const client = await createClient({ url: `redis://127.0.0.1:${args['redis-port']}` }).connect();
  const persistenceStore = new CachePersistenceLayer({ client });
  const config = new IdempotencyConfig({ eventKeyJmesPath: 'id' });
  // What Lambda would hand it (outside Lambda it warns on every call that
  // it cannot tell the time left, and a warning per event is not measured).
  config.registerLambdaContext({ getRemainingTimeInMillis: () => 300_000 });
  const handle = makeIdempotent(async (event) => ({ done: event.id }), { persistenceStore, config });
  return {
    one: async (id) => Buffer.from((await handle({ id })).done),
    close: () => client.quit(),
  };
}

async function dedupdLoop() {
  const client = new Client({ address: args.dedupd, namespace: 'bench' });
  return { one: (id) => client.process(id, () => id), close: () => client.close() };
}

async function rawLoop() {
  // The proto as the client package ships it, loaded the same way.
  const root = path.join(path.dirname(require.resolve('@dedupd/client/package.json')), 'proto');
  const definition = protoLoader.loadSync(path.join(root, 'dedup/v1/dedup.proto'), {
    includeDirs: [root], keepCase: true, longs: String, enums: String, defaults: true,
  });
  const Service = grpc.loadPackageDefinition(definition).dedup.v1.ClaimAndCommit;
  const stub = new Service(args.dedupd, grpc.credentials.createInsecure());
  const call = (method, request) => new Promise((resolve, reject) => {
    stub[method](request, { deadline: Date.now() + 10000 }, (error, answer) => (error ? reject(error) : resolve(answer)));
  });
  return {
    one: async (id) => {
      const claimed = await call('Claim', {
        namespace: 'bench', correlation_id: id, lease_ttl: { seconds: '30', nanos: 0 }, request_id: randomUUID(),
      });
      if (claimed.outcome !== 'CLAIM_OUTCOME_CLAIMED') throw new Error(`${id}: ${claimed.outcome}`);
      const committed = await call('Commit', {
        namespace: claimed.record.namespace, correlation_id: id, lease_token: claimed.lease_token,
        response: Buffer.from(id),
      });
      return committed.record.response;
    },
    close: () => stub.close(),
  };
}

async function run(loop, count) {
  const prefix = randomUUID().slice(0, 12);
  const share = Math.floor(count / concurrency);
  const latencies = [];
  const worker = async (index) => {
    for (let n = 0; n < share; n += 1) {
      const id = `${prefix}-${index}-${n}`;
      const began = process.hrtime.bigint();
      const answer = await loop.one(id);
      latencies.push(Number(process.hrtime.bigint() - began) / 1e3);
      if (Buffer.compare(Buffer.from(answer), Buffer.from(id)) !== 0) {
        throw new Error(`${id}: answered ${answer}`);
      }
    }
  };
  const began = process.hrtime.bigint();
  const cpuBegan = process.cpuUsage();
  await Promise.all(Array.from({ length: concurrency }, (_, index) => worker(index)));
  const elapsed = Number(process.hrtime.bigint() - began) / 1e9;
  const cpu = process.cpuUsage(cpuBegan);
  latencies.sort((a, b) => a - b);
  return {
    events: latencies.length,
    events_per_s: latencies.length / elapsed,
    p50_us: latencies[Math.floor(latencies.length / 2)],
    p99_us: latencies[Math.floor(latencies.length * 0.99)],
    // This process's CPU per event (libuv's threads included).
    cpu_us: (cpu.user + cpu.system) / latencies.length,
  };
}

const makers = { powertools: powertoolsLoop, dedupd: dedupdLoop, raw: rawLoop };
const peers = {};
for (const name of args.peers.split(',')) peers[name] = await makers[name]();
// Warm each peer (connections, and V8's optimising compiler) first.
for (const loop of Object.values(peers)) await run(loop, Math.min(events, 500 * concurrency));
const figures = Object.fromEntries(Object.keys(peers).map((name) => [name, []]));
for (let round = 0; round < rounds; round += 1) {
  for (const [name, loop] of Object.entries(peers)) {
    const result = await run(loop, events);
    figures[name].push(result);
    const rounded = Object.fromEntries(Object.entries(result).map(([k, v]) => [k, Math.round(v * 10) / 10]));
    console.log(JSON.stringify({ client: 'node', peer: name, setting: args.setting, concurrency, round, ...rounded }));
  }
}
const median = (values) => values.sort((a, b) => a - b)[Math.floor(values.length / 2)];
console.error(`# node, ${args.setting}, concurrency ${concurrency}, ${events} events, median of ${rounds}:`);
for (const [name, results] of Object.entries(figures)) {
  const rate = median(results.map((r) => r.events_per_s));
  const p50 = median(results.map((r) => r.p50_us));
  console.error(`#   ${name.padEnd(11)} ${rate.toFixed(0).padStart(8)} events/s   p50 ${p50.toFixed(0).padStart(7)} us`);
}
// What process() costs beyond its two calls, measured pairwise: the two
// loops alternate event by event, so both see the same moments of the
// machine; the difference of their p50 latencies and of their mean CPU per
// event (the process's: the event loop does the same work for both).
if (peers.dedupd && peers.raw && concurrency === 1) {
  const prefix = randomUUID().slice(0, 12);
  const latency = { ours: [], raw: [] };
  const cpu = { ours: [], raw: [] };
  for (let n = 0; n < events; n += 1) {
    const order = n % 2 ? [['ours', peers.dedupd], ['raw', peers.raw]] : [['raw', peers.raw], ['ours', peers.dedupd]];
    for (const [name, loop] of order) {
      const began = process.hrtime.bigint();
      const cpuBegan = process.cpuUsage();
      await loop.one(`${prefix}-${name}-${n}`);
      const used = process.cpuUsage(cpuBegan);
      cpu[name].push(used.user + used.system);
      latency[name].push(Number(process.hrtime.bigint() - began) / 1e3);
    }
  }
  const mean = (values) => values.reduce((a, b) => a + b, 0) / values.length;
  const extra = {
    p50_us: median([...latency.ours]) - median([...latency.raw]),
    cpu_us: mean(cpu.ours) - mean(cpu.raw),
  };
  const rounded = Object.fromEntries(Object.entries(extra).map(([k, v]) => [k, Math.round(v * 10) / 10]));
  console.log(JSON.stringify({ client: 'node', peer: 'beyond', setting: args.setting, concurrency: 1, ...rounded }));
  const signed = (v) => `${v >= 0 ? '+' : ''}${v.toFixed(0)}`;
  console.error(`#   process() beyond its two calls (interleaved): ${signed(extra.p50_us)} us p50, ${signed(extra.cpu_us)} us CPU`);
}
for (const loop of Object.values(peers)) await loop.close();
