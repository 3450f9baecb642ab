// The same types through the "import" condition (ESM consumers).
import dedupd, { Client, type Claim } from '@dedupd/client';

const client: Client = new dedupd.Client({ namespace: 'esm' });
const handler = (claim: Claim): string => claim.correlationId;
void client.process('x', handler);
