// Compiled with `tsc --noEmit` only: the published types, through the
// package's own "exports" (require condition), used as an application would.
import { Client, InProgress, LeaseLost, Stale, type Claim, type DedupRecord } from '@dedupd/client';

async function consume(client: Client, correlationId: string): Promise<Buffer | 'retry' | 'skip'> {
  try {
    return await client.process(correlationId, async (claim: Claim, signal: AbortSignal) => {
      const fencing: bigint = claim.fencingToken;
      signal.throwIfAborted();
      return `fenced by ${fencing}`;
    }, { eventType: 'PaymentReceived', orderingKey: 'acct', sequence: 2n ** 60n });
  } catch (error) {
    if (error instanceof InProgress) return error.retryAfterMs > 0 ? 'retry' : 'retry';
    if (error instanceof Stale) {
      const highest: bigint = error.highestCommittedSequence;
      return highest > 0n ? 'skip' : 'skip';
    }
    throw error;
  }
}

async function batch(client: Client): Promise<number> {
  const claims = await client.claimMany(['a', 'b']);
  const fresh = claims.filter((c): c is Claim => !(c instanceof Error) && !c.duplicate);
  const records = await client.commitMany(fresh.map((claim) => [claim, 'done'] as const));
  return records.filter((r): r is DedupRecord => !(r instanceof LeaseLost)).length;
}

const client = new Client({ address: 'unix:///run/dedupd/dedupd.sock', leaseMs: 10_000, retry: { attempts: 3 } });
void consume(client, 'x');
void batch(client);
// @ts-expect-error: fencing tokens are bigint, not number
const wrong: number = ({} as Claim).fencingToken;
void wrong;
