// The client: one method per RPC, and the shapes a consumer wants —
// process(id, handler) with the lease renewed (and an AbortSignal that
// fires if it is lost), and batches for Kafka-shaped polls.

import { randomUUID } from 'node:crypto';
import * as path from 'node:path';
import * as grpc from '@grpc/grpc-js';
import * as protoLoader from '@grpc/proto-loader';
import {
  DedupError,
  FingerprintMismatch,
  InProgress,
  LeaseLost,
  ResponseErased,
  Stale,
  Unavailable,
} from './errors';
import {
  authMetadata,
  callMetadata,
  backoff,
  resolveTarget,
  retryPolicy,
  type Retry,
  type RetryOptions,
  type TlsOptions,
} from './connection';
import { Renewals } from './renewal';

/** What a handler may return: cached by Commit, handed to duplicates. */
export type Result = Buffer | Uint8Array | string | null | undefined;

export interface ClientOptions {
  /** `host:port`, `http://…`, `https://…` (TLS) or `unix:///path.sock`;
   * unset: DEDUPD_ADDR, then 127.0.0.1:50051. */
  address?: string;
  /** Sent with every claim; empty: the sidecar's default namespace. */
  namespace?: string;
  owner?: string;
  consumerVersion?: string;
  /** The lease asked for, renewed every third of it by `process` (default 30000). */
  leaseMs?: number;
  /** The bearer token; unset: DEDUPD_TOKEN. */
  token?: string;
  /** TLS; unset: DEDUPD_TLS_CA / DEDUPD_TLS_CLIENT_CERT / DEDUPD_TLS_CLIENT_KEY. */
  tls?: TlsOptions;
  /** Deadline of each call (default 10000). */
  timeoutMs?: number;
  retry?: RetryOptions;
}

export type RecordState = 'CLAIMED' | 'COMMITTED' | 'RELEASED';

/** Everything dedupd knows about one key. */
export interface DedupRecord {
  namespace: string;
  correlationId: string;
  state: RecordState;
  fencingToken: bigint;
  attempt: number;
  eventType: string;
  consumerVersion: string;
  owner: string;
  payloadFingerprint: string;
  response: Buffer;
  /** The response was sealed with an encryption key the sidecar no longer
   * has (erased): `response` is empty. */
  responseErased: boolean;
  orderingKey: string;
  sequence: bigint;
  leaseExpiresAt: Date | undefined;
  claimedAt: Date | undefined;
  committedAt: Date | undefined;
  retainUntil: Date | undefined;
}

/** A claim: `duplicate` says the event was already processed (then
 * `cachedResponse` is what the first commit stored); otherwise this
 * consumer holds the key until it commits or releases. */
export interface Claim {
  namespace: string;
  correlationId: string;
  leaseToken: string;
  /** Pass it to the business write so a zombie holder's write is refused. */
  fencingToken: bigint;
  attempt: number;
  /** A previous holder died without committing: check before redoing. */
  recovered: boolean;
  duplicate: boolean;
  cachedResponse: Buffer;
  /** A duplicate whose response was erased (its encryption key destroyed
   * and declared so): `cachedResponse` is empty. */
  responseErased: boolean;
}

/** Optional fields of a Claim (see dedup.proto's ClaimRequest). */
export interface ClaimFields {
  eventType?: string;
  payloadFingerprint?: string;
  orderingKey?: string;
  sequence?: bigint | number;
  retentionMs?: number;
}

/** A handler: gets the claim and a signal that aborts if the lease is lost. */
export type Handler = (claim: Claim, signal: AbortSignal) => Result | Promise<Result>;

// What @grpc/proto-loader hands back (keepCase, longs as strings).
interface Timestamp { seconds: string; nanos: number }
interface Duration { seconds: string; nanos: number }
interface RawRecord {
  namespace: string; correlation_id: string; state: string; fencing_token: string;
  lease_expires_at: Timestamp | null; attempt: number; event_type: string;
  consumer_version: string; owner: string; payload_fingerprint: string;
  claimed_at: Timestamp | null; committed_at: Timestamp | null; retain_until: Timestamp | null;
  response: Buffer; ordering_key: string; sequence: string; response_erased: boolean;
}
interface RawClaimResponse {
  outcome: string; lease_token: string; fencing_token: string; attempt: number;
  recovered: boolean; retry_after: Duration | null; record: RawRecord | null;
  highest_committed_sequence: string;
}
interface RawCommitResponse { outcome: string; record: RawRecord | null }

type Unary = (request: object, metadata: grpc.Metadata, options: grpc.CallOptions,
  callback: (error: grpc.ServiceError | null, response: unknown) => void) => void;

