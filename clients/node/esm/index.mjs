// The ES module face of @dedupd/client: the CommonJS build, re-exported (one
// copy of the code, so `instanceof` works whichever way it was loaded).
import dedupd from '../dist/index.js';

export const { Client, DedupError, FingerprintMismatch, InProgress, LeaseLost, ResponseErased, Stale, Unavailable } = dedupd;
export default dedupd;
