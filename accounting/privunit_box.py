"""PrivUnit2's split of eps0 as a function of eps0 alone, and the d-free likelihood-ratio box it gives.

PrivUnit2 (Bhowmick, Duchi, Freudiger, Kapoor, Rogers, "Protection against reconstruction and its applications in
private federated learning", arXiv:1812.00984, 2018, Algorithm 1 and Theorem 1) outputs a point of the unit
sphere of R^d: with probability ``p`` uniform on a cap of mass ``A`` around the (sign-rounded) input direction,
else uniform on the rest. Against the uniform law on the sphere its density is ``hi = p / A`` on the cap and
``lo = (1 - p) / (1 - A)`` off it, and eps0 is split as ``eps_p + eps_cap`` with ``eps_p = log(p / (1 - p))`` and
``eps_cap = log((1 - A) / A)``. (The sampler draws float directions from a data-independent proposal law Q and
accepts by a float cap test; "uniform" is Q and ``A`` is ``Q(cap)``, which the clients bound below by ``A_low``,
docs/mechanisms.md. The densities only decrease on the cap and increase off it as ``A`` grows, so both ends of the
box below hold at ``A = A_low``.)

The split. :func:`privunit_split` fixes ``eps_cap = 2 eps0 / 3`` (at most :data:`EPS_CAP_MAX`) and ``eps_p = eps0 -
eps_cap`` for every d. A client (:func:`shuffledp.clients.privunit.privunit_params`) then draws its region coin with
a float ``p <= e^eps_p / (1 + e^eps_p)`` and picks its cap so that the mass it counts, ``A_low`` (``A`` less the
client's float margin), is at least ``1 / (1 + e^eps_cap)``. Whatever d:

    lo >= (1 - p) / (1 - 1/(1 + e^eps_cap)) >= L(eps0) = (1 + e^-eps_cap) / (1 + e^eps_p),
    hi <= p (1 + e^eps_cap) <= H(eps0) = e^eps_p (1 + e^eps_cap) / (1 + e^eps_p) = e^(eps_p + eps_cap) L(eps0),

and ``eps_p + eps_cap <= eps0``. So every report's likelihood ratio against the uniform law lies in the box
``[L, e^eps0 L]``, which depends on eps0 only: the box a privacy-blanket family needs (Balle, Bell, Gascon,
Nissim, "The privacy blanket of the shuffle model", CRYPTO 2019: with probability ``L`` a report is a draw from the
uniform law, whatever its input). ``L`` decreases and ``H`` increases with eps0 (``eps_p`` increases, ``eps_cap``
does not decrease), so the box of a smaller eps0 lies inside that of a larger one.

:func:`privunit_blanket_box` returns that box widened by :data:`BOX_SLACK` (relative), so that the rounding of its
own float evaluation cannot put it inside the true ``[L, H]``.

This module imports only the standard library and :mod:`shuffledp.accounting.validation`.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

from shuffledp.accounting.validation import check_eps0, check_real

__all__ = [
    "PRIVUNIT_MIN_EPS0",
    "PRIVUNIT_MAX_EPS0",
    "EPS_CAP_MAX",
    "CAP_SHARE",
    "BOX_SLACK",
    "privunit_split",
    "privunit_blanket_box",
]

#: The share of eps0 given to the cap, ``eps_cap = CAP_SHARE * eps0`` (below :data:`EPS_CAP_MAX`). Against the
#: best of 255 splits chosen per d, it loses at most 0.4% of PrivUnit2's decode factor m (the variance is
#: ``C^2 / m^2``) for d >= 10 and eps0 in [1, 6], about 1% at eps0 in [8, 10] (tests/clients/test_privunit_box.py
#: compares the two).
CAP_SHARE = 2.0 / 3.0
#: The largest ``eps_cap`` (reached at eps0 = 10.35): the cap then holds ``1 / (1 + e^6.9) = 1.0068e-3`` of the
#: sphere, so the clients' cap, that divided by ``1 - 2^-10`` (their margin), stays above their smallest cap mass
#: 2^-10 = 9.766e-4 (a rejection sampler draws about ``1 / A`` directions per report); a split searched per d took
#: the same cap at large eps0.
EPS_CAP_MAX = 6.9
#: The smallest eps0 accepted. There ``eps_cap = 0.004`` and the cap holds ``1 / (1 + e^0.004) = 0.49900`` of the
#: sphere, a relative 2^-9 below a hemisphere: room for the clients' cap margin (2^-10). Below about eps0 = 0.003
#: no cap of mass < 1/2 is left once that margin is counted; at 0.006 PrivUnit2's variance already exceeds
#: 6 10^5 C^2 in every dimension.
PRIVUNIT_MIN_EPS0 = 0.006
#: The largest eps0 accepted: the L2 mechanisms' limit (:data:`shuffledp.clients.coins.RR_MAX_EPS0`). A float64
#: below 1 has log-odds at most 36.74, so a client's coin, rounded down, spends a little less than ``eps_p`` near
#: that and at most 36.74 above it (at eps0 = 64 PrivUnit2 spends 43.6 in all): the box is pessimistic there, and
#: still valid (a smaller ``p`` only raises ``lo`` and lowers ``hi``).
PRIVUNIT_MAX_EPS0 = 64.0
#: The relative widening of the box on each side: ``lo`` is ``L (1 - BOX_SLACK)`` and ``log_ratio`` is ``eps0 +
#: 2 BOX_SLACK``, so the box's top ``lo e^log_ratio`` is at least ``H (1 + BOX_SLACK / 2)``. The float evaluation of
#: ``L`` (two ``exp``, two ``log1p``, one ``exp`` back) errs by a relative few 1e-16, and so does a client's float
#: check that its box is inside (:func:`shuffledp.clients.privunit.privunit_params`); 1e-9 leaves six orders of
#: magnitude, and costs a blanket family nothing measurable.
BOX_SLACK = 1e-9

_ALLOWED = f"a finite real number in [{PRIVUNIT_MIN_EPS0:g}, {PRIVUNIT_MAX_EPS0:g}] (privunit2's range)"


def _check(eps0: Any) -> float:
    eps = check_real("eps0", eps0, _ALLOWED)
    if not (math.isfinite(eps) and eps <= PRIVUNIT_MAX_EPS0):
        raise ValueError(f"eps0 must be {_ALLOWED}, got {eps0!r}")
    if not eps >= PRIVUNIT_MIN_EPS0:
        raise ValueError(f"eps0 must be {_ALLOWED}, got {eps0!r}: below {PRIVUNIT_MIN_EPS0:g} PrivUnit2's cap would "
                         f"hold more than 0.499 of the sphere, and below about 0.003 no cap of mass < 1/2 fits the "
                         f"clients' margin")
    return eps


def privunit_split(eps0: float) -> tuple[float, float]:
    """PrivUnit2's split of ``eps0`` into the coin's and the cap's share, the same for every dimension (module
    docstring; Bhowmick, Duchi, Freudiger, Kapoor, Rogers 2018, Theorem 1).

    Args:
        eps0: the local epsilon, in [:data:`PRIVUNIT_MIN_EPS0`, :data:`PRIVUNIT_MAX_EPS0`].

    Returns:
        ``(eps_p, eps_cap)`` with ``eps_cap = min(CAP_SHARE * eps0, EPS_CAP_MAX)`` and ``eps_p`` the float
        ``eps0 - eps_cap`` rounded down if needed, so that ``eps_p + eps_cap <= eps0`` holds for the real values of
        the two floats. ``1 / (1 + e^eps_cap)``, the cap mass a client must count, lies in
        ``[1 / (1 + e^EPS_CAP_MAX), (1 - 2^-9) / 2]``.

    Raises:
        TypeError: ``eps0`` is not a real number. ValueError: it is outside the range above (the message says
            why a smaller one is refused).
    """
    return _split(_check(eps0))


def _split(eps: float) -> tuple[float, float]:
    """:func:`privunit_split` without the clients' range check (``eps`` a float > 0)."""
    eps_cap = min(CAP_SHARE * eps, EPS_CAP_MAX)
    eps_p = eps - eps_cap
    while Fraction(eps_p) + Fraction(eps_cap) > Fraction(eps):  # at most one step: the difference errs by 1/2 ulp
        eps_p = math.nextafter(eps_p, 0.0)
    return eps_p, eps_cap


