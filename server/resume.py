"""Resuming a run: the settings a resume must keep, and :func:`restore`, which reconciles the checkpoint with the
ledger and the shuffler's count of released batches (see :mod:`shuffledp.server.rounds` for crash consistency)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from shuffledp.accounting.accountant import ShuffleAccountant
from shuffledp.accounting.events import ShuffleRound
from shuffledp.server.config import DEFAULTS
from shuffledp.server.optim import ServerOptimizer
from shuffledp.server.outcome import ResumeError, RoundOutcome
from shuffledp.server.state import CheckpointError

#: The round engine (:class:`shuffledp.server.rounds.RoundEngine`, which imports this module): its checkpoint
#: store, ledger, shuffler, configuration and state, which :func:`restore` reconciles and sets.
RoundEngine = Any

__all__ = ["RESUME_KEYS", "restore", "refuse_a_spent_key_epoch"]

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
    "seed",
    "target-delta",
    "accounting-family",
    "comparison-families",
    "server-optimizer",
    "server-lr",
    "server-momentum",
    "key-epoch",
)


def refuse_a_spent_key_epoch(engine: RoundEngine, rows: Sequence[Mapping[str, Any]], *, fresh: bool) -> None:
    """Raise ResumeError if the shuffler reports more released batches of this run's key epoch than this run's
    ledger charged (its Stats; a shuffler too old to report them says 0).

    A run's batches are charged before they are fetched (released), so every release of this run has a ledger
    row, and a surplus of releases is another run's, in the same key epoch: this accountant would leave out
    reports already released to a server. Rows without a batch (older ledgers) count as this epoch's.
    """
    stats = engine.shuffler.stats()
    released = int(stats.get("epoch_batches_released", 0))
    if int(stats.get("key_epoch", -1)) != engine.cfg.key_epoch:
        return
    charged = sum(1 for r in rows if r.get("key_epoch") in (engine.cfg.key_epoch, None))
    if released <= charged:
        return
    if fresh:
        raise ResumeError(
            f"the shuffler has already released {released} batch(es) of key epoch {engine.cfg.key_epoch}, and this "
            "run has no checkpoint or ledger rows: a fresh accountant would start at epsilon 0 although this "
            "epoch's reports were already released to a server. Resume the run that spent them (its output "
            "directory), or rotate the keys to a new key epoch for a new run"
        )
    raise ResumeError(
        f"the shuffler has released {released} batch(es) of key epoch {engine.cfg.key_epoch}, but this run's "
        f"ledger charges only {charged}: another run has used this key epoch since, and its releases are "
        "not in this run's accountant, so the epsilon it would report leaves them out. Find that run "
        "(`shuffledp audit` with both ledgers names the batches); every run needs its own key epoch"
    )


def restore(engine: RoundEngine) -> int:
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
        ckpt = engine.store.load()
    except CheckpointError as exc:
        raise ResumeError(f"cannot read the checkpoint: {exc}") from None
    rows = engine.ledger.rows()
    if ckpt is None:
        if rows:
            raise ResumeError(
                f"the ledger {engine.ledger.path} already records rounds {[r['round'] for r in rows]} but there "
                "is no checkpoint; refusing to start a run that would mix with another run's ledger "
                "(use a fresh run name or output directory)"
            )
        refuse_a_spent_key_epoch(engine, rows, fresh=True)
        engine.last_round = 0
        engine.save()
        return 1

    current = engine.cfg.as_dict()
    # a checkpoint written before a key existed holds no value for it: it ran with the key's default (laplace)
    saved = {k: ckpt.config.get(k, DEFAULTS.get(k)) for k in RESUME_KEYS}
    changed = {k: (saved[k], current.get(k)) for k in RESUME_KEYS if saved[k] != current.get(k)}
    if changed:
        raise ResumeError(
            "the configuration changed since the checkpoint in settings that a resume must keep: "
            + ", ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in changed.items())
        )
    refuse_a_spent_key_epoch(engine, rows, fresh=False)
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
    if [tuple(a.shape) for a in ckpt.arrays] != engine.shapes:
        raise ResumeError(
            f"the checkpoint's model has shapes {[tuple(a.shape) for a in ckpt.arrays]}, this run's model "
            f"has {engine.shapes}"
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
    bad_reports = engine.store.bad_reports()
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
    last_started = engine.store.last_started()
    known = {h.round for h in history}
    for rnd in range(1, last_started + 1):
        if rnd not in known:  # used (its requests may have gone out), never charged: nothing was released
            history.append(RoundOutcome(
                round=rnd, status="abandoned", eps0=engine.cfg.eps0, delta=engine.cfg.target_delta,
                reason="the process stopped or failed during this round before it was charged; nothing of it "
                       "was released to the server, and its id is not reused"))
            log.warning("round %d was started but never charged (the process stopped or failed): recorded "
                        "as abandoned", rnd)
    history.sort(key=lambda h: h.round)

    engine.arrays = [np.array(a, copy=True) for a in ckpt.arrays]
    engine.optimizer = optimizer
    engine.accountant = accountant
    engine.history = history
    engine.budget_changes = budget_changes
    engine.last_round = max(ckpt.round, last_ledger, last_started)
    engine.save()  # persist the reconciliation before anything else happens
    return engine.last_round + 1
