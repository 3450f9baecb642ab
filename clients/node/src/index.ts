// @dedupd/client: the Node.js client of the dedupd deduplication sidecar.
//
//   const { Client } = require('@dedupd/client');   // or: import { Client } from '@dedupd/client'
//   const dedup = new Client({ namespace: 'payments' });
//   const result = await dedup.process(event.correlationId, async (claim, signal) => handle(event, claim, signal));

export {
  Client,
  type Claim,
  type ClaimFields,
  type ClientOptions,
  type DedupRecord,
  type Handler,
  type RecordState,
  type Result,
} from './client';
export type { RetryOptions, TlsOptions } from './connection';
export { DedupError, FingerprintMismatch, InProgress, LeaseLost, ResponseErased, Stale, Unavailable } from './errors';