const PROTO_ROOT = path.join(__dirname, '..', 'proto');
let service: grpc.ServiceClientConstructor | undefined;

function serviceConstructor(): grpc.ServiceClientConstructor {
  if (!service) {
    const definition = protoLoader.loadSync(path.join(PROTO_ROOT, 'dedup/v1/dedup.proto'), {
      includeDirs: [PROTO_ROOT],
      keepCase: true,
      longs: String,
      enums: String,
      defaults: true,
    });
    const loaded = grpc.loadPackageDefinition(definition) as unknown as {
      dedup: { v1: { ClaimAndCommit: grpc.ServiceClientConstructor } };
    };
    service = loaded.dedup.v1.ClaimAndCommit;
  }
  return service;
}

const toDuration = (ms: number): Duration => ({
  seconds: String(Math.floor(ms / 1000)),
  nanos: Math.round((ms % 1000) * 1e6),
});
const millis = (d: Duration | null): number => (d ? Number(d.seconds) * 1000 + Math.round(d.nanos / 1e6) : 0);
const date = (t: Timestamp | null): Date | undefined =>
  t ? new Date(Number(t.seconds) * 1000 + Math.floor(t.nanos / 1e6)) : undefined;

function asBuffer(result: Result): Buffer {
  if (result === null || result === undefined) return Buffer.alloc(0);
  if (typeof result === 'string') return Buffer.from(result);
  if (result instanceof Uint8Array) return Buffer.from(result.buffer, result.byteOffset, result.byteLength);
  throw new TypeError(`a handler's result must be a Buffer, Uint8Array, string or nothing, not ${typeof result}`);
}

function toRecord(raw: RawRecord): DedupRecord {
  return {
    namespace: raw.namespace,
    correlationId: raw.correlation_id,
    state: raw.state.replace('RECORD_STATE_', '') as RecordState,
    fencingToken: BigInt(raw.fencing_token),
    attempt: raw.attempt,
    eventType: raw.event_type,
    consumerVersion: raw.consumer_version,
    owner: raw.owner,
    payloadFingerprint: raw.payload_fingerprint,
    response: raw.response,
    responseErased: raw.response_erased,
    orderingKey: raw.ordering_key,
    sequence: BigInt(raw.sequence),
    leaseExpiresAt: date(raw.lease_expires_at),
    claimedAt: date(raw.claimed_at),
    committedAt: date(raw.committed_at),
    retainUntil: date(raw.retain_until),
  };
}

function need<T>(value: T | null, what: string): T {
  if (value === null) throw new DedupError(`the sidecar's answer has no ${what}`);
  return value;
}

export class Client {
  readonly namespace: string;
  readonly owner: string;
  readonly consumerVersion: string;
  readonly leaseMs: number;
  private readonly client: grpc.Client;
  private readonly metadata: grpc.Metadata;
  private readonly timeoutMs: number;
  private readonly retry: Retry;
  private readonly rpcs = new Map<string, Unary>();
  private readonly renewals: Renewals;

  constructor(options: ClientOptions = {}) {
    const { target, credentials, options: channelOptions } = resolveTarget(options.address, options.tls);
    const Service = serviceConstructor();
    this.client = new Service(target, credentials, channelOptions);
    this.metadata = authMetadata(options.token);
    this.namespace = options.namespace ?? '';
    this.owner = options.owner ?? '';
    this.consumerVersion = options.consumerVersion ?? '';
    this.leaseMs = options.leaseMs ?? 30000;
    this.timeoutMs = options.timeoutMs ?? 10000;
    this.retry = retryPolicy(options.retry);
    // A renewal waits at most a beat: a hung one must not use up the lease.
    const beat = this.leaseMs / 3;
    // Nor is it retried here: the renewer tries again a quarter beat later.
    this.renewals = new Renewals(beat, (claim) => this.renewWithin(claim, Math.min(beat, this.timeoutMs), 1));
  }

  close(): void {
    this.renewals.close();
    this.client.close();
  }

  private async call<T>(method: string, request: object, timeoutMs = this.timeoutMs, attempts = this.retry.attempts): Promise<T> {
    const rpc = this.rpc(method);
    for (let attempt = 0; ; attempt += 1) {
      try {
        return await new Promise<T>((resolve, reject) => {
          rpc(request, callMetadata(this.metadata), { deadline: Date.now() + timeoutMs }, (error, response) =>
            error ? reject(error) : resolve(response as T));
        });
      } catch (error) {
        const failure = error as grpc.ServiceError;
        if (failure.code === grpc.status.UNAVAILABLE && attempt + 1 < attempts) {
          await new Promise((resolve) => setTimeout(resolve, backoff(this.retry, attempt)));
          continue;
        }
        throw this.translate(failure, method);
      }
    }
  }

