"""Exact privacy accounting of one shuffle round via clone pairs.

Clone reduction (Feldman, McMillan & Talwar, FOCS'21, Thm 3.1; "stronger clones", SODA'23): for any
eps0-LDP randomizer and n users, the shuffled output on neighbouring data sets is a post-processing of
one of two distributions ``P, Q`` on pairs ``(C, X)``:

    C ~ Bin(n - 1, q),   A | C ~ Bin(C, 1/2),   X = A + D,   w = 1 / (e^eps0 + 1),
    D ~ Bern(1 - w) under P,   D ~ Bern(w) under Q.

* ``variant="stronger"`` (default): ``q = 2 / (e^eps0 + 1)`` (FMT SODA'23; the pair of Wang, Su, Ye,
  Shokri & Su, NeurIPS'23, seed 003, App. C: ``P = (1-w) P0 + w Q0`` with ``P0 = (A+1, C-A)``).
* ``variant="focs"``: ``q = e^-eps0`` with ``Delta ~ Bern(e^eps0/(e^eps0+1))``, ``P = (A + Delta,
  C - A + 1 - Delta)``, ``Q = (A + 1 - Delta, C - A + Delta)`` (FMT FOCS'21 Thm 3.1; Chen, Cao, Ge, "Renyi DP
  in the shuffle model: enhanced amplification bounds", ICASSP 2024, seed 000, Prop. 1. Seed 000's Thm 1 writes
  ``Bern(p)``, which is wrong). Its first coordinate is ``X = A + Delta`` under P and ``A + 1 - Delta`` under Q,
  which is the common form above with ``1 - w = e^eps0/(e^eps0+1)``.

Given ``C = c`` (write ``m = c + 1``), ``P(x | c) = Bin(x; m, 1/2) * 2((1-w)x + w(m-x)) / m`` and
``Q(x | c) = Bin(x; m, 1/2) * 2(wx + (1-w)(m-x)) / m``, so the likelihood ratio
``((1-w)x + w(m-x)) / (wx + (1-w)(m-x))`` is increasing in ``x`` and at most ``e^eps0``. Hence, for each
``c``, ``sum_x [P - e^eps Q]_+`` is a pair of binomial tails of ``A ~ Bin(c, 1/2)`` with
``S(k) = P(A >= k)``:  ``alpha S(t-1) - beta S(t)`` with ``alpha = (1-w) - e^eps w``,
``beta = e^eps (1-w) - w`` and ``t`` the smallest ``x`` with ratio ``> e^eps``.

Both pairs are symmetric: ``x -> m - x`` maps ``P(. | c)`` onto ``Q(. | c)``, so the hockey-stick
divergence, the Renyi divergence and the privacy loss distribution are the same in both directions
(one direction is computed; the tests compute both and check that they agree).

Monotonicity used for rigorous truncation: the pair with ``c + 1`` clones is a post-processing of the pair
with ``c`` clones (add a fresh ``Bern(1/2)`` clone to ``A``), so every divergence is non-increasing in
``c``. Masses of ``C`` and ``X`` come from Loader's saddle-point form of the binomial mass (accurate to
~1e-12 at n = 1e9; plain log-gamma differences are off by ~1e-9 at n = 1e6) on a window around the mode
(log-mass at least ``max - drop``), normalised to ``1 - (tail masses)`` with the tails from the
incomplete beta function (``scipy.stats.binom.cdf/sf``, ``scipy.special.bdtr/bdtrc``), never ``1 - sum``.

Privacy loss distribution (:func:`clone_pld`): the exact losses ``log(P/Q)`` on the windows, with the
truncated mass sent to infinity (pessimistic) and blocks of ``c`` replaced by their lowest ``c``
(a dominating pair), rounded up onto a grid whose interval :func:`suggested_interval` scales with the
loss's mean and standard deviation and the number of rounds. The optimistic PLD mirrors every step (a
dominated pair, rounded down, truncated mass dropped) and gives a lower bound *on the clone pair's epsilon*, which
brackets the discretisation error; it is not a lower bound on the shuffled mechanism's epsilon (the clone pair
only bounds that from above; family ``"rr-lower"`` of ``shuffledp.accounting.bounds`` is a lower bound on the
mechanism).

The implementation is split by concern: :mod:`shuffledp.accounting.clone_pair` (the pairs, the constants, the
exact single-round delta and epsilon), :mod:`shuffledp.accounting.clone_renyi` (Renyi divergence) and
:mod:`shuffledp.accounting.clone_pld` (privacy loss distributions and their composition); the binomial masses
and tails are in :mod:`shuffledp.accounting.binomial`. This module gathers their public names.
"""

from __future__ import annotations

from shuffledp.accounting import clone_pld as _clone_pld_module
from shuffledp.accounting import clone_renyi as _clone_renyi_module
from shuffledp.accounting.clone_pair import (
    EPSILON_RTOL,
    EXACT_WINDOW_DROP,
    INTERVAL_RELATIVE_ERROR,
    MAX_COMPOSED_GRID,
    MAX_EPS0,
    MAX_N,
    MIN_COMPOSED_GRID,
    PLD_BLOCK_RELATIVE_WIDTH,
    PLD_TAIL_MASS_TRUNCATION,
    PLD_WINDOW_DROP,
    RENYI_MAX_ORDER,
    RENYI_WINDOW_DROP,
    VARIANTS,
    Variant,
    _epsilon_exact,
    clone_delta,
    clone_epsilon,
)
from shuffledp.accounting.clone_pld import (
    clone_epsilon_baseline,
    clone_epsilon_composed,
    clone_loss_moments,
    clone_pld,
    round_interval,
    suggested_interval,
)
from shuffledp.accounting.clone_renyi import clone_renyi

__all__ = [
    "Variant",
    "VARIANTS",
    "clone_delta",
    "clone_epsilon",
    "clone_renyi",
    "clone_pld",
    "clone_epsilon_composed",
    "suggested_interval",
    "round_interval",
    "clone_loss_moments",
    "clone_epsilon_baseline",
    "clear_caches",
    "EPSILON_RTOL",
    "EXACT_WINDOW_DROP",
    "INTERVAL_RELATIVE_ERROR",
    "MAX_COMPOSED_GRID",
    "MAX_EPS0",
    "MAX_N",
    "MIN_COMPOSED_GRID",
    "PLD_BLOCK_RELATIVE_WIDTH",
    "PLD_TAIL_MASS_TRUNCATION",
    "PLD_WINDOW_DROP",
    "RENYI_MAX_ORDER",
    "RENYI_WINDOW_DROP",
]


def clear_caches() -> None:
    """Empty the memoisation caches (PLDs, loss supports, exact inversions, Renyi values)."""
    for cached in (
        _clone_pld_module._loss_support,
        _clone_pld_module._clone_pld_cached,
        _epsilon_exact,
        _clone_renyi_module._renyi_cached,
    ):
        cached.cache_clear()
