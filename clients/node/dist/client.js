"use strict";
// The client: one method per RPC, and the shapes a consumer wants —
// process(id, handler) with the lease renewed (and an AbortSignal that
// fires if it is lost), and batches for Kafka-shaped polls.
Object.defineProperty(exports, "__esModule", { value: true });
exports.Client = void 0;
const node_crypto_1 = require("node:crypto");
const path = require("node:path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");
const errors_1 = require("./errors");
const connection_1 = require("./connection");
const renewal_1 = require("./renewal");
const PROTO_ROOT = path.join(__dirname, '..', 'proto');
let service;
function serviceConstructor() {
    if (!service) {
        const definition = protoLoader.loadSync(path.join(PROTO_ROOT, 'dedup/v1/dedup.proto'), {
            includeDirs: [PROTO_ROOT],
            keepCase: true,
            longs: String,
            enums: String,
            defaults: true,
        });
        const loaded = grpc.loadPackageDefinition(definition);
        service = loaded.dedup.v1.ClaimAndCommit;
    }
    return service;
}
const toDuration = (ms) => ({
    seconds: String(Math.floor(ms / 1000)),
    nanos: Math.round((ms % 1000) * 1e6),
});
const millis = (d) => (d ? Number(d.seconds) * 1000 + Math.round(d.nanos / 1e6) : 0);
const date = (t) => t ? new Date(Number(t.seconds) * 1000 + Math.floor(t.nanos / 1e6)) : undefined;
function asBuffer(result) {
    if (result === null || result === undefined)
        return Buffer.alloc(0);
    if (typeof result === 'string')
        return Buffer.from(result);
    if (result instanceof Uint8Array)
        return Buffer.from(result.buffer, result.byteOffset, result.byteLength);
    throw new TypeError(`a handler's result must be a Buffer, Uint8Array, string or nothing, not ${typeof result}`);
}
function toRecord(raw) {
    return {
        namespace: raw.namespace,
        correlationId: raw.correlation_id,
        state: raw.state.replace('RECORD_STATE_', ''),
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
function need(value, what) {
    if (value === null)
        throw new errors_1.DedupError(`the sidecar's answer has no ${what}`);
    return value;
}
class Client {
    namespace;
    owner;
    consumerVersion;
    leaseMs;
    client;
    metadata;
    timeoutMs;
    retry;
    rpcs = new Map();
    renewals;
    constructor(options = {}) {
        const { target, credentials, options: channelOptions } = (0, connection_1.resolveTarget)(options.address, options.tls);
        const Service = serviceConstructor();
        this.client = new Service(target, credentials, channelOptions);
        this.metadata = (0, connection_1.authMetadata)(options.token);
        this.namespace = options.namespace ?? '';
        this.owner = options.owner ?? '';
        this.consumerVersion = options.consumerVersion ?? '';
        this.leaseMs = options.leaseMs ?? 30000;
        this.timeoutMs = options.timeoutMs ?? 10000;
        this.retry = (0, connection_1.retryPolicy)(options.retry);
        // A renewal waits at most a beat: a hung one must not use up the lease.
        const beat = this.leaseMs / 3;
        // Nor is it retried here: the renewer tries again a quarter beat later.
        this.renewals = new renewal_1.Renewals(beat, (claim) => this.renewWithin(claim, Math.min(beat, this.timeoutMs), 1));
    }
    close() {
        this.renewals.close();
        this.client.close();
    }
    async call(method, request, timeoutMs = this.timeoutMs, attempts = this.retry.attempts) {
        const rpc = this.rpc(method);
        for (let attempt = 0;; attempt += 1) {
            try {
                return await new Promise((resolve, reject) => {
                    rpc(request, (0, connection_1.callMetadata)(this.metadata), { deadline: Date.now() + timeoutMs }, (error, response) => error ? reject(error) : resolve(response));
                });
            }
            catch (error) {
                const failure = error;
                if (failure.code === grpc.status.UNAVAILABLE && attempt + 1 < attempts) {
                    await new Promise((resolve) => setTimeout(resolve, (0, connection_1.backoff)(this.retry, attempt)));
                    continue;
                }
                throw this.translate(failure, method);
            }
        }
    }
    /** The stub's method, bound once per client (not on every call). */
    rpc(method) {
        let rpc = this.rpcs.get(method);
        if (!rpc) {
            rpc = this.client[method].bind(this.client);
            this.rpcs.set(method, rpc);
        }
        return rpc;
    }
    translate(error, method) {
        const code = typeof error.code === 'number' ? error.code : grpc.status.UNKNOWN;
        const message = `${method}: ${grpc.status[code] ?? code}: ${error.details || error.message}`;
        switch (code) {
            case grpc.status.UNAVAILABLE:
            case grpc.status.DEADLINE_EXCEEDED:
            case grpc.status.RESOURCE_EXHAUSTED:
                return new errors_1.Unavailable(message, code, this.retry.maxDelayMs);
            case grpc.status.FAILED_PRECONDITION:
                return new errors_1.LeaseLost(message, code);
            default:
                return new errors_1.DedupError(message, code);
        }
    }
    claimRequest(correlationId, fields) {
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
            request_id: (0, node_crypto_1.randomUUID)(),
            // Set only when given (no spread of a temporary object: the hot path).
            sequence: fields.sequence !== undefined ? String(fields.sequence) : undefined,
            retention: fields.retentionMs !== undefined ? toDuration(fields.retentionMs) : undefined,
        };
    }
    claimResult(correlationId, answer) {
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
                return new errors_1.InProgress(correlationId, millis(answer.retry_after));
            case 'CLAIM_OUTCOME_STALE':
                return new errors_1.Stale(correlationId, BigInt(answer.highest_committed_sequence));
            case 'CLAIM_OUTCOME_FINGERPRINT_MISMATCH':
                return new errors_1.FingerprintMismatch(correlationId, answer.record?.payload_fingerprint ?? '');
            default:
                throw new errors_1.DedupError(`unknown claim outcome ${answer.outcome} for ${JSON.stringify(correlationId)}`);
        }
    }
    static key(claim) {
        return { namespace: claim.namespace, correlation_id: claim.correlationId, lease_token: claim.leaseToken };
    }
    static claimable(claim, action) {
        if (claim.duplicate) {
            throw new errors_1.DedupError(`${JSON.stringify(claim.correlationId)} is a duplicate: there is nothing to ${action}`);
        }
    }
    /** Claims the key: a Claim (check `duplicate`), or throws InProgress,
     * Stale or FingerprintMismatch. The lease is not renewed. */
    async claimOnce(correlationId, fields = {}) {
        const answer = await this.call('Claim', this.claimRequest(correlationId, fields));
        const result = this.claimResult(correlationId, answer);
        if (result instanceof Error)
            throw result;
        return result;
    }
    /** Commits after the business write; `response` goes to duplicates.
     * Throws LeaseLost if the lease no longer holds the key. */
    async commit(claim, response, options = {}) {
        return toRecord(await this.commitRaw(claim, response, options.retentionMs));
    }
    async commitRaw(claim, response, retentionMs) {
        Client.claimable(claim, 'commit');
        const request = {
            ...Client.key(claim),
            response: asBuffer(response),
            ...(retentionMs !== undefined ? { retention: toDuration(retentionMs) } : {}),
        };
        const answer = await this.call('Commit', request);
        return need(answer.record, 'record');
    }
    /** Releases after a failure; a redelivery may claim at once. Releasing a
     * claim that expired or was released already is not an error. */
    async release(claim) {
        Client.claimable(claim, 'release');
        try {
            await this.call('Release', Client.key(claim));
        }
        catch (error) {
            if (!(error instanceof errors_1.LeaseLost))
                throw error;
        }
    }
    /** Extends the lease by `leaseMs` from now. */
    async renew(claim) {
        await this.renewWithin(claim, this.timeoutMs, this.retry.attempts);
    }
    async renewWithin(claim, timeoutMs, attempts) {
        Client.claimable(claim, 'renew');
        await this.call('Renew', { ...Client.key(claim), lease_ttl: toDuration(this.leaseMs) }, timeoutMs, attempts);
    }
    /** The key's record, or null. */
    async lookup(correlationId) {
        const answer = await this.call('Lookup', {
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
    async process(correlationId, handler, fields = {}) {
        // claimOnce, inlined: one promise fewer on the hot path.
        const answer = await this.call('Claim', this.claimRequest(correlationId, fields));
        const claim = this.claimResult(correlationId, answer);
        if (claim instanceof Error)
            throw claim;
        if (claim.duplicate) {
            // Never an empty answer the caller would take for the real one.
            if (claim.responseErased)
                throw new errors_1.ResponseErased(correlationId);
            return claim.cachedResponse;
        }
        const lease = new AbortController();
        const watch = this.renewals.watch(claim, lease);
        let result;
        try {
            result = await handler(claim, lease.signal);
        }
        catch (error) {
            this.renewals.end(watch);
            try {
                await this.release(claim);
            }
            catch (failure) {
                if (error instanceof Error) {
                    error.releaseError = failure;
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
    async claimMany(correlationIds, fields = {}) {
        const answer = await this.call('ClaimBatch', {
            items: correlationIds.map((id) => this.claimRequest(id, fields)),
        });
        return answer.results.map((result, index) => this.claimResult(correlationIds[index], result));
    }
    /** Commits a batch: per item the committed record, or LeaseLost. */
    async commitMany(commits) {
        for (const [claim] of commits)
            Client.claimable(claim, 'commit');
        const answer = await this.call('CommitBatch', {
            items: commits.map(([claim, response]) => ({ ...Client.key(claim), response: asBuffer(response) })),
        });
        return answer.results.map((result, index) => result.outcome === 'COMMIT_OUTCOME_LEASE_LOST'
            ? new errors_1.LeaseLost(`the lease on ${JSON.stringify(commits[index][0].correlationId)} expired before the batch commit`)
            : toRecord(need(result.record, 'record')));
    }
    /** Releases a batch (duplicates and claims no longer held are skipped). */
    async releaseMany(claims) {
        await this.call('ReleaseBatch', {
            items: claims.filter((claim) => !claim.duplicate).map((claim) => Client.key(claim)),
        });
    }
}
exports.Client = Client;
