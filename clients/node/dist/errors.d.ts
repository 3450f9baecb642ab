/** Base of every error this package throws. `code` is the gRPC status
 * code when the server answered with one. */
export declare class DedupError extends Error {
    readonly code: number | undefined;
    constructor(message: string, code?: number);
}
/** Another consumer holds a live lease: do not process; redeliver (nack)
 * or retry after `retryAfterMs`. */
export declare class InProgress extends DedupError {
    readonly correlationId: string;
    readonly retryAfterMs: number;
    constructor(correlationId: string, retryAfterMs: number);
}
/** An event of the same ordering key with a sequence at least as high was
 * already committed: acknowledge this one and skip it. */
export declare class Stale extends DedupError {
    readonly correlationId: string;
    readonly highestCommittedSequence: bigint;
    constructor(correlationId: string, highestCommittedSequence: bigint);
}
/** The correlation ID was seen with another payload: the producer reused
 * an ID for other content. Do not process; alert. */
export declare class FingerprintMismatch extends DedupError {
    readonly correlationId: string;
    readonly existingFingerprint: string;
    constructor(correlationId: string, existingFingerprint: string);
}
/** This claim's lease no longer holds the key (it expired and someone else
 * claimed, or it was released): the work must not be committed. */
export declare class LeaseLost extends DedupError {
}
/** The event was processed before, but its stored answer was erased (the
 * key that sealed it was destroyed): acknowledge the message and do not
 * process it again; the answer itself cannot be had. */
export declare class ResponseErased extends DedupError {
    readonly correlationId: string;
    constructor(correlationId: string);
}
/** The sidecar (or its store) could not answer after the retries: the call
 * is safe to make again after `retryAfterMs`; leave the message
 * unacknowledged so the broker redelivers it. */
export declare class Unavailable extends DedupError {
    readonly retryAfterMs: number;
    constructor(message: string, code: number, retryAfterMs: number);
}
