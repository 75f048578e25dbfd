"""A charged round's release, from the shuffler's attestation to the round's sum of reports.

* :func:`check_attestation`: the signed attestation must name the batch the server submitted (round, key epoch,
  model digest, at most the envelopes sent) before anything is charged or fetched;
* :func:`open_release`: the permuted inner ciphertexts stream back; each is opened on its own (one that fails to
  open is counted and skipped), the opened payloads are decoded a chunk at a time with the run's mechanism
  (``Mechanism.decode_batch``: a malformed report is a refused row, counted and left out, never raised) and the
  valid rows are added to a running sum. Memory is O(chunk * d) (:func:`chunk_rows`), never the whole batch;
* :func:`no_cover_accountant` and :func:`note_bad_reports`: the reports that failed to open or decode came from a
  broken or malicious enrolled client (an honest client's report always opens), so the run also bounds its privacy
  with them taken out of each round's n.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shuffledp.accounting import RefusedError
from shuffledp.accounting.accountant import ShuffleAccountant
from shuffledp.accounting.events import ShuffleRound
from shuffledp.clients.mechanism import Mechanism
from shuffledp.server.config import ServerConfig
from shuffledp.server.optim import ReportAccumulator
from shuffledp.server.outcome import InnerOpener, RoundOutcome
from shuffledp.server.state import CheckpointStore

__all__ = ["CHUNK_REPORTS", "CHUNK_VALUES", "chunk_rows", "OpenedRelease", "open_release", "check_attestation",
           "no_cover_accountant", "note_bad_reports"]

log = logging.getLogger("shuffledp.server")

#: At most this many opened reports are decoded together (one ``decode_batch`` call) ...
CHUNK_REPORTS = 1024
#: ... and at most this many decoded values (float64: 16 MiB), so that a large model's chunk is smaller. With the
#: payloads and the decoder's temporaries a chunk takes a few times this, whatever the number of reports.
CHUNK_VALUES = 2**21


def chunk_rows(dim: int) -> int:
    """The number of reports decoded together for a model of ``dim`` parameters.

    Returns:
        ``min(CHUNK_REPORTS, CHUNK_VALUES // dim)``, at least 1.
    """
    return max(1, min(CHUNK_REPORTS, CHUNK_VALUES // max(1, int(dim))))


@dataclass
class OpenedRelease:
    """What :func:`open_release` made of a released batch.

    Attributes:
        sum: the running sum of the reports that opened and decoded (``sum.count`` of them).
        bad: the reports that failed to open or decode (counted, not added).
    """

    sum: ReportAccumulator
    bad: int = 0

    @property
    def total(self) -> int:
        """Every report released: the ones added and the bad ones."""
        return self.sum.count + self.bad


def open_release(inners: Iterable[bytes], open_inner: InnerOpener, round_id: int, decoder: Mechanism, dim: int, *,
                 chunk: int | None = None) -> OpenedRelease:
    """Open, decode and sum a released batch of inner ciphertexts, a chunk of reports at a time.

    Each inner ciphertext is opened as it arrives (``open_inner(inner, round_id)``); one that raises is counted bad.
    The opened payloads are decoded ``chunk`` at a time (default :func:`chunk_rows`) with ``decoder.decode_batch``:
    a refused row, and a row with a non-finite value, is counted bad and left out of the sum. The sum is the one the
    reports decoded one at a time would give, up to the order of the floating-point additions.

    Args:
        inners: the released inner ciphertexts (e.g. ``ShufflerLike.fetch``'s stream), read once, lazily.
        open_inner: opens one inner ciphertext of round ``round_id`` (the server's private key is bound inside).
        round_id: the round the batch was released for.
        decoder: the run's mechanism (its ``decode_batch`` is the unbiased estimate of each clipped update).
        dim: the model's number of parameters.
        chunk: reports per ``decode_batch`` call, at least 1.

    Returns:
        :class:`OpenedRelease`: the sum and the bad count (the caller checks ``total`` against the attested count).
    """
    rows = chunk_rows(dim) if chunk is None else int(chunk)
    if rows < 1:
        raise ValueError(f"a chunk holds at least one report, got {chunk!r}")
    opened = OpenedRelease(ReportAccumulator(dim))
    pending: list[Any] = []
    for inner in inners:
        try:
            pending.append(open_inner(bytes(inner), round_id))
        except Exception:  # noqa: BLE001 - one report that fails to open is counted and skipped, never fatal
            opened.bad += 1
            continue
        if len(pending) >= rows:
            opened.bad += _add_chunk(opened.sum, decoder, pending, dim)
            pending = []
    if pending:
        opened.bad += _add_chunk(opened.sum, decoder, pending, dim)
    return opened


def _add_chunk(acc: ReportAccumulator, decoder: Mechanism, payloads: list[Any], dim: int) -> int:
    """Decode ``payloads`` as one batch and add its valid rows to ``acc``; returns how many were bad.

    ``decode_batch`` refuses a malformed report as a row, it does not raise; if it raises all the same (a defect of
    the decoder, not of one report), the chunk is decoded one report at a time, so that each report is counted on
    its own as with :meth:`Mechanism.decode`, and the fact is logged.
    """
    try:
        batch = decoder.decode_batch(payloads, dim)
        values = np.asarray(batch.values, dtype=np.float64)
        if values.shape != (len(payloads), dim):
            raise ValueError(f"decode_batch returned values of shape {values.shape} for {len(payloads)} reports of "
                             f"dimension {dim}")
        ok = batch.ok & np.isfinite(values).all(axis=1)
    except Exception as exc:  # noqa: BLE001 - the reports of a chunk the decoder fails on are decoded one by one
        log.warning("decoding a chunk of %d reports failed (%s: %s); decoding them one at a time", len(payloads),
                    type(exc).__name__, exc)
        return _add_one_by_one(acc, decoder, payloads, dim)
    n_ok = int(ok.sum())
    if n_ok == len(payloads):
        acc.add_batch(values)
    elif n_ok:
        acc.add_batch(values[ok])
    return len(payloads) - n_ok


def _add_one_by_one(acc: ReportAccumulator, decoder: Mechanism, payloads: list[Any], dim: int) -> int:
    """Decode and add each payload alone (``decoder.decode``); returns how many failed."""
    bad = 0
    for payload in payloads:
        try:
            acc.add(decoder.decode(payload, dim))
        except Exception:  # noqa: BLE001 - one report that fails to decode is counted and skipped, never fatal
            bad += 1
    return bad


def check_attestation(att: Any, *, round_id: int, key_epoch: int, digest: bytes, submitted: int) -> None:
    """Cross-check the (already signature-verified) attestation against what was submitted.

    Raises:
        RuntimeError: it attests more reports than envelopes were submitted, or names another round, key epoch or
            model digest (a missing field is a mismatch).
    """
    n = int(att.n_accepted)
    if not 0 <= n <= submitted:
        raise RuntimeError(f"the shuffler attested {n} reports for a batch of {submitted} envelopes")
    for attr, expected in (("round_id", round_id), ("key_epoch", key_epoch), ("model_digest", digest)):
        value = getattr(att, attr, None)  # a missing field is a mismatch, not a pass
        if value != expected:
            raise RuntimeError(f"the attestation's {attr} {value!r} does not match the submitted {expected!r}")


def no_cover_accountant(history: Sequence[RoundOutcome], *, target_delta: float, family: str,
                        extra: RoundOutcome | None = None) -> ShuffleAccountant | None:
    """The run's charged rounds (and ``extra``) composed with the reports that failed to open or decode taken out of
    each round's n (they gave no cover; a round left with none is composed at n = 1, no amplification).

    A round lost in a crash (rebuilt from its ledger row) has the bad count recorded when it was opened
    (:meth:`CheckpointStore.record_bad_reports`).

    Returns:
        An accountant of ``family`` at ``target_delta`` (no comparison families), or None if no such round had a
        bad report.
    """
    charged = [h for h in history if h.status in ("applied", "lost")] + ([extra] if extra else [])
    if not any(h.n_bad_reports for h in charged):
        return None
    acct = ShuffleAccountant(target_delta=target_delta, family=family)
    for h in charged:
        acct.compose(ShuffleRound(n=max(1, h.n_reports - h.n_bad_reports), eps0=h.eps0))
    return acct


def note_bad_reports(out: RoundOutcome, history: Sequence[RoundOutcome], cfg: ServerConfig,
                     store: CheckpointStore) -> None:
    """After a charged round's reports are opened (``out.n_bad_reports`` set): record the round's bad count in
    ``store`` (kept even if the round is lost before its checkpoint: the no-cover figure needs it) and set
    ``out.epsilon_if_bad_gave_no_cover`` (:func:`no_cover_accountant` over ``history`` and ``out``).

    A family that cannot bound the no-cover rounds leaves the figure None and logs why (the budget check stops the
    run before the next round); a round with bad reports logs both figures.
    """
    bad = out.n_bad_reports
    if bad:
        store.record_bad_reports(out.round, bad)
    no_cover = no_cover_accountant(history, target_delta=cfg.target_delta, family=cfg.accounting_family, extra=out)
    if no_cover is None:
        return
    try:
        out.epsilon_if_bad_gave_no_cover = float(no_cover.epsilon().value)
    except RefusedError as exc:  # e.g. fmt below its n: the budget check stops the run before the next
        log.warning("round %d: the family %r cannot bound the rounds with the reports that failed to open left out "
                    "of n (%s); the run stops before the next round", out.round, cfg.accounting_family, exc)
    if bad:
        log.warning(
            "round %d: %d of %d released reports failed to open or decode (an honest client's always opens); "
            "epsilon is %s counting them as cover, %s if they gave none (report.json: epsilon_if_bad_gave_no_cover; "
            "the budget uses the larger)", out.round, bad, out.n_reports, out.epsilon, out.epsilon_if_bad_gave_no_cover)
