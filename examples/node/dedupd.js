'use strict';
// A small Node.js helper for the dedupd sidecar. The service definition is
// loaded from proto/dedup/v1/dedup.proto at start-up (@grpc/proto-loader).
//
//   const dedup = new Dedup({ address: '127.0.0.1:50051', namespace: 'payments' });
//   const result = await dedup.process(event.correlationId, async (claim) => handle(event, claim));
//
// `process` claims the ID, runs the handler while renewing the lease, commits
// with the handler's result and returns it; a duplicate returns the result
// cached by the first commit without calling the handler; if the handler
// throws, the claim is released and the error rethrown.

const path = require('node:path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const PROTO_ROOT = path.resolve(__dirname, '..', '..', 'proto');
const definition = protoLoader.loadSync(path.join(PROTO_ROOT, 'dedup/v1/dedup.proto'), {
  includeDirs: [PROTO_ROOT],
  keepCase: true,
  longs: Number,
  enums: String,
  defaults: true,
});
const { ClaimAndCommit } = grpc.loadPackageDefinition(definition).dedup.v1;

class DedupError extends Error {}
class InProgress extends DedupError {
  constructor(retryAfterMs) {
    super(`in progress elsewhere; retry after ${retryAfterMs} ms`);
    this.retryAfterMs = retryAfterMs;
  }
}
class Stale extends DedupError {
  constructor(highestCommittedSequence) {
    super(`stale: sequence ${highestCommittedSequence} already committed`);
    this.highestCommittedSequence = highestCommittedSequence;
  }
}
class FingerprintMismatch extends DedupError {}
class LeaseLost extends DedupError {}

const duration = (ms) => ({ seconds: Math.floor(ms / 1000), nanos: (ms % 1000) * 1e6 });
const millis = (d) => (d ? Number(d.seconds) * 1000 + Math.round(d.nanos / 1e6) : 0);

class Dedup {
  constructor({
    address = process.env.DEDUPD_ADDR || '127.0.0.1:50051',
    namespace = '',
    owner = '',
    consumerVersion = '',
    leaseMs = 30000,
    token,
  } = {}) {
    this.client = new ClaimAndCommit(address, grpc.credentials.createInsecure());
    this.namespace = namespace;
    this.owner = owner;
    this.consumerVersion = consumerVersion;
    this.leaseMs = leaseMs;
    this.metadata = new grpc.Metadata();
    if (token) this.metadata.set('authorization', `Bearer ${token}`);
  }

  close() {
    this.client.close();
  }

  call(method, request) {
    return new Promise((resolve, reject) => {
      this.client[method](request, this.metadata, (error, response) =>
        error ? reject(error) : resolve(response));
    });
  }

  claimRaw(correlationId, fields = {}) {
    return this.call('Claim', {
      namespace: this.namespace,
      correlation_id: correlationId,
      owner: this.owner,
      consumer_version: this.consumerVersion,
      lease_ttl: duration(this.leaseMs),
      ...fields,
    });
  }

  async commit(claim, response) {
    try {
      return await this.call('Commit', {
        namespace: claim.namespace,
        correlation_id: claim.correlationId,
        lease_token: claim.leaseToken,
        response: response == null ? Buffer.alloc(0) : Buffer.from(response),
      });
    } catch (error) {
      if (error.code === grpc.status.FAILED_PRECONDITION) throw new LeaseLost(error.details);
      throw error;
    }
  }

  async release(claim) {
    try {
      await this.call('Release', {
        namespace: claim.namespace,
        correlation_id: claim.correlationId,
        lease_token: claim.leaseToken,
      });
    } catch (error) {
      if (error.code !== grpc.status.FAILED_PRECONDITION) throw error;
    }
  }

  renew(claim) {
    return this.call('Renew', {
      namespace: claim.namespace,
      correlation_id: claim.correlationId,
      lease_token: claim.leaseToken,
      lease_ttl: duration(this.leaseMs),
    });
  }

  // Runs `handler(claim)` at most once per correlation ID; resolves to its
  // result as a Buffer (or the cached result of the first run).
  async process(correlationId, handler, fields = {}) {
    const answer = await this.claimRaw(correlationId, fields);
    switch (answer.outcome) {
      case 'CLAIM_OUTCOME_DUPLICATE':
        return answer.record.response;
      case 'CLAIM_OUTCOME_IN_PROGRESS':
        throw new InProgress(millis(answer.retry_after));
      case 'CLAIM_OUTCOME_STALE':
        throw new Stale(answer.highest_committed_sequence);
      case 'CLAIM_OUTCOME_FINGERPRINT_MISMATCH':
        throw new FingerprintMismatch(correlationId);
      case 'CLAIM_OUTCOME_CLAIMED':
        break;
      default:
        throw new DedupError(`unexpected outcome ${answer.outcome}`);
    }
    const claim = {
      namespace: answer.record.namespace,
      correlationId,
      leaseToken: answer.lease_token,
      fencingToken: answer.fencing_token,
      attempt: answer.attempt,
      recovered: answer.recovered,
    };
    // Renew every third of the lease while the handler runs.
    const heartbeat = setInterval(() => this.renew(claim).catch(() => {}), this.leaseMs / 3);
    let result;
    try {
      result = await handler(claim);
    } catch (error) {
      clearInterval(heartbeat);
      await this.release(claim);
      throw error;
    }
    clearInterval(heartbeat);
    const committed = await this.commit(claim, result);
    return committed.record.response;
  }
}

module.exports = { Dedup, DedupError, InProgress, Stale, FingerprintMismatch, LeaseLost };