  /** The stub's method, bound once per client (not on every call). */
  private rpc(method: string): Unary {
    let rpc = this.rpcs.get(method);
    if (!rpc) {
      rpc = (this.client as unknown as Record<string, Unary>)[method]!.bind(this.client);
      this.rpcs.set(method, rpc);
    }
    return rpc;
  }

  private translate(error: grpc.ServiceError, method: string): DedupError {
    const code = typeof error.code === 'number' ? error.code : grpc.status.UNKNOWN;
    const message = `${method}: ${grpc.status[code] ?? code}: ${error.details || error.message}`;
    switch (code) {
      case grpc.status.UNAVAILABLE:
      case grpc.status.DEADLINE_EXCEEDED:
      case grpc.status.RESOURCE_EXHAUSTED:
        return new Unavailable(message, code, this.retry.maxDelayMs);
      case grpc.status.FAILED_PRECONDITION:
        return new LeaseLost(message, code);
      default:
        return new DedupError(message, code);
    }
  }

  private claimRequest(correlationId: string, fields: ClaimFields): object {
    return {
      namespace: this.namespace,
      correlation_id: correlationId,
      owner: this.owner,
      consumer_version: this.consumerVersion,
      lease_ttl: toDuration(this.leaseMs),
      event_type: fields.eventType ?? '',
      payload_fingerprint: fields.payloadFingerprint ?? '',
      ordering_key: fields.orderingKey ?? '',
      // One per claim: a repeat whose answer was lost gets the same claim.
      request_id: randomUUID(),
      // Set only when given (no spread of a temporary object: the hot path).
      sequence: fields.sequence !== undefined ? String(fields.sequence) : undefined,
      retention: fields.retentionMs !== undefined ? toDuration(fields.retentionMs) : undefined,
    };
  }

  private claimResult(correlationId: string, answer: RawClaimResponse): Claim | InProgress | Stale | FingerprintMismatch {
    switch (answer.outcome) {
      case 'CLAIM_OUTCOME_CLAIMED':
      case 'CLAIM_OUTCOME_DUPLICATE': {
        const record = need(answer.record, 'record');
        const duplicate = answer.outcome === 'CLAIM_OUTCOME_DUPLICATE';
        return {
          // The record names the namespace the sidecar used (its default
          // when ours is empty).
          namespace: record.namespace,
          correlationId,
          leaseToken: answer.lease_token,
          fencingToken: BigInt(answer.fencing_token),
          attempt: duplicate ? record.attempt : answer.attempt,
          recovered: answer.recovered,
          duplicate,
          cachedResponse: duplicate ? record.response : Buffer.alloc(0),
          responseErased: duplicate && record.response_erased,
        };
      }
      case 'CLAIM_OUTCOME_IN_PROGRESS':
        return new InProgress(correlationId, millis(answer.retry_after));
      case 'CLAIM_OUTCOME_STALE':
        return new Stale(correlationId, BigInt(answer.highest_committed_sequence));
      case 'CLAIM_OUTCOME_FINGERPRINT_MISMATCH':
        return new FingerprintMismatch(correlationId, answer.record?.payload_fingerprint ?? '');
      default:
        throw new DedupError(`unknown claim outcome ${answer.outcome} for ${JSON.stringify(correlationId)}`);
    }
  }

  private static key(claim: Claim): object {
    return { namespace: claim.namespace, correlation_id: claim.correlationId, lease_token: claim.leaseToken };
  }

  private static claimable(claim: Claim, action: string): void {
    if (claim.duplicate) {
      throw new DedupError(`${JSON.stringify(claim.correlationId)} is a duplicate: there is nothing to ${action}`);
    }
  }

  /** Claims the key: a Claim (check `duplicate`), or throws InProgress,
   * Stale or FingerprintMismatch. The lease is not renewed. */
  async claimOnce(correlationId: string, fields: ClaimFields = {}): Promise<Claim> {
    const answer = await this.call<RawClaimResponse>('Claim', this.claimRequest(correlationId, fields));
    const result = this.claimResult(correlationId, answer);
    if (result instanceof Error) throw result;
    return result;
  }

  /** Commits after the business write; `response` goes to duplicates.
   * Throws LeaseLost if the lease no longer holds the key. */
  async commit(claim: Claim, response?: Result, options: { retentionMs?: number } = {}): Promise<DedupRecord> {
    return toRecord(await this.commitRaw(claim, response, options.retentionMs));
  }

  private async commitRaw(claim: Claim, response: Result, retentionMs?: number): Promise<RawRecord> {
    Client.claimable(claim, 'commit');
    const request = {
      ...Client.key(claim),
      response: asBuffer(response),
      ...(retentionMs !== undefined ? { retention: toDuration(retentionMs) } : {}),
    };
    const answer = await this.call<RawCommitResponse>('Commit', request);
    return need(answer.record, 'record');
  }

