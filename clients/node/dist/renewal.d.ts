import type { Claim } from './client';
/** One running handler's claim, as the renewer sees it. */
export interface Watch {
    readonly claim: Claim;
    /** Aborted (with the LeaseLost) when a renewal finds the lease lost. */
    readonly lease: AbortController;
    /** When its next renewal is due (ms on `performance.now()`'s clock:
     * monotonic, so a wall clock stepped back never delays a renewal). */
    due: number;
    /** A renewal of it is in flight: never two at once. */
    renewing: boolean;
    /** The work is over: a late answer to a renewal is ignored. */
    ended: boolean;
}
export declare class Renewals {
    private readonly beatMs;
    private readonly renew;
    private readonly watches;
    private timer;
    private closed;
    /** `renew` sends one renewal with a deadline of at most `beatMs`. */
    constructor(beatMs: number, renew: (claim: Claim) => Promise<void>);
    /** Starts watching a claim whose handler is about to run. */
    watch(claim: Claim, lease: AbortController): Watch;
    /** The handler is over: no renewal is sent for it from now on. */
    end(watch: Watch): void;
    /** The client is closed: nothing is renewed any more. */
    close(): void;
    private arm;
    private look;
    private failed;
}
