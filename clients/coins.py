"""Exact coins for the L2 mechanisms: a Bernoulli(p) drawn exactly for a float p, and the randomized-response
interval of eps0 rounded so that its ratio bound provably holds for the floats used.

Why exact. A mechanism whose data enter only through one coin is eps0-LDP when the coin's probability lies in
``[p_lo, p_hi]`` with ``p_hi / p_lo <= e^eps0`` and ``(1 - p_lo) / (1 - p_hi) <= e^eps0`` (Warner, JASA 1965;
Kairouz, Oh, Viswanath, ICML 2014). Both must hold for the probabilities the coin is actually drawn with, not
for their real-number ideals:

* :func:`rr_interval` returns floats ``p_lo >= 1 / (e^eps0 + 1)`` and ``p_hi <= e^eps0 / (e^eps0 + 1)``, certified
  with exact rational arithmetic on the floats against a correctly rounded 60-digit ``e^eps0`` (Python's
  :mod:`decimal` rounds ``exp`` correctly), so both ratios are at most ``e^eps0`` exactly;
* :func:`bernoulli` draws ``P[1] = p`` exactly for a float ``p``: a float is a dyadic rational ``n / 2**k``, and
  a uniform ``k``-bit integer ``r`` from the CSPRNG satisfies ``P[r < n] = n / 2**k`` with no rounding anywhere;
* :func:`bernoulli_words` draws a batch of such coins from given uniform words, the same comparison written for
  ``W`` 64-bit words per coin (``W`` fixed by the smallest probability the mechanism can use, so every coin of a
  batch takes the same number of keystream bytes, whatever the data).
"""

from __future__ import annotations

import math
from decimal import Decimal, localcontext
from fractions import Fraction

import numpy as np

from shuffledp.clients.noise import ChaCha20Rng
from shuffledp.clients.validation import check_positive_finite

__all__ = ["RR_MAX_EPS0", "rr_interval", "rr_epsilon", "bernoulli", "coin_words", "bernoulli_words", "exp_lower",
           "check_l2_parameters"]

#: The largest eps0 the L2 mechanisms accept (their flip probability 1 / (e^eps0 + 1) stays above 2**-93).
RR_MAX_EPS0 = 64.0
_EXP_DIGITS = 60


def check_l2_parameters(eps0: float, clip_l2: float, mechanism: str) -> tuple[float, float]:
    """Validate an L2 mechanism's pinned parameters; returns ``(eps0, clip_l2)`` as floats.

    Raises:
        TypeError, ValueError: ``eps0`` is not a finite number in (0, :data:`RR_MAX_EPS0`] or ``clip_l2`` not a
            finite number > 0 (the message names ``mechanism``).
    """
    eps = check_positive_finite("eps0", eps0)
    if eps > RR_MAX_EPS0:
        raise ValueError(f"eps0 must be <= {RR_MAX_EPS0} for the {mechanism} mechanism, got {eps0!r}")
    return eps, check_positive_finite("clip_l2", clip_l2)


def exp_lower(x: float) -> Fraction:
    """A rational lower bound on ``e^x`` for a float ``x`` in ``[0, 709]``, within a relative ``10**-57``.

    Returns:
        ``E * (1 - 10**-58)`` where ``E`` is ``e^x`` correctly rounded to 60 significant digits (so ``E`` is within
        a relative ``10**-59`` of ``e^x``, and the result is below it).
    """
    if not (isinstance(x, float) and 0.0 <= x <= 709.0):
        raise ValueError(f"exp_lower needs a float in [0, 709], got {x!r}")
    with localcontext() as ctx:
        ctx.prec = _EXP_DIGITS
        e = Decimal(x).exp()  # Decimal(float) is exact; exp is correctly rounded at this precision
    return Fraction(e) * (1 - Fraction(1, 10**58))


def _float_at_least(q: Fraction) -> float:
    f = float(q)
    while Fraction(f) < q:
        f = math.nextafter(f, math.inf)
    return f


def _float_at_most(q: Fraction) -> float:
    f = float(q)
    while Fraction(f) > q:
        f = math.nextafter(f, -math.inf)
    return f


def rr_interval(eps0: float) -> tuple[float, float]:
    """The randomized-response interval of ``eps0`` as floats whose ratios provably stay within ``e^eps0``
    (Warner, "Randomized response", JASA 1965).

    Args:
        eps0: the local epsilon, in (0, :data:`RR_MAX_EPS0`].

    Returns:
        ``(p_lo, p_hi)``: the smallest float ``>= 1 / (E + 1)`` and the largest float ``<= E / (E + 1)`` for a
        certified lower bound ``E <= e^eps0`` (:func:`exp_lower`). Then ``p_hi / p_lo <= E`` and
        ``(1 - p_lo) / (1 - p_hi) <= E`` hold exactly for the two floats (checked here in rationals).

    Raises:
        TypeError, ValueError: ``eps0`` is not a finite number in (0, 64].
    """
    eps = check_positive_finite("eps0", eps0)
    if eps > RR_MAX_EPS0:
        raise ValueError(f"eps0 must be <= {RR_MAX_EPS0} for the L2 mechanisms, got {eps0!r}")
    e_lo = exp_lower(eps)
    p_lo = _float_at_least(1 / (e_lo + 1))
    p_hi = _float_at_most(e_lo / (e_lo + 1))
    lo, hi = Fraction(p_lo), Fraction(p_hi)
    if not (0 < lo < Fraction(1, 2) < hi < 1 and hi <= e_lo * lo and 1 - lo <= e_lo * (1 - hi)):
        raise ArithmeticError(f"the randomized-response interval for eps0={eps!r} failed its exact check")
    return p_lo, p_hi


