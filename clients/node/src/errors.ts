// The errors every call may throw; all derive from DedupError.

/** Base of every error this package throws. `code` is the gRPC status
 * code when the server answered with one. */
export class DedupError extends Error {
  readonly code: number | undefined;

  constructor(message: string, code?: number) {
    super(message);
    this.name = new.target.name;
    this.code = code;
  }
}

/** Another consumer holds a live lease: do not process; redeliver (nack)
 * or retry after `retryAfterMs`. */
export class InProgress extends DedupError {
  constructor(
    readonly correlationId: string,
    readonly retryAfterMs: number,
  ) {
    super(`${JSON.stringify(correlationId)} is in progress elsewhere; retry after ${retryAfterMs} ms`);
  }
}

/** An event of the same ordering key with a sequence at least as high was
 * already committed: acknowledge this one and skip it. */
export class Stale extends DedupError {
  constructor(
    readonly correlationId: string,
    readonly highestCommittedSequence: bigint,
  ) {
    super(`${JSON.stringify(correlationId)} is stale: sequence ${highestCommittedSequence} was already committed`);
  }
}

/** The correlation ID was seen with another payload: the producer reused
 * an ID for other content. Do not process; alert. */
export class FingerprintMismatch extends DedupError {
  constructor(
    readonly correlationId: string,
    readonly existingFingerprint: string,
  ) {
    super(
      `${JSON.stringify(correlationId)} was claimed before with another payload fingerprint (${JSON.stringify(existingFingerprint)})`,
    );
  }
}

/** This claim's lease no longer holds the key (it expired and someone else
 * claimed, or it was released): the work must not be committed. */
export class LeaseLost extends DedupError {}

/** The event was processed before, but its stored answer was erased (the
 * key that sealed it was destroyed): acknowledge the message and do not
 * process it again; the answer itself cannot be had. */
export class ResponseErased extends DedupError {
  constructor(readonly correlationId: string) {
    super(`${JSON.stringify(correlationId)} was processed, but its stored answer was erased`);
  }
}

/** The sidecar (or its store) could not answer after the retries: the call
 * is safe to make again after `retryAfterMs`; leave the message
 * unacknowledged so the broker redelivers it. */
export class Unavailable extends DedupError {
  constructor(
    message: string,
    code: number,
    readonly retryAfterMs: number,
  ) {
    super(message, code);
  }
}
