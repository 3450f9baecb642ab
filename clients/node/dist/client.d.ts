import { FingerprintMismatch, InProgress, LeaseLost, Stale } from './errors';
import { type RetryOptions, type TlsOptions } from './connection';
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
export declare class Client {
    readonly namespace: string;
    readonly owner: string;
    readonly consumerVersion: string;
    readonly leaseMs: number;
    private readonly client;
    private readonly metadata;
    private readonly timeoutMs;
    private readonly retry;
    private readonly rpcs;
    private readonly renewals;
    constructor(options?: ClientOptions);
    close(): void;
    private call;
    /** The stub's method, bound once per client (not on every call). */
    private rpc;
    private translate;
    private claimRequest;
    private claimResult;
    private static key;
    private static claimable;
    /** Claims the key: a Claim (check `duplicate`), or throws InProgress,
     * Stale or FingerprintMismatch. The lease is not renewed. */
    claimOnce(correlationId: string, fields?: ClaimFields): Promise<Claim>;
    /** Commits after the business write; `response` goes to duplicates.
     * Throws LeaseLost if the lease no longer holds the key. */
    commit(claim: Claim, response?: Result, options?: {
        retentionMs?: number;
    }): Promise<DedupRecord>;
    private commitRaw;
    /** Releases after a failure; a redelivery may claim at once. Releasing a
     * claim that expired or was released already is not an error. */
    release(claim: Claim): Promise<void>;
    /** Extends the lease by `leaseMs` from now. */
    renew(claim: Claim): Promise<void>;
    private renewWithin;
    /** The key's record, or null. */
    lookup(correlationId: string): Promise<DedupRecord | null>;
    /** Runs `handler(claim, signal)` at most once per correlation ID and
     * resolves to its result (as stored); a duplicate resolves to the first
     * result without calling it (rejects with ResponseErased if that result
     * was erased). While the handler runs past a third of the
     * lease, the lease is renewed every third of it (one timer per client);
     * `signal` aborts if it is lost. If the handler throws,
     * the claim is released and the handler's error rethrown — a failing
     * release never replaces it. */
    process(correlationId: string, handler: Handler, fields?: ClaimFields): Promise<Buffer>;
    /** Claims a batch (a Kafka poll, say) in one call and one disk sync: one
     * result per ID, in order — a Claim (check `duplicate`) or the error its
     * outcome stands for, returned, not thrown. Leases are not renewed. */
    claimMany(correlationIds: readonly string[], fields?: ClaimFields): Promise<Array<Claim | InProgress | Stale | FingerprintMismatch>>;
    /** Commits a batch: per item the committed record, or LeaseLost. */
    commitMany(commits: ReadonlyArray<readonly [Claim, Result]>): Promise<Array<DedupRecord | LeaseLost>>;
    /** Releases a batch (duplicates and claims no longer held are skipped). */
    releaseMany(claims: readonly Claim[]): Promise<void>;
}
