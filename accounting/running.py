"""The accountant's running clone bound: the value of :func:`shuffledp.accounting.bounds.epsilon_for_rounds` for
a clone family, kept up to date round by round at a cost that does not grow with the history.

:class:`CloneRunner` holds what the committed rounds determine: their count, the distinct rounds (original, and
moved onto the grid of :func:`shuffledp.accounting.heterogeneous.dominating_round` once there are more than
``HETEROGENEOUS_EXACT_GROUPS``), the rounds per eps0 (for the ``no-shuffle`` cap) and the composed distribution
(:class:`shuffledp.accounting.composed.ComposedClones`). A prospective round (``would_exceed``) extends it without
changing it; committing that round adopts the extension. Every answer is the one ``epsilon_for_rounds`` computes
from scratch (same composition, same query, same cap), with two shortcuts that cannot change it:

* The epsilon query is :meth:`~shuffledp.accounting.composed.ComposedClones.epsilon`, the same operations as
  :func:`shuffledp.accounting.composition.pld_epsilon` on the same arrays.
* The ``no-shuffle`` cap only binds when it is below the composed value. No-shuffle's epsilon never decreases when
  rounds are added (the composition of more rounds is at least that of fewer: a post-processing drops them), so one
  check that it exceeds a value ``v`` at ``T0`` rounds (``no_shuffle_delta(eps0, T0, v) > delta``, or the
  heterogeneous cap above ``v``) settles every later history that contains those rounds and whose value is below
  ``v``; ``v`` is chosen with room (``CAP_HEADROOM`` times the value), so the check is repeated only when the value
  has grown that much. Otherwise the cap is computed exactly as ``epsilon_for_rounds`` computes it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shuffledp.accounting import Bound, bounds
from shuffledp.accounting import families as fam
from shuffledp.accounting import heterogeneous as het
from shuffledp.accounting import literature as lit
from shuffledp.accounting.composed import ComposedClones, fold

__all__ = ["CloneRunner", "CAP_HEADROOM", "UNDO_DEPTH"]

#: A cap check is done at this multiple of the current value, so it covers the values up to it.
CAP_HEADROOM = 2.0
#: Committed rounds that can be taken back (a rollback) without recomposing the history.
UNDO_DEPTH = 16
#: Relative room kept below a heterogeneous no-shuffle cap before it is taken to cover a later history.
_CAP_MARGIN = 1e-3
_DISCRETISATION = "pessimistic (mean-preserving spread, connect the dots; clone blocks at their lowest c)"


@dataclass(frozen=True, eq=False)
class _Frame:
    """What the committed rounds determine, apart from the count dictionaries (kept in the runner)."""

    rounds: int
    moved: bool
    state: ComposedClones | None  # the composed rounds (moved when ``moved``); None until a second distinct round


class CloneRunner:
    """The running bound of a clone family (see the module docstring).

    Args:
        family: ``"clones"`` or ``"clones-focs"``.
    """

    def __init__(self, family: str) -> None:
        self._found = fam.lookup(family)
        self._variant = fam.CLONE_VARIANTS[self._found.name]
        self._moved_cache: dict[tuple[int, float], tuple[int, float]] = {}
        self._caps: dict[tuple, tuple] = {}
        self.reset(())

    # -- the committed history ---------------------------------------------------------------------------------
    def reset(self, pairs: Sequence[tuple[int, float]]) -> None:
        """Forget everything and take ``pairs`` (``(n, eps0)`` of the rounds, validated) as the committed rounds.

        Args:
            pairs: the rounds, in order.
        """
        self._pairs: list[tuple[int, float]] = []
        self._orig: dict[tuple[int, float], int] = {}
        self._mapped: dict[tuple[int, float], int] = {}
        self._eps0: dict[float, int] = {}
        self._frame = _Frame(0, False, None)
        self._undo: deque = deque(maxlen=UNDO_DEPTH)
        self._prospect: tuple | None = None
        i = 0
        while i < len(pairs):
            j = i
            while j < len(pairs) and pairs[j] == pairs[i]:
                j += 1
            self.commit(pairs[i], j - i, lazy=True)
            i = j
        self._undo.clear()

    @property
    def pairs(self) -> list[tuple[int, float]]:
        """The committed rounds (do not change the list)."""
        return self._pairs

    def _move(self, pair: tuple[int, float]) -> tuple[int, float]:
        found = self._moved_cache.get(pair)
        if found is None:
            if len(self._moved_cache) > 65536:
                self._moved_cache.clear()
            found = self._moved_cache[pair] = het.dominating_round(pair[0], pair[1], lower=False)
        return found

    def _child(self, pair: tuple[int, float], count: int) -> tuple[_Frame, tuple[int, float], bool]:
        """The frame of the committed rounds followed by ``count`` rounds ``pair`` (nothing is changed), the moved
        pair, and whether the whole history had to be moved (a fresh fold)."""
        frame = self._frame
        distinct = len(self._orig) + (pair not in self._orig)
        moved = frame.moved or distinct > het.HETEROGENEOUS_EXACT_GROUPS
        target = self._move(pair) if moved else pair
        if distinct == 1:
            return _Frame(frame.rounds + count, False, None), target, False
        if moved and not frame.moved:  # every round moves onto the grid: compose them afresh
            rounds = [self._move(p) for p in self._pairs] + [target] * count
            return _Frame(frame.rounds + count, True, fold(rounds, self._variant)), target, True
        state = self._committed_state()
        if state is None:  # one repeated round so far: it is one run
            state = fold(list(self._pairs), self._variant)
        return _Frame(frame.rounds + count, moved, state.extended(target[0], target[1], count)), target, False

    def commit(self, pair: tuple[int, float], count: int, *, lazy: bool = False) -> None:
        """Add ``count`` rounds ``pair`` to the committed rounds (adopting the prospective extension if it is the one
        last asked about).

        Args:
            pair: ``(n, eps0)`` of the round, validated.
            count: how many, >= 1.
            lazy: do not compose now (a history being rebuilt: the state is composed at the first query).
        """
        prospect = self._prospect
        self._prospect = None
        before = self._frame
        if prospect is not None and prospect[0] is before and prospect[1] == (pair, count):
            child = prospect[2][0]
        elif lazy:
            child = None
        else:
            child = self._child(pair, count)[0]
        self._undo.append((before, pair, count))
        self._pairs.extend([pair] * count)
        self._orig[pair] = self._orig.get(pair, 0) + count
        moved = before.moved or len(self._orig) > het.HETEROGENEOUS_EXACT_GROUPS
        if moved and not before.moved:
            self._recount(len(self._pairs) - count, moved=True)
        target = self._move(pair) if moved else pair
        self._mapped[target] = self._mapped.get(target, 0) + count
        self._eps0[target[1]] = self._eps0.get(target[1], 0) + count
        self._frame = child if child is not None else _Frame(before.rounds + count, moved, None)

    def _recount(self, upto: int, *, moved: bool) -> None:
        """Rebuild the moved (or original) round counts and the rounds per eps0 from the first ``upto`` rounds."""
        self._mapped, self._eps0 = {}, {}
        for p in self._pairs[:upto]:
            m = self._move(p) if moved else p
            self._mapped[m] = self._mapped.get(m, 0) + 1
            self._eps0[m[1]] = self._eps0.get(m[1], 0) + 1

    def rollback(self, rounds: int) -> bool:
        """Take the committed history back to its first ``rounds`` rounds, if they are within the undo log.

        Args:
            rounds: the length to go back to.

        Returns:
            True if done; False if the log does not reach back that far (nothing is changed then).
        """
        steps, total = 0, self._frame.rounds
        for entry in reversed(self._undo):
            if total <= rounds:
                break
            total -= entry[2]
            steps += 1
        if total != rounds:
            return False
        for _ in range(steps):
            frame, pair, count = self._undo.pop()
            del self._pairs[len(self._pairs) - count :]
            self._orig[pair] -= count
            if not self._orig[pair]:
                del self._orig[pair]
            if self._frame.moved and not frame.moved:
                self._recount(len(self._pairs), moved=False)
            else:
                target = self._move(pair) if frame.moved else pair
                self._mapped[target] -= count
                if not self._mapped[target]:
                    del self._mapped[target]
                self._eps0[target[1]] -= count
                if not self._eps0[target[1]]:
                    del self._eps0[target[1]]
            self._frame = frame
        self._prospect = None
        return True

    # -- queries -----------------------------------------------------------------------------------------------
    def _committed_state(self) -> ComposedClones | None:
        """The composed state of the committed rounds (composed now if a rebuild left it out); None while they are
        one repeated round."""
        frame = self._frame
        if frame.state is None and len(self._orig) > 1:
            pairs = [self._move(p) for p in self._pairs] if frame.moved else list(self._pairs)
            self._frame = frame = _Frame(frame.rounds, frame.moved, fold(pairs, self._variant))
        return frame.state

    def bound(self, delta: float, prospective: tuple[tuple[int, float], int] | None = None,
              allow_approximate: bool = False) -> Bound:
        """The family's bound for the committed rounds, followed by ``prospective`` (``(pair, count)``) if given.

        Args:
            delta: 0 < delta < 1 (validated).
            prospective: rounds to add for this answer only, or None.
            allow_approximate: passed on to the homogeneous bound.

        Returns:
            The :class:`~shuffledp.accounting.Bound` ``epsilon_for_rounds`` gives for those rounds.
        """
        if prospective is None:
            distinct = len(self._orig)
            state = self._committed_state()
            frame, first = self._frame, (self._pairs[0] if self._pairs else None)
            groups, by_eps0 = len(self._mapped), self._eps0
        else:
            pair, count = prospective
            if self._frame.state is None and len(self._orig) > 1:
                self._committed_state()
            prospect = self._prospect
            if prospect is None or prospect[0] is not self._frame or prospect[1] != (pair, count):
                prospect = self._prospect = (self._frame, (pair, count), self._child(pair, count))
            frame, target, refolded = prospect[2]
            state = frame.state
            distinct = len(self._orig) + (pair not in self._orig)
            first = self._pairs[0] if self._pairs else pair
            if refolded:
                mapped: dict = {}
                by_eps0: dict[float, int] = {}
                for p in self._pairs:
                    m = self._move(p)
                    mapped[m] = 1
                    by_eps0[m[1]] = by_eps0.get(m[1], 0) + 1
                mapped[target] = 1
                by_eps0[target[1]] = by_eps0.get(target[1], 0) + count
                groups = len(mapped)
            else:
                groups = len(self._mapped) + (target not in self._mapped)
                by_eps0 = {**self._eps0, target[1]: self._eps0.get(target[1], 0) + count}
        if distinct == 1:
            n, eps0 = first
            return bounds.epsilon(self._found.name, eps0, n, delta, frame.rounds, allow_approximate=allow_approximate)
        return self._composed_bound(state, delta, frame.rounds, distinct, groups, frame.moved, by_eps0)

    def _composed_bound(self, state: ComposedClones, delta: float, total: int, distinct: int, groups: int,
                        moved: bool, by_eps0: dict[float, int]) -> Bound:
        """``clones_in_order``'s value and details for the composed ``state`` (see the module docstring)."""
        value = state.epsilon(delta)
        details: dict[str, Any] = {"method": "pld, composed round by round", "discretisation": _DISCRETISATION,
                                   "interval": state.h}
        if moved:
            details["bucketed"] = {"groups_before": distinct, "n_ratio": het.HETEROGENEOUS_N_GRID_RATIO,
                                   "eps0_ratio": het.HETEROGENEOUS_EPS0_GRID_RATIO}
        details["groups"] = groups
        details["rounds"] = total
        cap = self._cap(value, delta, total, by_eps0)
        if cap < value:
            value, details = cap, {**details, "capped_by_no_shuffle": True, "uncapped": value}
        return Bound(value=max(value, 0.0), kind=self._found.kind, family=self._found.name, details=details)

    def _cap(self, value: float, delta: float, total: int, by_eps0: dict[float, int]) -> float:
        """The ``no-shuffle`` cap as ``clones_in_order`` uses it (``inf`` where it cannot bind)."""
        if len(by_eps0) == 1:
            (eps0,) = by_eps0
            key: tuple = (delta, eps0)
            cert = self._caps.get(key)
            if math.isfinite(value) and cert is not None and total >= cert[0] and value < cert[1]:
                return math.inf  # no_shuffle_epsilon(eps0, total) >= no_shuffle_epsilon(eps0, cert[0]) > cert[1]
            if math.isfinite(value) and lit.no_shuffle_delta(eps0, total, value) > delta:
                room = CAP_HEADROOM * value
                if value > 0.0 and lit.no_shuffle_delta(eps0, total, room) > delta:
                    self._caps[key] = (total, room)
                return math.inf
            return lit.no_shuffle_epsilon(eps0, total, delta)
        merged = [(1, e, c) for e, c in by_eps0.items()]
        key = (delta, tuple(sorted(by_eps0)))
        cert = self._caps.get(key)
        if (math.isfinite(value) and cert is not None and value < cert[1]
                and all(by_eps0[e] >= c for e, c in cert[0].items())):
            return math.inf  # more rounds of every eps0: the heterogeneous no-shuffle value can only be larger
        cap, _ = fam.REGISTRY["no-shuffle"].heterogeneous_epsilon(merged, total, delta, False)
        if math.isfinite(cap):  # the computed cap may move by its discretisation when rounds are added: keep room
            self._caps[key] = (dict(by_eps0), cap * (1.0 - _CAP_MARGIN))
        return cap
