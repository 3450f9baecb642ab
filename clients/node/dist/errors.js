"use strict";
// The errors every call may throw; all derive from DedupError.
Object.defineProperty(exports, "__esModule", { value: true });
exports.Unavailable = exports.ResponseErased = exports.LeaseLost = exports.FingerprintMismatch = exports.Stale = exports.InProgress = exports.DedupError = void 0;
/** Base of every error this package throws. `code` is the gRPC status
 * code when the server answered with one. */
class DedupError extends Error {
    code;
    constructor(message, code) {
        super(message);
        this.name = new.target.name;
        this.code = code;
    }
}
exports.DedupError = DedupError;
/** Another consumer holds a live lease: do not process; redeliver (nack)
 * or retry after `retryAfterMs`. */
class InProgress extends DedupError {
    correlationId;
    retryAfterMs;
    constructor(correlationId, retryAfterMs) {
        super(`${JSON.stringify(correlationId)} is in progress elsewhere; retry after ${retryAfterMs} ms`);
        this.correlationId = correlationId;
        this.retryAfterMs = retryAfterMs;
    }
}
exports.InProgress = InProgress;
/** An event of the same ordering key with a sequence at least as high was
 * already committed: acknowledge this one and skip it. */
class Stale extends DedupError {
    correlationId;
    highestCommittedSequence;
    constructor(correlationId, highestCommittedSequence) {
        super(`${JSON.stringify(correlationId)} is stale: sequence ${highestCommittedSequence} was already committed`);
        this.correlationId = correlationId;
        this.highestCommittedSequence = highestCommittedSequence;
    }
}
exports.Stale = Stale;
/** The correlation ID was seen with another payload: the producer reused
 * an ID for other content. Do not process; alert. */
class FingerprintMismatch extends DedupError {
    correlationId;
    existingFingerprint;
    constructor(correlationId, existingFingerprint) {
        super(`${JSON.stringify(correlationId)} was claimed before with another payload fingerprint (${JSON.stringify(existingFingerprint)})`);
        this.correlationId = correlationId;
        this.existingFingerprint = existingFingerprint;
    }
}
exports.FingerprintMismatch = FingerprintMismatch;
/** This claim's lease no longer holds the key (it expired and someone else
 * claimed, or it was released): the work must not be committed. */
class LeaseLost extends DedupError {
}
exports.LeaseLost = LeaseLost;
/** The event was processed before, but its stored answer was erased (the
 * key that sealed it was destroyed): acknowledge the message and do not
 * process it again; the answer itself cannot be had. */
class ResponseErased extends DedupError {
    correlationId;
    constructor(correlationId) {
        super(`${JSON.stringify(correlationId)} was processed, but its stored answer was erased`);
        this.correlationId = correlationId;
    }
}
exports.ResponseErased = ResponseErased;
/** The sidecar (or its store) could not answer after the retries: the call
 * is safe to make again after `retryAfterMs`; leave the message
 * unacknowledged so the broker redelivers it. */
class Unavailable extends DedupError {
    retryAfterMs;
    constructor(message, code, retryAfterMs) {
        super(message, code);
        this.retryAfterMs = retryAfterMs;
    }
}
exports.Unavailable = Unavailable;
