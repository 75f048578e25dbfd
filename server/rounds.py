"""The server's round logic, written against small protocols so that tests can drive it with a fake Grid.

One round ``r`` (:meth:`RoundEngine.run_round`):

1. sample the nodes (all, or ``fraction`` of them drawn with ``secrets.SystemRandom``);
2. check the budget *before sending*: stop if even the best case (every sampled node reports) would take the
   default family above ``budget-epsilon``;
3. durably mark ``r`` as started (a round id is never reused, see :mod:`shuffledp.server.state`);
4. send ``train.shuffled`` (model + round config) and open a Submit stream to the shuffler, bound to (key epoch,
   round id, digest of the model the server sent) and announcing one slot per message sent; collect replies
   until ``reply-timeout``, keeping only each reply's envelope bytes and dropping the reply (with its metadata:
   node id, timestamps) at once; the envelopes go to the shuffler as they arrive (flushed about once a second or
   per full packed message). An error reply, a malformed or duplicate reply, and a
   node that never replied each fill their slot with an empty placeholder (the shuffler counts it as
   ``empty``). The shuffler's verification work thus overlaps the collection;
5. fewer than ``k`` envelopes: cancel the stream (the shuffler seals nothing and the binding stays unused),
   skip the round, charge nothing;
6. close the stream: the shuffler drops envelopes that do not open under the binding (a tagged client that
   received another model) and signs the count it accepted; the client library verifies the attestation;
7. attested count below ``k`` or a budget overrun at the attested count: do not fetch (nothing is released to
   the server), skip or stop;
8. charge the accountant with the attested count and append the ledger row (with the batch's key epoch and id)
   — BEFORE fetching, so a crash while the server holds opened reports can never leave a release unrecorded;
9. stream the permuted inner ciphertexts, open and decode each one and add it to a running sum (O(model)
   memory, never the batch); a report that fails to open or decode is counted and skipped;
10. one server-optimizer step with the mean; central evaluation on the held-out test set;
11. atomic checkpoint (model, optimizer, accountant, round, history).

Crash consistency (:meth:`RoundEngine.restore`): the ledger is written before the checkpoint, so after a crash
the ledger is at most one round ahead of the checkpoint. That round's release is re-charged from the ledger row
(exactly once: the ledger's round primary key) and its model update is lost (marked ``"lost"`` in the
history); the run continues with a fresh round id.
"""

from __future__ import annotations

import logging
import math
import secrets
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import blake3
import numpy as np

from shuffledp.accounting import RefusedError, format_bound
from shuffledp.accounting.accountant import ShuffleAccountant
from shuffledp.accounting.events import ShuffleRound
from shuffledp.accounting.ledger import Ledger
from shuffledp.clients import messages as M
from shuffledp.clients.mechanism import L2_MECHANISMS, Mechanism, make_mechanism
from shuffledp.server.config import DEFAULTS, ConfigError, ServerConfig
from shuffledp.server.optim import ReportAccumulator, ServerOptimizer, num_parameters
from shuffledp.server.report import epsilon_label
from shuffledp.server.state import Checkpoint, CheckpointError, CheckpointStore

__all__ = [
    "GridLike",
    "ShufflerLike",
    "Evaluator",
    "RoundOutcome",
    "RoundEngine",
    "ResumeError",
    "envelope_of",
    "sample_nodes",
    "wait_for_nodes",
    "RESUME_KEYS",
]

log = logging.getLogger("shuffledp.server")

#: Settings that must not change between a run and its resume (they change what the ledger means or what the
#: checkpoint's arrays are, or they live in the checkpoint's own state: the optimizer is restored with its
#: learning rate and momentum, the accountant with its comparison families, so a new value would be ignored).
RESUME_KEYS = (
    "eps0",
    "mechanism",
    "clip-l1",
    "clip-l2",
    "report",
    "model",
    "hidden-units",
    "dataset",
    "pca-components",
    "target-delta",
    "accounting-family",
    "comparison-families",
    "server-optimizer",
    "server-lr",
    "server-momentum",
    "key-epoch",
)


#: Seconds between polls for replies on a grid that does not say (Flower's simulation grid has pull_interval).
PULL_INTERVAL_SECONDS = 1.0
#: Forward the envelopes collected so far to the shuffler at least this often (or once a packed message is full).
FLUSH_SECONDS = 1.0
#: Send a Keepalive on the Submit stream after this long without an envelope (the shuffler's default idle
#: timeout is 60 s).
KEEPALIVE_SECONDS = 5.0
#: The Submit stream's deadline is reply-timeout plus this margin (time for the shuffler to seal the batch).
SUBMIT_MARGIN_SECONDS = 600.0


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


def wait_for_nodes(grid: GridLike, min_nodes: int, *, node_wait: float, settle: float) -> list[int]:
    """The connected node ids, sorted, once at least ``min_nodes`` are connected and their count has not changed
    for ``settle`` seconds, or whatever is connected after ``node_wait`` seconds (the caller decides whether that
    is enough). Polls ``grid.get_node_ids()`` every 0.5 s at most."""
    deadline = time.monotonic() + node_wait
    last_count, stable_since = -1, time.monotonic()
    while True:
        nodes = sorted(set(int(n) for n in grid.get_node_ids()))
        now = time.monotonic()
        if len(nodes) != last_count:
            last_count, stable_since = len(nodes), now
        if (len(nodes) >= min_nodes and now - stable_since >= settle) or now >= deadline:
            return nodes
        time.sleep(min(0.5, max(0.0, deadline - now)))


