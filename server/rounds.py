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
9. stream the permuted inner ciphertexts, open each one, decode the opened reports a chunk at a time and add them
   to a running sum (O(chunk * model) memory, never the batch; :func:`shuffledp.server.release.open_release`); a
   report that fails to open or decode is counted and skipped;
10. one server-optimizer step with the mean; central evaluation on the held-out test set;
11. atomic checkpoint (model, optimizer, accountant, round, history).

Its parts live next to it: :mod:`shuffledp.server.collect` (steps 1 and 4-5: the messages, the collection),
:mod:`shuffledp.server.release` (steps 6 and 9: the attestation's cross-check; opening, decoding and summing the
released reports; the figure without the bad reports as cover), :mod:`shuffledp.server.resume` (the resume) and
:mod:`shuffledp.server.outcome` (the protocols it works against and :class:`RoundOutcome`).

Crash consistency (:meth:`RoundEngine.restore`): the ledger is written before the checkpoint, so after a crash
the ledger is at most one round ahead of the checkpoint. That round's release is re-charged from the ledger row
(exactly once: the ledger's round primary key) and its model update is lost (marked ``"lost"`` in the
history); the run continues with a fresh round id.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from shuffledp.accounting import RefusedError, format_bound
from shuffledp.accounting.accountant import ShuffleAccountant
from shuffledp.accounting.events import ShuffleRound
from shuffledp.accounting.ledger import Ledger
from shuffledp.clients import messages as M
from shuffledp.clients.mechanism import Mechanism, make_mechanism
from shuffledp.server.collect import (
    build_messages,
    check_array_names,
    check_train_config,
    collect_into_stream,
    envelope_of,
    sample_nodes,
    wait_for_nodes,
)
from shuffledp.server.config import ConfigError, ServerConfig
from shuffledp.server.optim import ServerOptimizer, num_parameters
from shuffledp.server.outcome import (
    Evaluator,
    GridLike,
    InnerOpener,
    ResumeError,
    RoundOutcome,
    ShufflerLike,
    is_refusal,
    report_rows,
)
from shuffledp.server.release import check_attestation, no_cover_accountant, note_bad_reports, open_release
from shuffledp.server.report import epsilon_label
from shuffledp.server.resume import RESUME_KEYS, restore
from shuffledp.server.state import Checkpoint, CheckpointStore

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
        self.array_names = check_array_names(array_names, len(self.arrays))
        self.extra_train_config = check_train_config(train_config, config)
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

    def restore(self) -> int:
        """Load the checkpoint (or start fresh), reconcile it with the ledger, and return the next round id: the rules
        are :func:`shuffledp.server.resume.restore`'s.

        Raises:
            ResumeError: the stored state and the ledger disagree, or a setting of :data:`RESUME_KEYS` changed.
        """
        return restore(self)

    # -- one round ---------------------------------------------------------------------------------------------
    def _build_messages(self, nodes: Sequence[int], round_id: int) -> list[Any]:
        """The round's ``train.shuffled`` messages (:func:`shuffledp.server.collect.build_messages`)."""
        return build_messages(nodes, round_id, self.arrays, self.array_names, self.cfg, self.extra_train_config)

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
        # pessimistic: the reports that failed to open or decode are not counted as cover
        no_cover = no_cover_accountant(self.history, target_delta=self.cfg.target_delta, family=family)
        try:
            if no_cover is not None and no_cover.would_exceed(event, self.cfg.budget_epsilon):
                return f"it would exceed {budget} once the reports of earlier rounds that failed to open or decode " \
                       "are not counted as cover"
        except RefusedError as exc:
            return (f"the accounting family {family!r} cannot bound the rounds once the reports that failed to open "
                    f"or decode are left out of n: {exc}")
        return None

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
        try:  # the messages are built in the call, not kept here: collect drops them once pushed
            stream = collect_into_stream(self.grid, self.shuffler, self.cfg, self.envelope_length,
                                         self._build_messages(sampled, round_id), round_id, digest, out)
        except Exception as exc:  # noqa: BLE001 - classified below
            if not is_refusal(exc):
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
            if not is_refusal(exc):
                raise
            out.reason = f"the shuffler refused the batch: {exc}"
            return self._finish(out)
        n_attested = int(attestation.n_accepted)
        out.n_reports = n_attested
        t2 = time.perf_counter()
        out.seconds["shuffle"] = t2 - t1
        try:
            check_attestation(attestation, round_id=round_id, key_epoch=cfg.key_epoch, digest=digest,
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
        return self._charged(out, attestation, t2)

    def _charged(self, out: RoundOutcome, attestation: Any, t_sealed: float) -> RoundOutcome:
        """The rest of a round once it is charged (steps 9-11 of the module docstring): fetch, open, decode and sum
        the released reports, one optimizer step with the mean, the evaluation and the checkpoint. Whatever fails
        here, the round stays on record as charged (applied or lost) before the error is raised."""
        cfg, round_id, n_attested = self.cfg, out.round, out.n_reports
        applied = False
        try:
            spent = self.accountant.epsilon()
            out.epsilon, out.epsilon_family, out.epsilon_kind = float(spent.value), spent.family, spent.kind
            self._record_attestation(round_id, attestation, charged=True)
            t3 = time.perf_counter()
            out.seconds["account"] = t3 - t_sealed
            # one at a time to open, a chunk at a time to decode; O(chunk * d) memory, never the batch
            opened = open_release(self.shuffler.fetch(attestation), self.open_inner, round_id, self.decoder, self.dim)
            acc, bad = opened.sum, opened.bad
            out.n_bad_reports = bad
            out.n_applied = acc.count
            if opened.total != n_attested:  # ShufflerClient.fetch checks this too; never apply more than charged
                raise RuntimeError(f"the shuffler released {opened.total} reports for an attested {n_attested}")
            note_bad_reports(out, self.history, cfg, self.store)
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
        """The per-round rows of report.json: charged rounds only (applied or lost; :func:`report_rows`)."""
        return report_rows(self.history)

