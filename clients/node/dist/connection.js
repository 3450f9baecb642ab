"use strict";
// How a client reaches the sidecar: the address (DEDUPD_ADDR), TLS, the
// bearer token and the caller's trace context, and the retry policy for
// UNAVAILABLE.
Object.defineProperty(exports, "__esModule", { value: true });
exports.DEFAULT_ADDRESS = void 0;
exports.retryPolicy = retryPolicy;
exports.backoff = backoff;
exports.resolveTarget = resolveTarget;
exports.authMetadata = authMetadata;
exports.callMetadata = callMetadata;
const node_fs_1 = require("node:fs");
const grpc = require("@grpc/grpc-js");
exports.DEFAULT_ADDRESS = '127.0.0.1:50051';
function retryPolicy(options = {}) {
    const retry = {
        attempts: options.attempts ?? 5,
        firstDelayMs: options.firstDelayMs ?? 50,
        maxDelayMs: options.maxDelayMs ?? 2000,
    };
    if (!Number.isInteger(retry.attempts) || retry.attempts < 1) {
        throw new RangeError(`retry.attempts must be a whole number >= 1, not ${retry.attempts}`);
    }
    return retry;
}
/** The wait before retry `attempt` (0-based): exponential with equal
 * jitter — at least half the delay, so `attempts` and the delays promise a
 * least time the retries ride out (a sidecar restart); with full jitter
 * every wait could be close to nothing and the retries end before the
 * sidecar is back. */
function backoff(retry, attempt) {
    const delay = Math.min(retry.maxDelayMs, retry.firstDelayMs * 2 ** attempt);
    return delay / 2 + Math.random() * (delay / 2);
}
function tlsFromEnv() {
    const env = process.env;
    if (!env.DEDUPD_TLS_CA && !env.DEDUPD_TLS_CLIENT_CERT && !env.DEDUPD_TLS_CLIENT_KEY)
        return undefined;
    const tls = {};
    if (env.DEDUPD_TLS_CA)
        tls.caFile = env.DEDUPD_TLS_CA;
    if (env.DEDUPD_TLS_CLIENT_CERT)
        tls.certFile = env.DEDUPD_TLS_CLIENT_CERT;
    if (env.DEDUPD_TLS_CLIENT_KEY)
        tls.keyFile = env.DEDUPD_TLS_CLIENT_KEY;
    return tls;
}
/** The gRPC target for an address: `host:port`, `http://host:port`,
 * `https://host:port` (TLS) or `unix:///path.sock`; unset: DEDUPD_ADDR,
 * then 127.0.0.1:50051. TLS settings: the argument, else DEDUPD_TLS_*. */
function resolveTarget(address, tlsOption) {
    let target = address || process.env.DEDUPD_ADDR || exports.DEFAULT_ADDRESS;
    let tls = tlsOption ?? tlsFromEnv();
    if (target.startsWith('unix:')) {
        if (tls)
            throw new TypeError(`${target}: TLS is not used on a Unix socket`);
    }
    else if (target.startsWith('https://')) {
        target = target.slice('https://'.length).replace(/\/+$/, '');
        tls = tls ?? {};
    }
    else if (target.startsWith('http://')) {
        target = target.slice('http://'.length).replace(/\/+$/, '');
    }
    else if (target.includes('://')) {
        throw new TypeError(`${JSON.stringify(target)}: use host:port, http://, https:// or unix:///path.sock`);
    }
    const options = {
        // Reconnect soon after the sidecar restarts, not after gRPC's default
        // backoff of up to two minutes.
        'grpc.initial_reconnect_backoff_ms': 100,
        'grpc.max_reconnect_backoff_ms': 2000,
    };
    if (!tls)
        return { target, credentials: grpc.credentials.createInsecure(), options };
    if (Boolean(tls.certFile) !== Boolean(tls.keyFile)) {
        throw new TypeError('TLS: certFile and keyFile go together (mTLS needs both)');
    }
    const read = (file) => (file ? (0, node_fs_1.readFileSync)(file) : null);
    if (tls.serverName)
        options['grpc.ssl_target_name_override'] = tls.serverName;
    return {
        target,
        credentials: grpc.credentials.createSsl(read(tls.caFile), read(tls.keyFile), read(tls.certFile)),
        options,
    };
}
function authMetadata(token) {
    const metadata = new grpc.Metadata();
    const bearer = token ?? process.env.DEDUPD_TOKEN;
    if (bearer)
        metadata.set('authorization', `Bearer ${bearer}`);
    return metadata;
}
let openTelemetry;
function openTelemetryApi() {
    if (openTelemetry === undefined) {
        try {
            openTelemetry = require('@opentelemetry/api');
        }
        catch {
            openTelemetry = null;
        }
    }
    return openTelemetry;
}
/**
 * `base` plus the application's active trace context (W3C `traceparent`,
 * `tracestate`, `baggage`: whatever propagator it registered) when it uses
 * OpenTelemetry, so the sidecar's span joins the caller's trace.
 */
function callMetadata(base) {
    const api = openTelemetryApi();
    if (!api)
        return base;
    const carrier = {};
    api.propagation.inject(api.context.active(), carrier);
    const fields = Object.entries(carrier);
    if (fields.length === 0)
        return base;
    const metadata = base.clone();
    for (const [key, value] of fields)
        metadata.set(key, value);
    return metadata;
}
