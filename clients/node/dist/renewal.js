"use strict";
// Lease renewal for process(): one timer per client, not one per claim.
//
// Most handlers end long before a third of their lease, so a claim costs a
// Set insertion and a deletion here; only work that outlives a beat (a third
// of the lease) is renewed. The timer looks every quarter beat while claims
// are watched, so a renewal is sent between 1 and 1¼ beats after the last
// one — well inside the lease's three — and stops looking once nothing is
// watched. While a handler runs the timer holds the process alive (as work
// in progress should); once none runs it is unref'd, so an idle client
// never keeps a process from exiting and ending a handler clears nothing.
Object.defineProperty(exports, "__esModule", { value: true });
exports.Renewals = void 0;
const errors_1 = require("./errors");
class Renewals {
    beatMs;
    renew;
    watches = new Set();
    timer;
    closed = false;
    /** `renew` sends one renewal with a deadline of at most `beatMs`. */
    constructor(beatMs, renew) {
        this.beatMs = beatMs;
        this.renew = renew;
    }
    /** Starts watching a claim whose handler is about to run. */
    watch(claim, lease) {
        const watch = { claim, lease, due: performance.now() + this.beatMs, renewing: false, ended: false };
        // After close(): the call will fail on the closed channel; nothing to renew.
        if (this.closed)
            return watch;
        this.watches.add(watch);
        if (this.timer === undefined)
            this.arm();
        else if (this.watches.size === 1)
            this.timer.ref();
        return watch;
    }
    /** The handler is over: no renewal is sent for it from now on. */
    end(watch) {
        watch.ended = true;
        if (this.watches.delete(watch) && this.watches.size === 0)
            this.timer?.unref();
    }
    /** The client is closed: nothing is renewed any more. */
    close() {
        this.closed = true;
        if (this.timer !== undefined)
            clearTimeout(this.timer);
        this.timer = undefined;
        for (const watch of this.watches)
            watch.ended = true;
        this.watches.clear();
    }
    arm() {
        this.timer = setTimeout(() => this.look(), this.beatMs / 4);
    }
    look() {
        this.timer = undefined;
        const now = performance.now();
        for (const watch of this.watches) {
            if (watch.renewing || watch.due > now)
                continue;
            watch.renewing = true;
            // Timed from when it is sent, as the lease it asks for is.
            watch.due = now + this.beatMs;
            this.renew(watch.claim).then(() => {
                watch.renewing = false;
            }, (error) => this.failed(watch, error, now));
        }
        if (this.watches.size > 0)
            this.arm();
    }
    failed(watch, error, sentAt) {
        watch.renewing = false;
        if (watch.ended)
            return; // the work is over: nothing to abort
        if (error instanceof errors_1.LeaseLost) {
            this.end(watch);
            watch.lease.abort(error);
        }
        else {
            // Unavailable, a deadline: again a quarter beat after the failed
            // one was sent. A renewal waits at most a beat, so at least half a
            // beat of the lease is left for the retry.
            watch.due = sentAt + this.beatMs / 4;
        }
    }
}
exports.Renewals = Renewals;
