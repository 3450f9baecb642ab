// How a client reaches the sidecar: the address (DEDUPD_ADDR), TLS, the
// bearer token and the caller's trace context, and the retry policy for
// UNAVAILABLE.

import { readFileSync } from 'node:fs';
import * as grpc from '@grpc/grpc-js';

export const DEFAULT_ADDRESS = '127.0.0.1:50051';

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

export function retryPolicy(options: RetryOptions = {}): Retry {
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
export function backoff(retry: Retry, attempt: number): number {
  const delay = Math.min(retry.maxDelayMs, retry.firstDelayMs * 2 ** attempt);
  return delay / 2 + Math.random() * (delay / 2);
}

function tlsFromEnv(): TlsOptions | undefined {
  const env = process.env;
  if (!env.DEDUPD_TLS_CA && !env.DEDUPD_TLS_CLIENT_CERT && !env.DEDUPD_TLS_CLIENT_KEY) return undefined;
  const tls: TlsOptions = {};
  if (env.DEDUPD_TLS_CA) tls.caFile = env.DEDUPD_TLS_CA;
  if (env.DEDUPD_TLS_CLIENT_CERT) tls.certFile = env.DEDUPD_TLS_CLIENT_CERT;
  if (env.DEDUPD_TLS_CLIENT_KEY) tls.keyFile = env.DEDUPD_TLS_CLIENT_KEY;
  return tls;
}

export interface Target {
  target: string;
  credentials: grpc.ChannelCredentials;
  options: grpc.ChannelOptions;
}

/** The gRPC target for an address: `host:port`, `http://host:port`,
 * `https://host:port` (TLS) or `unix:///path.sock`; unset: DEDUPD_ADDR,
 * then 127.0.0.1:50051. TLS settings: the argument, else DEDUPD_TLS_*. */
export function resolveTarget(address: string | undefined, tlsOption: TlsOptions | undefined): Target {
  let target = address || process.env.DEDUPD_ADDR || DEFAULT_ADDRESS;
  let tls = tlsOption ?? tlsFromEnv();
  if (target.startsWith('unix:')) {
    if (tls) throw new TypeError(`${target}: TLS is not used on a Unix socket`);
  } else if (target.startsWith('https://')) {
    target = target.slice('https://'.length).replace(/\/+$/, '');
    tls = tls ?? {};
  } else if (target.startsWith('http://')) {
    target = target.slice('http://'.length).replace(/\/+$/, '');
  } else if (target.includes('://')) {
    throw new TypeError(`${JSON.stringify(target)}: use host:port, http://, https:// or unix:///path.sock`);
  }
  const options: grpc.ChannelOptions = {
    // Reconnect soon after the sidecar restarts, not after gRPC's default
    // backoff of up to two minutes.
    'grpc.initial_reconnect_backoff_ms': 100,
    'grpc.max_reconnect_backoff_ms': 2000,
  };
  if (!tls) return { target, credentials: grpc.credentials.createInsecure(), options };
  if (Boolean(tls.certFile) !== Boolean(tls.keyFile)) {
    throw new TypeError('TLS: certFile and keyFile go together (mTLS needs both)');
  }
  const read = (file: string | undefined) => (file ? readFileSync(file) : null);
  if (tls.serverName) options['grpc.ssl_target_name_override'] = tls.serverName;
  return {
    target,
    credentials: grpc.credentials.createSsl(read(tls.caFile), read(tls.keyFile), read(tls.certFile)),
    options,
  };
}

export function authMetadata(token: string | undefined): grpc.Metadata {
  const metadata = new grpc.Metadata();
  const bearer = token ?? process.env.DEDUPD_TOKEN;
  if (bearer) metadata.set('authorization', `Bearer ${bearer}`);
  return metadata;
}

// The part of @opentelemetry/api the client uses: the application's, looked
// up at run time, so it stays an optional peer dependency.
interface OpenTelemetryApi {
  context: { active(): unknown };
  propagation: { inject(context: unknown, carrier: Record<string, string>): void };
}

let openTelemetry: OpenTelemetryApi | null | undefined;

function openTelemetryApi(): OpenTelemetryApi | null {
  if (openTelemetry === undefined) {
    try {
      openTelemetry = require('@opentelemetry/api') as OpenTelemetryApi;
    } catch {
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
export function callMetadata(base: grpc.Metadata): grpc.Metadata {
  const api = openTelemetryApi();
  if (!api) return base;
  const carrier: Record<string, string> = {};
  api.propagation.inject(api.context.active(), carrier);
  const fields = Object.entries(carrier);
  if (fields.length === 0) return base;
  const metadata = base.clone();
  for (const [key, value] of fields) metadata.set(key, value);
  return metadata;
}