def privunit_blanket_box(eps0: float) -> tuple[float, float]:
    """The box ``[lo, lo e^log_ratio]`` holding every PrivUnit2 report's likelihood ratio against the uniform law
    on the sphere, for every dimension, at the split of :func:`privunit_split` (module docstring; Bhowmick et al.
    2018 for the densities, Balle, Bell, Gascon, Nissim, CRYPTO 2019 for the blanket they give).

    The box is defined on the accounting's whole range of eps0, wider than the range the clients accept
    (:data:`PRIVUNIT_MIN_EPS0`, :data:`PRIVUNIT_MAX_EPS0`): a calibration searches eps0 from 0.001, and no client
    ever reports at an eps0 outside its range, so the values there bound nothing that exists but stay correct for
    the split's formula.

    Args:
        eps0: the local epsilon, in (0, ``EPS0_MAX``] (the accounting's range).

    Returns:
        ``(lo, log_ratio)``: ``lo = L(eps0) (1 - BOX_SLACK)`` with ``L = (1 + e^-eps_cap) / (1 + e^eps_p)``, the
        blanket mass (in (0, 1)), and ``log_ratio = eps0 + 2 BOX_SLACK``. ``lo`` does not increase and
        ``lo e^log_ratio`` does not decrease as eps0 grows.

    Raises:
        TypeError, ValueError: ``eps0`` not a real number in (0, ``EPS0_MAX``].
    """
    eps = check_eps0(eps0)
    eps_p, eps_cap = _split(eps)
    # log L = log(1 + e^-eps_cap) - log(1 + e^eps_p), the second as eps_p + log(1 + e^-eps_p) (no overflow)
    log_l = math.log1p(math.exp(-eps_cap)) - eps_p - math.log1p(math.exp(-eps_p))
    return math.exp(log_l) * (1.0 - BOX_SLACK), eps + 2.0 * BOX_SLACK