def sample_nodes(node_ids: Sequence[int], fraction: float, rng: secrets.SystemRandom | None = None) -> list[int]:
    """Sample ``max(1, floor(fraction * N))`` distinct nodes uniformly with a CSPRNG (all of them if fraction=1).

    Raises:
        ValueError: ``fraction`` is not in (0, 1] or there are no nodes.
    """
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction!r}")
    nodes = sorted(set(int(n) for n in node_ids))
    if not nodes:
        raise ValueError("there are no connected nodes to sample from")
    if fraction == 1.0:
        return nodes
    count = max(1, int(math.floor(fraction * len(nodes))))
    return (rng or secrets.SystemRandom()).sample(nodes, count)


def envelope_of(reply: Any, *, max_bytes: int) -> tuple[bytes | None, str]:
    """The envelope bytes of one reply, or ``None`` and why not: ``("error")`` for an error reply (e.g. a client
    refusing the request), ``("malformed")`` for no or an ill-formed ``content["envelope"]`` or an oversized
    one. Nothing else of the reply (node id, timestamps, message ids) is returned."""
    try:
        if reply.has_error():
            return None, "error"
        content = reply.content
        if set(content.keys()) != {M.ENVELOPE_KEY}:
            return None, "malformed"
        envelope = M.envelope_from_record(content[M.ENVELOPE_KEY])
    except Exception:  # noqa: BLE001 - any defect in one reply only drops that reply
        return None, "malformed"
    if len(envelope) > max_bytes:
        return None, "malformed"
    return envelope, "ok"


def _decoder(cfg: ServerConfig) -> Mechanism:
    """The run's mechanism (shuffledp.clients.mechanism), used here to decode: the clients' pinned one."""
    return make_mechanism(cfg.mechanism, eps0=cfg.eps0, clip_l1=cfg.clip_l1, clip_l2=cfg.clip_l2)


def _mechanism_label(cfg: ServerConfig, dim: int) -> str:
    if cfg.mechanism == "laplace":
        return f"discrete-laplace-l1(d={dim},C={cfg.clip_l1:g},eps0={cfg.eps0:g},report={cfg.report})"
    label = _decoder(cfg).label(dim)  # "name(parameters)": the report kind goes inside the parentheses
    return f"{label[:-1]},report={cfg.report})"


