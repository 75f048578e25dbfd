"""Round-by-round composition of the clone pair's privacy loss distribution (the accountant's default path).

:class:`ComposedClones` holds the composed pessimistic PLD of the rounds so far and composes a new round into it,
so a charge costs the same at round 1,000 as at round 1 (one FFT convolution of the composed PMF with the round's
PMF, and one epsilon query), instead of recomposing the whole history.

* One round's PMF comes from :func:`shuffledp.accounting.clone_blocks.round_pld`: cached conditional PLDs of blocks
  of clone counts, each block at its LOWEST count (fewer clones = weaker amplification, so grouping nearby n or c is
  pessimistic), discretised by the mean-preserving spread (:mod:`shuffledp.accounting.pld_spread`; pessimistic for
  every composition, second order in the grid interval).
* The grid interval is set by the first round (a power of 2, at least ``INCREMENTAL_STEPS_PER_SD`` points per
  standard deviation of its loss). A later round whose loss is much narrower refines the grid (exact: every point
  keeps its loss) while the composed PMF stays below ``MAX_COMPOSED_GRID / 2`` points; a composed PMF above
  ``MAX_COMPOSED_GRID`` points, or a round whose losses (in ``[-eps0, eps0]``) would need more than half that, makes
  the grid coarser by 2 (the same spread, pessimistic).
* Each composition step cuts at most ``INCREMENTAL_TAIL_MASS`` from the tails, pessimistically (the top goes to
  infinite loss), so after T rounds at most ``T * INCREMENTAL_TAIL_MASS`` is added to every delta.
* Canonical form: consecutive equal rounds form a run, composed as one FFT power (:func:`shuffledp.accounting.pld.
  _self_compose_dense`); the state is a function of the sequence of rounds alone (not of how compose calls grouped
  them), so replaying a checkpoint's round list rebuilds it bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dp_accounting.pld import pld_pmf

from shuffledp.accounting import clone_blocks
from shuffledp.accounting import pld as _pld
from shuffledp.accounting import pld_spread as ps
from shuffledp.accounting.clone_pair import MAX_COMPOSED_GRID, _params

__all__ = [
    "ComposedClones",
    "fold",
    "INCREMENTAL_STEPS_PER_SD",
    "INCREMENTAL_MIN_STEPS_PER_SD",
    "INCREMENTAL_TAIL_MASS",
    "loss_sd_estimate",
]

#: Grid points per (estimated) standard deviation of the first round's loss (excess about 1/(8 K^2) per round).
INCREMENTAL_STEPS_PER_SD = 24.0
#: A round with fewer grid points per standard deviation than this refines the grid (when it fits).
INCREMENTAL_MIN_STEPS_PER_SD = 8.0
#: Mass each composition step may cut from the tails (the top part goes to infinite loss).
INCREMENTAL_TAIL_MASS = 1e-15


def loss_sd_estimate(eps0: float, n: int, variant: str) -> float:
    """A cheap estimate of the standard deviation of one round's privacy loss, to size the grid only.

    Given ``m = C + 1`` the loss is about ``4 (1 - 2w)(X - m/2) / m`` with ``sd(X) ~ sqrt(m)/2``:
    ``2 (1 - 2w) / sqrt(E[C] + 1)``, at most ``eps0`` (the loss lies in ``[-eps0, eps0]``).

    Args:
        eps0: local privacy parameter.
        n: reports in the round.
        variant: the clone pair.

    Returns:
        The estimate.
    """
    w, log_q, _ = _params(eps0, variant)
    return min(eps0, 2.0 * math.tanh(eps0 / 2.0) / math.sqrt((n - 1) * math.exp(log_q) + 1.0))


def _power(dense: ps.Dense, h: float, times: int) -> ps.Dense:
    if times == 1:
        return dense
    pmf = pld_pmf.DensePLDPmf(h, dense[0], dense[1], dense[2], True)
    out = _pld._self_compose_dense(pmf, times, INCREMENTAL_TAIL_MASS)  # pylint: disable=protected-access
    # pylint: disable=protected-access
    return int(out._lower_loss), out._probs, float(out._infinity_mass)


@dataclass(frozen=True)
class ComposedClones:
    """The composed PLD of a sequence of rounds (immutable: :meth:`extended` returns a new one).

    Attributes:
        variant: the clone pair (``"stronger"`` or ``"focs"``).
        h: the grid interval.
        base: the composition of every run before the last one, or None.
        run: ``(n, eps0)`` of the last run, or None when empty.
        run_length: rounds in the last run.
        current: the composition of all rounds, or None when empty.
        rounds: the number of rounds.
    """

    variant: str
    h: float = 0.0
    base: ps.Dense | None = None
    run: tuple[int, float] | None = None
    run_length: int = 0
    current: ps.Dense | None = None
    rounds: int = 0

    def _with_grid(self, n: int, eps0: float) -> ComposedClones:
        """This state on a grid fine enough for a round ``(n, eps0)`` (refined by powers of 2 while it fits)."""
        target = loss_sd_estimate(eps0, n, self.variant) / INCREMENTAL_STEPS_PER_SD
        if self.current is None:  # a power of 2: nearby first rounds (and any refinement) share the grid
            return ComposedClones(self.variant, 2.0 ** math.floor(math.log2(target)))
        state = self
        while (loss_sd_estimate(eps0, n, self.variant) / state.h < INCREMENTAL_MIN_STEPS_PER_SD
               and 2 * state.current[1].size <= MAX_COMPOSED_GRID // 2):
            state = ComposedClones(
                self.variant, state.h / 2.0, None if state.base is None else ps.refine(state.base, 2),
                state.run, state.run_length, ps.refine(state.current, 2), state.rounds)
        return state

    def extended(self, n: int, eps0: float, count: int = 1) -> ComposedClones:
        """These rounds followed by ``count`` rounds of ``n`` reports at ``eps0``.

        Args:
            n: reports in the round (validated by the caller).
            eps0: the round's local privacy parameter.
            count: how many such rounds, >= 1.

        Returns:
            The new composed state.
        """
        if self.run == (n, eps0):
            base, length, state = self.base, self.run_length + count, self
        else:
            state = self._with_grid(n, eps0)
            base, length = state.current, count
        h = state.h
        while 2.0 * eps0 / h > MAX_COMPOSED_GRID // 2:  # one round's losses lie in [-eps0, eps0]
            h, base = 2.0 * h, None if base is None else ps.coarsen(base, h, 2)
        while True:
            one = clone_blocks.round_pld(eps0, n, self.variant, h)
            part = _power(one, h, length)
            current = part if base is None else ps.convolve(base, part, INCREMENTAL_TAIL_MASS)
            if current[1].size <= MAX_COMPOSED_GRID:
                break
            h, base = 2.0 * h, None if base is None else ps.coarsen(base, h, 2)
        return ComposedClones(self.variant, h, base, (n, eps0), length, current, self.rounds + count)

    def delta_pld(self) -> _pld.PrivacyLossDistribution:
        """The composed PLD (symmetric, pessimistic), for the queries of :mod:`shuffledp.accounting.pld`.

        Returns:
            The PLD.
        """
        if self.current is None:
            raise ValueError("no round has been composed")
        return ps.to_pld(self.current, self.h, pessimistic=True)


def fold(rounds: list[tuple[int, float]], variant: str, start: ComposedClones | None = None) -> ComposedClones:
    """Compose ``rounds`` (``(n, eps0)`` pairs, in order) onto ``start`` (default: nothing composed yet), one
    maximal run of equal rounds at a time (the canonical form, so the result depends on the rounds alone).

    Args:
        rounds: the rounds to add, in order.
        variant: the clone pair (``"stronger"`` or ``"focs"``).
        start: the composed state they follow.

    Returns:
        The composed state.
    """
    state = ComposedClones(variant) if start is None else start
    i = 0
    while i < len(rounds):
        j = i
        while j < len(rounds) and rounds[j] == rounds[i]:
            j += 1
        state = state.extended(rounds[i][0], rounds[i][1], j - i)
        i = j
    return state
