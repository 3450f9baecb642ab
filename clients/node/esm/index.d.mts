export * from '../dist/index.js';
import * as dedupd from '../dist/index.js';
export default dedupd;
