"""Lease renewal for the synchronous client: one thread per client renews
every claim whose work is still running a third of a lease (a beat) after it
was claimed or last renewed. A claim costs a heap push and a flag when its
work ends, not a thread: a handler that finishes within a beat never causes
a renewal, a wake-up or a lock wait on another thread.

The thread sleeps until the earliest claim is due, and at most one beat when
there is none: a claim watched later is due a beat after it was watched, so
no wake-up is owed to it (one due sooner wakes it). It exits once nothing
has been left to renew for a beat, and the next claim starts it again: an
idle client holds no thread, and one dropped without `close()` can be
collected. Renewals are sent without waiting (gRPC futures, each with a
deadline of at most a beat), so one slow sidecar answer never delays the
others. The next renewal is
timed from when the last one was sent; a refused renewal marks the claim
`lease_lost`; any other failure is tried again a quarter beat later, so a
lease gets several tries before it runs out. After `os.fork()` the child
starts afresh (the parent's thread does not exist there)."""

from __future__ import annotations

import heapq
import itertools
import os
import threading
import time
import weakref
from typing import Any, Callable, List, Optional, Tuple

from dedupd._protocol import Claim

#: Renews one claim without waiting, with a deadline: a gRPC future.
SendRenewal = Callable[[Claim, float], Any]


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
        self._closed = False
        self._start_afresh()
        me = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: _after_fork(me))

    def _start_afresh(self) -> None:
        self._lock = threading.Lock()
        self._due: List[Tuple[float, int, Watch]] = []
        #: Watches that ended while in `_due` (about: see `_schedule`).
        self._ended = 0
        self._order = itertools.count()
        #: When the thread will next look (it is told only of earlier claims).
        self._looks_at = float("inf")
        self._wake = threading.Event()
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
                self._looks_at = due
                self._thread = threading.Thread(target=self._run, name="dedupd-renewal", daemon=True)
                self._thread.start()
            elif due < self._looks_at:
                self._wake.set()

    def _run(self) -> None:
        idle = False
        while True:
            due_now: List[Watch] = []
            with self._lock:
                if self._closed or threading.current_thread() is not self._thread:
                    return
                now = time.monotonic()
                while self._due and (self._due[0][2].ended or self._due[0][0] <= now):
                    _, _, watch = heapq.heappop(self._due)
                    if watch.ended:
                        self._ended -= 1
                    else:
                        due_now.append(watch)
                if self._due or due_now:
                    idle = False
                elif idle:
                    # Nothing to renew for a whole beat: leave; the next
                    # claim starts a thread. (Not at once: a client whose
                    # claims each end quickly would start one per claim.)
                    self._thread = None
                    self._ended = 0
                    return
                else:
                    idle = True
                self._looks_at = self._due[0][0] if self._due else now + self._beat()
                wait = self._looks_at - now
            for watch in due_now:
                self._renew(watch)
            if not due_now:
                self._wake.wait(wait)
                self._wake.clear()

    def _renew(self, watch: Watch) -> None:
        if watch.ended:
            return
        beat = self._beat()
        sent = time.monotonic()
        try:
            future = self._send(watch.claim, beat)
        except Exception:  # noqa: BLE001 - a renewal that could not start is tried again
            self._schedule(watch, sent + beat / 4)
            return
        future.add_done_callback(lambda done: self._renewed(watch, done, sent, beat))

    def _renewed(self, watch: Watch, done: Any, sent: float, beat: float) -> None:
        # On gRPC's thread (or this one, if the answer was already in): an
        # exception here would end that thread, so none escapes.
        try:
            error = None if done.cancelled() else done.exception()
            if watch.ended:
                return  # Work over: a refusal now (the commit won) means nothing.
            if error is not None and self._is_lease_lost(error):
                watch.claim.lease_lost = True
                return  # The commit will be refused and say so.
            if error is None:
                self._schedule(watch, sent + beat)
            else:
                self._schedule(watch, time.monotonic() + beat / 4)
        except Exception:  # noqa: BLE001 - keep renewing the others
            self._schedule(watch, time.monotonic() + beat / 4)


def _after_fork(renewer: "weakref.ref[Renewer]") -> None:
    """In a forked child: the parent's thread and lock state do not carry
    over; claims made there start a thread of their own."""
    alive = renewer()
    if alive is not None:
        alive._start_afresh()
