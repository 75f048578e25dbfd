"""What the round engine works against and what it produces: the Grid and shuffler protocols (so that tests can drive
it with fakes), the evaluator and opener signatures, its errors (and :func:`is_refusal`, which tells a refusal of
the batch from a failure), :class:`RoundOutcome`, one round's record, and :func:`report_rows`, report.json's rows."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import numpy as np

__all__ = ["GridLike", "ShufflerLike", "Evaluator", "InnerOpener", "ResumeError", "ShufflerRefusal", "is_refusal",
           "RoundOutcome", "report_rows"]


class GridLike(Protocol):
    """The part of ``flwr.serverapp.Grid`` the round logic uses."""

    def get_node_ids(self) -> Iterable[int]:
        """The ids of the nodes connected now."""

    def push_messages(self, messages: Iterable[Any]) -> Iterable[str]:
        """Send ``messages``; returns their message ids."""

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Any]:
        """The replies that have arrived to the messages with these ids."""


class ShufflerLike(Protocol):
    """The part of ``shuffledp.shuffler.client.ShufflerClient`` the round logic uses (``open_submit`` returns a
    ``shuffledp.shuffler.client.SubmitStream``: ``send_many``, ``keepalive``, ``close`` -> attestation, ``cancel``)."""

    def open_submit(
        self, *, round_id: int, key_epoch: int, model_digest: bytes, count: int, envelope_length: int,
        timeout: float | None = None,
    ) -> Any:
        """Open the Submit stream of one round's ``count`` envelopes; returns the stream."""

    def fetch(self, attestation: Any) -> Iterator[bytes]:
        """Stream the inner ciphertexts of the batch ``attestation`` names, in the shuffled order, verified."""

    def stats(self) -> Mapping[str, Any]:
        """The shuffler's counters, its key epoch and its Submit message limit."""


#: ``evaluate(arrays) -> (loss, accuracy)`` on the server's test split (None for a metric it does not compute).
Evaluator = Callable[[Sequence[np.ndarray]], tuple[float | None, float | None]]
#: ``open_inner(inner, round_id) -> payload`` (the server's HPKE private key is bound inside).
InnerOpener = Callable[[bytes, int], bytes]


class ResumeError(RuntimeError):
    """The checkpoint, the ledger and the configuration do not agree; resuming would lose or double-count."""


class ShufflerRefusal(RuntimeError):
    """The shuffler refused the batch (e.g. fewer than its threshold of valid, distinct enrolled signers)."""


def is_refusal(exc: BaseException) -> bool:
    """Whether ``exc`` is the shuffler refusing the batch (the round is skipped) rather than a failure (fatal:
    transport failures and bad attestations).

    ``shuffledp.shuffler.client.ShufflerError`` carries the gRPC status code: FAILED_PRECONDITION (e.g. fewer than the
    shuffler's threshold of valid distinct signers), INVALID_ARGUMENT, ALREADY_EXISTS (binding already used) and
    RESOURCE_EXHAUSTED are refusals of this batch; UNAVAILABLE, DEADLINE_EXCEEDED, ... are not.

    Returns:
        True for a :class:`ShufflerRefusal` or an error with one of the four refusal codes.
    """
    if isinstance(exc, ShufflerRefusal):
        return True
    try:
        import grpc
    except ImportError:  # pragma: no cover
        return False
    code = getattr(exc, "code", None)
    if callable(code):
        code = code()
    return code in (
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    )


@dataclass
class RoundOutcome:
    """What happened in one round (JSON-safe via :meth:`as_dict`).

    ``status``: ``"applied"`` (charged, model updated), ``"skipped"`` (nothing released, nothing charged),
    ``"stopped"`` (the budget would be exceeded; the run ends), ``"lost"`` (charged, but the process died
    before the model update was checkpointed; only produced by :meth:`RoundEngine.restore`), ``"abandoned"``
    (its id was used, but the process stopped or failed before the charge, so nothing was released; only
    produced by :meth:`RoundEngine.restore`).
    """

    round: int
    status: str
    reason: str = ""
    n_sampled: int = 0
    n_not_pushed: int = 0  # messages the grid could not deliver (no id): no slot, no reply expected
    n_replies: int = 0
    n_error_replies: int = 0
    n_malformed_replies: int = 0
    n_envelopes: int = 0
    n_reports: int = 0  # attested count, what the accountant is charged with
    n_bad_reports: int = 0
    n_applied: int = 0
    eps0: float = 0.0
    epsilon: float | None = None  # cumulative, after this round, of the family below
    epsilon_family: str = ""  # the run's accounting family
    epsilon_kind: str = ""  # "upper" (a guarantee): accounting-family must be an upper-bound family
    #: cumulative upper bound of the same family if the reports that failed to open or decode gave no cover (each
    #: charged round composed with n_reports - n_bad_reports, at least 1); None while no round had bad reports.
    #: An honest client's report always opens, so a bad one came from a broken or malicious enrolled client, and
    #: the shuffle bound's assumption that all n reports came from the eps0-LDP randomizer failed for it.
    epsilon_if_bad_gave_no_cover: float | None = None
    delta: float | None = None
    accuracy: float | None = None
    loss: float | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    #: Unix time (the ServerApp's own clock) at which the round ended: where ``deploy local`` takes each round's
    #: boundaries from, since log lines relayed from the ServerApp can arrive late and several at once.
    finished_at: float | None = None

    def as_dict(self) -> dict[str, Any]:
        """The outcome as a JSON-safe dict (one row of the checkpoint history and report.json)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RoundOutcome:
        """Rebuild an outcome from :meth:`as_dict` output."""
        return cls(**dict(data))


def report_rows(history: Iterable[RoundOutcome]) -> list[dict[str, Any]]:
    """The per-round rows of report.json (:mod:`shuffledp.server.report`).

    Returns:
        One row per charged round of ``history`` (applied or lost), in order.
    """
    return [
        {
            "round": o.round,
            "n_reports": o.n_reports,
            "accuracy": o.accuracy,
            "loss": o.loss,
            "eps0": o.eps0,
            "epsilon": o.epsilon,
            "family": o.epsilon_family,
            "kind": o.epsilon_kind,
            "delta": o.delta,
            "n_applied": o.n_applied,
            "n_bad_reports": o.n_bad_reports,
            "epsilon_if_bad_gave_no_cover": o.epsilon_if_bad_gave_no_cover,
        }
        for o in history
        if o.status in ("applied", "lost")
    ]