  /** Releases after a failure; a redelivery may claim at once. Releasing a
   * claim that expired or was released already is not an error. */
  async release(claim: Claim): Promise<void> {
    Client.claimable(claim, 'release');
    try {
      await this.call('Release', Client.key(claim));
    } catch (error) {
      if (!(error instanceof LeaseLost)) throw error;
    }
  }

  /** Extends the lease by `leaseMs` from now. */
  async renew(claim: Claim): Promise<void> {
    await this.renewWithin(claim, this.timeoutMs, this.retry.attempts);
  }

  private async renewWithin(claim: Claim, timeoutMs: number, attempts: number): Promise<void> {
    Client.claimable(claim, 'renew');
    await this.call('Renew', { ...Client.key(claim), lease_ttl: toDuration(this.leaseMs) }, timeoutMs, attempts);
  }

  /** The key's record, or null. */
  async lookup(correlationId: string): Promise<DedupRecord | null> {
    const answer = await this.call<{ found: boolean; record: RawRecord | null }>('Lookup', {
      namespace: this.namespace,
      correlation_id: correlationId,
    });
    return answer.found && answer.record ? toRecord(answer.record) : null;
  }

  /** Runs `handler(claim, signal)` at most once per correlation ID and
   * resolves to its result (as stored); a duplicate resolves to the first
   * result without calling it (rejects with ResponseErased if that result
   * was erased). While the handler runs past a third of the
   * lease, the lease is renewed every third of it (one timer per client);
   * `signal` aborts if it is lost. If the handler throws,
   * the claim is released and the handler's error rethrown — a failing
   * release never replaces it. */
  async process(correlationId: string, handler: Handler, fields: ClaimFields = {}): Promise<Buffer> {
    // claimOnce, inlined: one promise fewer on the hot path.
    const answer = await this.call<RawClaimResponse>('Claim', this.claimRequest(correlationId, fields));
    const claim = this.claimResult(correlationId, answer);
    if (claim instanceof Error) throw claim;
    if (claim.duplicate) {
      // Never an empty answer the caller would take for the real one.
      if (claim.responseErased) throw new ResponseErased(correlationId);
      return claim.cachedResponse;
    }
    const lease = new AbortController();
    const watch = this.renewals.watch(claim, lease);
    let result: Result;
    try {
      result = await handler(claim, lease.signal);
    } catch (error) {
      this.renewals.end(watch);
      try {
        await this.release(claim);
      } catch (failure) {
        if (error instanceof Error) {
          (error as Error & { releaseError?: unknown }).releaseError = failure;
        }
      }
      throw error;
    }
    this.renewals.end(watch);
    // Only the stored response is handed back: no full record is built.
    return (await this.commitRaw(claim, result)).response;
  }

  /** Claims a batch (a Kafka poll, say) in one call and one disk sync: one
   * result per ID, in order — a Claim (check `duplicate`) or the error its
   * outcome stands for, returned, not thrown. Leases are not renewed. */
  async claimMany(correlationIds: readonly string[], fields: ClaimFields = {}): Promise<Array<Claim | InProgress | Stale | FingerprintMismatch>> {
    const answer = await this.call<{ results: RawClaimResponse[] }>('ClaimBatch', {
      items: correlationIds.map((id) => this.claimRequest(id, fields)),
    });
    return answer.results.map((result, index) => this.claimResult(correlationIds[index]!, result));
  }

  /** Commits a batch: per item the committed record, or LeaseLost. */
  async commitMany(commits: ReadonlyArray<readonly [Claim, Result]>): Promise<Array<DedupRecord | LeaseLost>> {
    for (const [claim] of commits) Client.claimable(claim, 'commit');
    const answer = await this.call<{ results: RawCommitResponse[] }>('CommitBatch', {
      items: commits.map(([claim, response]) => ({ ...Client.key(claim), response: asBuffer(response) })),
    });
    return answer.results.map((result, index) =>
      result.outcome === 'COMMIT_OUTCOME_LEASE_LOST'
        ? new LeaseLost(`the lease on ${JSON.stringify(commits[index]![0].correlationId)} expired before the batch commit`)
        : toRecord(need(result.record, 'record')));
  }

  /** Releases a batch (duplicates and claims no longer held are skipped). */
  async releaseMany(claims: readonly Claim[]): Promise<void> {
    await this.call('ReleaseBatch', {
      items: claims.filter((claim) => !claim.duplicate).map((claim) => Client.key(claim)),
    });
  }
}
