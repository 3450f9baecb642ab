'use strict';
// A Kafka-shaped consumer loop with dedupd: each poll's batch is claimed in
// one call (one disk sync), the new records processed, the batch committed
// in one call, then the offsets. Works with any client whose poll yields
// records with an ID and a value (kafkajs' eachBatch, node-rdkafka, …).

/** Processes one polled batch; `retry` lists the IDs not done (held by
 * another consumer, failed or lost): do not commit the offset past the
 * first of them. */
async function processBatch(dedup, records, handle) {
  const outcome = { processed: [], duplicates: [], retry: [] };
  const claims = await dedup.claimMany(records.map((record) => record.correlationId));
  const done = [];
  const failed = [];
  for (const [index, claimed] of claims.entries()) {
    const record = records[index];
    if (claimed instanceof Error) {
      // InProgress: someone else has it; Stale / FingerprintMismatch: skip.
      (claimed.name === 'InProgress' ? outcome.retry : outcome.duplicates).push(record.correlationId);
    } else if (claimed.duplicate) {
      outcome.duplicates.push(record.correlationId);
    } else {
      try {
        done.push([claimed, await handle(claimed, record)]);
      } catch {
        failed.push(claimed);
        outcome.retry.push(record.correlationId);
      }
    }
  }
  if (failed.length) await dedup.releaseMany(failed);
  if (done.length) {
    const results = await dedup.commitMany(done);
    results.forEach((result, index) => {
      const id = done[index][0].correlationId;
      (result instanceof Error ? outcome.retry : outcome.processed).push(id);
    });
  }
  return outcome;
}

module.exports = { processBatch };
