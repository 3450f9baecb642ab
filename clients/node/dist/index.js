"use strict";
// @dedupd/client: the Node.js client of the dedupd deduplication sidecar.
//
//   const { Client } = require('@dedupd/client');   // or: import { Client } from '@dedupd/client'
//   const dedup = new Client({ namespace: 'payments' });
//   const result = await dedup.process(event.correlationId, async (claim, signal) => handle(event, claim, signal));
Object.defineProperty(exports, "__esModule", { value: true });
exports.Unavailable = exports.Stale = exports.ResponseErased = exports.LeaseLost = exports.InProgress = exports.FingerprintMismatch = exports.DedupError = exports.Client = void 0;
var client_1 = require("./client");
Object.defineProperty(exports, "Client", { enumerable: true, get: function () { return client_1.Client; } });
var errors_1 = require("./errors");
Object.defineProperty(exports, "DedupError", { enumerable: true, get: function () { return errors_1.DedupError; } });
Object.defineProperty(exports, "FingerprintMismatch", { enumerable: true, get: function () { return errors_1.FingerprintMismatch; } });
Object.defineProperty(exports, "InProgress", { enumerable: true, get: function () { return errors_1.InProgress; } });
Object.defineProperty(exports, "LeaseLost", { enumerable: true, get: function () { return errors_1.LeaseLost; } });
Object.defineProperty(exports, "ResponseErased", { enumerable: true, get: function () { return errors_1.ResponseErased; } });
Object.defineProperty(exports, "Stale", { enumerable: true, get: function () { return errors_1.Stale; } });
Object.defineProperty(exports, "Unavailable", { enumerable: true, get: function () { return errors_1.Unavailable; } });
