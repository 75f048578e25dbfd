"""The round of the in-process path (:mod:`shuffledp.deploy.inprocess`) after the clients' local computation: the
clients' batch report path, the optional shuffler, the server's batch decode into the O(model) running sum and
the server optimizer's step, timed per phase.

Each chunk of updates is randomized with :func:`shuffledp.clients.core.payloads_from_updates` (the pinned
mechanism's ``randomize_batch``; the apps' ``randomize`` is its batch of one) and decoded with the run's
mechanism's ``decode_batch`` (the apps' ``decode`` is its batch of one) into
:meth:`shuffledp.server.optim.ReportAccumulator.add_batch`, then dropped: the server side holds one chunk of
reports at a time. With a shuffler (:class:`ReportExchange`), the round's reports are held until the exchange.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields
from typing import Any, Protocol

import numpy as np

from shuffledp.clients.core import payloads_from_updates
from shuffledp.clients.mechanism import Mechanism
from shuffledp.clients.messages import TrainConfig
from shuffledp.clients.noise import ChaCha20Rng
from shuffledp.clients.settings import PinnedSettings
from shuffledp.server.optim import ReportAccumulator, ServerOptimizer

__all__ = ["PhaseTimes", "ReportExchange", "report_round"]


@dataclass
class PhaseTimes:
    """Seconds spent per phase (summed over the rounds run).

    Attributes:
        updates: the clients' local computation (:func:`client_updates`).
        randomize: the clients' report path (clip, randomize, encode).
        shuffle: sealing, the shuffler process and opening (``through_shuffler`` only).
        decode: the server's decode into the running sum.
        step: the server optimizer's step.
        evaluate: central evaluation on the public and test splits.
    """

    updates: float = 0.0
    randomize: float = 0.0
    shuffle: float = 0.0
    decode: float = 0.0
    step: float = 0.0
    evaluate: float = 0.0

    def as_dict(self) -> dict[str, float]:
        """Returns the phases and their seconds."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


class ReportExchange(Protocol):
    """What ``through_shuffler`` uses: one round's payloads in, the permuted payloads the server opened out
    (:class:`shuffledp.deploy.sweep_shuffler.ShufflerExchange`)."""

    def exchange(self, payloads: Sequence[bytes], arrays: Sequence[np.ndarray], round_id: int) -> list[bytes]:
        """Seal, shuffle and open one round's reports; returns the opened payloads in the shuffler's order."""
        ...


def _timed(chunks: Iterator[np.ndarray], times: PhaseTimes) -> Iterator[np.ndarray]:
    """``chunks``, with the time spent producing them counted as the clients' local computation."""
    while True:
        t0 = time.perf_counter()
        try:
            chunk = next(chunks)
        except StopIteration:
            return
        times.updates += time.perf_counter() - t0
        yield chunk


def report_round(arrays: Sequence[np.ndarray], chunks: Iterator[np.ndarray], dim: int, cfg: TrainConfig,
                 pinned: PinnedSettings, decoder: Mechanism, optimizer: ServerOptimizer, *,
                 rng: ChaCha20Rng | None = None, times: PhaseTimes | None = None,
                 shuffler: ReportExchange | None = None, workers: int = 1) -> list[np.ndarray]:
    """One round after (or interleaved with) the local computation (module docstring).

    Args:
        arrays: the round's model.
        chunks: the clients' unclipped updates, chunk by chunk (``(m, dim)`` each); the time spent producing them
            is counted as ``updates``.
        dim: the model's number of parameters.
        cfg: the round's config (its ``round`` is the id the shuffler binds); pinned: the clients' settings.
        decoder: the server's mechanism; optimizer: the server optimizer (its state carries over rounds).
        rng: tests only: a keyed ChaCha20 stream for the clients' mechanism (default: the pinned mechanism's).
        times: where to add the phases' seconds.
        shuffler: send the round's reports through it (default: none).
        workers: threads that randomize and decode chunks while this thread computes the next chunk's updates
            (1: everything in this thread, chunk after chunk). With more, ``randomize`` and ``decode`` are
            thread-seconds and the chunks draw from the CSPRNG in whatever order the threads reach it (each
            keystream byte is still used once, so every report keeps its law); a keyed ``rng`` then no longer
            fixes the reports, so tests use 1. At most ``workers`` chunks are in flight (memory).

    Returns:
        The model after the round.

    Raises:
        RuntimeError: a report was refused by the decoder (an honest client's report always decodes).
        ValueError: ``workers`` < 1.
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    times = times if times is not None else PhaseTimes()
    acc = ReportAccumulator(dim)

    def decode(reports: Any) -> tuple[np.ndarray, float]:
        t0 = time.perf_counter()
        batch = decoder.decode_batch(reports, dim)
        if batch.refused:  # an honest client's report always decodes: a refusal is a bug, not noise
            why = next(iter(batch.refused.values()))
            raise RuntimeError(f"{len(batch.refused)} reports were refused, e.g. {why}")
        return batch.values, time.perf_counter() - t0

    def work(updates: np.ndarray) -> tuple[np.ndarray, float, float]:
        t0 = time.perf_counter()
        reports = payloads_from_updates(arrays, cfg, pinned, updates, rng=rng)
        t_randomize = time.perf_counter() - t0
        values, t_decode = decode(reports)
        return values, t_randomize, t_decode

    def collect(done: tuple[np.ndarray, float, float]) -> None:
        values, t_randomize, t_decode = done
        t0 = time.perf_counter()
        acc.add_batch(values)
        times.randomize += t_randomize
        times.decode += t_decode + time.perf_counter() - t0

    if shuffler is not None:
        held: list[bytes] = []  # the round's payloads, until the exchange
        for updates in _timed(chunks, times):
            t0 = time.perf_counter()
            held.extend(row.tobytes() for row in payloads_from_updates(arrays, cfg, pinned, updates, rng=rng))
            times.randomize += time.perf_counter() - t0
        t0 = time.perf_counter()
        opened = shuffler.exchange(held, arrays, cfg.round)
        times.shuffle += time.perf_counter() - t0
        values, t_decode = decode(opened)
        collect((values, 0.0, t_decode))
    elif workers == 1:
        for updates in _timed(chunks, times):
            collect(work(updates))
    else:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            flight: deque[Future[tuple[np.ndarray, float, float]]] = deque()
            for updates in _timed(chunks, times):
                flight.append(pool.submit(work, updates))
                while len(flight) >= workers:
                    collect(flight.popleft().result())
            while flight:
                collect(flight.popleft().result())
    t0 = time.perf_counter()
    out = optimizer.step(arrays, acc.mean())
    times.step += time.perf_counter() - t0
    return out
