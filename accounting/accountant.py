"""A stateful privacy accountant for federated rounds in the shuffle model.

:class:`ShuffleAccountant` mirrors the shape of Flower's ``PrivacyAccountant`` protocol (``compose``,
``would_exceed``, ``state_dict``/``load_state_dict``) and of Google ``dp_accounting`` (events kept apart from
accountants: a :class:`~shuffledp.accounting.events.ShuffleRound` says what happened, the accountant says what it
costs).

Every round is kept, so rounds may differ in ``n`` and ``eps0``. For a clone family as the default (``clones``,
``clones-focs``: Feldman, McMillan, Talwar, SODA'23 clone reduction; Wang et al., NeurIPS'23) the composed privacy
loss distribution is kept and each new round is composed into it (:class:`shuffledp.accounting.running.
CloneRunner` over :class:`shuffledp.accounting.composed.ComposedClones`), so a charge costs the same at round 1,000
as at round 1, and the value equals :func:`shuffledp.accounting.bounds.epsilon_for_rounds` (same composition, same
query, same ``no-shuffle`` cap); a history of one repeated round uses the homogeneous bound (exact for one round).
The other families are recomputed from the whole history with :func:`~shuffledp.accounting.bounds.
epsilon_for_rounds`, which composes privacy loss distributions pessimistically for the exact families, sums Renyi
divergences for the RDP families, and adds ``mu^2`` for the GDP families. A checkpoint
(:meth:`ShuffleAccountant.state_dict`) stores the round list; restoring it replays the composition in the same
order, which rebuilds the composed distribution bit for bit.

The default family must be one that yields a guarantee (an *upper bound* on the privacy loss). Comparison
families may be approximations (CLT-based, e.g. Chen-Cao-Ge ICASSP'24 Thm 2) or lower bounds, and are reported
with their kind; a comparison family that refuses the parameters is reported as a :class:`Refusal` carrying the
reason, never as a number.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from shuffledp.accounting import FAMILIES, FAMILY_KINDS, Bound, RefusedError, bounds
from shuffledp.accounting import families as fam
from shuffledp.accounting.core import EPS0_MAX, N_MAX
from shuffledp.accounting.events import ShuffleRound
from shuffledp.accounting.running import CloneRunner
from shuffledp.accounting.validation import check_delta, check_real, check_rounds

__all__ = ["ShuffleAccountant", "Refusal", "GUARANTEE_FAMILIES", "STATE_FORMAT", "STATE_VERSION"]

STATE_FORMAT = "shuffledp.accountant"
STATE_VERSION = 1
_CACHE_SIZE = 64

#: Families whose values are upper bounds on the privacy loss (guarantees); only these may be the default.
GUARANTEE_FAMILIES: tuple[str, ...] = tuple(f for f in FAMILIES if FAMILY_KINDS[f] == "upper")


@dataclass(frozen=True, slots=True)
class Refusal:
    """A family that declined to give a value for these rounds, with its reason. It carries no number.

    ``value`` is always None and ``kind`` always ``"refused"``, so a refusal can sit next to
    :class:`accounting.Bound` objects in a report but any arithmetic on it fails loudly.
    """

    family: str
    reason: str

    @property
    def value(self) -> None:
        """Always None: a refused family has no number."""
        return None

    @property
    def kind(self) -> str:
        """Always ``"refused"``."""
        return "refused"


def _revalidated(event: ShuffleRound) -> ShuffleRound:
    """Re-run the :class:`ShuffleRound` checks (n in [1, N_MAX], eps0 in (0, EPS0_MAX]) on ``event``.

    The constructor already checks them; this guards against a frozen instance altered behind its back, so
    that nothing the bounds would reject ever enters the history (every later query would fail on it). Values
    of exactly the types the constructor produces and inside its ranges are taken as they are (the constructor
    would return them unchanged); anything else goes through the constructor, which normalises or refuses it.
    """
    n, eps0 = event.n, event.eps0
    if type(n) is int and type(eps0) is float and 1 <= n <= N_MAX and 0.0 < eps0 <= EPS0_MAX:
        return event
    return ShuffleRound(n=n, eps0=eps0)


class _Prospect(Sequence):
    """A history followed by ``count`` rounds ``event``, as a read-only sequence that does not copy the history
    (the default clone family extends its running state instead of reading it)."""

    def __init__(self, history: list[ShuffleRound], event: ShuffleRound, count: int) -> None:
        self.history, self.event, self.count = history, event, count

    def __len__(self) -> int:
        return len(self.history) + self.count

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        i = index + len(self) if index < 0 else index
        if not 0 <= i < len(self):
            raise IndexError("round index out of range")
        return self.history[i] if i < len(self.history) else self.event


def _check_family(name: str, value: Any) -> str:
    if not isinstance(value, str) or value not in FAMILIES:
        raise ValueError(f"{name} must be one of {list(FAMILIES)}, got {value!r}")
    return value


class ShuffleAccountant:
    """Cumulative privacy accounting over shuffled rounds, at a fixed target delta.

    Args:
        target_delta: the delta at which epsilons are reported by default, in (0, 1).
        family: the bound family the budget is enforced with; one of :data:`GUARANTEE_FAMILIES` (default
            ``"clones"``, the stronger clone pair of Feldman, McMillan, Talwar SODA'23).
        comparison_families: other families reported next to the default (e.g. ``("ccg-gdp", "rr-lower")``);
            each at most once and different from ``family``.
        allow_approximate: let comparison families that are CLT approximations (``ccg-gdp``, ``ccg-rdp``) give
            a value even where they are known to fall below the exact value (few expected clones,
            ``n/(e^eps0+1) < 2 ln(1/delta)``). Off by default: they are then reported as refused.

    All epsilons returned are upper bounds (for the default family) computed pessimistically; values of
    comparison families carry their own kind (``upper``, ``approximate`` or ``lower``).

    Raises:
        ValueError: a parameter is outside what is allowed (the message says what is allowed).
    """

    def __init__(
        self,
        target_delta: float,
        family: str = "clones",
        comparison_families: Iterable[str] = (),
        *,
        allow_approximate: bool = False,
    ) -> None:
        self._target_delta = check_delta(target_delta, "target_delta")
        self._family = _check_family("family", family)
        if self._family not in GUARANTEE_FAMILIES:
            raise ValueError(
                f"family {family!r} does not give a guarantee (it is an approximation or a lower bound), so it "
                f"cannot enforce a budget; choose one of {list(GUARANTEE_FAMILIES)} and pass {family!r} in "
                "comparison_families instead"
            )
        if isinstance(comparison_families, str):
            raise TypeError(
                f"comparison_families must be a sequence of family names, not the string {comparison_families!r}"
            )
        comparison = tuple(_check_family("each comparison family", f) for f in comparison_families)
        if len(set(comparison)) != len(comparison):
            raise ValueError(f"comparison_families lists a family twice: {list(comparison)}")
        if self._family in comparison:
            raise ValueError(f"comparison_families must not repeat the default family {self._family!r}")
        self._comparison = comparison
        if not isinstance(allow_approximate, bool):
            raise TypeError(f"allow_approximate must be a bool, got {allow_approximate!r}")
        self._allow_approximate = allow_approximate
        self._rounds: list[ShuffleRound] = []
        # (family, delta, history id) -> result; small, most recent last. would_exceed's prospective result is kept,
        # so the usual would_exceed -> compose -> epsilon sequence computes the default family once. A history id
        # names a sequence of rounds: 0 the empty one, (parent id, event, count) -> child id in _children, and a
        # fresh id for a history loaded from a state (an id never names two different sequences).
        self._cache: dict[tuple[str, float, int], Bound | Refusal] = {}
        self._history = 0
        self._next_id = 1
        self._children: dict[tuple[int, ShuffleRound, int], int] = {}
        # the default clone family's running bound (composed distribution and round counts of the history)
        self._runner = CloneRunner(self._family) if self._family in fam.CLONE_VARIANTS else None

    # -- properties --------------------------------------------------------------------------------------------
    @property
    def target_delta(self) -> float:
        """The default delta of :meth:`epsilon` and :meth:`epsilons`."""
        return self._target_delta

    @property
    def family(self) -> str:
        """The default (budget-enforcing) family."""
        return self._family

    @property
    def comparison_families(self) -> tuple[str, ...]:
        """The families reported next to the default one."""
        return self._comparison

    @property
    def allow_approximate(self) -> bool:
        """Whether CLT approximations may be reported outside their region of validity."""
        return self._allow_approximate

    @property
    def rounds(self) -> tuple[ShuffleRound, ...]:
        """Every composed round, in order."""
        return tuple(self._rounds)

    @property
    def num_releases(self) -> int:
        """The number of composed rounds (the name Flower's ``PrivacyAccountant`` uses)."""
        return len(self._rounds)

    # -- composition -------------------------------------------------------------------------------------------
    def compose(self, event: ShuffleRound, count: int = 1) -> None:
        """Record ``count`` identical rounds ``event`` (each ``event.n`` reports, each ``event.eps0``-LDP).

        Raises:
            TypeError: ``event`` is not a :class:`ShuffleRound`, or ``count`` is not an int.
            ValueError: ``count < 1``, or the event's n/eps0 are outside what the bounds accept (n in
                [1, N_MAX], eps0 in (0, EPS0_MAX]). Nothing is composed in any of these cases.
        """
        if not isinstance(event, ShuffleRound):
            raise TypeError(f"compose takes a ShuffleRound, got {type(event).__name__}")
        count = check_rounds(count, "count")
        event = _revalidated(event)  # before any state changes: a rejected round leaves the history intact
        self._history = self._child(event, count)
        self._rounds.extend([event] * count)
        if self._runner is not None:
            self._runner.commit((event.n, event.eps0), count)

    def _child(self, event: ShuffleRound, count: int) -> int:
        """The id of this history followed by ``count`` rounds ``event``."""
        key = (self._history, event, count)
        if key not in self._children:
            if len(self._children) >= _CACHE_SIZE:
                self._children = {}  # ids stay unique (never reused), only the lookup of older children is lost
            self._children[key] = self._next_id
            self._next_id += 1
        return self._children[key]

    # -- queries -----------------------------------------------------------------------------------------------
    def _delta_or_target(self, delta: float | None) -> float:
        return self._target_delta if delta is None else check_delta(delta)

    def _compute(self, family: str, rounds: Sequence[ShuffleRound], delta: float) -> Bound:
        """The family's bound for ``rounds``: this history, or this history followed by prospective rounds
        (:class:`_Prospect`)."""
        if family == self._family and self._runner is not None:
            if rounds is self._rounds:
                if not rounds:
                    return Bound(value=0.0, kind=FAMILY_KINDS[family], family=family, details={"rounds": 0})
                return self._runner.bound(delta, None, self._allow_approximate)
            if isinstance(rounds, _Prospect) and rounds.history is self._rounds:
                extra = ((rounds.event.n, rounds.event.eps0), rounds.count)
                return self._runner.bound(delta, extra, self._allow_approximate)
        if not rounds:
            # No release yet: nothing has been learnt, for every family.
            return Bound(value=0.0, kind=FAMILY_KINDS[family], family=family, details={"rounds": 0})
        return bounds.epsilon_for_rounds(family, rounds, delta, allow_approximate=self._allow_approximate)

    def _cached(
        self, family: str, delta: float, rounds: Sequence[ShuffleRound] | None = None, history_id: int | None = None
    ) -> Bound | Refusal:
        history = self._rounds if rounds is None else rounds
        key = (family, delta, self._history if history_id is None else history_id)
        if key not in self._cache:
            try:
                result: Bound | Refusal = self._compute(family, history, delta)
            except RefusedError as exc:
                result = Refusal(family=family, reason=str(exc))
            self._cache[key] = result
            while len(self._cache) > _CACHE_SIZE:
                del self._cache[next(iter(self._cache))]
        return self._cache[key]

    def epsilon(self, delta: float | None = None) -> Bound:
        """Return an upper bound on the cumulative epsilon of all composed rounds, default family.

        Args:
            delta: the delta at which to state epsilon; defaults to ``target_delta``.

        Raises:
            accounting.RefusedError: the default family cannot bound these rounds (e.g. ``fmt`` outside
                its validity region). There is no silent fallback to another family.
        """
        result = self._cached(self._family, self._delta_or_target(delta))
        if isinstance(result, Refusal):
            raise RefusedError(result.reason)
        return result

    def epsilons(self, delta: float | None = None) -> dict[str, Bound | Refusal]:
        """Return the cumulative epsilon for the default family (first) and every comparison family.

        Each value is a :class:`~accounting.Bound` labelled with its kind (``upper`` = guarantee,
        ``approximate`` = estimate, ``lower`` = lower bound), or a :class:`Refusal` with the reason when a
        family declines these parameters. A refusal never appears as a number.
        """
        used = self._delta_or_target(delta)
        return {family: self._cached(family, used) for family in (self._family, *self._comparison)}

    def would_exceed(self, event: ShuffleRound, budget_epsilon: float, count: int = 1) -> bool:
        """Return True if composing ``count`` rounds ``event`` would take the default family above the budget.

        Pessimistic: the test is on the default family's upper bound of the cumulative epsilon at
        ``target_delta`` (for ``clones`` the pessimistically discretised privacy loss distribution), so False
        means the budget is certainly respected, by the default family's guarantee.

        Raises:
            TypeError, ValueError: invalid ``event``, ``budget_epsilon`` or ``count``.
            accounting.RefusedError: the default family cannot bound the prospective rounds.
        """
        if not isinstance(event, ShuffleRound):
            raise TypeError(f"would_exceed takes a ShuffleRound, got {type(event).__name__}")
        budget = check_real("budget_epsilon", budget_epsilon, "a real number > 0 (or inf)")
        if math.isnan(budget) or budget <= 0.0:
            raise ValueError(f"budget_epsilon must be a real number > 0 (or inf), got {budget!r}")
        count = check_rounds(count, "count")
        event = _revalidated(event)
        prospective = _Prospect(self._rounds, event, count)
        result = self._cached(self._family, self._target_delta, prospective, self._child(event, count))
        if isinstance(result, Refusal):
            raise RefusedError(result.reason)
        return float(result.value) > budget

    # -- checkpointing -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Return the accountant's state as a JSON-serialisable dict (versioned; floats round-trip exactly)."""
        return {
            "format": STATE_FORMAT,
            "version": STATE_VERSION,
            "target_delta": self._target_delta,
            "family": self._family,
            "comparison_families": list(self._comparison),
            "allow_approximate": self._allow_approximate,
            "rounds": [r.to_dict() for r in self._rounds],
        }

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> ShuffleAccountant:
        """Rebuild an accountant from :meth:`state_dict` output (e.g. after ``json.loads``).

        Raises:
            ValueError: the state is not a shuffledp accountant state of a supported version, or a field is
                invalid (the message names it).
        """
        expected = {"format", "version", "target_delta", "family", "comparison_families", "allow_approximate", "rounds"}
        if not isinstance(state, Mapping):
            raise ValueError(f"an accountant state must be a mapping, got {type(state).__name__}")
        if state.get("format") != STATE_FORMAT:
            raise ValueError(
                f"not a shuffledp accountant state: 'format' is {state.get('format')!r}, expected {STATE_FORMAT!r}"
            )
        version = state.get("version")
        if isinstance(version, bool) or not isinstance(version, int) or version != STATE_VERSION:
            raise ValueError(
                f"accountant state version {state.get('version')!r} is not supported; this version reads "
                f"version {STATE_VERSION}"
            )
        if set(state) != expected:
            raise ValueError(
                f"accountant state has keys {sorted(state)}; expected exactly {sorted(expected)}"
            )
        rounds = state["rounds"]
        if not isinstance(rounds, list):
            raise ValueError(f"accountant state 'rounds' must be a list, got {type(rounds).__name__}")
        comparison = state["comparison_families"]
        if not isinstance(comparison, list):
            raise ValueError(f"accountant state 'comparison_families' must be a list, got {type(comparison).__name__}")
        try:  # the constructors' TypeErrors (a string delta, a float count) are this method's ValueError
            accountant = cls(
                target_delta=state["target_delta"],
                family=state["family"],
                comparison_families=comparison,
                allow_approximate=state["allow_approximate"],
            )
            accountant._rounds = [ShuffleRound.from_dict(r) for r in rounds]
            if accountant._rounds:
                accountant._history, accountant._next_id = 1, 2
            if accountant._runner is not None:  # composed at the first query, in the order of the rounds
                accountant._runner.reset([(r.n, r.eps0) for r in accountant._rounds])
        except TypeError as exc:
            raise ValueError(f"accountant state has a field of the wrong type: {exc}") from None
        return accountant

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace this accountant's state with ``state`` (Flower's protocol name); validated before anything
        changes, so an invalid state leaves the accountant as it was."""
        other = ShuffleAccountant.from_state_dict(state)
        # a prefix of this history within the runner's undo log (the server's rollback after a failed ledger write)
        # keeps the composed state it had; any other history is composed afresh at its first query
        keep = (
            other._family == self._family and self._runner is not None and len(other._rounds) <= len(self._rounds)
            and self._rounds[: len(other._rounds)] == other._rounds and self._runner.rollback(len(other._rounds))
        )
        if not keep:
            self._runner = other._runner
        self._target_delta = other._target_delta
        self._family = other._family
        self._comparison = other._comparison
        self._allow_approximate = other._allow_approximate
        self._rounds = other._rounds
        self._cache = {}
        self._children = {}
        self._history = self._next_id if self._rounds else 0  # a fresh id: the loaded rounds may be any sequence
        self._next_id += 1

    def __repr__(self) -> str:
        return (
            f"ShuffleAccountant(target_delta={self._target_delta!r}, family={self._family!r}, "
            f"comparison_families={self._comparison!r}, rounds={len(self._rounds)})"
        )