class RoundEngine:
    """Runs rounds, keeps the model/optimizer/accountant, checkpoints and reconciles on resume.

    Args:
        config: the validated run configuration.
        grid: a ``flwr.serverapp.Grid`` (or a fake with the same two methods).
        shuffler: a ``ShufflerClient`` (or anything with ``open_submit``/``fetch``).
        open_inner: opens one inner ciphertext for a round (holds the server's private key).
        evaluator: central evaluation ``arrays -> (loss, accuracy)``.
        initial_arrays: the model at round 0 (used only when no checkpoint exists).
        ledger: the run's privacy ledger.
        store: the run's checkpoint store.
        node_wait: seconds to wait for at least ``min-reports`` nodes to connect before a round.
        on_round: called with each finished :class:`RoundOutcome` (progress display).
        on_attestation: called with (round id, attestation, charged) for every batch the shuffler sealed: right
            after it is charged, or, ``charged=False``, when it is left unfetched (below min-reports, or over the
            budget at the attested n), so the record of sealed batches is complete.
        array_names: the names of the model's arrays in the train messages (an app's own, e.g. a torch
            state_dict's); default "0", "1", ...
        train_config: the app's own entries for the clients' train config, next to the protocol's (whose keys it
            may not use).
        on_round_started: called with each round id before the round does anything.
    """

    def __init__(
        self,
        config: ServerConfig,
        *,
        grid: GridLike,
        shuffler: ShufflerLike,
        open_inner: InnerOpener,
        evaluator: Evaluator,
        initial_arrays: Sequence[np.ndarray],
        ledger: Ledger,
        store: CheckpointStore,
        node_wait: float = 0.0,
        on_round: Callable[[RoundOutcome], None] | None = None,
        on_attestation: Callable[[int, Any, bool], None] | None = None,
        array_names: Sequence[str] | None = None,
        train_config: Mapping[str, Any] | None = None,
        on_round_started: Callable[[int], None] | None = None,
    ) -> None:
        self.cfg = config
        self.grid = grid
        self.shuffler = shuffler
        self.open_inner = open_inner
        self.evaluator = evaluator
        self.ledger = ledger
        self.store = store
        self.node_wait = float(node_wait)
        self.on_round = on_round
        self.on_attestation = on_attestation
        self._settled = False
        self._rng = secrets.SystemRandom()
        self.arrays: list[np.ndarray] = [np.array(a, copy=True) for a in initial_arrays]
        if not self.arrays:
            raise ValueError("the initial model has no arrays")
        self.on_round_started = on_round_started
        self.array_names = self._check_names(array_names)
        self.extra_train_config = self._check_extra_config(train_config)
        self.shapes = [tuple(a.shape) for a in self.arrays]
        self.dim = num_parameters(self.shapes)
        self.mechanism = _mechanism_label(config, self.dim)
        # Every honest envelope of a round has this length (fixed-length reports); announcing it lets the shuffler
        # drop an envelope of any other length as a counted `wrong_length` instead of refusing the whole batch.
        from shuffledp.shuffler.envelope import ENVELOPE_OVERHEAD

        self.decoder = _decoder(config)
        self.envelope_length = self.decoder.report_length(self.dim) + ENVELOPE_OVERHEAD
        if config.max_message_bytes < self.envelope_length:
            raise ConfigError(
                f"run config 'max-message-bytes' ({config.max_message_bytes}) is below this model's envelope length "
                f"({self.envelope_length} bytes for {self.dim} parameters): every reply would be dropped as malformed"
            )
        # Honest laplace clients randomize on the default grid for the pinned (eps0, C); the decoder rejects a report
        # on any other grid (a rescaled report would be an outsized contribution).
        self.expected_log2_grid = getattr(self.decoder, "expected_log2_grid", None)
        self.optimizer = ServerOptimizer(config.server_optimizer, config.server_lr, momentum=config.server_momentum)
        self.accountant = ShuffleAccountant(
            target_delta=config.target_delta,
            family=config.accounting_family,
            comparison_families=config.comparison_families,
        )
        self.history: list[RoundOutcome] = []
        #: each resume that changed budget-epsilon: {"after_round", "from", "to"} (kept in the checkpoint and
        #: written to report.json, so a raised budget is on record, not only in a log)
        self.budget_changes: list[dict[str, Any]] = []
        self.last_round = 0
        self.stopped: RoundOutcome | None = None

    def _check_names(self, names: Sequence[str] | None) -> list[str]:
        """The names of the model's arrays in the train messages: ``names``, or "0", "1", ... (Flower's names for
        an ArrayRecord built from a list). Raises ConfigError unless one distinct string per array."""
        if names is None:
            return [str(i) for i in range(len(self.arrays))]
        names = list(names)
        if len(names) != len(self.arrays) or len(set(names)) != len(names) or not all(
                isinstance(n, str) and n for n in names):
            raise ConfigError(f"array_names must be {len(self.arrays)} distinct non-empty strings, one per array of "
                              f"the model; got {names!r}")
        return names

    def _check_extra_config(self, extra: Mapping[str, Any] | None) -> dict[str, Any]:
        """The app's own entries for the clients' train config. Raises ConfigError for a key of the protocol's own
        train config (those come from the run config, where the clients' pinned values are checked against
        them) and for a value a Flower ConfigRecord cannot hold."""
        from flwr.app import ConfigRecord

        extra = dict(extra or {})
        protocol = set(self._train_config(1).to_dict())
        for key in extra:
            if key in protocol:
                raise ConfigError(f"train_config key {key!r} is part of the protocol's train config "
                                  f"({sorted(protocol)}): set it in the run config instead")
        try:
            ConfigRecord(extra)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"train_config is not a valid Flower ConfigRecord: {exc}") from None
        return extra

    # -- checkpoint / resume -----------------------------------------------------------------------------------
    def _checkpoint(self) -> Checkpoint:
        meta, buffers = self.optimizer.state_dict()
        return Checkpoint(
            round=self.last_round,
            arrays=[np.array(a, copy=True) for a in self.arrays],
            optimizer=meta,
            optimizer_buffers=buffers,
            accountant=self.accountant.state_dict(),
            history=[o.as_dict() for o in self.history],
            config=self.cfg.as_dict(),
            budget_changes=[dict(c) for c in self.budget_changes],
        )

    def save(self) -> None:
        """Write the current state as the checkpoint (atomic)."""
        self.store.save(self._checkpoint())

    def _refuse_a_spent_key_epoch(self, rows: Sequence[Mapping[str, Any]], *, fresh: bool) -> None:
        """Raise ResumeError if the shuffler reports more released batches of this run's key epoch than this run's
        ledger charged (its Stats; a shuffler too old to report them says 0).

        A run's batches are charged before they are fetched (released), so every release of this run has a ledger
        row, and a surplus of releases is another run's, in the same key epoch: this accountant would leave out
        reports already released to a server. Rows without a batch (older ledgers) count as this epoch's.
        """
        stats = self.shuffler.stats()
        released = int(stats.get("epoch_batches_released", 0))
        if int(stats.get("key_epoch", -1)) != self.cfg.key_epoch:
            return
        charged = sum(1 for r in rows if r.get("key_epoch") in (self.cfg.key_epoch, None))
        if released <= charged:
            return
        if fresh:
            raise ResumeError(
                f"the shuffler has already released {released} batch(es) of key epoch {self.cfg.key_epoch}, and this "
                "run has no checkpoint or ledger rows: a fresh accountant would start at epsilon 0 although this "
                "epoch's reports were already released to a server. Resume the run that spent them (its output "
                "directory), or rotate the keys to a new key epoch for a new run"
            )
        raise ResumeError(
            f"the shuffler has released {released} batch(es) of key epoch {self.cfg.key_epoch}, but this run's "
            f"ledger charges only {charged}: another run has used this key epoch since, and its releases are "
            "not in this run's accountant, so the epsilon it would report leaves them out. Find that run "
            "(`shuffledp audit` with both ledgers names the batches); every run needs its own key epoch"
        )

    def restore(self) -> int:
        """Load the checkpoint (or start fresh), reconcile it with the ledger, and return the next round id.

        * no checkpoint and an empty ledger: a fresh run; a round-0 checkpoint is written at once.
        * no checkpoint but ledger rows: refused (the ledger belongs to another run or the state file is gone).
        * no checkpoint and an empty ledger, but the shuffler has already released batches of this key epoch:
          refused. Those releases were charged to another run's accountant (or to none); a fresh accountant
          starting at 0 would report an epsilon that leaves them out. Rotate keys (a new key epoch) per run.
        * a checkpoint, but the shuffler has released more batches of this key epoch than the ledger charges:
          refused. The surplus is another run's (this run charges a batch before it is released), and this
          accountant would leave it out.
        * ledger rows after the checkpoint's round: each is a round whose release was charged but whose model
          update was not checkpointed (a crash between the ledger append and the checkpoint). The accountant is
          charged with it from the ledger row, exactly once, and it is recorded as ``"lost"``.
        * ledger rows up to the checkpoint's round must match the accountant state in the checkpoint.

        Raises:
            ResumeError: the stored state and the ledger disagree, or the configuration changed in a setting
                listed in :data:`RESUME_KEYS`.
        """
        try:
            ckpt = self.store.load()
        except CheckpointError as exc:
            raise ResumeError(f"cannot read the checkpoint: {exc}") from None
        rows = self.ledger.rows()
        if ckpt is None:
            if rows:
                raise ResumeError(
                    f"the ledger {self.ledger.path} already records rounds {[r['round'] for r in rows]} but there "
                    "is no checkpoint; refusing to start a run that would mix with another run's ledger "
                    "(use a fresh run name or output directory)"
                )
            self._refuse_a_spent_key_epoch(rows, fresh=True)
            self.last_round = 0
            self.save()
            return 1

        current = self.cfg.as_dict()
        # a checkpoint written before a key existed holds no value for it: it ran with the key's default (laplace)
        saved = {k: ckpt.config.get(k, DEFAULTS.get(k)) for k in RESUME_KEYS}
        changed = {k: (saved[k], current.get(k)) for k in RESUME_KEYS if saved[k] != current.get(k)}
        if changed:
            raise ResumeError(
                "the configuration changed since the checkpoint in settings that a resume must keep: "
                + ", ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in changed.items())
            )
        self._refuse_a_spent_key_epoch(rows, fresh=False)
        budget_changes = list(ckpt.budget_changes)
        old_budget, new_budget = ckpt.config.get("budget-epsilon"), current.get("budget-epsilon")
        if old_budget != new_budget:
            budget_changes.append({"after_round": ckpt.round, "from": old_budget, "to": new_budget})
            # Allowed (an operator may extend or tighten a run), never silent: the ledger keeps the cumulative
            # epsilon of every round whatever the budget, and from here on the run stops at the new budget.
            log.warning(
                "budget-epsilon changed since the checkpoint (round %d): %r -> %r; the ledger's cumulative "
                "epsilon is unaffected, the run now stops at the new budget",
                ckpt.round, old_budget, new_budget,
            )
        if [tuple(a.shape) for a in ckpt.arrays] != self.shapes:
            raise ResumeError(
                f"the checkpoint's model has shapes {[tuple(a.shape) for a in ckpt.arrays]}, this run's model "
                f"has {self.shapes}"
            )
        try:
            accountant = ShuffleAccountant.from_state_dict(ckpt.accountant)
            optimizer = ServerOptimizer.from_state_dict(ckpt.optimizer, ckpt.optimizer_buffers)
        except (ValueError, KeyError, TypeError) as exc:
            raise ResumeError(f"the checkpoint's accountant or optimizer state is invalid: {exc}") from None
        history = [RoundOutcome.from_dict(h) for h in ckpt.history]

        charged = [h for h in history if h.status in ("applied", "lost")]
        covered = [r for r in rows if r["round"] <= ckpt.round]
        if [h.round for h in charged] != [r["round"] for r in covered]:
            raise ResumeError(
                f"the checkpoint (round {ckpt.round}) lists charged rounds {[h.round for h in charged]} but the "
                f"ledger has {[r['round'] for r in covered]} up to that round; they must agree"
            )
        if len(accountant.rounds) != len(covered) or any(
            (ev.n, ev.eps0) != (r["n_reports"], r["eps0"]) for ev, r in zip(accountant.rounds, covered)
        ):
            raise ResumeError("the checkpoint's accountant does not match the ledger rows up to its round")
        ahead = [r for r in rows if r["round"] > ckpt.round]
        bad_reports = self.store.bad_reports()
        for row in ahead:
            accountant.compose(ShuffleRound(n=int(row["n_reports"]), eps0=float(row["eps0"])))
            entry = row["epsilons"].get(accountant.family, {})
            history.append(
                RoundOutcome(
                    round=int(row["round"]),
                    status="lost",
                    reason="the process stopped after this round was charged and before its update was saved",
                    n_reports=int(row["n_reports"]),
                    n_bad_reports=bad_reports.get(int(row["round"]), 0),  # if it was opened before the crash
                    eps0=float(row["eps0"]),
                    epsilon=entry.get("value"),
                    epsilon_family=accountant.family,
                    epsilon_kind=str(entry.get("kind", "")),
                    delta=float(row["delta"]),
                )
            )
            log.warning("round %d was charged (ledger) but its model update was lost in a crash", row["round"])

        last_ledger = max((int(r["round"]) for r in rows), default=0)
        last_started = self.store.last_started()
        known = {h.round for h in history}
        for rnd in range(1, last_started + 1):
            if rnd not in known:  # used (its requests may have gone out), never charged: nothing was released
                history.append(RoundOutcome(
                    round=rnd, status="abandoned", eps0=self.cfg.eps0, delta=self.cfg.target_delta,
                    reason="the process stopped or failed during this round before it was charged; nothing of it "
                           "was released to the server, and its id is not reused"))
                log.warning("round %d was started but never charged (the process stopped or failed): recorded "
                            "as abandoned", rnd)
        history.sort(key=lambda h: h.round)

        self.arrays = [np.array(a, copy=True) for a in ckpt.arrays]
        self.optimizer = optimizer
        self.accountant = accountant
        self.history = history
        self.budget_changes = budget_changes
        self.last_round = max(ckpt.round, last_ledger, last_started)
        self.save()  # persist the reconciliation before anything else happens
        return self.last_round + 1

    # -- one round ---------------------------------------------------------------------------------------------
    def _train_config(self, round_id: int) -> M.TrainConfig:
        c = self.cfg
        return M.TrainConfig(
            round=round_id,
            key_epoch=c.key_epoch,
            eps0=c.eps0,
            clip_l1=c.clip_l1,
            mechanism=c.mechanism,
            clip_l2=c.clip_l2 if c.mechanism in L2_MECHANISMS else None,
            report=c.report,
            local_epochs=c.local_epochs,
            local_lr=c.local_lr,
            batch_size=c.batch_size,
        )

    def _build_messages(self, nodes: Sequence[int], round_id: int) -> list[Any]:
        from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict

        config_record = ConfigRecord({**self.extra_train_config, **self._train_config(round_id).to_dict()})
        arrays_record = ArrayRecord({name: Array.from_numpy_ndarray(np.ascontiguousarray(a))
                                     for name, a in zip(self.array_names, self.arrays)})
        msgs = []
        for node in nodes:
            content = RecordDict({M.ARRAYS_KEY: arrays_record, M.CONFIG_KEY: config_record})
            msgs.append(Message(content, dst_node_id=int(node), message_type=M.MESSAGE_TYPE, group_id=str(round_id)))
        return msgs

    def _connected_nodes(self) -> list[int]:
        """The connected nodes; waits up to ``node_wait`` s for at least ``min-reports`` of them.

        Before the first round of a process it also waits (within ``node_wait``) until the count has been stable
        for a moment: Flower registers simulated nodes progressively, and a first round sent to the first 1,000
        of 1,437 nodes would leave the others out of it.
        """
        settle = 0.0 if self._settled else min(3.0, self.node_wait)
        nodes = wait_for_nodes(self.grid, self.cfg.min_reports, node_wait=self.node_wait, settle=settle)
        self._settled = True
        return nodes

    def _collect_into_stream(self, messages: list[Any], round_id: int, digest: bytes, out: RoundOutcome) -> Any | None:
        """Send the round's messages and stream each reply's envelope to the shuffler as it arrives.

        The Submit stream announces one slot per message pushed. A reply is dropped as soon as its envelope is
        taken; envelopes are forwarded about once a second (:data:`FLUSH_SECONDS`) or per full packed message.
        An error reply, a malformed one and a duplicate (the same bytes twice) fill their slot with an empty
        placeholder, and so does every node without a reply at ``reply-timeout``. While nothing arrives
        the stream is kept alive (the shuffler cancels idle submissions). Returns the stream with every slot sent,
        ready to close, or ``None`` after cancelling it when fewer than ``min-reports`` envelopes arrived (the
        shuffler then seals nothing and the round's binding stays unused). Fills ``out``'s reply counters.

        The shuffler receives the envelopes in arrival order; it verifies each signer anyway, so the order tells it
        nothing it does not know. The server keeps only a SHA-256 of each envelope (for de-duplication).
        """
        from shuffledp.shuffler.wire import FIELD_OVERHEAD

        cfg = self.cfg
        # A SuperLink returns "" for a message it could not store (e.g. its node left after get_node_ids): that
        # message has no slot. One slot per distinct id actually pushed, so the count announced to the shuffler
        # is exactly the number of slots sent (else the whole batch is refused as count_mismatch).
        outstanding = {str(i) for i in self.grid.push_messages(messages) if i}
        out.n_not_pushed = len(messages) - len(outstanding)
        del messages
        stream = self.shuffler.open_submit(
            round_id=round_id, key_epoch=cfg.key_epoch, model_digest=digest, count=len(outstanding),
            envelope_length=self.envelope_length, timeout=cfg.reply_timeout + SUBMIT_MARGIN_SECONDS,
        )
        counts = {"error": 0, "malformed": 0, "duplicate": 0}
        seen: set[bytes] = set()
        n_replies = 0
        try:
            deadline = time.monotonic() + cfg.reply_timeout
            # Flower's in-memory (simulation) grid polls every `pull_interval` (0.1 s) in send_and_receive; a
            # deployment's SuperLink is polled less often.
            interval = float(getattr(self.grid, "pull_interval", PULL_INTERVAL_SECONDS))
            last_sent = time.monotonic()
            # Envelopes and placeholders wait here until about one packed message's worth has arrived or
            # FLUSH_SECONDS have passed: few sends (each wakes gRPC's request thread in this process, which in
            # simulation shares one GIL with Flower's engine), while the shuffler still verifies during the
            # collection.
            pending: list[bytes] = []
            pending_bytes = 0
            while outstanding:
                for reply in self.grid.pull_messages(set(outstanding)):
                    slot = str(reply.metadata.reply_to_message_id)
                    if slot not in outstanding:  # not one of ours, or a second reply for a slot: ignore
                        continue
                    outstanding.discard(slot)
                    n_replies += 1
                    envelope, kind = envelope_of(reply, max_bytes=cfg.max_message_bytes)
                    del reply  # the reply and its metadata are gone from here on
                    if envelope is not None:
                        fingerprint = blake3.blake3(envelope).digest()  # 12 us per 100 KiB; SHA-256 49
                        if fingerprint in seen:
                            envelope, kind = None, "duplicate"
                        seen.add(fingerprint)
                    if envelope is None:
                        counts[kind] += 1
                        envelope = b""
                    pending.append(envelope)
                    pending_bytes += len(envelope) + FIELD_OVERHEAD
                now = time.monotonic()
                # flush once the next envelope would not fit in the packed message, so messages stay whole
                full = pending_bytes + self.envelope_length + FIELD_OVERHEAD > stream.batch_bytes
                if pending and (full or now - last_sent >= FLUSH_SECONDS):
                    stream.send_many(pending)
                    pending, pending_bytes = [], 0
                    last_sent = now
                if not outstanding or now >= deadline:
                    break
                if time.monotonic() - last_sent >= KEEPALIVE_SECONDS:
                    stream.keepalive()
                    last_sent = time.monotonic()
                time.sleep(min(interval, max(0.0, deadline - time.monotonic())))
            stream.send_many(pending + [b""] * len(outstanding))  # and a placeholder per node without a reply
            del pending
        except BaseException:
            stream.cancel()
            raise
        out.n_replies = n_replies
        out.n_error_replies = counts["error"]
        out.n_malformed_replies = counts["malformed"] + counts["duplicate"]
        out.n_envelopes = n_replies - sum(counts.values())
        if out.n_envelopes < cfg.min_reports:
            stream.cancel()
            return None
        return stream

    def _finish(self, outcome: RoundOutcome, *, save: bool = True) -> RoundOutcome:
        outcome.finished_at = time.time()
        self.history.append(outcome)
        self.last_round = outcome.round
        if save:
            self.save()
        if self.on_round is not None:
            self.on_round(outcome)
        return outcome

    def _record_attestation(self, round_id: int, attestation: Any, *, charged: bool) -> None:
        if self.on_attestation is not None:
            self.on_attestation(round_id, attestation, charged)

    def _budget_stop(self, event: ShuffleRound) -> str | None:
        """Why composing ``event`` must not happen, or None: the default family's upper bound would exceed the
        budget, or the family refuses the prospective rounds (e.g. ``fmt`` outside its validity region), which
        no budget makes safe. Evaluated also for an infinite budget, so a refusal stops the run before anything
        is sent or fetched (the value is cached and reused once the round is charged)."""
        family = self.cfg.accounting_family
        budget = f"the privacy budget epsilon={self.cfg.budget_epsilon:g} at delta={self.cfg.target_delta:g} ({family})"
        try:
            if self.accountant.would_exceed(event, self.cfg.budget_epsilon):
                return f"it would exceed {budget}"
        except RefusedError as exc:
            return f"the accounting family {family!r} cannot bound this round: {exc}"
        no_cover = self._no_cover_accountant()  # pessimistic: reports that failed to open are not counted as cover
        try:
            if no_cover is not None and no_cover.would_exceed(event, self.cfg.budget_epsilon):
                return f"it would exceed {budget} once the reports of earlier rounds that failed to open or decode " \
                       "are not counted as cover"
        except RefusedError as exc:
            return (f"the accounting family {family!r} cannot bound the rounds once the reports that failed to open "
                    f"or decode are left out of n: {exc}")
        return None

    def _no_cover_accountant(self, extra: RoundOutcome | None = None) -> ShuffleAccountant | None:
        """The run's charged rounds (and ``extra``) composed with the reports that failed to open or decode taken
        out of each round's n (they gave no cover; a round left with none is composed at n = 1, no amplification).
        None if no such round had a bad report. A round lost in a crash (rebuilt from its ledger row) has the bad
        count recorded when it was opened (:meth:`CheckpointStore.record_bad_reports`). Same family and delta as
        the run's accountant, no comparison families."""
        charged = [h for h in self.history if h.status in ("applied", "lost")] + ([extra] if extra else [])
        if not any(h.n_bad_reports for h in charged):
            return None
        acct = ShuffleAccountant(target_delta=self.cfg.target_delta, family=self.cfg.accounting_family)
        for h in charged:
            acct.compose(ShuffleRound(n=max(1, h.n_reports - h.n_bad_reports), eps0=h.eps0))
        return acct

    def _spent(self) -> str:
        """The budget spent so far, labelled: ``epsilon=... (family, upper bound)``."""
        bound = self.accountant.epsilon()
        value = format_bound(bound.value, bound.kind, significant=6)  # an upper bound rounds up
        return f"epsilon={value} ({epsilon_label(bound.family, bound.kind)})"

    def run_round(self, round_id: int) -> RoundOutcome:
        """Run round ``round_id`` (must be after every round already used) and return what happened."""
        if round_id <= self.last_round:
            raise ValueError(
                f"round {round_id} is not after the last used round {self.last_round}; ids are never reused"
            )
        cfg = self.cfg
        out = RoundOutcome(round=round_id, status="skipped", eps0=cfg.eps0, delta=cfg.target_delta)
        t0 = time.perf_counter()
        if self.on_round_started is not None:
            self.on_round_started(round_id)

        nodes = self._connected_nodes()
        if len(nodes) < cfg.min_reports:
            out.reason = f"only {len(nodes)} nodes are connected, fewer than min-reports k={cfg.min_reports}"
            self.store.mark_started(round_id)
            return self._finish(out)
        sampled = sample_nodes(nodes, cfg.fraction, self._rng)
        out.n_sampled = len(sampled)
        if len(sampled) < cfg.min_reports:
            out.reason = (
                f"sampled {len(sampled)} of {len(nodes)} nodes (fraction {cfg.fraction}), fewer than min-reports "
                f"k={cfg.min_reports}"
            )
            self.store.mark_started(round_id)
            return self._finish(out)

        # Budget, best case for this round (every sampled node reports): if even that exceeds, stop now.
        best_case = ShuffleRound(n=len(sampled), eps0=cfg.eps0)
        stop = self._budget_stop(best_case)
        if stop is not None:
            out.status = "stopped"
            out.reason = (
                f"round {round_id} is not run: {stop}, even with all {len(sampled)} sampled reports; spent so far: "
                f"{self._spent()}"
            )
            self.stopped = out
            return self._finish(out, save=False)

        t_budget = time.perf_counter()
        out.seconds["budget"] = t_budget - t0
        # From here on the round id is used, whatever happens.
        self.store.mark_started(round_id)
        sent_arrays = [np.array(a, copy=True) for a in self.arrays]
        digest = M.arrays_digest(sent_arrays)
        messages = self._build_messages(sampled, round_id)
        try:
            stream = self._collect_into_stream(messages, round_id, digest, out)
        except Exception as exc:  # noqa: BLE001 - classified below
            if not _is_refusal(exc):
                raise
            out.reason = f"the shuffler refused the batch while it was being collected: {exc}"
            return self._finish(out)
        t1 = time.perf_counter()
        out.seconds["collect"] = t1 - t_budget
        if stream is None:
            out.reason = (
                f"{out.n_envelopes} envelopes arrived ({out.n_error_replies} error replies, "
                f"{out.n_malformed_replies} malformed or duplicate, {out.n_sampled - out.n_replies} no reply), fewer "
                f"than min-reports k={cfg.min_reports}; the submission was cancelled (nothing sealed or charged)"
            )
            return self._finish(out)

        try:
            attestation = stream.close()
        except Exception as exc:  # noqa: BLE001 - classified below
            if not _is_refusal(exc):
                raise
            out.reason = f"the shuffler refused the batch: {exc}"
            return self._finish(out)
        n_attested = int(attestation.n_accepted)
        out.n_reports = n_attested
        t2 = time.perf_counter()
        out.seconds["shuffle"] = t2 - t1
        try:
            _check_attestation(attestation, round_id=round_id, key_epoch=cfg.key_epoch, digest=digest,
                               submitted=out.n_envelopes)
        except RuntimeError:
            # a signed, sealed batch that disagrees with what was submitted: never fetched, never charged, but on
            # record like every other sealed batch (attestations.jsonl), for the audit and the operator
            try:
                self._record_attestation(round_id, attestation, charged=False)
            except Exception as record_exc:  # noqa: BLE001 - the cross-check's error is the one to raise
                log.error("round %d: could not record the sealed batch that failed the cross-check: %s", round_id,
                          record_exc)
            raise
        if n_attested < cfg.min_reports:
            out.reason = (
                f"the shuffler accepted {n_attested} of {out.n_envelopes} envelopes, fewer than min-reports "
                f"k={cfg.min_reports}; the batch was not fetched (nothing released, nothing charged)"
            )
            self._record_attestation(round_id, attestation, charged=False)
            return self._finish(out)
        event = ShuffleRound(n=n_attested, eps0=cfg.eps0)
        stop = None if event == best_case else self._budget_stop(event)
        if stop is not None:
            out.status = "stopped"
            out.reason = (
                f"round {round_id} with the attested n={n_attested}: {stop}; the batch was not fetched (nothing "
                "released, nothing charged)"
            )
            self.stopped = out
            self._record_attestation(round_id, attestation, charged=False)
            return self._finish(out)

        # Charge first, then fetch: a crash while reports are open can never leave the release unrecorded. The
        # accountant and the ledger change together: if the ledger refuses or fails (a full disk), the accountant
        # forgets the round again, so nothing later is composed on a round that the ledger does not hold.
        before = self.accountant.state_dict()
        self.accountant.compose(event)
        try:
            self.ledger.record(self.accountant, round=round_id, mechanism=self.mechanism,
                               key_epoch=attestation.key_epoch, batch_id=attestation.batch_id)
        except BaseException:
            self.accountant.load_state_dict(before)
            raise

        applied = False
        try:  # from here the round is charged: whatever fails, it is recorded as such (below)
            spent = self.accountant.epsilon()
            out.epsilon, out.epsilon_family, out.epsilon_kind = float(spent.value), spent.family, spent.kind
            self._record_attestation(round_id, attestation, charged=True)
            t3 = time.perf_counter()
            out.seconds["account"] = t3 - t2
            acc = ReportAccumulator(self.dim)
            bad = 0
            for inner in self.shuffler.fetch(attestation):
                try:
                    payload = self.open_inner(bytes(inner), round_id)
                    acc.add(self.decoder.decode(payload, self.dim))  # the run's mechanism: unbiased estimate
                except Exception:  # noqa: BLE001 - one bad report is counted and skipped, never fatal
                    bad += 1
            out.n_bad_reports = bad
            out.n_applied = acc.count
            if acc.count + bad != n_attested:  # ShufflerClient.fetch checks this too; never apply more than charged
                raise RuntimeError(f"the shuffler released {acc.count + bad} reports for an attested {n_attested}")
            if bad:  # kept even if the round is lost before its checkpoint (the no-cover figure needs it)
                self.store.record_bad_reports(round_id, bad)
            no_cover = self._no_cover_accountant(out)
            if no_cover is not None:
                try:
                    out.epsilon_if_bad_gave_no_cover = float(no_cover.epsilon().value)
                except RefusedError as exc:  # e.g. fmt below its n: the budget check stops the run before the next
                    log.warning("round %d: the family %r cannot bound the rounds with the reports that failed to "
                                "open left out of n (%s); the run stops before the next round", round_id,
                                cfg.accounting_family, exc)
                if bad:
                    log.warning(
                        "round %d: %d of %d released reports failed to open or decode (an honest client's always "
                        "opens); epsilon is %s counting them as cover, %s if they gave none (report.json: "
                        "epsilon_if_bad_gave_no_cover; the budget uses the larger)", round_id, bad, n_attested,
                        out.epsilon, out.epsilon_if_bad_gave_no_cover)
            t4 = time.perf_counter()
            out.seconds["open_apply"] = t4 - t3
            if acc.count:
                mean = acc.mean()
                # "delta" reports are w_local - w: the pseudo-gradient is their negated mean (FedOpt, Reddi et al.)
                pseudo_gradient = mean if cfg.report == "gradient" else -mean
                self.arrays = self.optimizer.step(self.arrays, pseudo_gradient)
                applied = True
                out.status = "applied"
                out.reason = "" if not bad else f"{bad} reports failed to open or decode and were skipped"
            else:
                out.status = "applied"
                out.reason = f"charged, but none of the {n_attested} reports opened and decoded; the model is unchanged"
            # an evaluator may answer None for a metric it does not compute (report.json: null, the progress line: n/a)
            out.loss, out.accuracy = (None if v is None else float(v) for v in self.evaluator(self.arrays))
            out.seconds["evaluate"] = time.perf_counter() - t4
        except BaseException as exc:
            # The round is charged (accountant + ledger): the engine must not forget it, or a caller that goes on
            # could reuse the id and a later checkpoint would disagree with the ledger. Not saved here (state may be
            # half-updated); a restart reconciles from the ledger, as after a crash.
            out.status = "applied" if applied else "lost"
            out.reason = f"charged, but the round failed after the charge: {type(exc).__name__}"
            out.finished_at = time.time()
            self.history.append(out)
            self.last_round = round_id
            if self.on_round is not None:  # the progress line and report.json show the charge before the error
                try:
                    self.on_round(out)
                except Exception as hook_exc:  # noqa: BLE001 - the round's own error is the one to raise
                    log.warning("could not report the failed round %d: %s", round_id, hook_exc)
            raise
        return self._finish(out)

    # -- the run -----------------------------------------------------------------------------------------------
    def run(self, *, start_round: int | None = None) -> list[RoundOutcome]:
        """Restore (or start) and run rounds up to ``num-server-rounds`` or until the budget stops the run."""
        next_round = self.restore() if start_round is None else start_round
        while next_round <= self.cfg.num_server_rounds:
            outcome = self.run_round(next_round)
            if outcome.status == "stopped":
                break
            next_round += 1
        return self.history

    def report_rows(self) -> list[dict[str, Any]]:
        """The per-round rows of report.json: charged rounds only (applied or lost)."""
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
            for o in self.history
            if o.status in ("applied", "lost")
        ]


def _is_refusal(exc: BaseException) -> bool:
    """A shuffler refusal of the batch skips the round; transport failures and bad attestations are fatal.

    ``shuffledp.shuffler.client.ShufflerError`` carries the gRPC status code: FAILED_PRECONDITION (e.g. fewer than the
    shuffler's threshold of valid distinct signers), INVALID_ARGUMENT, ALREADY_EXISTS (binding already used) and
    RESOURCE_EXHAUSTED are refusals of this batch; UNAVAILABLE, DEADLINE_EXCEEDED, ... are not.
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


def _check_attestation(att: Any, *, round_id: int, key_epoch: int, digest: bytes, submitted: int) -> None:
    """Cross-check the (already signature-verified) attestation against what was submitted."""
    n = int(att.n_accepted)
    if not 0 <= n <= submitted:
        raise RuntimeError(f"the shuffler attested {n} reports for a batch of {submitted} envelopes")
    for attr, expected in (("round_id", round_id), ("key_epoch", key_epoch), ("model_digest", digest)):
        value = getattr(att, attr, None)  # a missing field is a mismatch, not a pass
        if value != expected:
            raise RuntimeError(f"the attestation's {attr} {value!r} does not match the submitted {expected!r}")
