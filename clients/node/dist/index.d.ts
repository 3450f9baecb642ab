export { Client, type Claim, type ClaimFields, type ClientOptions, type DedupRecord, type Handler, type RecordState, type Result, } from './client';
export type { RetryOptions, TlsOptions } from './connection';
export { DedupError, FingerprintMismatch, InProgress, LeaseLost, ResponseErased, Stale, Unavailable } from './errors';