def rr_epsilon(p_lo: float, p_hi: float) -> float:
    """The privacy loss of a coin whose probability lies in ``[p_lo, p_hi]``.

    Returns:
        ``max(log(p_hi / p_lo), log((1 - p_lo) / (1 - p_hi)))`` (float; informational: the guarantee is the
        exact check of :func:`rr_interval`).
    """
    return max(math.log(p_hi) - math.log(p_lo), math.log1p(-p_lo) - math.log1p(-p_hi))


def bernoulli(p: float, rng: ChaCha20Rng) -> bool:
    """One coin with ``P[True] = p`` exactly (relative to the CSPRNG), for a float ``p`` in ``[0, 1]``.

    ``p = n / 2**k`` exactly (a float is a dyadic rational); ``r`` is a uniform ``k``-bit integer from ``rng``, and
    ``r < n`` has probability ``n / 2**k = p``. This is the lazy comparison of uniform bits with ``p``'s binary
    expansion, carried to the expansion's last bit at once (Knuth and Yao, 1976).

    Returns:
        True with probability exactly ``p``.

    Raises:
        ValueError: ``p`` is not a float in ``[0, 1]``.
    """
    if not isinstance(p, float) or not 0.0 <= p <= 1.0:
        raise ValueError(f"a coin's probability must be a float in [0, 1], got {p!r}")
    n, den = Fraction(p).as_integer_ratio()
    k = den.bit_length() - 1  # den = 2**k
    if k == 0:
        return n == 1
    return rng.getrandbits(k) < n


def coin_words(p_min: float) -> int:
    """The 64-bit words an exact coin needs for every float probability in ``[p_min, 1]``.

    A float ``p >= p_min > 0`` is ``n / 2**k`` with ``k <= 53 - e`` where ``p_min = m 2**e``, ``m`` in [1/2, 1).

    Returns:
        ``max(1, ceil((53 - e) / 64))`` (1 for ``p_min >= 2**-12``; 3 for the smallest ``p_lo`` of eps0 = 64).

    Raises:
        ValueError: ``p_min`` is not a float in (0, 1].
    """
    if not isinstance(p_min, float) or not 0.0 < p_min <= 1.0:
        raise ValueError(f"the smallest coin probability must be a float in (0, 1], got {p_min!r}")
    _, e = math.frexp(p_min)
    return max(1, -(-(53 - e) // 64))


def bernoulli_words(p: np.ndarray, words: np.ndarray) -> np.ndarray:
    """A batch of coins with ``P[True] = p_i`` exactly, coin i decided by the uniform words ``words[i]``.

    Coin i compares the ``64 W``-bit integer ``R`` whose big-endian words are ``words[i]`` with
    ``N = p_i 2**(64 W)``, an integer whenever ``p_i = n / 2**k`` with ``k <= 64 W`` (:func:`coin_words`):
    ``P[R < N] = N / 2**(64 W) = p_i`` exactly. It is :func:`bernoulli`'s comparison: ``R < n 2**(64 W - k)``
    holds iff the top ``k`` bits of ``R`` are ``< n`` (Knuth and Yao, 1976). The words of ``N`` are
    ``floor(p 2**(64 j)) mod 2**64``, exact in float64 (a power-of-two scaling, a floor and an ``fmod`` of
    integers below 2**1024 are exact). ``p_i = 1`` is True whatever the words.

    Args:
        p: float64 ``(k,)`` probabilities in [0, 1], each a float with ``k <= 64 W`` (the caller's bound).
        words: uint64 ``(k, W)`` uniform words from the CSPRNG (most significant first).

    Returns:
        bool ``(k,)``.

    Raises:
        ValueError: a probability outside [0, 1], or one that needs more than ``W`` words.
    """
    prob = np.asarray(p, dtype=np.float64)
    w = np.asarray(words, dtype=np.uint64)
    if w.ndim != 2 or prob.ndim != 1 or w.shape[0] != prob.shape[0]:
        raise ValueError(f"need p of shape (k,) and words of shape (k, W), got {prob.shape} and {w.shape}")
    if not ((prob >= 0.0) & (prob <= 1.0)).all():
        raise ValueError("a coin's probability must be a float in [0, 1]")
    width = w.shape[1]
    one = prob == 1.0
    frac = np.where(one, 0.0, prob)
    scaled = np.ldexp(frac, 64 * width)
    if (scaled != np.floor(scaled)).any():
        raise ValueError(f"a probability needs more than {width} words of 64 bits")
    # word j of N = floor(p 2**(64 (j + 1))) mod 2**64 (exact); the coin is settled at the first unequal word
    word = np.floor(np.ldexp(frac, 64)).astype(np.uint64)  # < 2**64: p < 1 here
    out = one | (w[:, 0] < word)
    decided = one | (w[:, 0] != word)
    for j in range(1, width):
        word = np.fmod(np.floor(np.ldexp(frac, 64 * (j + 1))), 2.0**64).astype(np.uint64)
        out |= ~decided & (w[:, j] < word)
        decided |= w[:, j] != word
    return out
