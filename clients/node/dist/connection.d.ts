import * as grpc from '@grpc/grpc-js';
export declare const DEFAULT_ADDRESS = "127.0.0.1:50051";
/** TLS to the sidecar. `caFile` verifies its certificate (PEM; the
 * system's roots when unset); `certFile` and `keyFile` are this client's
 * own, for mTLS; `serverName` overrides the name checked in its
 * certificate. */
export interface TlsOptions {
    caFile?: string;
    certFile?: string;
    keyFile?: string;
    serverName?: string;
}
/** Retries of calls answered UNAVAILABLE (the sidecar restarting, its store
 * away for a moment). Every dedupd call is safe to repeat: a Claim carries
 * a request ID (a repeat whose first answer was lost gets the same claim),
 * a repeated Commit answers ALREADY_COMMITTED, a repeated Release
 * ALREADY_RELEASED, Renew and Lookup change nothing twice. */
export interface RetryOptions {
    /** Attempts in all, the first included (default 5). */
    attempts?: number;
    /** The first backoff, doubled each time, with equal jitter (default 50). */
    firstDelayMs?: number;
    /** The longest backoff, and the `retryAfterMs` of `Unavailable` (default 2000). */
    maxDelayMs?: number;
}
export interface Retry {
    attempts: number;
    firstDelayMs: number;
    maxDelayMs: number;
}
export declare function retryPolicy(options?: RetryOptions): Retry;
/** The wait before retry `attempt` (0-based): exponential with equal
 * jitter — at least half the delay, so `attempts` and the delays promise a
 * least time the retries ride out (a sidecar restart); with full jitter
 * every wait could be close to nothing and the retries end before the
 * sidecar is back. */
export declare function backoff(retry: Retry, attempt: number): number;
export interface Target {
    target: string;
    credentials: grpc.ChannelCredentials;
    options: grpc.ChannelOptions;
}
/** The gRPC target for an address: `host:port`, `http://host:port`,
 * `https://host:port` (TLS) or `unix:///path.sock`; unset: DEDUPD_ADDR,
 * then 127.0.0.1:50051. TLS settings: the argument, else DEDUPD_TLS_*. */
export declare function resolveTarget(address: string | undefined, tlsOption: TlsOptions | undefined): Target;
export declare function authMetadata(token: string | undefined): grpc.Metadata;
/**
 * `base` plus the application's active trace context (W3C `traceparent`,
 * `tracestate`, `baggage`: whatever propagator it registered) when it uses
 * OpenTelemetry, so the sidecar's span joins the caller's trace.
 */
export declare function callMetadata(base: grpc.Metadata): grpc.Metadata;
