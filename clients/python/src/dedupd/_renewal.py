"""Lease renewal for the synchronous client: one thread per client renews
every claim whose work is still running a third of a lease after it was
claimed (or last renewed). A claim costs a heap push and a flag when its work
ends, not a thread: a handler that finishes within a third of its lease never
causes a renewal, a wake-up or a lock wait on another thread.

The thread sleeps until the earliest claim is due, and at most one beat
(a third of the lease) when there is none: a claim watched later is due a
beat after it was watched, so no wake-up is owed to it. Renewals are sent
without waiting (gRPC futures), so one slow sidecar answer never delays the
others; a refused renewal marks the claim `lease_lost`, any other failure
is tried again a beat later (the lease has two left)."""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from typing import Any, Callable, List, Optional, Tuple

from dedupd._protocol import Claim

#: Renews one claim without waiting: a gRPC future (or raises at once).
SendRenewal = Callable[[Claim], Any]


class Watch:
    """One claim whose work is running; `ended` once it is not."""

    __slots__ = ("claim", "ended")

    def __init__(self, claim: Claim) -> None:
        self.claim = claim
        self.ended = False


class Renewer:
    """Renews the leases of watched claims every `beat()` seconds."""

    def __init__(self, send: SendRenewal, beat: Callable[[], float], is_lease_lost: Callable[[Any], bool]) -> None:
        self._send = send
        self._beat = beat
        self._is_lease_lost = is_lease_lost
        self._lock = threading.Lock()
        self._due: List[Tuple[float, int, Watch]] = []
        #: Watches that ended while in `_due` (about: see `_schedule`).
        self._ended = 0
        self._order = itertools.count()
        #: When the thread will next look (it is told only of earlier claims).
        self._looks_at = float("inf")
        self._wake = threading.Event()
        self._closed = False
        self._thread: Optional[threading.Thread] = None

    def watch(self, claim: Claim) -> Watch:
        """Renews `claim` a beat from now, and every beat, until `end`."""
        watch = Watch(claim)
        self._schedule(watch, time.monotonic() + self._beat())
        return watch

    def end(self, watch: Watch) -> None:
        """The claim's work is over: no more renewals."""
        with self._lock:
            watch.ended = True
            self._ended += 1

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._due.clear()
        self._wake.set()

    def _schedule(self, watch: Watch, due: float) -> None:
        with self._lock:
            if self._closed or watch.ended:
                return
            heapq.heappush(self._due, (due, next(self._order), watch))
            # An ended watch stays until it comes due or the heap is rebuilt
            # without it, once ended ones are most of it: so the heap holds
            # about the running claims, not every claim of the last beat
            # (thousands of objects the garbage collector would scan again
            # and again).
            if self._ended > 64 and 2 * self._ended > len(self._due):
                self._due = [entry for entry in self._due if not entry[2].ended]
                heapq.heapify(self._due)
                self._ended = 0
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="dedupd-renewal", daemon=True)
                self._thread.start()
            elif due < self._looks_at:
                self._wake.set()

    def _run(self) -> None:
        while True:
            due_now: List[Watch] = []
            with self._lock:
                if self._closed:
                    return
                now = time.monotonic()
                while self._due and (self._due[0][2].ended or self._due[0][0] <= now):
                    _, _, watch = heapq.heappop(self._due)
                    if watch.ended:
                        self._ended -= 1
                    else:
                        due_now.append(watch)
                self._looks_at = self._due[0][0] if self._due else now + self._beat()
                wait = self._looks_at - now
            for watch in due_now:
                self._renew(watch)
            if not due_now:
                self._wake.wait(wait)
                self._wake.clear()

    def _renew(self, watch: Watch) -> None:
        try:
            future = self._send(watch.claim)
        except Exception:  # noqa: BLE001 - a renewal that could not start is tried again
            self._schedule(watch, time.monotonic() + self._beat())
            return
        future.add_done_callback(lambda done: self._renewed(watch, done))

    def _renewed(self, watch: Watch, done: Any) -> None:
        error = done.exception()
        if error is not None and self._is_lease_lost(error):
            watch.claim.lease_lost = True
            return  # The commit will be refused and say so.
        if not watch.ended:
            self._schedule(watch, time.monotonic() + self._beat())
