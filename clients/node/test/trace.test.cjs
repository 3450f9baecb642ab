'use strict';
// The application's OpenTelemetry context travels to the sidecar in the
// call's metadata (W3C traceparent and baggage): seen by a gRPC server of
// the test's own that keeps what each call carried. Needs the application's
// @opentelemetry/api (an optional peer dependency of the client).

const test = require('node:test');
const assert = require('node:assert/strict');
const path = require('node:path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const { context, propagation, trace, TraceFlags } = require('@opentelemetry/api');
const { W3CTraceContextPropagator, W3CBaggagePropagator, CompositePropagator } = require('@opentelemetry/core');
const { AsyncLocalStorageContextManager } = require('@opentelemetry/context-async-hooks');
const { Client } = require('@dedupd/client');

const TRACE_ID = '4bf92f3577b34da6a3ce929d0e0e4736';
const SPAN_ID = '00f067aa0ba902b7';

async function recorder(t) {
  const proto = require.resolve('@dedupd/client/package.json');
  const definition = protoLoader.loadSync(path.join(path.dirname(proto), 'proto', 'dedup', 'v1', 'dedup.proto'),
    { keepCase: false, longs: String, enums: String, defaults: true });
  const service = grpc.loadPackageDefinition(definition).dedup.v1.ClaimAndCommit.service;
  const seen = [];
  const server = new grpc.Server();
  server.addService(service, {
    claim(call, callback) {
      seen.push(call.metadata.getMap());
      callback(null, {
        outcome: 'CLAIM_OUTCOME_CLAIMED', leaseToken: 'token', fencingToken: '1', attempt: 1,
        record: { namespace: 'default', correlationId: call.request.correlationId },
      });
    },
  });
  const port = await new Promise((resolve, reject) =>
    server.bindAsync('127.0.0.1:0', grpc.ServerCredentials.createInsecure(), (error, bound) =>
      error ? reject(error) : resolve(bound)));
  t.after(() => server.forceShutdown());
  return { address: `127.0.0.1:${port}`, seen };
}

test('the client sends the active trace context and baggage', async (t) => {
  const contextManager = new AsyncLocalStorageContextManager().enable();
  context.setGlobalContextManager(contextManager);
  propagation.setGlobalPropagator(new CompositePropagator({
    propagators: [new W3CTraceContextPropagator(), new W3CBaggagePropagator()],
  }));
  t.after(() => { context.disable(); propagation.disable(); });
  const { address, seen } = await recorder(t);
  const dedup = new Client({ address, token: 'a-token' });
  t.after(() => dedup.close());

  await dedup.claimOnce('untraced');
  const span = trace.wrapSpanContext({ traceId: TRACE_ID, spanId: SPAN_ID, traceFlags: TraceFlags.SAMPLED });
  const active = propagation.setBaggage(trace.setSpan(context.active(), span),
    propagation.createBaggage({ tenant: { value: 'acme' } }));
  await context.with(active, () => dedup.claimOnce('traced'));

  const [untraced, traced] = seen;
  assert.equal(untraced.traceparent, undefined);
  assert.equal(traced.traceparent, `00-${TRACE_ID}-${SPAN_ID}-01`);
  assert.equal(traced.baggage, 'tenant=acme');
  assert.equal(traced.authorization, 'Bearer a-token', 'the token still goes along');
});
