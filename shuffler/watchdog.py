"""The service's watchdog: a Submit or Fetch whose peer stalls is cancelled (DEADLINE_EXCEEDED), so that it
cannot hold a worker thread for good (:mod:`shuffledp.shuffler.service`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc

__all__ = ["IdleWatchdog", "watched"]


class _IdleWatchdog:
    """Cancels a call that waits on its peer for more than ``timeout`` seconds (status DEADLINE_EXCEEDED).

    One thread per call polls how long the handler has been waiting *on the peer*: for a Submit, for the next
    message to arrive whole (:func:`_watched`); for a Fetch, for gRPC to take the last message (its flow control
    blocks the handler thread until the part of the message beyond the peer's window has been read, so a large
    message on a slow link is allowed its transfer time at ``fetch_min_rate`` on top). A stalled peer would
    otherwise hold a worker thread forever. Time the shuffler spends itself (staging, zero-fill, waiting for the
    core's locks, sealing and committing after the last message, reading the output) never counts. A context
    manager: leaving the ``with`` block stops the thread.
    """

    def __init__(self, context: grpc.ServicerContext, timeout: float, reason: str, what: str, *,
                 max_duration: float | None = None) -> None:
        self._context = context
        self._timeout = timeout
        self._reason, self._what = reason, what
        self.since = time.monotonic()
        #: ``max_duration``: the call is also cancelled once it has been open this long (checked only while it
        #: waits on the peer, so the shuffler's own sealing and committing are never cut short)
        self._deadline = None if max_duration is None else self.since + max_duration
        self._max_duration = max_duration
        self.fired_reason = ""
        self.allowance = timeout
        self.waiting = False
        self.fired = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=reason, daemon=True)
        self._thread.start()

    def wait_begins(self, extra: float = 0.0) -> None:
        """The handler starts waiting on the peer; ``extra`` seconds are allowed on top of the timeout for this
        wait (a Fetch message's transfer time at the slowest rate accepted)."""
        self.since = time.monotonic()
        self.allowance = self._timeout + extra
        self.waiting = True

    def wait_ends(self) -> None:
        self.waiting = False

    def _run(self) -> None:
        step = max(0.05, min(1.0, self._timeout / 4))
        while not self._stop.wait(step):
            now = time.monotonic()
            overdue = self._deadline is not None and now > self._deadline
            if self.waiting and (now - self.since > self.allowance or overdue):
                self.fired = True
                if overdue:
                    self.fired_reason = "submit_duration"
                    details = f"submit_duration: the stream stayed open for more than {self._max_duration:.3g} s"
                else:
                    self.fired_reason = self._reason
                    details = f"{self._reason}: {self._what} for {self.allowance:.3g} s"
                try:  # cancel with a specific status (grpc's server call object accepts one)
                    self._context._rpc_event.call.cancel(  # type: ignore[attr-defined] - grpc private; fallback below
                        grpc._cython.cygrpc.StatusCode.deadline_exceeded, details
                    )
                except (AttributeError, TypeError):
                    self._context.cancel()
                return

    def stop(self) -> None:
        self._stop.set()

    def __enter__(self) -> "_IdleWatchdog":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _watched(iterator: Iterator[Any], dog: _IdleWatchdog) -> Iterator[Any]:
    """The items of ``iterator``, with ``dog`` told when each wait for the next one begins and ends."""
    it = iter(iterator)
    while True:
        dog.wait_begins()
        try:
            item = next(it)
        except StopIteration:
            return
        finally:
            dog.wait_ends()
        yield item


IdleWatchdog = _IdleWatchdog
watched = _watched
